//! The CPU as a [`Device`]: host memory (from a pool that reuses freed blocks), `memcpy`
//! copies, and three ways to run them:
//!
//! - [`CpuDevice::new`]: copies are `memcpy`s in the calling thread, events complete at
//!   once. The device stands in for a GPU (in tests, in CI): the bridge treats its memory
//!   as out of the host's reach and moves every byte through staging memory, as on CUDA.
//! - [`CpuDevice::direct`]: the CPU device as it is: its memory is host memory the host
//!   may write and read directly ([`Device::host_accessible`]), so a transfer packs
//!   straight into it and unpacks straight from it, without staging copies.
//! - [`CpuDevice::with_link`]: copies run asynchronously on a copy-engine thread at the
//!   bandwidth and latency of a modelled link ([`LinkModel`]), in stream order, and events
//!   complete when the modelled copy does: what a GPU's copy engine does, so pipelining
//!   shows. Copies from or to memory that is not staging memory (pageable memory) are
//!   synchronous, as a driver does them (through its own staging).

use std::alloc::Layout;
use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::copy::{copy_bytes, Stores};
use super::kernels::{CpuKernels, DeviceKernels, RowIntegers, Validity};
use super::link::{LinkEngine, LinkEvent, LinkModel};
use super::pool::{HostPool, PoolStats, PooledMemory, DEFAULT_POOL_LIMIT};
use super::{
    CopyCounter, Device, DeviceCopy, DeviceMemory, MemoryPoolPolicy, StagingMemory, SyncEvent,
    BUFFER_ALIGNMENT,
};
use crate::error::{Error, Result};
use crate::ffi::ArrowDeviceType;
use crate::pinned_registry::PinnedRegistry;

/// The staging memory a [`CpuDevice`] keeps once its transfers free it: 256 MiB, above
/// what a transfer's staging and a few coalesced uploads hold at once.
const STAGING_POOL_LIMIT: usize = 256 << 20;

/// How a [`CpuDevice`] runs its copies.
#[derive(Debug)]
enum Mode {
    /// `memcpy` in the calling thread; memory reached through copies only.
    Staged,
    /// `memcpy` in the calling thread; memory the host reaches directly.
    Direct,
    /// On the copy engine of a modelled link.
    Link(Arc<LinkEngine>),
}

/// The CPU as a [`Device`]: "device" memory is host memory from a pool that reuses freed
/// blocks ([`HostPool`]: no page faults and no zeroing after a block's first use), copies
/// are `memcpy`. Three modes: [`CpuDevice::new`] (stands in for a GPU: every byte through
/// staging), [`CpuDevice::direct`] (its memory is host memory, packed into directly) and
/// [`CpuDevice::with_link`] (copies at the speed of a modelled link).
///
/// # Example
///
/// The [`Device`] calls the bridge makes, on the CPU: allocate, copy each way on the
/// device's stream, record an event, wait for it.
///
/// ```
/// use devarrow_abi::device::{CopyCounter, CpuDevice, Device};
/// use devarrow_abi::ArrowDeviceType;
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let device = CpuDevice::new();
/// assert_eq!(device.device_type(), ArrowDeviceType::CPU);
///
/// let memory = device.allocate(4)?;
/// let input = [1u8, 2, 3, 4];
/// let mut output = [0u8; 4];
/// // SAFETY: `input` and `output` outlive the copies (we wait for the event below), and
/// // `memory` holds 4 bytes of this device.
/// unsafe {
///     device.copy_to_device(input.as_ptr(), memory.address(), 4)?;
///     device.copy_to_host(memory.address(), output.as_mut_ptr(), 4)?;
/// }
/// device.record_event()?.wait_host()?;
/// assert_eq!(output, input);
/// assert_eq!(device.copy_count(), 2);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct CpuDevice {
    copies: AtomicU64,
    pool: Arc<HostPool>,
    /// Staging memory freed by transfers, kept for the next (as CUDA's reserve of pinned
    /// memory is sub-allocated again, never faulted in anew).
    staging: Arc<HostPool>,
    mode: Mode,
}

impl Default for CpuDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuDevice {
    /// A CPU device standing in for a GPU: synchronous copies, every transfer staged.
    pub fn new() -> Self {
        Self::with_mode(Mode::Staged)
    }

    fn with_mode(mode: Mode) -> Self {
        Self {
            copies: AtomicU64::new(0),
            pool: Arc::new(HostPool::new(DEFAULT_POOL_LIMIT)),
            staging: Arc::new(HostPool::new(STAGING_POOL_LIMIT)),
            mode,
        }
    }

    /// A CPU device whose memory the host reads and writes directly
    /// ([`Device::host_accessible`]): transfers pack into it without staging copies.
    pub fn direct() -> Self {
        Self::with_mode(Mode::Direct)
    }

    /// A CPU device whose host-device copies run on a copy-engine thread at the speed of
    /// `link` ([`LinkModel`]), in stream order; events complete when the modelled copy
    /// does, and copies from or to pageable memory are synchronous.
    ///
    /// # Panics
    /// If the copy engine's thread cannot be started.
    pub fn with_link(link: LinkModel) -> Self {
        let engine = LinkEngine::start(link).expect("starting the copy engine's thread");
        // Memory goes back to the system only once no enqueued copy uses it any more.
        let weak: Weak<LinkEngine> = Arc::downgrade(&engine);
        let fence = Box::new(move || {
            if let Some(engine) = weak.upgrade() {
                engine.synchronize();
            }
        });
        Self {
            copies: AtomicU64::new(0),
            pool: Arc::new(HostPool::with_fence(DEFAULT_POOL_LIMIT, fence)),
            staging: Arc::new(HostPool::new(STAGING_POOL_LIMIT)),
            mode: Mode::Link(engine),
        }
    }

    /// The link this device models, if any.
    pub fn link(&self) -> Option<LinkModel> {
        match &self.mode {
            Mode::Link(engine) => Some(engine.model()),
            _ => None,
        }
    }

    /// The pool device memory comes from.
    pub fn memory_pool(&self) -> &Arc<HostPool> {
        &self.pool
    }

    /// What the memory pool has done.
    pub fn memory_pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// What the pool of staging memory has done (misses: staging memory new from the
    /// system, faulted in when first written).
    pub fn staging_pool_stats(&self) -> PoolStats {
        self.staging.stats()
    }

    /// Gives the freed memory the pool keeps back to the system; returns the bytes freed.
    pub fn trim_memory_pool(&self) -> usize {
        self.pool.trim()
    }

    /// Whether `len` bytes at `ptr` lie in staging memory of a CPU device.
    fn staged(ptr: *const u8, len: usize) -> bool {
        CPU_STAGING.contains(ptr, len)
    }
}

impl MemoryPoolPolicy for CpuDevice {
    /// The limit of the device's memory pool ([`CpuDevice::memory_pool`]).
    fn retain_freed_memory(&self, bytes: Option<usize>) -> Result<()> {
        self.pool.set_limit(bytes.unwrap_or(DEFAULT_POOL_LIMIT));
        Ok(())
    }
}

impl CopyCounter for CpuDevice {
    fn copy_count(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }
}

impl Drop for CpuDevice {
    fn drop(&mut self) {
        if let Mode::Link(engine) = &self.mode {
            engine.shutdown();
        }
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

// SAFETY: allocations are aligned host memory of the size asked for, from the pool
// (initialized bytes, as `host_accessible` requires). Without a link model copies are
// `memcpy`s complete when the call returns, so every event and `synchronize` is complete;
// with one, copies run in call order on one engine thread, and events and `synchronize`
// wait for the engine to pass them. `host_accessible` is true only in the direct mode,
// whose copies are synchronous.
unsafe impl Device for CpuDevice {
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }
    fn device_id(&self) -> i64 {
        crate::cpu::CPU_DEVICE_ID
    }
    fn allocate(&self, len: usize) -> Result<Arc<dyn DeviceMemory>> {
        Ok(Arc::new(self.pool.allocate(len)?))
    }
    fn allocate_staging(&self, len: usize) -> Result<Box<dyn StagingMemory>> {
        Ok(Box::new(CpuStaging::from_pool(&self.staging, len)?))
    }
    unsafe fn copy_to_device(&self, src: *const u8, dst: *mut c_void, len: usize) -> Result<()> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        match &self.mode {
            Mode::Link(engine) => {
                // SAFETY: the caller keeps both ranges valid until the copy completes; a
                // copy from pageable memory is waited for here (synchronous).
                let seq = unsafe { engine.enqueue(src, dst.cast(), len, true) };
                if !Self::staged(src, len) {
                    engine.wait(seq);
                }
            }
            // SAFETY: the caller guarantees both ranges are valid; they are distinct
            // allocations (staging or user memory, and device memory).
            _ => unsafe { copy_bytes(dst.cast::<u8>(), src, len, Stores::for_bytes(len)) },
        }
        Ok(())
    }
    unsafe fn copy_to_host(&self, src: *const c_void, dst: *mut u8, len: usize) -> Result<()> {
        self.copies.fetch_add(1, Ordering::Relaxed);
        match &self.mode {
            Mode::Link(engine) => {
                // SAFETY: as in `copy_to_device`.
                let seq = unsafe { engine.enqueue(src.cast(), dst, len, true) };
                if !Self::staged(dst, len) {
                    engine.wait(seq);
                }
            }
            // SAFETY: as in `copy_to_device`.
            _ => unsafe { copy_bytes(dst, src.cast::<u8>(), len, Stores::for_bytes(len)) },
        }
        Ok(())
    }
    unsafe fn copy_on_device(&self, copies: &[DeviceCopy]) -> Result<()> {
        for c in copies {
            if c.len == 0 {
                continue;
            }
            match &self.mode {
                // SAFETY: the caller guarantees each source readable and each destination
                // writable for `len` bytes until the copies complete, and no overlap.
                Mode::Link(engine) => unsafe {
                    engine.enqueue(c.src.cast(), c.dst.cast(), c.len, false);
                },
                // SAFETY: as above; the copy completes here.
                _ => unsafe {
                    copy_bytes(
                        c.dst.cast::<u8>(),
                        c.src.cast::<u8>(),
                        c.len,
                        Stores::for_bytes(c.len),
                    )
                },
            }
        }
        Ok(())
    }
    /// A `memcpy` from another CPU device's memory (after both devices' pending copies,
    /// if they model a link); `Ok(false)` for any other device type.
    unsafe fn copy_from_peer(
        &self,
        from: &dyn Device,
        src: *const c_void,
        dst: *mut c_void,
        len: usize,
    ) -> Result<bool> {
        if from.device_type() != ArrowDeviceType::CPU {
            return Ok(false);
        }
        from.synchronize()?;
        self.synchronize()?;
        if len > 0 {
            // SAFETY: the caller guarantees `src` readable and `dst` writable for `len`
            // bytes; both devices' pending copies completed above; distinct allocations.
            unsafe {
                copy_bytes(
                    dst.cast::<u8>(),
                    src.cast::<u8>(),
                    len,
                    Stores::for_bytes(len),
                )
            };
        }
        Ok(true)
    }
    fn kernels(&self) -> Option<&dyn DeviceKernels> {
        Some(self)
    }
    fn record_event(&self) -> Result<Arc<dyn SyncEvent>> {
        Ok(match &self.mode {
            Mode::Link(engine) => Arc::new(LinkEvent::new(engine.clone())),
            _ => Arc::new(CpuEvent),
        })
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
        if let Mode::Link(engine) = &self.mode {
            engine.synchronize();
        }
        Ok(())
    }

    /// The CPU's own staging allocations (any [`CpuDevice`]'s) count as pinned, nothing
    /// else: the CPU device stands in for a GPU in tests, where ordinary (pageable)
    /// memory must go through staging as it does on CUDA.
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        Self::staged(ptr, len)
    }

    fn host_accessible(&self) -> bool {
        matches!(self.mode, Mode::Direct)
    }
}

/// The live staging allocations of every [`CpuDevice`].
static CPU_STAGING: PinnedRegistry = PinnedRegistry::new();

/// Staging memory of the [`CpuDevice`]: host memory registered as "pinned" while it
/// lives (see [`Device::is_pinned`]). A device's staging comes from a pool of its own, so
/// transfers write memory already faulted in, as CUDA's staging comes from the pinned
/// memory its context reserved.
#[derive(Debug)]
pub struct CpuStaging(PooledMemory);

impl CpuStaging {
    /// Allocates `len` zeroed bytes of its own (freed when dropped) and registers them.
    pub fn new(len: usize) -> Result<Self> {
        Self::from_pool(&Arc::new(HostPool::new(0)), len)
    }

    /// `len` bytes of `pool` (zeroed when new, else what their last user wrote), registered.
    fn from_pool(pool: &Arc<HostPool>, len: usize) -> Result<Self> {
        let memory = pool.allocate(len)?;
        CPU_STAGING.register(memory.as_ptr(), memory.len());
        Ok(Self(memory))
    }
}

impl Drop for CpuStaging {
    fn drop(&mut self) {
        CPU_STAGING.unregister(self.0.as_ptr());
    }
}

// SAFETY: the pooled block is valid for `len` initialized bytes (a pool's blocks are
// zeroed when new, else hold what their last user wrote) and owned by the value.
unsafe impl StagingMemory for CpuStaging {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above; borrowed exclusively through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), self.0.len()) }
    }
    fn as_slice(&self) -> &[u8] {
        // SAFETY: as above; the bytes are not written while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr(), self.0.len()) }
    }
}

// SAFETY: each kernel is `CpuKernels`' (which does what the trait documents), run once
// the copies enqueued before it have completed (with a link model, on the copy engine),
// so it is in order with the device's stream.
unsafe impl DeviceKernels for CpuDevice {
    unsafe fn row_sizes(
        &self,
        sizes: RowIntegers,
        validity: Validity,
        n: u64,
        out: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.row_sizes(sizes, validity, n, out) }
    }
    unsafe fn inclusive_scan_i64(&self, data: *mut c_void, n: u64) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.inclusive_scan_i64(data, n) }
    }
    unsafe fn gather_view_bytes(
        &self,
        views: *const c_void,
        validity: Validity,
        n: u64,
        buffers: *const c_void,
        offsets: *const c_void,
        out: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.gather_view_bytes(views, validity, n, buffers, offsets, out) }
    }
    unsafe fn narrow_i64_to_i32(&self, src: *const c_void, n: u64, dst: *mut c_void) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.narrow_i64_to_i32(src, n, dst) }
    }
    unsafe fn widen_decimals(
        &self,
        src: *const c_void,
        width: u64,
        n: u64,
        dst: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.widen_decimals(src, width, n, dst) }
    }
    unsafe fn fill_offsets_i32(&self, dst: *mut c_void, n: u64, step: u32) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.fill_offsets_i32(dst, n, step) }
    }
    unsafe fn compare_list_offsets(
        &self,
        offsets: RowIntegers,
        n: u64,
        expected: *const c_void,
        mismatch: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.compare_list_offsets(offsets, n, expected, mismatch) }
    }
    unsafe fn gather_list_values(
        &self,
        child: *const c_void,
        width: u64,
        child_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe {
            CpuKernels.gather_list_values(child, width, child_offset, offsets, n, new_offsets, dst)
        }
    }
    unsafe fn gather_list_bits(
        &self,
        bits: *const c_void,
        bit_offset: u64,
        offsets: RowIntegers,
        n: u64,
        new_offsets: *const c_void,
        dst: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.gather_list_bits(bits, bit_offset, offsets, n, new_offsets, dst) }
    }
    unsafe fn offsets_to_views(
        &self,
        offsets: RowIntegers,
        data: *const c_void,
        indices: *const c_void,
        n: u64,
        views: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.offsets_to_views(offsets, data, indices, n, views) }
    }
    unsafe fn count_set_bits(
        &self,
        bitmap: *const c_void,
        bit_offset: u64,
        len: u64,
        out: *mut c_void,
    ) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the caller's guarantees, passed on.
        unsafe { CpuKernels.count_set_bits(bitmap, bit_offset, len, out) }
    }
}
