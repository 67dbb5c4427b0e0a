//! [`CudaSyncEvent`]: the event a [`CudaDevice`](super::CudaDevice) records on its stream
//! (what an export's `sync_event` points to), and the pool its events come back to for
//! reuse ([`EventPool`]).

use std::ffi::c_void;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaStream};
use devarrow_abi::device::SyncEvent;

use crate::context;
use crate::error::Result;
use crate::event::Event;

/// Events of one device, for reuse: an event whose [`CudaSyncEvent`] dropped has no
/// consumer left (a wait enqueued on it captured its state when it was enqueued), so it
/// may be recorded again.
#[derive(Debug, Default)]
pub(super) struct EventPool {
    pub(super) free: Mutex<Vec<Event>>,
    pub(super) created: AtomicU64,
}

/// At most this many idle events are kept per device.
const MAX_IDLE_EVENTS: usize = 256;

/// A `CUevent` recorded on a [`CudaDevice`](super::CudaDevice)'s stream.
///
/// [`SyncEvent::as_sync_event_ptr`] points to a heap copy of the `CUevent` handle that
/// lives (and stays at the same address) as long as this value, and the event itself is
/// destroyed only when this value drops.
#[derive(Debug)]
pub struct CudaSyncEvent {
    /// Where `sync_event` points: the handle, boxed so its address never changes.
    pub(super) handle: Box<sys::CUevent>,
    /// Always `Some` until dropped (destroyed with its context bound, unless recycled).
    pub(super) event: Option<Event>,
    /// Where the event goes back to when this value drops (else it is destroyed).
    pub(super) recycle: Option<Arc<EventPool>>,
}

impl Drop for CudaSyncEvent {
    fn drop(&mut self) {
        let (Some(event), Some(pool)) = (self.event.take(), self.recycle.take()) else {
            return;
        };
        let mut free = pool.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < MAX_IDLE_EVENTS {
            free.push(event);
        }
    }
}

// SAFETY: `handle` is a copy of the CUevent handle owned by `event` (which is Send and
// Sync); CUDA event handles may be used from any thread, and the box is never
// written after construction.
unsafe impl Send for CudaSyncEvent {}
// SAFETY: as above; shared access only reads the handle and calls thread-safe driver
// functions.
unsafe impl Sync for CudaSyncEvent {}

impl CudaSyncEvent {
    /// Records a new event (`CU_EVENT_DISABLE_TIMING`) on `stream`, after all the work
    /// queued there so far.
    pub fn record(stream: &CudaStream) -> Result<Self> {
        let event = Event::create(
            stream.context(),
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint,
        )?;
        event.record(stream)?;
        Ok(Self {
            handle: Box::new(event.cu_event()),
            event: Some(event),
            recycle: None,
        })
    }

    fn event(&self) -> &Event {
        self.event.as_ref().expect("present until dropped")
    }

    /// Makes `stream` wait (on the GPU, without blocking the host) for this event: work
    /// queued on `stream` afterwards runs after the work before the event.
    pub fn wait_on(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: the event is live: we own it.
        unsafe { context::stream_wait_event(stream, self.cu_event()) }
    }

    /// The `CUevent` handle (do not destroy it).
    pub fn cu_event(&self) -> sys::CUevent {
        *self.handle
    }

    /// Whether the work before the event has completed (`cuEventQuery`), without waiting.
    pub fn is_complete(&self) -> Result<bool> {
        self.event().is_complete()
    }
}

// SAFETY: `wait_host` is `cuEventSynchronize` on an event recorded after the work; the
// pointer is the boxed `CUevent` handle of the event the value owns.
unsafe impl SyncEvent for CudaSyncEvent {
    fn as_sync_event_ptr(&self) -> *mut c_void {
        (&*self.handle as *const sys::CUevent).cast_mut().cast()
    }
    fn wait_host(&self) -> devarrow_abi::Result<()> {
        self.event().synchronize()?;
        Ok(())
    }
}
