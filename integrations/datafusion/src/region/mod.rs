//! Device regions: data that stays on a device between device operators.
//!
//! A region is a chain of plan nodes, bracketed by two transitions:
//!
//! ```text
//! DeviceUnloadExec            <- device to host: the region's output, in pinned memory
//!   DeviceOperatorExec ...    <- device operators: DeviceFrame in, DeviceFrame out
//!     DeviceOperatorExec ...
//!       DeviceLoadExec        <- host to device: coalesced, pipelined uploads
//!         <host plan>
//! ```
//!
//! Every node is an ordinary `ExecutionPlan`, so `EXPLAIN` shows where data is on the
//! device and which operator runs there, and DataFusion's rules see each node's
//! properties. Data does not travel between the region's nodes in DataFusion's
//! `RecordBatch` streams, though: when the unload (or any node of the region, executed
//! on its own) runs a partition, it walks down to the load, collects the operators, and
//! runs the whole chain on the partition's device (`run.rs`), handing [`DeviceFrame`](crate::frame::DeviceFrame)s
//! from operator to operator. Only the unload's output crosses into DataFusion.
//! `docs/datafusion-gpu.md` says why (and what the other way, device columns inside
//! `RecordBatch`es, would cost).
//!
//! A device operator replaces one host node and computes what it computes: it declares
//! the host node's guarantees (ordering, partitioning, equivalences, statistics) by
//! keeping that node as its *host twin* ([`DeviceOperatorExec::host_twin`]), rebuilt over
//! the twins of its new children when DataFusion rewrites the plan. It claims nothing
//! else.

mod coalesce;
mod load;
mod operator;
pub mod ops;
mod run;
mod unload;

pub use load::DeviceLoadExec;
pub use operator::{BindContext, DeviceOperator, DeviceOperatorExec, OperatorContext, RegionBatch};
pub use unload::DeviceUnloadExec;

use std::sync::Arc;

use datafusion::common::{internal_err, Result};
use datafusion::physical_plan::ExecutionPlan;

/// The host node a device node stands for: a load's child (a load moves data, it
/// computes nothing), an operator's host twin, an unload's child's twin.
pub fn host_twin(plan: &Arc<dyn ExecutionPlan>) -> Arc<dyn ExecutionPlan> {
    if let Some(load) = plan.downcast_ref::<DeviceLoadExec>() {
        return load.input().clone();
    }
    if let Some(op) = plan.downcast_ref::<DeviceOperatorExec>() {
        return op.host_twin().clone();
    }
    if let Some(unload) = plan.downcast_ref::<DeviceUnloadExec>() {
        return host_twin(unload.input());
    }
    plan.clone()
}

/// Whether `plan`'s output is on a device (a load or a device operator).
pub fn is_on_device(plan: &Arc<dyn ExecutionPlan>) -> bool {
    plan.downcast_ref::<DeviceLoadExec>().is_some()
        || plan.downcast_ref::<DeviceOperatorExec>().is_some()
}

/// The chain under (and including) `top`, a device node: its load, and its operators
/// from the bottom up.
pub(crate) fn chain(
    top: &Arc<dyn ExecutionPlan>,
) -> Result<(Arc<DeviceLoadExec>, Vec<Arc<DeviceOperatorExec>>)> {
    let mut ops = Vec::new();
    let mut node = top.clone();
    loop {
        if let Some(load) = node.downcast_ref::<DeviceLoadExec>() {
            ops.reverse();
            return Ok((Arc::new(load.clone()), ops));
        }
        let Some(op) = node.downcast_ref::<DeviceOperatorExec>() else {
            return internal_err!(
                "a device region's node has a child that is not on the device: {}",
                node.name()
            );
        };
        let next = op.input().clone();
        ops.push(Arc::new(op.clone()));
        node = next;
    }
}
