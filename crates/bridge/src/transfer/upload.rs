//! The staged upload pipeline: packing on several threads at once, each thread a whole
//! window of its own, while the calling thread enqueues the copies of the windows already
//! packed.
//!
//! The only GPU run so far (an H200 on PCIe 5, 16 cores, 2026-11-28, at `9615f3d`; nothing
//! since, this pipeline included, has run on a GPU) suggested why a window must not be
//! packed by all threads together: packing alone ran at 44 GiB/s and copying a packed batch
//! at 46 GiB/s, yet the two in one pipeline gave 12–18 GB/s, with the host packing 93 ms of
//! 107. Each window was a fork-join over the thread pool (a few µs to hand out the work,
//! tens of µs to wake threads that went to sleep while the calling thread waited for a
//! staging buffer), and nothing was packed while the calling thread enqueued a copy or
//! waited. Here each worker packs one window at a time on its own (a single thread copies
//! 5–10 GB/s), workers run ahead of the copies by as many windows as the staging buffers
//! allow, and the calling thread ([`Pipeline::run`], the *dispatcher*) does nothing but
//! enqueue, in image order, the copy of each window as soon as it is packed, and hand a
//! staging buffer back to the workers once the copy that read it has completed.
//!
//! Only the dispatcher calls the device: workers read host buffers and write staging
//! memory, nothing else, so a device whose calls must come from one thread (a CUDA
//! context current on it) needs nothing more.
//!
//! ## The protocol
//!
//! With `S` staging buffers (slots) and windows `0..n`, window `k` is packed into slot
//! `k % S`. Workers claim windows in order (an atomic counter) and may pack window `k`
//! once it is *granted*: its slot's last copy (window `k - S`) has completed. The
//! dispatcher, at step `k`: waits until window `k` is packed; enqueues its copy and
//! records an event in its slot; then, once `D` copies are in flight, waits for the
//! oldest (window `k - D`, normally long done) and grants window `k - D + S`. So up to
//! `D + 1` copies are queued on the device and workers pack up to `S - D` windows ahead.
//!
//! Progress never depends on a worker that has not started: a worker that claims a window
//! packs it (waiting only for its grant, which depends on earlier windows alone), and
//! while no worker has started (a busy or single-threaded pool), the dispatcher packs the
//! windows itself.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use arrow_buffer::Buffer;
use devarrow_abi::device::{Device, SyncEvent};
use devarrow_abi::{Error, Result};

use crate::transfer::pack::{equal_windows, pack_range_uninit};
use crate::transfer::stages::StageTimes;

/// One window of the pipeline: bytes `start..end` of image `image`, copied to
/// `dst_base + start` on the device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    pub(crate) image: usize,
    pub(crate) start: usize,
    pub(crate) end: usize,
}

/// What one image packs from: its segments (`(bytes, image offset)`, in image order) and
/// the device address of its first byte.
pub(crate) struct Image<'a> {
    pub(crate) segments: &'a [(Buffer, usize)],
    pub(crate) dst_base: usize,
}

/// A staging buffer the pipeline may write: its first byte and its size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot {
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

/// The slots of one call, shared with the workers.
struct Slots(Vec<Slot>);

// SAFETY: the slots are staging memory owned by the transfer for the whole call; the
// protocol above gives each slot to one window at a time (a worker writes it, then the
// dispatcher's copy reads it, and only after that copy completed is it granted again), so
// no two threads ever access one slot's bytes at once.
unsafe impl Sync for Slots {}
// SAFETY: as above; the pointers are not tied to a thread.
unsafe impl Send for Slots {}

impl Slots {
    /// Slot `i` (a method, so that closures capture the whole `Sync` wrapper).
    fn get(&self, i: usize) -> Slot {
        self.0[i]
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Default)]
struct Shared {
    /// Windows below this may be packed.
    granted: usize,
    /// Which windows are packed (by window index).
    packed: Vec<bool>,
    /// Set when the dispatcher gives up (an error): workers stop.
    failed: bool,
    /// A worker's panic, re-raised by the dispatcher.
    panic: Option<Box<dyn std::any::Any + Send>>,
}

struct State {
    shared: Mutex<Shared>,
    changed: Condvar,
    /// The next window to claim.
    next: AtomicUsize,
    /// Workers that have started.
    started: AtomicUsize,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        // Every update is a single assignment: a panic elsewhere leaves it consistent.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The pipeline of one call: the windows, the images they come from, the slots.
pub(crate) struct Pipeline<'a> {
    pub(crate) images: &'a [Image<'a>],
    pub(crate) windows: &'a [Window],
    /// The staging buffers; each at least as large as the largest window.
    pub(crate) slots: &'a [Slot],
    /// Each slot's last copy, from earlier calls (waited for before the slot is reused)
    /// and, when the call returns, from this one.
    pub(crate) pending: &'a mut [Option<Arc<dyn SyncEvent>>],
    /// Worker threads (of the rayon pool) packing windows.
    pub(crate) workers: usize,
    /// How many copies may be queued on the device before the dispatcher waits for the
    /// oldest to hand its slot back.
    pub(crate) in_flight: usize,
}

impl Pipeline<'_> {
    /// Packs every window and enqueues its copy on `device`, in order; returns once the
    /// last copy is enqueued (the slots' events, in `pending`, say when each copy
    /// completed). Adds the dispatcher's time waiting for packed windows to `times.pack`
    /// and its time enqueueing and waiting for copies to `times.copy`.
    pub(crate) fn run(self, device: &dyn Device, times: &mut StageTimes) -> Result<()> {
        let Pipeline {
            images,
            windows,
            slots,
            pending,
            workers,
            in_flight,
        } = self;
        let n = windows.len();
        if n == 0 {
            return Ok(());
        }
        let s = slots.len();
        if s == 0 || pending.len() != s {
            return Err(Error::InvalidArgument(format!(
                "an upload pipeline of {s} staging buffers ({} events)",
                pending.len()
            )));
        }
        let largest = windows.iter().map(|w| w.end - w.start).max().unwrap_or(0);
        if slots.iter().any(|slot| slot.len < largest) {
            return Err(Error::InvalidArgument(format!(
                "a staging buffer smaller than a window of {largest} bytes"
            )));
        }
        let in_flight = in_flight.min(s - 1);
        let slots = Slots(slots.to_vec());
        let state = State {
            shared: Mutex::new(Shared {
                granted: 0,
                packed: vec![false; n],
                ..Default::default()
            }),
            changed: Condvar::new(),
            next: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
        };
        let pack = |k: usize| {
            let w = windows[k];
            let slot = slots.get(k % s);
            // `slot` is at least as large as every window (checked above).
            // SAFETY: the protocol gives slot `k % s` to window `k` alone until its copy
            // completed (see `Slots`); the bytes are only written through this view.
            let out = unsafe {
                std::slice::from_raw_parts_mut(slot.ptr.cast::<MaybeUninit<u8>>(), w.end - w.start)
            };
            pack_range_uninit(images[w.image].segments, w.start, out);
        };
        let worker = || {
            state.started.fetch_add(1, Ordering::AcqRel);
            loop {
                let k = state.next.fetch_add(1, Ordering::AcqRel);
                if k >= n {
                    return;
                }
                {
                    let mut shared = state.lock();
                    while shared.granted <= k && !shared.failed {
                        shared = state
                            .changed
                            .wait(shared)
                            .unwrap_or_else(|e| e.into_inner());
                    }
                    if shared.failed {
                        return;
                    }
                }
                if let Err(panic) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pack(k)))
                {
                    let mut shared = state.lock();
                    shared.failed = true;
                    shared.panic = Some(panic);
                    drop(shared);
                    state.changed.notify_all();
                    return;
                }
                state.lock().packed[k] = true;
                state.changed.notify_all();
            }
        };
        let mut result = Ok(());
        rayon::in_place_scope(|scope| {
            for _ in 0..workers.min(n) {
                scope.spawn(|_| worker());
            }
            // A panic of the dispatcher (or of a pack it does itself) must release the
            // workers waiting for a grant before it unwinds, or the scope would wait for
            // them forever.
            let dispatched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                dispatch(
                    device, &state, &pack, windows, images, &slots, pending, in_flight, times,
                )
            }));
            match dispatched {
                Ok(r) => result = r,
                Err(panic) => {
                    state.lock().panic.get_or_insert(panic);
                    result = Err(Error::InvalidArgument(
                        "the upload pipeline's dispatcher panicked".into(),
                    ));
                }
            }
            if result.is_err() {
                state.lock().failed = true;
                state.changed.notify_all();
            }
        });
        if let Some(panic) = state.lock().panic.take() {
            std::panic::resume_unwind(panic);
        }
        result
    }
}

/// The dispatcher's side of [`Pipeline::run`].
#[allow(clippy::too_many_arguments)]
fn dispatch(
    device: &dyn Device,
    state: &State,
    pack: &(dyn Fn(usize) + Sync),
    windows: &[Window],
    images: &[Image<'_>],
    slots: &Slots,
    pending: &mut [Option<Arc<dyn SyncEvent>>],
    in_flight: usize,
    times: &mut StageTimes,
) -> Result<()> {
    let (n, s) = (windows.len(), slots.len());
    // The first use of each slot in this call: its last copy (of an earlier call) must
    // have completed. Normally long done.
    let start = Instant::now();
    for event in pending.iter_mut().take(n).filter_map(Option::take) {
        event.wait_host()?;
    }
    grant(state, n.min(s));
    times.copy += start.elapsed();
    for k in 0..n {
        let waiting = Instant::now();
        wait_packed(state, pack, k, n)?;
        let packed = Instant::now();
        times.pack += packed - waiting;
        let w = windows[k];
        let slot = slots.get(k % s);
        let dst = (images[w.image].dst_base + w.start) as *mut std::ffi::c_void;
        // The slot holds the packed window (`wait_packed`), and is not written again
        // until the event recorded next has completed (it is granted again only then).
        // SAFETY: `slot.ptr` is valid for the window's length (checked by `run`); `dst`
        // lies inside the image's device region, which the caller allocated.
        unsafe { device.copy_to_device(slot.ptr, dst, w.end - w.start)? };
        pending[k % s] = Some(device.record_event()?);
        if k >= in_flight {
            let oldest = k - in_flight;
            if oldest + s < n {
                if let Some(event) = pending[oldest % s].take() {
                    event.wait_host()?;
                }
                grant(state, oldest + s + 1);
            }
        }
        times.copy += packed.elapsed();
    }
    Ok(())
}

/// Grants every window below `upto`.
fn grant(state: &State, upto: usize) {
    let mut shared = state.lock();
    if upto > shared.granted {
        shared.granted = upto;
        drop(shared);
        state.changed.notify_all();
    }
}

/// Waits until window `k` is packed. While no worker has started, the dispatcher claims
/// and packs windows itself (they are granted: it only packs what it granted).
fn wait_packed(state: &State, pack: &(dyn Fn(usize) + Sync), k: usize, n: usize) -> Result<()> {
    loop {
        {
            let shared = state.lock();
            if shared.packed[k] {
                return Ok(());
            }
            if shared.failed {
                return Err(Error::InvalidArgument(
                    "a worker of the upload pipeline failed".into(),
                ));
            }
            if state.started.load(Ordering::Acquire) > 0 {
                // A worker runs: it (or another) has claimed or will claim window k.
                let shared = state
                    .changed
                    .wait_while(shared, |sh| !sh.packed[k] && !sh.failed)
                    .unwrap_or_else(|e| e.into_inner());
                if shared.packed[k] {
                    return Ok(());
                }
                continue;
            }
            let claimable = state.next.load(Ordering::Acquire);
            if claimable >= n || claimable >= shared.granted {
                // Claimed by a worker that has started since, or not granted: wait.
                let _unused = state
                    .changed
                    .wait_timeout(shared, std::time::Duration::from_micros(50))
                    .unwrap_or_else(|e| e.into_inner());
                continue;
            }
        }
        // No worker has started: claim the next window and pack it here.
        let c = state.next.fetch_add(1, Ordering::AcqRel);
        if c >= n {
            continue;
        }
        pack(c);
        state.lock().packed[c] = true;
        state.changed.notify_all();
    }
}

/// Cuts `ranges` (byte ranges of image `image`) into equal windows of at most `size`
/// bytes ([`equal_windows`]).
pub(crate) fn cut_windows(
    image: usize,
    ranges: &[std::ops::Range<usize>],
    size: usize,
    out: &mut Vec<Window>,
) {
    for r in ranges {
        out.extend(
            equal_windows(r.start, r.end, size)
                .into_iter()
                .map(|(start, end)| Window { image, start, end }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devarrow_abi::device::{CopyCounter, CpuDevice};

    fn segments(lens: &[usize]) -> (Vec<(Buffer, usize)>, usize) {
        let mut segs = Vec::new();
        let mut at = 0usize;
        for (i, len) in lens.iter().enumerate() {
            let bytes: Vec<u8> = (0..*len).map(|j| (j * 13 + i * 7) as u8).collect();
            segs.push((Buffer::from_vec(bytes), at));
            at = (at + len).next_multiple_of(64);
        }
        let total = segs.last().map_or(0, |(b, a)| a + b.len());
        (segs, total)
    }

    fn run(workers: usize, slots: usize, in_flight: usize, max: usize, link: bool) {
        let device = Arc::new(if link {
            CpuDevice::with_link("50GB/s,1us".parse().unwrap())
        } else {
            CpuDevice::new()
        });
        // Smaller under Miri (interpreted), with the same shape: windows that cut
        // segments, segments shorter than a window.
        let scale = if cfg!(miri) { 64 } else { 1 };
        // The staging slots too (each slot's bytes are written and read interpreted).
        let max = max / scale;
        let lens = [
            5usize,
            700_000 / scale,
            3,
            2_000_000 / scale,
            64,
            1_500_001 / scale,
        ];
        let (a, total_a) = segments(&lens);
        let (b, total_b) = segments(&lens[1..]);
        let mem_a = device.allocate(total_a).unwrap();
        let mem_b = device.allocate(total_b).unwrap();
        let images = [
            Image {
                segments: &a,
                dst_base: mem_a.address() as usize,
            },
            Image {
                segments: &b,
                dst_base: mem_b.address() as usize,
            },
        ];
        let mut windows = Vec::new();
        cut_windows(
            0,
            std::slice::from_ref(&(0..total_a)),
            max.min((1 << 19) / scale),
            &mut windows,
        );
        cut_windows(
            1,
            std::slice::from_ref(&(0..total_b)),
            max.min((1 << 19) / scale),
            &mut windows,
        );
        let mut staging: Vec<_> = (0..slots)
            .map(|_| device.allocate_staging(max).unwrap())
            .collect();
        let slot_list: Vec<Slot> = staging
            .iter_mut()
            .map(|m| Slot {
                ptr: m.as_mut_slice().as_mut_ptr(),
                len: m.as_slice().len(),
            })
            .collect();
        let mut pending = vec![None; slots];
        let mut times = StageTimes::default();
        Pipeline {
            images: &images,
            windows: &windows,
            slots: &slot_list,
            pending: &mut pending,
            workers,
            in_flight,
        }
        .run(device.as_ref(), &mut times)
        .unwrap();
        device.synchronize().unwrap();
        for (segs, mem) in [(&a, &mem_a), (&b, &mem_b)] {
            // SAFETY: CPU device memory is host memory; the copies completed above.
            let bytes =
                unsafe { std::slice::from_raw_parts(mem.address().cast::<u8>(), mem.len()) };
            for (buf, at) in segs.iter() {
                assert_eq!(&bytes[*at..at + buf.len()], buf.as_slice());
            }
        }
        assert_eq!(device.copy_count() as usize, windows.len());
    }

    #[test]
    fn every_window_arrives_whatever_the_geometry() {
        // The link engine waits out modelled time: far too slow interpreted.
        let links: &[bool] = if cfg!(miri) { &[false] } else { &[false, true] };
        for &link in links {
            for (workers, slots, in_flight) in
                [(0, 2, 1), (1, 2, 1), (2, 3, 1), (4, 8, 2), (8, 4, 3)]
            {
                run(workers, slots, in_flight, 1 << 20, link);
            }
        }
        if !cfg!(miri) {
            run(3, 5, 2, 4 << 20, true);
        }
    }

    #[test]
    fn ranges_are_cut_in_equal_windows() {
        let mut out = Vec::new();
        cut_windows(0, &[0..100, 200..(200 + (20 << 20))], 8 << 20, &mut out);
        assert_eq!(out.len(), 1 + 3);
        assert!(out.iter().all(|w| w.end - w.start <= 8 << 20));
        assert_eq!((out[0].start, out[0].end), (0, 100));
        assert_eq!(out[1].start, 200);
        assert_eq!(out.last().unwrap().end, 200 + (20 << 20));
        assert!(out.windows(2).skip(1).all(|p| p[0].end == p[1].start));
    }
}
