//! Support for GPU test binaries: one rule for every test that needs a GPU.

use std::sync::{Mutex, MutexGuard};

/// Serializes GPU tests of one binary: several measure free device memory, which
/// concurrent tests would disturb.
static GPU_LOCK: Mutex<()> = Mutex::new(());

/// Whether `DEVARROW_REQUIRE_GPU=1` is set: GPU tests must then fail, not skip.
pub fn gpu_required() -> bool {
    std::env::var("DEVARROW_REQUIRE_GPU").as_deref() == Ok("1")
}

/// The name of the GPU test that last took [`GPU_LOCK`] in this binary, if any.
static LAST_TEST: Mutex<Option<String>> = Mutex::new(None);

/// Set once a sticky fault was found: the message every later GPU test fails with.
static STICKY: Mutex<Option<String>> = Mutex::new(None);

/// Opens what a GPU test needs with the test lock held, or returns `None` after printing
/// `skipping: <reason>`; panics instead when [`gpu_required`].
///
/// A sticky fault (an illegal address found while a stream ran) poisons the primary
/// context: every later call in it returns that error, so every later test of the binary
/// would fail for it and hide what they test. Before opening, when an earlier GPU test
/// ran in this binary, this checks each active primary context ([`sticky_fault`]); on a
/// sticky error it prints `sticky CUDA fault <code> left by test <name>; later tests in
/// this binary cannot run` to the process's stderr (not captured by the test harness)
/// and panics with that message, and so does every later GPU test of the binary at once,
/// without a driver call. The binary then exits with a failure after the harness has
/// printed the output of the test that left the fault (had it exited at once, that
/// output, which the harness holds until the end, would be lost).
pub fn open_or_skip<T, E: std::fmt::Display>(
    open: impl FnOnce() -> Result<T, E>,
) -> Option<(MutexGuard<'static, ()>, T)> {
    let guard = GPU_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(message) = STICKY.lock().unwrap_or_else(|e| e.into_inner()).clone() {
        drop(guard);
        panic!("{message}");
    }
    let this_test = std::thread::current()
        .name()
        .unwrap_or("<unnamed>")
        .to_owned();
    let previous = LAST_TEST
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .replace(this_test);
    if let Some(previous) = previous {
        if let Some(code) = sticky_fault() {
            let message = format!(
                "sticky CUDA fault {code:?} ({}) left by test {previous}; later tests in \
                 this binary cannot run",
                code as u32
            );
            // Straight to the file descriptor: `eprintln!` is captured per test.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "{message}");
            *STICKY.lock().unwrap_or_else(|e| e.into_inner()) = Some(message.clone());
            drop(guard);
            panic!("{message}");
        }
    }
    match open() {
        Ok(held) => Some((guard, held)),
        Err(e) => {
            if gpu_required() {
                panic!("DEVARROW_REQUIRE_GPU=1 but no GPU is usable: {e}");
            }
            println!("skipping: {e}");
            eprintln!("skipping: {e}");
            None
        }
    }
}

/// The sticky error of an active primary context, if one has one: each device's primary
/// context that is active (`cuDevicePrimaryCtxGetState`) is retained, made current and
/// synchronized (`cuCtxSynchronize` returns the context's sticky error), then released,
/// leaving the calling thread's current context as it was. `None` also when the driver
/// cannot be loaded or initialized (there is then no context to check).
pub fn sticky_fault() -> Option<cudarc::driver::sys::CUresult> {
    use cudarc::driver::sys::{self, CUresult};
    if !devarrow_cuda::driver_available() {
        return None;
    }
    let mut count = 0;
    // SAFETY: plain driver calls (the library is loaded: `driver_available`) with valid
    // out-pointers; a retain is balanced by the release below, a push by the pop.
    unsafe {
        if sys::cuInit(0) != CUresult::CUDA_SUCCESS
            || sys::cuDeviceGetCount(&mut count) != CUresult::CUDA_SUCCESS
        {
            return None;
        }
        for ordinal in 0..count {
            let mut device = 0;
            let (mut flags, mut active) = (0u32, 0i32);
            if sys::cuDeviceGet(&mut device, ordinal) != CUresult::CUDA_SUCCESS
                || sys::cuDevicePrimaryCtxGetState(device, &mut flags, &mut active)
                    != CUresult::CUDA_SUCCESS
                || active == 0
            {
                continue;
            }
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            if sys::cuDevicePrimaryCtxRetain(&mut ctx, device) != CUresult::CUDA_SUCCESS {
                continue;
            }
            let mut sticky = None;
            if sys::cuCtxPushCurrent_v2(ctx) == CUresult::CUDA_SUCCESS {
                let result = sys::cuCtxSynchronize();
                if result != CUresult::CUDA_SUCCESS {
                    sticky = Some(result);
                }
                sys::cuCtxPopCurrent_v2(&mut ctx);
            }
            sys::cuDevicePrimaryCtxRelease_v2(device);
            if sticky.is_some() {
                return sticky;
            }
        }
    }
    None
}

/// Whether the tests run under `compute-sanitizer`: `DEVARROW_UNDER_SANITIZER=1`, or the
/// tool's injection library named in `CUDA_INJECTION64_PATH` or `LD_PRELOAD`.
///
/// The sanitizer reports every driver call that returns an error, and a run with
/// `--error-exitcode` then fails even when every test passes. Tests that provoke a
/// driver error on purpose (out of device memory) or assert one (`CUDA_ERROR_NOT_READY`
/// from a query of a running kernel's event) skip that part under the sanitizer and say
/// so; the plain GPU run checks it.
pub fn under_sanitizer() -> bool {
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    var("DEVARROW_UNDER_SANITIZER") == "1"
        || ["CUDA_INJECTION64_PATH", "LD_PRELOAD"]
            .iter()
            .any(|name| var(name).to_ascii_lowercase().contains("sanitizer"))
}

/// `true` when the part of a test named `what` runs: always, except under
/// [`under_sanitizer`], where it prints `skipping under compute-sanitizer: <what>`.
pub fn unless_sanitized(what: &str) -> bool {
    if under_sanitizer() {
        println!("skipping under compute-sanitizer: {what}");
        false
    } else {
        true
    }
}

/// Asserts that the work recorded before `event` is still running: `cuEventQuery`
/// answers `CUDA_ERROR_NOT_READY`. Skipped (and said) under [`under_sanitizer`], which
/// would report that answer as a driver error.
///
/// # Safety
/// `event` must be a live `CUevent`.
pub unsafe fn assert_still_running(event: cudarc::driver::sys::CUevent, what: &str) {
    use cudarc::driver::{result, sys};
    if unless_sanitized(&format!("asserting CUDA_ERROR_NOT_READY: {what}")) {
        // SAFETY: the caller's guarantee.
        let state = unsafe { result::event::query(event) };
        assert_eq!(
            state,
            Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)),
            "{what}"
        );
    }
}

/// Failure injection of the emulated driver (`tests/cuda-emu`): arms the failure of the
/// `n`th fallible driver call from now, so a test can walk one failure through every
/// call of an operation. `None` on a real driver, which has no such thing.
#[derive(Debug, Clone, Copy)]
pub struct FailureInjection {
    fail_nth_call: unsafe extern "C" fn(u64),
    injected_failures: unsafe extern "C" fn() -> u64,
}

impl FailureInjection {
    /// The emulator's controls, when the `libcuda.so` in use is the emulator.
    pub fn find() -> Option<Self> {
        // SAFETY: dlopen of a library that is already loaded (cudarc opened it) only
        // bumps its reference count (never dropped: the handle is kept for the process);
        // the names are NUL-terminated.
        let lib = unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW) };
        if lib.is_null() {
            return None;
        }
        // SAFETY: a live handle and NUL-terminated names.
        let (fail, injected) = unsafe {
            (
                libc::dlsym(lib, c"devarrow_emu_fail_nth_call".as_ptr()),
                libc::dlsym(lib, c"devarrow_emu_injected_failures".as_ptr()),
            )
        };
        if fail.is_null() || injected.is_null() {
            return None;
        }
        // SAFETY: the emulator defines both symbols with exactly these signatures.
        unsafe {
            Some(Self {
                fail_nth_call: std::mem::transmute::<*mut libc::c_void, unsafe extern "C" fn(u64)>(
                    fail,
                ),
                injected_failures: std::mem::transmute::<
                    *mut libc::c_void,
                    unsafe extern "C" fn() -> u64,
                >(injected),
            })
        }
    }

    /// Arms the failure of the `n`th fallible driver call from now (0 disarms).
    pub fn fail_nth_call(&self, n: u64) {
        // SAFETY: the emulator's function, which only stores `n`.
        unsafe { (self.fail_nth_call)(n) }
    }

    /// How many failures the emulator injected so far.
    pub fn injected_failures(&self) -> u64 {
        // SAFETY: the emulator's function, which only reads a counter.
        unsafe { (self.injected_failures)() }
    }
}

/// A symbol of the `libcuda.so` in use (the emulator's controls), NULL where missing.
pub(crate) fn driver_symbol(name: &std::ffi::CStr) -> *mut libc::c_void {
    // SAFETY: dlopen of a library that is already loaded (cudarc opened it) only bumps
    // its reference count (never dropped: the handle is kept for the process).
    let lib = unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW) };
    if lib.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a live handle and a NUL-terminated name.
    unsafe { libc::dlsym(lib, name.as_ptr()) }
}

/// The emulated driver's controls of the CUDA path's options (`tests/cuda-emu`): whether
/// `cuMemcpyBatchAsync` is there, and how many host ranges are registered with
/// `cuMemHostRegister`. `None` on a real driver, which has no such thing.
#[derive(Debug, Clone, Copy)]
pub struct EmulatedDriver {
    set_batch_copy: unsafe extern "C" fn(std::ffi::c_int),
    host_registrations: unsafe extern "C" fn(*mut u64) -> u64,
}

impl EmulatedDriver {
    /// The controls, when the `libcuda.so` in use is the emulator.
    pub fn find() -> Option<Self> {
        let (set, registrations) = (
            driver_symbol(c"devarrow_emu_set_batch_copy"),
            driver_symbol(c"devarrow_emu_host_registrations"),
        );
        if set.is_null() || registrations.is_null() {
            return None;
        }
        // SAFETY: the emulator defines both symbols with exactly these signatures.
        unsafe {
            Some(Self {
                set_batch_copy: std::mem::transmute::<
                    *mut libc::c_void,
                    unsafe extern "C" fn(std::ffi::c_int),
                >(set),
                host_registrations: std::mem::transmute::<
                    *mut libc::c_void,
                    unsafe extern "C" fn(*mut u64) -> u64,
                >(registrations),
            })
        }
    }

    /// Makes `cuMemcpyBatchAsync` there (`Some(true)`), or a driver without it
    /// (`Some(false)`: `CUDA_ERROR_NOT_SUPPORTED`), or as `DEVARROW_EMU_NO_BATCH_COPY`
    /// says (`None`, the default).
    pub fn set_batch_copy(&self, available: Option<bool>) {
        let value = match available {
            Some(true) => 1,
            Some(false) => 0,
            None => -1,
        };
        // SAFETY: the emulator's function, which only stores the value.
        unsafe { (self.set_batch_copy)(value) }
    }

    /// Whether the run sets `DEVARROW_EMU_NO_BATCH_COPY=1` (a driver without
    /// `cuMemcpyBatchAsync` unless a test says otherwise).
    pub fn batch_copy_off_by_environment() -> bool {
        std::env::var("DEVARROW_EMU_NO_BATCH_COPY").as_deref() == Ok("1")
    }

    /// `(live, total)`: host ranges registered now, and since the process started.
    pub fn host_registrations(&self) -> (u64, u64) {
        let mut total = 0u64;
        // SAFETY: the emulator's function, writing to a valid out-pointer.
        let live = unsafe { (self.host_registrations)(&mut total) };
        (live, total)
    }
}

/// The emulated driver's counts of implicitly synchronizing driver calls
/// (`tests/cuda-emu`, `devarrow_emu_implicit_syncs`): page-locked host allocation and
/// registration, device allocation outside the stream-ordered pool, `cuMemFree`,
/// `cuMemFreeHost`, the synchronous memsets, every call that enqueues work on the legacy
/// NULL stream, and `cuCtxSynchronize`, by call name. A real driver counts nothing:
/// [`ImplicitSyncs::snapshot`] is `None` there.
///
/// The counts are process-wide; GPU tests of one binary run one at a time
/// ([`open_or_skip`]), so the difference of two snapshots taken by a test is that test's
/// (and of whatever it left running on other threads).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImplicitSyncs {
    /// The number of calls counted.
    pub total: u64,
    /// The count of each call name (only names counted at least once).
    pub calls: std::collections::BTreeMap<String, u64>,
}

impl ImplicitSyncs {
    /// The counts since the process started, when the `libcuda.so` in use is the
    /// emulator; `None` on a real driver.
    pub fn snapshot() -> Option<Self> {
        Self::counts_of(c"devarrow_emu_implicit_syncs")
    }

    /// Every driver call since the process started, by name (`devarrow_emu_api_calls`),
    /// when the `libcuda.so` in use is the emulator; `None` on a real driver. What a host
    /// path costs in calls (waits, allocations, launches per batch), counted exactly.
    pub fn every_call() -> Option<Self> {
        Self::counts_of(c"devarrow_emu_api_calls")
    }

    /// The counts the emulator's function `name` writes (both have one signature).
    fn counts_of(name: &std::ffi::CStr) -> Option<Self> {
        let symbol = driver_symbol(name);
        if symbol.is_null() {
            return None;
        }
        // SAFETY: the emulator defines the symbol with exactly this signature.
        let counts = unsafe {
            std::mem::transmute::<
                *mut libc::c_void,
                unsafe extern "C" fn(*mut std::ffi::c_char, usize) -> u64,
            >(symbol)
        };
        let mut buf = vec![0 as std::ffi::c_char; 1 << 16];
        // SAFETY: `buf` holds `buf.len()` bytes, which the call NUL-terminates.
        let total = unsafe { counts(buf.as_mut_ptr(), buf.len()) };
        // SAFETY: NUL-terminated by the call above.
        let text = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
        let calls = text
            .lines()
            .filter_map(|line| {
                let (name, n) = line.rsplit_once(' ')?;
                Some((name.to_owned(), n.parse().ok()?))
            })
            .collect();
        Some(Self { total, calls })
    }

    /// What was counted after `earlier` (a snapshot taken before this one): the calls
    /// whose count grew, by how much.
    pub fn since(&self, earlier: &Self) -> Self {
        let calls = self
            .calls
            .iter()
            .filter_map(|(name, &n)| {
                let grew = n.saturating_sub(earlier.calls.get(name).copied().unwrap_or(0));
                (grew > 0).then(|| (name.clone(), grew))
            })
            .collect();
        Self {
            total: self.total.saturating_sub(earlier.total),
            calls,
        }
    }

    /// [`ImplicitSyncs::every_call`] once the process has stopped calling the driver: no
    /// call counted for half a second, five polls of 100 ms in a row (at most 10 s of
    /// waiting). The counts are the process's: threads a test left behind (a region's
    /// workers dropping their batches after its stream ended) may still be calling when
    /// the next test, holding the GPU lock, starts counting, and on a loaded machine
    /// (CI's two cores) they can pause for more than one poll between two calls.
    pub fn every_call_settled() -> Option<Self> {
        let mut last = Self::every_call()?;
        let mut quiet = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(100));
            let now = Self::every_call()?;
            quiet = if now.total == last.total {
                quiet + 1
            } else {
                0
            };
            if quiet == 5 {
                return Some(now);
            }
            last = now;
        }
        Some(last)
    }

    /// What was counted since `earlier`, taking a snapshot now (`None` on a real driver).
    pub fn counted_since(earlier: &Self) -> Option<Self> {
        Some(Self::snapshot()?.since(earlier))
    }

    /// Whether nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }
}

impl std::fmt::Display for ImplicitSyncs {
    /// `"3 (cuMemAlloc_v2 x1, cuMemHostAlloc x2)"`, or `"0"`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.total)?;
        if !self.calls.is_empty() {
            let calls: Vec<String> = self
                .calls
                .iter()
                .map(|(name, n)| format!("{name} x{n}"))
                .collect();
            write!(f, " ({})", calls.join(", "))?;
        }
        Ok(())
    }
}
