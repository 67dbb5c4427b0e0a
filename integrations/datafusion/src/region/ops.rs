//! The device operators that replace DataFusion's own nodes: a filter, a projection and
//! a partial aggregate (see [`crate::compute`] for what each computes on the device).
//!
//! Each computes what the host node it replaces computes, and so declares what that
//! node declares (its host twin's properties):
//!
//! | operator | replaces | order | partitioning | columns |
//! | --- | --- | --- | --- | --- |
//! | [`FilterOperator`] | `FilterExec` | kept | kept | untouched (a pending selection; its projection picks columns) |
//! | [`ProjectionOperator`] | `ProjectionExec` | kept where the sort columns are passed through | kept where the key columns are | passed through or computed |
//! | [`PartialAggregateOperator`] | `AggregateExec` (`Partial`) | none | the input's partition count | group keys and partial states |
//! | [`HashJoinOperator`] | `HashJoinExec` (`Inner`, `Left`, `Right`, `Full`, `LeftSemi`, `LeftAnti`, `RightSemi`, `RightAnti`, `RightMark`) | the probe side's, as DataFusion's join declares it | the join's | probe columns untouched, build columns gathered |

use std::fmt;
use std::sync::{Arc, Mutex, Weak};

use arrow_schema::SchemaRef;
use datafusion::physical_expr::expressions::Column;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::joins::{HashJoinExec, PartitionMode};
use datafusion::physical_plan::projection::ProjectionExec;
use datafusion::physical_plan::ExecutionPlan;

use arrow_array::RecordBatch;
use datafusion::arrow::compute::concat_batches;
use datafusion::datasource::memory::MemorySourceConfig;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::collect;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use devarrow::bridge::{Transfer, TransferOptions};

use crate::compute::join::{BuiltJoin, DeviceHashJoin, JoinTable};
use crate::compute::{select, ComputeError, DeviceExpr, DevicePartialAggregate, Unsupported};
use crate::error::BoxError;
use crate::estimate::{link_bytes, SMALL_BUILD_SIDE};
use crate::frame::DeviceFrame;
use crate::step::ExecDevice;

use super::{BindContext, DeviceOperator, OperatorContext, RegionBatch};

/// `FilterExec` on the device: the predicate's selection, and-ed with the frame's
/// pending one; no row moves (the unload, or a terminal operator, applies it).
///
/// A batch whose predicate overflows the device's 64-bit lanes (a cast to a wide
/// decimal scale, say, where DataFusion computes in 128 bits) is filtered on the host by
/// the `FilterExec` itself and its rows uploaded again (`on_host_and_back`): the
/// query never fails for it; `host_fallback_batches` counts those batches.
#[derive(Debug)]
pub struct FilterOperator {
    predicate: Arc<dyn PhysicalExpr>,
    compiled: DeviceExpr,
    projection: Option<Vec<usize>>,
    host: Arc<dyn ExecutionPlan>,
}

impl FilterOperator {
    /// `filter` on the device, or why not.
    pub fn try_new(filter: &FilterExec) -> Result<Self, Unsupported> {
        if filter.fetch().is_some() {
            return Err(Unsupported(
                "a filter with a fetch (LIMIT) stays on the host".into(),
            ));
        }
        let compiled = DeviceExpr::compile(filter.predicate(), &filter.input().schema())?;
        Ok(Self {
            predicate: filter.predicate().clone(),
            compiled,
            projection: filter.projection().as_ref().map(|p| p.to_vec()),
            host: Arc::new(filter.clone()),
        })
    }
}

impl DeviceOperator for FilterOperator {
    fn name(&self) -> &'static str {
        "DeviceFilterExec"
    }

    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.predicate)?;
        if let Some(projection) = &self.projection {
            write!(f, ", projection={projection:?}")?;
        }
        Ok(())
    }

    fn apply(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError> {
        let selection = match select(&self.compiled, &frame, cx.device) {
            Ok(selection) => selection,
            Err(e) if is_overflow(e.as_ref()) => {
                let frame = on_host_and_back(&self.host, &frame, cx)?;
                return Ok(RegionBatch::Device(frame));
            }
            Err(e) => return Err(e),
        };
        let mut frame = frame.with_selection(selection)?;
        if let Some(projection) = &self.projection {
            frame = frame.project(projection)?;
        }
        Ok(RegionBatch::Device(frame))
    }
}

/// One output column of a projection.
#[derive(Debug)]
enum Projected {
    /// An input column, passed on zero-copy.
    Input(usize),
    /// A column computed on the device.
    Computed(DeviceExpr),
}

/// `ProjectionExec` on the device: input columns passed on, others computed.
///
/// A batch where a computed column overflows the device's 64-bit lanes is projected on
/// the host by the `ProjectionExec` itself and uploaded again, as the filter's
/// (`on_host_and_back`).
#[derive(Debug)]
pub struct ProjectionOperator {
    exprs: Vec<(Arc<dyn PhysicalExpr>, String)>,
    columns: Vec<Projected>,
    schema: SchemaRef,
    host: Arc<dyn ExecutionPlan>,
}

impl ProjectionOperator {
    /// `projection` on the device, or why not.
    pub fn try_new(projection: &ProjectionExec) -> Result<Self, Unsupported> {
        let input = projection.input().schema();
        let mut exprs = Vec::new();
        let mut columns = Vec::new();
        for item in projection.projection_expr().iter() {
            exprs.push((item.expr.clone(), item.alias.clone()));
            columns.push(match item.expr.downcast_ref::<Column>() {
                Some(column) => Projected::Input(column.index()),
                None => Projected::Computed(DeviceExpr::compile(&item.expr, &input)?),
            });
        }
        Ok(Self {
            exprs,
            columns,
            schema: projection.schema(),
            host: Arc::new(projection.clone()),
        })
    }

    /// Whether it only picks and renames input columns (nothing to compute).
    pub fn picks_only(projection: &ProjectionExec) -> bool {
        projection
            .projection_expr()
            .iter()
            .all(|item| item.expr.downcast_ref::<Column>().is_some())
    }
}

impl DeviceOperator for ProjectionOperator {
    fn name(&self) -> &'static str {
        "DeviceProjectionExec"
    }

    fn only_picks(&self) -> bool {
        self.columns
            .iter()
            .all(|c| matches!(c, Projected::Input(_)))
    }

    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "expr=[")?;
        for (i, (expr, alias)) in self.exprs.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{expr} as {alias}")?;
        }
        write!(f, "]")
    }

    fn apply(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError> {
        let mut columns = Vec::with_capacity(self.columns.len());
        for column in &self.columns {
            columns.push(match column {
                Projected::Input(i) => frame
                    .column(*i)
                    .ok_or_else(|| format!("no input column {i}"))?
                    .clone(),
                Projected::Computed(expr) => match expr.evaluate(&frame, cx.device) {
                    Ok(column) => column,
                    Err(e) if is_overflow(e.as_ref()) => {
                        let frame = on_host_and_back(&self.host, &frame, cx)?;
                        return Ok(RegionBatch::Device(frame));
                    }
                    Err(e) => return Err(e),
                },
            });
        }
        let frame = DeviceFrame::try_new(
            self.schema.clone(),
            columns,
            frame.num_rows(),
            frame.selection().cloned(),
        )?;
        Ok(RegionBatch::Device(frame))
    }
}

/// `frame`'s selected rows run through `host` (the node a device operator replaces,
/// over one batch) on the host, and its output uploaded again as a frame of no pending
/// selection: a device operator's fallback for a batch it cannot compute. The batch
/// counts in `host_fallback_batches`, its bytes both ways in `bytes_from_device` and
/// `bytes_to_device`.
fn on_host_and_back(
    host: &Arc<dyn ExecutionPlan>,
    frame: &DeviceFrame,
    cx: &OperatorContext<'_>,
) -> Result<DeviceFrame, BoxError> {
    cx.host_fallback_batches.add(1);
    let mut transfer = Transfer::new(cx.device.device().clone(), TransferOptions::default());
    let batch = frame.download(&mut transfer)?;
    let output = run_on_host(host, batch)?;
    let uploaded = transfer.to_device(&output)?;
    let stats = transfer.take_stats();
    cx.bytes_from_device.add(stats.to_host.bytes as usize);
    cx.bytes_to_device.add(stats.to_device.bytes as usize);
    Ok(DeviceFrame::from_batch(uploaded))
}

/// `host` (a node of one child) over `batch` alone, by DataFusion on the host: its
/// output as one batch.
fn run_on_host(host: &Arc<dyn ExecutionPlan>, batch: RecordBatch) -> Result<RecordBatch, BoxError> {
    let source = MemorySourceConfig::try_new_exec(&[vec![batch.clone()]], batch.schema(), None)?;
    let plan = replace_children_if_necessary(host.clone(), vec![source])?;
    let batches =
        futures::executor::block_on(collect(plan.clone(), Arc::new(TaskContext::default())))?;
    Ok(concat_batches(&plan.schema(), &batches)?)
}

/// Whether `error` is (or wraps) an overflow of the device's 64-bit lanes, which the
/// host's 128-bit decimals may hold, or a value the device leaves to the host
/// (`ComputeError::HostOnly`): either way the host computes the batch.
fn is_overflow(error: &(dyn std::error::Error + 'static)) -> bool {
    wraps(error, |e| {
        matches!(e, ComputeError::Overflow(_) | ComputeError::HostOnly(_))
    })
}

/// Whether `error` is, or has among its sources, a [`ComputeError`] that `is`.
fn wraps(error: &(dyn std::error::Error + 'static), is: impl Fn(&ComputeError) -> bool) -> bool {
    ComputeError::find(error).is_some_and(is)
}

/// `AggregateExec` in `Partial` mode on the device, per batch: the groups of the
/// frame's selected rows and their partial states, read back to the host (a few rows
/// per batch), where DataFusion's final aggregate takes them as its own partial's.
///
/// A batch the device cannot group (two different long string keys of one 64-bit hash:
/// `ComputeError::KeyCollision`) or compute (an argument or key that overflows the
/// device's 64-bit lanes, or divides by zero) is aggregated on the host instead, by the
/// `AggregateExec` itself over the downloaded batch: the query never fails for it, and
/// the operator's `host_fallback_batches` metric counts those batches.
#[derive(Debug)]
pub struct PartialAggregateOperator {
    compiled: DevicePartialAggregate,
    host: Arc<dyn ExecutionPlan>,
    description: String,
}

impl PartialAggregateOperator {
    /// `aggregate` on the device, or why not.
    pub fn try_new(aggregate: &AggregateExec) -> Result<Self, Unsupported> {
        if *aggregate.mode() != AggregateMode::Partial {
            return Err(Unsupported(format!(
                "only partial aggregates run on the device, not {:?}",
                aggregate.mode()
            )));
        }
        let compiled = DevicePartialAggregate::compile(aggregate)?;
        let groups: Vec<String> = aggregate
            .group_expr()
            .expr()
            .iter()
            .map(|(e, name)| format!("{e} as {name}"))
            .collect();
        let aggregates: Vec<String> = aggregate
            .aggr_expr()
            .iter()
            .map(|a| a.name().to_string())
            .collect();
        Ok(Self {
            compiled,
            host: Arc::new(aggregate.clone()),
            description: format!(
                "mode=Partial, gby=[{}], aggr=[{}]",
                groups.join(", "),
                aggregates.join(", ")
            ),
        })
    }
}

impl DeviceOperator for PartialAggregateOperator {
    fn name(&self) -> &'static str {
        "DevicePartialAggregateExec"
    }

    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.description)
    }

    fn apply(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError> {
        match self.compiled.run(&frame, cx.device) {
            Ok(batch) => Ok(RegionBatch::Host(batch)),
            Err(e) if is_key_collision(e.as_ref()) || is_overflow(e.as_ref()) => {
                cx.host_fallback_batches.add(1);
                Ok(RegionBatch::Host(self.on_host(&frame, cx)?))
            }
            Err(e) => Err(e),
        }
    }

    fn is_terminal(&self) -> bool {
        true
    }
}

impl PartialAggregateOperator {
    /// The partial aggregate of `frame`'s selected rows by DataFusion on the host.
    fn on_host(
        &self,
        frame: &DeviceFrame,
        cx: &OperatorContext<'_>,
    ) -> Result<RecordBatch, BoxError> {
        let mut transfer = Transfer::new(cx.device.device().clone(), TransferOptions::default());
        let batch = frame.download(&mut transfer)?;
        cx.bytes_from_device
            .add(transfer.take_stats().to_host.bytes as usize);
        run_on_host(&self.host, batch)
    }
}

/// `HashJoinExec` on the device: its right child (the probe side) in the region, its
/// left child (the build side) a host plan read whole per partition (partition 0 of it
/// when the join collects its left side, else the partition's own), made into a table
/// and uploaded when the partition starts ([`DeviceOperator::bind`]), then probed frame
/// by frame with no host wait (see [`crate::compute::join`]).
///
/// An inner join whose build keys repeat makes one row per matching pair, on the
/// device too (its pair count read back once per frame).
#[derive(Debug)]
pub struct HashJoinOperator {
    compiled: DeviceHashJoin,
    host: Arc<dyn ExecutionPlan>,
    collect_left: bool,
    description: String,
    /// The partition's join, once bound.
    bound: Option<Mutex<Bound>>,
    /// The host tables of the build sides partitions share (a collected one), by those
    /// batches: the first partition builds it, the others upload it.
    tables: Mutex<Vec<SharedTable>>,
}

/// A partition's join: its table where it is (the device, or the host), and what the
/// partition's frames have moved over the link so far while it joins on the host.
#[derive(Debug)]
struct Bound {
    built: Arc<BuiltJoin>,
    /// Whether the partition joins on the host: its build side, read, was heavier to
    /// upload than the host join would move ([`HashJoinOperator::keeps_table_on_host`]).
    /// When the frames of the query's partitions have moved as many bytes as the table
    /// holds (down, then joined up again: [`JoinTable::moved_on_host`]), the table goes
    /// up and each partition joins on the device from its next frame: a wrong estimate
    /// of the probe side costs at most the table's bytes twice.
    on_host: bool,
}

/// A host table, by the (weak) batches it was built from: kept while a partition of the
/// query may still bind (the query's partitions hold the batches until they have), then
/// dropped at the next bind (the bound operators hold it as long as they run).
type SharedTable = (Weak<Vec<RecordBatch>>, Arc<JoinTable>);

impl HashJoinOperator {
    /// `join` (the node `node`) on the device, or why not.
    pub fn try_new(
        node: &Arc<dyn ExecutionPlan>,
        join: &HashJoinExec,
    ) -> Result<Self, Unsupported> {
        let compiled = DeviceHashJoin::compile(join)?;
        let on: Vec<String> = join
            .on()
            .iter()
            .map(|(l, r)| format!("({l}, {r})"))
            .collect();
        let mut description = format!(
            "mode={:?}, join_type={}, on=[{}]",
            join.partition_mode(),
            join.join_type(),
            on.join(", ")
        );
        if let Some(filter) = join.filter() {
            description.push_str(&format!(", filter={}", filter.expression()));
        }
        if let Some(projection) = &join.projection {
            let schema = join.schema();
            let names: Vec<String> = projection
                .iter()
                .zip(schema.fields())
                .map(|(i, f)| format!("{}@{i}", f.name()))
                .collect();
            description.push_str(&format!(", projection=[{}]", names.join(", ")));
        }
        Ok(Self {
            compiled,
            host: node.clone(),
            collect_left: *join.partition_mode() == PartitionMode::CollectLeft,
            description,
            bound: None,
            tables: Mutex::default(),
        })
    }

    /// The partition's join (an error before it is bound).
    fn bound(&self) -> Result<std::sync::MutexGuard<'_, Bound>, BoxError> {
        let bound = self.bound.as_ref().ok_or_else(|| {
            ComputeError::Input("a device join used before its build side".into())
        })?;
        Ok(bound.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// `frame` joined on the host, where `built`'s table is: its rows brought down
    /// (compacted), joined there, the result taken up again; with the bytes that moved.
    fn joined_on_host(
        built: &BuiltJoin,
        frame: &DeviceFrame,
        cx: &OperatorContext<'_>,
    ) -> Result<(Vec<DeviceFrame>, usize), BoxError> {
        let host = ExecDevice::cpu();
        let mut down = Transfer::new(cx.device.device().clone(), TransferOptions::default());
        let batch = frame.download(&mut down)?;
        let down = down.take_stats().to_host.bytes as usize;
        cx.bytes_from_device.add(down);
        let mut in_place = Transfer::new(host.device().clone(), TransferOptions::default());
        let frame = DeviceFrame::from_batch(in_place.to_device(&batch)?);
        let joined = built.probe(&frame, &host)?;
        let (frames, up) = Self::to_region(joined, cx)?;
        Ok((frames, down + up))
    }

    /// Run-time placement: whether `table` (a build side this partition read) weighs
    /// more to upload than the host join would move at most (its probe side brought
    /// back and its output taken up again, by DataFusion's statistics, per partition
    /// where the build side is partitioned): the rule's check at plan time
    /// ([`crate::rule`]), with the build side's true bytes for its estimate. DataFusion
    /// calls TPC-H Q18's 6M-row build side 1.5M rows at SF 1. False where the
    /// statistics say nothing of the probe side, or the table is small.
    fn keeps_table_on_host(&self, table: &JoinTable) -> bool {
        let build = table.link_bytes();
        if build <= SMALL_BUILD_SIDE {
            return false;
        }
        let Some(probe) = self.host.children().get(1).and_then(|c| link_bytes(c)) else {
            return false;
        };
        let output = link_bytes(&self.host).unwrap_or(0);
        let partitions = if self.collect_left {
            1
        } else {
            self.host.properties().partitioning.partition_count().max(1)
        };
        build > probe.saturating_add(output) / partitions
    }

    /// `frames` (made on the host) taken up to the region's device, for the operators
    /// above; with the bytes that moved.
    fn to_region(
        frames: Vec<DeviceFrame>,
        cx: &OperatorContext<'_>,
    ) -> Result<(Vec<DeviceFrame>, usize), BoxError> {
        let host = ExecDevice::cpu();
        let mut down = Transfer::new(host.device().clone(), TransferOptions::default());
        let mut up = Transfer::new(cx.device.device().clone(), TransferOptions::default());
        let frames = frames
            .iter()
            .map(|frame| {
                let batch = frame.download(&mut down)?;
                Ok(DeviceFrame::from_batch(up.to_device(&batch)?))
            })
            .collect::<Result<_, BoxError>>()?;
        let bytes = up.take_stats().to_device.bytes as usize;
        cx.bytes_to_device.add(bytes);
        Ok((frames, bytes))
    }
}

/// The frames an operator hands on for one batch.
fn handed_on(mut frames: Vec<DeviceFrame>) -> RegionBatch {
    match frames.len() {
        0 => RegionBatch::Nothing,
        1 => RegionBatch::Device(frames.remove(0)),
        _ => RegionBatch::Frames(frames),
    }
}

impl DeviceOperator for HashJoinOperator {
    fn name(&self) -> &'static str {
        "DeviceHashJoinExec"
    }

    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.description)
    }

    fn device_child(&self) -> usize {
        1
    }

    fn may_end_a_region(&self) -> bool {
        false
    }

    fn host_partition(&self, _child: usize, partition: usize) -> usize {
        if self.collect_left {
            0
        } else {
            partition
        }
    }

    fn shares_host_input(&self, _child: usize) -> bool {
        self.collect_left
    }

    fn partitions_share_state(&self) -> bool {
        self.collect_left && self.compiled.emits_build_rows()
    }

    fn bind(
        &self,
        host_inputs: Vec<Arc<Vec<RecordBatch>>>,
        cx: &mut BindContext<'_>,
    ) -> Result<Option<Arc<dyn DeviceOperator>>, BoxError> {
        let [build] = host_inputs.as_slice() else {
            return Err(ComputeError::Input(format!(
                "a join has one build side, not {}",
                host_inputs.len()
            ))
            .into());
        };
        let table = {
            // Held while a table is built: a partition of the same query waits, then
            // takes it.
            let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
            tables.retain(|(batches, _)| batches.strong_count() > 0);
            let shared = tables.iter().find_map(|(batches, table)| {
                let same = batches.upgrade().is_some_and(|b| Arc::ptr_eq(&b, build));
                same.then(|| table.clone())
            });
            match shared {
                Some(table) => table,
                None => {
                    // A collected build side is probed by every partition of the
                    // query; a join whose output is build rows emits them when the
                    // last of them ends.
                    let probes = if self.collect_left {
                        self.host.properties().partitioning.partition_count()
                    } else {
                        1
                    };
                    let table = Arc::new(self.compiled.shared_table(build.clone(), probes)?);
                    tables.push((Arc::downgrade(build), table.clone()));
                    cx.host_tables_built.add(1);
                    table
                }
            }
        };
        // Its build side read, the join may stay on the host (run-time placement).
        let on_host = cx.weigh_host_inputs && self.keeps_table_on_host(&table);
        let built = if on_host {
            cx.partitions_on_host.add(1);
            let host = ExecDevice::cpu();
            let in_place = table.on_host();
            self.compiled.bind_on(table, in_place, &host, cx.upload)?
        } else {
            // The table on the partition's device: uploaded by the query's first
            // partition there, shared by the others.
            let (on_device, uploaded) =
                table.on_device(cx.device, cx.upload, Some((cx.memory_pool, cx.partition)))?;
            cx.bytes_to_device.add(uploaded);
            self.compiled
                .bind_on(table, on_device, cx.device, cx.upload)?
        };
        let bound = Bound {
            built: Arc::new(built),
            on_host,
        };
        Ok(Some(Arc::new(Self {
            compiled: self.compiled.clone(),
            host: self.host.clone(),
            collect_left: self.collect_left,
            description: self.description.clone(),
            bound: Some(Mutex::new(bound)),
            tables: Mutex::default(),
        })))
    }

    fn bound_bytes(&self) -> usize {
        // The table's own bytes are reserved with it, shared.
        self.bound().map_or(0, |b| b.built.partition_bytes())
    }

    fn apply(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError> {
        let mut bound = self.bound()?;
        let table = bound.built.table().clone();
        if bound.on_host && table.host_joins_outweigh_it() {
            // The query's host joins have moved as many bytes as the table holds: the
            // table goes up (or is there already, by another partition), with the
            // partition's marks so far, and the partition joins on the device.
            let mut upload = Transfer::new(cx.device.device().clone(), TransferOptions::default());
            let (on_device, uploaded) =
                table.on_device(cx.device, &mut upload, Some((cx.memory_pool, cx.partition)))?;
            cx.bytes_to_device.add(uploaded);
            let built = self
                .compiled
                .moved(&bound.built, on_device, cx.device, &mut upload)?;
            *bound = Bound {
                built: Arc::new(built),
                on_host: false,
            };
        }
        if !bound.on_host {
            let built = bound.built.clone();
            drop(bound);
            return Ok(handed_on(built.probe(&frame, cx.device)?));
        }
        let (frames, bytes) = Self::joined_on_host(&bound.built, &frame, cx)?;
        table.moved_on_host(bytes);
        Ok(handed_on(frames))
    }

    fn finish(&self, cx: &OperatorContext<'_>) -> Result<Option<RegionBatch>, BoxError> {
        let bound = self.bound()?;
        let built = bound.built.clone();
        if !bound.on_host {
            drop(bound);
            return Ok(built.finish(cx.device)?.map(RegionBatch::Device));
        }
        drop(bound);
        let emitted = built.finish(&ExecDevice::cpu())?;
        let (frames, _) = Self::to_region(emitted.into_iter().collect(), cx)?;
        Ok(Some(handed_on(frames)))
    }
}

/// Whether `error` is (or wraps) the device's refusal of string keys it cannot group.
fn is_key_collision(error: &(dyn std::error::Error + 'static)) -> bool {
    wraps(error, |e| matches!(e, ComputeError::KeyCollision { .. }))
}

/// The device operator for `node`: `None` when no device operator replaces nodes of its
/// kind, `Some(Err(why))` when one does but not this node.
pub fn device_operator(
    node: &Arc<dyn ExecutionPlan>,
) -> Option<Result<Arc<dyn DeviceOperator>, Unsupported>> {
    fn boxed<T: DeviceOperator + 'static>(
        op: Result<T, Unsupported>,
    ) -> Result<Arc<dyn DeviceOperator>, Unsupported> {
        op.map(|op| Arc::new(op) as Arc<dyn DeviceOperator>)
    }
    if let Some(filter) = node.downcast_ref::<FilterExec>() {
        return Some(boxed(FilterOperator::try_new(filter)));
    }
    if let Some(projection) = node.downcast_ref::<ProjectionExec>() {
        // Picking columns is worth a device operator only inside a region (the rule
        // merges such a projection into the region below it: fewer bytes come down).
        if ProjectionOperator::picks_only(projection) {
            return None;
        }
        return Some(boxed(ProjectionOperator::try_new(projection)));
    }
    if let Some(aggregate) = node.downcast_ref::<AggregateExec>() {
        if *aggregate.mode() == AggregateMode::Partial {
            return Some(boxed(PartialAggregateOperator::try_new(aggregate)));
        }
    }
    if let Some(join) = node.downcast_ref::<HashJoinExec>() {
        return Some(boxed(HashJoinOperator::try_new(node, join)));
    }
    None
}
