//! Memory: allocation and free (device, stream-ordered, pinned, managed), the default
//! memory pool, pointer attributes, copies and memsets.

use std::ffi::{c_uchar, c_uint, c_ushort, c_void};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering as AtomicOrdering};
use std::sync::Arc;

use cudarc::driver::sys::{
    CUcontext, CUdeviceptr, CUmemPool_attribute, CUmemcpyAttributes, CUmemcpySrcAccessOrder,
    CUmemoryPool, CUpointer_attribute, CUresult, CUstream,
};

use super::alloc::{Alloc, FreeBlock, Kind, MemTable, DEVICE_ADDRESS_BASE, DEVICE_ADDRESS_END};
use super::common::*;
use super::config::config_restricted;
use super::queue::{Endpoint, Op, Stream};
use super::state::*;
use super::sync;

/// `CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED`.
const HOST_ALLOC_FLAGS: u32 = 0x7;

fn is_device_address(p: u64) -> bool {
    (DEVICE_ADDRESS_BASE..DEVICE_ADDRESS_END).contains(&p)
}

/// Allocates device memory (`cuMemAlloc`): never zeroed (filled with
/// [`super::POISON`]), 256-byte aligned, at an address the host cannot dereference.
///
/// An implicit synchronization ("a device memory allocation", CUDA C++ Programming Guide,
/// "Implicit Synchronization"; see [`super::sync`]): every stream of the context waits
/// for the work enqueued before the call; counted.
///
/// # Safety
/// `dptr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    api("cuMemAlloc_v2", || {
        let ctx = current_context()?;
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        inject("cuMemAlloc_v2", CUDA_ERROR_OUT_OF_MEMORY)?;
        let a = driver()
            .mem
            .alloc_device(ctx.device(), bytesize, ctx.handle(), None)?;
        ctx.barrier();
        sync::count("cuMemAlloc_v2");
        // SAFETY: the caller's out-pointer (non-NULL).
        unsafe { out(dptr, a.addr) }
    })
}

/// Frees device or managed memory (`cuMemFree`), after all work of the allocation's
/// context has completed: "For all other pointers, this API may perform implicit
/// synchronization" (CUDA driver API, `cuMemFree`); counted (see [`super::sync`]).
/// Memory from a pool (`cuMemAllocAsync`, `cuMemAllocFromPoolAsync`) is freed at once
/// instead, without waiting and uncounted: "This API will not perform any implicit
/// synchronization when the pointer was allocated with cuMemAllocAsync or
/// cuMemAllocFromPoolAsync. Callers must ensure that all accesses to these pointer have
/// completed before invoking cuMemFree" (work still queued on it faults). Freeing
/// anything but the base address of a live device or managed allocation is
/// `CUDA_ERROR_INVALID_VALUE`.
///
/// No context need be current: the pointer names its allocation, and so its context
/// (which is the one drained and whose sticky error is returned). NVIDIA's driver accepts
/// such a free, and producers outside devarrow do it (a release callback run on a thread
/// that never bound a context); only `cuInit` is required.
///
/// # Safety
/// None beyond the driver API's (the address is only looked up).
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    api("cuMemFree_v2", || {
        require_init()?;
        if dptr == 0 {
            return Ok(());
        }
        let mem = &driver().mem;
        let a = mem
            .begin_free(dptr, |k| k.is_device() || k == Kind::Managed)
            .inspect_err(|_| bad_free("cuMemFree_v2", mem, dptr))?;
        // A live allocation's context is live (destroying a context frees its memory).
        let ctx = match driver().get(a.ctx) {
            Some(Object::Context(ctx)) => Some(ctx),
            _ => None,
        };
        let pooled = a.kind == (Kind::Device { pooled: true });
        if let Some(ctx) = ctx.as_ref().filter(|_| !pooled) {
            ctx.drain();
            sync::count("cuMemFree_v2");
        }
        mem.finish_free(&a);
        ctx.map_or(Ok(()), |ctx| ctx.shared.sticky())
    })
}

fn bad_free(call: &str, mem: &MemTable, addr: u64) {
    let what = match mem.find(addr) {
        Some(a) if a.addr == addr => {
            format!("{} (wrong kind of memory for this call)", a.describe())
        }
        Some(a) => format!("{addr:#x}, inside {} but not its start", a.describe()),
        None => mem.describe(addr, 1),
    };
    eprintln!("devarrow-emu: {call}: invalid free of {what}");
}

/// A stream-ordered allocation from `pool` on `stream`, reusing a block freed in stream
/// order where the pool's rules allow it, as the driver's pools do (CUDA programming
/// guide, "Stream Ordered Memory Allocator", reuse policies; `CUmemPool_attribute`):
///
/// - a block freed on the **same** stream, at once, even before the free ran: stream
///   order puts the new allocation's work after the free;
/// - one freed on another stream this stream was made to wait for at or after the free
///   (`cuStreamWaitEvent`, the legacy stream), with
///   `CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES`;
/// - one whose free has already run, with `CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC`
///   (what a reader on a stream that never waited then reads depends on timing, as on a
///   GPU);
/// - any other of the pool, with `CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES`,
///   after making this stream wait for the free.
///
/// Otherwise the allocation gets fresh memory at a new address.
fn alloc_async(
    call: &'static str,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
    pool: u64,
) -> R {
    let ctx = current_context()?;
    let stream = ctx.stream(stream as u64)?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // 0: the default pool of the context's device.
    let pool = if pool == 0 {
        default_pool(ctx.device())
    } else {
        pool
    };
    if pool_device(pool) != Some(ctx.device()) {
        // A pool of another device: the stream's device allocates from its own pools.
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    inject(call, CUDA_ERROR_OUT_OF_MEMORY)?;
    let mem = &driver().mem;
    let [follow_events, opportunistic, internal] = mem.reuse_flags(pool).map(|f| f != 0);
    // A block freed on another stream, reused: checked when the allocation runs.
    let reused_from = std::cell::RefCell::new(None);
    let ordered = |block: &FreeBlock| {
        block
            .stream
            .clone()
            .downcast::<Stream>()
            .is_ok_and(|freeing| {
                let same = Arc::ptr_eq(&freeing, &stream);
                let ok = same
                    || (follow_events && stream.is_ordered_after(&freeing, block.seq))
                    || (opportunistic && freeing.is_done(block.seq));
                if ok && !same {
                    *reused_from.borrow_mut() = Some((freeing, block.seq));
                }
                ok
            })
    };
    let mut wait_for = None;
    let mut reused = mem.reuse(bytesize, ctx.handle(), pool, ordered);
    if reused.is_none() && internal {
        reused = mem.reuse(
            bytesize,
            ctx.handle(),
            pool,
            |block: &FreeBlock| match block.stream.clone().downcast::<Stream>() {
                Ok(freeing) => {
                    wait_for = Some((freeing, block.seq));
                    true
                }
                Err(_) => false,
            },
        );
    }
    let a = match reused {
        Some(a) => a,
        None => mem.alloc_device(ctx.device(), bytesize, ctx.handle(), Some(pool))?,
    };
    if let Some((freeing, seq)) = wait_for {
        ctx.enqueue(
            &stream,
            Op::Wait {
                stream: freeing,
                seq,
            },
        );
    }
    if let Some((stream_freed, seq)) = reused_from.into_inner() {
        ctx.enqueue(
            &stream,
            Op::ReusedAfter {
                stream: stream_freed,
                seq,
            },
        );
    }
    ctx.enqueue(&stream, Op::AllocReady(a.clone()));
    // SAFETY: the caller's out-pointer (non-NULL).
    unsafe { out(dptr, a.addr) }
}

/// Allocates device memory from the default pool in stream order (`cuMemAllocAsync`):
/// the address is returned at once, but the memory may be used only by work ordered
/// after the allocation on `hStream` (work running earlier faults). It may be a block
/// freed before: on `hStream` at once, on other streams per the pool's reuse flags.
///
/// # Safety
/// `dptr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemAllocAsync", || {
        alloc_async("cuMemAllocAsync", dptr, bytesize, hStream, 0)
    })
}

/// [`cuMemAllocAsync`] from an explicit pool (the default pool or a created one).
///
/// # Safety
/// `dptr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    hStream: CUstream,
) -> CUresult {
    api("cuMemAllocFromPoolAsync", || {
        check_pool(pool)?;
        alloc_async(
            "cuMemAllocFromPoolAsync",
            dptr,
            bytesize,
            hStream,
            pool as u64,
        )
    })
}

/// Frees device memory in stream order (`cuMemFreeAsync`): no new work may use it after
/// this call; work already enqueued before the free on `hStream` may. The memory returns
/// to the pool when the free runs, which fills it with [`super::FREED_POISON`]; the pool
/// may hand the block to a later allocation at once (see [`cuMemAllocAsync`]).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, hStream: CUstream) -> CUresult {
    api("cuMemFreeAsync", || {
        let ctx = current_context_any()?;
        let stream = ctx.stream(hStream as u64)?;
        let mem = &driver().mem;
        let a = mem
            .begin_free(dptr, Kind::is_device)
            .inspect_err(|_| bad_free("cuMemFreeAsync", mem, dptr))?;
        let pooled = a.kind == (Kind::Device { pooled: true });
        let seq = ctx.enqueue(&stream, Op::Free(a.clone()));
        if pooled {
            mem.keep_free_block(FreeBlock {
                alloc: a,
                stream,
                seq,
            });
        }
        ctx.shared.sticky()
    })
}

/// Allocates managed memory (`cuMemAllocManaged`): a page-aligned host allocation,
/// accessible from kernels and the host at the same address. A device memory allocation,
/// so an implicit synchronization as [`cuMemAlloc_v2`] is (counted). In a restricted runtime
/// (`DEVARROW_EMU_RESTRICTED=1`) it fails with `CUDA_ERROR_OPERATING_SYSTEM`, although
/// the device attribute still reports managed memory.
///
/// # Safety
/// `dptr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    api("cuMemAllocManaged", || {
        let ctx = current_context()?;
        if dptr.is_null() || !(flags == 1 || flags == 2) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if config_restricted() {
            // gVisor's nvproxy did not support managed memory: `cudaMallocManaged`
            // failed there while it worked under runc (google/gvisor#9593).
            return Err(CUDA_ERROR_OPERATING_SYSTEM);
        }
        let a = driver()
            .mem
            .alloc_host(ctx.device(), bytesize, ctx.handle(), Kind::Managed)?;
        ctx.barrier();
        sync::count("cuMemAllocManaged");
        // SAFETY: the caller's out-pointer (non-NULL).
        unsafe { out(dptr, a.addr) }
    })
}

/// `cuMemHostAlloc` / `cuMemAllocHost`. Zero bytes succeed without allocating and leave
/// `*pp` as it was (not even NULL is written): what NVIDIA's driver does, as users of
/// `cudaMallocHost(&p, 0)` report (alpaka-group/alpaka#1868: "some CUDA versions return
/// the unchanged pointer given to CUDA memory allocation if the size to allocate is
/// zero"; ComputationalRadiationPhysics/picongpu#1179: no error, the pointer unchanged),
/// unlike `cuMemAlloc`, whose documentation makes 0 bytes `CUDA_ERROR_INVALID_VALUE`.
///
/// An implicit synchronization ("a page-locked host memory allocation", CUDA C++
/// Programming Guide, "Implicit Synchronization"; see [`super::sync`]): every stream of
/// the context waits for the work enqueued before the call; counted as `call`.
fn host_alloc(call: &'static str, pp: *mut *mut c_void, bytesize: usize, flags: u32) -> R {
    let ctx = current_context()?;
    if pp.is_null() || flags & !HOST_ALLOC_FLAGS != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if bytesize == 0 {
        return Ok(());
    }
    inject("cuMemHostAlloc", CUDA_ERROR_OUT_OF_MEMORY)?;
    let a =
        driver()
            .mem
            .alloc_host(ctx.device(), bytesize, ctx.handle(), Kind::Pinned { flags })?;
    ctx.barrier();
    sync::count(call);
    // SAFETY: the caller's out-pointer (non-NULL).
    unsafe { out(pp, a.addr as *mut c_void) }
}

/// Allocates pinned host memory (`cuMemAllocHost`, flags 0).
///
/// # Safety
/// `pp` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytesize: usize) -> CUresult {
    api("cuMemAllocHost_v2", || {
        host_alloc("cuMemAllocHost_v2", pp, bytesize, 0)
    })
}

/// Allocates pinned host memory with `CU_MEMHOSTALLOC_*` flags (recorded for
/// `cuMemHostGetFlags`). Its device address is its host address.
///
/// # Safety
/// `pp` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytesize: usize,
    Flags: c_uint,
) -> CUresult {
    api("cuMemHostAlloc", || {
        host_alloc("cuMemHostAlloc", pp, bytesize, Flags)
    })
}

/// Frees pinned host memory, after all work of the context has completed (an implicit
/// synchronization, counted: see [`super::sync`]). NULL is accepted and frees nothing
/// (`cudaFreeHost(NULL)` succeeds: ComputationalRadiationPhysics/picongpu#1179), as
/// `cuMemFree(0)` does.
///
/// # Safety
/// None beyond the driver API's (the address is only looked up).
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    api("cuMemFreeHost", || {
        let ctx = current_context_any()?;
        if p.is_null() {
            return Ok(());
        }
        let mem = &driver().mem;
        let a = mem
            .begin_free(p as u64, |k| matches!(k, Kind::Pinned { .. }))
            .inspect_err(|_| bad_free("cuMemFreeHost", mem, p as u64))?;
        ctx.drain();
        sync::count("cuMemFreeHost");
        mem.finish_free(&a);
        ctx.shared.sticky()
    })
}

fn pinned_at(p: u64) -> R<(Arc<Alloc>, u32)> {
    match driver().mem.find(p) {
        Some(a) => match a.kind {
            Kind::Pinned { flags } => Ok((a, flags)),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        },
        None => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// The flags pinned memory was allocated with (`CUDA_ERROR_INVALID_VALUE` for anything
/// that is not inside a `cuMemHostAlloc` / `cuMemAllocHost` allocation).
///
/// # Safety
/// `pFlags` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetFlags(pFlags: *mut c_uint, p: *mut c_void) -> CUresult {
    api("cuMemHostGetFlags", || {
        current_context_any()?;
        let (_, flags) = pinned_at(p as u64)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(pFlags, flags) }
    })
}

/// The device address of pinned memory: the same address (unified addressing).
///
/// # Safety
/// `pdptr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    pdptr: *mut CUdeviceptr,
    p: *mut c_void,
    Flags: c_uint,
) -> CUresult {
    api("cuMemHostGetDevicePointer_v2", || {
        current_context()?;
        if Flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        pinned_at(p as u64)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(pdptr, p as u64) }
    })
}

/// `CU_MEMHOSTREGISTER_PORTABLE | _DEVICEMAP | _IOMEMORY | _READ_ONLY`.
const HOST_REGISTER_FLAGS: u32 = 0xF;
/// `CU_MEMHOSTREGISTER_IOMEMORY`: I/O memory (a device's BAR), not emulated.
const HOST_REGISTER_IOMEMORY: u32 = 0x4;

/// How many host ranges `cuMemHostRegister` registered so far (successful calls).
static HOST_REGISTRATIONS: AtomicU64 = AtomicU64::new(0);

/// Page-locks the caller's host range `p..p + bytesize` (`cuMemHostRegister`): copies
/// then use it in place, asynchronously (read or written when they run, not staged at
/// the call as pageable memory is), until [`cuMemHostUnregister`]. A range sharing a page
/// with a page-locked one (pinned or registered) is
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, as the driver locks whole pages. In a
/// restricted runtime (`DEVARROW_EMU_RESTRICTED=1`) every valid call fails with
/// `CUDA_ERROR_OPERATING_SYSTEM`.
///
/// Page-locking is a page-locked host allocation in place ("This memory range also is
/// added to the same tracking mechanism as cuMemHostAlloc", CUDA driver API,
/// `cuMemHostRegister`), so an implicit synchronization as [`cuMemHostAlloc`] is: every
/// stream of the context waits for the work enqueued before the call; counted.
///
/// # Safety
/// `p..p + bytesize` must be host memory of the caller, valid until it is unregistered.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    bytesize: usize,
    Flags: c_uint,
) -> CUresult {
    api("cuMemHostRegister_v2", || {
        let ctx = current_context()?;
        if p.is_null() || bytesize == 0 || Flags & !HOST_REGISTER_FLAGS != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if Flags & HOST_REGISTER_IOMEMORY != 0 {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if is_device_address(p as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if config_restricted() {
            // A sandbox that cannot pin the caller's pages answers "OS call failed or
            // operation not supported on this OS" (CUDA_ERROR_OPERATING_SYSTEM), the
            // error nvproxy users meet (google/gvisor#9372), not NOT_SUPPORTED.
            return Err(CUDA_ERROR_OPERATING_SYSTEM);
        }
        inject("cuMemHostRegister_v2", CUDA_ERROR_OUT_OF_MEMORY)?;
        driver()
            .mem
            .register_host(ctx.device(), p as u64, bytesize, ctx.handle(), Flags)?;
        HOST_REGISTRATIONS.fetch_add(1, AtomicOrdering::Relaxed);
        ctx.barrier();
        sync::count("cuMemHostRegister_v2");
        Ok(())
    })
}

/// Makes a range registered by [`cuMemHostRegister_v2`] pageable again; `p` must be the
/// address it was registered at (else `CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED`).
///
/// Stricter than the driver documents: the range is forgotten at once, without waiting
/// for the work that uses it, so a copy still queued on a stream that reads or writes it
/// faults when it runs (`CUDA_ERROR_ILLEGAL_ADDRESS`, sticky): a caller must unregister
/// only after the copies have completed. Counted as an implicit synchronization (see
/// [`super::sync`]), the undoing of a page-locked allocation: work enqueued afterwards
/// on any stream of the context runs after the work enqueued before.
///
/// # Safety
/// None beyond the driver API's (the address is only looked up).
#[no_mangle]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    api("cuMemHostUnregister", || {
        let ctx = current_context_any()?;
        let mem = &driver().mem;
        let a = mem
            .begin_free(p as u64, |k| matches!(k, Kind::Registered { .. }))
            .map_err(|_| {
                bad_free("cuMemHostUnregister", mem, p as u64);
                CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
            })?;
        mem.finish_free(&a);
        ctx.barrier();
        sync::count("cuMemHostUnregister");
        Ok(())
    })
}

/// How many host ranges are registered now (`cuMemHostRegister` not yet undone by
/// `cuMemHostUnregister`, nor by the destruction of the context), and, through `total`
/// when not NULL, how many were registered since the process started. Not a CUDA
/// symbol: tests find it with `dlsym`, and skip where it is missing (a real driver).
///
/// # Safety
/// `total` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn devarrow_emu_host_registrations(total: *mut u64) -> u64 {
    if !total.is_null() {
        // SAFETY: non-NULL, the caller's out-pointer.
        unsafe { total.write(HOST_REGISTRATIONS.load(AtomicOrdering::Relaxed)) };
    }
    catch(|| {
        driver()
            .mem
            .snapshot()
            .iter()
            .filter(|a| matches!(a.kind, Kind::Registered { .. }))
            .count() as u64
    })
    .unwrap_or(0)
}

/// How many times `cuMemGetInfo_v2` was called (successful or not).
static MEM_GET_INFO_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many times `cuMemGetInfo_v2` has been called since the process started. Not a
/// CUDA symbol: tests find it with `dlsym`, and skip where it is missing (a real driver).
#[no_mangle]
pub extern "C" fn devarrow_emu_mem_get_info_calls() -> u64 {
    MEM_GET_INFO_CALLS.load(AtomicOrdering::Relaxed)
}

/// Free and total device memory: exactly the live device allocations (rounded to 256
/// bytes) and the memory the pool holds are in use. Counted
/// ([`devarrow_emu_mem_get_info_calls`]).
///
/// # Safety
/// The pointers must be NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    MEM_GET_INFO_CALLS.fetch_add(1, AtomicOrdering::Relaxed);
    api("cuMemGetInfo_v2", || {
        let ctx = current_context()?;
        // The current context's device's memory.
        let (f, t) = driver().mem.info(ctx.device());
        // SAFETY: the caller's out-pointers.
        unsafe {
            out(free, f as usize)?;
            out(total, t as usize)
        }
    })
}

/// The base and size of the allocation containing `dptr`.
///
/// # Safety
/// The pointers must be NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    pbase: *mut CUdeviceptr,
    psize: *mut usize,
    dptr: CUdeviceptr,
) -> CUresult {
    api("cuMemGetAddressRange_v2", || {
        current_context()?;
        let a = driver().mem.find(dptr).ok_or(CUDA_ERROR_NOT_FOUND)?;
        // SAFETY: the caller's out-pointers (each may be NULL).
        unsafe {
            if !pbase.is_null() {
                out(pbase, a.addr)?;
            }
            if !psize.is_null() {
                out(psize, a.size)?;
            }
        }
        Ok(())
    })
}

/// One attribute of the allocation containing `ptr` (`CUDA_ERROR_INVALID_VALUE` for
/// memory the driver does not know, such as pageable host memory).
///
/// # Safety
/// `data` must be NULL or valid for a write of the attribute's type.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: CUpointer_attribute,
    ptr: CUdeviceptr,
) -> CUresult {
    // SAFETY: the caller's contract.
    api("cuPointerGetAttribute", || unsafe {
        pointer_attribute(data, attribute, ptr)
    })
}

/// The body of [`cuPointerGetAttribute`], shared with [`cuPointerGetAttributes`].
///
/// # Safety
/// As [`cuPointerGetAttribute`].
unsafe fn pointer_attribute(
    data: *mut c_void,
    attribute: CUpointer_attribute,
    ptr: CUdeviceptr,
) -> R {
    require_init()?;
    let a = driver().mem.find(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if !a.usable() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let device = a.kind.is_device();
    // SAFETY: (every write below) `data` is the caller's out-pointer, valid for the
    // attribute's documented type.
    unsafe {
        match attribute as i32 {
            1 => out(data.cast::<CUcontext>(), a.ctx as CUcontext),
            2 => out(
                data.cast::<u32>(),
                if a.kind.is_page_locked() { 1 } else { 2 },
            ),
            3 => out(data.cast::<CUdeviceptr>(), ptr),
            4 if device => Err(CUDA_ERROR_INVALID_VALUE),
            4 => out(data.cast::<*mut c_void>(), ptr as *mut c_void),
            6 => out(data.cast::<u32>(), 0),
            7 => out(data.cast::<u64>(), a.id),
            8 => out(data.cast::<u32>(), u32::from(a.kind == Kind::Managed)),
            9 => out(data.cast::<i32>(), a.device as i32),
            10 => out(
                data.cast::<u32>(),
                u32::from(a.kind == Kind::Device { pooled: false }),
            ),
            11 => out(data.cast::<CUdeviceptr>(), a.addr),
            12 => out(data.cast::<usize>(), a.size),
            13 => out(data.cast::<u32>(), 1),
            14 => out(data.cast::<u64>(), 0),
            15 => out(data.cast::<u32>(), u32::from(device)),
            16 => out(data.cast::<i32>(), 3),
            17 if a.kind == (Kind::Device { pooled: true }) => {
                out(data.cast::<CUmemoryPool>(), a.pool as CUmemoryPool)
            }
            18 => out(data.cast::<usize>(), a.size),
            19 => out(data.cast::<*mut c_void>(), a.addr as *mut c_void),
            20 => out(data.cast::<u64>(), a.id),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

/// Several attributes of `ptr` at once. Unlike [`cuPointerGetAttribute`], memory the
/// driver does not know (pageable host memory) is not an error: every attribute then
/// reads as zero (NULL), as do attributes that do not apply to the allocation.
///
/// # Safety
/// `attributes` and `data` must each hold `numAttributes` entries, and every `data[i]`
/// must be valid for a write of the type of `attributes[i]`.
#[no_mangle]
pub unsafe extern "C" fn cuPointerGetAttributes(
    numAttributes: c_uint,
    attributes: *mut CUpointer_attribute,
    data: *mut *mut c_void,
    ptr: CUdeviceptr,
) -> CUresult {
    api("cuPointerGetAttributes", || {
        require_init()?;
        if numAttributes == 0 || attributes.is_null() || data.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for i in 0..numAttributes as usize {
            // SAFETY: both arrays hold `numAttributes` entries (the caller's contract).
            let (attribute, slot) = unsafe { (*attributes.add(i), *data.add(i)) };
            let size = match attribute as i32 {
                2 | 6 | 8 | 9 | 10 | 13 | 15 | 16 => 4,
                1 | 3 | 4 | 7 | 11 | 12 | 14 | 17 | 18 | 19 | 20 => 8,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            };
            // SAFETY: `slot` is valid for the attribute's type (the caller's contract).
            let known = unsafe { pointer_attribute(slot, attribute, ptr) }.is_ok();
            if !known && !slot.is_null() {
                // SAFETY: as above; `size` is the size of the attribute's type.
                unsafe { std::ptr::write_bytes(slot.cast::<u8>(), 0, size) };
            }
        }
        Ok(())
    })
}

/// The device of a valid pool handle (`CUDA_ERROR_INVALID_VALUE` otherwise).
fn check_pool(pool: CUmemoryPool) -> R<usize> {
    require_init()?;
    pool_device(pool as u64).ok_or(CUDA_ERROR_INVALID_VALUE)
}

/// Creates a pool of device memory on the emulated device (`allocType` pinned, location
/// the device, no handle types), owned by the current context (the primary context when
/// none is current): its reset or destruction destroys the pool too. Limitation: every
/// pool shares the default pool's accounting (its reserve, release threshold and high
/// marks); pool handles are checked.
///
/// # Safety
/// `pool` must be NULL or valid for a write, `poolProps` NULL or valid for a read.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    poolProps: *const cudarc::driver::sys::CUmemPoolProps,
) -> CUresult {
    api("cuMemPoolCreate", || {
        require_init()?;
        if poolProps.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-NULL, the caller's pointer to the properties.
        let props = unsafe { &*poolProps };
        use cudarc::driver::sys::{
            CUmemAllocationHandleType, CUmemAllocationType, CUmemLocationType,
        };
        if props.allocType != CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
            || props.handleTypes != CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
            || props.location.type_ != CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
            || check_device(props.location.id).is_err()
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let handle = DEFAULT_POOL + 0x10 * n;
        let dev = props.location.id as usize;
        // Owned by the device's primary context (the current context when it is that).
        let owner = match current_context_any() {
            Ok(ctx) if ctx.device() == dev => ctx.handle(),
            _ => lock(&driver().primary[dev])
                .handle
                .ok_or(CUDA_ERROR_INVALID_CONTEXT)?,
        };
        lock(&driver().mem.pools).push((handle, owner, dev));
        // SAFETY: the caller's out-pointer.
        unsafe { out(pool, handle as CUmemoryPool) }
    })
}

/// Destroys a pool made with [`cuMemPoolCreate`] (the default pool cannot be).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    api("cuMemPoolDestroy", || {
        require_init()?;
        let mut created = lock(&driver().mem.pools);
        let at = created
            .iter()
            .position(|&(p, _, _)| p == pool as u64)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        created.remove(at);
        Ok(())
    })
}

/// Releases the pool's unused memory until it holds at most `minBytesToKeep`.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolTrimTo(pool: CUmemoryPool, minBytesToKeep: usize) -> CUresult {
    api("cuMemPoolTrimTo", || {
        let dev = check_pool(pool)?;
        driver().mem.trim_pool(dev, minBytesToKeep as u64);
        Ok(())
    })
}

/// Sets a pool attribute (reuse flags, release threshold, resets of the high marks).
///
/// # Safety
/// `value` must point to the attribute's type (`int` or `cuuint64_t`).
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolSetAttribute(
    pool: CUmemoryPool,
    attr: CUmemPool_attribute,
    value: *mut c_void,
) -> CUresult {
    api("cuMemPoolSetAttribute", || {
        let dev = check_pool(pool)?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let attr = attr as u32;
        let (v32, v64) = if (1..=3).contains(&attr) {
            // SAFETY: for the reuse attributes `value` points to an `int`.
            (unsafe { value.cast::<i32>().read() }, 0)
        } else {
            // SAFETY: for the other attributes `value` points to a `cuuint64_t`.
            (0, unsafe { value.cast::<u64>().read() })
        };
        if (1..=3).contains(&attr) {
            driver()
                .mem
                .set_reuse_flag(pool as u64, attr as usize - 1, v32);
            return Ok(());
        }
        let mut a = driver().mem.acct(dev);
        match attr {
            4 => a.pool_threshold = v64,
            6 if v64 == 0 => a.reserved_high = a.pool_used + a.pool_free,
            8 if v64 == 0 => a.used_high = a.pool_used,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        }
        Ok(())
    })
}

/// Reads a pool attribute.
///
/// # Safety
/// `value` must point to the attribute's type (`int` or `cuuint64_t`).
#[no_mangle]
pub unsafe extern "C" fn cuMemPoolGetAttribute(
    pool: CUmemoryPool,
    attr: CUmemPool_attribute,
    value: *mut c_void,
) -> CUresult {
    api("cuMemPoolGetAttribute", || {
        let dev = check_pool(pool)?;
        let flags = driver().mem.reuse_flags(pool as u64);
        let a = driver().mem.acct(dev);
        // SAFETY: (every write below) `value` is the caller's out-pointer for the
        // attribute's type.
        unsafe {
            match attr as u32 {
                n @ 1..=3 => out(value.cast::<i32>(), flags[n as usize - 1]),
                4 => out(value.cast::<u64>(), a.pool_threshold),
                5 => out(value.cast::<u64>(), a.pool_used + a.pool_free),
                6 => out(value.cast::<u64>(), a.reserved_high),
                7 => out(value.cast::<u64>(), a.pool_used),
                8 => out(value.cast::<u64>(), a.used_high),
                _ => Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
    })
}

// ------------------------------------------------------------------------------------
// Copies and memsets
// ------------------------------------------------------------------------------------

/// What one end of a copy may be.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Device-accessible memory: device, pinned or managed (`CUdeviceptr`).
    Device,
    /// A host pointer: pageable, pinned or managed, never device memory.
    Host,
    /// Either (unified addressing: `cuMemcpy`, `cuMemcpyAsync`).
    Any,
}

/// Classifies one end of a copy of `len` (> 0) bytes.
fn endpoint(call: &str, which: &str, p: u64, len: usize, role: Role) -> R<Endpoint> {
    if p == 0 {
        eprintln!("devarrow-emu: {call}: NULL {which}");
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mem = &driver().mem;
    let registered = is_device_address(p) || mem.find(p).is_some();
    if !registered {
        if role == Role::Device {
            eprintln!("devarrow-emu: {call}: the {which} {}", mem.describe(p, len));
            return Err(CUDA_ERROR_ILLEGAL_ADDRESS);
        }
        return Ok(Endpoint::Host(p as usize));
    }
    match mem.find_range(p, len) {
        Ok((a, _)) if !a.usable() => {
            eprintln!(
                "devarrow-emu: {call}: the {which} {p:#x}..{:#x} is in {}, whose free was already requested",
                p + len as u64,
                a.describe()
            );
            Err(CUDA_ERROR_ILLEGAL_ADDRESS)
        }
        Ok((a, _)) if role == Role::Host && a.kind.is_device() => {
            eprintln!(
                "devarrow-emu: {call}: the {which} (a host pointer) is in {}",
                a.describe()
            );
            Err(CUDA_ERROR_INVALID_VALUE)
        }
        Ok((a, offset)) => Ok(Endpoint::Mem(a, offset)),
        Err(why) => {
            eprintln!("devarrow-emu: {call}: the {which} {why}");
            Err(CUDA_ERROR_ILLEGAL_ADDRESS)
        }
    }
}

/// Checks that work of `ctx` may touch `end`: device memory of another device only once
/// `ctx` enabled peer access to it (`cuCtxEnablePeerAccess`), else
/// `CUDA_ERROR_ILLEGAL_ADDRESS`, as on hardware where that memory is not mapped into the
/// device's address space. Host memory (pinned, managed, pageable) is reachable from
/// every device.
fn reachable(call: &str, which: &str, end: &Endpoint, ctx: &Context) -> R {
    match end {
        Endpoint::Mem(a, _)
            if a.kind.is_device() && (ctx.accessible_devices() >> a.device) & 1 == 0 =>
        {
            eprintln!(
                "devarrow-emu: {call}: the {which} is in {}, memory of device {}, and the \
                 context of device {} has no peer access to it (cuCtxEnablePeerAccess)",
                a.describe(),
                a.device,
                ctx.device()
            );
            Err(CUDA_ERROR_ILLEGAL_ADDRESS)
        }
        _ => Ok(()),
    }
}

/// Every copy: checks both ends now, stages a pageable source now (as the driver does),
/// enqueues the copy, and returns once it ran when `sync` or when the destination is
/// pageable host memory.
#[allow(clippy::too_many_arguments)]
fn copy(
    call: &'static str,
    dst: u64,
    dst_role: Role,
    src: u64,
    src_role: Role,
    len: usize,
    stream: CUstream,
    sync: bool,
) -> R {
    copy_between(call, dst, dst_role, src, src_role, len, stream, sync, false)
}

/// [`copy`], where `peer` (a `cuMemcpyPeerAsync`) lets the ends be memory of any device:
/// the driver then stages the copy itself, with or without peer access.
#[allow(clippy::too_many_arguments)]
fn copy_between(
    call: &'static str,
    dst: u64,
    dst_role: Role,
    src: u64,
    src_role: Role,
    len: usize,
    stream: CUstream,
    sync: bool,
    peer: bool,
) -> R {
    let ctx = current_context()?;
    let stream = ctx.stream(stream as u64)?;
    if len == 0 {
        return Ok(());
    }
    inject(call, CUDA_ERROR_OUT_OF_MEMORY)?;
    let dst = endpoint(call, "destination", dst, len, dst_role)?;
    if !peer {
        reachable(call, "destination", &dst, &ctx)?;
    }
    let src = endpoint(call, "source", src, len, src_role)?;
    if !peer {
        reachable(call, "source", &src, &ctx)?;
    }
    let src = match src {
        Endpoint::Host(p) => {
            let mut staged = vec![0u8; len];
            // SAFETY: the caller guarantees `len` readable bytes at the source host
            // pointer for the duration of the call.
            unsafe { std::ptr::copy_nonoverlapping(p as *const u8, staged.as_mut_ptr(), len) };
            Endpoint::Staged(staged)
        }
        other => other,
    };
    let wait = sync || matches!(dst, Endpoint::Host(_));
    ctx.submit(
        &stream,
        Op::Copy {
            dst,
            src,
            len,
            call,
        },
        wait,
    )
}

/// Copies between any two addresses (unified addressing), synchronously.
///
/// # Safety
/// Host ranges must be valid for `ByteCount` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpy(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    ByteCount: usize,
) -> CUresult {
    api("cuMemcpy", || {
        copy(
            "cuMemcpy",
            dst,
            Role::Any,
            src,
            Role::Any,
            ByteCount,
            std::ptr::null_mut(),
            true,
        )
    })
}

/// Copies between any two addresses (unified addressing) on `hStream`.
///
/// # Safety
/// Host ranges must be valid for `ByteCount` bytes until the copy has run.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemcpyAsync", || {
        copy(
            "cuMemcpyAsync",
            dst,
            Role::Any,
            src,
            Role::Any,
            ByteCount,
            hStream,
            false,
        )
    })
}

/// Host to device, synchronous.
///
/// # Safety
/// `srcHost` must be valid for `ByteCount` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dstDevice: CUdeviceptr,
    srcHost: *const c_void,
    ByteCount: usize,
) -> CUresult {
    api("cuMemcpyHtoD_v2", || {
        copy(
            "cuMemcpyHtoD_v2",
            dstDevice,
            Role::Device,
            srcHost as u64,
            Role::Host,
            ByteCount,
            std::ptr::null_mut(),
            true,
        )
    })
}

/// Host to device on `hStream`: a pageable source is read during the call, a pinned
/// one when the copy runs.
///
/// # Safety
/// `srcHost` must be valid for `ByteCount` bytes (until the copy ran, if pinned).
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dstDevice: CUdeviceptr,
    srcHost: *const c_void,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemcpyHtoDAsync_v2", || {
        copy(
            "cuMemcpyHtoDAsync_v2",
            dstDevice,
            Role::Device,
            srcHost as u64,
            Role::Host,
            ByteCount,
            hStream,
            false,
        )
    })
}

/// Device to host, synchronous.
///
/// # Safety
/// `dstHost` must be valid for `ByteCount` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dstHost: *mut c_void,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
) -> CUresult {
    api("cuMemcpyDtoH_v2", || {
        copy(
            "cuMemcpyDtoH_v2",
            dstHost as u64,
            Role::Host,
            srcDevice,
            Role::Device,
            ByteCount,
            std::ptr::null_mut(),
            true,
        )
    })
}

/// Device to host on `hStream`: into pageable memory it completes before returning,
/// into pinned memory it runs asynchronously.
///
/// # Safety
/// `dstHost` must be valid for `ByteCount` bytes of writes (until the copy ran).
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dstHost: *mut c_void,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemcpyDtoHAsync_v2", || {
        copy(
            "cuMemcpyDtoHAsync_v2",
            dstHost as u64,
            Role::Host,
            srcDevice,
            Role::Device,
            ByteCount,
            hStream,
            false,
        )
    })
}

/// Device to device, synchronous.
///
/// # Safety
/// None beyond the driver API's (both ends are checked device addresses).
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(
    dstDevice: CUdeviceptr,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
) -> CUresult {
    api("cuMemcpyDtoD_v2", || {
        copy(
            "cuMemcpyDtoD_v2",
            dstDevice,
            Role::Device,
            srcDevice,
            Role::Device,
            ByteCount,
            std::ptr::null_mut(),
            true,
        )
    })
}

/// Device to device on `hStream`.
///
/// # Safety
/// None beyond the driver API's (both ends are checked device addresses).
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoDAsync_v2(
    dstDevice: CUdeviceptr,
    srcDevice: CUdeviceptr,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemcpyDtoDAsync_v2", || {
        copy(
            "cuMemcpyDtoDAsync_v2",
            dstDevice,
            Role::Device,
            srcDevice,
            Role::Device,
            ByteCount,
            hStream,
            false,
        )
    })
}

/// The context a `CUcontext` argument names (`CUDA_ERROR_INVALID_CONTEXT` for NULL or
/// anything that is not a live context).
fn named_context(ctx: CUcontext) -> R<Arc<Context>> {
    match driver().get(ctx as u64) {
        Some(Object::Context(c)) => Ok(c),
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    }
}

/// Checks that `p..p + len` is device memory of `ctx` (`CUDA_ERROR_INVALID_VALUE` for
/// memory of another context, or pinned/managed memory: a peer copy names device
/// memory and its context).
fn check_peer_end(call: &str, which: &str, p: u64, len: usize, ctx: &Context) -> R {
    match driver().mem.find(p) {
        Some(a) if a.kind.is_device() && a.ctx == ctx.handle() => Ok(()),
        Some(a) => {
            eprintln!(
                "devarrow-emu: {call}: the {which} is in {}, not device memory of context {:#x}",
                a.describe(),
                ctx.handle()
            );
            Err(CUDA_ERROR_INVALID_VALUE)
        }
        // Not in any allocation: the range check of the copy reports it.
        None => endpoint(call, which, p, len.max(1), Role::Device).map(|_| ()),
    }
}

/// Copies device memory of one context to device memory of another on `hStream`
/// (`cuMemcpyPeerAsync`): asynchronous, ordered on `hStream` (a stream of the current
/// context; NULL is its legacy stream). Between the contexts of two devices it needs no
/// peer access: the driver stages the copy through host memory where the devices cannot
/// reach each other ("Copies from device memory in one context to device memory in
/// another context", CUDA driver API, `cuMemcpyPeerAsync`, which names no peer-access
/// error; CUDA programming guide, "Peer-to-Peer Memory Copy": between two devices'
/// memories a copy works whether peer access is enabled or not, it is only faster when
/// it is), so the emulator copies whatever `cuDeviceCanAccessPeer` and
/// `cuCtxEnablePeerAccess` say. Within one context it is a device-to-device copy.
///
/// Checked as the driver documents: `cuInit`, a current context (for the stream), both
/// contexts live (`CUDA_ERROR_INVALID_CONTEXT` otherwise: NULL included), each pointer
/// device memory of its context (`CUDA_ERROR_INVALID_VALUE`), both ranges inside one
/// allocation (`CUDA_ERROR_ILLEGAL_ADDRESS`, as every copy here); 0 bytes is a no-op
/// after those checks.
///
/// # Safety
/// None beyond the driver API's (both ends are checked device addresses).
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dstDevice: CUdeviceptr,
    dstContext: CUcontext,
    srcDevice: CUdeviceptr,
    srcContext: CUcontext,
    ByteCount: usize,
    hStream: CUstream,
) -> CUresult {
    const CALL: &str = "cuMemcpyPeerAsync";
    api(CALL, || {
        current_context()?;
        let (dst_ctx, src_ctx) = (named_context(dstContext)?, named_context(srcContext)?);
        dst_ctx.shared.sticky()?;
        src_ctx.shared.sticky()?;
        if ByteCount == 0 {
            return Ok(());
        }
        check_peer_end(CALL, "destination", dstDevice, ByteCount, &dst_ctx)?;
        check_peer_end(CALL, "source", srcDevice, ByteCount, &src_ctx)?;
        copy_between(
            CALL,
            dstDevice,
            Role::Device,
            srcDevice,
            Role::Device,
            ByteCount,
            hStream,
            false,
            true,
        )
    })
}

/// Whether [`cuMemcpyBatchAsync`] is available: 0 as `DEVARROW_EMU_NO_BATCH_COPY`
/// says (unavailable when it is `1`), 1 available, 2 unavailable.
static BATCH_COPY: AtomicU8 = AtomicU8::new(0);

fn batch_copy_available() -> bool {
    match BATCH_COPY.load(AtomicOrdering::Acquire) {
        1 => true,
        2 => false,
        _ => std::env::var("DEVARROW_EMU_NO_BATCH_COPY").as_deref() != Ok("1"),
    }
}

/// Makes [`cuMemcpyBatchAsync`] available (`available > 0`) or not (`0`: every call
/// returns `CUDA_ERROR_NOT_SUPPORTED`, as a driver without it would, not reported as an
/// API error), or, with a negative value, as `DEVARROW_EMU_NO_BATCH_COPY=1` says (the
/// default: available unless it is set). Not a CUDA symbol: tests find it with `dlsym`,
/// and skip where it is missing (a real driver).
#[no_mangle]
pub extern "C" fn devarrow_emu_set_batch_copy(available: std::ffi::c_int) {
    let state = match available {
        a if a > 0 => 1,
        0 => 2,
        _ => 0,
    };
    BATCH_COPY.store(state, AtomicOrdering::Release);
}

/// `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`, the one copy flag.
const MEMCPY_FLAGS: u32 = 0x1;

/// Many copies in one call (CUDA 12.8, the signature of the 12.x headers, which CUDA 13
/// keeps exporting under this name; its `cuMemcpyBatchAsync_v2` drops `failIdx`).
///
/// Checked as the driver documents: a created stream (the legacy NULL stream is
/// `CUDA_ERROR_INVALID_VALUE`), `count > 0` copies, `1 <= numAttrs <= count` attribute
/// sets whose `attrsIdxs` start at 0 and increase, each with a valid source access order
/// and flags; every end of every copy checked as [`cuMemcpyAsync`] checks them (a bad
/// one sets `*failIdx` to its index; any other failure sets it to `SIZE_MAX`). The
/// copies run as one stream operation, in no particular order (the emulator runs them
/// last to first, so a batch whose copies depend on each other shows it). A pageable
/// source is read when the batch runs, except with
/// `CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL`, where it is read during the call.
///
/// `DEVARROW_EMU_NO_BATCH_COPY=1` (or [`devarrow_emu_set_batch_copy`]) makes it return
/// `CUDA_ERROR_NOT_SUPPORTED`, as a driver without it would; a restricted runtime
/// (`DEVARROW_EMU_RESTRICTED=1`) `CUDA_ERROR_NOT_PERMITTED` (reported as an API error).
///
/// # Safety
/// `dsts`, `srcs` and `sizes` must hold `count` entries, `attrs` and `attrsIdxs`
/// `numAttrs`; `failIdx` must be NULL or valid for a write; host ranges must stay valid
/// until the batch has run.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuMemcpyBatchAsync(
    dsts: *mut CUdeviceptr,
    srcs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    attrs: *mut CUmemcpyAttributes,
    attrsIdxs: *mut usize,
    numAttrs: usize,
    failIdx: *mut usize,
    hStream: CUstream,
) -> CUresult {
    const CALL: &str = "cuMemcpyBatchAsync";
    api(CALL, || {
        if !failIdx.is_null() {
            // SAFETY: the caller's out-pointer (non-NULL).
            unsafe { failIdx.write(usize::MAX) };
        }
        let ctx = current_context()?;
        if config_restricted() {
            // A sandbox refuses what its filter does not know (CUDA 12.8's batched copy
            // included) with NOT_PERMITTED, not NOT_SUPPORTED.
            return Err(CUDA_ERROR_NOT_PERMITTED);
        }
        if !batch_copy_available() {
            return simulated(CUDA_ERROR_NOT_SUPPORTED);
        }
        let stream = ctx.stream(hStream as u64)?;
        if stream.legacy {
            eprintln!("devarrow-emu: {CALL}: the legacy NULL stream is not accepted");
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if count == 0
            || dsts.is_null()
            || srcs.is_null()
            || sizes.is_null()
            || attrs.is_null()
            || attrsIdxs.is_null()
            || numAttrs == 0
            || numAttrs > count
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's arrays of `count` and `numAttrs` entries (non-NULL).
        let (dsts, srcs, sizes, attrs, starts) = unsafe {
            (
                std::slice::from_raw_parts(dsts, count),
                std::slice::from_raw_parts(srcs, count),
                std::slice::from_raw_parts(sizes, count),
                std::slice::from_raw_parts(attrs, numAttrs),
                std::slice::from_raw_parts(attrsIdxs, numAttrs),
            )
        };
        if starts[0] != 0
            || starts.windows(2).any(|w| w[0] >= w[1])
            || starts[numAttrs - 1] >= count
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        use CUmemcpySrcAccessOrder::*;
        for a in attrs {
            let order_ok = matches!(
                a.srcAccessOrder,
                CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                    | CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL
                    | CU_MEMCPY_SRC_ACCESS_ORDER_ANY
            );
            if !order_ok || a.flags & !MEMCPY_FLAGS != 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        inject(CALL, CUDA_ERROR_OUT_OF_MEMORY)?;
        let mut copies = Vec::with_capacity(count);
        for i in 0..count {
            let attr = &attrs[starts.partition_point(|&s| s <= i) - 1];
            let len = sizes[i];
            if len == 0 {
                continue;
            }
            let ends = endpoint(CALL, "destination", dsts[i], len, Role::Any).and_then(|dst| {
                let src = match endpoint(CALL, "source", srcs[i], len, Role::Any)? {
                    Endpoint::Host(p)
                        if attr.srcAccessOrder == CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL =>
                    {
                        let mut staged = vec![0u8; len];
                        // SAFETY: the caller guarantees `len` readable bytes at the host
                        // source, for the call at least.
                        unsafe {
                            std::ptr::copy_nonoverlapping(p as *const u8, staged.as_mut_ptr(), len)
                        };
                        Endpoint::Staged(staged)
                    }
                    other => other,
                };
                reachable(CALL, "destination", &dst, &ctx)?;
                reachable(CALL, "source", &src, &ctx)?;
                Ok((dst, src, len))
            });
            match ends {
                Ok(copy) => copies.push(copy),
                Err(e) => {
                    if !failIdx.is_null() {
                        // SAFETY: the caller's out-pointer (non-NULL).
                        unsafe { failIdx.write(i) };
                    }
                    return Err(e);
                }
            }
        }
        copies.reverse();
        ctx.submit(&stream, Op::CopyBatch { copies, call: CALL }, false)
    })
}

fn memset(
    call: &'static str,
    dst: u64,
    pattern: [u8; 4],
    elem: usize,
    count: usize,
    stream: CUstream,
    sync: bool,
) -> R {
    let ctx = current_context()?;
    let stream = ctx.stream(stream as u64)?;
    if count == 0 {
        return Ok(());
    }
    if !dst.is_multiple_of(elem as u64) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let len = count.checked_mul(elem).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    // The "synchronous" memsets are asynchronous with respect to the host except into
    // pinned host memory (the driver API's synchronization rules): device and managed
    // targets are only enqueued on the legacy stream, so code that reads or writes them
    // right after such a memset without synchronizing sees the race here too.
    let wait = sync
        && driver()
            .mem
            .find(dst)
            .is_some_and(|a| matches!(a.kind, Kind::Pinned { .. }));
    let dst = endpoint(call, "destination", dst, len, Role::Device)?;
    reachable(call, "destination", &dst, &ctx)?;
    if sync {
        // "A device memory set" (CUDA C++ Programming Guide, "Implicit
        // Synchronization"): the synchronous memsets order every stream, not only the
        // blocking ones the legacy stream waits for.
        ctx.barrier();
        sync::count(call);
    }
    ctx.submit(
        &stream,
        Op::Memset {
            dst,
            pattern,
            elem,
            count,
            call,
        },
        wait,
    )
}

/// Sets `N` bytes to `uc` on the legacy stream; waits only for pinned host memory.
///
/// # Safety
/// None beyond the driver API's (the range is checked).
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8_v2(dstDevice: CUdeviceptr, uc: c_uchar, N: usize) -> CUresult {
    api("cuMemsetD8_v2", || {
        memset(
            "cuMemsetD8_v2",
            dstDevice,
            [uc, 0, 0, 0],
            1,
            N,
            std::ptr::null_mut(),
            true,
        )
    })
}

/// Sets `N` bytes to `uc` on `hStream`.
///
/// # Safety
/// None beyond the driver API's (the range is checked).
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD8Async(
    dstDevice: CUdeviceptr,
    uc: c_uchar,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemsetD8Async", || {
        memset(
            "cuMemsetD8Async",
            dstDevice,
            [uc, 0, 0, 0],
            1,
            N,
            hStream,
            false,
        )
    })
}

/// Sets `N` 16-bit values on the legacy stream; waits only for pinned host memory.
///
/// # Safety
/// None beyond the driver API's (the range is checked).
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16_v2(
    dstDevice: CUdeviceptr,
    us: c_ushort,
    N: usize,
) -> CUresult {
    api("cuMemsetD16_v2", || {
        let b = us.to_ne_bytes();
        memset(
            "cuMemsetD16_v2",
            dstDevice,
            [b[0], b[1], 0, 0],
            2,
            N,
            std::ptr::null_mut(),
            true,
        )
    })
}

/// Sets `N` 16-bit values on `hStream`.
///
/// # Safety
/// None beyond the driver API's (the range is checked).
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD16Async(
    dstDevice: CUdeviceptr,
    us: c_ushort,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemsetD16Async", || {
        let b = us.to_ne_bytes();
        memset(
            "cuMemsetD16Async",
            dstDevice,
            [b[0], b[1], 0, 0],
            2,
            N,
            hStream,
            false,
        )
    })
}

/// Sets `N` 32-bit values on the legacy stream; waits only for pinned host memory.
///
/// # Safety
/// None beyond the driver API's (the range is checked).
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32_v2(dstDevice: CUdeviceptr, ui: c_uint, N: usize) -> CUresult {
    api("cuMemsetD32_v2", || {
        memset(
            "cuMemsetD32_v2",
            dstDevice,
            ui.to_ne_bytes(),
            4,
            N,
            std::ptr::null_mut(),
            true,
        )
    })
}

/// Sets `N` 32-bit values on `hStream`.
///
/// # Safety
/// None beyond the driver API's (the range is checked).
#[no_mangle]
pub unsafe extern "C" fn cuMemsetD32Async(
    dstDevice: CUdeviceptr,
    ui: c_uint,
    N: usize,
    hStream: CUstream,
) -> CUresult {
    api("cuMemsetD32Async", || {
        memset(
            "cuMemsetD32Async",
            dstDevice,
            ui.to_ne_bytes(),
            4,
            N,
            hStream,
            false,
        )
    })
}
