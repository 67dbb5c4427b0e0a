//! The codec's region nodes: a plan with a region round-trips through DataFusion's
//! protobuf with the operator's parameters, and bytes off the wire never panic the
//! decoder (the fuzz target's body on mutations of real encodings: every truncation,
//! every byte flipped, and seeded random edits).

mod common;

#[path = "common/codec_fuzz_body.rs"]
mod codec_fuzz_body;

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{binary, col, lit};
use datafusion::physical_plan::displayable;
use datafusion::physical_plan::filter::FilterExec;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_extension_codec, physical_plan_to_bytes_with_extension_codec,
};
use datafusion_proto::physical_plan::{DefaultPhysicalProtoConverter, PhysicalExtensionCodec};
use devarrow_datafusion::compute::Unsupported;
use devarrow_datafusion::frame::DeviceFrame;
use devarrow_datafusion::region::{
    DeviceOperator, DeviceOperatorExec, DeviceUnloadExec, OperatorContext, RegionBatch,
};
use devarrow_datafusion::rule::{DeviceOperatorFactory, DeviceOperatorRegistry, HostOnlyExec};
use devarrow_datafusion::BoxError;

use codec_fuzz_body::Decoder;

/// A filter operator that only records its predicate (the codec test never runs it).
#[derive(Debug)]
struct Recorded(String);

impl DeviceOperator for Recorded {
    fn name(&self) -> &'static str {
        "DeviceFilterExec"
    }

    fn fmt_params(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }

    fn apply(&self, _: DeviceFrame, _: &OperatorContext<'_>) -> Result<RegionBatch, BoxError> {
        Err("not run here".into())
    }
}

#[derive(Debug)]
struct RecordingFilters;

impl DeviceOperatorFactory for RecordingFilters {
    fn device_operator(
        &self,
        node: &Arc<dyn ExecutionPlan>,
    ) -> Option<Result<Arc<dyn DeviceOperator>, Unsupported>> {
        let filter = node.downcast_ref::<FilterExec>()?;
        Some(Ok(Arc::new(Recorded(filter.predicate().to_string()))))
    }
}

fn registry() -> DeviceOperatorRegistry {
    let mut registry = DeviceOperatorRegistry::empty();
    registry.register(Arc::new(RecordingFilters));
    registry
}

/// Unload(Filter on the device(Load(EmptyExec))), under a HostOnlyExec.
fn region_plan(decoder: &Decoder) -> Arc<dyn ExecutionPlan> {
    let load = decoder.device_input().clone();
    let schema = load.schema();
    let predicate = binary(
        col("l_quantity", &schema).unwrap(),
        Operator::Gt,
        lit(ScalarValue::Int64(Some(24))),
        &schema,
    )
    .unwrap();
    let host = decoder.host_input().clone();
    let twin: Arc<dyn ExecutionPlan> = Arc::new(FilterExec::try_new(predicate, host).unwrap());
    let operator = RecordingFilters.device_operator(&twin).unwrap().unwrap();
    let op = Arc::new(DeviceOperatorExec::try_new(operator, load, twin).unwrap());
    let unload = Arc::new(DeviceUnloadExec::try_new(op).unwrap());
    Arc::new(HostOnlyExec::new(unload, "a reason, with ünïcode"))
}

fn text(plan: &Arc<dyn ExecutionPlan>) -> String {
    displayable(plan.as_ref()).indent(false).to_string()
}

#[test]
fn a_region_round_trips_with_its_operators_parameters() {
    let decoder = Decoder::default();
    let codec = decoder.codec().clone().with_operators(registry());
    let plan = region_plan(&decoder);
    let bytes = physical_plan_to_bytes_with_extension_codec(plan.clone(), &codec).unwrap();
    let ctx = datafusion::execution::TaskContext::default();
    let back = physical_plan_from_bytes_with_extension_codec(&bytes, &ctx, &codec).unwrap();
    assert_eq!(text(&back), text(&plan));
    assert!(
        text(&back).contains("DeviceFilterExec: l_quantity@2 > 24"),
        "{}",
        text(&back)
    );
    // A process without a device operator for the node refuses it, typed.
    let without = decoder
        .codec()
        .clone()
        .with_operators(DeviceOperatorRegistry::empty());
    let error = physical_plan_from_bytes_with_extension_codec(&bytes, &ctx, &without).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("no device operator for `FilterExec`"),
        "{error}"
    );
}

/// The encodings of each node of the region plan alone (the fuzzer's seeds).
fn seeds(decoder: &Decoder) -> Vec<Vec<u8>> {
    let codec = decoder.codec().clone().with_operators(registry());
    let converter = DefaultPhysicalProtoConverter {};
    let mut seeds = Vec::new();
    let mut stack = vec![region_plan(decoder)];
    while let Some(node) = stack.pop() {
        let mut buf = Vec::new();
        if codec.try_encode(node.clone(), &mut buf, &converter).is_ok() {
            seeds.push(buf);
        }
        stack.extend(node.children().into_iter().cloned());
    }
    assert!(seeds.len() >= 4, "{} seeds", seeds.len());
    seeds
}

/// A small deterministic generator (xorshift), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

#[test]
fn bytes_off_the_wire_never_panic_the_decoder() {
    let decoder = Decoder::default();
    let seeds = seeds(&decoder);
    let mut inputs: Vec<Vec<u8>> = vec![Vec::new(), b"devarrow-datafusion region ".to_vec()];
    for seed in &seeds {
        for len in 0..=seed.len() {
            inputs.push(seed[..len].to_vec());
        }
        for at in 0..seed.len() {
            let mut flipped = seed.clone();
            flipped[at] ^= 0xff;
            inputs.push(flipped);
        }
    }
    let mut rng = Rng(0x5eed_dec0de);
    for _ in 0..3000 {
        let mut bytes = seeds[rng.below(seeds.len())].clone();
        for _ in 0..=rng.below(4) {
            match rng.below(3) {
                0 if !bytes.is_empty() => {
                    let at = rng.below(bytes.len());
                    bytes[at] = rng.next() as u8;
                }
                1 => {
                    let at = rng.below(bytes.len() + 1);
                    bytes.insert(at, rng.next() as u8);
                }
                _ if !bytes.is_empty() => {
                    let at = rng.below(bytes.len());
                    bytes.remove(at);
                }
                _ => {}
            }
        }
        inputs.push(bytes);
    }
    let mut decoded = 0;
    for bytes in &inputs {
        match catch_unwind(AssertUnwindSafe(|| decoder.decode(bytes))) {
            Ok(n) => decoded += n,
            Err(_) => panic!(
                "the decoder panicked on {:?}",
                String::from_utf8_lossy(bytes)
            ),
        }
    }
    // The unmutated seeds decode (over the right input).
    assert!(
        decoded >= 3,
        "{decoded} of {} decodes succeeded",
        inputs.len()
    );
}
