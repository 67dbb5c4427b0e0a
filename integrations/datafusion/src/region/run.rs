//! One partition of a device region, run: a load thread (the child's batches,
//! coalesced, uploaded ahead), an operator thread (the operators on each frame, then the
//! download), and a stream that takes the finished host batches off a channel.
//!
//! Nothing here blocks a tokio worker: every wait for a device slot and every host wait
//! for the device (an upload's staging, an aggregate's read-back, a download) happens on
//! the partition's two threads. A thread holds a device slot only while it works on the
//! device (one upload; one batch's operators and download), never while it waits for its
//! input: a region whose input is another region (through a join or a sort) cannot take
//! every slot and leave its input none. Dropping the stream raises a flag and drops the
//! channel; the threads see it at their next step and end on their own, freeing the
//! partition's device memory and its memory reservation. No drop joins a thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryPool, MemoryReservation};
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream, TaskContext};
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, MetricBuilder, Time,
};
use datafusion::physical_plan::ExecutionPlan;
use devarrow::bridge::DeviceBatch;
use futures::{Stream, StreamExt, TryStreamExt};
use tokio::sync::mpsc;

use crate::config::{DevarrowConfig, DeviceLease, DevicePool, PartitionTicket};
use crate::error::{BoxError, DeviceExecError};
use crate::frame::DeviceFrame;
use crate::step::ExecDevice;

use crate::frame::batch_bytes;

use super::coalesce::coalesce;
use super::{chain, BindContext, DeviceOperator, DeviceOperatorExec, OperatorContext, RegionBatch};

/// Grows a partition's `reservation` by `bytes`, or the partition's typed memory error.
fn reserve(
    reservation: &MemoryReservation,
    bytes: usize,
    partition: usize,
    pool: &DevicePool,
) -> Result<()> {
    reservation.try_grow(bytes).map_err(|e| {
        DataFusionError::External(Box::new(DeviceExecError::Memory {
            partition,
            device: pool.id().to_string(),
            bytes,
            reason: e.to_string(),
        }))
    })
}

/// The load's metrics of one partition.
#[derive(Clone)]
struct LoadMetrics {
    bytes_to_device: Count,
    input_batches: Count,
    uploaded_batches: Count,
    load_time: Time,
}

impl LoadMetrics {
    fn new(metrics: &ExecutionPlanMetricsSet, partition: usize) -> Self {
        Self {
            bytes_to_device: MetricBuilder::new(metrics).counter("bytes_to_device", partition),
            input_batches: MetricBuilder::new(metrics).counter("input_batches", partition),
            uploaded_batches: MetricBuilder::new(metrics).counter("uploaded_batches", partition),
            load_time: MetricBuilder::new(metrics).subset_time("load_time", partition),
        }
    }
}

/// The region's output metrics of one partition (on the unload, or the node executed).
#[derive(Clone)]
struct UnloadMetrics {
    baseline: BaselineMetrics,
    bytes_from_device: Count,
    unload_time: Time,
    load_wait: Time,
    slot_wait: Time,
    compacted_batches: Count,
    pageable_downloads: Count,
}

impl UnloadMetrics {
    fn new(metrics: &ExecutionPlanMetricsSet, partition: usize) -> Self {
        Self {
            baseline: BaselineMetrics::new(metrics, partition),
            bytes_from_device: MetricBuilder::new(metrics).counter("bytes_from_device", partition),
            unload_time: MetricBuilder::new(metrics).subset_time("unload_time", partition),
            load_wait: MetricBuilder::new(metrics).subset_time("load_wait", partition),
            slot_wait: MetricBuilder::new(metrics).subset_time("slot_wait", partition),
            compacted_batches: MetricBuilder::new(metrics).counter("compacted_batches", partition),
            pageable_downloads: MetricBuilder::new(metrics)
                .counter("pageable_downloads", partition),
        }
    }
}

/// The batches of a host child every partition of a query reads, read once.
type SharedCell = OnceLock<std::result::Result<Arc<Vec<RecordBatch>>, Arc<DataFusionError>>>;

/// A query's partitions' handle on a [`SharedCell`].
type SharedInput = Arc<SharedCell>;

/// The host inputs an operator node's partitions share (a collected build side), one
/// per child and query (task context). The node holds a query's cell until each of the
/// query's partitions has taken it (however far apart they start: a partition that
/// starts after another has ended still shares its batches, and what the operator keeps
/// with them, such as a join's matched build rows), or until the query's context goes;
/// then the batches go when the partitions do.
#[derive(Debug, Default)]
pub(crate) struct SharedInputs {
    slots: Mutex<Vec<SharedSlot>>,
}

#[derive(Debug)]
struct SharedSlot {
    child: usize,
    context: Weak<TaskContext>,
    input: SharedInput,
    /// The query's partitions yet to take it.
    takers: usize,
}

impl SharedInputs {
    /// The shared batches of host child `child` for the query of `context`, one of its
    /// `partitions` partitions taking them (the same cell for every partition of that
    /// query; filled by the first that reads it).
    fn get(&self, child: usize, context: &Arc<TaskContext>, partitions: usize) -> SharedInput {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots.retain(|s| s.context.strong_count() > 0);
        let found = slots.iter().position(|s| {
            s.child == child
                && s.context
                    .upgrade()
                    .is_some_and(|c| Arc::ptr_eq(&c, context))
        });
        if let Some(at) = found {
            let slot = &mut slots[at];
            let input = slot.input.clone();
            slot.takers = slot.takers.saturating_sub(1);
            if slot.takers == 0 {
                slots.swap_remove(at);
            }
            return input;
        }
        let input = SharedInput::default();
        if partitions > 1 {
            slots.push(SharedSlot {
                child,
                context: Arc::downgrade(context),
                input: input.clone(),
                takers: partitions - 1,
            });
        }
        input
    }
}

/// A host child of an operator (a join's build side), read when the partition starts.
enum HostInput {
    /// The partition's own stream of it.
    Stream(SendableRecordBatchStream),
    /// Its batches, shared by the query's partitions: the first to need them reads
    /// `partition` of `plan`, the others wait for them (on their own threads).
    Shared {
        batches: SharedInput,
        plan: Arc<dyn ExecutionPlan>,
        partition: usize,
        context: Arc<TaskContext>,
    },
}

/// What the load thread hands the operator thread: an uploaded batch, the bytes
/// reserved for it, and the slot whose stream it was uploaded on.
type Uploaded = std::result::Result<(DeviceBatch, usize, usize), DataFusionError>;

/// The slot a partition asks for first: its own where partitions are no more than
/// slots, so that its load and its operators use one stream (see
/// [`DevicePool::lease_preferring`]).
fn home_slot(pool: &DevicePool, partition: usize) -> usize {
    partition % pool.slots()
}

/// Everything a partition's threads need, gathered before its device slot is granted.
struct Pending {
    pool: Arc<DevicePool>,
    ticket: PartitionTicket,
    child: SendableRecordBatchStream,
    ops: Vec<Arc<DeviceOperatorExec>>,
    /// Per operator, its host children (a join's build side).
    host_inputs: Vec<Vec<HostInput>>,
    config: DevarrowConfig,
    reservation: Arc<MemoryReservation>,
    memory_pool: Arc<dyn MemoryPool>,
    load_metrics: LoadMetrics,
    unload_metrics: UnloadMetrics,
    runtime: Option<tokio::runtime::Handle>,
    partition: usize,
}

/// Runs the region whose top node is `top` for `partition`; its output metrics go to
/// `metrics` (the unload's), or to `top`'s own node when `None`.
pub(crate) fn execute_region(
    top: &Arc<dyn ExecutionPlan>,
    metrics: Option<&ExecutionPlanMetricsSet>,
    partition: usize,
    context: Arc<TaskContext>,
) -> Result<SendableRecordBatchStream> {
    let (load, ops) = chain(top)?;
    let schema = top.schema();
    let config = context
        .session_config()
        .options()
        .extensions
        .get::<DevarrowConfig>()
        .cloned()
        .unwrap_or_default();
    let ticket = load.placement().place(&config, partition)?;
    let pool = ticket.pool().clone();
    let child = load.input().execute(partition, context.clone())?;
    let mut host_inputs = Vec::with_capacity(ops.len());
    for op in &ops {
        let mut inputs = Vec::new();
        for (i, input) in op.host_inputs() {
            let at = op.operator().host_partition(i, partition);
            inputs.push(if op.operator().shares_host_input(i) {
                HostInput::Shared {
                    batches: op.shared_inputs().get(
                        i,
                        &context,
                        op.properties().partitioning.partition_count(),
                    ),
                    plan: input.clone(),
                    partition: at,
                    context: context.clone(),
                }
            } else {
                HostInput::Stream(input.execute(at, context.clone())?)
            });
        }
        host_inputs.push(inputs);
    }
    let reservation = Arc::new(
        MemoryConsumer::new(format!("DeviceRegion[{partition}]@{}", pool.id()))
            .register(context.memory_pool()),
    );
    let own_metrics = ops
        .last()
        .map(|op| op.metrics_set().clone())
        .unwrap_or_else(|| load.metrics_set().clone());
    let unload_metrics = UnloadMetrics::new(metrics.unwrap_or(&own_metrics), partition);
    let pending = Pending {
        pool,
        ticket,
        child,
        ops,
        host_inputs,
        config,
        reservation,
        memory_pool: context.memory_pool().clone(),
        load_metrics: LoadMetrics::new(load.metrics_set(), partition),
        unload_metrics: unload_metrics.clone(),
        runtime: tokio::runtime::Handle::try_current().ok(),
        partition,
    };
    Ok(Box::pin(RegionStream {
        schema,
        state: State::Starting(Some(Box::new(pending))),
        cancel: Arc::new(AtomicBool::new(false)),
        baseline: unload_metrics.baseline,
    }))
}

enum State {
    /// Not polled yet: the threads start at the first poll.
    Starting(Option<Box<Pending>>),
    /// The threads run; their batches come through here.
    Running(mpsc::Receiver<Result<RecordBatch>>),
    /// Ended.
    Done,
}

/// A partition of a region, as DataFusion polls it.
struct RegionStream {
    schema: SchemaRef,
    state: State,
    cancel: Arc<AtomicBool>,
    baseline: BaselineMetrics,
}

impl Drop for RegionStream {
    fn drop(&mut self) {
        // The threads end on their own (no join on a runtime thread).
        self.cancel.store(true, Ordering::Release);
    }
}

impl RecordBatchStream for RegionStream {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}

impl Stream for RegionStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            match &mut this.state {
                State::Starting(pending) => {
                    let pending = pending.take().expect("a starting state holds its work");
                    let receiver = start(*pending, this.cancel.clone());
                    this.state = match receiver {
                        Ok(receiver) => State::Running(receiver),
                        Err(e) => {
                            this.state = State::Done;
                            return Poll::Ready(Some(Err(e)));
                        }
                    };
                }
                State::Running(receiver) => {
                    let poll = receiver.poll_recv(cx);
                    if let Poll::Ready(None) = poll {
                        this.state = State::Done;
                    }
                    return this.baseline.record_poll(poll);
                }
                State::Done => return Poll::Ready(None),
            }
        }
    }
}

/// Starts the partition's two threads.
fn start(pending: Pending, cancel: Arc<AtomicBool>) -> Result<mpsc::Receiver<Result<RecordBatch>>> {
    let Pending {
        pool,
        ticket,
        child,
        ops,
        host_inputs,
        config,
        reservation,
        memory_pool,
        load_metrics,
        unload_metrics,
        runtime,
        partition,
    } = pending;
    let (upload_tx, upload_rx) = sync_channel::<Uploaded>(config.read_ahead);
    let (out_tx, out_rx) = mpsc::channel::<Result<RecordBatch>>(1);
    let device_id = pool.id().to_string();
    let spawn_error = |e: std::io::Error| {
        DataFusionError::External(Box::new(DeviceExecError::Device {
            spec: device_id.clone(),
            reason: format!("no thread for partition {partition}: {e}"),
        }))
    };
    {
        let (pool, cancel, reservation) = (pool.clone(), cancel.clone(), reservation.clone());
        let load = LoadThread {
            child,
            runtime: runtime.clone(),
            pool,
            batch_bytes: config.batch_bytes,
            reservation,
            cancel,
            metrics: load_metrics,
            partition,
        };
        std::thread::Builder::new()
            .name(format!("devarrow-load-{partition}"))
            .spawn(move || load.run(upload_tx))
            .map_err(spawn_error)?;
    }
    let operators = OperatorThread {
        _ticket: ticket,
        weigh_host_inputs: !config.always_place_joins,
        ops,
        host_inputs,
        runtime,
        pool,
        reservation,
        memory_pool,
        cancel,
        metrics: unload_metrics,
        partition,
    };
    std::thread::Builder::new()
        .name(format!("devarrow-region-{partition}"))
        .spawn(move || operators.run(upload_rx, out_tx))
        .map_err(spawn_error)?;
    Ok(out_rx)
}

/// The load: the child's batches, coalesced, uploaded.
struct LoadThread {
    child: SendableRecordBatchStream,
    runtime: Option<tokio::runtime::Handle>,
    pool: Arc<DevicePool>,
    batch_bytes: usize,
    reservation: Arc<MemoryReservation>,
    cancel: Arc<AtomicBool>,
    metrics: LoadMetrics,
    partition: usize,
}

impl LoadThread {
    fn run(mut self, out: SyncSender<Uploaded>) {
        let result = catch_unwind(AssertUnwindSafe(|| self.feed(&out)));
        let error = match result {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => DataFusionError::External(Box::new(DeviceExecError::Device {
                spec: self.pool.id().to_string(),
                reason: format!("the load of partition {} panicked", self.partition),
            })),
        };
        let _ = out.send(Err(error));
    }

    /// An upload (or its coalescing) failed.
    fn upload_error(&self, source: devarrow::abi::Error) -> DataFusionError {
        DataFusionError::External(Box::new(DeviceExecError::Upload {
            partition: self.partition,
            device: self.pool.id().to_string(),
            source: Box::new(source),
        }))
    }

    /// The child's next batch, polled on the query's runtime.
    fn next_child(&mut self) -> Option<Result<RecordBatch>> {
        match &self.runtime {
            Some(runtime) => runtime.block_on(self.child.next()),
            None => futures::executor::block_on(self.child.next()),
        }
    }

    fn feed(&mut self, out: &SyncSender<Uploaded>) -> Result<()> {
        let schema = self.child.schema();
        let mut gathered: Vec<RecordBatch> = Vec::new();
        let mut gathered_bytes = 0;
        let mut ended = false;
        while !ended {
            if self.cancel.load(Ordering::Acquire) {
                return Ok(());
            }
            match self.next_child() {
                None => ended = true,
                Some(Err(e)) => return Err(e),
                Some(Ok(batch)) => {
                    if batch.num_rows() == 0 {
                        continue;
                    }
                    self.metrics.input_batches.add(1);
                    gathered_bytes += batch_bytes(&batch);
                    gathered.push(batch);
                    if gathered_bytes < self.batch_bytes {
                        continue;
                    }
                }
            }
            if gathered.is_empty() {
                continue;
            }
            let timer = self.metrics.load_time.timer();
            let batch = if gathered.len() == 1 {
                gathered.pop().expect("one batch")
            } else {
                let staging = self.pool.staging_device();
                let batch = coalesce(staging.device().as_ref(), &schema, &gathered)
                    .map_err(|source| self.upload_error(source))?;
                gathered.clear();
                batch
            };
            let bytes = std::mem::take(&mut gathered_bytes);
            reserve(&self.reservation, bytes, self.partition, &self.pool)?;
            // A slot for this upload only: none is held while the child is read. The
            // operators ask for the same one (its stream orders the batch for them).
            let lease = self
                .pool
                .lease_blocking_preferring(home_slot(&self.pool, self.partition));
            let slot = lease.slot();
            let uploaded = lease.upload().to_device(&batch);
            drop(lease);
            let uploaded = match uploaded {
                Ok(uploaded) => uploaded,
                Err(source) => {
                    self.reservation.shrink(bytes);
                    return Err(self.upload_error(source));
                }
            };
            timer.done();
            self.metrics.bytes_to_device.add(bytes);
            self.metrics.uploaded_batches.add(1);
            if out.send(Ok((uploaded, bytes, slot))).is_err() {
                // The operator thread ended; its receiver dropped the batch (and its
                // reservation is released by whoever drops the last handle).
                self.reservation.shrink(bytes);
                return Ok(());
            }
        }
        Ok(())
    }
}

/// Where a batch starts through the operators.
enum Start {
    /// An uploaded frame, through every operator.
    Frame(RegionBatch),
    /// What operator `at` emits at the end, through those above it.
    Finish(usize),
}

/// An operator's counters for a partition.
struct OperatorCounts {
    host_fallback_batches: Count,
    bytes_to_device: Count,
    bytes_from_device: Count,
}

impl OperatorCounts {
    /// The operator's context for batch `batch` of `partition`, on `device`.
    fn context<'a>(
        &'a self,
        partition: usize,
        batch: usize,
        device: &'a ExecDevice,
        memory_pool: &'a Arc<dyn MemoryPool>,
    ) -> OperatorContext<'a> {
        OperatorContext {
            memory_pool,
            partition,
            batch,
            device,
            host_fallback_batches: &self.host_fallback_batches,
            bytes_to_device: &self.bytes_to_device,
            bytes_from_device: &self.bytes_from_device,
        }
    }
}

/// The operators, then the download.
struct OperatorThread {
    /// The partition's place on its device, given up when the thread ends.
    _ticket: PartitionTicket,
    /// Whether operators may run on the host when their host inputs turn out heavy
    /// ([`BindContext::weigh_host_inputs`]).
    weigh_host_inputs: bool,
    ops: Vec<Arc<DeviceOperatorExec>>,
    host_inputs: Vec<Vec<HostInput>>,
    runtime: Option<tokio::runtime::Handle>,
    pool: Arc<DevicePool>,
    reservation: Arc<MemoryReservation>,
    memory_pool: Arc<dyn MemoryPool>,
    cancel: Arc<AtomicBool>,
    metrics: UnloadMetrics,
    partition: usize,
}

impl OperatorThread {
    fn run(mut self, uploads: Receiver<Uploaded>, out: mpsc::Sender<Result<RecordBatch>>) {
        let result = catch_unwind(AssertUnwindSafe(|| match self.bind()? {
            Some(bound) => self.drain(&bound, &uploads, &out),
            // Cancelled while binding: nothing more to do.
            None => Ok(()),
        }));
        let error = match result {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => DataFusionError::External(Box::new(DeviceExecError::Device {
                spec: self.pool.id().to_string(),
                reason: format!("the operators of partition {} panicked", self.partition),
            })),
        };
        let _ = out.blocking_send(Err(error));
    }

    /// The operators bound to the partition: each one with host children (a join's
    /// build side) given their batches, read here on the query's runtime (holding no
    /// device slot), then bound under a slot and its bytes reserved for the partition.
    /// `None` when the stream was dropped meanwhile.
    fn bind(&mut self) -> Result<Option<Vec<Arc<dyn DeviceOperator>>>> {
        let mut bound = Vec::with_capacity(self.ops.len());
        let host_inputs = std::mem::take(&mut self.host_inputs);
        for (op, host) in self.ops.iter().zip(host_inputs) {
            if host.is_empty() {
                bound.push(op.operator().clone());
                continue;
            }
            // The time to read the host inputs (waiting for the partition that reads a
            // shared one included), then to bind under a slot (its wait included: a
            // join's table built, or taken from the partition that built it, and
            // uploaded): `EXPLAIN ANALYZE`'s `host_input_time` and `bind_time`.
            let input_time =
                MetricBuilder::new(op.metrics_set()).subset_time("host_input_time", self.partition);
            let reading = input_time.timer();
            let mut inputs = Vec::with_capacity(host.len());
            for input in host {
                inputs.push(match input {
                    HostInput::Stream(stream) => Arc::new(self.collect(stream)?),
                    HostInput::Shared {
                        batches,
                        plan,
                        partition,
                        context,
                    } => {
                        let read = batches.get_or_init(|| {
                            // Executing a plan may spawn its tasks on the query's runtime.
                            let _entered = self.runtime.as_ref().map(|r| r.enter());
                            plan.execute(partition, context)
                                .and_then(|stream| self.collect(stream))
                                .map(Arc::new)
                                .map_err(Arc::new)
                        });
                        match read {
                            Ok(batches) => batches.clone(),
                            Err(e) => return Err(DataFusionError::Shared(e.clone())),
                        }
                    }
                });
            }
            reading.done();
            if self.cancel.load(Ordering::Acquire) {
                return Ok(None);
            }
            let bind_time =
                MetricBuilder::new(op.metrics_set()).subset_time("bind_time", self.partition);
            let binding = bind_time.timer();
            let lease = self
                .pool
                .lease_blocking_preferring(home_slot(&self.pool, self.partition));
            let mut upload = lease.upload();
            let built =
                MetricBuilder::new(op.metrics_set()).counter("host_tables_built", self.partition);
            let uploaded =
                MetricBuilder::new(op.metrics_set()).counter("bytes_to_device", self.partition);
            let on_host =
                MetricBuilder::new(op.metrics_set()).counter("partitions_on_host", self.partition);
            let mut cx = BindContext {
                weigh_host_inputs: self.weigh_host_inputs,
                partitions_on_host: &on_host,
                partition: self.partition,
                device: lease.device(),
                upload: &mut upload,
                host_tables_built: &built,
                bytes_to_device: &uploaded,
                memory_pool: &self.memory_pool,
            };
            let operator = op.operator().bind(inputs, &mut cx);
            drop(upload);
            drop(lease);
            binding.done();
            let operator = operator
                .map_err(|source| match source.downcast::<DeviceExecError>() {
                    // A refused reservation is the partition's memory error, as is.
                    Ok(memory) if matches!(*memory, DeviceExecError::Memory { .. }) => *memory,
                    Ok(other) => DeviceExecError::Operator {
                        operator: op.operator().name().to_string(),
                        partition: self.partition,
                        batch: 0,
                        source: other,
                    },
                    Err(source) => DeviceExecError::Operator {
                        operator: op.operator().name().to_string(),
                        partition: self.partition,
                        batch: 0,
                        source,
                    },
                })?
                .unwrap_or_else(|| op.operator().clone());
            let bytes = operator.bound_bytes();
            reserve(&self.reservation, bytes, self.partition, &self.pool)?;
            bound.push(operator);
        }
        Ok(Some(bound))
    }

    /// A host stream's batches, read on the query's runtime.
    fn collect(&self, stream: SendableRecordBatchStream) -> Result<Vec<RecordBatch>> {
        match &self.runtime {
            Some(runtime) => runtime.block_on(stream.try_collect::<Vec<_>>()),
            None => futures::executor::block_on(stream.try_collect::<Vec<_>>()),
        }
    }

    fn drain(
        &self,
        bound: &[Arc<dyn DeviceOperator>],
        uploads: &Receiver<Uploaded>,
        out: &mpsc::Sender<Result<RecordBatch>>,
    ) -> Result<()> {
        let ops: Vec<_> = self
            .ops
            .iter()
            .zip(bound)
            .map(|(op, operator)| {
                let time =
                    MetricBuilder::new(op.metrics_set()).subset_time("device_time", self.partition);
                let counter =
                    |name| MetricBuilder::new(op.metrics_set()).counter(name, self.partition);
                let counts = OperatorCounts {
                    host_fallback_batches: counter("host_fallback_batches"),
                    bytes_to_device: counter("bytes_to_device"),
                    bytes_from_device: counter("bytes_from_device"),
                };
                (operator, time, counts)
            })
            .collect();
        let mut index = 0;
        loop {
            if self.cancel.load(Ordering::Acquire) {
                return Ok(());
            }
            let waiting = Instant::now();
            let Ok(uploaded) = uploads.recv() else {
                break;
            };
            self.metrics.load_wait.add_elapsed(waiting);
            let (batch, reserved, slot) = uploaded?;
            let first = RegionBatch::Device(DeviceFrame::from_batch(batch));
            if !self.one_batch(&ops, Start::Frame(first), slot, index, reserved, out)? {
                return Ok(());
            }
            index += 1;
        }
        // The input has ended: what each operator emits now goes on through the
        // operators above it, in order (a join's build rows, then what a later operator
        // emits of them).
        for at in 0..ops.len() {
            if self.cancel.load(Ordering::Acquire) {
                return Ok(());
            }
            let home = home_slot(&self.pool, self.partition);
            if !self.one_batch(&ops, Start::Finish(at), home, index, 0, out)? {
                return Ok(());
            }
            index += 1;
        }
        Ok(())
    }

    /// One batch through the operators under a device slot (taken for this batch's
    /// operators and download only: `slot` when it is free, the one the batch was
    /// uploaded on), sent on when it has rows; `reserved` bytes were reserved for it so
    /// far. False when the stream was dropped.
    fn one_batch(
        &self,
        ops: &[(&Arc<dyn DeviceOperator>, Time, OperatorCounts)],
        start: Start,
        slot: usize,
        index: usize,
        reserved: usize,
        out: &mpsc::Sender<Result<RecordBatch>>,
    ) -> Result<bool> {
        let waiting = Instant::now();
        let lease = self.pool.lease_blocking_preferring(slot);
        self.metrics.slot_wait.add_elapsed(waiting);
        let compute = self.metrics.baseline.elapsed_compute().clone();
        let timer = compute.timer();
        let mut held = reserved;
        let host = self.through(&lease, start, ops, index, &mut held);
        drop(lease);
        self.reservation.shrink(held);
        timer.done();
        for host in host? {
            if host.num_rows() > 0 && out.blocking_send(Ok(host)).is_err() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Grows the partition's reservation to the device memory `frame` holds (its
    /// batches: the upload's and the columns operators computed), where that is more
    /// than the `held` bytes reserved for the batch so far; `held` is what the batch
    /// then holds reserved, given back when the batch is done. A column computed inside
    /// the region is thus reserved as an uploaded one is (its peak, operator by
    /// operator), and a refusal ends the partition with [`DeviceExecError::Memory`].
    fn reserve_frame(&self, frame: &DeviceFrame, held: &mut usize) -> Result<()> {
        self.reserve_bytes(frame.device_bytes(), held)
    }

    /// Grows the batch's reservation to `live` bytes where that is more than `held`.
    fn reserve_bytes(&self, live: usize, held: &mut usize) -> Result<()> {
        if live <= *held {
            return Ok(());
        }
        let more = live - *held;
        reserve(&self.reservation, more, self.partition, &self.pool)?;
        *held = live;
        Ok(())
    }

    /// One batch through the operators and down to the host: an uploaded frame through
    /// all of them, or what operator `at` emits at the end through those above it. No
    /// batch when an operator keeps the batch for the end, or emits nothing there; one
    /// per frame where an operator hands on several.
    fn through(
        &self,
        lease: &DeviceLease,
        start: Start,
        ops: &[(&Arc<dyn DeviceOperator>, Time, OperatorCounts)],
        index: usize,
        held: &mut usize,
    ) -> Result<Vec<RecordBatch>> {
        let device = lease.device();

        // A step's CUDA calls (cudarc's, some of which take the thread's current context)
        // find the device's context bound.
        #[cfg(feature = "cuda")]
        if let Some(cuda) = device.cuda() {
            cuda.primary_context()
                .context()
                .bind_to_thread()
                .map_err(|e| DeviceExecError::Device {
                    spec: device.id().to_string(),
                    reason: e.to_string(),
                })?;
        }
        let (current, after) = match start {
            Start::Frame(frame) => (frame, 0),
            Start::Finish(at) => {
                let (op, time, counts) = &ops[at];
                let cx = counts.context(self.partition, index, device, &self.memory_pool);
                let timer = time.timer();
                let emitted = op
                    .finish(&cx)
                    .map_err(|source| self.operator_error(op, index, source))?;
                timer.done();
                match emitted {
                    Some(emitted) => (emitted, at + 1),
                    None => return Ok(Vec::new()),
                }
            }
        };
        self.onward(lease, current, &ops[after..], index, held)
    }

    /// `current` through `ops`, then down to the host (see [`Self::through`]).
    fn onward(
        &self,
        lease: &DeviceLease,
        mut current: RegionBatch,
        ops: &[(&Arc<dyn DeviceOperator>, Time, OperatorCounts)],
        index: usize,
        held: &mut usize,
    ) -> Result<Vec<RecordBatch>> {
        let device = lease.device();
        self.reserve_batch(&current, held)?;
        for (k, (op, time, counts)) in ops.iter().enumerate() {
            let cx = counts.context(self.partition, index, device, &self.memory_pool);
            let frame = match current {
                RegionBatch::Device(frame) => frame,
                RegionBatch::Nothing => return Ok(Vec::new()),
                // Each frame on through the rest, one after another.
                RegionBatch::Frames(frames) => {
                    let mut host = Vec::new();
                    for frame in frames {
                        let frame = RegionBatch::Device(frame);
                        host.extend(self.onward(lease, frame, &ops[k..], index, held)?);
                    }
                    return Ok(host);
                }
                RegionBatch::Host(_) => {
                    return Err(DataFusionError::Internal(format!(
                        "{} follows an operator whose output is on the host",
                        op.name()
                    )))
                }
            };
            let timer = time.timer();
            current = op
                .apply(frame, &cx)
                .map_err(|source| self.operator_error(op, index, source))?;
            timer.done();
            self.reserve_batch(&current, held)?;
        }
        match current {
            RegionBatch::Nothing => Ok(Vec::new()),
            RegionBatch::Host(batch) => Ok(vec![batch]),
            RegionBatch::Device(frame) => Ok(self
                .unload(lease, frame, index, held)?
                .into_iter()
                .collect()),
            RegionBatch::Frames(frames) => {
                let mut host = Vec::with_capacity(frames.len());
                for frame in frames {
                    host.extend(self.unload(lease, frame, index, held)?);
                }
                Ok(host)
            }
        }
    }

    /// Operator `op`'s error `source` on batch `index` of the partition.
    fn operator_error(
        &self,
        op: &Arc<dyn DeviceOperator>,
        index: usize,
        source: BoxError,
    ) -> DeviceExecError {
        DeviceExecError::Operator {
            operator: op.name().to_string(),
            partition: self.partition,
            batch: index,
            source,
        }
    }

    /// Grows the batch's reservation to the device memory of what an operator handed
    /// on (every frame of several: they are alive together).
    fn reserve_batch(&self, batch: &RegionBatch, held: &mut usize) -> Result<()> {
        match batch {
            RegionBatch::Device(frame) => self.reserve_frame(frame, held),
            RegionBatch::Frames(frames) => {
                self.reserve_bytes(frames.iter().map(DeviceFrame::device_bytes).sum(), held)
            }
            RegionBatch::Host(_) | RegionBatch::Nothing => Ok(()),
        }
    }

    /// `frame` down to the host: the rows a pending selection keeps, compacted on the
    /// device (`None` where it keeps none).
    fn unload(
        &self,
        lease: &DeviceLease,
        frame: DeviceFrame,
        index: usize,
        held: &mut usize,
    ) -> Result<Option<RecordBatch>> {
        let device = lease.device();
        let timer = self.metrics.unload_time.timer();
        let unload_error = |source| {
            DataFusionError::External(Box::new(DeviceExecError::Operator {
                operator: "DeviceUnloadExec".into(),
                partition: self.partition,
                batch: index,
                source,
            }))
        };
        // Only the rows a pending selection keeps cross the link, where the
        // device compacts the frame's columns.
        let frame = match crate::compute::compact(&frame, device).map_err(unload_error)? {
            Some(Some(kept)) => {
                self.reserve_bytes(frame.device_bytes() + kept.device_bytes(), held)?;
                self.metrics.compacted_batches.add(1);
                kept
            }
            Some(None) => {
                self.metrics.compacted_batches.add(1);
                timer.done();
                return Ok(None);
            }
            None => frame,
        };
        let mut transfer = lease.download();
        let host = frame.download(&mut transfer).map_err(unload_error)?;
        let stats = transfer.take_stats();
        drop(transfer);
        self.metrics
            .bytes_from_device
            .add(stats.to_host.bytes as usize);
        self.metrics
            .pageable_downloads
            .add(stats.pageable_downloads as usize);
        timer.done();
        Ok(Some(host))
    }
}
