//! The primitives every other driver module shares: the result type [`R`] and the
//! `CUresult` codes, the failure injection, poison-free locking, the panic-catching
//! wrapper of every API call ([`api`]), the fatal end of an unchecked misuse
//! ([`fatal_misuse`]), [`catch`], the out-parameter writer [`out`],
//! and the mark of stream worker threads (where API calls are not permitted).
//!
//! A leaf module: it depends on no other module of the crate.

use std::any::Any;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use cudarc::driver::sys::CUresult;

/// A driver call's outcome: `Err` holds the `CUresult` to return.
pub(crate) type R<T = ()> = Result<T, CUresult>;

pub(crate) use CUresult::*;

/// Failure injection (`DEVARROW_EMU_FAIL_EVERY=N`): every `N`th call of the fallible
/// driver functions that take part fails with `code`, as a real driver may under
/// memory pressure, so that the error paths of the caller run (and are checked for
/// leaks, use-after-free and panics). `Ok` otherwise (and always when unset).
///
/// Tests arm one failure themselves with [`devarrow_emu_fail_nth_call`]: the `n`th
/// fallible call from then on fails, once, so a test can walk the failure through every
/// call of an operation. Injected failures are not reported as API errors (they are not
/// the caller's).
pub(crate) fn inject(call: &'static str, code: CUresult) -> R {
    if let Ok(previous) = ARMED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
        (n > 0).then(|| n - 1)
    }) {
        if previous == 1 {
            INJECTED.fetch_add(1, Ordering::AcqRel);
            INJECTING.with(|c| c.set(true));
            return Err(code);
        }
    }
    static EVERY: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let every = *EVERY.get_or_init(|| {
        std::env::var("DEVARROW_EMU_FAIL_EVERY")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    });
    if every == 0 || !(COUNT.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(every) {
        return Ok(());
    }
    eprintln!("devarrow-emu: injected failure: {call} returns {code:?}");
    INJECTED.fetch_add(1, Ordering::AcqRel);
    INJECTING.with(|c| c.set(true));
    Err(code)
}

/// Fails the call with `code` as a driver that lacks a feature would (see
/// `devarrow_emu_set_batch_copy`): a condition the emulator was asked to simulate, so,
/// like an injected failure, not reported as an API error.
pub(crate) fn simulated(code: CUresult) -> R {
    INJECTING.with(|c| c.set(true));
    Err(code)
}

/// The countdown of [`devarrow_emu_fail_nth_call`] (0: disarmed).
static ARMED: AtomicU64 = AtomicU64::new(0);
/// How many failures were injected so far.
static INJECTED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set by [`inject`] while the failing call returns, so that it is not reported.
    static INJECTING: Cell<bool> = const { Cell::new(false) };
}

/// Arms one injected failure: the `n`th fallible driver call from now (any thread)
/// fails, once; 0 disarms. Not a CUDA symbol: tests find it with `dlsym` in the
/// `libcuda.so` they loaded, and skip where it is missing (a real driver).
#[no_mangle]
pub extern "C" fn devarrow_emu_fail_nth_call(n: u64) {
    ARMED.store(n, Ordering::Release);
}

/// The number of failures injected so far (armed ones and `DEVARROW_EMU_FAIL_EVERY`'s).
#[no_mangle]
pub extern "C" fn devarrow_emu_injected_failures() -> u64 {
    INJECTED.load(Ordering::Acquire)
}

/// Locks a mutex, ignoring poisoning (a panic caught at the API boundary must not make
/// the emulator unusable).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// Set on stream workers: driver calls from host functions are not permitted.
    static IN_STREAM_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as a stream worker.
pub(crate) fn mark_stream_worker() {
    IN_STREAM_WORKER.with(|c| c.set(true));
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

/// Reports every call that returns an error, as `compute-sanitizer` does on a real
/// driver (where `--error-exitcode` then fails the run): a way to find, without a GPU,
/// the driver errors a test suite raises. `CUDA_ERROR_NOT_READY` (a query's "not yet")
/// is left out.
/// - `DEVARROW_EMU_REPORT_API_ERRORS=1`: one line on stderr per error;
/// - `DEVARROW_EMU_API_ERROR_LOG=<path>`: the same line appended to that file (stderr of
///   passing tests is captured by the test harness; the file is not).
fn report_api_error(name: &str, e: CUresult) {
    static TARGETS: OnceLock<(bool, Option<String>)> = OnceLock::new();
    let (to_stderr, log) = TARGETS.get_or_init(|| {
        (
            std::env::var("DEVARROW_EMU_REPORT_API_ERRORS").is_ok_and(|v| v == "1"),
            std::env::var("DEVARROW_EMU_API_ERROR_LOG")
                .ok()
                .filter(|p| !p.is_empty()),
        )
    });
    if e == CUDA_ERROR_NOT_READY || (!to_stderr && log.is_none()) {
        return;
    }
    let line = format!("devarrow-emu: API error: {name} returned {e:?}");
    if *to_stderr {
        eprintln!("{line}");
    }
    if let Some(path) = log {
        use std::io::Write;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path);
        if let Ok(mut file) = file {
            // One write per line: appends from several processes do not interleave.
            let _ = file.write_all(format!("{line}\n").as_bytes());
        }
    }
}

thread_local! {
    /// The driver call running on this thread, and whether it was counted as an implicit
    /// synchronization already (see `super::sync`).
    pub(crate) static CURRENT_CALL: Cell<(&'static str, bool)> = const { Cell::new(("", false)) };
    /// The driver call the calling thread is in (for [`fatal_misuse`]).
    static CALL: Cell<&'static str> = const { Cell::new("a driver call") };
}

/// Ends the process as NVIDIA's driver would on a misuse it does not check: it
/// dereferences handles without validating them, so a handle it never handed out, or one
/// already destroyed, is a crash there (a segmentation fault), not an error code a caller
/// could handle or a test could expect. Prints `devarrow-emu: fatal: <call>: <what>` on
/// stderr and aborts.
pub(crate) fn fatal_misuse(what: &str) -> ! {
    let call = CALL.with(|c| c.get());
    eprintln!(
        "devarrow-emu: fatal: {call}: {what} (NVIDIA's driver does not validate handles: \
         it would crash here); aborting"
    );
    std::process::abort()
}

/// Every driver call, by name, counted by [`api`] (read by
/// `sync::devarrow_emu_api_calls`).
pub(crate) static CALLS: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

/// Runs the body of driver call `name`: counts it ([`CALLS`]), refuses calls from stream
/// workers (host functions), catches panics (returning `CUDA_ERROR_UNKNOWN`), maps the
/// result.
pub(crate) fn api(name: &'static str, body: impl FnOnce() -> R) -> CUresult {
    *lock(&CALLS).entry(name).or_insert(0) += 1;
    CALL.with(|c| c.set(name));
    CURRENT_CALL.with(|c| c.set((name, false)));
    if IN_STREAM_WORKER.with(|c| c.get()) {
        eprintln!(
            "devarrow-emu: {name} called from a host function running on a stream: \
             CUDA calls are not permitted there"
        );
        return CUDA_ERROR_NOT_PERMITTED;
    }
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => {
            if !INJECTING.with(|c| c.replace(false)) {
                report_api_error(name, e);
            }
            e
        }
        Err(p) => {
            eprintln!(
                "devarrow-emu: internal error in {name}: {} (returning CUDA_ERROR_UNKNOWN)",
                panic_message(p.as_ref())
            );
            CUDA_ERROR_UNKNOWN
        }
    }
}

/// Catches a panic of `body` (an emulator or interpreter bug), returning its message.
pub(crate) fn catch<T>(body: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(body)).map_err(|p| panic_message(p.as_ref()))
}

/// Writes `value` through the out-pointer `p` (`CUDA_ERROR_INVALID_VALUE` if NULL).
///
/// # Safety
/// `p` must be NULL or valid for a write of `T` (the driver API's contract for its
/// out-parameters).
pub(crate) unsafe fn out<T>(p: *mut T, value: T) -> R {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-NULL and valid for writes by the caller's contract; `write` does not
    // read or drop the old (possibly uninitialized) value.
    unsafe { p.write(value) };
    Ok(())
}
