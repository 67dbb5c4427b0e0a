//! [`Event`]: a `CUevent` devarrow creates itself, with any combination of
//! `CU_EVENT_*` flags, for the sync events of a [`CudaDevice`](crate::CudaDevice).
//!
//! cudarc's [`CudaEvent`](cudarc::driver::CudaEvent) takes its flags as the enum
//! `CUevent_flags`, one flag at a time, so it cannot make an event that both blocks the
//! waiting host thread (`CU_EVENT_BLOCKING_SYNC`) and skips timing
//! (`CU_EVENT_DISABLE_TIMING`, cheaper to record), which
//! [`HostWait::Block`](crate::HostWait::Block) wants. This type makes the raw `cuEventCreate` call (through
//! [`crate::driver`]) and destroys the event on drop with its context bound.

use std::ffi::c_uint;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream};

use crate::context::{self, ContextGuard};
use crate::driver;
use crate::error::Result;

/// A `CUevent` of one context, destroyed when dropped (the context bound for that, and
/// the thread's current context restored).
#[derive(Debug)]
pub(crate) struct Event {
    cu_event: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUevent handle may be used from any thread; every use binds its context
// first.
unsafe impl Send for Event {}
// SAFETY: as above; shared access only passes the handle to thread-safe driver calls.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event of `ctx` with the `CU_EVENT_*` bits `flags`.
    pub(crate) fn create(ctx: &Arc<CudaContext>, flags: c_uint) -> Result<Self> {
        context::bind(ctx)?;
        Ok(Self {
            cu_event: driver::event_create(flags)?,
            ctx: ctx.clone(),
        })
    }

    /// Records the event at the current end of `stream` (a stream of the event's
    /// context).
    pub(crate) fn record(&self, stream: &CudaStream) -> Result<()> {
        context::bind(&self.ctx)?;
        // SAFETY: the event is live (owned) and its context, the stream's, is bound.
        unsafe { driver::event_record(self.cu_event, stream.cu_stream()) }
    }

    /// Blocks until the work before the event has completed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        context::bind(&self.ctx)?;
        // SAFETY: the event is live (owned).
        unsafe { driver::event_synchronize(self.cu_event) }
    }

    /// Whether the work before the event has completed, without waiting.
    pub(crate) fn is_complete(&self) -> Result<bool> {
        context::bind(&self.ctx)?;
        // SAFETY: the event is live (owned).
        unsafe { driver::event_query(self.cu_event) }
    }

    /// The handle (owned by this value: do not destroy it).
    pub(crate) fn cu_event(&self) -> sys::CUevent {
        self.cu_event
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; without the context bound the event
        // leaks rather than being destroyed in the wrong context.
        if let Ok(_bound) = ContextGuard::enter(&self.ctx) {
            // SAFETY: the event is live and destroyed exactly once, here.
            let _ = unsafe { driver::event_destroy(self.cu_event) };
        }
    }
}
