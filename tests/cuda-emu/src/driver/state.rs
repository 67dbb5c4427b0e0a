//! The emulator's global state: the handle table, the primary context, the per-thread
//! current context, and the leak report.
//!
//! The top of the driver's internal layers: it uses the data types of [`super::alloc`],
//! [`super::kernel`] and [`super::queue`], none of which uses it back; only the API
//! modules (`context`, `device`, `memory`, `module`, `stream`) sit above it.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::alloc::MemTable;
use super::common::*;
use super::config::{config_devices, config_total_memory};
use super::kernel::{Function, LoadedModule};
use super::queue::{CtxShared, Event, Op, Stream};

/// The CUDA version the emulator reports (`cuDriverGetVersion`, `cuCtxGetApiVersion`).
pub(crate) const DRIVER_VERSION: i32 = 12080;

/// The first emulated device's ordinal (`DEVARROW_EMU_DEVICES` says how many follow).
pub(crate) const DEVICE: i32 = 0;

/// Handles are opaque, never dereferenced, and (like device addresses) non-canonical.
const HANDLE_BASE: u64 = 0x00e0_0000_0000_0000;

/// The handle of device 0's default memory pool.
pub(crate) const DEFAULT_POOL: u64 = 0x00e0_0000_0000_0010;

/// Device `dev`'s default pool handle: [`DEFAULT_POOL`] plus `dev << 40` (far above the
/// handles `cuMemPoolCreate` hands out, `DEFAULT_POOL + 0x10 * n`).
pub(crate) fn default_pool(dev: usize) -> u64 {
    DEFAULT_POOL + ((dev as u64) << 40)
}

/// The device of a pool handle: a default pool's, or a created pool's (`None` for
/// neither).
pub(crate) fn pool_device(pool: u64) -> Option<usize> {
    if let Some(dev) = (0..config_devices()).find(|&d| default_pool(d) == pool) {
        return Some(dev);
    }
    lock(&driver().mem.pools)
        .iter()
        .find(|&&(p, _, _)| p == pool)
        .map(|&(_, _, d)| d)
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
    /// The per-thread default streams (`CU_STREAM_PER_THREAD`) of the threads that used
    /// one, each also in `streams`.
    pub per_thread: Mutex<HashMap<std::thread::ThreadId, Arc<Stream>>>,
    pub flags: AtomicU32,
    pub limits: Mutex<HashMap<u32, usize>>,
    pub cache_config: AtomicU32,
    /// The devices whose primary contexts this context enabled peer access to
    /// (`cuCtxEnablePeerAccess`), as a bit mask.
    pub peers: AtomicU64,
}

impl Context {
    pub fn handle(&self) -> u64 {
        self.shared.handle
    }

    /// The context's device ordinal.
    pub fn device(&self) -> usize {
        self.shared.device
    }

    /// The devices whose memory work in this context may touch (bit `d` for device `d`):
    /// its own and those it enabled peer access to.
    pub fn accessible_devices(&self) -> u64 {
        (1u64 << self.device()) | self.peers.load(Ordering::Acquire)
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
            super::sync::count_legacy_stream();
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

    /// The implicit synchronization of the calls that NVIDIA's programming guide lists
    /// ("Two commands from different streams cannot run concurrently if any one of the
    /// following operations is issued in-between them by the host thread": page-locked
    /// host allocation, device allocation, device memset, ...; see `super::sync`): every
    /// stream of the context, blocking or not, the NULL stream included, waits (on the
    /// device) for the work enqueued so far on every other one. The host does not wait;
    /// work enqueued afterwards on any stream runs after all of it.
    pub fn barrier(&self) {
        // Destroyed streams still run what was enqueued before: waited for, never
        // made to wait.
        let streams = self.all_streams();
        let tails: Vec<(Arc<Stream>, u64)> = streams
            .iter()
            .map(|s| (s.clone(), s.tail()))
            .filter(|(s, seq)| !s.is_done(*seq))
            .collect();
        for s in streams.iter().filter(|s| s.accepts_work()) {
            for (other, seq) in &tails {
                if !Arc::ptr_eq(s, other) {
                    s.push(Op::Wait {
                        stream: other.clone(),
                        seq: *seq,
                    });
                }
            }
        }
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

    /// The calling thread's per-thread default stream of this context
    /// (`CU_STREAM_PER_THREAD`), made on its first use: as NVIDIA documents it, "not a
    /// non-blocking stream", so it synchronizes with the legacy NULL stream (it waits for
    /// it, and the NULL stream waits for it, as for any blocking stream), and with no
    /// other stream (CUDA driver API, "Stream synchronization behavior", "Per-thread
    /// default stream"). Each thread has its own; it lives as long as the context.
    pub fn per_thread_stream(&self) -> Arc<Stream> {
        let thread = std::thread::current().id();
        let mut per_thread = lock(&self.per_thread);
        if let Some(stream) = per_thread.get(&thread) {
            return stream.clone();
        }
        let d = driver();
        let stream = Stream::spawn(d.new_handle(), self.shared.clone(), &d.mem, 0, 0, false);
        lock(&self.streams).push(stream.clone());
        per_thread.insert(thread, stream.clone());
        stream
    }

    /// The stream a `CUstream` handle names in this context (NULL and
    /// `CU_STREAM_LEGACY` are the legacy NULL stream, `CU_STREAM_PER_THREAD` the calling
    /// thread's per-thread default stream).
    pub fn stream(&self, handle: u64) -> R<Arc<Stream>> {
        match handle {
            0 | 1 => Ok(self.null_stream.clone()),
            2 => Ok(self.per_thread_stream()),
            h => match driver().get(h) {
                Some(Object::Stream(s)) if s.ctx.handle == self.handle() => Ok(s),
                Some(Object::Stream(_)) => Err(CUDA_ERROR_INVALID_CONTEXT),
                _ => Err(driver().dead_handle("stream", h)),
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
    /// The primary context's handle, the same for the life of the process (as the
    /// driver's): a context created anew after a reset or a last release gets it again,
    /// with a new `cuCtxGetId`.
    pub handle: Option<u64>,
}

/// The whole emulator.
pub(crate) struct Driver {
    pub initialized: AtomicBool,
    /// Each device's primary context, by ordinal.
    pub primary: Vec<Mutex<Primary>>,
    objects: Mutex<HashMap<u64, Object>>,
    /// Streams and events destroyed by their owner (their handles are never reused).
    destroyed: Mutex<HashSet<u64>>,
    next_handle: AtomicU64,
    pub mem: MemTable,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();

pub(crate) fn driver() -> &'static Driver {
    DRIVER.get_or_init(|| Driver {
        initialized: AtomicBool::new(false),
        primary: (0..config_devices())
            .map(|_| Mutex::new(Primary::default()))
            .collect(),
        objects: Mutex::new(HashMap::new()),
        destroyed: Mutex::new(HashSet::new()),
        next_handle: AtomicU64::new(1),
        mem: MemTable::new(config_devices(), config_total_memory()),
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

    /// Removes a stream or event its owner destroyed (`cuStreamDestroy`,
    /// `cuEventDestroy`): any later use of the handle is fatal ([`Driver::dead_handle`]).
    pub fn destroy(&self, handle: u64) {
        lock(&self.objects).remove(&handle);
        lock(&self.destroyed).insert(handle);
    }

    /// What a `kind` handle (`"stream"`, `"event"`) that names no live object of that
    /// kind means: the end of the process ([`fatal_misuse`]) for a value never handed
    /// out, one of another kind, or one its owner destroyed, as NVIDIA's driver (which
    /// dereferences handles) would crash there; `CUDA_ERROR_INVALID_HANDLE` for one that
    /// went with its context (destroyed or reset), which a caller may still hold and
    /// drop.
    pub fn dead_handle(&self, kind: &str, handle: u64) -> cudarc::driver::sys::CUresult {
        let index = handle.wrapping_sub(HANDLE_BASE);
        let handed_out = handle >= HANDLE_BASE
            && index.is_multiple_of(0x100)
            && index / 0x100 < self.next_handle.load(Ordering::Relaxed);
        if !handed_out {
            fatal_misuse(&format!(
                "{kind} handle {handle:#x} was never handed out by the driver"
            ));
        }
        if lock(&self.destroyed).contains(&handle) {
            fatal_misuse(&format!("{kind} handle {handle:#x} was destroyed"));
        }
        if self.get(handle).is_some() {
            fatal_misuse(&format!(
                "{kind} handle {handle:#x} names another kind of object"
            ));
        }
        CUDA_ERROR_INVALID_HANDLE
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

    /// Retains the primary context, creating it (active again, with a new id) if needed;
    /// returns its handle.
    pub fn retain_primary(&'static self, dev: usize) -> u64 {
        let mut p = lock(&self.primary[dev]);
        let ctx = match &p.ctx {
            Some(c) => c.clone(),
            None => self.new_primary(dev, &mut p),
        };
        p.refcount += 1;
        ctx.handle()
    }

    /// Creates the primary context (under its one handle) and makes it `p.ctx`.
    fn new_primary(&'static self, dev: usize, p: &mut Primary) -> Arc<Context> {
        let handle = *p.handle.get_or_insert_with(|| self.new_handle());
        let shared = Arc::new(CtxShared::new(handle, dev));
        let null_stream = Stream::spawn(self.new_handle(), shared.clone(), &self.mem, 0, 0, true);
        let ctx = Arc::new(Context {
            shared,
            null_stream,
            streams: Mutex::new(Vec::new()),
            per_thread: Mutex::new(HashMap::new()),
            flags: AtomicU32::new(p.flags),
            limits: Mutex::new(HashMap::new()),
            cache_config: AtomicU32::new(0),
            peers: AtomicU64::new(0),
        });
        self.insert(handle, Object::Context(ctx.clone()));
        p.ctx = Some(ctx.clone());
        ctx
    }

    /// Releases the primary context; destroys it when the count drops to zero.
    ///
    /// A reset destroys it whatever the count (its memory, streams, events, modules and
    /// the pools created in it are gone) and leaves the primary context *inactive*
    /// (`cuDevicePrimaryCtxGetState` says so): "Resetting the primary context does not
    /// release it" (CUDA driver API, `cuDevicePrimaryCtxReset`), so the retains stay
    /// counted and each is still released. Calls made in it fail with
    /// `CUDA_ERROR_CONTEXT_IS_DESTROYED` until a `cuDevicePrimaryCtxRetain` makes it
    /// active again, under the same handle with a new `cuCtxGetId`. Observed on NVIDIA's
    /// driver: JuliaGPU/CUDA.jl#16 (709 after `device_reset!`), lupinemachines/lupine#844
    /// (after `cudaDeviceReset` the handle stays current, `active=0`, `cuMemAlloc` gives
    /// 709 until libcudart's `cuDevicePrimaryCtxRetain`).
    pub fn release_primary(&'static self, dev: usize, reset: bool) -> R {
        let ctx = {
            let mut p = lock(&self.primary[dev]);
            if !reset {
                if p.refcount == 0 {
                    return Err(CUDA_ERROR_INVALID_CONTEXT);
                }
                p.refcount -= 1;
                if p.refcount > 0 {
                    return Ok(());
                }
            }
            match p.ctx.take() {
                Some(ctx) => ctx,
                // Inactive since a reset: nothing to destroy.
                None => return Ok(()),
            }
        };
        self.destroy_context(&ctx, !reset);
        Ok(())
    }

    /// Whether `handle` is the primary context's handle while the context is inactive
    /// (reset, or released by all): calls in it are `CUDA_ERROR_CONTEXT_IS_DESTROYED`.
    pub fn is_inactive_primary(&self, handle: u64) -> bool {
        self.primary.iter().any(|p| {
            let p = lock(p);
            p.handle == Some(handle) && p.ctx.is_none()
        })
    }

    /// Waits for the context's work, then frees everything it owns.
    /// `report`: whether what it still owns is reported as a leak (not at a reset, which
    /// destroys live objects on purpose).
    fn destroy_context(&self, ctx: &Arc<Context>, report: bool) {
        ctx.shared.destroyed.store(true, Ordering::Release);
        let left = self.remove_all_of(ctx.handle());
        let owns_memory = || self.mem.snapshot().iter().any(|a| a.ctx == ctx.handle());
        if report && report_leaks() && (left.len() > 1 || owns_memory()) {
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
        lock(&ctx.per_thread).clear();
        self.mem.free_all_of(ctx.device(), ctx.handle());
        // Peer access to this context ends with it (a new one starts without).
        let bit = !(1u64 << ctx.device());
        for p in &self.primary {
            if let Some(other) = lock(p).ctx.clone() {
                other.peers.fetch_and(bit, Ordering::AcqRel);
            }
        }
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
    if (DEVICE..DEVICE + config_devices() as i32).contains(&dev) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_DEVICE)
    }
}
