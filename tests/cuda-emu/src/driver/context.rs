//! The primary context and the per-thread current context.

use std::ffi::{c_int, c_uint};
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{CUcontext, CUdevice, CUfunc_cache, CUlimit, CUresult};

use super::common::*;
use super::state::*;

/// Retains the device's primary context (creating it on first use; a context destroyed
/// by its last release is created anew, with a new handle).
///
/// # Safety
/// `pctx` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    api("cuDevicePrimaryCtxRetain", || {
        require_init()?;
        check_device(dev)?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let handle = driver().retain_primary(dev as usize);
        // SAFETY: the caller's out-pointer (checked non-NULL above).
        unsafe { out(pctx, handle as CUcontext) }
    })
}

/// Releases the primary context; the last release destroys it (waiting for its work,
/// then freeing its memory, streams, events and modules).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    api("cuDevicePrimaryCtxRelease_v2", || {
        require_init()?;
        check_device(dev)?;
        driver().release_primary(dev as usize, false)
    })
}

/// Destroys the primary context whatever its reference count, leaving it inactive until
/// the next retain (see `Driver::release_primary`).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    api("cuDevicePrimaryCtxReset_v2", || {
        require_init()?;
        check_device(dev)?;
        driver().release_primary(dev as usize, true)
    })
}

/// The primary context's flags and whether it is active.
///
/// # Safety
/// `flags` and `active` must be NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    api("cuDevicePrimaryCtxGetState", || {
        require_init()?;
        check_device(dev)?;
        let (f, a) = {
            let p = lock(&driver().primary[dev as usize]);
            (p.flags, i32::from(p.ctx.is_some()))
        };
        // SAFETY: the caller's out-pointers.
        unsafe {
            out(flags, f)?;
            out(active, a)
        }
    })
}

/// Sets the primary context's flags (scheduling flags only).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) -> CUresult {
    api("cuDevicePrimaryCtxSetFlags_v2", || {
        require_init()?;
        check_device(dev)?;
        let mut p = lock(&driver().primary[dev as usize]);
        p.flags = flags;
        if let Some(c) = &p.ctx {
            c.flags.store(flags, Ordering::Relaxed);
        }
        Ok(())
    })
}

/// The calling thread's current context (NULL when none).
///
/// # Safety
/// `pctx` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    api("cuCtxGetCurrent", || {
        require_init()?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(pctx, current_handle() as CUcontext) }
    })
}

/// A context handle may be made current: a live context, or the primary context's
/// handle while it is inactive (after a reset the thread's current-context slot keeps
/// naming it, lupinemachines/lupine#844); calls then fail with
/// `CUDA_ERROR_CONTEXT_IS_DESTROYED` until it is retained again.
fn check_context(handle: u64) -> R {
    match driver().get(handle) {
        Some(Object::Context(_)) => Ok(()),
        _ if driver().is_inactive_primary(handle) => Ok(()),
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    }
}

/// Makes `ctx` current on the calling thread (NULL unbinds).
///
/// # Safety
/// None beyond the driver API's (`ctx` is only looked up).
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    api("cuCtxSetCurrent", || {
        require_init()?;
        let handle = ctx as u64;
        if handle != 0 {
            check_context(handle)?;
        }
        set_current_handle(handle);
        Ok(())
    })
}

/// Pushes `ctx` on the calling thread's context stack.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    api("cuCtxPushCurrent_v2", || {
        require_init()?;
        check_context(ctx as u64)?;
        push_current_handle(ctx as u64);
        Ok(())
    })
}

/// Pops the calling thread's current context.
///
/// # Safety
/// `pctx` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    api("cuCtxPopCurrent_v2", || {
        require_init()?;
        let popped = pop_current_handle().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !pctx.is_null() {
            // SAFETY: the caller's out-pointer (non-NULL).
            unsafe { out(pctx, popped as CUcontext)? };
        }
        Ok(())
    })
}

/// The device of the current context.
///
/// # Safety
/// `device` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    api("cuCtxGetDevice", || {
        let ctx = current_context_any()?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(device, ctx.device() as CUdevice) }
    })
}

/// The unique id of `ctx` (the current context when NULL): a primary context created
/// anew after a reset keeps its handle but gets a new id; while it is inactive (reset,
/// not yet retained again) there is none: `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
///
/// # Safety
/// `id` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetId(ctx: CUcontext, id: *mut std::ffi::c_ulonglong) -> CUresult {
    api("cuCtxGetId", || {
        let ctx = if ctx.is_null() {
            current_context_any()?
        } else {
            match driver().get(ctx as u64) {
                Some(Object::Context(c)) => c,
                _ if driver().is_inactive_primary(ctx as u64) => {
                    return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED)
                }
                _ => return Err(CUDA_ERROR_INVALID_CONTEXT),
            }
        };
        // SAFETY: the caller's out-pointer.
        unsafe { out(id, ctx.shared.id) }
    })
}

/// Blocks until all work of the current context has run; returns its sticky error.
/// A device-wide wait, counted with the implicit ones (see [`super::sync`]).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSynchronize() -> CUresult {
    api("cuCtxSynchronize", || {
        let ctx = current_context()?;
        ctx.drain();
        super::sync::count("cuCtxSynchronize");
        driver().mem.release_pool_at_sync(ctx.device());
        ctx.shared.sticky()
    })
}

/// The current context's flags.
///
/// # Safety
/// `flags` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetFlags(flags: *mut c_uint) -> CUresult {
    api("cuCtxGetFlags", || {
        let ctx = current_context_any()?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(flags, ctx.flags.load(Ordering::Relaxed)) }
    })
}

/// Sets the current context's flags.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetFlags(flags: c_uint) -> CUresult {
    api("cuCtxSetFlags", || {
        let ctx = current_context()?;
        ctx.flags.store(flags, Ordering::Relaxed);
        Ok(())
    })
}

fn default_limit(limit: u32) -> usize {
    match limit {
        0 => 1024,    // STACK_SIZE
        1 => 1 << 20, // PRINTF_FIFO_SIZE
        2 => 8 << 20, // MALLOC_HEAP_SIZE
        3 => 2,       // DEV_RUNTIME_SYNC_DEPTH
        4 => 2048,    // DEV_RUNTIME_PENDING_LAUNCH_COUNT
        5 => 64,      // MAX_L2_FETCH_GRANULARITY
        6 => 0,       // PERSISTING_L2_CACHE_SIZE
        _ => 0,
    }
}

/// A limit of the current context.
///
/// # Safety
/// `pvalue` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetLimit(pvalue: *mut usize, limit: CUlimit) -> CUresult {
    api("cuCtxGetLimit", || {
        let ctx = current_context()?;
        let l = limit as u32;
        let v = lock(&ctx.limits)
            .get(&l)
            .copied()
            .unwrap_or_else(|| default_limit(l));
        // SAFETY: the caller's out-pointer.
        unsafe { out(pvalue, v) }
    })
}

/// Sets a limit of the current context (recorded, otherwise ignored).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetLimit(limit: CUlimit, value: usize) -> CUresult {
    api("cuCtxSetLimit", || {
        let ctx = current_context()?;
        lock(&ctx.limits).insert(limit as u32, value);
        Ok(())
    })
}

/// Stream priorities: least 0, greatest -5 (as on recent GPUs).
///
/// # Safety
/// The pointers must be NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    leastPriority: *mut c_int,
    greatestPriority: *mut c_int,
) -> CUresult {
    api("cuCtxGetStreamPriorityRange", || {
        current_context()?;
        // SAFETY: the caller's out-pointers (each may be NULL).
        unsafe {
            if !leastPriority.is_null() {
                out(leastPriority, 0)?;
            }
            if !greatestPriority.is_null() {
                out(greatestPriority, -5)?;
            }
        }
        Ok(())
    })
}

/// The API version of `ctx` (12.8).
///
/// # Safety
/// `version` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) -> CUresult {
    api("cuCtxGetApiVersion", || {
        require_init()?;
        if !ctx.is_null() {
            check_context(ctx as u64)?;
        } else {
            current_context_any()?;
        }
        // SAFETY: the caller's out-pointer.
        unsafe { out(version, DRIVER_VERSION as c_uint) }
    })
}

/// The current context's cache configuration preference.
///
/// # Safety
/// `pconfig` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCacheConfig(pconfig: *mut CUfunc_cache) -> CUresult {
    api("cuCtxGetCacheConfig", || {
        let ctx = current_context()?;
        let v = match ctx.cache_config.load(Ordering::Relaxed) {
            1 => CUfunc_cache::CU_FUNC_CACHE_PREFER_SHARED,
            2 => CUfunc_cache::CU_FUNC_CACHE_PREFER_L1,
            3 => CUfunc_cache::CU_FUNC_CACHE_PREFER_EQUAL,
            _ => CUfunc_cache::CU_FUNC_CACHE_PREFER_NONE,
        };
        // SAFETY: the caller's out-pointer.
        unsafe { out(pconfig, v) }
    })
}

/// Sets the current context's cache configuration preference (recorded only).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCacheConfig(config: CUfunc_cache) -> CUresult {
    api("cuCtxSetCacheConfig", || {
        let ctx = current_context()?;
        ctx.cache_config.store(config as u32, Ordering::Relaxed);
        Ok(())
    })
}

/// The live context a peer-access call names (`CUDA_ERROR_INVALID_CONTEXT` for NULL, an
/// unknown handle, or an inactive primary context).
fn peer_context(peer: CUcontext) -> R<std::sync::Arc<Context>> {
    match driver().get(peer as u64) {
        Some(Object::Context(c)) => Ok(c),
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    }
}

/// Enables access from the current context to the memory of `peerContext`'s device
/// (`cuCtxEnablePeerAccess`): from then on kernels and copies of the current context may
/// touch that device's memory (before, they fault with `CUDA_ERROR_ILLEGAL_ADDRESS`). The
/// access is one way (enable it from the peer too for the other), and ends when either
/// context is destroyed.
///
/// Errors as documented (CUDA driver API, "Peer Context Memory Access"):
/// `CUDA_ERROR_INVALID_VALUE` when `Flags` is not 0; `CUDA_ERROR_INVALID_CONTEXT` with no
/// current context, an invalid `peerContext`, or `peerContext` the current context;
/// `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED` when `cuDeviceCanAccessPeer` says the current
/// context's device cannot access the peer's (`DEVARROW_EMU_NO_PEER=1`);
/// `CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED` when it is already enabled.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peerContext: CUcontext, Flags: c_uint) -> CUresult {
    api("cuCtxEnablePeerAccess", || {
        let ctx = current_context()?;
        let peer = peer_context(peerContext)?;
        if Flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if peer.handle() == ctx.handle() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        if peer.device() == ctx.device() || super::config::config_no_peer() {
            return Err(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
        }
        let bit = 1u64 << peer.device();
        if ctx.peers.fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            return Err(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    })
}

/// Disables access from the current context to `peerContext`'s memory
/// (`cuCtxDisablePeerAccess`): `CUDA_ERROR_PEER_ACCESS_NOT_ENABLED` when it was not
/// enabled, `CUDA_ERROR_INVALID_CONTEXT` with no current context or an invalid
/// `peerContext` (CUDA driver API, "Peer Context Memory Access").
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peerContext: CUcontext) -> CUresult {
    api("cuCtxDisablePeerAccess", || {
        let ctx = current_context()?;
        let peer = peer_context(peerContext)?;
        let bit = 1u64 << peer.device();
        if peer.handle() == ctx.handle() || ctx.peers.fetch_and(!bit, Ordering::AcqRel) & bit == 0 {
            return Err(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
        }
        Ok(())
    })
}
