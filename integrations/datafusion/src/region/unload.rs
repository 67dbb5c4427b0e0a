//! [`DeviceUnloadExec`]: a region's output back to the host.

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

use super::{is_on_device, run};

/// The end of a device region: runs the region's chain for each partition (the load,
/// then each operator on the device, handing frames from one to the next) and brings
/// its output back to the host, into pinned memory the batches own (devarrow's
/// `Transfer`, a warm one per device slot).
///
/// Its partition streams never block a tokio worker: uploads, operators and downloads
/// run on two threads of the partition, and the stream only takes finished batches off
/// a channel. Dropping the stream stops those threads without waiting for them; they
/// free the partition's device memory and its device slot as they end.
///
/// Metrics: `output_rows`, `elapsed_compute` (the operators and the download),
/// `bytes_from_device`, `pageable_downloads` (batches that landed in pageable memory
/// through staging: the device pool's pinned memory had no room), `unload_time` (the
/// downloads), `load_wait` (time the operators
/// waited for the next uploaded batch: the child's work and the upload, where
/// read-ahead did not hide them). The load's and each operator's own metrics are on
/// their nodes.
#[derive(Debug, Clone)]
pub struct DeviceUnloadExec {
    input: Arc<dyn ExecutionPlan>,
    metrics: ExecutionPlanMetricsSet,
}

impl DeviceUnloadExec {
    /// The region ending at `input` (a node on the device).
    ///
    /// # Errors
    /// An internal error when `input` is not on the device.
    pub fn try_new(input: Arc<dyn ExecutionPlan>) -> Result<Self> {
        if !is_on_device(&input) {
            return internal_err!(
                "DeviceUnloadExec takes a child on the device, not {}",
                input.name()
            );
        }
        Ok(Self {
            input,
            metrics: ExecutionPlanMetricsSet::new(),
        })
    }

    /// The region's top node.
    pub fn input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.input
    }
}

impl DisplayAs for DeviceUnloadExec {
    fn fmt_as(&self, t: DisplayFormatType, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match t {
            DisplayFormatType::Default | DisplayFormatType::Verbose => {
                write!(f, "DeviceUnloadExec: device->host")
            }
            DisplayFormatType::TreeRender => write!(f, "device->host"),
        }
    }
}

impl ExecutionPlan for DeviceUnloadExec {
    fn name(&self) -> &str {
        "DeviceUnloadExec"
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
            return internal_err!("DeviceUnloadExec takes one child");
        }
        let input = children.swap_remove(0);
        if !is_on_device(&input) {
            // A rewrite put a host node under the unload: nothing is left to bring back.
            return Ok(input);
        }
        Ok(Arc::new(Self::try_new(input)?))
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        run::execute_region(&self.input, Some(&self.metrics), partition, context)
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
