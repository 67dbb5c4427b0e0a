//! Implicit synchronization: the driver calls that wait for, or are ordered against, the
//! device's other work without being asked to, and their counters.
//!
//! What NVIDIA documents, and how the emulator models each (the calls wait where the
//! driver does, so that a test observing the order of work sees what hardware shows, and
//! every such call is counted, so that a test can assert that a path makes none):
//!
//! - **A device-wide barrier** (CUDA C++ Programming Guide, "Implicit Synchronization":
//!   "Two commands from different streams cannot run concurrently if any one of the
//!   following operations is issued in-between them by the host thread: a page-locked
//!   host memory allocation, a device memory allocation, a device memory set, [...] any
//!   CUDA command to the NULL stream"): `cuMemAllocHost`, `cuMemHostAlloc`,
//!   `cuMemHostRegister` (which page-locks memory in place: "This memory range also is
//!   added to the same tracking mechanism as cuMemHostAlloc", CUDA driver API,
//!   `cuMemHostRegister`) and its undoing `cuMemHostUnregister`, `cuMemAlloc` and
//!   `cuMemAllocManaged` (device memory allocated outside the stream-ordered allocator,
//!   whose `cuMemAllocAsync` is documented as stream-ordered instead), and the synchronous
//!   memsets `cuMemsetD8/16/32`. The emulator makes every stream of the context (blocking
//!   or not) wait, on the device, for all the work enqueued on every other stream before
//!   the call (`Context::barrier` in `state.rs`); the host is not blocked (the guide
//!   promises only the ordering), but any later work of the context runs after the work
//!   enqueued before the call.
//! - **A host wait for the whole context**: `cuMemFree` of memory not from a pool ("For
//!   all other pointers, this API may perform implicit synchronization", CUDA driver API,
//!   `cuMemFree`; for pointers from `cuMemAllocAsync` / `cuMemAllocFromPoolAsync` it
//!   "will not perform any implicit synchronization", and is not counted) and
//!   `cuMemFreeHost` (NVIDIA documents no synchronization for it, nor that pinned memory
//!   may be freed under a pending copy; AMD documents a device-wide wait for its
//!   counterpart, `hipHostFree` "performs an implicit hipDeviceSynchronize", and the
//!   emulator keeps the wait it always had, now counted): the call returns once every
//!   operation enqueued in the context has run.
//! - **The legacy default stream** (CUDA driver API, "Stream synchronization behavior":
//!   "When an action is taken in the legacy stream such as a kernel launch or
//!   cudaStreamWaitEvent(), the legacy stream first waits on all blocking streams, the
//!   action is queued in the legacy stream, and then all blocking streams wait on the
//!   legacy stream"; streams created with `CU_STREAM_NON_BLOCKING` are exempt): modelled by
//!   `Context::enqueue` in `state.rs`. Every API call that enqueues work on the NULL
//!   stream (`CU_STREAM_LEGACY` included) is counted once, under its own name: the
//!   synchronous copies (`cuMemcpy`, `cuMemcpyHtoD`, ...: "The synchronous forms of these
//!   APIs issue these copies through the default stream", CUDA driver API, "API
//!   synchronization behavior"), and any `*Async` call, launch, event record, wait or
//!   `cuStreamSynchronize` given the NULL stream.
//! - **Kernel loading** (CUDA C++ Programming Guide, "Lazy Loading", "Potential
//!   Hazards", "Concurrent Execution": "Loading kernels might require context
//!   synchronization"; a kernel spinning until another is launched deadlocks when that
//!   launch loads the other): the call that loads a kernel, the first
//!   `cuModuleGetFunction` of it under lazy loading (the driver's default since CUDA 12.2
//!   on Linux) or `cuModuleLoadData*` with `CUDA_MODULE_LOADING=EAGER`, waits for all
//!   the context's work, as `cuCtxSynchronize` does, and is counted under its name with a
//!   note of the mode (`driver/module.rs`). The documented worst case: a test that
//!   passes here does not depend on the driver choosing not to wait.
//! - **`cuCtxSynchronize`**, which waits for the whole context by definition: not
//!   implicit, but a device-wide wait all the same, counted so that a test of a path that
//!   should wait only for its own work sees it.
//!
//! Not counted (NVIDIA documents no device-wide wait for them): stream-ordered allocation
//! and free, `cuMemPoolTrimTo`, `cuMemGetInfo`, `*Async` copies and memsets on a created
//! stream (a copy into pageable memory returns once it has run, which waits for its own
//! stream only), `cuStreamSynchronize` / `cuEventSynchronize` of a created stream or an
//! event.
//!
//! The counters are process-wide: [`devarrow_emu_implicit_syncs`] gives the total and the
//! count per call name, [`devarrow_emu_implicit_sync_count`] one call's. Tests take a
//! snapshot and compare (the GPU tests of a binary run one at a time).
//! `DEVARROW_EMU_TRACE_IMPLICIT_SYNCS=1` prints a line per counted call to stderr, `=2`
//! with the caller's backtrace: how to find which code made one.

use std::collections::BTreeMap;
use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use super::common::{lock, CALLS, CURRENT_CALL};

/// Every counted call, by name.
static COUNTS: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());
/// The sum of [`COUNTS`].
static TOTAL: AtomicU64 = AtomicU64::new(0);

/// Counts one implicitly synchronizing call `name`.
pub(crate) fn count(name: &'static str) {
    CURRENT_CALL.with(|c| c.set((c.get().0, true)));
    *lock(&COUNTS).entry(name).or_insert(0) += 1;
    TOTAL.fetch_add(1, Ordering::Relaxed);
    trace(name);
}

/// Counts the API call running on this thread as a command on the legacy NULL stream,
/// once per call however many operations it enqueues there.
pub(crate) fn count_legacy_stream() {
    let (name, counted) = CURRENT_CALL.with(|c| c.get());
    if !counted && !name.is_empty() {
        count(name);
    }
}

/// `DEVARROW_EMU_TRACE_IMPLICIT_SYNCS`: 0 (unset), 1 (a line per call) or 2 (and a
/// backtrace).
fn trace(name: &str) {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    let level = *LEVEL.get_or_init(|| {
        std::env::var("DEVARROW_EMU_TRACE_IMPLICIT_SYNCS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    });
    match level {
        0 => {}
        1 => eprintln!("devarrow-emu: implicit synchronization: {name}"),
        _ => eprintln!(
            "devarrow-emu: implicit synchronization: {name}, called from\n{}",
            std::backtrace::Backtrace::force_capture()
        ),
    }
}

/// How many implicitly synchronizing calls were made since the process started (see the
/// module [`self`]), and, when `buf` is not NULL, the count of each call name written to
/// it as lines `"<name> <count>\n"` (in name order), NUL-terminated, cut to the last
/// whole line that fits in `len` bytes. Not a CUDA symbol: tests find it with `dlsym`,
/// and skip where it is missing (a real driver).
///
/// # Safety
/// `buf` must be NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_emu_implicit_syncs(buf: *mut c_char, len: usize) -> u64 {
    // SAFETY: the caller's contract, passed on.
    unsafe { write_counts(&lock(&COUNTS), buf, len) }
}

/// How many driver calls were made since the process started (every entry point, by
/// name, as [`devarrow_emu_implicit_syncs`] writes them): what a host path costs in calls
/// (a wait, an allocation, a launch per batch), which the emulator counts exactly where a
/// profile of a real driver would be needed. Not a CUDA symbol.
///
/// # Safety
/// `buf` must be NULL or valid for writes of `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_emu_api_calls(buf: *mut c_char, len: usize) -> u64 {
    // SAFETY: the caller's contract, passed on.
    unsafe { write_counts(&lock(&CALLS), buf, len) }
}

/// Writes `counts` to `buf` as [`devarrow_emu_implicit_syncs`] documents; their sum.
///
/// # Safety
/// `buf` must be NULL or valid for writes of `len` bytes.
unsafe fn write_counts(counts: &BTreeMap<&'static str, u64>, buf: *mut c_char, len: usize) -> u64 {
    if !buf.is_null() && len > 0 {
        let mut text = String::new();
        for (name, n) in counts {
            let line = format!("{name} {n}\n");
            if text.len() + line.len() >= len {
                break;
            }
            text.push_str(&line);
        }
        // SAFETY: `buf` is valid for `len` bytes (the caller's contract) and
        // `text.len() + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
            buf.add(text.len()).write(0);
        }
    }
    counts.values().sum()
}

/// How many times call `name` (a NUL-terminated name such as `"cuMemHostAlloc"`)
/// synchronized implicitly since the process started; with NULL, the total. Not a CUDA
/// symbol: tests find it with `dlsym`, and skip where it is missing (a real driver).
///
/// # Safety
/// `name` must be NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn devarrow_emu_implicit_sync_count(name: *const c_char) -> u64 {
    if name.is_null() {
        return TOTAL.load(Ordering::Relaxed);
    }
    // SAFETY: a NUL-terminated string (the caller's contract).
    let name = unsafe { CStr::from_ptr(name) };
    let Ok(name) = name.to_str() else {
        return 0;
    };
    lock(&COUNTS).get(name).copied().unwrap_or(0)
}
