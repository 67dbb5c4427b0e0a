//! Choosing the device the job runs on: the library's [`devarrow::select_device`], with
//! the command line's hint when an explicit CUDA device does not open.

use std::sync::Arc;

use devarrow::abi::device::{CpuDevice, LinkModel};
use devarrow::{select_device, DeviceRequest};

use super::options::DeviceChoice;
use super::JobError;

/// The device a run uses, and what the machine said about CUDA.
pub type Selected = devarrow::SelectedDevice;

/// Opens the device asked for. `auto` falls back to the CPU device (saying why);
/// an explicit `cuda:N` that does not open is an error.
///
/// The CPU device models `link` when given (`CpuDevice::with_link`); without one it is
/// the CPU device whose memory the host reaches directly (`CpuDevice::direct`), so the
/// run shows devarrow's host-side costs at memory speed. A link on CUDA is an error.
pub fn select(choice: DeviceChoice, link: Option<LinkModel>) -> Result<Selected, JobError> {
    let request = match choice {
        DeviceChoice::Auto => DeviceRequest::Auto,
        DeviceChoice::Cpu => DeviceRequest::Cpu,
        DeviceChoice::Cuda(id) => DeviceRequest::Cuda(id),
    };
    let mut selected = select_device(request)
        .map_err(|e| JobError::new(format!("{e} (use --device cpu to run on the CPU device)")))?;
    if selected.id == "cpu" {
        selected.device = match link {
            Some(link) => Arc::new(CpuDevice::with_link(link)),
            None => Arc::new(CpuDevice::direct()),
        };
    } else if link.is_some() {
        return Err(JobError::new(format!(
            "--link models a link on the CPU device; {} has a real one (use --device cpu)",
            selected.id
        )));
    }
    Ok(selected)
}
