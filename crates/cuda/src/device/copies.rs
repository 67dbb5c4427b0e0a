//! `impl Device for CudaDevice`: allocations, staging memory and the copies each way (one
//! by one, in one `cuMemcpyBatchAsync` (`batch.rs`), on the device (`on_device.rs`), from
//! a peer device (`peer.rs`), from registered pageable memory), the events, and the
//! memory types they hand out ([`TransferMemory`], [`PinnedStaging`]).

use std::any::Any;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::sys;
use devarrow_abi::device::{
    Device, DeviceKernels, DeviceMemory, DeviceToHost, HostRegistration, HostToDevice,
    StagingMemory, SyncEvent,
};
use devarrow_abi::pinned_registry::PinnedRegistry;
use devarrow_abi::ArrowDeviceType;

use crate::context;
use crate::driver;
use crate::error::CudaError;
use crate::event::Event;
use crate::host_register::{self, Registered};
use crate::memory::{CudaMemory as _, DeviceBuffer};

use super::arena::ArenaBlock;

use super::event::CudaSyncEvent;
use super::{CudaDevice, Direction};

/// Device memory of a [`CudaDevice`]: a [`DeviceBuffer`] seen through
/// [`devarrow_abi::device::DeviceMemory`] (the address is the `CUdeviceptr`).
#[derive(Debug)]
pub struct TransferMemory {
    buffer: DeviceBuffer,
    len: usize,
}

impl TransferMemory {
    /// The underlying device buffer.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }
}

// SAFETY: the address is the device allocation the value owns (freed in stream order
// on drop), fixed at allocation.
unsafe impl DeviceMemory for TransferMemory {
    fn address(&self) -> *mut c_void {
        self.buffer.device_ptr() as *mut c_void
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Host staging memory of a [`CudaDevice`]: a block of the pinned memory its context
/// reserved ([`CudaDevice::reserve_pinned`]), registered (while it lives) in the
/// process-wide registry [`CudaDevice::is_pinned`] answers from; or, where the reserved
/// memory has no room for it, pageable memory ([`PinnedStaging::is_pinned`] says which).
///
/// Neither allocating nor dropping it makes a driver call: `cuMemHostAlloc` is an
/// implicit synchronization (NVIDIA's programming guide: it orders every stream of the
/// device after the work enqueued before it, other libraries' work included), and
/// `cuMemFreeHost` may block the host until the whole device is idle (AMD documents that
/// for `hipHostFree`; the emulated driver does it), so neither may run in a pipeline,
/// nor when a user drops a batch downloaded into such memory. A dropped block's range
/// goes back to the context's pinned memory for the next. Pageable staging is correct
/// but slower: copies from it are staged by the driver, copies into it return only once
/// they have run. The memory must be unused by pending copies when the value drops, as
/// for any staging memory.
#[derive(Debug)]
pub struct PinnedStaging {
    memory: StagingBacking,
}

#[derive(Debug)]
enum StagingBacking {
    Pinned(ArenaBlock),
    Pageable(Box<[u8]>),
}

impl PinnedStaging {
    fn pinned(block: ArenaBlock) -> Self {
        CUDA_PINNED.register(block.as_slice().as_ptr(), block.as_slice().len());
        Self {
            memory: StagingBacking::Pinned(block),
        }
    }

    /// Whether the memory is pinned (a block of the reserved pinned memory), not the
    /// pageable memory handed out beyond it.
    pub fn is_pinned(&self) -> bool {
        matches!(self.memory, StagingBacking::Pinned(_))
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        if let StagingBacking::Pinned(block) = &self.memory {
            CUDA_PINNED.unregister(block.as_slice().as_ptr());
        }
    }
}

impl CudaDevice {
    /// Staging of `len` bytes: a block of the context's reserved pinned memory, else
    /// pageable memory (zeroed), counted ([`CudaDevice::pageable_staging`]).
    fn staging_of(&self, len: usize) -> PinnedStaging {
        match self.pinned.allocate(len) {
            Some(block) => PinnedStaging::pinned(block),
            None => {
                self.pageable_staging.fetch_add(1, Ordering::Relaxed);
                PinnedStaging {
                    memory: StagingBacking::Pageable(vec![0; len].into_boxed_slice()),
                }
            }
        }
    }
}

/// Every live [`PinnedStaging`] of the process. Pinned memory is allocated
/// `CU_MEMHOSTALLOC_PORTABLE`, so any context (any [`CudaDevice`]) can DMA it.
static CUDA_PINNED: PinnedRegistry = PinnedRegistry::new();

/// The memory type (`CU_MEMORYTYPE_*`, 0 when the driver does not know the address)
/// and the buffer id (0 when unknown) of `addr`, in one `cuPointerGetAttributes` call.
/// Unlike `cuPointerGetAttribute`, it answers pageable memory with zeros and
/// `CUDA_SUCCESS`, so asking about ordinary memory raises no driver error (which
/// `compute-sanitizer` would report in every user's run).
fn pointer_type_and_buffer(addr: usize) -> (u32, u64) {
    driver::pointer_memory_type_and_buffer_id(addr).unwrap_or((0, 0))
}

/// Whether the driver reports `first..=last` as inside one page-locked host allocation
/// (`cuMemHostAlloc` or `cuMemHostRegister`, of any library): both ends are
/// `CU_MEMORYTYPE_HOST` with the same nonzero buffer id (one allocation). Pageable memory
/// is not: the driver reports it as unregistered (type 0), HMM systems included. One
/// `cuPointerGetAttributes` per end, which never fails for an address it does not know
/// (`cuMemHostGetFlags`, used before, fails on registered memory: a driver error in
/// normal operation, which compute-sanitizer reports).
fn driver_reports_pinned(first: usize, last: usize) -> bool {
    let host = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
    let (first_type, first_buffer) = pointer_type_and_buffer(first);
    if first_type != host || first_buffer == 0 {
        return false;
    }
    pointer_type_and_buffer(last) == (first_type, first_buffer)
}

// SAFETY: both slices cover the one allocation the value owns (a block of a slab, or a
// boxed slice), never reallocated nor moved while the value lives.
unsafe impl StagingMemory for PinnedStaging {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.memory {
            StagingBacking::Pinned(block) => block.as_mut_slice(),
            StagingBacking::Pageable(bytes) => bytes,
        }
    }
    fn as_slice(&self) -> &[u8] {
        match &self.memory {
            StagingBacking::Pinned(block) => block.as_slice(),
            StagingBacking::Pageable(bytes) => bytes,
        }
    }
}

// SAFETY: allocations are `cuMemAlloc(Async)` of the size asked for (256-byte aligned),
// staging is pinned memory of at least that size, and every copy and event is enqueued
// on the device's one stream in call order; `is_pinned` asks the driver.
unsafe impl Device for CudaDevice {
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CUDA
    }

    fn device_id(&self) -> i64 {
        self.device.id() as i64
    }

    /// Allocates `len` bytes of device memory, stream-ordered on the device's stream (at
    /// least one byte is allocated, so even an empty allocation has a real device
    /// address; `len()` reports `len`). CUDA allocations are 256-byte aligned.
    fn allocate(&self, len: usize) -> devarrow_abi::Result<Arc<dyn DeviceMemory>> {
        let buffer = DeviceBuffer::alloc(&self.stream, len.max(1))?;
        Ok(Arc::new(TransferMemory { buffer, len }))
    }

    /// The PTX kernels of `kernels/convert.ptx` on the device's stream (see
    /// [`DeviceKernels for CudaDevice`](#impl-DeviceKernels-for-CudaDevice)).
    fn kernels(&self) -> Option<&dyn DeviceKernels> {
        Some(self)
    }

    /// A block of the context's reserved pinned memory ([`PinnedStaging`]), or pageable
    /// memory (zeroed) where the reserve has no room for `len` bytes: never a driver call.
    fn allocate_staging(&self, len: usize) -> devarrow_abi::Result<Box<dyn StagingMemory>> {
        Ok(Box::new(self.staging_of(len)))
    }

    /// A block of the context's reserved pinned memory, or `None` where it has no room
    /// for `len` bytes: never a driver call.
    fn try_allocate_staging(
        &self,
        len: usize,
    ) -> devarrow_abi::Result<Option<Box<dyn StagingMemory>>> {
        Ok(self
            .pinned
            .allocate(len)
            .map(|block| Box::new(PinnedStaging::pinned(block)) as Box<dyn StagingMemory>))
    }

    /// [`CudaDevice::reserve_pinned`]: an explicit warm-up.
    fn reserve_staging(&self, bytes: usize) -> devarrow_abi::Result<()> {
        self.reserve_pinned(bytes)?;
        Ok(())
    }

    unsafe fn copy_to_device(
        &self,
        src: *const u8,
        dst: *mut c_void,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        if !self.begin_copy(src.is_null() || dst.is_null(), len, "device")? {
            return Ok(());
        }
        // SAFETY: the caller guarantees `src` is readable for `len` bytes until the copy
        // completes and `dst` is device memory of `len` bytes; the stream belongs to the
        // context bound above.
        unsafe {
            driver::memcpy_htod_async(
                dst as sys::CUdeviceptr,
                src.cast(),
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    unsafe fn copy_to_host(
        &self,
        src: *const c_void,
        dst: *mut u8,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        if !self.begin_copy(src.is_null() || dst.is_null(), len, "host")? {
            return Ok(());
        }
        // SAFETY: the caller guarantees `dst` is writable for `len` bytes (and not read)
        // until the copy completes and `src` is device memory of `len` bytes; the stream
        // belongs to the context bound above.
        unsafe {
            driver::memcpy_dtoh_async(
                dst.cast(),
                src as sys::CUdeviceptr,
                len,
                self.stream.cu_stream(),
            )
        }?;
        Ok(())
    }

    /// One `cuMemcpyBatchAsync` where [`CudaDeviceOptions::batch_copies`] asks for it
    /// and the driver has it (see there), else one `cuMemcpyHtoDAsync` per copy.
    ///
    /// [`CudaDeviceOptions::batch_copies`]: super::CudaDeviceOptions::batch_copies
    unsafe fn copy_batch_to_device(&self, copies: &[HostToDevice]) -> devarrow_abi::Result<()> {
        let copies = self.begin_batch(
            copies
                .iter()
                .map(|c| (c.dst as sys::CUdeviceptr, c.src as sys::CUdeviceptr, c.len)),
            "device",
        )?;
        // SAFETY: the caller guarantees every source readable until the copies complete,
        // every destination device memory of its length, none overlapping another; the
        // context is bound (`begin_batch`).
        if unsafe { self.try_batch(&copies, Direction::ToDevice) }? {
            return Ok(());
        }
        for &(dst, src, len) in &copies {
            // SAFETY: as above, copy by copy, on the device's stream.
            unsafe {
                driver::memcpy_htod_async(dst, src as *const c_void, len, self.stream.cu_stream())
            }?;
        }
        Ok(())
    }

    /// As [`CudaDevice::copy_batch_to_device`], the other way (`cuMemcpyDtoHAsync` per
    /// copy where not batched).
    unsafe fn copy_batch_to_host(&self, copies: &[DeviceToHost]) -> devarrow_abi::Result<()> {
        let copies = self.begin_batch(
            copies
                .iter()
                .map(|c| (c.dst as sys::CUdeviceptr, c.src as sys::CUdeviceptr, c.len)),
            "host",
        )?;
        // SAFETY: the caller guarantees every destination writable (and not read) until
        // the copies complete, every source device memory of its length, no destination
        // overlapping another; the context is bound (`begin_batch`).
        if unsafe { self.try_batch(&copies, Direction::ToHost) }? {
            return Ok(());
        }
        for &(dst, src, len) in &copies {
            // SAFETY: as above, copy by copy, on the device's stream.
            unsafe {
                driver::memcpy_dtoh_async(dst as *mut c_void, src, len, self.stream.cu_stream())
            }?;
        }
        Ok(())
    }

    /// `dvx_batched_copy` launches on the device's stream for all `copies` (cut into
    /// pieces by [`crate::kernels::plan_batched_copy`]): one per table of at most one wave
    /// of the kernel's resident warps (the size a plan has unless it copies more segments
    /// than that). Each table is written to one of two slots of pinned memory allocated
    /// when the device was made, uploaded with `cuMemcpyHtoDAsync` into a stream-ordered
    /// device table (freed in stream order after its kernel): no driver call that
    /// synchronizes, and nothing blocks the host unless the upload of the table before
    /// last has not yet run.
    unsafe fn copy_on_device(
        &self,
        copies: &[devarrow_abi::device::DeviceCopy],
    ) -> devarrow_abi::Result<()> {
        // SAFETY: the caller's guarantees, forwarded.
        unsafe { self.batched_copy_on_device(copies) }
    }

    /// One `cuMemcpyPeerAsync` on the device's stream from another CUDA device's memory
    /// (`cuMemcpyAsync` from this device's own), where `cuDeviceCanAccessPeer` says this
    /// device can access the peer's memory; the first copy between two contexts enables
    /// peer access from this device's context to the source memory's (its
    /// `CU_POINTER_ATTRIBUTE_CONTEXT`), remembered for the process per pair of contexts.
    /// `Ok(false)` for a peer without access, or a device of another type: the caller
    /// stages the copy.
    unsafe fn copy_from_peer(
        &self,
        from: &dyn Device,
        src: *const c_void,
        dst: *mut c_void,
        len: usize,
    ) -> devarrow_abi::Result<bool> {
        // SAFETY: the caller's guarantees, forwarded.
        unsafe { self.direct_copy_from_peer(from, src, dst, len) }
    }

    /// [`CudaDevice::open`] of `device_id` with this device's options.
    fn peer_device(&self, device_id: i64) -> devarrow_abi::Result<Option<Arc<dyn Device>>> {
        let id = usize::try_from(device_id).map_err(|_| {
            CudaError::InvalidArgument(format!("no CUDA device has the id {device_id}"))
        })?;
        let device = CudaDevice::open(id)?.with_options(self.options);
        Ok(Some(Arc::new(device)))
    }

    fn record_event(&self) -> devarrow_abi::Result<Arc<dyn SyncEvent>> {
        let pooled = if self.options.reuse_events {
            self.events
                .free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop()
        } else {
            None
        };
        let event = match pooled {
            Some(event) => event,
            None => {
                self.events.created.fetch_add(1, Ordering::Relaxed);
                // The event is made in devarrow's own `CudaContext` value of the primary
                // context (the stream's may be the caller's, with its own stored errors).
                Event::create(self.device.context(), self.options.event_flags())?
            }
        };
        event.record(&self.stream)?;
        Ok(Arc::new(CudaSyncEvent {
            handle: Box::new(event.cu_event()),
            event: Some(event),
            recycle: self.options.reuse_events.then(|| self.events.clone()),
        }))
    }

    unsafe fn wait_sync_event(&self, sync_event: *mut c_void) -> devarrow_abi::Result<()> {
        if sync_event.is_null() {
            return Ok(());
        }
        // SAFETY: the caller guarantees a non-NULL `sync_event` points to a live CUevent
        // (the C Device interface's `CUevent*` for ARROW_DEVICE_CUDA).
        let event = unsafe { *sync_event.cast::<sys::CUevent>() };
        // SAFETY: the event is live (see above); waiting enqueues a dependency on our
        // stream and does not block the host.
        unsafe { context::stream_wait_event(&self.stream, event) }?;
        Ok(())
    }

    fn synchronize(&self) -> devarrow_abi::Result<()> {
        context::sync_stream(&self.stream)?;
        Ok(())
    }

    fn stream_handles(&self) -> Option<(usize, usize)> {
        Some((
            self.stream.context().cu_ctx() as usize,
            self.stream.cu_stream() as usize,
        ))
    }

    /// [`CudaDeviceOptions::register_pageable`], unless the driver said registering is
    /// not supported here.
    ///
    /// [`CudaDeviceOptions::register_pageable`]: super::CudaDeviceOptions::register_pageable
    fn host_registration_min_bytes(&self) -> Option<usize> {
        self.options
            .register_pageable
            .filter(|_| !self.registration_unsupported.load(Ordering::Relaxed))
    }

    /// Registers the whole pages inside the range
    /// ([`whole_pages`](devarrow_abi::device::whole_pages): `cuMemHostRegister`,
    /// portable), or takes one more use of devarrow's registration
    /// that holds them (see [`crate::HostRegistration`]), when
    /// [`CudaDeviceOptions::register_pageable`] asks for ranges this large. `Ok(None)` for
    /// ranges below it or holding no whole page, devarrow's own staging memory (pinned
    /// already), pages partly shared with a registration of devarrow that does not hold
    /// them, pages whose first or last the driver reports
    /// page-locked (by someone else: used as it is, not asked to register), and ranges
    /// the driver refuses to lock: locked by someone else in between
    /// (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, used as it is), not lockable
    /// (`CUDA_ERROR_INVALID_VALUE`: a read-only mapping, say), beyond the memlock limit
    /// (`CUDA_ERROR_OUT_OF_MEMORY`), or any other error that leaves the context usable
    /// (not [sticky](crate::is_sticky_error), nor saying the context is gone:
    /// `CUDA_ERROR_NOT_SUPPORTED`, and the `CUDA_ERROR_OPERATING_SYSTEM` or
    /// `CUDA_ERROR_NOT_PERMITTED` of restricted runtimes; then never tried again on this
    /// device). A sticky error, or one saying the context is gone, is returned
    /// ([`CudaError::Driver`]).
    ///
    /// [`CudaDeviceOptions::register_pageable`]: super::CudaDeviceOptions::register_pageable
    unsafe fn register_host(
        &self,
        ptr: *const u8,
        len: usize,
    ) -> devarrow_abi::Result<Option<Box<dyn HostRegistration>>> {
        let Some(min) = self.host_registration_min_bytes() else {
            return Ok(None);
        };
        if len == 0 || len < min || ptr.is_null() || CUDA_PINNED.contains(ptr, len) {
            return Ok(None);
        }
        self.bind()?;
        // Memory the driver reports page-locked at either end is someone else's (devarrow's
        // own registrations are found in its table first): not asked to register.
        let host = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;
        let locked = |first: usize, last: usize| {
            pointer_type_and_buffer(first).0 == host || pointer_type_and_buffer(last).0 == host
        };
        // SAFETY: the caller guarantees the range stays allocated until the registration
        // drops, and drops it only after the copies using it have completed; the context
        // is bound.
        match unsafe { host_register::register(self.device.context(), ptr, len, locked) } {
            Ok(Registered::Yes(registration, new)) => {
                if new {
                    self.ranges_registered.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(Box::new(registration)))
            }
            Ok(Registered::Skipped) => Ok(None),
            Err(e) => {
                use sys::CUresult::*;
                match e.driver_result() {
                    Some(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) => Ok(None),
                    // About this range: others may still lock.
                    Some(CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_OUT_OF_MEMORY) => {
                        self.registrations_refused.fetch_add(1, Ordering::Relaxed);
                        Ok(None)
                    }
                    // About the device or the runtime: not asked again.
                    _ if e.allows_fallback() => {
                        self.registration_unsupported.store(true, Ordering::Relaxed);
                        self.registrations_refused.fetch_add(1, Ordering::Relaxed);
                        Ok(None)
                    }
                    _ => Err(e.into()),
                }
            }
        }
    }

    /// `true` for ranges inside one live staging allocation of any `CudaDevice`
    /// (a registry lookup, no driver call); `false` for ranges reaching into pages
    /// devarrow registered ([`CudaDeviceOptions::register_pageable`]); otherwise asks the
    /// driver whether the first
    /// and the last byte lie in one `cuMemHostAlloc`ed allocation (`cuPointerGetAttributes`
    /// memory type and buffer id, `cuMemHostGetFlags`), which also finds memory other
    /// libraries pinned. Any doubt (a failed query) answers `false`.
    ///
    /// [`CudaDeviceOptions::register_pageable`]: super::CudaDeviceOptions::register_pageable
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        if CUDA_PINNED.contains(ptr, len) {
            return true;
        }
        // Pages devarrow registered for a transfer are unregistered when its copies are
        // done: a copy from them must take a use of the registration
        // (`register_host`), not rely on it.
        if len == 0 || ptr.is_null() || host_register::overlaps_registered(ptr, len) {
            return false;
        }
        if self.bind().is_err() {
            return false;
        }
        let first = ptr as usize;
        first
            .checked_add(len - 1)
            .is_some_and(|last| driver_reports_pinned(first, last))
    }
}
