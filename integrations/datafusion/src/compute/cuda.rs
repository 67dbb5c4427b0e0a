//! CUDA: the PTX kernels of `kernels/compute.ptx`.

use std::sync::Arc;

use devarrow::cuda::CudaDevice;

use super::aggregate::{Groups, Plan};
use super::{ComputeError, DeviceExpr};
use crate::error::BoxError;
use crate::frame::{DeviceFrame, FrameColumn};
use crate::step::ExecDevice;

pub(crate) fn evaluate(
    _expr: &DeviceExpr,
    _frame: &DeviceFrame,
    _cuda: &Arc<CudaDevice>,
    _device: &ExecDevice,
) -> Result<FrameColumn, BoxError> {
    Err(ComputeError::Input("CUDA expressions are not built yet".into()).into())
}

pub(crate) fn select(
    _expr: &DeviceExpr,
    _frame: &DeviceFrame,
    _cuda: &Arc<CudaDevice>,
    _device: &ExecDevice,
) -> Result<FrameColumn, BoxError> {
    Err(ComputeError::Input("CUDA selections are not built yet".into()).into())
}

pub(crate) fn groups(
    _plan: &Plan,
    _frame: &DeviceFrame,
    _cuda: &Arc<CudaDevice>,
) -> Result<Groups, BoxError> {
    Err(ComputeError::Input("CUDA aggregates are not built yet".into()).into())
}
