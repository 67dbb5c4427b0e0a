//! The devices this process opened, once each (`DeviceInner`: the device and its
//! transfer), shared by the Python objects of each device and by imports. Apart from
//! `device.rs` (the Python `Device`), so that batches, streams and downloads reach a
//! device without reaching the Python classes that make them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use devarrow::abi::ArrowDeviceType;
use devarrow::bridge::{Transfer, TransferOptions};
use devarrow::{select_device, DeviceRequest, SelectedDevice};
use pyo3::prelude::*;

use crate::errors::DeviceUnavailableError;

/// A device and the transfer that moves batches to it and back, shared by every object
/// of that device (one per device id in the process).
#[derive(Debug)]
pub struct DeviceInner {
    pub selected: SelectedDevice,
    transfer: Mutex<Transfer>,
}

impl DeviceInner {
    /// The device's transfer, prepared: its staging and the room of the pinned pool its
    /// downloads land in are reserved now, at open, an explicit warm-up
    /// (`Transfer::prepare`), so that no later upload or download allocates pinned memory
    /// (a call that synchronizes the device) or falls back to pageable memory for want of
    /// room in the device's reserve. A refused landing pool is not fatal (downloads then
    /// land in pageable memory, and `Device.transfer_stats()` says why).
    fn new(selected: SelectedDevice) -> devarrow::abi::Result<Arc<Self>> {
        let mut transfer = Transfer::new(selected.device.clone(), TransferOptions::default());
        transfer.prepare()?;
        Ok(Arc::new(Self {
            selected,
            transfer: Mutex::new(transfer),
        }))
    }

    /// The transfer (call without holding the GIL: uploads and downloads wait on it).
    pub fn transfer(&self) -> MutexGuard<'_, Transfer> {
        self.transfer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `cpu` or `cuda:N`.
    pub fn id(&self) -> &str {
        &self.selected.id
    }
}

fn cache() -> MutexGuard<'static, HashMap<String, Arc<DeviceInner>>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<DeviceInner>>>> = OnceLock::new();
    CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// The device of a request, opened once per process; and why it was chosen.
pub fn open(request: DeviceRequest) -> PyResult<(Arc<DeviceInner>, String)> {
    let key = match request {
        DeviceRequest::Cpu => Some("cpu".to_string()),
        DeviceRequest::Cuda(n) => Some(format!("cuda:{n}")),
        DeviceRequest::Auto => None,
    };
    if let Some(inner) = key.as_ref().and_then(|k| cache().get(k).cloned()) {
        return Ok((inner, "as asked".to_string()));
    }
    let selected =
        select_device(request).map_err(|e| DeviceUnavailableError::new_err(e.to_string()))?;
    let reason = match (&request, &selected.fallback) {
        (_, Some(why)) => format!("auto: the CPU device, as {why}"),
        (DeviceRequest::Auto, None) => format!("auto: {} opened", selected.id),
        _ => "as asked".to_string(),
    };
    let mut cache = cache();
    let inner = match cache.get(&selected.id) {
        Some(inner) => inner.clone(),
        None => {
            let id = selected.id.clone();
            let inner = DeviceInner::new(selected).map_err(|e| {
                DeviceUnavailableError::new_err(format!("preparing {id}'s transfers: {e}"))
            })?;
            cache.insert(id, inner.clone());
            inner
        }
    };
    Ok((inner, reason))
}

/// The device that holds arrays of `device_type` / `device_id` (for imports).
pub fn for_arrays(device_type: ArrowDeviceType, device_id: i64) -> PyResult<Arc<DeviceInner>> {
    let request = match device_type {
        ArrowDeviceType::CPU => DeviceRequest::Cpu,
        ArrowDeviceType::CUDA | ArrowDeviceType::CUDA_HOST | ArrowDeviceType::CUDA_MANAGED => {
            DeviceRequest::Cuda(usize::try_from(device_id).unwrap_or(0))
        }
        other => {
            return Err(crate::errors::UnsupportedDeviceError::new_err(format!(
                "data on {other} is not supported (devarrow reads the CPU and CUDA devices)"
            )))
        }
    };
    Ok(open(request)?.0)
}
