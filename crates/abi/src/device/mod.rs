//! One device abstraction for the CPU and CUDA (in the spirit of nanoarrow's small device
//! vtable): allocate memory on the device, copy between host and device on the device's
//! own stream, and mark when enqueued work is done with a sync event. With it, the checks
//! that data lies where a device can use it: on that very device ([`check_same_device`]),
//! or in memory of a type it can import ([`check_stream_device`]).
//!
//! The bridge (arrow-rs record batches to a device and back) is written once against
//! [`Device`]; [`CpuDevice`] implements it with host memory, so the whole bridge logic runs
//! in CI without a GPU, and `devarrow-cuda` implements it on CUDA.

use std::any::Any;
use std::ffi::c_void;
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ffi::ArrowDeviceType;

/// Alignment of every device allocation and of every buffer packed into one (64 bytes,
/// as the Arrow columnar format recommends).
pub const BUFFER_ALIGNMENT: usize = 64;

/// Memory on a device: freed when the last reference drops.
///
/// # Safety
/// Code that copies to and from device memory (the bridge) trusts implementations:
/// `address()` must return the same address on every call, the start of at least `len()`
/// bytes of the device's memory that stay allocated for as long as the value lives.
pub unsafe trait DeviceMemory: Send + Sync + fmt::Debug {
    /// The address of the first byte on the device (a host pointer for the CPU).
    fn address(&self) -> *mut c_void;
    /// The size in bytes.
    fn len(&self) -> usize;
    /// Whether the allocation is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The concrete type, for device implementations that need it back.
    fn as_any(&self) -> &dyn Any;
}

/// Page-locked (pinned) host memory the device can DMA from and to directly; plain host
/// memory on the CPU device.
///
/// # Safety
/// Devices copy to and from staging memory asynchronously, through the pointer of a slice
/// taken earlier: both slices must cover the same memory on every call (no reallocation),
/// which stays allocated for as long as the value lives.
pub unsafe trait StagingMemory: Send + fmt::Debug {
    /// The memory, writable by the host.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// The memory, readable by the host.
    fn as_slice(&self) -> &[u8];
}

/// A point in a device's stream of work: done once everything enqueued before it is.
///
/// # Safety
/// Callers free or reuse memory once `wait_host` returns `Ok`: it must return `Ok` only
/// after all work enqueued on the device before the event was recorded has completed.
/// `as_sync_event_ptr` must be NULL or point to a live event of the device's type (for
/// CUDA, a `CUevent`) for as long as the value lives.
pub unsafe trait SyncEvent: Send + Sync + fmt::Debug {
    /// What `ArrowDeviceArray.sync_event` should hold for this event (NULL when the data
    /// is ready as soon as the call returns, as on the CPU). For CUDA: a `CUevent*`.
    fn as_sync_event_ptr(&self) -> *mut c_void;
    /// Blocks the calling host thread until the event has completed.
    fn wait_host(&self) -> Result<()>;
}

/// One copy of [`Device::copy_on_device`]: `len` bytes from device address `src` to
/// device address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCopy {
    /// The source address on the device.
    pub src: *const c_void,
    /// The destination address on the device.
    pub dst: *mut c_void,
    /// The number of bytes.
    pub len: usize,
}

/// One copy of [`Device::copy_batch_to_device`]: `len` bytes from host memory at `src`
/// to device address `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostToDevice {
    /// The source in host memory.
    pub src: *const u8,
    /// The destination on the device.
    pub dst: *mut c_void,
    /// The number of bytes.
    pub len: usize,
}

/// One copy of [`Device::copy_batch_to_host`]: `len` bytes from device address `src` to
/// host memory at `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceToHost {
    /// The source on the device.
    pub src: *const c_void,
    /// The destination in host memory.
    pub dst: *mut u8,
    /// The number of bytes.
    pub len: usize,
}

/// Host memory that a device made directly DMA-able ([`Device::register_host`]; on CUDA,
/// pages locked with `cuMemHostRegister`) for as long as the value lives: dropping it
/// undoes that, which is why the registration's contract says when it may be dropped.
pub trait HostRegistration: Send + fmt::Debug {}

/// A device data can be moved to and from. Copies are enqueued on the device's own stream
/// in call order; host memory passed to a copy must stay valid until an event recorded
/// after it has completed (or [`Device::synchronize`] returned).
///
/// # Safety
/// The bridge's unsafe code relies on what implementations promise here:
/// - `allocate(len)` returns memory of this device (`device_type`, `device_id`) of at least
///   `len` bytes aligned to [`BUFFER_ALIGNMENT`]; `allocate_staging(len)` returns at least
///   `len` bytes;
/// - copies and events are ordered on one stream in call order: an event from
///   `record_event` completes only after every copy enqueued before it, and `synchronize`
///   returns `Ok` only once all enqueued work has completed;
/// - `is_pinned` answers `true` only as its documentation says;
/// - `host_accessible` answers `true` only as its documentation says.
pub unsafe trait Device: Send + Sync + fmt::Debug {
    /// The `ArrowDeviceType` of memory this device allocates.
    fn device_type(&self) -> ArrowDeviceType;
    /// The `device_id` of arrays on this device (-1 for the CPU).
    fn device_id(&self) -> i64;
    /// Allocates `len` bytes (uninitialized), aligned to [`BUFFER_ALIGNMENT`].
    fn allocate(&self, len: usize) -> Result<Arc<dyn DeviceMemory>>;
    /// Allocates host staging memory the device can copy from and to without another
    /// copy (pinned on CUDA, from the pinned memory the device reserved; beyond it, CUDA
    /// hands out pageable memory rather than allocate pinned memory, which would
    /// synchronize the device). Its bytes are initialized, not necessarily zero (memory
    /// used before holds what its last user wrote).
    fn allocate_staging(&self, len: usize) -> Result<Box<dyn StagingMemory>>;
    /// [`Device::allocate_staging`] where the device can hand out memory it copies
    /// directly without allocating any (CUDA: a block of the pinned memory it reserved),
    /// else `None`. The default allocates.
    fn try_allocate_staging(&self, len: usize) -> Result<Option<Box<dyn StagingMemory>>> {
        self.allocate_staging(len).map(Some)
    }
    /// An explicit warm-up: makes sure a staging allocation of `bytes` can be served
    /// from memory the device already holds (CUDA: reserves pinned memory with
    /// `cuMemHostAlloc` where its free pinned memory has no range that large, an
    /// implicit synchronization of the device made here rather than in a pipeline). The
    /// default does nothing.
    fn reserve_staging(&self, bytes: usize) -> Result<()> {
        let _ = bytes;
        Ok(())
    }
    /// Enqueues a copy of `len` bytes from host memory `src` to device address `dst`.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes until the copy has completed; `dst`
    /// must be valid device memory for `len` bytes.
    unsafe fn copy_to_device(&self, src: *const u8, dst: *mut c_void, len: usize) -> Result<()>;
    /// Enqueues a copy of `len` bytes from device address `src` to host memory `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes until the copy has completed, and not
    /// read before; `src` must be valid device memory for `len` bytes.
    unsafe fn copy_to_host(&self, src: *const c_void, dst: *mut u8, len: usize) -> Result<()>;
    /// Enqueues every copy of `copies` from device memory to device memory, as one
    /// operation where the device has one (one `dvx_batched_copy` kernel launch on CUDA,
    /// `memcpy`s on the CPU). Not counted by [`CopyCounter::copy_count`], which counts
    /// host-device copies.
    ///
    /// The default goes through host staging memory (a copy to the host per segment, a
    /// host wait, a copy back per segment, a host wait): correct on any device, but slow
    /// and blocking; devices override it.
    ///
    /// # Safety
    /// Every source must be device memory readable for its `len` bytes and every
    /// destination device memory writable for its `len` bytes until the copy has
    /// completed; no destination may overlap another destination or any source.
    unsafe fn copy_on_device(&self, copies: &[DeviceCopy]) -> Result<()> {
        let copies: Vec<&DeviceCopy> = copies.iter().filter(|c| c.len > 0).collect();
        let total = copies
            .iter()
            .try_fold(0usize, |t, c| t.checked_add(c.len))
            .ok_or_else(|| Error::InvalidArgument("copies on the device overflow".into()))?;
        if total == 0 {
            return Ok(());
        }
        let mut staging = self.allocate_staging(total)?;
        let base = staging.as_mut_slice().as_mut_ptr();
        let result = (|| {
            let mut at = 0;
            for c in &copies {
                // SAFETY: the source is the caller's guarantee; the staging range `at..at
                // + len` lies inside the `total` bytes allocated above, is not read before
                // the wait below, and the staging memory outlives the copy (we wait).
                unsafe { self.copy_to_host(c.src, base.add(at), c.len)? };
                at += c.len;
            }
            self.record_event()?.wait_host()?;
            let mut at = 0;
            for c in &copies {
                // SAFETY: the staging bytes were written by the completed copies above;
                // the destination is the caller's guarantee; we wait for the copies below
                // before the staging memory is freed.
                unsafe { self.copy_to_device(base.add(at), c.dst, c.len)? };
                at += c.len;
            }
            self.record_event()?.wait_host()
        })();
        if result.is_err() {
            // Copies may still use the staging memory, freed when we return.
            let _ = self.synchronize();
        }
        result
    }
    /// Enqueues every copy of `copies` from host memory to the device, as one operation
    /// where the device has one (on CUDA, one `cuMemcpyBatchAsync` when its options ask
    /// for batched copies and the driver has them), else one
    /// [`Device::copy_to_device`] each, in order (the default). Each copy counts in
    /// [`CopyCounter::copy_count`] as one.
    ///
    /// # Safety
    /// Every copy as [`Device::copy_to_device`] requires; the copies may run in any order
    /// (concurrently), so no destination may overlap another copy's destination.
    unsafe fn copy_batch_to_device(&self, copies: &[HostToDevice]) -> Result<()> {
        for c in copies {
            // SAFETY: the caller's guarantees, copy by copy.
            unsafe { self.copy_to_device(c.src, c.dst, c.len)? };
        }
        Ok(())
    }
    /// Enqueues every copy of `copies` from the device to host memory, as one operation
    /// where the device has one, else one [`Device::copy_to_host`] each, in order (the
    /// default). As [`Device::copy_batch_to_device`].
    ///
    /// # Safety
    /// Every copy as [`Device::copy_to_host`] requires; no destination may overlap
    /// another copy's destination.
    unsafe fn copy_batch_to_host(&self, copies: &[DeviceToHost]) -> Result<()> {
        for c in copies {
            // SAFETY: the caller's guarantees, copy by copy.
            unsafe { self.copy_to_host(c.src, c.dst, c.len)? };
        }
        Ok(())
    }
    /// Enqueues one direct copy of `len` bytes from `src`, memory of device `from` (another
    /// device, or this one), to `dst`, memory of this device, on this device's stream,
    /// where the two devices have a direct path: CUDA devices whose
    /// `cuDeviceCanAccessPeer` says so (`cuMemcpyPeerAsync`, peer access enabled and
    /// remembered), a `memcpy` between CPU devices. The caller orders the copy after the
    /// source's work (this device's stream waits on the source's event first) and keeps
    /// the source memory alive until the copy has completed.
    ///
    /// `Ok(false)`: no direct path (other device types, no peer access; the default):
    /// the caller stages the bytes through host memory instead. Nothing was enqueued.
    ///
    /// # Safety
    /// `src` must be memory of `from` readable for `len` bytes and `dst` memory of this
    /// device writable for `len` bytes until the copy has completed.
    unsafe fn copy_from_peer(
        &self,
        from: &dyn Device,
        src: *const c_void,
        dst: *mut c_void,
        len: usize,
    ) -> Result<bool> {
        let _ = (from, src, dst, len);
        Ok(false)
    }
    /// A handle on another device of this device's type, `device_id`, with this device's
    /// options (its own stream): what an import of an array living there reads it on
    /// before copying it here (`DeviceBatch::import_with_options` with
    /// `ImportOptions::copy_from_other_device`). `Ok(None)`: this device has no such
    /// handle (the default; the CPU device).
    fn peer_device(&self, device_id: i64) -> Result<Option<Arc<dyn Device>>> {
        let _ = device_id;
        Ok(None)
    }
    /// The device's data-parallel kernels ([`DeviceKernels`]), run on its stream in order
    /// with its copies, or `None` (the default) for a device without them: exports that
    /// rewrite arrays on the device (the bridge's `ExportOptions::for_libcudf`) are then
    /// refused with a typed error.
    fn kernels(&self) -> Option<&dyn DeviceKernels> {
        None
    }
    /// Records an event after all work enqueued so far.
    fn record_event(&self) -> Result<Arc<dyn SyncEvent>>;
    /// Makes later work on this device's stream wait for a producer's `sync_event`
    /// (without blocking the host). NULL means the data is ready.
    ///
    /// # Safety
    /// A non-NULL `sync_event` must point to a live event of this device's type.
    unsafe fn wait_sync_event(&self, sync_event: *mut c_void) -> Result<()>;
    /// Blocks the host until all work enqueued on this device's stream has completed.
    fn synchronize(&self) -> Result<()>;
    /// The handles `(context, stream)` of the one stream where this device enqueues its
    /// copies and records its events, for devices with such a stream (CUDA), `None` (the
    /// default) otherwise. Two devices that return the same `Some` share that stream, so
    /// work they enqueue is ordered by stream order alone: the bridge then skips events
    /// between them. Part of the trait's safety contract: a `Some` must be true.
    fn stream_handles(&self) -> Option<(usize, usize)> {
        None
    }

    // ---- Pinned host memory: what the device can DMA directly (issue #4) ----

    /// Whether the `len` host bytes at `ptr` lie in memory this device can copy from and
    /// to directly at full speed (page-locked memory: on CUDA, staging memory from
    /// [`Device::allocate_staging`] or other pinned memory the driver knows), so that a
    /// transfer may copy them without packing them into staging memory first.
    ///
    /// `true` promises that the whole range lies inside **one** live allocation of such
    /// memory (callers may then copy the range in one piece, bytes between their own
    /// buffers included); when unsure, answer `false`, which is always correct: copies
    /// of any host memory work, only slower. The default (for devices that do not track
    /// pinned memory) is `false`. Never dereferences `ptr`.
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        let _ = (ptr, len);
        false
    }

    // ---- Registering pageable host memory for direct DMA ----

    /// The size from which this device makes pageable host memory directly DMA-able
    /// ([`Device::register_host`]), or `None` (the default) when it never does. A
    /// transfer asks to register only ranges at least this large.
    fn host_registration_min_bytes(&self) -> Option<usize> {
        None
    }

    /// Makes the whole host pages inside the `len` bytes at `ptr` (ordinary pageable
    /// memory: an arrow-rs buffer to upload, a host buffer to download into) directly
    /// DMA-able for copies to and from this device, so that a transfer copies them in
    /// place instead of through staging memory (on CUDA: those pages locked with
    /// `cuMemHostRegister`). A cost paid per call: worth it for large ranges only (see
    /// [`Device::host_registration_min_bytes`]).
    ///
    /// Only the pages lying wholly inside the range are registered ([`whole_pages`]):
    /// the partial pages at its ends may hold other allocations (a neighbouring buffer of
    /// the heap), whose copies would otherwise be taken for direct ones while this
    /// registration lasts, and be left running on pages it unlocks. The caller copies the
    /// bytes before and after those pages as any host memory; an allocation made for
    /// the purpose (page-aligned, its length a whole number of pages) is registered whole.
    ///
    /// `Ok(Some(registration))`: until `registration` drops, [`whole_pages`]`(ptr, len)`
    /// is as [`Device::is_pinned`] would answer `true` for it (copies of any part of it
    /// run at full speed, asynchronously). `Ok(None)`: not registered (the default; a
    /// device that does not register memory, whole pages below its threshold, memory the
    /// driver refuses to lock, pages shared with page-locked memory of another owner):
    /// copy it as any host memory. Errors are the device's failures (a broken context),
    /// not refusals.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be host memory that stays allocated until the registration
    /// drops, and the registration must be dropped only after every copy enqueued on
    /// the range has completed (an event recorded after them waited for, or the device
    /// synchronized): undoing it under a running DMA lets the device read or write pages
    /// the system may have moved.
    unsafe fn register_host(
        &self,
        ptr: *const u8,
        len: usize,
    ) -> Result<Option<Box<dyn HostRegistration>>> {
        let _ = (ptr, len);
        Ok(None)
    }

    /// Whether the host may read and write this device's memory directly, at host memory
    /// speed: the CPU device ([`CpuDevice::direct`]), or memory a device shares with the
    /// host. A transfer then packs a batch straight into device memory and unpacks it
    /// straight from there, without staging copies (on such a device a staging copy is
    /// one more `memcpy` of every byte, not a DMA the host gets for free).
    ///
    /// `true` promises that every [`DeviceMemory::address`] of memory this device
    /// allocates is a host address of `len()` initialized bytes (readable as `&[u8]`),
    /// and that the device never has work pending: its copies complete before their call
    /// returns, so the host may touch device memory without waiting for events. The
    /// default is `false`.
    fn host_accessible(&self) -> bool {
        false
    }
}

// ---- Beside the device: its memory pool's policy, its instrumentation ----

/// What a device's memory pool keeps of the memory freed into it: a policy of the pool,
/// not something a device needs to move data (the bridge never calls it). Engines and
/// benchmarks that free and allocate a known amount per cycle set it.
pub trait MemoryPoolPolicy {
    /// Lets the device's memory pool keep up to `bytes` of freed device memory for reuse
    /// (`None`: what it keeps by default, 1 GiB; on CUDA an eighth of the device where
    /// that is less), for a steady state that frees and allocates more than that. Beyond
    /// what the pool keeps, each cycle's allocations take fresh memory from the system:
    /// page faults on the CPU device, new physical pages mapped on CUDA. Memory kept is
    /// not available to other allocators (another library on the same GPU).
    ///
    /// CUDA: the release threshold of devarrow's pool of the device
    /// (`devarrow_cuda::pool::PoolPolicy::release_threshold`), for every handle on it.
    fn retain_freed_memory(&self, bytes: Option<usize>) -> Result<()>;
}

/// Instrumentation of a device: how many host-device copies it has enqueued. Lets tests
/// and benchmarks assert, or report, that a transfer moved its buffers in few copies;
/// nothing in the bridge depends on it.
pub trait CopyCounter {
    /// How many host-device copies this device has enqueued since it was created (each
    /// copy of a batched copy counts as one; copies on the device do not count).
    fn copy_count(&self) -> u64;
}

// ---- Same-device checks ----

/// Checks that `device` can copy the memory of data living on `home` (a batch `home`
/// allocated, or imported on): both must be the same device, by device type and id. Two
/// handles on one device that differ otherwise (e.g. in their streams) pass.
///
/// # Errors
/// [`Error::UnsupportedDevice`] when the device types differ (accepting `device`'s type,
/// named "the transfer's device" as the bridge's transfers call this),
/// [`Error::DeviceMismatch`] when the ids differ: a device cannot copy another one's
/// memory.
pub fn check_same_device(home: &dyn Device, device: &dyn Device) -> Result<()> {
    let (found, id) = (home.device_type(), home.device_id());
    if found != device.device_type() {
        return Err(Error::UnsupportedDevice {
            found,
            accepted: format!("{} (the transfer's device)", device.device_type()),
        });
    }
    if id != device.device_id() {
        return Err(Error::DeviceMismatch {
            device_type: found,
            expected: device.device_id(),
            found: id,
        });
    }
    Ok(())
}

/// Checks that `device` can import arrays whose memory is of type `found` (the
/// `device_type` of an `ArrowDeviceArray` or of an `ArrowDeviceArrayStream`): the device's
/// own type, or a host-visible type of its family (`ARROW_DEVICE_CUDA_HOST` and
/// `ARROW_DEVICE_CUDA_MANAGED` for a CUDA device, `ARROW_DEVICE_ROCM_HOST` for a ROCm
/// one).
///
/// Only the type is checked: an array of the device's own (non-CPU) type must also have
/// the device's id, which a stream's type alone does not tell.
///
/// # Errors
/// [`Error::UnsupportedDevice`], listing the accepted types.
pub fn check_stream_device(device: &dyn Device, found: ArrowDeviceType) -> Result<()> {
    let own = device.device_type();
    let accepted: &[ArrowDeviceType] = match own {
        ArrowDeviceType::CUDA => &[
            ArrowDeviceType::CUDA,
            ArrowDeviceType::CUDA_HOST,
            ArrowDeviceType::CUDA_MANAGED,
        ],
        ArrowDeviceType::ROCM => &[ArrowDeviceType::ROCM, ArrowDeviceType::ROCM_HOST],
        _ => std::slice::from_ref(&own),
    };
    if accepted.contains(&found) {
        Ok(())
    } else {
        Err(Error::UnsupportedDevice {
            found,
            accepted: accepted
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }
}

pub mod copy;
mod cpu;
mod kernels;
pub mod link;
pub mod pool;
pub use cpu::{CpuDevice, CpuEvent, CpuStaging, HostMemory};
pub use kernels::{CpuKernels, DeviceKernels, RowIntegers, Validity};
pub use link::{LinkEvent, LinkModel};
pub use pool::{host_page_size, whole_pages, HostPool, PoolStats, PooledMemory};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_device_checks() {
        let cpu = CpuDevice::new();
        assert!(check_same_device(&cpu, &CpuDevice::new()).is_ok());
        assert!(check_stream_device(&cpu, ArrowDeviceType::CPU).is_ok());
        let err = check_stream_device(&cpu, ArrowDeviceType::CUDA).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::UnsupportedDevice { found: ArrowDeviceType::CUDA, accepted }
                    if *accepted == ArrowDeviceType::CPU.to_string()
            ),
            "{err:?}"
        );
    }
}
