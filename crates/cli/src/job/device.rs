//! Choosing the device the job runs on: the library's [`devarrow::select_device`], with
//! the command line's hint when an explicit CUDA device does not open, and the CUDA
//! device options of the run.

use std::sync::Arc;

use devarrow::abi::device::{CpuDevice, LinkModel};
use devarrow::cuda::CudaDevice;
use devarrow::{select_device, DeviceRequest};

use super::cuda_options::{CudaOptions, Source};
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
///
/// A CUDA device runs with `cuda_options` (its default options when none were given).
/// `--cuda-options` with `--device cpu` is an error, as a link on CUDA is: the command
/// line contradicts itself. Options from the environment variable, or from the flag when
/// `auto` falls back to the CPU device, are not: the variable may be set for the GPU runs
/// of a shell, and `auto` runs on whatever the machine has; the caller notes that they
/// were not used ([`super::report::cuda_options_unused`]).
pub fn select(
    choice: DeviceChoice,
    link: Option<LinkModel>,
    cuda_options: &CudaOptions,
) -> Result<Selected, JobError> {
    if choice == DeviceChoice::Cpu && cuda_options.source == Source::Flag {
        return Err(JobError::new(
            "--cuda-options sets options of a CUDA device; the CPU device has none (use \
             --device cuda, or leave --cuda-options out)",
        ));
    }
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
    if let Some(opened) = selected.cuda.take() {
        // A device of the same context with the options: `select_device` opens devices
        // with the defaults, and a device's options are set before it first works.
        let device = CudaDevice::new(opened.primary_context().clone())
            .map_err(|e| JobError::new(format!("opening {}: {e}", selected.id)))?
            .with_options(cuda_options.options);
        let device = Arc::new(device);
        selected.device = device.clone();
        selected.cuda = Some(device);
    }
    Ok(selected)
}
