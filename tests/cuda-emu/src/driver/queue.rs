//! Streams (in-order queues, each run by its own worker thread), their operations,
//! events, and what a context shares with its streams ([`CtxShared`]).
//!
//! It does not know the global driver state: a stream is given the allocation table its
//! operations access when it is spawned.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use cudarc::driver::sys::CUresult::{self, *};

use crate::ptx::{Dims, ExecError};

use super::alloc::{Alloc, KernelMemory, MemTable};
use super::common::{catch, lock, mark_stream_worker, R};
use super::config::config_delay;
use super::kernel::Function;

/// What a context shares with its streams: its handle and its sticky error.
#[derive(Debug)]
pub(crate) struct CtxShared {
    pub handle: u64,
    /// `cuCtxGetId`: unique for the life of the process, unlike the handle, which the
    /// primary context keeps across a reset.
    pub id: u64,
    /// The context's device ordinal.
    pub device: usize,
    sticky: Mutex<Option<CUresult>>,
    pub destroyed: AtomicBool,
}

impl CtxShared {
    /// The shared part of a new context `handle` (no error, not destroyed).
    pub fn new(handle: u64, device: usize) -> Self {
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            handle,
            device,
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            sticky: Mutex::new(None),
            destroyed: AtomicBool::new(false),
        }
    }

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

/// One end of a copy.
pub(crate) enum Endpoint {
    /// Inside a registered allocation (device, pinned or managed), at an offset.
    Mem(Arc<Alloc>, usize),
    /// Plain (pageable) host memory the caller guarantees valid until the copy ran.
    Host(usize),
    /// Source bytes staged at call time (pageable host memory, as the driver does).
    Staged(Vec<u8>),
}

impl Endpoint {
    /// The host pointer to access, checking the allocation can be accessed now.
    fn pointer(&self, len: usize, role: &str) -> Result<*mut u8, String> {
        match self {
            Endpoint::Mem(a, offset) => match a.state_problem() {
                None => Ok(a.ptr(*offset)),
                Some(problem) => Err(format!(
                    "the {role} {:#x}..{:#x} is in {} and accessed {problem}",
                    a.addr + *offset as u64,
                    a.addr + (*offset + len) as u64,
                    a.describe()
                )),
            },
            Endpoint::Host(p) => Ok(*p as *mut u8),
            Endpoint::Staged(v) => Ok(v.as_ptr().cast_mut()),
        }
    }
}

/// A stream operation.
pub(crate) enum Op {
    Copy {
        dst: Endpoint,
        src: Endpoint,
        len: usize,
        call: &'static str,
    },
    /// The copies of one `cuMemcpyBatchAsync`, run in this order.
    CopyBatch {
        copies: Vec<(Endpoint, Endpoint, usize)>,
        call: &'static str,
    },
    Memset {
        dst: Endpoint,
        pattern: [u8; 4],
        elem: usize,
        count: usize,
        call: &'static str,
    },
    Kernel {
        func: Arc<Function>,
        dims: Dims,
        params: Vec<Vec<u8>>,
        /// The live allocations at launch (see [`KernelMemory`]).
        memory: Vec<Arc<Alloc>>,
        /// The devices whose memory the kernel may access (a bit mask, see
        /// [`KernelMemory::new`]).
        devices: u64,
    },
    Record {
        event: Arc<Event>,
        generation: u64,
    },
    Wait {
        stream: Arc<Stream>,
        seq: u64,
    },
    HostFn {
        f: unsafe extern "C" fn(*mut c_void),
        data: usize,
    },
    Callback {
        f: unsafe extern "C" fn(cudarc::driver::sys::CUstream, CUresult, *mut c_void),
        stream_handle: u64,
        data: usize,
    },
    AllocReady(Arc<Alloc>),
    /// Before a block freed on `stream` at `seq` is made another stream's allocation
    /// (reused as the pool's flags allow): the emulator's own check that the free has
    /// run by then, as the reuse rules promise. An internal error (the process aborts)
    /// where it has not: the emulator would hand out memory still in use.
    ReusedAfter {
        stream: Arc<Stream>,
        seq: u64,
    },
    Free(Arc<Alloc>),
    Nop,
}

struct Queue {
    ops: VecDeque<(u64, Op)>,
    enqueued: u64,
    completed: u64,
    shutdown: bool,
    exited: bool,
}

/// A stream: operations run in order on its worker thread.
pub(crate) struct Stream {
    pub ctx: Arc<CtxShared>,
    /// The device's allocation table, which its operations access.
    mem: &'static MemTable,
    pub flags: u32,
    pub priority: i32,
    /// The legacy NULL stream.
    pub legacy: bool,
    queue: Mutex<Queue>,
    changed: Condvar,
    /// The streams this one was made to wait for (`Op::Wait`, from `cuStreamWaitEvent`
    /// or the legacy stream rules): stream (by its handle, never reused: a destroyed
    /// stream's address may be a later stream's, whose sequence numbers start again) ->
    /// the latest sequence number waited for. The stream-ordered allocator's
    /// `CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES` reuses a block freed on such a
    /// stream at or before that point. Updated with the queue locked, after the wait is
    /// in it: what another thread reads here is in the queue before anything it enqueues
    /// next.
    waited_for: Mutex<HashMap<u64, u64>>,
    /// Its handle (unique for the process's life).
    id: u64,
}

impl Stream {
    /// Creates a stream and starts its worker.
    pub fn spawn(
        handle: u64,
        ctx: Arc<CtxShared>,
        mem: &'static MemTable,
        flags: u32,
        priority: i32,
        legacy: bool,
    ) -> Arc<Stream> {
        let stream = Arc::new(Stream {
            ctx,
            mem,
            flags,
            priority,
            legacy,
            queue: Mutex::new(Queue {
                ops: VecDeque::new(),
                enqueued: 0,
                completed: 0,
                shutdown: false,
                exited: false,
            }),
            changed: Condvar::new(),
            waited_for: Mutex::new(HashMap::new()),
            id: handle,
        });
        let worker = stream.clone();
        std::thread::Builder::new()
            .name(format!("emu-stream-{:x}", handle & 0xffff_ffff))
            .stack_size(64 << 20)
            .spawn(move || worker.run())
            .expect("devarrow-emu: cannot start a stream worker thread");
        stream
    }

    /// Whether it synchronizes with the legacy NULL stream.
    pub fn is_blocking(&self) -> bool {
        !self.legacy && self.flags & 1 == 0
    }

    /// Appends `op`; returns its sequence number.
    pub fn push(&self, op: Op) -> u64 {
        let waited = match &op {
            Op::Wait { stream, seq } => Some((stream.id, *seq)),
            _ => None,
        };
        let mut q = lock(&self.queue);
        q.enqueued += 1;
        let seq = q.enqueued;
        q.ops.push_back((seq, op));
        if let Some((stream, waited_seq)) = waited {
            // Only now that the wait is in the queue (still locked): another thread that
            // sees it here and enqueues on this stream (an allocation reusing a block
            // freed on `stream`) enqueues behind it. Updated first, a thread allocating
            // meanwhile could enqueue its allocation ahead of the wait it relied on.
            let mut waited = lock(&self.waited_for);
            let at = waited.entry(stream).or_insert(0);
            *at = (*at).max(waited_seq);
        }
        self.changed.notify_all();
        seq
    }

    /// The sequence number of the last operation enqueued.
    pub fn tail(&self) -> u64 {
        lock(&self.queue).enqueued
    }

    /// Whether work enqueued on this stream from now on runs after operation `seq` of
    /// `other`: the same stream, or one this stream was made to wait for up to `seq` or
    /// later (direct waits only; the driver's own tracking may follow chains further).
    pub fn is_ordered_after(&self, other: &Stream, seq: u64) -> bool {
        std::ptr::eq(self, other)
            || lock(&self.waited_for)
                .get(&other.id)
                .is_some_and(|&at| at >= seq)
    }

    /// Whether operation `seq` (and everything before it) has run.
    pub fn is_done(&self, seq: u64) -> bool {
        lock(&self.queue).completed >= seq
    }

    /// Blocks until operation `seq` has run.
    pub fn wait_seq(&self, seq: u64) {
        let mut q = lock(&self.queue);
        while q.completed < seq && !q.exited {
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether work may still be enqueued (the stream was not destroyed).
    pub fn accepts_work(&self) -> bool {
        !lock(&self.queue).shutdown
    }

    /// Lets the worker exit once the queue is drained.
    pub fn shutdown(&self) {
        lock(&self.queue).shutdown = true;
        self.changed.notify_all();
    }

    /// Whether the worker has exited (after a shutdown, once the queue was drained).
    pub fn has_exited(&self) -> bool {
        lock(&self.queue).exited
    }

    /// Blocks until the worker has exited.
    pub fn wait_exited(&self) {
        let mut q = lock(&self.queue);
        while !q.exited {
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn run(self: Arc<Self>) {
        mark_stream_worker();
        loop {
            let (seq, op) = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(next) = q.ops.pop_front() {
                        break next;
                    }
                    if q.shutdown {
                        q.exited = true;
                        self.changed.notify_all();
                        return;
                    }
                    q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            let delay = config_delay();
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            self.execute(op);
            let mut q = lock(&self.queue);
            q.completed = seq;
            self.changed.notify_all();
        }
    }

    fn execute(&self, op: Op) {
        let faulted = self.ctx.sticky().is_err();
        match op {
            Op::Nop => {}
            Op::Wait { stream, seq } => stream.wait_seq(seq),
            Op::Record { event, generation } => event.mark_recorded(generation),
            Op::ReusedAfter { stream, seq } => {
                if !stream.is_done(seq) {
                    eprintln!(
                        "devarrow-emu: internal error: a block freed on another stream (at \
                         its operation {seq}, of which {} have run) is reused before its \
                         free ran",
                        lock(&stream.queue).completed
                    );
                    std::process::abort();
                }
            }
            Op::AllocReady(a) => a.make_live(),
            Op::Free(a) => self.mem.finish_free(&a),
            // After a fault the context is unusable: nothing else runs.
            _ if faulted => {}
            Op::Copy {
                dst,
                src,
                len,
                call,
            } => {
                let pointers = dst
                    .pointer(len, "destination")
                    .and_then(|d| Ok((d, src.pointer(len, "source")?)));
                match pointers {
                    // SAFETY: both ranges were checked to lie inside their allocations
                    // (kept alive by the Arcs) or are host memory the caller guarantees
                    // until the copy ran; `copy` allows overlap.
                    Ok((d, s)) => unsafe { std::ptr::copy(s, d, len) },
                    Err(why) => self
                        .ctx
                        .fault(CUDA_ERROR_ILLEGAL_ADDRESS, &format!("{call}: {why}")),
                }
            }
            Op::CopyBatch { copies, call } => {
                for (dst, src, len) in copies {
                    let pointers = dst
                        .pointer(len, "destination")
                        .and_then(|d| Ok((d, src.pointer(len, "source")?)));
                    match pointers {
                        // SAFETY: as for `Op::Copy`.
                        Ok((d, s)) => unsafe { std::ptr::copy(s, d, len) },
                        Err(why) => {
                            self.ctx
                                .fault(CUDA_ERROR_ILLEGAL_ADDRESS, &format!("{call}: {why}"));
                            break;
                        }
                    }
                }
            }
            Op::Memset {
                dst,
                pattern,
                elem,
                count,
                call,
            } => match dst.pointer(elem * count, "destination") {
                Ok(d) => {
                    for i in 0..count {
                        // SAFETY: `d` is valid for `elem * count` bytes (checked when
                        // enqueued, the allocation kept alive by the Arc).
                        unsafe {
                            std::ptr::copy_nonoverlapping(pattern.as_ptr(), d.add(i * elem), elem)
                        };
                    }
                }
                Err(why) => self
                    .ctx
                    .fault(CUDA_ERROR_ILLEGAL_ADDRESS, &format!("{call}: {why}")),
            },
            Op::Kernel {
                func,
                dims,
                params,
                memory,
                devices,
            } => self.run_kernel(&func, dims, &params, memory, devices),
            Op::HostFn { f, data } => {
                // SAFETY: the caller of cuLaunchHostFunc provided `f` and its argument
                // for exactly this call.
                if let Err(p) = catch(|| unsafe { f(data as *mut c_void) }) {
                    eprintln!("devarrow-emu: a host function panicked: {p}");
                }
            }
            Op::Callback {
                f,
                stream_handle,
                data,
            } => {
                // SAFETY: as for host functions (cuStreamAddCallback).
                if let Err(p) = catch(|| unsafe {
                    f(
                        stream_handle as cudarc::driver::sys::CUstream,
                        CUDA_SUCCESS,
                        data as *mut c_void,
                    )
                }) {
                    eprintln!("devarrow-emu: a stream callback panicked: {p}");
                }
            }
        }
    }

    fn run_kernel(
        &self,
        func: &Function,
        dims: Dims,
        params: &[Vec<u8>],
        memory: Vec<Arc<Alloc>>,
        devices: u64,
    ) {
        let mem = KernelMemory::new(self.mem, memory, devices);
        let started = Instant::now();
        let outcome = catch(|| func.module.ptx.launch(&func.name, dims, params, &mem));
        let (code, message) = match outcome {
            Ok(Ok(())) => {
                if std::env::var_os("DEVARROW_EMU_TRACE").is_some() {
                    eprintln!(
                        "devarrow-emu: {} grid {:?} block {:?} ran in {:?}",
                        func.name,
                        dims.grid,
                        dims.block,
                        started.elapsed()
                    );
                }
                return;
            }
            Ok(Err(e)) => {
                let code = match &e {
                    ExecError::Fault { fault, .. } if fault.kind.contains("misaligned") => {
                        CUDA_ERROR_MISALIGNED_ADDRESS
                    }
                    ExecError::Fault { .. } => CUDA_ERROR_ILLEGAL_ADDRESS,
                    ExecError::Deadlock { .. } => CUDA_ERROR_LAUNCH_TIMEOUT,
                    ExecError::InvalidLaunch(_) | ExecError::Unsupported(_) => {
                        CUDA_ERROR_LAUNCH_FAILED
                    }
                };
                (code, format!("kernel {} failed: {e}", func.name))
            }
            Err(p) => (
                CUDA_ERROR_LAUNCH_FAILED,
                format!(
                    "internal error: the PTX interpreter panicked running {}: {p}",
                    func.name
                ),
            ),
        };
        self.ctx.fault(code, &message);
    }
}

/// An event: the point of a stream it was last recorded at.
pub(crate) struct Event {
    pub ctx: u64,
    pub flags: u32,
    state: Mutex<EventState>,
}

#[derive(Default)]
struct EventState {
    recorded: Option<(Arc<Stream>, u64)>,
    generation: u64,
    time: Option<Instant>,
}

/// `CU_EVENT_DISABLE_TIMING`.
const DISABLE_TIMING: u32 = 2;

impl Event {
    pub fn new(ctx: u64, flags: u32) -> Self {
        Self {
            ctx,
            flags,
            state: Mutex::new(EventState::default()),
        }
    }

    /// Records the event on `stream` (through `enqueue`, which applies the legacy
    /// stream rules and returns the operation's sequence number).
    pub fn record(self: &Arc<Self>, stream: &Arc<Stream>, enqueue: impl FnOnce(Op) -> u64) {
        let mut st = lock(&self.state);
        st.generation += 1;
        st.time = None;
        let seq = enqueue(Op::Record {
            event: self.clone(),
            generation: st.generation,
        });
        st.recorded = Some((stream.clone(), seq));
    }

    fn mark_recorded(&self, generation: u64) {
        let mut st = lock(&self.state);
        if st.generation == generation {
            st.time = Some(Instant::now());
        }
    }

    /// Where a wait on the event must wait: `(stream, seq)`, or `None` if never recorded.
    pub fn wait_point(&self) -> Option<(Arc<Stream>, u64)> {
        lock(&self.state).recorded.clone()
    }

    /// Whether the recorded work has completed (an event never recorded has).
    pub fn is_complete(&self) -> bool {
        match self.wait_point() {
            Some((s, seq)) => s.is_done(seq),
            None => true,
        }
    }

    /// Blocks until the recorded work has completed.
    pub fn synchronize(&self) {
        if let Some((s, seq)) = self.wait_point() {
            s.wait_seq(seq);
        }
    }

    /// Milliseconds from `self` to `end` (`cuEventElapsedTime`).
    pub fn elapsed_ms(&self, end: &Event) -> R<f32> {
        if self.flags & DISABLE_TIMING != 0 || end.flags & DISABLE_TIMING != 0 {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        if self.wait_point().is_none() || end.wait_point().is_none() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        if !self.is_complete() || !end.is_complete() {
            return Err(CUDA_ERROR_NOT_READY);
        }
        let (a, b) = (lock(&self.state).time, lock(&end.state).time);
        match (a, b) {
            (Some(a), Some(b)) => Ok(if b >= a {
                (b - a).as_secs_f64() as f32 * 1000.0
            } else {
                -((a - b).as_secs_f64() as f32 * 1000.0)
            }),
            _ => Err(CUDA_ERROR_NOT_READY),
        }
    }
}
