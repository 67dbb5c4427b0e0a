//! Choosing the device the job runs on: the library's [`devarrow::select_device`], with
//! the command line's hint when an explicit CUDA device does not open.

use devarrow::{select_device, DeviceRequest};

use super::options::DeviceChoice;
use super::JobError;

/// The device a run uses, and what the machine said about CUDA.
pub type Selected = devarrow::SelectedDevice;

/// Opens the device asked for. `auto` falls back to the CPU device (saying why);
/// an explicit `cuda:N` that does not open is an error.
pub fn select(choice: DeviceChoice) -> Result<Selected, JobError> {
    let request = match choice {
        DeviceChoice::Auto => DeviceRequest::Auto,
        DeviceChoice::Cpu => DeviceRequest::Cpu,
        DeviceChoice::Cuda(id) => DeviceRequest::Cuda(id),
    };
    select_device(request)
        .map_err(|e| JobError::new(format!("{e} (use --device cpu to run on the CPU device)")))
}
