//! [`DeviceExec`]: each partition of the child through a device.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, ColumnStatistics, DataFusionError, Result, Statistics};
use datafusion::execution::memory_pool::{MemoryConsumer, MemoryReservation};
use datafusion::execution::{RecordBatchStream, SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::projection::{ProjectionMapping, ProjectionTargets};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::CardinalityEffect;
use datafusion::physical_plan::metrics::{
    BaselineMetrics, Count, ExecutionPlanMetricsSet, Gauge, MetricBuilder, MetricsSet, Time,
};
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{
    DisplayAs, DisplayFormatType, ExecutionPlan, Partitioning, PlanProperties,
};
use devarrow::bridge::{DeviceBatch, StreamOptions, Transfer, TransferOptions, UploadStream};
use futures::{Stream, StreamExt};

use crate::error::DeviceExecError;
use crate::step::{DeviceStep, ExecDevice, KeptColumns, StepContext, StepOutput};

/// How many batches of a partition are uploaded ahead of the step by default.
pub const DEFAULT_READ_AHEAD: usize = 2;

/// A plan node that streams each partition of its child through a device: every batch is
/// uploaded (on a background thread, up to `read_ahead` batches ahead of the step: a
/// bounded queue, so a slow step holds the child back), the [`DeviceStep`] runs on it,
/// and the step's output is downloaded ([`ExecutionPlan::execute`]) or handed on as
/// device batches ([`DeviceExec::execute_device`]).
///
/// - One output batch per non-empty input batch, same rows, same order. Of the child's
///   properties the node claims only what the step declares it keeps
///   ([`Preserves`](crate::Preserves)): an appending step ([`StepOutput::Append`]) keeps
///   the child's orderings, equivalences and partitioning on the input's columns; a
///   replacing step claims none of them unless it declares them
///   ([`DeviceStep::preserves_order`], [`DeviceStep::preserves_partitioning`],
///   [`DeviceStep::leaves_untouched`]), and its partitioning is otherwise
///   `UnknownPartitioning` of the child's partition count.
/// - Statistics: the child's row count; column statistics for the columns the step
///   leaves untouched, unknown for the others.
/// - Metrics (per partition): `output_rows`, `elapsed_compute` (the step, and the
///   download with [`ExecutionPlan::execute`]: at least `device_step` + `download`),
///   `bytes_to_device`, `bytes_from_device`, `upload_wait` (time the step
///   waited for its next uploaded batch: the child's work and the upload, where
///   read-ahead did not hide them), `device_step` (the
///   step's code; on CUDA it enqueues, and the kernels' time shows in the download),
///   `download`, `download_mib_per_s`.
/// - Errors: a failing step fails the partition with [`DeviceExecError::Step`] naming
///   the step, the partition and the batch; the child's errors come through unchanged.
/// - The step and the download run on a thread of the partition, never on a tokio
///   worker: the stream takes finished batches off a channel.
/// - Dropping a partition's stream (a cancelled query) stops its threads without
///   waiting for them (no join on a runtime thread); the partition's device memory is
///   freed as they end.
///
/// # Example
///
/// TPC-H's revenue on devarrow's CPU device (no GPU needed; `ExecDevice::open("cuda:0")`
/// runs the same plan on a GPU):
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{Array, Decimal128Array, RecordBatch};
/// use arrow_schema::{DataType, Field, Schema};
/// use datafusion::datasource::memory::MemorySourceConfig;
/// use datafusion::physical_plan::{collect, ExecutionPlan};
/// use datafusion::prelude::SessionContext;
/// use devarrow_datafusion::revenue::revenue_step;
/// use devarrow_datafusion::{DeviceExec, ExecDevice};
///
/// # fn main() -> datafusion::common::Result<()> {
/// let decimal = |values: Vec<i128>| -> datafusion::common::Result<_> {
///     Ok(Arc::new(Decimal128Array::from(values).with_precision_and_scale(15, 2)?))
/// };
/// let schema = Arc::new(Schema::new(vec![
///     Field::new("l_extendedprice", DataType::Decimal128(15, 2), false),
///     Field::new("l_discount", DataType::Decimal128(15, 2), false),
/// ]));
/// // 100.00 at 10% off, 20.50 at none.
/// let batch = RecordBatch::try_new(
///     schema.clone(),
///     vec![decimal(vec![10_000, 2_050])?, decimal(vec![10, 0])?],
/// )?;
/// let input = MemorySourceConfig::try_new_exec(&[vec![batch]], schema, None)?;
/// let plan = Arc::new(DeviceExec::try_new(input, Arc::new(revenue_step()), ExecDevice::cpu())?);
///
/// let ctx = SessionContext::new();
/// let runtime = tokio::runtime::Runtime::new()?;
/// let out = runtime.block_on(collect(plan.clone(), ctx.task_ctx()))?;
/// // The input's columns, then `revenue` (scale 4): 90.0000 and 20.5000.
/// let revenue = out[0].column_by_name("revenue").unwrap();
/// let revenue = revenue.as_any().downcast_ref::<Decimal128Array>().unwrap();
/// assert_eq!(revenue.values().to_vec(), vec![900_000, 205_000]);
/// // Its metrics: what went up and came down.
/// let metrics = plan.metrics().unwrap();
/// assert!(metrics.sum_by_name("bytes_to_device").unwrap().as_usize() >= 2 * 2 * 16);
/// # Ok(())
/// # }
/// ```
pub struct DeviceExec {
    input: Arc<dyn ExecutionPlan>,
    step: Arc<DeviceStep>,
    device: ExecDevice,
    read_ahead: usize,
    schema: SchemaRef,
    step_schema: SchemaRef,
    append: bool,
    projection: Option<Vec<usize>>,
    kept: KeptColumns,
    maintains_order: bool,
    properties: Arc<PlanProperties>,
    metrics: ExecutionPlanMetricsSet,
}

impl fmt::Debug for DeviceExec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceExec")
            .field("step", &self.step.name())
            .field("device", &self.device.id())
            .field("read_ahead", &self.read_ahead)
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

impl DeviceExec {
    /// `input`'s partitions through `step` on `device`, with the default read-ahead.
    ///
    /// # Errors
    /// [`DeviceExecError::Input`] when the step needs a column `input` lacks, or appends
    /// one it has.
    pub fn try_new(
        input: Arc<dyn ExecutionPlan>,
        step: Arc<DeviceStep>,
        device: ExecDevice,
    ) -> Result<Self> {
        let input_schema = input.schema();
        let projection = step.upload_projection(&input_schema)?;
        let (schema, step_schema) = step.schemas(&input_schema)?;
        let append = matches!(step.output(&input_schema), StepOutput::Append(_));
        let kept = step.kept_columns(&input_schema, &schema)?;
        // DataFusion pushes a sort required above a node that maintains its input's
        // order down to the child, column for column (same indices): only sound when
        // each of the child's columns is at its index in the output, ordered as it was.
        let width = input_schema.fields().len().min(schema.fields().len());
        let maintains_order = (0..width).all(|i| kept.order.contains(&(i, i)));
        let properties = Arc::new(Self::compute_properties(&input, &schema, &kept)?);
        Ok(Self {
            input,
            step,
            device,
            read_ahead: DEFAULT_READ_AHEAD,
            schema,
            step_schema,
            append,
            projection,
            kept,
            maintains_order,
            properties,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// This node with `read_ahead` batches uploaded ahead of the step (0: on demand).
    pub fn with_read_ahead(mut self, read_ahead: usize) -> Self {
        self.read_ahead = read_ahead;
        self
    }

    /// The step.
    pub fn step(&self) -> &Arc<DeviceStep> {
        &self.step
    }

    /// The device.
    pub fn device(&self) -> &ExecDevice {
        &self.device
    }

    /// The read-ahead, in batches.
    pub fn read_ahead(&self) -> usize {
        self.read_ahead
    }

    /// The child.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// The child's properties that hold on the output: its equivalences, orderings and
    /// partitioning projected onto the columns the step keeps ([`KeptColumns`]).
    fn compute_properties(
        input: &Arc<dyn ExecutionPlan>,
        schema: &SchemaRef,
        kept: &KeptColumns,
    ) -> Result<PlanProperties> {
        let input_properties = input.properties();
        let input_schema = input.schema();
        let input_eq = &input_properties.eq_properties;
        let mapping = |pairs: &[(usize, usize)]| -> ProjectionMapping {
            pairs
                .iter()
                .map(|&(i, o)| {
                    let source: Arc<dyn PhysicalExpr> =
                        Arc::new(Column::new(input_schema.field(i).name(), i));
                    let target: Arc<dyn PhysicalExpr> =
                        Arc::new(Column::new(schema.field(o).name(), o));
                    (source, ProjectionTargets::from(vec![(target, o)]))
                })
                .collect()
        };
        let mut eq_properties = input_eq.project(&mapping(&kept.untouched), schema.clone());
        if kept.order != kept.untouched {
            let ordered = input_eq.project(&mapping(&kept.order), schema.clone());
            eq_properties.add_orderings(ordered.oeq_class().iter().cloned());
        }
        let count = input_properties.partitioning.partition_count();
        let partitioning = match &input_properties.partitioning {
            Partitioning::Hash(exprs, n) => {
                let by = mapping(&kept.partitioning);
                match input_eq
                    .project_expressions(exprs, &by)
                    .collect::<Option<Vec<_>>>()
                {
                    Some(exprs) => Partitioning::Hash(exprs, *n),
                    None => Partitioning::UnknownPartitioning(count),
                }
            }
            Partitioning::Range(_) => input_properties
                .partitioning
                .project(&mapping(&kept.partitioning), input_eq),
            // How the rows were dealt, not what they hold: one output batch per input
            // batch keeps it.
            Partitioning::RoundRobinBatch(_) | Partitioning::UnknownPartitioning(_) => {
                input_properties.partitioning.clone()
            }
        };
        Ok(PlanProperties::new(
            eq_properties,
            partitioning,
            input_properties.emission_type,
            input_properties.boundedness,
        ))
    }

    /// The partition's batches after the step, still on the device (the step's output
    /// only: with [`StepOutput::Append`], without the input's columns). Dropping the
    /// stream stops the partition's uploads and frees its device memory. It keeps no
    /// input batch on the host (only [`ExecutionPlan::execute`] joins them with the
    /// step's output).
    pub fn execute_device(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<DeviceBatchStream> {
        self.stream_partition(partition, context, false)
    }

    /// The partition through the step; with `keep_host`, an appending step's input
    /// batches queued for the download to join its output with.
    fn stream_partition(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
        keep_host: bool,
    ) -> Result<DeviceBatchStream> {
        let memory_pool = context.memory_pool().clone();
        let child = self.input.execute(partition, context)?;
        let host = (keep_host && self.append).then(|| {
            Arc::new(Mutex::new(HostQueue {
                batches: VecDeque::new(),
                reservation: MemoryConsumer::new(format!("DeviceExec[{partition}]"))
                    .register(&memory_pool),
            }))
        });
        let child_error = Arc::new(Mutex::new(None));
        let upload_schema = match &self.projection {
            Some(indices) => Arc::new(child.schema().project(indices)?),
            None => child.schema(),
        };
        let feed = ChildFeed {
            inner: child,
            runtime: tokio::runtime::Handle::try_current().ok(),
            projection: self.projection.clone(),
            host: host.clone(),
            error: child_error.clone(),
            done: false,
        };
        let options = StreamOptions::default().with_read_ahead(self.read_ahead);
        let uploads =
            UploadStream::spawn(upload_schema, feed, self.device.device().clone(), options)
                .map_err(|source| DeviceExecError::Upload {
                    partition,
                    device: self.device.id().to_string(),
                    source: Box::new(source),
                })?;
        Ok(DeviceBatchStream {
            uploads: Some(uploads),
            host,
            child_error,
            step: self.step.clone(),
            step_schema: self.step_schema.clone(),
            device: self.device.clone(),
            partition,
            batch: 0,
            waiting_since: None,
            done: false,
            metrics: PartitionMetrics::new(&self.metrics, partition),
        })
    }
}

impl DisplayAs for DeviceExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => write!(
                f,
                "DeviceExec: step={}, device={}, read_ahead={}",
                self.step.name(),
                self.device.id(),
                self.read_ahead
            ),
            DisplayFormatType::TreeRender => {
                writeln!(f, "step={}", self.step.name())?;
                write!(f, "device={}", self.device.id())
            }
        }
    }
}

impl ExecutionPlan for DeviceExec {
    fn name(&self) -> &str {
        "DeviceExec"
    }

    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    /// Rows keep their order, but DataFusion reads `true` as "a sort required above may
    /// be pushed below, column for column": true only when each of the child's columns
    /// is at its index in the output with its order kept (an appending step, or one
    /// declaring [`DeviceStep::preserves_order`] or leaving every column untouched).
    fn maintains_input_order(&self) -> Vec<bool> {
        vec![self.maintains_order]
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false]
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return internal_err!("DeviceExec takes one child, not {}", children.len());
        }
        let node = DeviceExec::try_new(
            children.swap_remove(0),
            self.step.clone(),
            self.device.clone(),
        )?
        .with_read_ahead(self.read_ahead);
        Ok(Arc::new(node))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let device_batches = self.stream_partition(partition, context, true)?;
        let host = HostBatchStream {
            transfer: Transfer::new(self.device.device().clone(), TransferOptions::default()),
            schema: self.schema.clone(),
            inner: device_batches,
        };
        Ok(Box::pin(OffRuntime::new(
            self.schema.clone(),
            host,
            format!("devarrow-step-{partition}"),
        )))
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    /// The child's row count (one row out per row in); its column statistics for the
    /// columns the step leaves untouched (all the input's, when it appends); unknown
    /// for the others, and byte sizes inexact.
    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        let input = &input_stats[0];
        let mut columns = vec![ColumnStatistics::new_unknown(); self.schema.fields().len()];
        for &(i, o) in &self.kept.untouched {
            if let Some(stats) = input.column_statistics.get(i) {
                columns[o] = stats.clone();
            }
        }
        Ok(Arc::new(Statistics {
            num_rows: input.num_rows,
            total_byte_size: input.total_byte_size.to_inexact(),
            column_statistics: columns,
        }))
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        CardinalityEffect::Equal
    }
}

/// The input batches whose columns an appending step's output is joined with
/// ([`DeviceExec::execute`] only), in upload order, with their memory accounted in
/// DataFusion's memory pool while they wait.
struct HostQueue {
    batches: VecDeque<(RecordBatch, usize)>,
    reservation: MemoryReservation,
}

impl HostQueue {
    fn push(&mut self, batch: RecordBatch) {
        let size = batch.get_array_memory_size();
        self.reservation.grow(size);
        self.batches.push_back((batch, size));
    }

    fn pop(&mut self) -> Option<RecordBatch> {
        let (batch, size) = self.batches.pop_front()?;
        self.reservation.shrink(size);
        Some(batch)
    }
}

/// The metrics of one partition.
#[derive(Debug, Clone)]
struct PartitionMetrics {
    baseline: BaselineMetrics,
    bytes_to_device: Count,
    bytes_from_device: Count,
    upload_wait: Time,
    device_step: Time,
    download: Time,
    download_mib_per_s: Gauge,
}

impl PartitionMetrics {
    fn new(metrics: &ExecutionPlanMetricsSet, partition: usize) -> Self {
        Self {
            baseline: BaselineMetrics::new(metrics, partition),
            bytes_to_device: MetricBuilder::new(metrics).counter("bytes_to_device", partition),
            bytes_from_device: MetricBuilder::new(metrics).counter("bytes_from_device", partition),
            upload_wait: MetricBuilder::new(metrics).subset_time("upload_wait", partition),
            device_step: MetricBuilder::new(metrics).subset_time("device_step", partition),
            download: MetricBuilder::new(metrics).subset_time("download", partition),
            download_mib_per_s: MetricBuilder::new(metrics).gauge("download_mib_per_s", partition),
        }
    }
}

/// The child's batches as the upload thread pulls them: polled there inside the tokio
/// runtime of the query (DataFusion's streams may spawn tasks on first poll), projected
/// to the step's input columns; the whole batch queued ([`HostQueue`]) only when
/// [`DeviceExec::execute`] joins it with an appending step's output; empty batches
/// skipped; an error of the child kept aside (delivered unchanged by
/// [`DeviceBatchStream`]) and the end of the feed.
struct ChildFeed {
    inner: SendableRecordBatchStream,
    runtime: Option<tokio::runtime::Handle>,
    projection: Option<Vec<usize>>,
    host: Option<Arc<Mutex<HostQueue>>>,
    error: Arc<Mutex<Option<DataFusionError>>>,
    done: bool,
}

impl Stream for ChildFeed {
    type Item = std::result::Result<RecordBatch, devarrow::abi::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            let _runtime = this.runtime.as_ref().map(|r| r.enter());
            let batch = match this.inner.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    *this.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Ok(batch))) => batch,
            };
            if batch.num_rows() == 0 {
                continue;
            }
            let upload = match &this.projection {
                Some(indices) => match batch.project(indices) {
                    Ok(projected) => projected,
                    Err(e) => return Poll::Ready(Some(Err(e.into()))),
                },
                None => batch.clone(),
            };
            if let Some(host) = &this.host {
                host.lock().unwrap_or_else(|e| e.into_inner()).push(batch);
            }
            return Poll::Ready(Some(Ok(upload)));
        }
    }
}

/// One partition of a [`DeviceExec`] after its step, on the device
/// ([`DeviceExec::execute_device`]).
pub struct DeviceBatchStream {
    /// `None` once dropped (its drop, which stops and joins the upload thread, runs on a
    /// thread of its own: never on the runtime thread that drops this stream).
    uploads: Option<UploadStream>,
    host: Option<Arc<Mutex<HostQueue>>>,
    child_error: Arc<Mutex<Option<DataFusionError>>>,
    step: Arc<DeviceStep>,
    step_schema: SchemaRef,
    device: ExecDevice,
    partition: usize,
    batch: usize,
    waiting_since: Option<Instant>,
    done: bool,
    metrics: PartitionMetrics,
}

impl fmt::Debug for DeviceBatchStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBatchStream")
            .field("step", &self.step.name())
            .field("device", &self.device.id())
            .field("partition", &self.partition)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl DeviceBatchStream {
    /// The schema of the step's batches.
    pub fn step_schema(&self) -> &SchemaRef {
        &self.step_schema
    }

    /// Runs the step on one uploaded batch and checks its output.
    fn run_step(&mut self, uploaded: DeviceBatch) -> Result<DeviceBatch> {
        let batch = self.batch;
        let rows = uploaded.num_rows();
        self.metrics.bytes_to_device.add(uploaded.device_bytes());
        let cx = StepContext {
            partition: self.partition,
            batch,
            device: &self.device,
        };
        // elapsed_compute encloses device_step (the download adds its own share in
        // HostBatchStream): started first, stopped last, on errors too (on drop).
        let compute_timer = self.metrics.baseline.elapsed_compute().timer();
        let step_timer = self.metrics.device_step.timer();
        // The polling thread may be any of the runtime's: the step's CUDA calls (cudarc's,
        // some of which take the thread's current context) find the device's context bound.
        #[cfg(feature = "cuda")]
        if let Some(cuda) = self.device.cuda() {
            cuda.primary_context()
                .context()
                .bind_to_thread()
                .map_err(|e| DeviceExecError::Step {
                    step: self.step.name().to_string(),
                    partition: self.partition,
                    batch,
                    source: Box::new(e),
                })?;
        }
        let output = self
            .step
            .run(uploaded, &cx)
            .map_err(|source| DeviceExecError::Step {
                step: self.step.name().to_string(),
                partition: self.partition,
                batch,
                source,
            })?;
        step_timer.done();
        compute_timer.done();
        let same_columns = output.schema().fields().len() == self.step_schema.fields().len()
            && output
                .schema()
                .fields()
                .iter()
                .zip(self.step_schema.fields())
                .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
        if !same_columns {
            return Err(DeviceExecError::OutputSchema {
                step: self.step.name().to_string(),
                partition: self.partition,
                batch,
                expected: self.step_schema.to_string(),
                found: output.schema().to_string(),
            }
            .into());
        }
        if output.num_rows() != rows {
            return Err(DeviceExecError::OutputRows {
                step: self.step.name().to_string(),
                partition: self.partition,
                batch,
                expected: rows,
                found: output.num_rows(),
            }
            .into());
        }
        Ok(output)
    }

    /// The input batch the device batch `batch` was uploaded from
    /// ([`StepOutput::Append`] only).
    fn take_host_batch(&self) -> Option<RecordBatch> {
        self.host
            .as_ref()
            .and_then(|h| h.lock().unwrap_or_else(|e| e.into_inner()).pop())
    }
}

impl Drop for DeviceBatchStream {
    fn drop(&mut self) {
        // Stopping the upload thread joins it: hand that to a thread of its own, so that a
        // tokio worker dropping this stream (a cancelled query) never waits for it. The
        // partition's device memory is freed when that join ends.
        if let Some(uploads) = self.uploads.take() {
            let dropped = std::thread::Builder::new()
                .name("devarrow-step-drop".into())
                .spawn(move || drop(uploads));
            if let Err(e) = dropped {
                // No thread to be had: join here rather than leak the uploads.
                drop(e);
            }
        }
    }
}

impl Stream for DeviceBatchStream {
    type Item = Result<DeviceBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let Some(uploads) = self.uploads.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = uploads.poll_next_unpin(cx);
        match polled {
            Poll::Pending => {
                self.waiting_since.get_or_insert_with(Instant::now);
                Poll::Pending
            }
            Poll::Ready(item) => {
                if let Some(since) = self.waiting_since.take() {
                    self.metrics.upload_wait.add_elapsed(since);
                }
                match item {
                    None => {
                        self.done = true;
                        let child_error = self
                            .child_error
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .take();
                        match child_error {
                            Some(e) => Poll::Ready(Some(Err(e))),
                            None => Poll::Ready(None),
                        }
                    }
                    Some(Err(source)) => {
                        self.done = true;
                        let error = DeviceExecError::Upload {
                            partition: self.partition,
                            device: self.device.id().to_string(),
                            source: Box::new(source),
                        };
                        Poll::Ready(Some(Err(error.into())))
                    }
                    Some(Ok(uploaded)) => {
                        let output = self.run_step(uploaded);
                        if output.is_err() {
                            self.done = true;
                        }
                        self.batch += 1;
                        Poll::Ready(Some(output))
                    }
                }
            }
        }
    }
}

/// [`DeviceBatchStream`] downloaded: the output of [`DeviceExec::execute`].
struct HostBatchStream {
    inner: DeviceBatchStream,
    transfer: Transfer,
    schema: SchemaRef,
}

impl HostBatchStream {
    fn download(&mut self, output: DeviceBatch) -> Result<RecordBatch> {
        let batch = self.inner.batch - 1;
        let metrics = self.inner.metrics.clone();
        let timer = metrics.download.timer();
        let downloaded =
            self.transfer
                .to_host(&output)
                .map_err(|source| DeviceExecError::Download {
                    partition: self.inner.partition,
                    batch,
                    device: self.inner.device.id().to_string(),
                    source: Box::new(source),
                })?;
        timer.done();
        drop(output);
        let stats = self.transfer.take_stats().to_host;
        metrics.bytes_from_device.add(stats.bytes as usize);
        let (bytes, nanos) = (
            metrics.bytes_from_device.value(),
            metrics.download.value().max(1),
        );
        metrics
            .download_mib_per_s
            .set((bytes as f64 / (1 << 20) as f64 / (nanos as f64 * 1e-9)) as usize);
        let columns = match self.inner.take_host_batch() {
            Some(host) => {
                let mut columns = host.columns().to_vec();
                columns.extend(downloaded.columns().iter().cloned());
                columns
            }
            None => downloaded.columns().to_vec(),
        };
        Ok(RecordBatch::try_new(self.schema.clone(), columns)?)
    }
}

impl Stream for HostBatchStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.poll_next_unpin(cx);
        let poll = match polled {
            Poll::Ready(Some(Ok(output))) => {
                let compute = self.inner.metrics.baseline.elapsed_compute().clone();
                let timer = compute.timer();
                let result = self.download(output);
                timer.done();
                if result.is_err() {
                    self.inner.done = true;
                }
                Poll::Ready(Some(result))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        };
        self.inner.metrics.baseline.clone().record_poll(poll)
    }
}

impl RecordBatchStream for HostBatchStream {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}

/// A stream driven on a thread of its own, its items handed over a channel: the step and
/// the download (host waits for the device) never run on a tokio worker. The thread
/// starts at the first poll; dropping this stream drops the channel and the thread ends
/// at its next item, dropping the inner stream there (no join here).
struct OffRuntime {
    schema: SchemaRef,
    start: Option<(HostBatchStream, String)>,
    receiver: Option<tokio::sync::mpsc::Receiver<Result<RecordBatch>>>,
}

impl OffRuntime {
    fn new(schema: SchemaRef, inner: HostBatchStream, name: String) -> Self {
        Self {
            schema,
            start: Some((inner, name)),
            receiver: None,
        }
    }

    fn start(&mut self) -> Result<()> {
        let Some((mut inner, name)) = self.start.take() else {
            return Ok(());
        };
        let (sender, receiver) = tokio::sync::mpsc::channel(1);
        let partition = inner.inner.partition;
        let device = inner.inner.device.id().to_string();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    while let Some(item) = futures::executor::block_on(inner.next()) {
                        if sender.blocking_send(item).is_err() {
                            return;
                        }
                    }
                }));
                if caught.is_err() {
                    let error = DeviceExecError::Device {
                        spec: device,
                        reason: format!("the device step of partition {partition} panicked"),
                    };
                    let _ = sender.blocking_send(Err(error.into()));
                }
            })
            .map_err(|e| DataFusionError::External(Box::new(e)))?;
        self.receiver = Some(receiver);
        Ok(())
    }
}

impl Stream for OffRuntime {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Err(e) = self.start() {
            return Poll::Ready(Some(Err(e)));
        }
        match self.receiver.as_mut() {
            Some(receiver) => receiver.poll_recv(cx),
            None => Poll::Ready(None),
        }
    }
}

impl RecordBatchStream for OffRuntime {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}
