//! The body of the codec's fuzz target (`fuzz/fuzz_targets/codec_decode.rs`), shared
//! with `tests/codec_fuzz.rs`, which runs it on mutations of real encodings: bytes off
//! the wire decode into a node or a typed error, never a panic.

use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::{DefaultPhysicalProtoConverter, PhysicalExtensionCodec};
use devarrow_datafusion::region::DeviceLoadExec;
use devarrow_datafusion::{DeviceExecCodec, ExecDevice, StepRegistry};

/// What the fuzzer decodes against: the codec of a CPU-device process and two inputs
/// (a host node, and a node on the device).
pub struct Decoder {
    codec: DeviceExecCodec,
    host: Arc<dyn ExecutionPlan>,
    device: Arc<dyn ExecutionPlan>,
    ctx: TaskContext,
}

impl Default for Decoder {
    fn default() -> Self {
        let registry = Arc::new(StepRegistry::new());
        registry.register(devarrow_datafusion::revenue::revenue_step());
        let schema = Arc::new(Schema::new(vec![
            Field::new("l_extendedprice", DataType::Decimal128(15, 2), false),
            Field::new("l_discount", DataType::Decimal128(15, 2), false),
            Field::new("l_quantity", DataType::Int64, true),
        ]));
        let host: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(schema));
        let device: Arc<dyn ExecutionPlan> = Arc::new(DeviceLoadExec::new(host.clone()));
        Self {
            codec: DeviceExecCodec::new(registry, ExecDevice::cpu()),
            host,
            device,
            ctx: TaskContext::default(),
        }
    }
}

impl Decoder {
    /// Decodes `bytes` over each input and over none: any result but a panic is fine.
    /// Returns how many decodes succeeded.
    pub fn decode(&self, bytes: &[u8]) -> usize {
        let converter = DefaultPhysicalProtoConverter {};
        let inputs: [&[Arc<dyn ExecutionPlan>]; 3] = [
            std::slice::from_ref(&self.host),
            std::slice::from_ref(&self.device),
            &[],
        ];
        inputs
            .iter()
            .filter(|inputs| {
                self.codec
                    .try_decode(bytes, inputs, &self.ctx, &converter)
                    .is_ok()
            })
            .count()
    }

    /// The codec.
    pub fn codec(&self) -> &DeviceExecCodec {
        &self.codec
    }

    /// The input on the device.
    pub fn device_input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.device
    }

    /// The host input.
    pub fn host_input(&self) -> &Arc<dyn ExecutionPlan> {
        &self.host
    }
}
