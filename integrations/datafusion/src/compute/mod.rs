//! Device compute for the device operators of a region: DataFusion's physical
//! expressions compiled for the device ([`DeviceExpr`]), row selections ([`select`]) and
//! per-batch partial aggregates ([`DevicePartialAggregate`]). On CUDA, PTX kernels
//! (`kernels/`); on the CPU device, the same arithmetic on the host.
//!
//! What cannot run on the device is refused when compiled, with the reason
//! ([`Unsupported`]): the optimizer rule leaves that node on the host and says why in
//! `EXPLAIN`.

use std::fmt;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Schema};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::AggregateExec;

use crate::error::BoxError;
use crate::frame::{DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

/// Why an expression or an aggregate cannot run on the device (shown in `EXPLAIN`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unsupported(pub String);

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unsupported {}

/// A physical expression compiled for the device.
#[derive(Debug, Clone)]
pub struct DeviceExpr {
    data_type: DataType,
}

impl DeviceExpr {
    /// `expr` over `input`, or why it cannot run on the device.
    pub fn compile(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Result<Self, Unsupported> {
        let _ = (expr, input);
        Err(Unsupported("device expressions are not built yet".into()))
    }

    /// The type of its values (the host expression's).
    pub fn data_type(&self) -> &DataType {
        &self.data_type
    }

    /// Its values for every row of `frame` (selected or not), a new column on `device`.
    pub fn evaluate(
        &self,
        frame: &DeviceFrame,
        device: &ExecDevice,
    ) -> Result<FrameColumn, BoxError> {
        let _ = (frame, device);
        Err("device expressions are not built yet".into())
    }
}

/// The selection of `frame`'s rows where `predicate` (a `Boolean` expression) is true,
/// and-ed with the frame's own pending selection: a `UInt8` column (1 selected, 0 not)
/// on `device`.
pub fn select(
    predicate: &DeviceExpr,
    frame: &DeviceFrame,
    device: &ExecDevice,
) -> Result<FrameColumn, BoxError> {
    let _ = (predicate, frame, device);
    Err("device selections are not built yet".into())
}

/// An `AggregateExec` in `Partial` mode compiled for the device: per batch, the groups
/// and their partial states, read back as a host batch of the aggregate's own schema.
#[derive(Debug, Clone)]
pub struct DevicePartialAggregate {
    _private: (),
}

impl DevicePartialAggregate {
    /// `aggregate` (mode `Partial`), or why it cannot run on the device.
    pub fn compile(aggregate: &AggregateExec) -> Result<Self, Unsupported> {
        let _ = aggregate;
        Err(Unsupported("device aggregates are not built yet".into()))
    }

    /// The partial aggregate of `frame`'s selected rows: a host batch of the
    /// aggregate's output schema (one row per group present).
    pub fn run(&self, frame: &DeviceFrame, device: &ExecDevice) -> Result<RecordBatch, BoxError> {
        let _ = (frame, device);
        Err("device aggregates are not built yet".into())
    }
}
