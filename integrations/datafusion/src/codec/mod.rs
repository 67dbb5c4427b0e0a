//! [`DeviceExecCodec`]: a [`DeviceExec`] in a serialized physical plan (DataFusion's
//! protobuf plans, as Ballista ships them to executors).
//!
//! Device regions travel too: a [`DeviceLoadExec`](crate::DeviceLoadExec) and a
//! [`DeviceUnloadExec`](crate::DeviceUnloadExec) carry nothing (devices are chosen where
//! the plan runs), a [`HostOnlyExec`](crate::HostOnlyExec) its reason, and a
//! [`DeviceOperatorExec`](crate::DeviceOperatorExec) its operator's parameters: its host
//! twin, as DataFusion's own protobuf, over a placeholder child. The receiving process
//! rebuilds the operator from the twin with its own registry, for its own devices.
//! Decoding never panics on bytes off the wire: anything malformed is
//! `DeviceExecError::Codec` (`fuzz/` holds the fuzz target, `tests/codec_fuzz.rs` runs
//! its body on mutations of real encodings).
//!
//! The `DeviceExec` node carries the step's **name** and the read-ahead, never code or a device:
//! each process decodes it with its own codec, which looks the step up in its
//! [`StepRegistry`] and runs it on its own device (`cuda:N` on a GPU executor, `cpu`
//! elsewhere).

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};

use crate::error::DeviceExecError;
use crate::exec::DeviceExec;
use crate::rule::DeviceOperatorRegistry;
use crate::step::{ExecDevice, StepRegistry};

mod region;

/// The first line of an encoded node: what it is, and the version of the encoding.
const HEADER: &str = "devarrow-datafusion DeviceExec v1";

/// Encodes and decodes [`DeviceExec`] nodes; decoded nodes run their step from
/// `registry` on `device`. Other nodes go to the fallback codec, if any (an engine's own:
/// Ballista's, for its shuffle nodes), else are an error.
///
/// # Example
///
/// A plan serialized by a client and decoded by an executor onto its own device (the CPU
/// device here; `ExecDevice::open("cuda:1")` on a GPU executor):
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{Int64Array, RecordBatch};
/// use arrow_schema::{DataType, Field, Schema};
/// use datafusion::datasource::memory::MemorySourceConfig;
/// use datafusion::physical_plan::{collect, ExecutionPlan};
/// use datafusion::prelude::SessionContext;
/// use datafusion_proto::bytes::{
///     physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
/// };
/// use devarrow_datafusion::{DeviceExec, DeviceExecCodec, DeviceStep, ExecDevice, StepRegistry};
///
/// # fn main() -> datafusion::common::Result<()> {
/// // Each process registers the same step names, with code for its own devices.
/// let registry = Arc::new(StepRegistry::new());
/// let step = registry.register(DeviceStep::new("example.identity", |batch, _cx| Ok(batch)));
///
/// let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)]));
/// let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(vec![1, 2]))])?;
/// let input = MemorySourceConfig::try_new_exec(&[vec![batch]], schema, None)?;
/// let plan: Arc<dyn ExecutionPlan> =
///     Arc::new(DeviceExec::try_new(input, step, ExecDevice::cpu())?);
///
/// // The client: the node goes as the step's name and the read-ahead.
/// let client = DeviceExecCodec::new(registry.clone(), ExecDevice::cpu());
/// let bytes = physical_plan_to_bytes_with_extension_codec(plan, &client)?;
/// // An executor: the step looked up by name, run on its device.
/// let executor = DeviceExecCodec::new(registry, ExecDevice::open("cpu")?);
/// let ctx = SessionContext::new();
/// let decoded = physical_plan_from_bytes_with_extension_codec(&bytes, &ctx.task_ctx(), &executor)?;
/// let node = decoded.downcast_ref::<DeviceExec>().unwrap();
/// assert_eq!(node.step().name(), "example.identity");
/// let out = tokio::runtime::Runtime::new()?.block_on(collect(decoded, ctx.task_ctx()))?;
/// assert_eq!(out[0].num_rows(), 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct DeviceExecCodec {
    registry: Arc<StepRegistry>,
    device: ExecDevice,
    operators: DeviceOperatorRegistry,
    fallback: Option<Arc<dyn PhysicalExtensionCodec>>,
}

impl DeviceExecCodec {
    /// A codec whose decoded nodes take their steps from `registry` and run on `device`.
    pub fn new(registry: Arc<StepRegistry>, device: ExecDevice) -> Self {
        Self {
            registry,
            device,
            operators: DeviceOperatorRegistry::default(),
            fallback: None,
        }
    }

    /// This codec, rebuilding decoded device operators with `operators` (an engine's
    /// own factories; devarrow's by default).
    pub fn with_operators(mut self, operators: DeviceOperatorRegistry) -> Self {
        self.operators = operators;
        self
    }

    /// This codec, passing the nodes that are not `DeviceExec`s to `fallback`.
    pub fn with_fallback(mut self, fallback: Arc<dyn PhysicalExtensionCodec>) -> Self {
        self.fallback = Some(fallback);
        self
    }

    /// The device decoded nodes run on.
    pub fn device(&self) -> &ExecDevice {
        &self.device
    }

    /// The bytes of a node: the header, then `key=value` lines.
    pub fn encode(node: &DeviceExec) -> Vec<u8> {
        format!(
            "{HEADER}\nstep={}\nread_ahead={}\n",
            node.step().name(),
            node.read_ahead()
        )
        .into_bytes()
    }

    /// The node of `buf` over `input`.
    pub fn decode(&self, buf: &[u8], input: Arc<dyn ExecutionPlan>) -> Result<DeviceExec> {
        let bad = |why: &str| DeviceExecError::Codec(why.to_string());
        let text = std::str::from_utf8(buf).map_err(|_| bad("not UTF-8"))?;
        let mut lines = text.lines();
        if lines.next() != Some(HEADER) {
            return Err(bad(&format!("the first line is not `{HEADER}`")).into());
        }
        let (mut step, mut read_ahead) = (None, None);
        for line in lines {
            match line.split_once('=') {
                Some(("step", name)) => step = Some(name),
                Some(("read_ahead", n)) => {
                    read_ahead = Some(
                        n.parse::<usize>()
                            .map_err(|_| bad(&format!("read_ahead `{n}` is not a count")))?,
                    )
                }
                _ => return Err(bad(&format!("unknown line `{line}`")).into()),
            }
        }
        let step = self.registry.get(step.ok_or_else(|| bad("no step"))?)?;
        let read_ahead = read_ahead.ok_or_else(|| bad("no read_ahead"))?;
        Ok(DeviceExec::try_new(input, step, self.device.clone())?.with_read_ahead(read_ahead))
    }
}

impl PhysicalExtensionCodec for DeviceExecCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        if buf.starts_with(region::PREFIX.as_bytes()) {
            return region::decode(self, buf, inputs, ctx, proto_converter);
        }
        if let Some(fallback) = &self.fallback {
            if !buf.starts_with(HEADER.as_bytes()) {
                return fallback.try_decode(buf, inputs, ctx, proto_converter);
            }
        }
        let [input] = inputs else {
            return Err(DeviceExecError::Codec(format!(
                "a DeviceExec has one input, this node {}",
                inputs.len()
            ))
            .into());
        };
        Ok(Arc::new(self.decode(buf, input.clone())?))
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if region::encode(self, &node, buf, proto_converter)? {
            return Ok(());
        }
        let Some(exec) = node.downcast_ref::<DeviceExec>() else {
            if let Some(fallback) = &self.fallback {
                return fallback.try_encode(node, buf, proto_converter);
            }
            return Err(DeviceExecError::Codec(format!(
                "cannot encode {}: this codec encodes DeviceExec nodes",
                node.name()
            ))
            .into());
        };
        buf.extend_from_slice(&Self::encode(exec));
        Ok(())
    }
}
