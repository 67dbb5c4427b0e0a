//! Lists of host-device copies ([`Device::copy_batch_to_device`],
//! [`Device::copy_batch_to_host`]): one `cuMemcpyBatchAsync` where the driver has it and
//! the options ask for it, else the caller copies them one by one.
//!
//! [`Device::copy_batch_to_device`]: devarrow_abi::device::Device::copy_batch_to_device
//! [`Device::copy_batch_to_host`]: devarrow_abi::device::Device::copy_batch_to_host

use std::sync::atomic::Ordering;

use cudarc::driver::sys;

use crate::driver;
use crate::error::{CudaError, Result};

use super::{CudaDevice, Direction, BATCH_AVAILABLE, BATCH_UNAVAILABLE, LEGACY_STREAM};

impl CudaDevice {
    /// Whether a list of copies goes to `cuMemcpyBatchAsync`: asked for, the stream not
    /// the legacy default stream, and the symbol in the driver (looked up once).
    pub(super) fn batch_copy_usable(&self) -> bool {
        if !self.options.batch_copies {
            return false;
        }
        let stream = self.stream.cu_stream() as usize;
        if stream == 0 || stream == LEGACY_STREAM {
            return false;
        }
        match self.batch_copy.load(Ordering::Acquire) {
            BATCH_AVAILABLE => true,
            BATCH_UNAVAILABLE => false,
            _ => {
                let present = driver::memcpy_batch_async_present();
                let state = if present {
                    BATCH_AVAILABLE
                } else {
                    BATCH_UNAVAILABLE
                };
                self.batch_copy.store(state, Ordering::Release);
                present
            }
        }
    }

    /// Enqueues `copies` (`(dst, src, len)` unified addresses, none empty or NULL) in one
    /// `cuMemcpyBatchAsync` where [`CudaDevice::batch_copy_usable`]: `Ok(true)` when they
    /// were, `Ok(false)` when the caller must copy them one by one (too few to batch, not
    /// asked for, or the driver does not have it: then remembered).
    ///
    /// # Safety
    /// Every source readable and every destination writable for its length until the
    /// copies complete, no destination overlapping another copy; the context bound.
    pub(super) unsafe fn try_batch(
        &self,
        copies: &[(u64, u64, usize)],
        direction: Direction,
    ) -> Result<bool> {
        if copies.len() < 2 || !self.batch_copy_usable() {
            return Ok(false);
        }
        let mut dsts: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.0).collect();
        let mut srcs: Vec<sys::CUdeviceptr> = copies.iter().map(|c| c.1).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
        let host = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        };
        let device = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: self.device.id() as i32,
        };
        let locations = match direction {
            Direction::ToDevice => (host, device),
            Direction::ToHost => (device, host),
        };
        // SAFETY: the symbol is there (`batch_copy_usable`); the ranges are the caller's
        // guarantee; the stream is the device's, a created stream (not the legacy one,
        // checked above) of the context the caller bound.
        let batched = unsafe {
            driver::memcpy_batch_async(
                &mut dsts,
                &mut srcs,
                &mut sizes,
                locations,
                self.stream.cu_stream(),
            )
        };
        match batched {
            Ok(()) => {
                self.batched_calls.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(e) if e.allows_fallback() => {
                // Not usable here after all, whatever code says so: a driver that
                // exports the symbol but does not implement it (NOT_SUPPORTED,
                // NOT_FOUND), a sandbox that refuses it (NOT_PERMITTED, OPERATING_SYSTEM
                // under gVisor's nvproxy), ...: any error that leaves the context
                // usable. Copy one by one, from now on. The batch enqueued nothing (and
                // had it enqueued a part, copying the same sources to the same
                // destinations again writes the same bytes).
                self.batch_copy.store(BATCH_UNAVAILABLE, Ordering::Release);
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// What a list of copies does first: counts them, drops the empty ones, refuses NULL
    /// pointers, and binds the context. `(dst, src, len)` of the copies left.
    pub(super) fn begin_batch(
        &self,
        copies: impl ExactSizeIterator<Item = (u64, u64, usize)>,
        towards: &str,
    ) -> Result<Vec<(u64, u64, usize)>> {
        self.copies
            .fetch_add(copies.len() as u64, Ordering::Relaxed);
        let copies: Vec<_> = copies.filter(|c| c.2 > 0).collect();
        if copies.iter().any(|c| c.0 == 0 || c.1 == 0) {
            return Err(CudaError::InvalidArgument(format!(
                "a batch of copies to the {towards} with a NULL pointer"
            )));
        }
        if !copies.is_empty() {
            self.bind()?;
        }
        Ok(copies)
    }
}
