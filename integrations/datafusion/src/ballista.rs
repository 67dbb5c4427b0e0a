//! Device regions under Ballista's adaptive planner: the executor places them.
//!
//! Ballista 55's adaptive planner (on by default) plans each stage with a rule list of
//! its own, so the session's [`DevicePlacementRule`] never runs in the scheduler. A
//! [`DevicePlacementEngine`] runs it in the executor instead: Ballista hands every task's
//! stage plan to its executor's [`ExecutionEngine`], and this one places the device
//! regions in the plan under the stage's shuffle writer before Ballista's own engine runs
//! it. The scheduler and the client plan with no device, as always; the executor with
//! the GPUs decides, with the options the client's session sent (`devarrow.*`, which its
//! config producer must know: [`DevarrowConfig`](crate::DevarrowConfig)).
//!
//! ```no_run
//! use std::sync::Arc;
//! use ballista_executor::executor_process::{start_executor_process, ExecutorProcessConfig};
//! use datafusion::prelude::SessionConfig;
//! use devarrow_datafusion::ballista::DevicePlacementEngine;
//! use devarrow_datafusion::DevarrowConfig;
//!
//! # async fn run() -> ballista_core::error::Result<()> {
//! use ballista::prelude::SessionConfigExt;
//! let config = SessionConfig::new_with_ballista().with_option_extension(DevarrowConfig::default());
//! let executor = ExecutorProcessConfig {
//!     override_execution_engine: Some(Arc::new(DevicePlacementEngine::default())),
//!     override_config_producer: Some(Arc::new(move || config.clone())),
//!     ..Default::default()
//! };
//! start_executor_process(Arc::new(executor)).await
//! # }
//! ```
//!
//! A stage the scheduler placed regions in already (Ballista's static planner, which
//! runs the session's rules) runs as it came.

use std::sync::Arc;

use ballista_core::JobId;
use ballista_executor::execution_engine::{
    DefaultExecutionEngine, ExecutionEngine, QueryStageExecutor,
};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::error::Result;
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::prelude::SessionConfig;

use crate::region::{DeviceLoadExec, DeviceOperatorExec, DeviceUnloadExec};
use crate::rule::{DevicePlacementRule, HostOnlyExec};

/// A Ballista executor's [`ExecutionEngine`] that places device regions in each stage
/// plan it runs ([`DevicePlacementRule`]), then hands the plan to another engine
/// (Ballista's [`DefaultExecutionEngine`] unless [`DevicePlacementEngine::new`] is
/// given one). See the [module](self).
pub struct DevicePlacementEngine {
    rule: DevicePlacementRule,
    inner: Arc<dyn ExecutionEngine>,
}

impl std::fmt::Debug for DevicePlacementEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePlacementEngine")
            .field("rule", &self.rule)
            .finish_non_exhaustive()
    }
}

impl Default for DevicePlacementEngine {
    /// devarrow's operators, then Ballista's default engine.
    fn default() -> Self {
        Self::new(
            DevicePlacementRule::default(),
            Arc::new(DefaultExecutionEngine::new()),
        )
    }
}

impl DevicePlacementEngine {
    /// `rule` placing the regions, `inner` running the stages.
    pub fn new(rule: DevicePlacementRule, inner: Arc<dyn ExecutionEngine>) -> Self {
        Self { rule, inner }
    }

    /// `plan` (a stage: a shuffle writer over the stage's plan) with device regions
    /// placed under its root, with the task's options; as it is where it has devarrow
    /// nodes already.
    pub fn place(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        config: &SessionConfig,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if has_device_nodes(&plan)? {
            return Ok(plan);
        }
        let children: Vec<Arc<dyn ExecutionPlan>> = plan.children().into_iter().cloned().collect();
        if children.is_empty() {
            return self.rule.optimize(plan, config.options());
        }
        let placed = children
            .into_iter()
            .map(|child| self.rule.optimize(child, config.options()))
            .collect::<Result<Vec<_>>>()?;
        replace_children_if_necessary(plan, placed)
    }
}

/// Whether `plan` holds a node of devarrow's placement (a region or a host-only marker).
fn has_device_nodes(plan: &Arc<dyn ExecutionPlan>) -> Result<bool> {
    let mut found = false;
    plan.apply(|node| {
        found = node.downcast_ref::<DeviceLoadExec>().is_some()
            || node.downcast_ref::<DeviceUnloadExec>().is_some()
            || node.downcast_ref::<DeviceOperatorExec>().is_some()
            || node.downcast_ref::<HostOnlyExec>().is_some();
        Ok(if found {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    Ok(found)
}

impl ExecutionEngine for DevicePlacementEngine {
    fn create_query_stage_exec(
        &self,
        job_id: JobId,
        stage_id: usize,
        task_id: usize,
        global_output_partition_ids: Vec<usize>,
        plan: Arc<dyn ExecutionPlan>,
        work_dir: &str,
        config: &SessionConfig,
    ) -> Result<Arc<dyn QueryStageExecutor>> {
        let plan = self.place(plan, config)?;
        self.inner.create_query_stage_exec(
            job_id,
            stage_id,
            task_id,
            global_output_partition_ids,
            plan,
            work_dir,
            config,
        )
    }
}
