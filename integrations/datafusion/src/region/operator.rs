//! [`DeviceOperator`], what a device operator does to a frame, and
//! [`DeviceOperatorExec`], its plan node.

use std::fmt;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::memory_pool::MemoryPool;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::OrderingRequirements;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::distribution_requirements::InputDistributionRequirements;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::execution_plan::CardinalityEffect;
use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

use devarrow::bridge::Transfer;

use crate::error::BoxError;
use crate::frame::DeviceFrame;
use crate::step::ExecDevice;

use super::host_twin;
use super::run::{self, SharedInputs};

/// What an operator hands on: a frame still on the device, or (a terminal operator's,
/// such as a partial aggregate reading its small result back) a host batch.
#[derive(Debug)]
pub enum RegionBatch {
    /// On the device.
    Device(DeviceFrame),
    /// On the host: the region's output for this batch.
    Host(RecordBatch),
    /// Nothing for this batch: the operator keeps what it learned of it for the end of
    /// the partition ([`DeviceOperator::finish`]), as a left semi join marks the build
    /// rows it matched.
    Nothing,
    /// Several frames for this batch, each on through the operators above in turn: a
    /// right or full join with a filter hands on its pairs that passed it, then the
    /// probe rows with none (their build columns null).
    Frames(Vec<DeviceFrame>),
}

/// What an operator sees when it is bound to a partition ([`DeviceOperator::bind`]).
#[derive(Debug)]
pub struct BindContext<'a> {
    /// The partition.
    pub partition: usize,
    /// The device, with the slot's own stream on CUDA.
    pub device: &'a ExecDevice,
    /// The slot's upload `Transfer` (pipelined, pinned staging).
    pub upload: &'a mut Transfer,
    /// Host tables (a join's) the operator built for this partition rather than took
    /// from another partition of the query (the operator's `host_tables_built` metric).
    pub host_tables_built: &'a Count,
    /// The bytes the operator uploaded for this partition (a join's table, counted by
    /// the partition that uploads it for the device: the operator's `bytes_to_device`).
    pub bytes_to_device: &'a Count,
    /// The query's memory pool, for device memory the query's partitions share (a
    /// join's table on one device).
    pub memory_pool: &'a Arc<dyn MemoryPool>,
    /// Whether the operator may run on the host when its host inputs, now read, turn
    /// out heavier to upload than the statistics said (a join's build side: run-time
    /// placement). False with `devarrow.always_place_joins`.
    pub weigh_host_inputs: bool,
    /// Partitions the operator ran on the host for that (its `partitions_on_host`
    /// metric).
    pub partitions_on_host: &'a Count,
}

/// What an operator sees besides its frame.
#[derive(Debug)]
pub struct OperatorContext<'a> {
    /// The partition.
    pub partition: usize,
    /// The batch of the partition (0-based, as the region's load made them).
    pub batch: usize,
    /// The device, with the slot's own stream on CUDA: kernels go there.
    pub device: &'a ExecDevice,
    /// Batches an operator computed on the host instead (the operator's
    /// `host_fallback_batches` metric).
    pub host_fallback_batches: &'a Count,
    /// The bytes the operator itself moved to the device (a computation on the host:
    /// its output taken up; the operator's `bytes_to_device` metric).
    pub bytes_to_device: &'a Count,
    /// The bytes the operator itself brought down (a computation on the host: its input;
    /// the operator's `bytes_from_device` metric).
    pub bytes_from_device: &'a Count,
    /// The query's memory pool (a join's table uploaded while the partition runs).
    pub memory_pool: &'a Arc<dyn MemoryPool>,
}

/// A device operator: one host node's computation on device frames.
pub trait DeviceOperator: fmt::Debug + Send + Sync {
    /// The node's name in plans (`DeviceFilterExec`, ...).
    fn name(&self) -> &'static str;

    /// Its parameters, as `EXPLAIN` shows them after the name.
    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result;

    /// Runs on one frame of the partition. A terminal operator returns
    /// [`RegionBatch::Host`]; the others return [`RegionBatch::Device`] (or
    /// [`RegionBatch::Frames`], [`RegionBatch::Nothing`]).
    fn apply(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError>;

    /// What it emits once the partition's input has ended (after its last frame), on
    /// through the operators above it: a join whose output is build rows (left semi,
    /// anti and outer joins) emits them here. `None` (the default): nothing.
    ///
    /// # Errors
    /// The operator's.
    fn finish(&self, _cx: &OperatorContext<'_>) -> Result<Option<RegionBatch>, BoxError> {
        Ok(None)
    }

    /// Whether its output is on the host (the region ends with it).
    fn is_terminal(&self) -> bool {
        false
    }

    /// Whether it is worth running on the device as the region's last operator, its
    /// output going straight back to the host. A join is not: its output is its probe
    /// rows widened by build columns, and uploading its inputs only to bring that back
    /// moves more bytes than the host join moves none; the rule leaves such a join on
    /// the host (a join stays on the device where a device operator takes its output).
    fn may_end_a_region(&self) -> bool {
        true
    }

    /// Whether it only picks (and renames) input columns: the rule looks through it for
    /// the operator below when it decides where a region ends.
    fn only_picks(&self) -> bool {
        false
    }

    /// Which child of the host node it replaces runs on the device (the chain goes
    /// through it); its other children stay host plans that the operator reads whole
    /// per partition ([`DeviceOperator::bind`]), as a join reads its build side. 0 for a
    /// node of one child.
    fn device_child(&self) -> usize {
        0
    }

    /// The partition of host child `child` that partition `partition` reads (a join
    /// that collects its build side reads partition 0, one partitioned reads its own).
    fn host_partition(&self, _child: usize, partition: usize) -> usize {
        partition
    }

    /// Whether every partition reads the same batches of host child `child` (a join
    /// that collects its build side): they are then read once per query, by the first
    /// partition that needs them, and shared.
    fn shares_host_input(&self, _child: usize) -> bool {
        false
    }

    /// Whether its partitions share state beyond their host inputs, so that a query's
    /// partitions must run in one plan of one process: a join that collects its build
    /// side and emits build rows when the last partition ends (left semi, anti and outer
    /// joins). The rule keeps such an operator on the host where partitions run as
    /// separate plans (Ballista's tasks).
    fn partitions_share_state(&self) -> bool {
        false
    }

    /// The operator bound to one partition, given the batches of its host children
    /// (one list per host child, in child order; the same `Arc` for every partition of a
    /// query where the child is shared, [`DeviceOperator::shares_host_input`]): a join
    /// builds its table and uploads it here, once per partition, before the partition's
    /// first frame. `None` (the
    /// default, for an operator without host children): the operator itself.
    ///
    /// # Errors
    /// The operator's.
    fn bind(
        &self,
        _host_inputs: Vec<Arc<Vec<RecordBatch>>>,
        _cx: &mut BindContext<'_>,
    ) -> Result<Option<Arc<dyn DeviceOperator>>, BoxError> {
        Ok(None)
    }

    /// The device memory a bound operator holds for its partition (a join's table),
    /// reserved in the partition's `MemoryPool` for as long as the partition runs.
    fn bound_bytes(&self) -> usize {
        0
    }
}

/// A device operator's node: its operator, its device child, its host children (a
/// join's build side; none for most operators), and its host twin (the host node it
/// replaces, over the host twins of its children), whose properties it declares.
///
/// Its children are in the host twin's order: the device child at the operator's
/// [`DeviceOperator::device_child`], the host children around it.
#[derive(Debug, Clone)]
pub struct DeviceOperatorExec {
    operator: Arc<dyn DeviceOperator>,
    children: Vec<Arc<dyn ExecutionPlan>>,
    host_twin: Arc<dyn ExecutionPlan>,
    metrics: ExecutionPlanMetricsSet,
    shared: Arc<SharedInputs>,
}

impl DeviceOperatorExec {
    /// `operator` over `input` (a node on the device), standing for `host_twin`.
    ///
    /// # Errors
    /// An internal error when `input` is not on the device, or its schema is not the
    /// host twin's input's.
    pub fn try_new(
        operator: Arc<dyn DeviceOperator>,
        input: Arc<dyn ExecutionPlan>,
        host_twin: Arc<dyn ExecutionPlan>,
    ) -> Result<Self> {
        Self::with_children(operator, vec![input], host_twin)
    }

    /// `operator` over `children` (in its host twin's order: the one at the operator's
    /// [`DeviceOperator::device_child`] on the device, the others host plans), standing
    /// for `host_twin`.
    ///
    /// # Errors
    /// An internal error when the device child is not on the device, a host child is,
    /// or a child's schema is not that of the host twin's child at its place.
    pub fn with_children(
        operator: Arc<dyn DeviceOperator>,
        children: Vec<Arc<dyn ExecutionPlan>>,
        host_twin: Arc<dyn ExecutionPlan>,
    ) -> Result<Self> {
        let at = operator.device_child();
        let twin_inputs = host_twin.children();
        if twin_inputs.len() != children.len() || at >= children.len() {
            return internal_err!(
                "{}'s host twin {} takes {} children, the operator is given {}",
                operator.name(),
                host_twin.name(),
                twin_inputs.len(),
                children.len()
            );
        }
        for (i, (child, twin_child)) in children.iter().zip(&twin_inputs).enumerate() {
            if super::is_on_device(child) != (i == at) {
                return internal_err!(
                    "{} takes its child {i} {}, not {}",
                    operator.name(),
                    if i == at {
                        "on the device"
                    } else {
                        "on the host"
                    },
                    child.name()
                );
            }
            if child.schema() != twin_child.schema() {
                return internal_err!(
                    "{}'s host twin {} does not take its child {i}'s schema",
                    operator.name(),
                    host_twin.name()
                );
            }
        }
        Ok(Self {
            operator,
            children,
            host_twin,
            metrics: ExecutionPlanMetricsSet::new(),
            shared: Arc::default(),
        })
    }

    /// The batches of host children its partitions share (`shares_host_input`).
    pub(crate) fn shared_inputs(&self) -> &SharedInputs {
        &self.shared
    }

    /// The operator.
    pub fn operator(&self) -> &Arc<dyn DeviceOperator> {
        &self.operator
    }

    /// The child on the device.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.children[self.operator.device_child()]
    }

    /// The host children (a join's build side), in child order, with their index among
    /// the node's children.
    pub fn host_inputs(&self) -> impl Iterator<Item = (usize, &Arc<dyn ExecutionPlan>)> {
        let at = self.operator.device_child();
        self.children
            .iter()
            .enumerate()
            .filter(move |(i, _)| *i != at)
    }

    /// The host node it stands for.
    pub fn host_twin(&self) -> &Arc<dyn ExecutionPlan> {
        &self.host_twin
    }

    pub(crate) fn metrics_set(&self) -> &ExecutionPlanMetricsSet {
        &self.metrics
    }
}

impl DisplayAs for DeviceOperatorExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => {
                write!(f, "{}: ", self.operator.name())?;
                self.operator.fmt_params(f)
            }
            DisplayFormatType::TreeRender => self.operator.fmt_params(f),
        }
    }
}

impl ExecutionPlan for DeviceOperatorExec {
    fn name(&self) -> &str {
        self.operator.name()
    }

    fn schema(&self) -> SchemaRef {
        self.host_twin.schema()
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.host_twin.properties()
    }

    fn input_distribution_requirements(&self) -> InputDistributionRequirements {
        self.host_twin.input_distribution_requirements()
    }

    fn required_input_ordering(&self) -> Vec<Option<OrderingRequirements>> {
        self.host_twin.required_input_ordering()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        self.host_twin.maintains_input_order()
    }

    fn benefits_from_input_partitioning(&self) -> Vec<bool> {
        vec![false; self.children.len()]
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        self.children.iter().collect()
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.host_twin.apply_expressions(f)
    }

    fn with_new_children(
        self: Arc<Self>,
        children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let at = self.operator.device_child();
        if children.len() != self.children.len() {
            return internal_err!(
                "{} takes {} children",
                self.operator.name(),
                self.children.len()
            );
        }
        if !super::is_on_device(&children[at])
            || children
                .iter()
                .enumerate()
                .any(|(i, c)| i != at && super::is_on_device(c))
        {
            // A rewrite put a host node under this one where its device child was
            // (DataFusion's EnforceDistribution does, to probe a plan with a
            // `CoalescePartitionsExec`), or a device node where a host child was: the
            // node becomes its host twin, which computes the same rows on the host, over
            // those children (a child on the device through an unload).
            let mut host = Vec::with_capacity(children.len());
            for child in children {
                host.push(if super::is_on_device(&child) {
                    Arc::new(super::DeviceUnloadExec::try_new(child)?) as Arc<dyn ExecutionPlan>
                } else {
                    child
                });
            }
            return replace_children_if_necessary(self.host_twin.clone(), host);
        }
        let twins: Vec<_> = children.iter().map(host_twin).collect();
        let twin = replace_children_if_necessary(self.host_twin.clone(), twins)?;
        Ok(Arc::new(Self::with_children(
            self.operator.clone(),
            children,
            twin,
        )?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        // Executed on its own (not under an unload): the region ends here.
        let me: Arc<dyn ExecutionPlan> = Arc::new(self.clone());
        run::execute_region(&me, None, partition, context)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    /// The host twin's statistics: its child stands for this node's child, so the
    /// statistics asked of this node's child are those the twin would ask of its own.
    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        self.host_twin.child_stats_requests(partition)
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        self.host_twin.statistics_from_inputs(input_stats, args)
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        self.host_twin.cardinality_effect()
    }
}
