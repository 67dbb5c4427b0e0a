//! [`DeviceOperator`], what a device operator does to a frame, and
//! [`DeviceOperatorExec`], its plan node.

use std::fmt;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::OrderingRequirements;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::distribution_requirements::InputDistributionRequirements;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::execution_plan::CardinalityEffect;
use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

use crate::error::BoxError;
use crate::frame::DeviceFrame;
use crate::step::ExecDevice;

use super::{host_twin, run};

/// What an operator hands on: a frame still on the device, or (a terminal operator's,
/// such as a partial aggregate reading its small result back) a host batch.
#[derive(Debug)]
pub enum RegionBatch {
    /// On the device.
    Device(DeviceFrame),
    /// On the host: the region's output for this batch.
    Host(RecordBatch),
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
}

/// A device operator: one host node's computation on device frames.
pub trait DeviceOperator: fmt::Debug + Send + Sync {
    /// The node's name in plans (`DeviceFilterExec`, ...).
    fn name(&self) -> &'static str;

    /// Its parameters, as `EXPLAIN` shows them after the name.
    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result;

    /// Runs on one frame of the partition. A terminal operator returns
    /// [`RegionBatch::Host`]; the others return [`RegionBatch::Device`].
    fn apply(&self, frame: DeviceFrame, cx: &OperatorContext<'_>) -> Result<RegionBatch, BoxError>;

    /// Whether its output is on the host (the region ends with it).
    fn is_terminal(&self) -> bool {
        false
    }
}

/// A device operator's node: its operator, its device child, and its host twin (the
/// host node it replaces, over the host twins of its children), whose properties it
/// declares.
#[derive(Debug, Clone)]
pub struct DeviceOperatorExec {
    operator: Arc<dyn DeviceOperator>,
    input: Arc<dyn ExecutionPlan>,
    host_twin: Arc<dyn ExecutionPlan>,
    metrics: ExecutionPlanMetricsSet,
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
        if !super::is_on_device(&input) {
            return internal_err!(
                "{} takes a child on the device, not {}",
                operator.name(),
                input.name()
            );
        }
        let twin_inputs = host_twin.children();
        if twin_inputs.len() != 1 || twin_inputs[0].schema() != input.schema() {
            return internal_err!(
                "{}'s host twin {} does not take its child's schema",
                operator.name(),
                host_twin.name()
            );
        }
        Ok(Self {
            operator,
            input,
            host_twin,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// The operator.
    pub fn operator(&self) -> &Arc<dyn DeviceOperator> {
        &self.operator
    }

    /// The child, on the device.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
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
        vec![false]
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        vec![&self.input]
    }

    fn apply_expressions(
        &self,
        f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        self.host_twin.apply_expressions(f)
    }

    fn with_new_children(
        self: Arc<Self>,
        mut children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if children.len() != 1 {
            return internal_err!("{} takes one child", self.operator.name());
        }
        let input = children.swap_remove(0);
        if !super::is_on_device(&input) {
            // A rewrite put a host node under this one (DataFusion's EnforceDistribution
            // does, to probe a plan with a `CoalescePartitionsExec`): the operator's
            // input is no longer on the device, so the node becomes its host twin,
            // which computes the same rows on the host.
            return replace_children_if_necessary(self.host_twin.clone(), vec![input]);
        }
        let twin = replace_children_if_necessary(self.host_twin.clone(), vec![host_twin(&input)])?;
        Ok(Arc::new(Self::try_new(self.operator.clone(), input, twin)?))
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
