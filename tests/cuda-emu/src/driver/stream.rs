//! Streams, events and host functions.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;

use cudarc::driver::sys::{CUcontext, CUevent, CUhostFn, CUresult, CUstream, CUstreamCallback};

use super::common::*;
use super::queue::{Event, Op, Stream};
use super::state::*;

/// `CU_STREAM_NON_BLOCKING`.
const NON_BLOCKING: u32 = 1;

fn create_stream(phStream: *mut CUstream, flags: c_uint, priority: c_int) -> R {
    let ctx = current_context()?;
    if phStream.is_null() || flags & !NON_BLOCKING != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    inject("cuStreamCreate", CUDA_ERROR_OUT_OF_MEMORY)?;
    let d = driver();
    let handle = d.new_handle();
    let stream = Stream::spawn(
        handle,
        ctx.shared.clone(),
        &d.mem,
        flags,
        priority.clamp(-5, 0),
        false,
    );
    lock(&ctx.streams).push(stream.clone());
    d.insert(handle, Object::Stream(stream));
    // SAFETY: the caller's out-pointer (non-NULL).
    unsafe { out(phStream, handle as CUstream) }
}

/// Creates a stream (`CU_STREAM_DEFAULT`: synchronizes with the legacy NULL stream;
/// `CU_STREAM_NON_BLOCKING`: does not). Each stream runs on its own worker thread.
///
/// # Safety
/// `phStream` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(phStream: *mut CUstream, Flags: c_uint) -> CUresult {
    api("cuStreamCreate", || create_stream(phStream, Flags, 0))
}

/// [`cuStreamCreate`] with a priority (recorded, clamped to `[-5, 0]`).
///
/// # Safety
/// `phStream` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    phStream: *mut CUstream,
    flags: c_uint,
    priority: c_int,
) -> CUresult {
    api("cuStreamCreateWithPriority", || {
        create_stream(phStream, flags, priority)
    })
}

/// Destroys a stream: returns at once; work already enqueued still runs.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(hStream: CUstream) -> CUresult {
    api("cuStreamDestroy_v2", || {
        let ctx = current_context_any()?;
        let h = hStream as u64;
        if h <= 2 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let stream = ctx.stream(h)?;
        driver().destroy(h);
        // It stays in the context's list until its worker has run the work enqueued.
        stream.shutdown();
        ctx.shared.sticky()
    })
}

/// Blocks until all work enqueued on the stream has run; returns the context's sticky
/// error. Synchronizing the NULL stream waits for the blocking streams too.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuStreamSynchronize(hStream: CUstream) -> CUresult {
    api("cuStreamSynchronize", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        let seq = if stream.legacy {
            ctx.enqueue(&stream, Op::Nop)
        } else {
            stream.tail()
        };
        stream.wait_seq(seq);
        driver().mem.release_pool_at_sync(ctx.device());
        ctx.shared.sticky()
    })
}

/// `CUDA_SUCCESS` when all work enqueued on the stream has run, else
/// `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuStreamQuery(hStream: CUstream) -> CUresult {
    api("cuStreamQuery", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        if stream.is_done(stream.tail()) {
            ctx.shared.sticky()
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    })
}

/// Makes all future work on `hStream` wait until the work recorded in `hEvent` has run
/// (without blocking the host). An event never recorded is a no-op; re-recording or
/// destroying the event later does not affect the wait.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(
    hStream: CUstream,
    hEvent: CUevent,
    Flags: c_uint,
) -> CUresult {
    api("cuStreamWaitEvent", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        if Flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let event = event(hEvent)?;
        inject("cuStreamWaitEvent", CUDA_ERROR_OUT_OF_MEMORY)?;
        if let Some((on, seq)) = event.wait_point() {
            if !Arc::ptr_eq(&on, &stream) {
                ctx.enqueue(&stream, Op::Wait { stream: on, seq });
            }
        }
        Ok(())
    })
}

/// The stream's flags.
///
/// # Safety
/// `flags` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetFlags(hStream: CUstream, flags: *mut c_uint) -> CUresult {
    api("cuStreamGetFlags", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(flags, stream.flags) }
    })
}

/// The stream's priority.
///
/// # Safety
/// `priority` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetPriority(hStream: CUstream, priority: *mut c_int) -> CUresult {
    api("cuStreamGetPriority", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(priority, stream.priority) }
    })
}

/// The stream's context.
///
/// # Safety
/// `pctx` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(hStream: CUstream, pctx: *mut CUcontext) -> CUresult {
    api("cuStreamGetCtx", || {
        let ctx = match hStream as u64 {
            0..=2 => current_context_any()?,
            h => match driver().get(h) {
                Some(Object::Stream(s)) => match driver().get(s.ctx.handle) {
                    Some(Object::Context(c)) => c,
                    _ => return Err(CUDA_ERROR_CONTEXT_IS_DESTROYED),
                },
                _ => return Err(driver().dead_handle("stream", h)),
            },
        };
        // SAFETY: the caller's out-pointer.
        unsafe { out(pctx, ctx.handle() as CUcontext) }
    })
}

/// Enqueues a host function: it runs on the stream's worker thread, in stream order,
/// where driver calls fail with `CUDA_ERROR_NOT_PERMITTED` (as in CUDA). Not called
/// after a fault.
///
/// # Safety
/// `fn_` must be callable with `userData` once, from another thread.
#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(
    hStream: CUstream,
    fn_: CUhostFn,
    userData: *mut c_void,
) -> CUresult {
    api("cuLaunchHostFunc", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        let f = fn_.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        ctx.enqueue(
            &stream,
            Op::HostFn {
                f,
                data: userData as usize,
            },
        );
        Ok(())
    })
}

/// Enqueues a stream callback (see [`cuLaunchHostFunc`]); `flags` must be 0.
///
/// # Safety
/// `callback` must be callable with these arguments once, from another thread.
#[no_mangle]
pub unsafe extern "C" fn cuStreamAddCallback(
    hStream: CUstream,
    callback: CUstreamCallback,
    userData: *mut c_void,
    flags: c_uint,
) -> CUresult {
    api("cuStreamAddCallback", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        let f = callback.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        ctx.enqueue(
            &stream,
            Op::Callback {
                f,
                stream_handle: hStream as u64,
                data: userData as usize,
            },
        );
        Ok(())
    })
}

// ------------------------------------------------------------------------------------
// Events
// ------------------------------------------------------------------------------------

/// The live event `handle` names; a handle never handed out or already destroyed is
/// fatal ([`Driver::dead_handle`]).
fn event(handle: CUevent) -> R<Arc<Event>> {
    match driver().get(handle as u64) {
        Some(Object::Event(e)) => Ok(e),
        _ => Err(driver().dead_handle("event", handle as u64)),
    }
}

/// Creates an event (`CU_EVENT_DEFAULT`, `BLOCKING_SYNC`, `DISABLE_TIMING`,
/// `INTERPROCESS` flags).
///
/// # Safety
/// `phEvent` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(phEvent: *mut CUevent, Flags: c_uint) -> CUresult {
    api("cuEventCreate", || {
        let ctx = current_context()?;
        if phEvent.is_null() || Flags & !0x7 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        inject("cuEventCreate", CUDA_ERROR_OUT_OF_MEMORY)?;
        let d = driver();
        let handle = d.new_handle();
        d.insert(
            handle,
            Object::Event(Arc::new(Event::new(ctx.handle(), Flags))),
        );
        // SAFETY: the caller's out-pointer (non-NULL).
        unsafe { out(phEvent, handle as CUevent) }
    })
}

fn record(hEvent: CUevent, hStream: CUstream) -> R {
    let ctx = current_context()?;
    let stream = ctx.stream(hStream as u64)?;
    let event = event(hEvent)?;
    if event.ctx != ctx.handle() {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    inject("cuEventRecord", CUDA_ERROR_OUT_OF_MEMORY)?;
    event.record(&stream, |op| ctx.enqueue(&stream, op));
    Ok(())
}

/// Records the event at the current end of `hStream`.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(hEvent: CUevent, hStream: CUstream) -> CUresult {
    api("cuEventRecord", || record(hEvent, hStream))
}

/// [`cuEventRecord`] with flags (only 0 and `CU_EVENT_RECORD_EXTERNAL` are accepted).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuEventRecordWithFlags(
    hEvent: CUevent,
    hStream: CUstream,
    flags: c_uint,
) -> CUresult {
    api("cuEventRecordWithFlags", || {
        if flags & !1 != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        record(hEvent, hStream)
    })
}

/// `CUDA_SUCCESS` if the recorded work has run (or the event was never recorded), else
/// `CUDA_ERROR_NOT_READY`.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(hEvent: CUevent) -> CUresult {
    api("cuEventQuery", || {
        let ctx = current_context()?;
        let event = event(hEvent)?;
        if event.is_complete() {
            ctx.shared.sticky()
        } else {
            Err(CUDA_ERROR_NOT_READY)
        }
    })
}

/// Blocks until the recorded work has run.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(hEvent: CUevent) -> CUresult {
    api("cuEventSynchronize", || {
        let ctx = current_context()?;
        let event = event(hEvent)?;
        event.synchronize();
        driver().mem.release_pool_at_sync(ctx.device());
        ctx.shared.sticky()
    })
}

/// Milliseconds between two completed events (neither created with
/// `CU_EVENT_DISABLE_TIMING`).
///
/// # Safety
/// `pMilliseconds` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(
    pMilliseconds: *mut f32,
    hStart: CUevent,
    hEnd: CUevent,
) -> CUresult {
    api("cuEventElapsedTime", || {
        let ctx = current_context()?;
        let ms = event(hStart)?.elapsed_ms(&*event(hEnd)?)?;
        ctx.shared.sticky()?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(pMilliseconds, ms) }
    })
}

/// The `CU_EVENT_*` flags `event` was created with, or -1 when it is not a live event.
/// Not a CUDA symbol (the driver has no way to read an event's flags back): tests find
/// it with `dlsym`, and skip where it is missing (a real driver).
#[no_mangle]
pub extern "C" fn devarrow_emu_event_flags(event: CUevent) -> i64 {
    catch(|| match driver().get(event as u64) {
        Some(Object::Event(e)) => i64::from(e.flags),
        _ => -1,
    })
    .unwrap_or(-1)
}

/// Destroys an event; waits already enqueued on it are unaffected.
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(hEvent: CUevent) -> CUresult {
    api("cuEventDestroy_v2", || {
        let ctx = current_context_any()?;
        event(hEvent)?;
        driver().destroy(hEvent as u64);
        ctx.shared.sticky()
    })
}
