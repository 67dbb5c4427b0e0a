//! The CPU as a [`Device`]: host memory, `memcpy` copies, events complete at once.

use std::alloc::Layout;
use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Device, DeviceCopy, DeviceMemory, StagingMemory, SyncEvent, BUFFER_ALIGNMENT};
use crate::error::{Error, Result};
use crate::ffi::ArrowDeviceType;
use crate::pinned_registry::PinnedRegistry;

/// The CPU as a [`Device`]: "device" memory is host memory, copies are `memcpy`, events
/// are complete at once (and exported as a NULL `sync_event`).
#[derive(Debug, Default)]
pub struct CpuDevice {
    copies: AtomicU64,
}

impl CpuDevice {
    /// A CPU device.
    pub fn new() -> Self {
        Self::default()
    }
}

/// A host allocation aligned to [`BUFFER_ALIGNMENT`].
#[derive(Debug)]
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: HostMemory exclusively owns its allocation; the raw pointer is not shared
// with any thread-affine resource.
unsafe impl Send for HostMemory {}
// SAFETY: shared references only expose the address and length.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Allocates `len` zeroed bytes aligned to [`BUFFER_ALIGNMENT`].
    pub fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(Self {
                ptr: std::ptr::null_mut::<u8>().wrapping_add(BUFFER_ALIGNMENT),
                len: 0,
            });
        }
        let layout = Self::layout(len)?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::Arrow(arrow_schema::ArrowError::MemoryError(
                format!("cannot allocate {len} bytes of host memory"),
            )));
        }
        Ok(Self { ptr, len })
    }

    fn layout(len: usize) -> Result<Layout> {
        Layout::from_size_align(len, BUFFER_ALIGNMENT)
            .map_err(|e| Error::InvalidArgument(format!("allocation of {len} bytes: {e}")))
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `zeroed` with this very layout.
            unsafe {
                std::alloc::dealloc(
                    self.ptr,
                    Self::layout(self.len).expect("valid at allocation"),
                )
            };
        }
    }
}

// SAFETY: the address is fixed at allocation and owned (freed on drop) by the value.
unsafe impl DeviceMemory for HostMemory {
    fn address(&self) -> *mut c_void {
        self.ptr.cast()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

// SAFETY: both slices cover the one allocation the value owns, never reallocated.
unsafe impl StagingMemory for HostMemory {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `len` bytes (or dangling and aligned for len 0) and
        // exclusively borrowed through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn as_slice(&self) -> &[u8] {
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// The CPU's event: always complete.
#[derive(Debug)]
pub struct CpuEvent;

// SAFETY: CPU copies are complete when the copy call returns; the pointer is NULL.
unsafe impl SyncEvent for CpuEvent {
    fn as_sync_event_ptr(&self) -> *mut c_void {
        std::ptr::null_mut()
    }
    fn wait_host(&self) -> Result<()> {
        Ok(())
    }
}

// SAFETY: allocations are aligned host memory of the size asked for; copies are
// `memcpy`s complete when the call returns, so every event and `synchronize` is complete.
unsafe impl Device for CpuDevice {
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }
    fn device_id(&self) -> i64 {
        crate::cpu::CPU_DEVICE_ID
    }
    fn allocate(&self, len: usize) -> Result<Arc<dyn DeviceMemory>> {
        Ok(Arc::new(HostMemory::zeroed(len)?))
    }
    fn allocate_staging(&self, len: usize) -> Result<Box<dyn StagingMemory>> {
        Ok(Box::new(CpuStaging::new(len)?))
    }
    unsafe fn copy_to_device(&self, src: *const u8, dst: *mut c_void, len: usize) -> Result<()> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller guarantees both ranges are valid; they are distinct
        // allocations (staging or user memory, and device memory).
        unsafe { std::ptr::copy_nonoverlapping(src, dst.cast::<u8>(), len) };
        Ok(())
    }
    unsafe fn copy_to_host(&self, src: *const c_void, dst: *mut u8, len: usize) -> Result<()> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as in `copy_to_device`.
        unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), dst, len) };
        Ok(())
    }
    unsafe fn copy_on_device(&self, copies: &[DeviceCopy]) -> Result<()> {
        for c in copies {
            if c.len == 0 {
                continue;
            }
            // SAFETY: the caller guarantees each source is readable and each destination
            // writable for `len` bytes, and that no destination overlaps a source.
            unsafe { std::ptr::copy_nonoverlapping(c.src.cast::<u8>(), c.dst.cast::<u8>(), c.len) };
        }
        Ok(())
    }
    fn record_event(&self) -> Result<Arc<dyn SyncEvent>> {
        Ok(Arc::new(CpuEvent))
    }
    unsafe fn wait_sync_event(&self, sync_event: *mut c_void) -> Result<()> {
        if sync_event.is_null() {
            Ok(())
        } else {
            Err(Error::UnexpectedSyncEvent {
                device_type: ArrowDeviceType::CPU,
            })
        }
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn copy_count(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    /// The CPU's own staging allocations (any [`CpuDevice`]'s) count as pinned, nothing
    /// else: the CPU device stands in for a GPU in tests, where ordinary (pageable)
    /// memory must go through staging as it does on CUDA.
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        CPU_STAGING.contains(ptr, len)
    }
}

/// The live staging allocations of every [`CpuDevice`].
static CPU_STAGING: PinnedRegistry = PinnedRegistry::new();

/// Staging memory of the [`CpuDevice`]: [`HostMemory`] registered as "pinned" while it
/// lives (see [`Device::is_pinned`]).
#[derive(Debug)]
pub struct CpuStaging(HostMemory);

impl CpuStaging {
    /// Allocates `len` zeroed bytes and registers them.
    pub fn new(len: usize) -> Result<Self> {
        let memory = HostMemory::zeroed(len)?;
        CPU_STAGING.register(memory.ptr, memory.len);
        Ok(Self(memory))
    }
}

impl Drop for CpuStaging {
    fn drop(&mut self) {
        CPU_STAGING.unregister(self.0.ptr);
    }
}

// SAFETY: delegates to the `HostMemory` it owns.
unsafe impl StagingMemory for CpuStaging {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
    fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }
}
