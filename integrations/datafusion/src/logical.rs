//! A device step in a **logical** plan, DataFusion's way for a node of its own
//! ([`DeviceStepNode`], a `UserDefinedLogicalNode`), planned into a [`DeviceExec`] by
//! [`DeviceExtensionPlanner`] (through [`DevicePlanner`], a `QueryPlanner`), and shipped
//! in a serialized logical plan by [`DeviceLogicalCodec`]: what an engine that plans
//! elsewhere (Ballista's scheduler) needs, since it receives the logical plan.

use std::cmp::Ordering;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::{DFSchema, DFSchemaRef, Result, TableReference};
use datafusion::execution::context::QueryPlanner;
use datafusion::execution::TaskContext;
use datafusion::logical_expr::physical_planning_context::PhysicalPlanningContext;
use datafusion::logical_expr::UserDefinedLogicalNode;
use datafusion::logical_expr::{Expr, Extension, LogicalPlan, UserDefinedLogicalNodeCore};
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_planner::{DefaultPhysicalPlanner, ExtensionPlanner, PhysicalPlanner};
use datafusion_proto::logical_plan::LogicalExtensionCodec;

use crate::error::DeviceExecError;
use crate::exec::DeviceExec;
use crate::step::{DeviceStep, ExecDevice, StepOutput, StepRegistry};

/// The first line of an encoded [`DeviceStepNode`].
const HEADER: &str = "devarrow-datafusion DeviceStepNode v1";

/// `input` through the device step named `step` (a logical plan node).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceStepNode {
    input: LogicalPlan,
    step: String,
    schema: DFSchemaRef,
}

impl DeviceStepNode {
    /// `input` through `step`.
    pub fn try_new(input: LogicalPlan, step: &DeviceStep) -> Result<Self> {
        let input_schema = input.schema().clone();
        let arrow_input = Arc::new(input_schema.as_arrow().clone());
        step.upload_projection(&arrow_input)?;
        let schema = match step.output(&arrow_input) {
            StepOutput::Append(fields) => {
                let appended = DFSchema::from_unqualified_fields(fields, Default::default())?;
                Arc::new(input_schema.join(&appended)?)
            }
            StepOutput::Replace(schema) => Arc::new(DFSchema::try_from(schema.as_ref().clone())?),
        };
        Ok(Self {
            input,
            step: step.name().to_string(),
            schema,
        })
    }

    /// The step's name.
    pub fn step(&self) -> &str {
        &self.step
    }

    /// This node as a logical plan.
    pub fn into_plan(self) -> LogicalPlan {
        LogicalPlan::Extension(Extension {
            node: Arc::new(self),
        })
    }
}

impl PartialOrd for DeviceStepNode {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        match self.step.partial_cmp(&other.step)? {
            Ordering::Equal => self.input.partial_cmp(&other.input),
            other => Some(other),
        }
    }
}

impl UserDefinedLogicalNodeCore for DeviceStepNode {
    fn name(&self) -> &str {
        "DeviceStep"
    }

    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![&self.input]
    }

    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }

    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }

    fn fmt_for_explain(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "DeviceStep: step={}", self.step)
    }

    fn with_exprs_and_inputs(
        &self,
        _exprs: Vec<Expr>,
        mut inputs: Vec<LogicalPlan>,
    ) -> Result<Self> {
        if inputs.len() != 1 {
            return Err(DeviceExecError::Codec(format!(
                "a DeviceStep node has one input, not {}",
                inputs.len()
            ))
            .into());
        }
        Ok(Self {
            input: inputs.swap_remove(0),
            step: self.step.clone(),
            schema: self.schema.clone(),
        })
    }

    fn supports_limit_pushdown(&self) -> bool {
        true
    }
}

/// Plans [`DeviceStepNode`]s into [`DeviceExec`]s running on `device`, their steps taken
/// from `registry`.
#[derive(Debug, Clone)]
pub struct DeviceExtensionPlanner {
    registry: Arc<StepRegistry>,
    device: ExecDevice,
}

impl DeviceExtensionPlanner {
    /// A planner for steps of `registry` on `device`.
    pub fn new(registry: Arc<StepRegistry>, device: ExecDevice) -> Self {
        Self { registry, device }
    }
}

#[async_trait]
impl ExtensionPlanner for DeviceExtensionPlanner {
    async fn plan_extension(
        &self,
        _planner: &dyn PhysicalPlanner,
        node: &dyn UserDefinedLogicalNode,
        _logical_inputs: &[&LogicalPlan],
        physical_inputs: &[Arc<dyn ExecutionPlan>],
        _session: &dyn Session,
        _planning_ctx: &PhysicalPlanningContext,
    ) -> Result<Option<Arc<dyn ExecutionPlan>>> {
        let Some(node) = node.as_any().downcast_ref::<DeviceStepNode>() else {
            return Ok(None);
        };
        let step = self.registry.get(node.step())?;
        let exec = DeviceExec::try_new(physical_inputs[0].clone(), step, self.device.clone())?;
        Ok(Some(Arc::new(exec)))
    }
}

/// DataFusion's physical planner with [`DeviceExtensionPlanner`].
#[derive(Debug, Clone)]
pub struct DevicePlanner {
    extension: Arc<DeviceExtensionPlanner>,
}

impl DevicePlanner {
    /// A query planner for steps of `registry` on `device`.
    pub fn new(registry: Arc<StepRegistry>, device: ExecDevice) -> Self {
        Self {
            extension: Arc::new(DeviceExtensionPlanner::new(registry, device)),
        }
    }
}

#[async_trait]
impl QueryPlanner for DevicePlanner {
    async fn create_physical_plan(
        &self,
        logical_plan: &LogicalPlan,
        session: &dyn Session,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        DefaultPhysicalPlanner::with_extension_planners(vec![self.extension.clone()])
            .create_physical_plan(logical_plan, session)
            .await
    }
}

/// Encodes and decodes [`DeviceStepNode`]s (the step's name); everything else goes to
/// `inner` (an engine's own codec, such as Ballista's).
#[derive(Debug)]
pub struct DeviceLogicalCodec {
    registry: Arc<StepRegistry>,
    inner: Arc<dyn LogicalExtensionCodec>,
}

impl DeviceLogicalCodec {
    /// A codec for steps of `registry`, passing other nodes to `inner`.
    pub fn new(registry: Arc<StepRegistry>, inner: Arc<dyn LogicalExtensionCodec>) -> Self {
        Self { registry, inner }
    }
}

impl LogicalExtensionCodec for DeviceLogicalCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[LogicalPlan],
        ctx: &TaskContext,
    ) -> Result<Extension> {
        let Some(rest) = buf
            .strip_prefix(HEADER.as_bytes())
            .and_then(|r| r.strip_prefix(b"\nstep="))
        else {
            return self.inner.try_decode(buf, inputs, ctx);
        };
        let name = std::str::from_utf8(rest)
            .map_err(|_| DeviceExecError::Codec("a step name that is not UTF-8".into()))?
            .trim_end();
        let [input] = inputs else {
            return Err(DeviceExecError::Codec(format!(
                "a DeviceStep node has one input, this one {}",
                inputs.len()
            ))
            .into());
        };
        let step = self.registry.get(name)?;
        Ok(Extension {
            node: Arc::new(DeviceStepNode::try_new(input.clone(), &step)?),
        })
    }

    fn try_encode(&self, node: &Extension, buf: &mut Vec<u8>) -> Result<()> {
        match node.node.as_any().downcast_ref::<DeviceStepNode>() {
            Some(ours) => {
                buf.extend_from_slice(format!("{HEADER}\nstep={}\n", ours.step()).as_bytes());
                Ok(())
            }
            None => self.inner.try_encode(node, buf),
        }
    }

    fn try_decode_table_provider(
        &self,
        buf: &[u8],
        table_ref: &TableReference,
        schema: arrow_schema::SchemaRef,
        ctx: &TaskContext,
    ) -> Result<Arc<dyn TableProvider>> {
        self.inner
            .try_decode_table_provider(buf, table_ref, schema, ctx)
    }

    fn try_encode_table_provider(
        &self,
        table_ref: &TableReference,
        node: Arc<dyn TableProvider>,
        buf: &mut Vec<u8>,
    ) -> Result<()> {
        self.inner.try_encode_table_provider(table_ref, node, buf)
    }

    fn try_decode_file_format(
        &self,
        buf: &[u8],
        ctx: &TaskContext,
    ) -> Result<Arc<dyn datafusion::datasource::file_format::FileFormatFactory>> {
        self.inner.try_decode_file_format(buf, ctx)
    }

    fn try_encode_file_format(
        &self,
        buf: &mut Vec<u8>,
        node: Arc<dyn datafusion::datasource::file_format::FileFormatFactory>,
    ) -> Result<()> {
        self.inner.try_encode_file_format(buf, node)
    }
}
