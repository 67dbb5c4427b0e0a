//! Making a context current on the calling thread, and synchronizing, without cudarc's
//! stored-error check.
//!
//! cudarc's `CudaContext::bind_to_thread` (and so `CudaStream::synchronize` and
//! `CudaEvent::synchronize`) first returns, and clears, an error that an earlier drop
//! recorded on the context (`record_err`), *without* binding or synchronizing. A drop that
//! then records that error again would make every later cleanup skip its binding and its
//! synchronization: a consumer's release could free memory a kernel still reads. devarrow
//! therefore binds with `cuCtxSetCurrent` itself, synchronizes with the plain driver calls,
//! and never records errors on the shared context.
//!
//! Drops and `release` callbacks, which run on threads that may be doing CUDA work of their
//! own (another device, another context), bind through a [`ContextGuard`], which makes the
//! caller's current context current again when it is dropped.

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use crate::driver;
use crate::error::Result;

/// Makes `ctx` current on the calling thread (no-op if it already is); the previous
/// current context is not restored.
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    if driver::ctx_get_current()? != Some(ctx.cu_ctx()) {
        // SAFETY: `ctx` is a live context (we hold a reference), so its handle is valid.
        unsafe { driver::ctx_set_current(ctx.cu_ctx()) }?;
    }
    Ok(())
}

/// Makes `stream` wait (on the device: the host is not blocked) for `event`, binding the
/// stream's context first.
///
/// # Safety
/// `event` must be a live `CUevent` (one the driver may still be recording is fine).
pub(crate) unsafe fn stream_wait_event(stream: &CudaStream, event: sys::CUevent) -> Result<()> {
    bind(stream.context())?;
    // SAFETY: the stream is live (borrowed) and its context bound; the event is live
    // (the caller's guarantee).
    unsafe { driver::stream_wait_event(stream.cu_stream(), event) }
}

/// Blocks until all work queued on `stream` has completed.
pub(crate) fn sync_stream(stream: &CudaStream) -> Result<()> {
    bind(stream.context())?;
    // SAFETY: the stream is live (borrowed) and belongs to the context bound above.
    unsafe { driver::stream_synchronize(stream.cu_stream()) }
}

/// Blocks until `event` has completed.
pub(crate) fn sync_event(event: &CudaEvent) -> Result<()> {
    bind(event.context())?;
    // SAFETY: the event is live (borrowed) and belongs to the context bound above.
    unsafe { driver::event_synchronize(event.cu_event()) }
}

/// A context made current for a scope: dropping the guard makes the thread's previous
/// current context (possibly none) current again.
pub(crate) struct ContextGuard {
    /// The context to restore, when binding changed it.
    previous: Option<sys::CUcontext>,
}

impl ContextGuard {
    /// Makes `ctx` current until the guard drops.
    pub(crate) fn enter(ctx: &CudaContext) -> Result<Self> {
        let previous = driver::ctx_get_current()?;
        if previous == Some(ctx.cu_ctx()) {
            return Ok(Self { previous: None });
        }
        // SAFETY: `ctx` is a live context (we hold a reference), so its handle is valid.
        unsafe { driver::ctx_set_current(ctx.cu_ctx()) }?;
        Ok(Self {
            previous: Some(previous.unwrap_or(std::ptr::null_mut())),
        })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: `previous` was current on this thread when the guard was made (or
            // NULL, which unbinds); a context current on a thread is one the thread's owner
            // keeps alive while it uses it.
            let _ = unsafe { driver::ctx_set_current(previous) };
        }
    }
}

/// A cudarc object whose drop binds its context (and leaves it bound).
pub(crate) trait InContext {
    /// The context the object's drop binds.
    fn bound_context(&self) -> &CudaContext;
}

impl InContext for CudaEvent {
    fn bound_context(&self) -> &CudaContext {
        self.context()
    }
}

impl InContext for std::sync::Arc<CudaStream> {
    fn bound_context(&self) -> &CudaContext {
        self.context()
    }
}

impl InContext for std::sync::Arc<CudaContext> {
    fn bound_context(&self) -> &CudaContext {
        self
    }
}

/// Holds a cudarc object and drops it with its context bound through a [`ContextGuard`],
/// so that dropping it (on whatever thread the last owner drops, a consumer's thread
/// releasing an array, say) leaves that thread's current context as it was.
pub(crate) struct DropInContext<T: InContext>(std::mem::ManuallyDrop<T>);

impl<T: InContext> DropInContext<T> {
    /// Wraps `value`.
    pub(crate) fn new(value: T) -> Self {
        Self(std::mem::ManuallyDrop::new(value))
    }
}

impl<T: InContext + std::fmt::Debug> std::fmt::Debug for DropInContext<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (*self.0).fmt(f)
    }
}

impl<T: InContext> std::ops::Deref for DropInContext<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: InContext> Drop for DropInContext<T> {
    fn drop(&mut self) {
        let _bound = ContextGuard::enter(self.0.bound_context());
        // SAFETY: the value is dropped exactly once, here, and never used afterwards.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.0) };
    }
}

/// The handle of the per-thread default stream (`CU_STREAM_PER_THREAD`, cudarc's
/// `CudaContext::per_thread_stream`).
const PER_THREAD_STREAM: usize = 0x2;

/// Refuses the per-thread default stream where devarrow keeps a stream to use later:
/// that handle names the stream of whichever thread uses it, and devarrow frees memory
/// and waits on it from the thread that drops or releases (often another one), which
/// would order the work on the wrong stream.
pub(crate) fn check_keepable(stream: &CudaStream, what: &str) -> crate::Result<()> {
    if stream.cu_stream() as usize == PER_THREAD_STREAM {
        return Err(crate::CudaError::InvalidArgument(format!(
            "{what}: the per-thread default stream (CU_STREAM_PER_THREAD) names another \
             stream on every thread, and devarrow uses this stream later, possibly from \
             another thread; pass a created stream (or the legacy default stream)"
        )));
    }
    Ok(())
}
