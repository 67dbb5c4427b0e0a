//! [`DeviceLoadExec`]: host batches onto the device.

use std::fmt;
use std::sync::Arc;

use arrow_schema::SchemaRef;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{internal_err, Result, Statistics};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::execution_plan::CardinalityEffect;
use datafusion::physical_plan::metrics::{ExecutionPlanMetricsSet, MetricsSet};
use datafusion::physical_plan::statistics::{ChildStats, StatisticsArgs};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};

use crate::config::DevicePlacement;

use super::run;

/// The start of a device region: each partition of its host child onto a device.
///
/// - Pipelined: a thread of the partition pulls the child's batches and uploads them,
///   up to `devarrow.read_ahead` batches ahead of the region's operators (a bounded
///   queue: slow operators hold the child back), on the stream of a device slot it holds for
///   that upload only.
/// - Coalescing: it gathers the child's batches up to `devarrow.batch_bytes` (32 MiB by
///   default) before one upload, so the operators see few large batches (one kernel
///   launch and one event per batch, not per 8,192 rows).
/// - The device is chosen when the partition runs ([`DevicePlacement`]: the session's
///   `devarrow.devices` by default), and the bytes in flight are reserved in the task's
///   `MemoryPool` (a refusal fails the partition with `DeviceExecError::Memory`).
///
/// It moves data and computes nothing: its properties are its child's (same schema,
/// rows, order and partitioning; only the batch boundaries change).
#[derive(Debug, Clone)]
pub struct DeviceLoadExec {
    input: Arc<dyn ExecutionPlan>,
    placement: DevicePlacement,
    metrics: ExecutionPlanMetricsSet,
}

impl DeviceLoadExec {
    /// `input` onto the devices of the session (`devarrow.devices`).
    pub fn new(input: Arc<dyn ExecutionPlan>) -> Self {
        Self::with_placement(input, DevicePlacement::FromSession)
    }

    /// `input` onto the devices of `placement`.
    pub fn with_placement(input: Arc<dyn ExecutionPlan>, placement: DevicePlacement) -> Self {
        Self {
            input,
            placement,
            metrics: ExecutionPlanMetricsSet::new(),
        }
    }

    /// The host child.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }

    /// Where its partitions run.
    pub fn placement(&self) -> &DevicePlacement {
        &self.placement
    }

    pub(crate) fn metrics_set(&self) -> &ExecutionPlanMetricsSet {
        &self.metrics
    }
}

impl DisplayAs for DeviceLoadExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let devices = match &self.placement {
            DevicePlacement::FromSession => "session".to_string(),
            DevicePlacement::Pools(pools) => pools
                .iter()
                .map(|p| p.id().to_string())
                .collect::<Vec<_>>()
                .join(","),
        };
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => {
                write!(f, "DeviceLoadExec: host->device, devices={devices}")
            }
            DisplayFormatType::TreeRender => write!(f, "devices={devices}"),
        }
    }
}

impl ExecutionPlan for DeviceLoadExec {
    fn name(&self) -> &str {
        "DeviceLoadExec"
    }

    fn schema(&self) -> SchemaRef {
        self.input.schema()
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        self.input.properties()
    }

    fn maintains_input_order(&self) -> Vec<bool> {
        vec![true]
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
            return internal_err!("DeviceLoadExec takes one child");
        }
        Ok(Arc::new(Self {
            input: children.swap_remove(0),
            placement: self.placement.clone(),
            metrics: ExecutionPlanMetricsSet::new(),
        }))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        // Executed on its own: up and down again (a region of no operator).
        let me: Arc<dyn ExecutionPlan> = Arc::new(self.clone());
        run::execute_region(&me, None, partition, context)
    }

    fn metrics(&self) -> Option<MetricsSet> {
        Some(self.metrics.clone_inner())
    }

    fn child_stats_requests(&self, partition: Option<usize>) -> Vec<ChildStats> {
        vec![ChildStats::At(partition)]
    }

    fn statistics_from_inputs(
        &self,
        input_stats: &[Arc<Statistics>],
        _args: &StatisticsArgs,
    ) -> Result<Arc<Statistics>> {
        Ok(input_stats[0].clone())
    }

    fn cardinality_effect(&self) -> CardinalityEffect {
        CardinalityEffect::Equal
    }
}
