//! The emulator's global state: configuration, the handle table, the primary context,
//! the per-thread current context, and the panic-catching wrapper of every API call.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use cudarc::driver::sys::CUresult;

use super::alloc::MemTable;
use super::module::{Function, LoadedModule};
use super::queue::{Event, Op, Stream};

/// A driver call's outcome: `Err` holds the `CUresult` to return.
pub(crate) type R<T = ()> = Result<T, CUresult>;

pub(crate) use CUresult::*;

/// The CUDA version the emulator reports (`cuDriverGetVersion`, `cuCtxGetApiVersion`).
pub(crate) const DRIVER_VERSION: i32 = 12080;

/// The one emulated device's ordinal.
pub(crate) const DEVICE: i32 = 0;

/// Handles are opaque, never dereferenced, and (like device addresses) non-canonical.
const HANDLE_BASE: u64 = 0x00e0_0000_0000_0000;

/// The handle of the device's default memory pool.
pub(crate) const DEFAULT_POOL: u64 = 0x00e0_0000_0000_0010;

struct Config {
    total_memory: u64,
    delay: Duration,
    jitter_us: u64,
}

fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, scale) = match text.chars().last()? {
        'k' | 'K' => (&text[..text.len() - 1], 1u64 << 10),
        'm' | 'M' => (&text[..text.len() - 1], 1 << 20),
        'g' | 'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(scale)
}

fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let total_memory = match std::env::var("DEVARROW_EMU_MEM_BYTES") {
            Ok(v) => parse_bytes(&v).filter(|&b| b > 0).unwrap_or_else(|| {
                eprintln!("devarrow-emu: ignoring DEVARROW_EMU_MEM_BYTES={v:?} (not a byte count)");
                8 << 30
            }),
            Err(_) => 8 << 30,
        };
        let micros = |name: &str| match std::env::var(name) {
            Ok(v) => v.trim().parse::<u64>().unwrap_or_else(|_| {
                eprintln!("devarrow-emu: ignoring {name}={v:?} (not a number)");
                0
            }),
            Err(_) => 0,
        };
        Config {
            total_memory,
            delay: Duration::from_micros(micros("DEVARROW_EMU_DELAY_US")),
            jitter_us: micros("DEVARROW_EMU_JITTER_US"),
        }
    })
}

/// The emulated device's total memory (`DEVARROW_EMU_MEM_BYTES`, default 8 GiB).
pub fn config_total_memory() -> u64 {
    config().total_memory
}

/// The delay before a stream operation: `DEVARROW_EMU_DELAY_US` (default 0) plus a
/// pseudo-random part of up to `DEVARROW_EMU_JITTER_US` (default 0), which varies how
/// the streams interleave from one operation to the next.
pub fn config_delay() -> Duration {
    let c = config();
    if c.jitter_us == 0 {
        return c.delay;
    }
    static STATE: AtomicU64 = AtomicU64::new(0x9E37_79B9_7F4A_7C15);
    // SplitMix64 over a shared counter: cheap, and good enough to shuffle timings.
    let mut z = STATE.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    c.delay + Duration::from_micros(z % (c.jitter_us + 1))
}

/// Failure injection (`DEVARROW_EMU_FAIL_EVERY=N`): every `N`th call of the fallible
/// driver functions that take part fails with `code`, as a real driver may under
/// memory pressure, so that the error paths of the caller run (and are checked for
/// leaks, use-after-free and panics). `Ok` otherwise (and always when unset).
pub(crate) fn inject(call: &'static str, code: CUresult) -> R {
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
    Err(code)
}

/// Locks a mutex, ignoring poisoning (a panic caught at the API boundary must not make
/// the emulator unusable).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a context shares with its streams: its handle and its sticky error.
#[derive(Debug)]
pub(crate) struct CtxShared {
    pub handle: u64,
    sticky: Mutex<Option<CUresult>>,
    pub destroyed: AtomicBool,
}

impl CtxShared {
    /// The sticky error, if a fault happened.
    pub fn sticky(&self) -> R {
        match *lock(&self.sticky) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Records a fault (the first one wins) and prints what happened.
    pub fn fault(&self, code: CUresult, message: &str) {
        eprintln!("devarrow-emu: {message} ({code:?}; the context is now unusable)");
        let mut s = lock(&self.sticky);
        if s.is_none() {
            *s = Some(code);
        }
    }
}

/// A context (only primary contexts are emulated).
pub(crate) struct Context {
    pub shared: Arc<CtxShared>,
    /// The legacy NULL stream.
    pub null_stream: Arc<Stream>,
    /// Streams created in the context (not the NULL stream), including destroyed ones
    /// whose worker still runs the work enqueued before the destroy (a context
    /// synchronization or destruction waits for that work too).
    pub streams: Mutex<Vec<Arc<Stream>>>,
    pub flags: AtomicU32,
    pub limits: Mutex<HashMap<u32, usize>>,
    pub cache_config: AtomicU32,
}

impl Context {
    pub fn handle(&self) -> u64 {
        self.shared.handle
    }

    /// Every stream of the context, the NULL stream first (destroyed streams whose
    /// work has all run are forgotten here).
    pub fn all_streams(&self) -> Vec<Arc<Stream>> {
        let mut streams = lock(&self.streams);
        streams.retain(|s| !s.has_exited());
        let mut v = vec![self.null_stream.clone()];
        v.extend(streams.iter().cloned());
        v
    }

    /// Waits until every operation enqueued so far in the context has run.
    pub fn drain(&self) {
        for s in self.all_streams() {
            s.wait_seq(s.tail());
        }
    }

    /// Enqueues `op` on `stream`, first making it wait as the legacy NULL stream rules
    /// require: the NULL stream waits for every blocking stream, a blocking stream for
    /// the NULL stream. Returns the operation's sequence number.
    pub fn enqueue(&self, stream: &Arc<Stream>, op: Op) -> u64 {
        let wait_for = |s: &Arc<Stream>| {
            let seq = s.tail();
            if !s.is_done(seq) {
                stream.push(Op::Wait {
                    stream: s.clone(),
                    seq,
                });
            }
        };
        if stream.legacy {
            let blocking: Vec<Arc<Stream>> = self
                .all_streams()
                .into_iter()
                .filter(|s| s.is_blocking())
                .collect();
            blocking.iter().for_each(wait_for);
        } else if stream.is_blocking() {
            wait_for(&self.null_stream);
        }
        stream.push(op)
    }

    /// Enqueues `op` on `stream` as [`Context::enqueue`] does and, for a synchronous
    /// call (`wait`), waits for it and returns the context's sticky error, if any.
    pub fn submit(&self, stream: &Arc<Stream>, op: Op, wait: bool) -> R {
        let seq = self.enqueue(stream, op);
        if wait {
            stream.wait_seq(seq);
            self.shared.sticky()?;
        }
        Ok(())
    }

    /// The stream a `CUstream` handle names in this context (NULL and
    /// `CU_STREAM_LEGACY` are the legacy NULL stream).
    pub fn stream(&self, handle: u64) -> R<Arc<Stream>> {
        match handle {
            0 | 1 => Ok(self.null_stream.clone()),
            2 => {
                eprintln!("devarrow-emu: CU_STREAM_PER_THREAD is not emulated");
                Err(CUDA_ERROR_NOT_SUPPORTED)
            }
            h => match driver().get(h) {
                Some(Object::Stream(s)) if s.ctx.handle == self.handle() => Ok(s),
                Some(Object::Stream(_)) => Err(CUDA_ERROR_INVALID_CONTEXT),
                _ => Err(CUDA_ERROR_INVALID_HANDLE),
            },
        }
    }
}

/// An object a handle names.
#[derive(Clone)]
pub(crate) enum Object {
    Context(Arc<Context>),
    Stream(Arc<Stream>),
    Event(Arc<Event>),
    Module(Arc<LoadedModule>),
    Function(Arc<Function>),
}

impl Object {
    fn ctx(&self) -> u64 {
        match self {
            Object::Context(c) => c.handle(),
            Object::Stream(s) => s.ctx.handle,
            Object::Event(e) => e.ctx,
            Object::Module(m) => m.ctx,
            Object::Function(f) => f.ctx,
        }
    }
}

/// The primary context of the device.
#[derive(Default)]
pub(crate) struct Primary {
    pub refcount: u32,
    pub ctx: Option<Arc<Context>>,
    pub flags: u32,
}

/// The whole emulator.
pub(crate) struct Driver {
    pub initialized: AtomicBool,
    pub primary: Mutex<Primary>,
    objects: Mutex<HashMap<u64, Object>>,
    next_handle: AtomicU64,
    pub mem: MemTable,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();

pub(crate) fn driver() -> &'static Driver {
    DRIVER.get_or_init(|| Driver {
        initialized: AtomicBool::new(false),
        primary: Mutex::new(Primary::default()),
        objects: Mutex::new(HashMap::new()),
        next_handle: AtomicU64::new(1),
        mem: MemTable::new(config_total_memory()),
    })
}

impl Driver {
    /// A fresh handle value (never reused).
    pub fn new_handle(&self) -> u64 {
        HANDLE_BASE + 0x100 * self.next_handle.fetch_add(1, Ordering::Relaxed)
    }

    pub fn insert(&self, handle: u64, object: Object) {
        lock(&self.objects).insert(handle, object);
    }

    pub fn remove(&self, handle: u64) -> Option<Object> {
        lock(&self.objects).remove(&handle)
    }

    pub fn get(&self, handle: u64) -> Option<Object> {
        lock(&self.objects).get(&handle).cloned()
    }

    /// Removes every object of context `ctx` (the context included).
    pub fn remove_all_of(&self, ctx: u64) -> Vec<Object> {
        let mut objects = lock(&self.objects);
        let handles: Vec<u64> = objects
            .iter()
            .filter(|(_, o)| o.ctx() == ctx)
            .map(|(h, _)| *h)
            .collect();
        handles
            .into_iter()
            .filter_map(|h| objects.remove(&h))
            .collect()
    }

    /// Retains the primary context, creating it if needed; returns its handle.
    pub fn retain_primary(&self) -> u64 {
        let mut p = lock(&self.primary);
        let ctx = match &p.ctx {
            Some(c) => c.clone(),
            None => {
                let handle = self.new_handle();
                let shared = Arc::new(CtxShared {
                    handle,
                    sticky: Mutex::new(None),
                    destroyed: AtomicBool::new(false),
                });
                let null_stream = Stream::spawn(self.new_handle(), shared.clone(), 0, 0, true);
                let ctx = Arc::new(Context {
                    shared,
                    null_stream,
                    streams: Mutex::new(Vec::new()),
                    flags: AtomicU32::new(p.flags),
                    limits: Mutex::new(HashMap::new()),
                    cache_config: AtomicU32::new(0),
                });
                self.insert(handle, Object::Context(ctx.clone()));
                p.ctx = Some(ctx.clone());
                ctx
            }
        };
        p.refcount += 1;
        ctx.handle()
    }

    /// Releases the primary context; destroys it when the count drops to zero.
    pub fn release_primary(&self, reset: bool) -> R {
        let ctx = {
            let mut p = lock(&self.primary);
            if p.ctx.is_none() {
                return if reset {
                    Ok(())
                } else {
                    Err(CUDA_ERROR_INVALID_CONTEXT)
                };
            }
            p.refcount = if reset { 0 } else { p.refcount - 1 };
            if p.refcount > 0 {
                return Ok(());
            }
            p.ctx.take().expect("checked above")
        };
        self.destroy_context(&ctx);
        Ok(())
    }

    /// Waits for the context's work, then frees everything it owns.
    fn destroy_context(&self, ctx: &Arc<Context>) {
        ctx.shared.destroyed.store(true, Ordering::Release);
        let left = self.remove_all_of(ctx.handle());
        let owns_memory = || self.mem.snapshot().iter().any(|a| a.ctx == ctx.handle());
        if report_leaks() && (left.len() > 1 || owns_memory()) {
            let left = left
                .iter()
                .filter(|o| !matches!(o, Object::Context(_)))
                .cloned()
                .collect::<Vec<_>>();
            self.report(
                "at the destruction of the primary context",
                &left,
                Some(ctx.handle()),
            );
        }
        for s in ctx.all_streams() {
            s.shutdown();
        }
        for s in ctx.all_streams() {
            s.wait_exited();
        }
        lock(&ctx.streams).clear();
        self.mem.free_all_of(ctx.handle());
    }
}

/// Whether `DEVARROW_EMU_REPORT_LEAKS` is set: what is still alive when the primary
/// context is destroyed, and at process exit, is then printed to stderr.
fn report_leaks() -> bool {
    static REPORT: OnceLock<bool> = OnceLock::new();
    *REPORT.get_or_init(|| std::env::var_os("DEVARROW_EMU_REPORT_LEAKS").is_some())
}

impl Driver {
    /// Prints the objects and allocations (of context `ctx`, or all) still alive.
    fn report(&self, when: &str, objects: &[Object], ctx: Option<u64>) {
        let mut counts = [0usize; 4];
        for o in objects {
            match o {
                Object::Stream(_) => counts[0] += 1,
                Object::Event(_) => counts[1] += 1,
                Object::Module(_) => counts[2] += 1,
                Object::Function(_) => counts[3] += 1,
                Object::Context(_) => {}
            }
        }
        let allocations: Vec<_> = self
            .mem
            .snapshot()
            .into_iter()
            .filter(|a| ctx.is_none_or(|c| a.ctx == c))
            .collect();
        let bytes: usize = allocations.iter().map(|a| a.size).sum();
        eprintln!(
            "devarrow-emu: still alive {when} (pid {}): {} streams, {} events, {} modules \
             ({} functions), {} allocations of {bytes} bytes{}",
            std::process::id(),
            counts[0],
            counts[1],
            counts[2],
            counts[3],
            allocations.len(),
            if allocations.is_empty() { "" } else { ":" }
        );
        for a in allocations.iter().take(20) {
            eprintln!("devarrow-emu:   {}", a.describe());
        }
        if allocations.len() > 20 {
            eprintln!("devarrow-emu:   ... and {} more", allocations.len() - 20);
        }
    }
}

/// Runs at process exit (from `.fini_array`): the leak report.
extern "C" fn report_at_exit() {
    if !report_leaks() {
        return;
    }
    if let Some(d) = DRIVER.get() {
        let objects: Vec<Object> = lock(&d.objects).values().cloned().collect();
        let live_contexts = objects
            .iter()
            .filter(|o| matches!(o, Object::Context(_)))
            .count();
        d.report(
            &format!("at exit ({live_contexts} live contexts)"),
            &objects,
            None,
        );
    }
}

#[used]
#[link_section = ".fini_array"]
static REPORT_AT_EXIT: extern "C" fn() = report_at_exit;

thread_local! {
    /// The calling thread's context stack (handles); the top is current.
    static CURRENT: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// Set on stream workers: driver calls from host functions are not permitted.
    static IN_STREAM_WORKER: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as a stream worker.
pub(crate) fn mark_stream_worker() {
    IN_STREAM_WORKER.with(|c| c.set(true));
}

/// The current context handle of the calling thread (0 when none).
pub(crate) fn current_handle() -> u64 {
    CURRENT.with(|c| c.borrow().last().copied().unwrap_or(0))
}

/// Replaces the top of the calling thread's context stack (pops it for 0).
pub(crate) fn set_current_handle(handle: u64) {
    CURRENT.with(|c| {
        let mut c = c.borrow_mut();
        c.pop();
        if handle != 0 {
            c.push(handle);
        }
    });
}

pub(crate) fn push_current_handle(handle: u64) {
    CURRENT.with(|c| c.borrow_mut().push(handle));
}

pub(crate) fn pop_current_handle() -> Option<u64> {
    CURRENT.with(|c| c.borrow_mut().pop())
}

/// `cuInit` has run.
pub(crate) fn require_init() -> R {
    if driver().initialized.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(CUDA_ERROR_NOT_INITIALIZED)
    }
}

/// The calling thread's current context, whatever its error state.
pub(crate) fn current_context_any() -> R<Arc<Context>> {
    require_init()?;
    let handle = current_handle();
    if handle == 0 {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    match driver().get(handle) {
        Some(Object::Context(c)) => Ok(c),
        _ => Err(CUDA_ERROR_CONTEXT_IS_DESTROYED),
    }
}

/// The calling thread's current context, failing with its sticky error if it has one.
pub(crate) fn current_context() -> R<Arc<Context>> {
    let ctx = current_context_any()?;
    ctx.shared.sticky()?;
    Ok(ctx)
}

/// Checks a device ordinal.
pub(crate) fn check_device(dev: i32) -> R {
    if dev == DEVICE {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_DEVICE)
    }
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

/// Runs the body of driver call `name`: refuses calls from stream workers (host
/// functions), catches panics (returning `CUDA_ERROR_UNKNOWN`), maps the result.
pub(crate) fn api(name: &'static str, body: impl FnOnce() -> R) -> CUresult {
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
            report_api_error(name, e);
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

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("123"), Some(123));
        assert_eq!(parse_bytes("4K"), Some(4096));
        assert_eq!(parse_bytes(" 2g "), Some(2 << 30));
        assert_eq!(parse_bytes("x"), None);
        assert_eq!(parse_bytes(""), None);
    }
}
