//! Device, pinned host, managed and foreign (borrowed) CUDA memory.
//!
//! All four implement [`CudaMemory`] (a device-visible address range with its Arrow
//! device placement), which is what the kernels of [`crate::kernels`] take. The owning
//! ones free their memory on drop, binding the right context themselves, from any
//! thread; wrapped into an arrow-rs [`Buffer`] (`into_arrow_buffer`) they are freed when
//! the last arrow-rs reference goes, which is how the CUDA export hands buffers to the
//! C Device interface.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use arrow_buffer::alloc::Allocation;
use arrow_buffer::Buffer;
use cudarc::driver::{sys, CudaContext, CudaStream, DeviceRepr};
use devarrow_abi::ArrowDeviceType;

use crate::context::{self, ContextGuard, DropInContext};
use crate::driver;
use crate::error::{CudaError, DriverResultExt, Result};
use crate::pool;
use crate::primary_context::PrimaryContext;
use crate::stats::{self, DeviceCounters};

/// A range of memory that CUDA kernels can address, with its Arrow device placement.
pub trait CudaMemory {
    /// The device-visible address of the first byte (0 for an empty range).
    fn device_ptr(&self) -> u64;
    /// The length in bytes.
    fn len(&self) -> usize;
    /// Whether the range is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `ARROW_DEVICE_CUDA`, `ARROW_DEVICE_CUDA_HOST` or `ARROW_DEVICE_CUDA_MANAGED`.
    fn device_type(&self) -> ArrowDeviceType;
    /// The CUDA ordinal the memory belongs to.
    fn device_id(&self) -> i64;
    /// Orders `stream` after the work that makes the memory ready to use, without blocking
    /// the host: for a [`DeviceBuffer`] used on another stream than its own, the work
    /// queued on its own stream so far (its stream-ordered allocation, its writes); for a
    /// [`ForeignBuffer`] of an import, the producer's `sync_event`. Every function of this
    /// crate that takes memory and a stream calls it.
    fn order_on(&self, stream: &CudaStream) -> Result<()> {
        let _ = stream;
        Ok(())
    }
}

/// Makes `waiter` wait (on the device, not the host) for the work queued on `stream` so
/// far. A no-op when they are the same stream.
pub(crate) fn stream_waits_for(waiter: &CudaStream, stream: &CudaStream) -> Result<()> {
    if waiter.cu_stream() == stream.cu_stream() {
        return Ok(());
    }
    context::bind(stream.context())?;
    // For ordering only: timing off (NVIDIA's advice for events a stream waits on).
    let event = stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .call("cuEventRecord")?;
    // SAFETY: the event is live until the end of this function; the driver keeps what the
    // wait needs after it is destroyed (destroying a pending recorded event is allowed).
    unsafe { context::stream_wait_event(waiter, event.cu_event()) }
}

/// Memory this process owns and may write (kernels take it as an output).
pub trait CudaMemoryMut: CudaMemory {}

/// The address arrow-rs gets for an empty buffer: non-null, never dereferenced.
fn dangling() -> NonNull<u8> {
    NonNull::<u64>::dangling().cast()
}

/// Copies `bytes` bytes between any two UVA addresses (device, pinned or managed memory,
/// or pageable host memory) on `stream`.
///
/// # Safety
/// Both ranges must be valid for `bytes` bytes until the copy completes.
unsafe fn memcpy_async(dst: u64, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: the caller guarantees both ranges; with unified addressing the driver
    // infers the direction of the copy from the addresses.
    unsafe { driver::memcpy_async(dst, src, bytes, stream.cu_stream()) }
}

fn sync(stream: &CudaStream) -> Result<()> {
    context::sync_stream(stream)
}

/// Device memory (`ARROW_DEVICE_CUDA`) owned by this process.
///
/// Allocated stream-ordered (`cuMemAllocFromPoolAsync` on the given stream, from
/// devarrow's memory pool of the device, which keeps freed memory for reuse: see
/// [`crate::pool`]) when the device supports memory pools, else with `cuMemAlloc`.
/// Dropping it frees it in stream order on the allocation stream (`cuMemFreeAsync`), or
/// after synchronizing that stream (`cuMemFree`); the pool may give the memory to the
/// next stream-ordered allocation on that stream at once. Work on *other* streams that
/// uses the buffer must be ordered before the drop (e.g. by an event the allocation
/// stream waits on, or by synchronizing): the safe functions of this crate that take a
/// buffer and another stream return only once that stream's work is done, so only work
/// enqueued through raw addresses (`device_ptr`, the `unsafe` kernel launches, cudarc
/// views) needs it. Addresses are at least 256-byte aligned.
///
/// # Example
///
/// ```
/// use devarrow_cuda::{memory_stats, CudaDevice, CudaError, CudaMemory, DeviceBuffer};
///
/// # fn main() -> devarrow_cuda::Result<()> {
/// let device = match CudaDevice::open(0) {
///     Ok(device) => device,
///     Err(e @ (CudaError::NoDriver | CudaError::NoDevice)) => {
/// #       assert!(std::env::var("DEVARROW_REQUIRE_GPU").as_deref() != Ok("1"), "{e}");
///         println!("no GPU here: {e}");
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// let stream = device.stream();
/// let before = memory_stats(0).live_buffers;
///
/// let mut buffer = DeviceBuffer::from_host(stream, &[1u32, 2, 3, 4])?;
/// assert_eq!(buffer.len(), 16);
/// buffer.copy_from_host(stream, &[9u32])?; // overwrites the first value
/// let mut back = [0u32; 4];
/// buffer.copy_to_host(stream, &mut back)?;
/// assert_eq!(back, [9, 2, 3, 4]);
/// assert_eq!(memory_stats(0).live_buffers, before + 1);
///
/// drop(buffer); // freed in order on its stream, back to devarrow's pool
/// assert_eq!(memory_stats(0).live_buffers, before);
/// # Ok(())
/// # }
/// ```
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream: DropInContext<Arc<CudaStream>>,
    stream_ordered: bool,
    /// devarrow's accounting of the buffer's device ([`crate::memory_stats`]).
    counters: Arc<DeviceCounters>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device", &self.stream.context().ordinal())
            .field("stream_ordered", &self.stream_ordered)
            .finish()
    }
}

impl DeviceBuffer {
    /// Allocates `len` uninitialized bytes on the device of `stream`, ordered on
    /// `stream`. Out of memory is [`CudaError::OutOfMemory`]; the per-thread default
    /// stream is refused ([`CudaError::InvalidArgument`]): the buffer is freed on its
    /// stream by whichever thread drops it. Counted in [`crate::memory_stats`] until
    /// dropped.
    pub fn alloc(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        context::check_keepable(stream, "DeviceBuffer::alloc")?;
        let ctx = stream.context();
        context::bind(ctx)?;
        let stream_ordered = ctx.has_async_alloc();
        let counters = stats::counters(ctx.ordinal());
        let ptr = if len == 0 {
            0
        } else if stream_ordered {
            let pool = pool::pool_of(ctx)?;
            // The pool keeps freed memory for reuse: when the device's free memory is
            // short of `len`, it first gives back what it holds unused. (Trying first and
            // trimming on out-of-memory would make a driver call fail in normal
            // operation, which compute-sanitizer reports in every user's run.) Asking
            // the driver for its free memory is a round trip (slower still in a
            // sandbox), so it is asked only when trimming could matter: the pool may
            // hold idle memory and `len` is large against the free memory devarrow's
            // own accounting estimates (`DeviceCounters::needs_free_memory`).
            let mut trimmed = false;
            if counters.needs_free_memory(len) {
                let free = driver::mem_get_info()?.0;
                counters.observed_free(free);
                if free < len {
                    pool::trim(ctx, 0)?;
                    counters.trimmed();
                    trimmed = true;
                }
            }
            // SAFETY: the pool is one of this device's, the stream belongs to the current
            // context (both live); the memory is only handed out as an address.
            match unsafe { driver::mem_alloc_from_pool_async(pool, len, stream.cu_stream()) } {
                // The estimate was too hopeful (others allocated since the driver was
                // last asked) and the pool holds idle memory: give it back, try once
                // more. Rare, and only then does a driver call fail before succeeding.
                Err(e) if e.is_out_of_memory() && !trimmed && counters.pool_idle_bound() > 0 => {
                    pool::trim(ctx, 0)?;
                    counters.trimmed();
                    // SAFETY: as above.
                    unsafe { driver::mem_alloc_from_pool_async(pool, len, stream.cu_stream()) }?
                }
                allocated => allocated?,
            }
        } else {
            driver::mem_alloc(len)?
        };
        if len > 0 {
            counters.allocated(len, stream_ordered);
        }
        Ok(Self {
            ptr,
            len,
            stream: DropInContext::new(stream.clone()),
            stream_ordered,
            counters,
        })
    }

    /// Allocates `len` bytes set to zero (`cuMemsetD8Async` on `stream`).
    pub fn zeroed(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let mut buf = Self::alloc(stream, len)?;
        buf.memset(stream, 0)?;
        Ok(buf)
    }

    /// Allocates a buffer holding a copy of `data`; returns once the copy is complete.
    pub fn from_host<T: DeviceRepr>(stream: &Arc<CudaStream>, data: &[T]) -> Result<Self> {
        let bytes = std::mem::size_of_val(data);
        let mut buf = Self::alloc(stream, bytes)?;
        buf.copy_from_host(stream, data)?;
        Ok(buf)
    }

    /// Overwrites the start of the buffer with `data`; returns once the copy is complete.
    pub fn copy_from_host<T: DeviceRepr>(&mut self, stream: &CudaStream, data: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        if bytes > self.len {
            return Err(CudaError::InvalidArgument(format!(
                "copying {bytes} bytes into a device buffer of {} bytes",
                self.len
            )));
        }
        self.order_on(stream)?;
        context::bind(stream.context())?;
        // SAFETY: the destination holds at least `bytes` bytes (checked above) and the
        // source slice outlives the copy, which completes before we return.
        unsafe { memcpy_async(self.ptr, data.as_ptr() as u64, bytes, stream)? };
        sync(stream)
    }

    /// Copies the whole buffer to a new `Vec<u8>` on `stream` (blocking).
    pub fn to_host(&self, stream: &CudaStream) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        self.copy_to_host(stream, &mut out)?;
        Ok(out)
    }

    /// Copies the first `dst.len()` bytes of the buffer into `dst` on `stream`
    /// (blocking).
    pub fn copy_to_host<T: DeviceRepr>(&self, stream: &CudaStream, dst: &mut [T]) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        if bytes > self.len {
            return Err(CudaError::InvalidArgument(format!(
                "copying {bytes} bytes out of a device buffer of {} bytes",
                self.len
            )));
        }
        self.order_on(stream)?;
        context::bind(stream.context())?;
        // SAFETY: `dst` is valid for `bytes` bytes and outlives the copy (we synchronize
        // before returning); the source holds at least `bytes` bytes.
        unsafe { memcpy_async(dst.as_mut_ptr() as u64, self.ptr, bytes, stream)? };
        sync(stream)
    }

    /// Sets every byte to `value` on `stream` (asynchronous; device memory is never
    /// read by the host, so no host-visible race is possible).
    pub fn memset(&mut self, stream: &CudaStream, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.order_on(stream)?;
        context::bind(stream.context())?;
        // SAFETY: the range is our live allocation; the stream belongs to the bound
        // context.
        unsafe { driver::memset_d8_async(self.ptr, value, self.len, stream.cu_stream()) }?;
        // The buffer is freed in order on its own stream: order that after the memset.
        stream_waits_for(&self.stream, stream)
    }

    /// The stream the buffer was allocated on (and will be freed on).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Whether it came from the stream-ordered allocator.
    pub fn is_stream_ordered(&self) -> bool {
        self.stream_ordered
    }

    /// Turns the buffer into an arrow-rs [`Buffer`] that owns it: the device memory is
    /// freed when the last clone of the `Buffer` (or of an `ArrayData` holding it) is
    /// dropped.
    ///
    /// # Safety
    /// The returned `Buffer` points to **device** memory: it must never be read on the
    /// host (no `as_slice`, no arrow-rs kernel, no `ArrayData::validate`, no arrow-rs
    /// `from_ffi`, no slicing of a `NullBuffer` over it). Only its address and length may
    /// be used, as the CUDA export does.
    pub unsafe fn into_arrow_buffer(self) -> Buffer {
        let len = self.len;
        let ptr = NonNull::new(self.ptr as *mut u8).unwrap_or_else(dangling);
        // SAFETY: `ptr..ptr+len` stays allocated as long as the owner (`self`, moved into
        // the Arc) lives; the caller promises never to dereference it on the host.
        unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(self)) }
    }
}

impl CudaMemory for DeviceBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CUDA
    }
    fn device_id(&self) -> i64 {
        self.stream.context().ordinal() as i64
    }
    fn order_on(&self, stream: &CudaStream) -> Result<()> {
        stream_waits_for(stream, &self.stream)
    }
}

impl CudaMemoryMut for DeviceBuffer {}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // Not live any more, whether freed below or gone with its context already.
        self.counters.freed(self.len, self.stream_ordered);
        // Errors cannot be reported from drop, and are not recorded on the shared context
        // (see `crate::context`); without the context bound the memory leaks rather than
        // being freed in the wrong context.
        let Ok(_bound) = ContextGuard::enter(self.stream.context()) else {
            return;
        };
        if self.stream_ordered {
            // SAFETY: allocated by cuMemAllocAsync on this stream and freed exactly once,
            // in stream order after the work queued on it.
            let _ = unsafe { driver::mem_free_async(self.ptr, self.stream.cu_stream()) };
        } else if context::sync_stream(&self.stream).is_ok() {
            // SAFETY: allocated by cuMemAlloc, freed exactly once, after its stream's
            // work completed.
            let _ = unsafe { driver::mem_free(self.ptr) };
        }
    }
}

/// Pinned (page-locked) host memory, `ARROW_DEVICE_CUDA_HOST` (`cuMemHostAlloc` with
/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP`; deliberately **not**
/// write-combined, so host reads stay fast). Readable and writable from the host and,
/// through its device address, from kernels.
///
/// # Example
///
/// Written on the host, copied to the device (a DMA, with no staging copy), read back
/// into it, and handed to arrow-rs as a host-readable [`Buffer`].
///
/// ```
/// use devarrow_abi::ArrowDeviceType;
/// use devarrow_cuda::{CudaDevice, CudaError, CudaMemory, DeviceBuffer, PinnedHostBuffer};
///
/// # fn main() -> devarrow_cuda::Result<()> {
/// let device = match CudaDevice::open(0) {
///     Ok(device) => device,
///     Err(e @ (CudaError::NoDriver | CudaError::NoDevice)) => {
/// #       assert!(std::env::var("DEVARROW_REQUIRE_GPU").as_deref() != Ok("1"), "{e}");
///         println!("no GPU here: {e}");
///         return Ok(());
///     }
///     Err(e) => return Err(e),
/// };
/// let stream = device.stream();
///
/// let mut pinned = PinnedHostBuffer::alloc(device.primary_context(), 8)?; // zeroed
/// pinned.as_mut_slice().copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
/// assert_eq!(pinned.device_type(), ArrowDeviceType::CUDA_HOST);
/// assert_ne!(pinned.device_ptr(), 0); // mapped: kernels can read it at this address
///
/// let mut on_device = DeviceBuffer::from_host(stream, pinned.as_slice())?;
/// on_device.copy_from_host(stream, &[9u8])?;
/// on_device.copy_to_host(stream, pinned.as_mut_slice())?; // returns once copied
/// assert_eq!(pinned.as_slice(), [9, 2, 3, 4, 5, 6, 7, 8]);
///
/// let buffer = pinned.into_arrow_buffer(); // owns the pinned memory from now on
/// assert_eq!(buffer.as_slice()[0], 9);
/// # Ok(())
/// # }
/// ```
pub struct PinnedHostBuffer {
    ptr: *mut u8,
    device_ptr: u64,
    len: usize,
    ctx: DropInContext<Arc<CudaContext>>,
}

// SAFETY: the allocation is plain host memory owned by this value; freeing it binds the
// context, and CUDA allows that from any thread.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: shared references only read (`as_slice`); writes need `&mut`.
unsafe impl Sync for PinnedHostBuffer {}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedHostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedHostBuffer {
    /// Allocates `len` zeroed bytes of pinned host memory, mapped for `device`.
    pub fn alloc(device: &PrimaryContext, len: usize) -> Result<Self> {
        device.bind_to_thread()?;
        if len == 0 {
            return Ok(Self {
                ptr: dangling().as_ptr(),
                device_ptr: 0,
                len: 0,
                ctx: DropInContext::new(device.context().clone()),
            });
        }
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // The context is bound; the memory is zeroed below before any read.
        let ptr = driver::mem_host_alloc(len, flags)?;
        let mut this = Self {
            ptr: ptr.cast(),
            device_ptr: 0,
            len,
            ctx: DropInContext::new(device.context().clone()),
        };
        // Mapped with DEVICEMAP; on failure, dropping `this` frees the allocation.
        this.device_ptr = driver::mem_host_get_device_pointer(ptr)?;
        // SAFETY: `ptr` is valid for `len` writable bytes, owned by `this` and not yet
        // shared with anything.
        unsafe { zero_in_parallel(this.ptr, len) };
        Ok(this)
    }

    /// Allocates pinned memory holding a copy of `data`.
    pub fn from_slice(device: &PrimaryContext, data: &[u8]) -> Result<Self> {
        let mut buf = Self::alloc(device, data.len())?;
        buf.as_mut_slice().copy_from_slice(data);
        Ok(buf)
    }

    /// The bytes, from the host.
    ///
    /// Device work writing the buffer must have completed (this crate's safe kernel
    /// wrappers return only after their work is done).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes (or dangling with len 0) for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably, from the host.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Turns the buffer into an arrow-rs [`Buffer`] that owns it (host-readable).
    pub fn into_arrow_buffer(self) -> Buffer {
        let len = self.len;
        let ptr = NonNull::new(self.ptr).unwrap_or_else(dangling);
        // SAFETY: `ptr..ptr+len` is host memory owned by `self`, which the Arc keeps
        // alive as long as the Buffer; it is readable from the host.
        unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(self)) }
    }
}

impl CudaMemory for PinnedHostBuffer {
    fn device_ptr(&self) -> u64 {
        self.device_ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CUDA_HOST
    }
    fn device_id(&self) -> i64 {
        self.ctx.ordinal() as i64
    }
}

impl CudaMemoryMut for PinnedHostBuffer {}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        let Ok(_bound) = ContextGuard::enter(&self.ctx) else {
            return;
        };
        // SAFETY: allocated by cuMemHostAlloc and freed exactly once.
        let _ = unsafe { driver::mem_free_host(self.ptr.cast::<c_void>()) };
    }
}

/// Below this many bytes, [`zero_in_parallel`] zeroes on the calling thread alone.
const PARALLEL_ZERO_MIN_BYTES: usize = 16 << 20;

/// Writes zeros over `len` bytes from `ptr`: on the calling thread for small ranges, else
/// cut into runs of at least 8 MiB on up to 8 scoped threads (pinned memory of a slab is
/// written once, when it is allocated; one thread writes about 10 GB/s, so a 128 MiB
/// slab would cost some 13 ms on one).
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes, and nothing else may access them until
/// this returns.
pub(crate) unsafe fn zero_in_parallel(ptr: *mut u8, len: usize) {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8)
        .min(len / (8 << 20))
        .max(1);
    if len < PARALLEL_ZERO_MIN_BYTES || threads == 1 {
        // SAFETY: the caller's guarantee.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        return;
    }
    // The threads below (all joined before the scope ends) write disjoint runs;
    // `MaybeUninit`: the bytes are not initialized yet.
    // SAFETY: the caller's guarantee: `len` writable bytes, accessed by nothing else.
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(ptr.cast::<std::mem::MaybeUninit<u8>>(), len) };
    let run = len.div_ceil(threads);
    std::thread::scope(|scope| {
        for part in bytes.chunks_mut(run) {
            scope.spawn(move || {
                // SAFETY: `part` is this thread's own run of the range (see above),
                // writable for its length (`write_bytes` is one `memset`, even in an
                // unoptimized build, where a `fill` loop is not).
                unsafe { std::ptr::write_bytes(part.as_mut_ptr(), 0, part.len()) }
            });
        }
    });
}

/// Managed (unified) memory, `ARROW_DEVICE_CUDA_MANAGED` (`cuMemAllocManaged`,
/// `CU_MEM_ATTACH_GLOBAL`). Addressable from the host and every device.
pub struct ManagedBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: DropInContext<Arc<CudaContext>>,
}

impl std::fmt::Debug for ManagedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManagedBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl ManagedBuffer {
    /// Allocates `len` bytes of managed memory, zeroed by the device.
    ///
    /// [`CudaError::Unsupported`] on devices without managed memory;
    /// [`CudaError::Refused`] where the device has it but the driver refuses the
    /// allocation with an error that leaves the context usable (restricted runtimes such
    /// as gVisor's nvproxy answer `CUDA_ERROR_OPERATING_SYSTEM`); out of memory is
    /// [`CudaError::OutOfMemory`].
    pub fn alloc(device: &PrimaryContext, len: usize) -> Result<Self> {
        if !device.supports_managed_memory() {
            return Err(CudaError::Unsupported("managed memory"));
        }
        device.bind_to_thread()?;
        let ptr = if len == 0 {
            0
        } else {
            // The context is bound; the memory is zeroed before any read.
            driver::mem_alloc_managed(len, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL).map_err(
                |e| match e {
                    // The device claims managed memory, the driver refuses it: a
                    // restricted runtime (gVisor's nvproxy answers OPERATING_SYSTEM).
                    CudaError::Driver { call, source } if e.allows_fallback() => {
                        CudaError::Refused {
                            feature: "managed memory",
                            call,
                            source,
                        }
                    }
                    e => e,
                },
            )?
        };
        let this = Self {
            ptr,
            len,
            ctx: DropInContext::new(device.context().clone()),
        };
        // Zeroed by the device (`cuMemsetD8`), not the host: on devices without
        // concurrent managed access a host write while any kernel of the context runs
        // would fault. `cuMemsetD8` may return before the memset completes (the API's
        // synchronization rules promise otherwise only for pinned host memory), so the
        // legacy stream it ran on is synchronized: a host write or a kernel on another
        // stream right after `alloc` must not be overwritten by the zeroing.
        if len > 0 {
            // SAFETY: `ptr` is our live allocation of `len` bytes; the context is bound.
            unsafe { driver::memset_d8(ptr, 0, len) }?;
            // SAFETY: the NULL handle is the context's legacy default stream.
            unsafe { driver::stream_synchronize(std::ptr::null_mut()) }?;
        }
        Ok(this)
    }

    /// The bytes, from the host.
    ///
    /// # Safety
    /// No device work may be accessing the buffer (synchronize the streams that used it
    /// first): on devices without concurrent managed access a host access while any
    /// kernel runs faults, and on others it races.
    pub unsafe fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: valid for `len` bytes; the caller guarantees no concurrent device access.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }

    /// The bytes, mutably, from the host.
    ///
    /// # Safety
    /// As for [`ManagedBuffer::as_slice`].
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: valid for `len` bytes, exclusive through `&mut self`; the caller
        // guarantees no concurrent device access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u8, self.len) }
    }

    /// Turns the buffer into an arrow-rs [`Buffer`] that owns it.
    ///
    /// # Safety
    /// The host may read the `Buffer` only while no device work accesses the memory.
    pub unsafe fn into_arrow_buffer(self) -> Buffer {
        let len = self.len;
        let ptr = NonNull::new(self.ptr as *mut u8).unwrap_or_else(dangling);
        // SAFETY: the range stays allocated as long as the Arc'd owner; host access rules
        // are the caller's.
        unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(self)) }
    }
}

impl CudaMemory for ManagedBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CUDA_MANAGED
    }
    fn device_id(&self) -> i64 {
        self.ctx.ordinal() as i64
    }
}

impl CudaMemoryMut for ManagedBuffer {}

impl Drop for ManagedBuffer {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        let Ok(_bound) = ContextGuard::enter(&self.ctx) else {
            return;
        };
        // SAFETY: allocated by cuMemAllocManaged, freed exactly once.
        let _ = unsafe { driver::mem_free(self.ptr) };
    }
}

/// A non-owning view of memory someone else allocated (a foreign producer's buffer, a
/// pointer from another library), kept valid by an `owner` it holds: the memory lives
/// at least as long as any clone of the view.
///
/// Views of an imported array ([`crate::ImportedArray::buffer`]) hold the import, so the
/// producer's `release` runs only after the last view is dropped.
#[derive(Clone)]
pub struct ForeignBuffer {
    ptr: u64,
    len: usize,
    device_type: ArrowDeviceType,
    device_id: i64,
    host_readable: bool,
    /// The `CUevent` the memory is ready after (the producer's `sync_event` of an import;
    /// 0 for none), kept alive by `owner`. A plain handle value, so the view stays `Send`
    /// and `Sync` (CUDA event handles may be used from any thread).
    ready_event: u64,
    owner: Arc<dyn Allocation>,
}

impl std::fmt::Debug for ForeignBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("device_type", &self.device_type)
            .field("device_id", &self.device_id)
            .field("host_readable", &self.host_readable)
            .finish()
    }
}

impl ForeignBuffer {
    /// Wraps `len` bytes at `ptr`, kept alive by `owner`.
    ///
    /// `host_readable` says the bytes may be read from the host right now (pinned or
    /// managed memory whose producer event has been synchronized).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be memory of `device_type` on `device_id` that stays valid
    /// and unmodified as long as `owner` is alive; when `host_readable`, it must be
    /// host-readable for that long.
    pub unsafe fn new(
        ptr: u64,
        len: usize,
        device_type: ArrowDeviceType,
        device_id: i64,
        host_readable: bool,
        owner: Arc<dyn Allocation>,
    ) -> Self {
        Self {
            ptr,
            len,
            device_type,
            device_id,
            host_readable: host_readable && device_type.is_host_accessible(),
            ready_event: 0,
            owner,
        }
    }

    /// Sets the event the memory is ready after: [`CudaMemory::order_on`] (and so every
    /// use of the view on a stream) makes the stream wait on it (`cuStreamWaitEvent`).
    ///
    /// # Safety
    /// `event` must be NULL or a `CUevent` that stays valid as long as the view's owner is
    /// alive.
    pub unsafe fn with_ready_event(mut self, event: sys::CUevent) -> Self {
        self.ready_event = event as u64;
        self
    }

    /// What keeps the memory alive.
    pub fn owner(&self) -> &Arc<dyn Allocation> {
        &self.owner
    }

    /// The bytes, when they may be read from the host (pinned or managed memory after
    /// its sync event completed); `None` otherwise.
    pub fn host_slice(&self) -> Option<&[u8]> {
        if !self.host_readable {
            return None;
        }
        if self.len == 0 {
            return Some(&[]);
        }
        // SAFETY: `new`'s contract: host-readable and valid while `owner` (held by self)
        // lives.
        Some(unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) })
    }

    /// Copies the bytes to the host on `stream` (blocking), whatever the memory type.
    pub fn to_host(&self, stream: &CudaStream) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        self.order_on(stream)?;
        context::bind(stream.context())?;
        // SAFETY: the source is valid for `len` bytes while we hold the owner; `out` is
        // ours and outlives the copy (we synchronize before returning).
        unsafe { memcpy_async(out.as_mut_ptr() as u64, self.ptr, self.len, stream)? };
        sync(stream)?;
        Ok(out)
    }

    /// A view of `len` bytes starting `offset` bytes in, sharing the owner.
    pub fn slice(&self, offset: usize, len: usize) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(CudaError::InvalidArgument(format!(
                "slice {offset}+{len} of a {}-byte buffer",
                self.len
            )));
        }
        let mut out = self.clone();
        out.ptr = if len == 0 {
            self.ptr
        } else {
            self.ptr + offset as u64
        };
        out.len = len;
        Ok(out)
    }

    /// Turns the view into an arrow-rs [`Buffer`] that holds the owner.
    ///
    /// # Safety
    /// Unless [`ForeignBuffer::host_slice`] is `Some`, the `Buffer` points to memory the
    /// host must not read; see [`DeviceBuffer::into_arrow_buffer`].
    pub unsafe fn into_arrow_buffer(self) -> Buffer {
        let len = self.len;
        let ptr = NonNull::new(self.ptr as *mut u8).unwrap_or_else(dangling);
        let owner: Arc<ForeignBuffer> = Arc::new(self);
        // SAFETY: the memory stays valid while the view (and so its owner) lives, which
        // the Arc ties to the Buffer; host access is the caller's responsibility.
        unsafe { Buffer::from_custom_allocation(ptr, len, owner) }
    }
}

impl CudaMemory for ForeignBuffer {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device_type(&self) -> ArrowDeviceType {
        self.device_type
    }
    fn device_id(&self) -> i64 {
        self.device_id
    }
    fn order_on(&self, stream: &CudaStream) -> Result<()> {
        if self.ready_event == 0 {
            return Ok(());
        }
        // SAFETY: the event stays valid while the owner lives (`with_ready_event`'s
        // contract), and we hold the owner.
        unsafe { context::stream_wait_event(stream, self.ready_event as sys::CUevent) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_buffer_holds_its_owner() {
        let data = vec![1u8, 2, 3, 4];
        let ptr = data.as_ptr() as u64;
        let owner: Arc<dyn Allocation> = Arc::new(data);
        // SAFETY: the Vec (host memory) lives as long as `owner`, and is never modified.
        let view = unsafe {
            ForeignBuffer::new(ptr, 4, ArrowDeviceType::CUDA_HOST, 0, true, owner.clone())
        };
        assert_eq!(Arc::strong_count(&owner), 2);
        assert_eq!(view.host_slice(), Some(&[1u8, 2, 3, 4][..]));
        let tail = view.slice(1, 3).unwrap();
        assert_eq!(tail.host_slice(), Some(&[2u8, 3, 4][..]));
        assert!(view.slice(2, 3).is_err());
        drop(view);
        // SAFETY: as above; CUDA device memory is never host-readable.
        let dev =
            unsafe { ForeignBuffer::new(ptr, 4, ArrowDeviceType::CUDA, 0, true, owner.clone()) };
        assert_eq!(dev.host_slice(), None);
        // SAFETY: the Buffer is only inspected for its address and length.
        let arrow = unsafe { tail.into_arrow_buffer() };
        assert_eq!(arrow.len(), 3);
        assert_eq!(arrow.as_ptr() as u64, ptr + 1);
        drop(dev);
        assert_eq!(Arc::strong_count(&owner), 2);
        drop(arrow);
        assert_eq!(Arc::strong_count(&owner), 1);
    }
}
