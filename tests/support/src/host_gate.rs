//! A stream held by a host function the test releases: the producer of another library
//! that keeps its stream busy (`cuLaunchHostFunc` blocking on a host-side flag), to show
//! that a devarrow call does not wait for the whole device.
//!
//! Unlike a spinning kernel, the gate cannot end early: the stream stays held until the
//! test opens it. A devarrow call that waits for the device while the gate is closed
//! would then wait forever; a watchdog thread opens the gate after a time limit instead
//! and records that it did ([`HostFnGate::opened_by_watchdog`]), so such a test fails
//! ([`HostFnGate::assert_held`]) rather than hangs.

use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result, CudaStream, DriverError};

#[derive(Debug, Default)]
struct State {
    /// The host function has started running (the stream is held from then on).
    entered: bool,
    /// The gate is open: the host function returns.
    open: bool,
    /// The watchdog opened it, at the time limit.
    by_watchdog: bool,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn open(&self, by_watchdog: bool) {
        let mut state = self.lock();
        if !state.open {
            state.open = true;
            state.by_watchdog = by_watchdog;
        }
        self.changed.notify_all();
    }
}

/// A host function enqueued on a stream that blocks the stream until the test opens it
/// (or the watchdog does, at the time limit). Dropping it opens it.
#[derive(Debug)]
pub struct HostFnGate {
    shared: Arc<Shared>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

/// The host function: blocks until the gate opens. It makes no CUDA call (none is
/// permitted in a host function).
unsafe extern "C" fn hold(data: *mut c_void) {
    // SAFETY: `data` is the reference `HostFnGate::close` leaked for this call, reclaimed
    // exactly once here.
    let shared = unsafe { Arc::from_raw(data.cast::<Shared>()) };
    let mut state = shared.lock();
    state.entered = true;
    shared.changed.notify_all();
    while !state.open {
        state = shared
            .changed
            .wait(state)
            .unwrap_or_else(|e| e.into_inner());
    }
}

impl HostFnGate {
    /// Enqueues the gate on `stream` (`cuLaunchHostFunc`): nothing enqueued on `stream`
    /// after it runs until [`HostFnGate::open`], or until `limit` has passed, when a
    /// watchdog thread opens it and records that it did.
    pub fn close(stream: &CudaStream, limit: Duration) -> Result<Self, DriverError> {
        stream.context().bind_to_thread()?;
        let shared = Arc::new(Shared::default());
        let data = Arc::into_raw(shared.clone()).cast_mut().cast::<c_void>();
        // SAFETY: `hold` takes ownership of the one reference leaked into `data`; the
        // stream is live (borrowed) and its context bound.
        let enqueued =
            unsafe { result::stream::launch_host_function(stream.cu_stream(), hold, data) };
        if let Err(e) = enqueued {
            // SAFETY: not enqueued, so `hold` never runs: reclaim its reference.
            drop(unsafe { Arc::from_raw(data.cast_const().cast::<Shared>()) });
            return Err(e);
        }
        let watched = shared.clone();
        let watchdog = std::thread::spawn(move || {
            let deadline = Instant::now() + limit;
            let mut state = watched.lock();
            while !state.open {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    drop(state);
                    eprintln!(
                        "HostFnGate: opened by the watchdog after {limit:?}: something waited \
                         for the held stream"
                    );
                    watched.open(true);
                    return;
                }
                state = watched
                    .changed
                    .wait_timeout(state, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        });
        Ok(Self {
            shared,
            watchdog: Some(watchdog),
        })
    }

    /// Blocks until the host function runs (the stream reached the gate, so from now on
    /// it is held), or the gate was opened.
    pub fn wait_entered(&self) {
        let mut state = self.shared.lock();
        while !state.entered && !state.open {
            state = self
                .shared
                .changed
                .wait(state)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether the gate is still closed (neither the test nor the watchdog opened it).
    pub fn is_held(&self) -> bool {
        !self.shared.lock().open
    }

    /// Whether the watchdog opened the gate at the time limit.
    pub fn opened_by_watchdog(&self) -> bool {
        self.shared.lock().by_watchdog
    }

    /// Panics, naming `what`, if the gate is not closed any more: `what` (a call made
    /// while the stream was held) waited for the held stream until the watchdog opened it.
    ///
    /// Under compute-sanitizer ([`crate::gpu::under_sanitizer`]) it prints that instead:
    /// the sanitizer's memcheck orders the driver's work itself (on the H200 on
    /// 2026-11-30 two of `gpu_bridge`'s gates failed under memcheck, by the watchdog, and
    /// passed without it), so the ordering is checked by the plain GPU run, and a
    /// sanitized run checks memory.
    pub fn assert_held(&self, what: &str) {
        let state = self.shared.lock();
        if state.open && crate::gpu::under_sanitizer() {
            println!(
                "not checked under compute-sanitizer (it orders the device's work itself): \
                 {what} waited for the held stream"
            );
            return;
        }
        assert!(
            !state.open,
            "{what} waited for a stream held by a host function{}",
            if state.by_watchdog {
                " (until the watchdog released it)"
            } else {
                ""
            }
        );
    }

    /// Opens the gate: the host function returns and the stream runs on.
    pub fn open(&self) {
        self.shared.open(false);
    }
}

impl Drop for HostFnGate {
    fn drop(&mut self) {
        self.open();
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
    }
}
