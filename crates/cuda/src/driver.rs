//! The thin layer over the CUDA driver API: the only code of this crate that calls the
//! driver (cudarc's `sys::cu*` and `result::*` functions), modelled on cudarc's own
//! `driver::result`. Everything else uses these functions and cudarc's safe types
//! ([`CudaContext`](cudarc::driver::CudaContext), [`CudaStream`](cudarc::driver::CudaStream),
//! [`CudaEvent`](cudarc::driver::CudaEvent), ...).
//!
//! - One small function per driver call, named after it (`cuMemAllocFromPoolAsync` is
//!   [`mem_alloc_from_pool_async`]), returning [`crate::Result`]: a failure is
//!   [`CudaError::Driver`](crate::CudaError::Driver) naming the call, with cudarc's
//!   `DriverError` as its source; `CUDA_ERROR_NO_DEVICE` is
//!   [`CudaError::NoDevice`](crate::CudaError::NoDevice), and the out of memory of an
//!   allocation [`CudaError::OutOfMemory`](crate::CudaError::OutOfMemory) with its size.
//! - A function is `unsafe` when it takes a handle (context, stream, event, pool) or an
//!   address that the driver uses, which the caller must keep valid; functions that take
//!   only values (sizes, ordinals, attributes, flags), or only look an address up, are
//!   safe.
//! - Every function but [`culib_present`] needs the driver library (cudarc panics where
//!   it cannot be loaded): the crate's entry points check
//!   [`driver_available`](crate::driver_available) before their first driver call.
//!   Functions that allocate, copy or use a stream need the right context current
//!   (`crate::context::bind`).

use std::ffi::{c_uint, c_void};

use cudarc::driver::{result, sys};

use crate::error::{DriverResultExt, Result};

// ---------------------------------------------------------------------------------------
// The library and initialization
// ---------------------------------------------------------------------------------------

/// Whether the driver library (`libcuda`) can be loaded; no driver call.
pub(crate) fn culib_present() -> bool {
    // Miri cannot dlopen: under it there is no driver, as on a machine without one.
    if cfg!(miri) {
        return false;
    }
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by its
    // well-known names; it has no other side effect and no precondition.
    unsafe { sys::is_culib_present() }
}

/// `cuInit(0)`.
pub(crate) fn init() -> Result<()> {
    result::init().call("cuInit")
}

// ---------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------

/// `cuDeviceGetCount`: the number of devices.
pub(crate) fn device_get_count() -> Result<i32> {
    result::device::get_count().call("cuDeviceGetCount")
}

/// `cuDeviceGet`: the device of `ordinal`.
pub(crate) fn device_get(ordinal: i32) -> Result<sys::CUdevice> {
    result::device::get(ordinal).call("cuDeviceGet")
}

/// `cuDeviceGetAttribute`: attribute `attribute` of `device`.
pub(crate) fn device_get_attribute(
    device: sys::CUdevice,
    attribute: sys::CUdevice_attribute,
) -> Result<i32> {
    // SAFETY: a CUdevice is a plain ordinal, which the driver checks (an invalid one is
    // CUDA_ERROR_INVALID_DEVICE); the attribute is a valid enum value, and the result is
    // written to a local.
    unsafe { result::device::get_attribute(device, attribute) }.call("cuDeviceGetAttribute")
}

/// `cuDeviceGetName`: the device's name.
pub(crate) fn device_get_name(device: sys::CUdevice) -> Result<String> {
    result::device::get_name(device).call("cuDeviceGetName")
}

/// `cuDeviceTotalMem`: the device's memory in bytes.
pub(crate) fn device_total_mem(device: sys::CUdevice) -> Result<usize> {
    // SAFETY: as in `device_get_attribute`, the driver checks the ordinal.
    unsafe { result::device::total_mem(device) }.call("cuDeviceTotalMem")
}

/// `cuDeviceGetDefaultMemPool`: the device's default memory pool (which lives as long as
/// the process).
pub(crate) fn device_get_default_mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    // SAFETY: as in `device_get_attribute`, the driver checks the ordinal.
    unsafe { result::device::get_default_mem_pool(device) }.call("cuDeviceGetDefaultMemPool")
}

// ---------------------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------------------

/// `cuDevicePrimaryCtxGetState`: whether the primary context of `device` is active. It
/// is not after `cuDevicePrimaryCtxReset` until it is retained again.
pub(crate) fn primary_ctx_is_active(device: sys::CUdevice) -> Result<bool> {
    let (mut flags, mut active): (std::ffi::c_uint, std::ffi::c_int) = (0, 0);
    // SAFETY: the driver checks the ordinal and writes to our locals.
    unsafe { sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active) }
        .result()
        .call("cuDevicePrimaryCtxGetState")?;
    Ok(active != 0)
}

/// `cuDevicePrimaryCtxRetain`: retains (and activates) the primary context of `device`;
/// the caller releases it once with [`primary_ctx_release`].
pub(crate) fn primary_ctx_retain(device: sys::CUdevice) -> Result<sys::CUcontext> {
    // SAFETY: the driver checks the ordinal (an invalid one is CUDA_ERROR_INVALID_DEVICE).
    unsafe { result::primary_ctx::retain(device) }.call("cuDevicePrimaryCtxRetain")
}

/// `cuDevicePrimaryCtxRelease`: releases one retain of [`primary_ctx_retain`].
///
/// # Safety
/// The caller owns a retain of the primary context of `device` and gives it up.
pub(crate) unsafe fn primary_ctx_release(device: sys::CUdevice) -> Result<()> {
    // SAFETY: the caller's retain is given back exactly once.
    unsafe { result::primary_ctx::release(device) }.call("cuDevicePrimaryCtxRelease")
}

/// `cuCtxGetCurrent`: the context current on the calling thread, if any.
pub(crate) fn ctx_get_current() -> Result<Option<sys::CUcontext>> {
    result::ctx::get_current().call("cuCtxGetCurrent")
}

/// `cuCtxSetCurrent`: makes `ctx` current on the calling thread (NULL unbinds).
///
/// # Safety
/// `ctx` must be NULL or a live context.
pub(crate) unsafe fn ctx_set_current(ctx: sys::CUcontext) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::ctx::set_current(ctx) }.call("cuCtxSetCurrent")
}

/// `cuCtxSynchronize`: waits for all work of the current context.
pub(crate) fn ctx_synchronize() -> Result<()> {
    result::ctx::synchronize().call("cuCtxSynchronize")
}

/// `cuMemGetInfo`: `(free, total)` memory of the current context's device, in bytes.
pub(crate) fn mem_get_info() -> Result<(usize, usize)> {
    result::mem_get_info().call("cuMemGetInfo")
}

/// `cuCtxGetId`: the id of `ctx`, unique for the life of the process. Unlike the
/// `CUcontext` value, which a primary context keeps across `cuDevicePrimaryCtxReset`,
/// the id of the context created anew after a reset differs.
pub(crate) fn ctx_get_id(ctx: sys::CUcontext) -> Result<u64> {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: the driver checks `ctx` and writes the id to our local.
    unsafe { sys::cuCtxGetId(ctx, &mut id) }
        .result()
        .call("cuCtxGetId")?;
    Ok(id)
}

// ---------------------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------------------

/// `cuStreamSynchronize`: blocks until the work queued on `stream` has completed.
///
/// # Safety
/// `stream` must be a live stream of the current context, or NULL (the current
/// context's legacy default stream).
pub(crate) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::stream::synchronize(stream) }.call("cuStreamSynchronize")
}

/// `cuStreamWaitEvent(stream, event, CU_EVENT_WAIT_DEFAULT)`: work queued on `stream`
/// afterwards waits (on the device) for `event`.
///
/// # Safety
/// `stream` must be a live stream of the current context and `event` a live event (one
/// the driver may still be recording is fine).
pub(crate) unsafe fn stream_wait_event(stream: sys::CUstream, event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe {
        result::stream::wait_event(
            stream,
            event,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .call("cuStreamWaitEvent")
}

/// `cuEventSynchronize`: blocks until `event` has completed.
///
/// # Safety
/// `event` must be a live event.
pub(crate) unsafe fn event_synchronize(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::event::synchronize(event) }.call("cuEventSynchronize")
}

/// `cuEventCreate` with `flags`, any combination of `CU_EVENT_*` bits (cudarc's
/// `CUevent_flags` is an enum of single flags: `CU_EVENT_BLOCKING_SYNC |
/// CU_EVENT_DISABLE_TIMING` is not one of its values, so the raw call takes the bits).
/// The context the event belongs to must be current.
pub(crate) fn event_create(flags: c_uint) -> Result<sys::CUevent> {
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: the driver writes the new handle to our local; flags are plain bits (an
    // unknown bit is CUDA_ERROR_INVALID_VALUE, not undefined behaviour).
    unsafe { sys::cuEventCreate(&mut event, flags) }
        .result()
        .call("cuEventCreate")?;
    Ok(event)
}

/// `cuEventRecord`: records `event` at the current end of `stream`.
///
/// # Safety
/// `event` must be a live event and `stream` a live stream of the event's context, which
/// must be current.
pub(crate) unsafe fn event_record(event: sys::CUevent, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::event::record(event, stream) }.call("cuEventRecord")
}

/// `cuEventQuery`: whether the work before `event` has completed (`CUDA_ERROR_NOT_READY`
/// is `Ok(false)`).
///
/// # Safety
/// `event` must be a live event.
pub(crate) unsafe fn event_query(event: sys::CUevent) -> Result<bool> {
    // SAFETY: the caller's guarantee.
    match unsafe { result::event::query(event) } {
        Ok(()) => Ok(true),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        Err(e) => Err(e).call("cuEventQuery"),
    }
}

/// `cuEventDestroy`: destroys `event` (a wait already enqueued on it is unaffected).
///
/// # Safety
/// `event` must be a live event, not used afterwards.
pub(crate) unsafe fn event_destroy(event: sys::CUevent) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::event::destroy(event) }.call("cuEventDestroy")
}

// ---------------------------------------------------------------------------------------
// Memory pools and stream-ordered allocation
// ---------------------------------------------------------------------------------------

/// `cuMemPoolCreate`: a new pool of device memory (pinned allocations, no export handle
/// types) on device `ordinal`, with the default attributes.
pub(crate) fn mem_pool_create(ordinal: usize) -> Result<sys::CUmemoryPool> {
    // SAFETY: CUmemPoolProps is plain data (enums whose zero value is valid, a NULL
    // pointer, sizes and reserved bytes); zero is the documented default of every field.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ordinal as i32;
    // SAFETY: `props` is a valid, fully initialized CUmemPoolProps, read only during
    // the call.
    unsafe { result::mem_pool::create(&props) }.call("cuMemPoolCreate")
}

/// `cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes)`: how much
/// unused memory the pool keeps reserved at a synchronization.
///
/// # Safety
/// `pool` must be a live pool.
pub(crate) unsafe fn mem_pool_set_release_threshold(
    pool: sys::CUmemoryPool,
    bytes: u64,
) -> Result<()> {
    let mut threshold = bytes;
    // SAFETY: the pool is live (the caller's guarantee); RELEASE_THRESHOLD takes a u64,
    // which `threshold` is, read only during the call.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .call("cuMemPoolSetAttribute")
}

/// `cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES)`: whether
/// the driver may make an allocation wait on the stream that freed the memory it reuses.
///
/// # Safety
/// `pool` must be a live pool.
pub(crate) unsafe fn mem_pool_set_internal_dependencies(
    pool: sys::CUmemoryPool,
    allow: bool,
) -> Result<()> {
    let mut value: i32 = allow.into();
    // SAFETY: the pool is live (the caller's guarantee); the reuse attributes take an
    // `int`, which `value` is, read only during the call.
    unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
            (&mut value as *mut i32).cast(),
        )
    }
    .call("cuMemPoolSetAttribute")
}

/// `cuMemPoolDestroy`.
///
/// # Safety
/// `pool` must be a live pool that is not a device's default pool, and is not used
/// afterwards.
pub(crate) unsafe fn mem_pool_destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::mem_pool::destroy(pool) }.call("cuMemPoolDestroy")
}

/// `cuMemPoolTrimTo`: returns the pool's unused memory to the system, keeping at most
/// `keep` bytes reserved.
///
/// # Safety
/// `pool` must be a live pool.
pub(crate) unsafe fn mem_pool_trim_to(pool: sys::CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::mem_pool::trim_to(pool, keep) }.call("cuMemPoolTrimTo")
}

/// `cuMemAllocFromPoolAsync`: `bytes` uninitialized bytes from `pool`, ordered on
/// `stream`. Out of memory is [`CudaError::OutOfMemory`](crate::CudaError::OutOfMemory).
///
/// # Safety
/// `pool` must be a live pool of the current context's device and `stream` a live
/// stream of the current context.
pub(crate) unsafe fn mem_alloc_from_pool_async(
    pool: sys::CUmemoryPool,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    // SAFETY: the caller's guarantee; the memory is returned as an address only.
    unsafe { result::mem_pool::alloc_async(pool, bytes, stream) }
        .alloc("cuMemAllocFromPoolAsync", bytes)
}

/// `cuMemFreeAsync`: frees `ptr` in stream order on `stream`.
///
/// # Safety
/// `ptr` must come from a stream-ordered allocation not yet freed, used afterwards only
/// by work queued before on `stream`; `stream` must be a live stream of the current
/// context.
pub(crate) unsafe fn mem_free_async(ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::free_async(ptr, stream) }.call("cuMemFreeAsync")
}

// ---------------------------------------------------------------------------------------
// Device, pinned host and managed memory
// ---------------------------------------------------------------------------------------

/// `cuMemAlloc`: `bytes` uninitialized bytes of device memory in the current context.
/// Out of memory is [`CudaError::OutOfMemory`](crate::CudaError::OutOfMemory).
pub(crate) fn mem_alloc(bytes: usize) -> Result<sys::CUdeviceptr> {
    // SAFETY: the memory is returned as an address only, never read as Rust values.
    unsafe { result::malloc_sync(bytes) }.alloc("cuMemAlloc", bytes)
}

/// `cuMemFree`.
///
/// # Safety
/// `ptr` must come from [`mem_alloc`] or [`mem_alloc_managed`], not yet freed, with all
/// work using it completed, and not be used afterwards.
pub(crate) unsafe fn mem_free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::free_sync(ptr) }.call("cuMemFree")
}

/// `cuMemHostAlloc`: `bytes` uninitialized bytes of page-locked host memory with
/// `flags` (`CU_MEMHOSTALLOC_*`). Out of memory is
/// [`CudaError::OutOfMemory`](crate::CudaError::OutOfMemory).
///
/// Zero bytes: NULL. The driver answers `cuMemHostAlloc(&p, 0, ..)` with `CUDA_SUCCESS`
/// and leaves `p` unwritten (what `cudaMallocHost(&p, 0)` users see: alpaka#1868), so
/// the out-pointer starts as NULL here (cudarc's `malloc_host` would read it
/// uninitialized); callers keep a zero-length buffer without any allocation.
pub(crate) fn mem_host_alloc(bytes: usize, flags: c_uint) -> Result<*mut c_void> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: the driver writes the pointer to our local (or, for 0 bytes, nothing); the
    // memory is returned as a raw pointer only, never read here.
    unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, flags) }
        .result()
        .alloc("cuMemHostAlloc", bytes)?;
    Ok(if bytes == 0 {
        std::ptr::null_mut()
    } else {
        ptr
    })
}

/// `cuMemHostGetDevicePointer`: the device address of page-locked memory allocated
/// with `CU_MEMHOSTALLOC_DEVICEMAP`.
pub(crate) fn mem_host_get_device_pointer(ptr: *mut c_void) -> Result<sys::CUdeviceptr> {
    let mut device_ptr: sys::CUdeviceptr = 0;
    // SAFETY: the driver only looks the address up (an unknown one is an error) and
    // writes the answer to our local.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, ptr, 0) }
        .result()
        .call("cuMemHostGetDevicePointer")?;
    Ok(device_ptr)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` must come from [`mem_host_alloc`], not yet freed, with all work using it
/// completed, and not be used afterwards.
pub(crate) unsafe fn mem_free_host(ptr: *mut c_void) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::free_host(ptr) }.call("cuMemFreeHost")
}

/// `cuMemHostRegister(ptr, bytes, flags)`: page-locks the host range `ptr..ptr + bytes`
/// (`CU_MEMHOSTREGISTER_*` flags) so that copies DMA it in place. The driver locks whole
/// pages; a range sharing a page with locked memory is
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`.
///
/// # Safety
/// The range must be host memory of the process that stays allocated until
/// [`mem_host_unregister`]; a context must be current.
pub(crate) unsafe fn mem_host_register(
    ptr: *mut c_void,
    bytes: usize,
    flags: c_uint,
) -> Result<()> {
    // SAFETY: the caller's guarantee; the driver only locks the pages (it neither reads
    // nor writes them during the call).
    unsafe { sys::cuMemHostRegister_v2(ptr, bytes, flags) }
        .result()
        .call("cuMemHostRegister")
}

/// `cuMemHostUnregister(ptr)`: makes a range registered at `ptr` pageable again.
///
/// # Safety
/// `ptr` must be where [`mem_host_register`] registered a range, and every copy that
/// reads or writes the range must have completed; a context must be current.
pub(crate) unsafe fn mem_host_unregister(ptr: *mut c_void) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { sys::cuMemHostUnregister(ptr) }
        .result()
        .call("cuMemHostUnregister")
}

/// `cuMemAllocManaged`: `bytes` uninitialized bytes of managed memory attached with
/// `flags`. Out of memory is [`CudaError::OutOfMemory`](crate::CudaError::OutOfMemory).
pub(crate) fn mem_alloc_managed(
    bytes: usize,
    flags: sys::CUmemAttach_flags,
) -> Result<sys::CUdeviceptr> {
    // SAFETY: the memory is returned as an address only, never read here.
    unsafe { result::malloc_managed(bytes, flags) }.alloc("cuMemAllocManaged", bytes)
}

/// `cuPointerGetAttributes` for `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` and
/// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of `addr`, in one call: the memory type
/// (`CU_MEMORYTYPE_*`, 0 when the driver does not know the address) and the buffer id
/// (0 when unknown). Unlike `cuPointerGetAttribute`, it answers pageable memory with
/// zeros and `CUDA_SUCCESS`.
pub(crate) fn pointer_memory_type_and_buffer_id(addr: usize) -> Result<(u32, u64)> {
    let mut memory_type: u32 = 0;
    let mut buffer_id: u64 = 0;
    let mut attributes = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
    ];
    let mut data: [*mut c_void; 2] = [
        (&mut memory_type as *mut u32).cast(),
        (&mut buffer_id as *mut u64).cast(),
    ];
    // SAFETY: two attributes, each paired with a local of the type it writes (MEMORY_TYPE
    // a 32-bit enum, BUFFER_ID a u64); the driver only looks the address up.
    unsafe {
        sys::cuPointerGetAttributes(
            2,
            attributes.as_mut_ptr(),
            data.as_mut_ptr(),
            addr as sys::CUdeviceptr,
        )
    }
    .result()
    .call("cuPointerGetAttributes")?;
    Ok((memory_type, buffer_id))
}

// ---------------------------------------------------------------------------------------
// Copies and memsets
// ---------------------------------------------------------------------------------------

/// `cuDeviceCanAccessPeer`: whether `device` can access `peer`'s memory directly once
/// peer access is enabled (`false` for a device and itself).
pub(crate) fn device_can_access_peer(device: sys::CUdevice, peer: sys::CUdevice) -> Result<bool> {
    let mut can: std::ffi::c_int = 0;
    // SAFETY: the driver checks both ordinals and writes to our local.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, device, peer) }
        .result()
        .call("cuDeviceCanAccessPeer")?;
    Ok(can != 0)
}

/// `cuCtxEnablePeerAccess(peer, 0)`: work of the current context may access `peer`'s
/// memory from now on. `Ok(false)` when it already could
/// (`CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`, which is no failure here).
///
/// # Safety
/// `peer` must be a live context, and a context must be current.
pub(crate) unsafe fn ctx_enable_peer_access(peer: sys::CUcontext) -> Result<bool> {
    // SAFETY: the caller's guarantee.
    match unsafe { sys::cuCtxEnablePeerAccess(peer, 0) } {
        sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(false),
        r => r.result().call("cuCtxEnablePeerAccess").map(|()| true),
    }
}

/// `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_CONTEXT)`: the context that owns the
/// memory at `addr`.
pub(crate) fn pointer_context(addr: usize) -> Result<sys::CUcontext> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the attribute writes a CUcontext to our local; the driver only looks the
    // address up.
    unsafe {
        sys::cuPointerGetAttribute(
            (&mut ctx as *mut sys::CUcontext).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
            addr as sys::CUdeviceptr,
        )
    }
    .result()
    .call("cuPointerGetAttribute")?;
    Ok(ctx)
}

/// `cuMemcpyPeerAsync`: copies `bytes` bytes from device memory `src` of context
/// `src_ctx` to device memory `dst` of context `dst_ctx` on `stream` (the driver stages
/// it where the devices have no peer access).
///
/// # Safety
/// `src` must be readable and `dst` writable for `bytes` bytes until the copy completes,
/// each memory of its context; both contexts live; `stream` a live stream of the current
/// context.
pub(crate) unsafe fn memcpy_peer_async(
    dst: sys::CUdeviceptr,
    dst_ctx: sys::CUcontext,
    src: sys::CUdeviceptr,
    src_ctx: sys::CUcontext,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { sys::cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, bytes, stream) }
        .result()
        .call("cuMemcpyPeerAsync")
}

/// `cuMemcpyAsync`: copies `bytes` bytes between two unified addresses (device, pinned,
/// managed or pageable host memory; the driver infers the direction) on `stream`.
///
/// # Safety
/// `src` must be readable and `dst` writable for `bytes` bytes until the copy
/// completes; `stream` must be a live stream of the current context.
pub(crate) unsafe fn memcpy_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) }
        .result()
        .call("cuMemcpyAsync")
}

/// `cuMemcpyHtoDAsync`: copies `bytes` bytes from host memory at `src` to device memory
/// at `dst` on `stream`.
///
/// # Safety
/// `src` must be readable for `bytes` bytes (and not written) and `dst` device memory
/// writable for `bytes` bytes until the copy completes; `stream` must be a live stream of
/// the current context.
pub(crate) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, bytes, stream) }
        .result()
        .call("cuMemcpyHtoDAsync")
}

/// `cuMemcpyDtoHAsync`: copies `bytes` bytes from device memory at `src` to host memory
/// at `dst` on `stream`.
///
/// # Safety
/// `dst` must be writable for `bytes` bytes (and not otherwise accessed) and `src`
/// device memory readable for `bytes` bytes until the copy completes; `stream` must be a
/// live stream of the current context.
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut c_void,
    src: sys::CUdeviceptr,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src, bytes, stream) }
        .result()
        .call("cuMemcpyDtoHAsync")
}

/// Whether the driver library exports `cuMemcpyBatchAsync` (drivers of CUDA 12.8 and
/// later). Looked up by name in the library cudarc loaded, which is what cudarc's
/// dynamic loading does on the first call: there it panics when the symbol is missing,
/// so [`memcpy_batch_async`] must never be called where this answers `false`.
pub(crate) fn memcpy_batch_async_present() -> bool {
    // SAFETY: `culib` returns the driver library cudarc loaded (the callers have a device
    // open, so it loads); `get` only looks the symbol up, it is not called here, and the
    // function type it is read as is never used.
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync\0") }.is_ok()
}

/// `cuMemcpyBatchAsync`: the copies `srcs[i] -> dsts[i]` of `sizes[i]` bytes (unified
/// addresses: device, pinned, registered or pageable host memory), read in stream order
/// (`CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`), the sources at `src_location` and the
/// destinations at `dst_location` (the hints), in one call on `stream`. The batch runs in stream order as a
/// whole; its copies in no particular order.
///
/// ABI: bound to the CUDA 12.8 signature that cudarc's `cuda-12080` bindings declare
/// (`dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, failIdx, hStream`). CUDA 13
/// headers map the name to `cuMemcpyBatchAsync_v2`, which drops `failIdx`, and CUDA 13
/// drivers keep exporting `cuMemcpyBatchAsync` with the 12.x signature for binaries
/// built against 12.x, which is the symbol cudarc loads by that name. `failIdx` (the
/// copy the driver refused, if any) is not reported: the error names the call.
///
/// # Safety
/// Only where [`memcpy_batch_async_present`]. The three slices must have the same
/// length; every source must be readable and every destination writable for its size
/// until the batch has completed, and no destination may overlap another copy; `stream`
/// must be a live stream of the current context, not the legacy NULL stream (which the
/// call does not accept).
pub(crate) unsafe fn memcpy_batch_async(
    dsts: &mut [sys::CUdeviceptr],
    srcs: &mut [sys::CUdeviceptr],
    sizes: &mut [usize],
    (src_location, dst_location): (sys::CUmemLocation, sys::CUmemLocation),
    stream: sys::CUstream,
) -> Result<()> {
    debug_assert!(dsts.len() == srcs.len() && srcs.len() == sizes.len());
    // SAFETY: CUmemcpyAttributes is plain data (enums whose zero value is valid, ints);
    // every field is set below or left at its documented default of zero (no flags).
    let mut attributes: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    // Sources are read in stream order (after the work enqueued before the batch), as
    // every other copy of the stream reads them.
    attributes.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    // Where the ends lie: the driver uses the hints for memory it did not allocate
    // (pageable and registered host memory).
    attributes.srcLocHint = src_location;
    attributes.dstLocHint = dst_location;
    let mut attrs = [attributes];
    let mut first_copy_of_each = [0usize];
    let mut fail_index = usize::MAX;
    // Three arrays of `sizes.len()` copies and one attribute set that applies from copy
    // 0, all live for the call; `fail_index` is a local.
    // SAFETY: the symbol exists (the caller's guarantee), so cudarc's lazy lookup does
    // not panic; the arrays are as above; the ranges and the stream are the caller's.
    unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            sizes.len(),
            attrs.as_mut_ptr(),
            first_copy_of_each.as_mut_ptr(),
            1,
            &mut fail_index,
            stream,
        )
    }
    .result()
    .call("cuMemcpyBatchAsync")
}

/// `cuMemsetD8Async`: sets `bytes` bytes at `ptr` to `value` on `stream`.
///
/// # Safety
/// `ptr` must be device-accessible memory writable for `bytes` bytes until the memset
/// completes; `stream` must be a live stream of the current context.
pub(crate) unsafe fn memset_d8_async(
    ptr: sys::CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::memset_d8_async(ptr, value, bytes, stream) }.call("cuMemsetD8Async")
}

/// `cuMemsetD32Async`: sets `count` 32-bit words at `ptr` (4-byte aligned) to `value` on
/// `stream`.
///
/// # Safety
/// `ptr` must be device-accessible memory writable for `4 * count` bytes until the memset
/// completes; `stream` must be a live stream of the current context.
pub(crate) unsafe fn memset_d32_async(
    ptr: sys::CUdeviceptr,
    value: u32,
    count: usize,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { sys::cuMemsetD32Async(ptr, value, count, stream) }
        .result()
        .call("cuMemsetD32Async")
}

/// `cuMemsetD8`: sets `bytes` bytes at `ptr` to `value`, on the current context's legacy
/// default stream (the call may return before the memset completes).
///
/// # Safety
/// `ptr` must be device-accessible memory writable for `bytes` bytes until the memset
/// completes.
pub(crate) unsafe fn memset_d8(ptr: sys::CUdeviceptr, value: u8, bytes: usize) -> Result<()> {
    // SAFETY: the caller's guarantee.
    unsafe { result::memset_d8_sync(ptr, value, bytes) }.call("cuMemsetD8")
}

// ---------------------------------------------------------------------------------------
// Modules
// ---------------------------------------------------------------------------------------

/// The JIT's error log for `ptx` (`cuModuleLoadDataEx` with `CU_JIT_ERROR_LOG_BUFFER`),
/// asked for only after a load failed, to say why. `None` when the log is empty or the
/// load succeeds this time (the module is then unloaded again).
pub(crate) fn jit_error_log(ptx: &str) -> Option<String> {
    let image = std::ffi::CString::new(ptx).ok()?;
    let mut log = vec![0u8; 16 << 10];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: a NUL-terminated image, two options with their values (the buffer, and its
    // size passed as the pointer value, as the driver reads it), all live for the call;
    // the caller has the context current.
    let loaded = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            image.as_ptr().cast(),
            2,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    if loaded == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the module was just loaded and is used by nothing else.
        let _ = unsafe { sys::cuModuleUnload(module) };
        return None;
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
    (!text.is_empty()).then_some(text)
}
