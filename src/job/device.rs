//! Choosing the device the job runs on.

use std::sync::Arc;

use devarrow::abi::device::{CpuDevice, Device};
use devarrow::cuda::CudaTransferDevice;

use super::options::DeviceChoice;
use super::JobError;

/// The device a run uses, and what the machine said about CUDA.
#[derive(Debug, Clone)]
pub struct Selected {
    /// The device, as the bridge sees it.
    pub device: Arc<dyn Device>,
    /// The same device when it is a CUDA device.
    pub cuda: Option<Arc<CudaTransferDevice>>,
    /// `cuda:N` or `cpu`.
    pub id: String,
    /// The GPU's name, or `CPU device`.
    pub name: String,
    /// The CUDA devices of the machine (one line), or why there are none.
    pub cuda_summary: Result<String, String>,
    /// Why `auto` fell back to the CPU device (no driver, no device, device 0 did not
    /// open); `None` when it did not fall back.
    pub fallback: Option<String>,
}

fn cpu(cuda_summary: Result<String, String>, fallback: Option<String>) -> Selected {
    Selected {
        device: Arc::new(CpuDevice::new()),
        cuda: None,
        id: "cpu".into(),
        name: "CPU device".into(),
        cuda_summary,
        fallback,
    }
}

fn cuda(id: usize, cuda_summary: Result<String, String>) -> Result<Selected, String> {
    let device = CudaTransferDevice::open(id).map_err(|e| e.to_string())?;
    let device = Arc::new(device);
    Ok(Selected {
        name: device.cuda_device().name().to_string(),
        device: device.clone(),
        cuda: Some(device),
        id: format!("cuda:{id}"),
        cuda_summary,
        fallback: None,
    })
}

/// Opens the device asked for. `auto` falls back to the CPU device (saying why);
/// an explicit `cuda:N` that does not open is an error.
pub fn select(choice: DeviceChoice) -> Result<Selected, JobError> {
    let summary = devarrow::cuda_device_summary();
    match choice {
        DeviceChoice::Cpu => Ok(cpu(summary, None)),
        DeviceChoice::Auto => match &summary {
            Ok(_) => cuda(0, summary.clone()).or_else(|e| {
                Ok(cpu(
                    summary,
                    Some(format!("CUDA device 0 did not open: {e}")),
                ))
            }),
            Err(reason) => {
                let why = format!("no CUDA device found: {reason}");
                Ok(cpu(summary, Some(why)))
            }
        },
        DeviceChoice::Cuda(id) => {
            let reason = match &summary {
                Err(reason) => reason.clone(),
                Ok(_) => match cuda(id, summary.clone()) {
                    Ok(selected) => return Ok(selected),
                    Err(e) => e,
                },
            };
            Err(JobError::new(format!(
                "CUDA device cuda:{id} is not available: {reason} (use --device cpu to run \
                 on the CPU device)"
            )))
        }
    }
}
