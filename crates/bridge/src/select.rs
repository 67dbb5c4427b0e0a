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
//!
//! Device strings (`"auto"`, `"cpu"`, `"cuda:1"`, ...) have one grammar, the
//! [`DeviceSpec`] of devarrow's command (`--device`) and of its Python package
//! (`devarrow.device(...)`): see there. [`DeviceRequest`] parses the strings of one
//! device.

use std::fmt;
use std::str::FromStr;
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

impl FromStr for DeviceRequest {
    type Err = DeviceSpecError;

    /// One device in [`DeviceSpec`]'s grammar: `auto`, `cpu`, `cuda` or `cuda:N`. A list
    /// or `cuda:all` is [`DeviceSpecError::Several`].
    ///
    /// ```
    /// use devarrow_bridge::select::{DeviceRequest, DeviceSpecError};
    ///
    /// assert_eq!("cuda:1".parse(), Ok(DeviceRequest::Cuda(1)));
    /// assert_eq!(" CPU ".parse(), Ok(DeviceRequest::Cpu));
    /// assert!(matches!(
    ///     "cuda:0,1".parse::<DeviceRequest>(),
    ///     Err(DeviceSpecError::Several { .. })
    /// ));
    /// ```
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match parse_spec(s, Grammar::OneDevice)? {
            DeviceSpec::Auto => Ok(Self::Auto),
            DeviceSpec::Cpu => Ok(Self::Cpu),
            DeviceSpec::Cuda(id) => Ok(Self::Cuda(id)),
            DeviceSpec::CudaList(_) | DeviceSpec::CudaAll => {
                Err(DeviceSpecError::Several { spec: normalize(s) })
            }
        }
    }
}

/// A device string: which device, or devices, to run on. The one grammar of devarrow's
/// device strings, parsed with [`str::parse`] ([`FromStr`]); [`Display`](fmt::Display)
/// writes the canonical form back.
///
/// | string | meaning |
/// | --- | --- |
/// | `auto` | CUDA device 0 when it opens, else the CPU device (saying why) |
/// | `cpu` | the CPU device |
/// | `cuda` | CUDA device 0 (the same as `cuda:0`) |
/// | `cuda:N` | CUDA device `N` (a decimal ordinal); an error when it does not open |
/// | `cuda:N,M,...` | several CUDA devices at once: two or more, distinct, in the order given |
/// | `cuda:all` | every CUDA device of the machine |
///
/// Case does not matter and spaces around the string and around the items of a list are
/// ignored (` CUDA:2, 0 ` is `cuda:2,0`); a one-device list is that device (`cuda:1`).
/// Anything else is a [`DeviceSpecError`] saying what is wrong.
///
/// Who takes what: devarrow's command (`devarrow --device`) takes every form. A
/// [`DeviceRequest`] (what [`select_device`] opens, and what the Python package's
/// `devarrow.device(...)` takes) is one device: it parses the first four forms and
/// refuses lists and `cuda:all` with [`DeviceSpecError::Several`] (open each device on
/// its own).
///
/// ```
/// use devarrow_bridge::select::{DeviceSpec, DeviceSpecError};
///
/// assert_eq!("auto".parse(), Ok(DeviceSpec::Auto));
/// assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
/// assert_eq!(" CUDA:2, 0 ".parse(), Ok(DeviceSpec::CudaList(vec![2, 0])));
/// assert_eq!("cuda:all".parse::<DeviceSpec>().unwrap().to_string(), "cuda:all");
/// assert_eq!(
///     "cuda:0,0".parse::<DeviceSpec>(),
///     Err(DeviceSpecError::Repeated { spec: "cuda:0,0".into(), id: 0 })
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// `auto`: CUDA device 0 when one opens, else the CPU device.
    #[default]
    Auto,
    /// `cpu`: the CPU device.
    Cpu,
    /// `cuda` or `cuda:N`: CUDA device `N`; an error when it does not open.
    Cuda(usize),
    /// `cuda:N,M,...`: several CUDA devices at once, two or more, distinct, in the order
    /// given; an error when one does not open.
    CudaList(Vec<usize>),
    /// `cuda:all`: every CUDA device of the machine; an error when there is none.
    CudaAll,
}

impl DeviceSpec {
    /// Whether more than one CUDA device may be used (a list or `cuda:all`).
    pub fn is_multi(&self) -> bool {
        matches!(self, Self::CudaList(_) | Self::CudaAll)
    }
}

impl From<DeviceRequest> for DeviceSpec {
    fn from(request: DeviceRequest) -> Self {
        match request {
            DeviceRequest::Auto => Self::Auto,
            DeviceRequest::Cpu => Self::Cpu,
            DeviceRequest::Cuda(id) => Self::Cuda(id),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = DeviceSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_spec(s, Grammar::Lists)
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::CudaList(ids) => {
                let ids: Vec<String> = ids.iter().map(usize::to_string).collect();
                write!(f, "cuda:{}", ids.join(","))
            }
            Self::CudaAll => f.write_str("cuda:all"),
        }
    }
}

/// What the strings of [`DeviceSpec`]'s grammar accepted where an error arose.
const EXPECTED_LISTS: &str =
    "expected `cpu`, `cuda`, `cuda:N`, `cuda:N,M,...`, `cuda:all` or `auto`";
/// What the strings of one device ([`DeviceRequest`]) are.
const EXPECTED_ONE: &str = "expected `cpu`, `cuda`, `cuda:N` or `auto`";

/// Why a string is not a [`DeviceSpec`] (or not a [`DeviceRequest`]). `spec` is the
/// string trimmed and in lower case.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceSpecError {
    /// Not a form of the grammar (`tpu`, `cuda0`, `cuda:`).
    #[error("{expected}")]
    Unknown {
        /// The string.
        spec: String,
        /// The forms accepted where it was parsed.
        expected: &'static str,
    },
    /// An item of a list is empty (`cuda:0,`, and `cuda:` where lists are accepted).
    #[error("`{spec}`: an empty device in the list; {EXPECTED_LISTS}")]
    EmptyItem {
        /// The string.
        spec: String,
    },
    /// An item is not a device ordinal (`cuda:x`, `cuda:0,x`).
    #[error("`{spec}`: `{item}` is not a device number; {expected}")]
    NotANumber {
        /// The string.
        spec: String,
        /// The item.
        item: String,
        /// The forms accepted where it was parsed.
        expected: &'static str,
    },
    /// A list names a device twice (`cuda:0,0`).
    #[error("`{spec}`: cuda:{id} is named twice")]
    Repeated {
        /// The string.
        spec: String,
        /// The device named twice.
        id: usize,
    },
    /// A list or `cuda:all` where one device is asked for ([`DeviceRequest`]).
    #[error(
        "`{spec}` names several devices, but one device is asked for here; {EXPECTED_ONE} \
         (open each device on its own)"
    )]
    Several {
        /// The string.
        spec: String,
    },
}

/// Which forms a parse accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Grammar {
    /// Every form of [`DeviceSpec`].
    Lists,
    /// One device ([`DeviceRequest`]): a list is [`DeviceSpecError::Several`].
    OneDevice,
}

fn normalize(s: &str) -> String {
    s.trim().to_ascii_lowercase()
}

/// [`DeviceSpec`]'s grammar; with [`Grammar::OneDevice`] the messages list only the forms
/// of one device and a list is refused at once (`cuda:all` is refused by the caller).
fn parse_spec(s: &str, grammar: Grammar) -> Result<DeviceSpec, DeviceSpecError> {
    let expected = match grammar {
        Grammar::Lists => EXPECTED_LISTS,
        Grammar::OneDevice => EXPECTED_ONE,
    };
    let spec = normalize(s);
    match spec.as_str() {
        "auto" => return Ok(DeviceSpec::Auto),
        "cpu" => return Ok(DeviceSpec::Cpu),
        "cuda" => return Ok(DeviceSpec::Cuda(0)),
        "cuda:all" => return Ok(DeviceSpec::CudaAll),
        _ => {}
    }
    let Some(list) = spec.strip_prefix("cuda:") else {
        return Err(DeviceSpecError::Unknown { spec, expected });
    };
    if grammar == Grammar::OneDevice && list.contains(',') {
        return Err(DeviceSpecError::Several { spec });
    }
    let mut ids = Vec::new();
    for item in list.split(',').map(str::trim) {
        let Ok(id) = item.parse::<usize>() else {
            return Err(if item.is_empty() && grammar == Grammar::Lists {
                DeviceSpecError::EmptyItem { spec }
            } else if item.is_empty() {
                DeviceSpecError::Unknown { spec, expected }
            } else {
                DeviceSpecError::NotANumber {
                    item: item.to_owned(),
                    spec,
                    expected,
                }
            });
        };
        if ids.contains(&id) {
            return Err(DeviceSpecError::Repeated { spec, id });
        }
        ids.push(id);
    }
    Ok(match ids.as_slice() {
        [id] => DeviceSpec::Cuda(*id),
        _ => DeviceSpec::CudaList(ids),
    })
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
    fn device_strings_accepted() {
        let spec = |s: &str| s.parse::<DeviceSpec>().unwrap();
        assert_eq!(spec("auto"), DeviceSpec::Auto);
        assert_eq!(spec("cpu"), DeviceSpec::Cpu);
        assert_eq!(spec("cuda"), DeviceSpec::Cuda(0));
        assert_eq!(spec("cuda:3"), DeviceSpec::Cuda(3));
        assert_eq!(spec(" Cuda:1 "), DeviceSpec::Cuda(1));
        assert_eq!(spec("CPU"), DeviceSpec::Cpu);
        assert_eq!(spec("cuda:0,1"), DeviceSpec::CudaList(vec![0, 1]));
        assert_eq!(spec(" CUDA:2, 0 ,1"), DeviceSpec::CudaList(vec![2, 0, 1]));
        assert_eq!(spec("cuda:all"), DeviceSpec::CudaAll);
        assert_eq!(spec("cuda:1"), DeviceSpec::Cuda(1), "a one-device list");
        assert!(spec("cuda:all").is_multi() && spec("cuda:0,1").is_multi());
        assert!(!spec("cuda:0").is_multi() && !spec("auto").is_multi());
        // Display writes the canonical form, which parses back.
        for s in ["auto", "cpu", "cuda:0", "cuda:7", "cuda:2,0,1", "cuda:all"] {
            assert_eq!(spec(s).to_string(), s);
            assert_eq!(spec(&spec(s).to_string()), spec(s));
        }
        let one = |s: &str| s.parse::<DeviceRequest>().unwrap();
        assert_eq!(one("auto"), DeviceRequest::Auto);
        assert_eq!(one(" CPU"), DeviceRequest::Cpu);
        assert_eq!(one("cuda"), DeviceRequest::Cuda(0));
        assert_eq!(one("cuda:12"), DeviceRequest::Cuda(12));
        for request in [
            DeviceRequest::Auto,
            DeviceRequest::Cpu,
            DeviceRequest::Cuda(5),
        ] {
            assert_eq!(one(&DeviceSpec::from(request).to_string()), request);
        }
    }

    #[test]
    fn device_strings_refused_say_why() {
        let err = |s: &str| s.parse::<DeviceSpec>().unwrap_err();
        for bad in ["", "tpu", "gpu", "cuda0", "cuda 0", "cpu:0", "auto:1"] {
            assert_eq!(
                err(bad),
                DeviceSpecError::Unknown {
                    spec: bad.trim().to_owned(),
                    expected: EXPECTED_LISTS
                },
                "{bad:?}"
            );
            assert!(err(bad).to_string().contains("cuda:all"), "{bad:?}");
        }
        assert_eq!(
            err("cuda:0,0").to_string(),
            "`cuda:0,0`: cuda:0 is named twice"
        );
        assert!(err("cuda:0,x")
            .to_string()
            .contains("`x` is not a device number"));
        assert!(err("cuda:-1")
            .to_string()
            .contains("`-1` is not a device number"));
        assert!(err("cuda:0,").to_string().contains("an empty device"));
        assert!(err("cuda:").to_string().contains("an empty device"));
        assert!(err("cuda:99999999999999999999999")
            .to_string()
            .contains("is not a device number"));

        let one = |s: &str| s.parse::<DeviceRequest>().unwrap_err();
        for several in ["cuda:0,1", "cuda:all", " CUDA:ALL ", "cuda:0,", "cuda:0,0"] {
            let e = one(several);
            assert_eq!(
                e,
                DeviceSpecError::Several {
                    spec: several.trim().to_ascii_lowercase()
                },
                "{several:?}"
            );
            assert!(e.to_string().contains("names several devices"), "{e}");
        }
        for bad in ["gpu", "cuda:", "tpu"] {
            let e = one(bad).to_string();
            assert!(
                e.contains("cuda:N") && !e.contains("cuda:all"),
                "{bad:?}: {e}"
            );
        }
        assert!(one("cuda:x")
            .to_string()
            .contains("`x` is not a device number"));
    }

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
