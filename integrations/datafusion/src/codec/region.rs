//! The wire form of a device region's nodes: a header line naming the node and the
//! version, then the node's parameters.
//!
//! | node | after the header |
//! | --- | --- |
//! | `DeviceLoadExec` | nothing |
//! | `DeviceUnloadExec` | nothing |
//! | `HostOnlyExec` | the reason, UTF-8 |
//! | `DeviceOperatorExec` | the host twin over an `EmptyExec` of each child's schema, as DataFusion's protobuf `PhysicalPlanNode` |

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::execution::TaskContext;
use datafusion::physical_plan::empty::EmptyExec;
use datafusion::physical_plan::execution_plan::replace_children_if_necessary;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::bytes::{
    physical_plan_from_bytes_with_proto_converter, physical_plan_to_bytes_with_proto_converter,
};
use datafusion_proto::physical_plan::PhysicalProtoConverterExtension;

use crate::error::DeviceExecError;
use crate::region::{host_twin, DeviceLoadExec, DeviceOperatorExec, DeviceUnloadExec};
use crate::rule::HostOnlyExec;

use super::DeviceExecCodec;

/// What every header of a region node starts with.
pub(super) const PREFIX: &str = "devarrow-datafusion region ";
const LOAD: &str = "devarrow-datafusion region DeviceLoadExec v1\n";
const UNLOAD: &str = "devarrow-datafusion region DeviceUnloadExec v1\n";
const HOST_ONLY: &str = "devarrow-datafusion region HostOnlyExec v1\n";
const OPERATOR: &str = "devarrow-datafusion region DeviceOperatorExec v1\n";

fn bad(why: impl Into<String>) -> datafusion::error::DataFusionError {
    DeviceExecError::Codec(why.into()).into()
}

/// Appends `node`'s bytes to `buf` when it is a region node (`Ok(true)`).
pub(super) fn encode(
    codec: &DeviceExecCodec,
    node: &Arc<dyn ExecutionPlan>,
    buf: &mut Vec<u8>,
    proto_converter: &dyn PhysicalProtoConverterExtension,
) -> Result<bool> {
    if node.downcast_ref::<DeviceLoadExec>().is_some() {
        buf.extend_from_slice(LOAD.as_bytes());
    } else if node.downcast_ref::<DeviceUnloadExec>().is_some() {
        buf.extend_from_slice(UNLOAD.as_bytes());
    } else if let Some(host_only) = node.downcast_ref::<HostOnlyExec>() {
        buf.extend_from_slice(HOST_ONLY.as_bytes());
        buf.extend_from_slice(host_only.reason().as_bytes());
    } else if let Some(op) = node.downcast_ref::<DeviceOperatorExec>() {
        let twin = op.host_twin();
        if crate::rule::reads_scalar_subquery(twin) {
            return Err(bad(format!(
                "`{}` reads a scalar subquery's value, which DataFusion's protobuf decodes \
                 only inside its ScalarSubqueryExec, not from a device node's bytes: plan \
                 the query on Ballista (where the rule keeps such a node on the host) or \
                 without devarrow's rule",
                twin.name()
            )));
        }
        let placeholders: Vec<Arc<dyn ExecutionPlan>> = op
            .children()
            .into_iter()
            .map(|c| Arc::new(EmptyExec::new(c.schema())) as Arc<dyn ExecutionPlan>)
            .collect();
        let alone = replace_children_if_necessary(twin.clone(), placeholders)?;
        let bytes = physical_plan_to_bytes_with_proto_converter(alone, codec, proto_converter)?;
        buf.extend_from_slice(OPERATOR.as_bytes());
        buf.extend_from_slice(&bytes);
    } else {
        return Ok(false);
    }
    Ok(true)
}

/// The region node of `buf` over `inputs`.
pub(super) fn decode(
    codec: &DeviceExecCodec,
    buf: &[u8],
    inputs: &[Arc<dyn ExecutionPlan>],
    ctx: &TaskContext,
    proto_converter: &dyn PhysicalProtoConverterExtension,
) -> Result<Arc<dyn ExecutionPlan>> {
    let Some(twin) = buf.strip_prefix(OPERATOR.as_bytes()) else {
        let [input] = inputs else {
            return Err(bad(format!(
                "a device region's load, unload or host-only node has one input, this one {}",
                inputs.len()
            )));
        };
        let input = input.clone();
        if buf == LOAD.as_bytes() {
            return Ok(Arc::new(DeviceLoadExec::new(input)));
        }
        if buf == UNLOAD.as_bytes() {
            return Ok(Arc::new(
                DeviceUnloadExec::try_new(input).map_err(|e| bad(e.to_string()))?,
            ));
        }
        if let Some(reason) = buf.strip_prefix(HOST_ONLY.as_bytes()) {
            let reason =
                std::str::from_utf8(reason).map_err(|_| bad("a reason that is not UTF-8"))?;
            return Ok(Arc::new(HostOnlyExec::new(input, reason)));
        }
        let header = buf.split(|&b| b == b'\n').next().unwrap_or_default();
        return Err(bad(format!(
            "unknown region node `{}`",
            String::from_utf8_lossy(header)
        )));
    };
    // DataFusion's own decoding of a plan: errors, not panics, on malformed protobuf
    // (the fuzz target checks that too).
    let alone = physical_plan_from_bytes_with_proto_converter(twin, ctx, codec, proto_converter)
        .map_err(|e| bad(format!("a device operator's host twin: {e}")))?;
    let placeholders = alone.children();
    if placeholders.len() != inputs.len()
        || placeholders
            .iter()
            .zip(inputs)
            .any(|(p, input)| p.schema() != input.schema())
    {
        return Err(bad(format!(
            "a device operator's host twin `{}` does not take its inputs' schemas",
            alone.name()
        )));
    }
    let twin = replace_children_if_necessary(alone, inputs.iter().map(host_twin).collect())
        .map_err(|e| bad(e.to_string()))?;
    let operator = match codec.operators.device_operator(&twin) {
        Some(Ok(operator)) => operator,
        Some(Err(why)) => {
            return Err(bad(format!(
                "this process cannot run `{}` on a device: {why}",
                twin.name()
            )))
        }
        None => {
            return Err(bad(format!(
                "this process has no device operator for `{}`",
                twin.name()
            )))
        }
    };
    Ok(Arc::new(
        DeviceOperatorExec::with_children(operator, inputs.to_vec(), twin)
            .map_err(|e| bad(e.to_string()))?,
    ))
}
