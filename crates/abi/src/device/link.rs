//! A modelled host-device link for the [`CpuDevice`](super::CpuDevice): its copies run on a
//! copy-engine thread, in stream order, each taking `latency + bytes / bandwidth` of
//! modelled time ([`LinkModel`]), and its events complete when the modelled copy does, as
//! on a GPU. With it the pipelining of a transfer (packing chunk k + 1 while chunk k is
//! copied) shows on a machine without a GPU.
//!
//! The engine keeps a timeline: a copy starts when it was enqueued or when the copy before
//! it ends, whichever is later, and ends its modelled time after that. The engine does the
//! `memcpy`, then sleeps (and spins the last few microseconds) until the modelled end, and
//! only then completes the copy. A `memcpy` slower than the model (a link faster than the
//! host's memory) ends when it really ends: the model is only meaningful for links well
//! below the host's copy bandwidth. Copies between device allocations
//! ([`Device::copy_on_device`](super::Device::copy_on_device)) cross no link: they run in
//! order, at memory speed.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::copy::{copy_bytes, Stores};
use super::SyncEvent;
use crate::error::Result;

/// A host-device link: every copy takes `latency + bytes / bytes_per_s`.
///
/// Parsed from `BANDWIDTH,LATENCY`, e.g. `4GB/s,10us` (GB = 10^9 bytes; also `MB/s`,
/// `GiB/s`, `MiB/s`; latency in `ns`, `us`, `ms` or `s`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Bytes per second (finite, positive).
    pub bytes_per_s: f64,
    /// The fixed time of every copy.
    pub latency: Duration,
}

impl LinkModel {
    /// A link of `bytes_per_s` bytes per second and `latency` per copy.
    pub fn new(bytes_per_s: f64, latency: Duration) -> Self {
        Self {
            bytes_per_s,
            latency,
        }
    }

    /// The bandwidth in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        self.bytes_per_s / 1e9
    }

    /// The modelled time of one copy of `bytes` bytes.
    pub fn copy_time(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bytes_per_s)
    }
}

impl fmt::Display for LinkModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = self.latency.as_secs_f64() * 1e6;
        write!(f, "{}GB/s,{}us", self.gbps(), us)
    }
}

impl FromStr for LinkModel {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (bandwidth, latency) = s
            .split_once(',')
            .ok_or_else(|| format!("`{s}`: expected BANDWIDTH,LATENCY (e.g. 4GB/s,10us)"))?;
        let bytes_per_s = parse_bandwidth(bandwidth.trim())?;
        let latency = parse_latency(latency.trim())?;
        Ok(Self::new(bytes_per_s, latency))
    }
}

/// Splits `12.5GB/s` into `12.5` and `GB/s`.
fn number_and_unit(s: &str) -> std::result::Result<(f64, &str), String> {
    let at = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(at);
    let number = number
        .parse::<f64>()
        .map_err(|_| format!("`{s}` does not start with a number"))?;
    Ok((number, unit.trim()))
}

fn parse_bandwidth(s: &str) -> std::result::Result<f64, String> {
    let (n, unit) = number_and_unit(s)?;
    let scale = match unit.to_ascii_lowercase().trim_end_matches("/s") {
        "gb" => 1e9,
        "mb" => 1e6,
        "kb" => 1e3,
        "b" => 1.0,
        "gib" => (1u64 << 30) as f64,
        "mib" => (1u64 << 20) as f64,
        _ => {
            return Err(format!(
                "`{s}`: a bandwidth is e.g. 4GB/s, 800MB/s, 12GiB/s"
            ))
        }
    };
    let v = n * scale;
    if v.is_finite() && v >= 1.0 {
        Ok(v)
    } else {
        Err(format!("`{s}`: the bandwidth must be positive"))
    }
}

fn parse_latency(s: &str) -> std::result::Result<Duration, String> {
    let (n, unit) = number_and_unit(s)?;
    let scale = match unit {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        _ => return Err(format!("`{s}`: a latency is e.g. 10us, 500ns, 1ms")),
    };
    let secs = n * scale;
    if secs.is_finite() && secs <= 10.0 {
        Ok(Duration::from_secs_f64(secs))
    } else {
        Err(format!("`{s}`: the latency must be at most 10 s"))
    }
}

/// One copy of the engine: `len` bytes from `src` to `dst`, over the link (`timed`) or
/// within the device.
struct Op {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    timed: bool,
    enqueued: Instant,
}

// SAFETY: the enqueuing caller guarantees (per `Device::copy_to_*`) that both ranges stay
// valid until the copy completes, whichever thread performs it.
unsafe impl Send for Op {}

#[derive(Default)]
struct State {
    queue: VecDeque<Op>,
    /// Copies enqueued since the engine started (the sequence number of the last).
    enqueued: u64,
    /// Copies completed, in order.
    completed: u64,
    shutdown: bool,
}

/// The copy engine: one thread performing the copies of one device, in order.
pub(crate) struct LinkEngine {
    model: LinkModel,
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for LinkEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("LinkEngine")
            .field("model", &self.model)
            .field("enqueued", &state.enqueued)
            .field("completed", &state.completed)
            .finish_non_exhaustive()
    }
}

impl LinkEngine {
    /// Starts the engine's thread.
    pub(crate) fn start(model: LinkModel) -> Result<Arc<Self>> {
        let engine = Arc::new(Self {
            model,
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            thread: Mutex::new(None),
        });
        let worker = engine.clone();
        let handle = std::thread::Builder::new()
            .name("devarrow-cpu-link".into())
            .spawn(move || worker.run())
            .map_err(|e| {
                crate::Error::InvalidArgument(format!("cannot start the copy engine: {e}"))
            })?;
        *engine.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(engine)
    }

    pub(crate) fn model(&self) -> LinkModel {
        self.model
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update of the state is complete under the lock; the engine does not panic
        // while holding it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues a copy and returns its sequence number.
    ///
    /// # Safety
    /// `src` must be valid for reads and `dst` for writes of `len` bytes, not overlapping,
    /// until the copy has completed (see [`LinkEngine::wait`]).
    pub(crate) unsafe fn enqueue(
        &self,
        src: *const u8,
        dst: *mut u8,
        len: usize,
        timed: bool,
    ) -> u64 {
        let mut state = self.state();
        state.enqueued += 1;
        state.queue.push_back(Op {
            src,
            dst,
            len,
            timed,
            enqueued: Instant::now(),
        });
        let seq = state.enqueued;
        drop(state);
        self.work.notify_one();
        seq
    }

    /// The sequence number of the last copy enqueued.
    pub(crate) fn last(&self) -> u64 {
        self.state().enqueued
    }

    /// Blocks until copy `seq` (and every copy before it) has completed.
    pub(crate) fn wait(&self, seq: u64) {
        let mut state = self.state();
        while state.completed < seq {
            state = self.done.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether copy `seq` has completed.
    pub(crate) fn is_complete(&self, seq: u64) -> bool {
        self.state().completed >= seq
    }

    /// Blocks until every copy enqueued so far has completed.
    pub(crate) fn synchronize(&self) {
        let last = self.last();
        self.wait(last);
    }

    /// Finishes every enqueued copy, then stops the thread.
    pub(crate) fn shutdown(&self) {
        self.state().shutdown = true;
        self.work.notify_one();
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }

    fn run(&self) {
        // The end of the last copy on the modelled timeline.
        let mut free_at = Instant::now();
        loop {
            let op = {
                let mut state = self.state();
                loop {
                    if let Some(op) = state.queue.pop_front() {
                        break op;
                    }
                    if state.shutdown {
                        return;
                    }
                    state = self.work.wait(state).unwrap_or_else(|e| e.into_inner());
                }
            };
            if op.len > 0 {
                // SAFETY: the enqueuer guaranteed both ranges valid and disjoint until this
                // copy completes, which is signalled below, after it.
                unsafe { copy_bytes(op.dst, op.src, op.len, Stores::for_bytes(op.len)) };
            }
            if op.timed {
                let copied = Instant::now();
                let end = op.enqueued.max(free_at) + self.model.copy_time(op.len);
                wait_until(end);
                // A late wake-up does not delay the next copy (the timeline absorbs it);
                // a memcpy slower than the model does.
                free_at = end.max(copied);
            }
            self.state().completed += 1;
            self.done.notify_all();
        }
    }
}

/// Sleeps until shortly before `deadline`, then yields until it has passed: a plain sleep
/// can overshoot by 50 µs and more (timer slack, scheduling), far more than a short copy.
fn wait_until(deadline: Instant) {
    const SPIN: Duration = Duration::from_micros(80);
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let left = deadline - now;
        if left > SPIN {
            std::thread::sleep(left - SPIN);
        } else {
            std::thread::yield_now();
        }
    }
}

/// An event of a CPU device with a link model: complete when the copy enqueued last before
/// it has completed.
#[derive(Debug)]
pub struct LinkEvent {
    engine: Arc<LinkEngine>,
    seq: u64,
}

impl LinkEvent {
    pub(crate) fn new(engine: Arc<LinkEngine>) -> Self {
        let seq = engine.last();
        Self { engine, seq }
    }

    /// Whether the event has completed (without blocking).
    pub fn is_complete(&self) -> bool {
        self.engine.is_complete(self.seq)
    }
}

// SAFETY: `wait_host` returns only once the engine has completed every copy up to the
// last one enqueued before the event (copies complete in order); the pointer is NULL.
unsafe impl SyncEvent for LinkEvent {
    /// NULL, once the event has completed: an `ARROW_DEVICE_CPU` array carries no event
    /// its consumer could wait on, so its data must be ready when it is handed out. This
    /// blocks until then.
    fn as_sync_event_ptr(&self) -> *mut std::ffi::c_void {
        self.engine.wait(self.seq);
        std::ptr::null_mut()
    }
    fn wait_host(&self) -> Result<()> {
        self.engine.wait(self.seq);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_models_parse() {
        let m: LinkModel = "4GB/s,10us".parse().unwrap();
        assert_eq!(m.bytes_per_s, 4e9);
        assert_eq!(m.latency, Duration::from_micros(10));
        assert_eq!(m.gbps(), 4.0);
        let m: LinkModel = " 800MB/s , 1.5ms ".parse().unwrap();
        assert_eq!(m.bytes_per_s, 8e8);
        assert_eq!(m.latency, Duration::from_micros(1500));
        let m: LinkModel = "1GiB/s,0ns".parse().unwrap();
        assert_eq!(m.bytes_per_s, (1u64 << 30) as f64);
        assert_eq!(m.latency, Duration::ZERO);
        assert_eq!(
            m.copy_time(1 << 30),
            Duration::from_secs(1),
            "a GiB at a GiB/s"
        );
        for bad in [
            "",
            "4GB/s",
            "4,10us",
            "x GB/s,1us",
            "4GB/s,10",
            "0GB/s,1us",
            "4GB/s,20s",
        ] {
            assert!(bad.parse::<LinkModel>().is_err(), "{bad}");
        }
        let m: LinkModel = "4GB/s,10us".parse().unwrap();
        assert_eq!(m.to_string().parse::<LinkModel>().unwrap(), m);
    }

    #[test]
    fn copies_complete_in_order() {
        let engine = LinkEngine::start(LinkModel::new(1e12, Duration::ZERO)).unwrap();
        let src: Vec<u8> = (0..=255).collect();
        let mut dst = vec![0u8; 256];
        // One raw pointer for all four copies: reborrowing `dst` for each would retag the
        // bytes the engine thread may be writing already (a data race, Miri says).
        let dst_ptr = dst.as_mut_ptr();
        let mut seqs = Vec::new();
        for i in 0..4 {
            // SAFETY: both ranges live until the `synchronize` below, and `dst` is not
            // touched through a reference before then.
            seqs.push(unsafe {
                engine.enqueue(src[i * 64..].as_ptr(), dst_ptr.add(i * 64), 64, i % 2 == 0)
            });
        }
        assert_eq!(seqs, vec![1, 2, 3, 4]);
        let event = LinkEvent::new(engine.clone());
        event.wait_host().unwrap();
        assert!(event.is_complete());
        engine.synchronize();
        assert_eq!(dst, src);
        engine.shutdown();
    }
}
