//! Choosing the device the job runs on: the library's [`devarrow::select_device`], with
//! the command line's hint when an explicit CUDA device does not open, and the CUDA
//! device options of the run.

use std::sync::Arc;

use devarrow::abi::device::{CpuDevice, LinkModel};
use devarrow::cuda::CudaDevice;
use devarrow::{select_device, DeviceRequest, SelectedDevice};

use super::cuda_options::{CudaOptions, Source};
use super::measure::JobDevice;
use super::options::DeviceChoice;
use super::JobError;

/// The device a run uses, and what the machine said about CUDA: the library's
/// [`SelectedDevice`] with the device the job opened (with the run's options).
#[derive(Debug)]
pub struct Selected {
    /// The device.
    pub device: Arc<dyn JobDevice>,
    /// The same device when it is a CUDA device.
    pub cuda: Option<Arc<CudaDevice>>,
    /// `cuda:N` or `cpu`.
    pub id: String,
    /// The GPU's name, or `CPU device`.
    pub name: String,
    /// The CUDA devices of the machine in one line, or why there are none.
    pub cuda_summary: Result<String, String>,
    /// Why `auto` fell back to the CPU device; `None` when it did not.
    pub fallback: Option<String>,
}

impl Selected {
    /// `selected` on `device`, the device the job opened in its place.
    fn new(selected: SelectedDevice, device: Arc<dyn JobDevice>) -> Self {
        Self {
            device,
            cuda: selected.cuda,
            id: selected.id,
            name: selected.name,
            cuda_summary: selected.cuda_summary,
            fallback: selected.fallback,
        }
    }
}

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
    choice: &DeviceChoice,
    link: Option<LinkModel>,
    cuda_options: &CudaOptions,
) -> Result<Selected, JobError> {
    if *choice == DeviceChoice::Cpu && cuda_options.source == Source::Flag {
        return Err(JobError::new(
            "--cuda-options sets options of a CUDA device; the CPU device has none (use \
             --device cuda, or leave --cuda-options out)",
        ));
    }
    let request = match choice {
        DeviceChoice::Auto => DeviceRequest::Auto,
        DeviceChoice::Cpu => DeviceRequest::Cpu,
        DeviceChoice::Cuda(id) => DeviceRequest::Cuda(*id),
        DeviceChoice::CudaList(_) | DeviceChoice::CudaAll => {
            return Err(JobError::new(format!(
                "--device {choice} names several devices: open them with select_several"
            )))
        }
    };
    let selected = select_device(request)
        .map_err(|e| JobError::new(format!("{e} (use --device cpu to run on the CPU device)")))?;
    if selected.id == "cpu" {
        let device: Arc<dyn JobDevice> = match link {
            Some(link) => Arc::new(CpuDevice::with_link(link)),
            None => Arc::new(CpuDevice::direct()),
        };
        return Ok(Selected::new(selected, device));
    } else if link.is_some() {
        return Err(JobError::new(format!(
            "--link models a link on the CPU device; {} has a real one (use --device cpu)",
            selected.id
        )));
    }
    let id = selected.id.clone();
    with_options(selected, cuda_options).map_err(|e| JobError::new(format!("opening {id}: {e}")))
}

/// Gives a selected CUDA device the options of the run: a device of the same context
/// with the options (`select_device` opens devices with the defaults, and a device's
/// options are set before it first works).
fn with_options(
    mut selected: SelectedDevice,
    cuda_options: &CudaOptions,
) -> Result<Selected, devarrow::cuda::CudaError> {
    let Some(opened) = selected.cuda.take() else {
        return Err(devarrow::cuda::CudaError::NoDevice);
    };
    let device =
        CudaDevice::new(opened.primary_context().clone())?.with_options(cuda_options.options);
    let device = Arc::new(device);
    selected.cuda = Some(device.clone());
    Ok(Selected::new(selected, device))
}

/// Why the CUDA devices of `--device cuda:N,M,...` or `--device cuda:all` did not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevicesError {
    /// `cuda:all` on a machine with no CUDA device (no driver, or none reported).
    #[error("--device cuda:all: no CUDA device to run on: {reason} (use --device cpu to run on the CPU device)")]
    NoCudaDevice {
        /// Why there is none.
        reason: String,
    },
    /// A device of the list (or of `cuda:all`) did not open.
    #[error("--device {asked}: CUDA device cuda:{id} did not open: {reason}")]
    DidNotOpen {
        /// The devices asked for, as given (`cuda:0,1`, `cuda:all`).
        asked: String,
        /// The device that did not open.
        id: usize,
        /// Why.
        reason: String,
    },
    /// `--link` with CUDA devices.
    #[error("--link models a link on the CPU device; {asked} have a real one (use --device cpu)")]
    Link {
        /// The devices asked for.
        asked: String,
    },
}

/// Opens every CUDA device of a list (`cuda:0,1`) or of the machine (`cuda:all`), in
/// order, each with the run's `cuda_options`. A device that does not open is an error
/// naming it; `cuda:all` with no device is an error saying so. Any other choice opens
/// the one device [`select`] opens.
pub fn select_several(
    choice: &DeviceChoice,
    link: Option<LinkModel>,
    cuda_options: &CudaOptions,
) -> Result<Vec<Selected>, JobError> {
    let asked = choice.to_string();
    let ids = match choice {
        DeviceChoice::CudaList(ids) => ids.clone(),
        DeviceChoice::CudaAll => match devarrow::cuda::device_count() {
            Ok(0) => {
                return Err(DevicesError::NoCudaDevice {
                    reason: "the driver reports no device".into(),
                }
                .into())
            }
            Ok(n) => (0..n).collect(),
            Err(e) => {
                return Err(DevicesError::NoCudaDevice {
                    reason: e.to_string(),
                }
                .into())
            }
        },
        single => return select(single, link, cuda_options).map(|s| vec![s]),
    };
    if link.is_some() {
        return Err(DevicesError::Link { asked }.into());
    }
    let mut devices = Vec::with_capacity(ids.len());
    for id in ids {
        let did_not_open = |reason: String| DevicesError::DidNotOpen {
            asked: asked.clone(),
            id,
            reason,
        };
        let selected = select_device(DeviceRequest::Cuda(id)).map_err(|e| match e {
            devarrow::bridge::select::SelectError::CudaUnavailable { reason, .. } => {
                did_not_open(reason)
            }
            other => did_not_open(other.to_string()),
        })?;
        let selected =
            with_options(selected, cuda_options).map_err(|e| did_not_open(e.to_string()))?;
        devices.push(selected);
    }
    Ok(devices)
}
