//! A gate: a kernel that keeps its stream busy until the test opens it, so that an
//! ordering test's precondition ("this work is still pending") holds by construction,
//! on the emulator and on any GPU.
//!
//! The kernel (`dvx_gate_fill_u32` of `testing.ptx`) spins with volatile loads on a
//! flag in mapped pinned host memory (`cuMemHostAlloc` with
//! `CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE`, its device address from
//! `cuMemHostGetDevicePointer`), then fills its destination as the timed spin does.
//! Nothing but the host's write of the flag ends it: not a clock, and not a host call
//! that waits for the device (which would wait forever).
//!
//! A time limit turns that forever into a failure: a watchdog thread opens a gate that
//! is still closed after [`Gate::DEFAULT_LIMIT`] (or `DEVARROW_GATE_LIMIT_S` seconds,
//! or [`Gate::with_limit`]), says so on the process's stderr at once, and the test then
//! fails at [`Gate::open`] (or when the gate drops) with "the gate was opened by its
//! time limit: a call waited for the device while the gate was closed". That is what a
//! host call that synchronizes the device (an implicitly synchronizing driver call, a
//! hidden `cuStreamSynchronize`) between the launch and the test's own opening shows
//! as, instead of a hang or a precondition silently lost.
//!
//! A call under test that must block until the gated work is done (a blocking read, a
//! drop that waits for a stream) runs inside [`Gate::open_during`], which opens the gate
//! from another thread while the call waits and checks that the call did not return
//! before the gate opened.
//!
//! Flags are 64-byte slots of a 64 KiB page per context, allocated once (the first gate
//! of a context, before its kernel is launched) and never freed nor reused: freeing
//! (`cuMemFreeHost`, which may synchronize the device) or waiting for a slot's kernel to
//! end before reuse could wait on another gate still closed, and querying whether it
//! has ended answers `CUDA_ERROR_NOT_READY`, which compute-sanitizer reports. The
//! context frees the pages when it is destroyed, after its kernels; a gate must not
//! outlive its context (it holds its stream, which holds the context).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::driver::{CudaStream, DriverError, LaunchConfig, PushKernelArg};

use crate::spin::testing_function;

/// Bytes of one page of flags (mapped pinned host memory).
const PAGE_BYTES: usize = 64 << 10;
/// Bytes of one flag's slot: a cache line of its own.
const SLOT_BYTES: usize = 64;

/// How long [`Gate::open_during`] lets the call wait before it opens the gate.
const OPEN_DURING_DELAY: Duration = Duration::from_millis(200);

/// Who opened a gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opener {
    /// The test: [`Gate::open`] or [`Gate::open_during`].
    Test,
    /// The watchdog, at the time limit.
    Limit,
    /// [`Gate`]'s drop, the test having never opened it.
    Drop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed,
    Open { at: Instant, by: Opener },
}

/// The host side of a gate: its flag and who opened it when.
#[derive(Debug)]
struct Latch {
    flag: &'static AtomicU32,
    state: Mutex<State>,
    changed: Condvar,
    limit: Duration,
    /// The test that made the gate (its thread's name).
    test: String,
}

impl Latch {
    /// Opens the gate (if closed) by `by`; the state before.
    fn open(&self, by: Opener) -> State {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let before = *state;
        if before == State::Closed {
            // The time first: whatever the kernel completes is after it.
            *state = State::Open {
                at: Instant::now(),
                by,
            };
            self.flag.store(1, Ordering::SeqCst);
            self.changed.notify_all();
        }
        before
    }

    fn state(&self) -> State {
        *self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn limit_message(&self) -> String {
        format!(
            "the gate of test {} was opened by its time limit ({:?}): a call waited for the \
             device while the gate was closed (a host call that synchronizes the device or \
             the gated stream, or a wait the test did not run inside Gate::open_during)",
            self.test, self.limit
        )
    }

    /// Waits until the gate opens or the time limit passes, then opens it.
    fn watch(&self) {
        let deadline = Instant::now() + self.limit;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while *state == State::Closed {
            let now = Instant::now();
            if now >= deadline {
                drop(state);
                if self.open(Opener::Limit) == State::Closed {
                    // Straight to the file descriptor: the harness captures `eprintln!`
                    // per test, and the test may be stuck elsewhere.
                    use std::io::Write;
                    let _ = writeln!(
                        std::io::stderr(),
                        "devarrow-testing: {}",
                        self.limit_message()
                    );
                }
                return;
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A page of flags of one context.
struct Page {
    host: usize,
    device: u64,
    next: usize,
}

/// A fresh flag of `stream`'s context (zero): its host cell and device address.
fn new_flag(stream: &CudaStream) -> Result<(&'static AtomicU32, u64), DriverError> {
    static PAGES: OnceLock<Mutex<HashMap<u64, Page>>> = OnceLock::new();
    let ctx = stream.context();
    let mut id = 0;
    // SAFETY: the driver checks the context and writes the id to our local.
    unsafe { sys::cuCtxGetId(ctx.cu_ctx(), &mut id) }.result()?;
    let mut pages = PAGES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if pages
        .get(&id)
        .is_none_or(|page| page.next == PAGE_BYTES / SLOT_BYTES)
    {
        ctx.bind_to_thread()?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointers, the context current; the memory is zeroed before
        // any flag of it is handed out and never freed (the context frees it).
        unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                PAGE_BYTES,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
            .result()?;
            std::ptr::write_bytes(host.cast::<u8>(), 0, PAGE_BYTES);
            sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0).result()?;
        }
        pages.insert(
            id,
            Page {
                host: host as usize,
                device,
                next: 0,
            },
        );
    }
    let page = pages.get_mut(&id).expect("inserted above");
    let offset = page.next * SLOT_BYTES;
    page.next += 1;
    // SAFETY: a 64-byte aligned slot of a live page (pinned memory of PAGE_BYTES bytes,
    // page-aligned, never freed while the context lives), handed out once; every access
    // to it from the host is through this atomic.
    let flag = unsafe { AtomicU32::from_ptr((page.host + offset) as *mut u32) };
    flag.store(0, Ordering::SeqCst);
    Ok((flag, page.device + offset as u64))
}

/// A kernel gate on a stream: work launched through it ([`Gate::launch_fill`]) keeps the
/// stream busy until [`Gate::open`] (or the time limit, which fails the test). See the
/// module's documentation.
///
/// Make the gate before the work it is to hold up (its first use in a context allocates
/// pinned memory, which may synchronize the device), and after the memory its kernel
/// writes, so that it drops (opens) first. Dropping it opens it: a failing test never
/// leaves a kernel spinning.
#[derive(Debug)]
pub struct Gate {
    latch: Arc<Latch>,
    watchdog: Option<JoinHandle<()>>,
    stream: Option<Arc<CudaStream>>,
    device_flag: u64,
}

impl Gate {
    /// The time limit of a gate made by [`Gate::new`], unless `DEVARROW_GATE_LIMIT_S`
    /// says otherwise.
    pub const DEFAULT_LIMIT: Duration = Duration::from_secs(20);

    /// A closed gate for `stream`, with the default time limit.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, DriverError> {
        let limit = std::env::var("DEVARROW_GATE_LIMIT_S")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map_or(Self::DEFAULT_LIMIT, Duration::from_secs_f64);
        Self::with_limit(stream, limit)
    }

    /// A closed gate for `stream` whose watchdog opens it (failing the test) after
    /// `limit`.
    pub fn with_limit(stream: &Arc<CudaStream>, limit: Duration) -> Result<Self, DriverError> {
        // Loaded now: a module load may synchronize, and must not once work is gated.
        testing_function(stream, "dvx_gate_fill_u32")?;
        let (flag, device_flag) = new_flag(stream)?;
        Ok(Self::on_flag(
            flag,
            device_flag,
            Some(stream.clone()),
            limit,
        ))
    }

    fn on_flag(
        flag: &'static AtomicU32,
        device_flag: u64,
        stream: Option<Arc<CudaStream>>,
        limit: Duration,
    ) -> Self {
        let latch = Arc::new(Latch {
            flag,
            state: Mutex::new(State::Closed),
            changed: Condvar::new(),
            limit,
            test: std::thread::current()
                .name()
                .unwrap_or("<unnamed>")
                .to_owned(),
        });
        let watched = latch.clone();
        let watchdog = std::thread::Builder::new()
            .name("gate-watchdog".into())
            .spawn(move || watched.watch())
            .expect("a watchdog thread");
        Self {
            latch,
            watchdog: Some(watchdog),
            stream,
            device_flag,
        }
    }

    /// Enqueues `dvx_gate_fill_u32` on the gate's stream (one block of 256 threads): it
    /// waits until the gate opens, then writes `dst[i] = value + i` for `i < n` (`u32`s).
    /// May be called more than once; every such kernel ends once the gate opens.
    ///
    /// # Safety
    /// `dst` must be writable for `4 * n` bytes until the kernel completes (after the
    /// gate opens).
    pub unsafe fn launch_fill(&self, dst: u64, n: u64, value: u32) -> Result<(), DriverError> {
        let stream = self
            .stream
            .as_ref()
            .expect("a gate made by Gate::new has a stream");
        let function = testing_function(stream, "dvx_gate_fill_u32")?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&function);
        b.arg(&self.device_flag).arg(&dst).arg(&n).arg(&value);
        // SAFETY: the arguments match the kernel's (u64, u64, u64, u32); the flag lives
        // as long as the context (never freed), `dst` is the caller's guarantee.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Whether the gate is still closed.
    pub fn is_closed(&self) -> bool {
        self.latch.state() == State::Closed
    }

    /// Asserts that the work recorded before `event` (behind this gate) is still pending
    /// ([`crate::gpu::assert_still_running`]: skipped under compute-sanitizer). When the
    /// time limit opened the gate, fails with that instead: a call waited for the device,
    /// which is why the work is done.
    ///
    /// # Safety
    /// `event` must be a live `CUevent`.
    pub unsafe fn assert_pending(&self, event: sys::CUevent, what: &str) {
        let limit_passed = || {
            matches!(
                self.latch.state(),
                State::Open {
                    by: Opener::Limit,
                    ..
                }
            )
        };
        if limit_passed() {
            panic!("{}", self.latch.limit_message());
        }
        let still_running = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: the caller's guarantee.
            unsafe { crate::gpu::assert_still_running(event, what) }
        }));
        if let Err(failure) = still_running {
            if limit_passed() {
                panic!("{}", self.latch.limit_message());
            }
            std::panic::resume_unwind(failure);
        }
    }

    /// Opens the gate: the gated kernels go on. Panics (failing the test) when the time
    /// limit had opened it, or when it was already open.
    pub fn open(&self) {
        match self.latch.open(Opener::Test) {
            State::Closed => {}
            State::Open {
                by: Opener::Limit, ..
            } => panic!("{}", self.latch.limit_message()),
            State::Open { .. } => panic!("the gate was opened twice"),
        }
    }

    /// Runs `call`, which must wait for the gated work (a blocking read of what it
    /// writes, a drop that waits for its stream), and opens the gate from another thread
    /// while it waits (200 ms after the call began). Panics when the time limit opened
    /// the gate, or when `call` returned before the gate opened: it did not wait for the
    /// gated work.
    ///
    /// The precondition of what `call` tests (the gated work still pending when `call`
    /// enqueues its wait) holds when `call` gets there within those 200 ms; a call that
    /// never waits fails here whatever its speed.
    pub fn open_during<R>(&self, call: impl FnOnce() -> R) -> R {
        assert!(self.is_closed(), "Gate::open_during of an open gate");
        let latch = self.latch.clone();
        let opener = std::thread::Builder::new()
            .name("gate-opener".into())
            .spawn(move || {
                std::thread::sleep(OPEN_DURING_DELAY);
                latch.open(Opener::Test);
            })
            .expect("an opener thread");
        let result = call();
        let returned = Instant::now();
        let opened = opener.join().is_ok();
        match self.latch.state() {
            State::Open {
                by: Opener::Limit, ..
            } => panic!("{}", self.latch.limit_message()),
            State::Open { at, .. } if opened => assert!(
                returned >= at,
                "the call returned before the gate opened: it did not wait for the gated work"
            ),
            state => panic!("the gate's opener failed ({state:?})"),
        }
        result
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.latch.open(Opener::Drop);
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        let by_limit = matches!(
            self.latch.state(),
            State::Open {
                by: Opener::Limit,
                ..
            }
        );
        if by_limit && !std::thread::panicking() {
            panic!("{}", self.latch.limit_message());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_gate(limit: Duration) -> (Gate, &'static AtomicU32) {
        let flag: &'static AtomicU32 = Box::leak(Box::new(AtomicU32::new(0)));
        (Gate::on_flag(flag, 0, None, limit), flag)
    }

    #[test]
    fn open_sets_the_flag_once() {
        let (gate, flag) = host_gate(Duration::from_secs(60));
        assert!(gate.is_closed());
        assert_eq!(flag.load(Ordering::SeqCst), 0);
        gate.open();
        assert!(!gate.is_closed());
        assert_eq!(flag.load(Ordering::SeqCst), 1);
        drop(gate);
    }

    #[test]
    fn drop_opens_a_closed_gate_without_failing() {
        let (gate, flag) = host_gate(Duration::from_secs(60));
        drop(gate);
        assert_eq!(flag.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_time_limit_opens_the_gate_and_fails_the_test_at_open() {
        let (gate, flag) = host_gate(Duration::from_millis(50));
        // What a host call that waits for the gated stream does: wait until it opens.
        while flag.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let message = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gate.open()))
            .expect_err("open must fail after the time limit");
        let message = message.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("was opened by its time limit")
                && message.contains("a call waited for the device while the gate was closed"),
            "{message}"
        );
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(gate)));
        assert!(result.is_err(), "the drop fails the test too");
    }

    #[test]
    fn open_during_passes_a_call_that_waits_for_the_flag() {
        let (gate, flag) = host_gate(Duration::from_secs(60));
        let t = Instant::now();
        let value = gate.open_during(|| {
            while flag.load(Ordering::SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            7
        });
        assert_eq!(value, 7);
        assert!(t.elapsed() >= OPEN_DURING_DELAY);
        drop(gate);
    }

    #[test]
    fn open_during_fails_a_call_that_does_not_wait() {
        let (gate, _flag) = host_gate(Duration::from_secs(60));
        let failed =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gate.open_during(|| ())));
        let message = failed.expect_err("a call that returns at once must fail");
        let message = message.downcast_ref::<&str>().copied().unwrap_or_default();
        assert!(
            message.contains("did not wait for the gated work"),
            "{message}"
        );
        drop(gate);
    }
}
