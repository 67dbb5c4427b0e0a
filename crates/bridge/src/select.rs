//! Choosing the device to run on: CUDA device `N` when it opens, else the CPU device, and
//! why ([`select_device`]).
//!
//! ```
//! use devarrow_bridge::select::{select_device, DeviceRequest};
//!
//! // On a machine without a GPU this is the CPU device, with the reason in `fallback`.
//! let selected = select_device(DeviceRequest::Auto).unwrap();
//! println!("running on {} ({})", selected.id, selected.name);
//! if let Some(why) = &selected.fallback {
//!     println!("not on CUDA: {why}");
//! }
//! // The CPU device is always there.
//! let cpu = select_device(DeviceRequest::Cpu).unwrap();
//! assert_eq!(cpu.id, "cpu");
//! ```

use std::sync::Arc;

use devarrow_abi::device::{CpuDevice, Device};

/// Which device to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceRequest {
    /// CUDA device 0 when it opens, else the CPU device ([`SelectedDevice::fallback`] says
    /// why).
    #[default]
    Auto,
    /// The CPU device.
    Cpu,
    /// CUDA device `N`, or an error.
    Cuda(usize),
}

/// The device opened by [`select_device`], and what the machine said about CUDA.
#[derive(Debug, Clone)]
pub struct SelectedDevice {
    /// The device, as the bridge sees it.
    pub device: Arc<dyn Device>,
    /// The same device when it is a CUDA device.
    #[cfg(feature = "cuda")]
    pub cuda: Option<Arc<devarrow_cuda::CudaDevice>>,
    /// `cuda:N` or `cpu`.
    pub id: String,
    /// The GPU's name, or `CPU device`.
    pub name: String,
    /// The CUDA devices of the machine in one line ([`cuda_summary`]), or why there are
    /// none.
    pub cuda_summary: Result<String, String>,
    /// Why [`DeviceRequest::Auto`] fell back to the CPU device (no driver, no device,
    /// device 0 did not open, built without CUDA); `None` when it did not fall back.
    pub fallback: Option<String>,
}

/// Why [`select_device`] could not open the device asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SelectError {
    /// [`DeviceRequest::Cuda`] named a device that does not open.
    #[error("CUDA device cuda:{id} is not available: {reason}")]
    CudaUnavailable {
        /// The device asked for.
        id: usize,
        /// Why it did not open (no driver, no such device, the driver's error).
        reason: String,
    },
}

/// The CUDA devices of this machine in one line (`cuda:0 NVIDIA H100 (sm_90, 79 GiB)`),
/// or why there are none (no driver, no device, built without the `cuda` feature).
/// Never panics.
pub fn cuda_summary() -> Result<String, String> {
    #[cfg(feature = "cuda")]
    {
        let devices = devarrow_cuda::list_devices().map_err(|e| e.to_string())?;
        if devices.is_empty() {
            return Err("the driver reports no device".to_string());
        }
        Ok(devices
            .iter()
            .map(|d| {
                format!(
                    "cuda:{} {} (sm_{}{}, {:.0} GiB)",
                    d.id,
                    d.name,
                    d.compute_capability.0,
                    d.compute_capability.1,
                    d.total_memory as f64 / (1u64 << 30) as f64
                )
            })
            .collect::<Vec<_>>()
            .join(", "))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("devarrow-bridge was built without the `cuda` feature".to_string())
    }
}

fn cpu(cuda_summary: Result<String, String>, fallback: Option<String>) -> SelectedDevice {
    SelectedDevice {
        device: Arc::new(CpuDevice::new()),
        #[cfg(feature = "cuda")]
        cuda: None,
        id: "cpu".into(),
        name: "CPU device".into(),
        cuda_summary,
        fallback,
    }
}

#[cfg(feature = "cuda")]
fn cuda(id: usize, cuda_summary: Result<String, String>) -> Result<SelectedDevice, String> {
    let device = devarrow_cuda::CudaDevice::open(id).map_err(|e| e.to_string())?;
    let device = Arc::new(device);
    Ok(SelectedDevice {
        name: device.primary_context().name().to_string(),
        device: device.clone(),
        cuda: Some(device),
        id: format!("cuda:{id}"),
        cuda_summary,
        fallback: None,
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda(_id: usize, cuda_summary: Result<String, String>) -> Result<SelectedDevice, String> {
    Err(cuda_summary.err().unwrap_or_default())
}

/// Opens the device asked for. [`DeviceRequest::Auto`] falls back to the CPU device
/// (saying why in [`SelectedDevice::fallback`]); an explicit [`DeviceRequest::Cuda`] that
/// does not open is an error.
pub fn select_device(request: DeviceRequest) -> Result<SelectedDevice, SelectError> {
    let summary = cuda_summary();
    match request {
        DeviceRequest::Cpu => Ok(cpu(summary, None)),
        DeviceRequest::Auto => match &summary {
            Ok(_) => Ok(cuda(0, summary.clone()).unwrap_or_else(|e| {
                cpu(summary, Some(format!("CUDA device 0 did not open: {e}")))
            })),
            Err(reason) => {
                let why = format!("no CUDA device found: {reason}");
                Ok(cpu(summary, Some(why)))
            }
        },
        DeviceRequest::Cuda(id) => {
            let reason = match &summary {
                Err(reason) => reason.clone(),
                Ok(_) => match cuda(id, summary.clone()) {
                    Ok(selected) => return Ok(selected),
                    Err(e) => e,
                },
            };
            Err(SelectError::CudaUnavailable { id, reason })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_device_is_always_there() {
        let selected = select_device(DeviceRequest::Cpu).unwrap();
        assert_eq!(selected.id, "cpu");
        assert_eq!(selected.name, "CPU device");
        assert!(selected.fallback.is_none());
        assert_eq!(
            selected.device.device_type(),
            devarrow_abi::ArrowDeviceType::CPU
        );
    }

    #[test]
    // Loads the CUDA driver (dlopen): Miri cannot call foreign functions.
    #[cfg_attr(miri, ignore)]
    fn auto_says_why_it_is_not_on_cuda() {
        let selected = select_device(DeviceRequest::Auto).unwrap();
        match selected.id.as_str() {
            "cpu" => assert!(selected.fallback.is_some(), "{selected:?}"),
            id => assert!(id.starts_with("cuda:"), "{id}"),
        }
    }

    #[test]
    // Loads the CUDA driver (dlopen): Miri cannot call foreign functions.
    #[cfg_attr(miri, ignore)]
    fn a_missing_cuda_device_is_a_typed_error() {
        let err = select_device(DeviceRequest::Cuda(usize::MAX)).unwrap_err();
        let SelectError::CudaUnavailable { id, reason } = &err;
        assert_eq!(*id, usize::MAX);
        assert!(!reason.is_empty());
        assert!(err.to_string().starts_with("CUDA device cuda:"), "{err}");
    }
}
