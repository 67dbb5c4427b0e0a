//! The measurements: devarrow's transfer of a set of batches each way, raw pinned and
//! pageable copies of the same byte count, and the buffer-by-buffer baseline, all on
//! one device, each timed until its copies have completed.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::baseline::{BufferByBuffer, RawCopy};
use arrow_array::RecordBatch;
use devarrow::abi::device::copy::{copy_bytes, Stores};
use devarrow::abi::device::{CopyCounter, Device, HostPool, MemoryPoolPolicy};
use devarrow::bridge::{DeviceBatch, StageTimes, Transfer, TransferOptions};

use super::progress::Stage;
use super::JobError;

/// A device as the job measures it: a [`Device`] whose pool the job sizes
/// ([`MemoryPoolPolicy`]) and whose copies it counts ([`CopyCounter`]). The CPU and CUDA
/// devices are.
pub trait JobDevice: Device + MemoryPoolPolicy + CopyCounter {}

impl<T: Device + MemoryPoolPolicy + CopyCounter + ?Sized> JobDevice for T {}

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// devarrow's `Transfer` (packed, staged through pinned memory, asynchronous).
    Devarrow,
    /// One raw copy of all the bytes from or to pinned (staging) memory: the link's
    /// ceiling.
    Pinned,
    /// One raw copy of all the bytes from or to pageable memory.
    Pageable,
    /// One allocation and one synchronous copy per Arrow buffer.
    BufferByBuffer,
}

impl Method {
    /// Every method, in the order reported.
    pub const ALL: [Method; 4] = [
        Method::Devarrow,
        Method::Pinned,
        Method::Pageable,
        Method::BufferByBuffer,
    ];

    /// The identifier used in JSON and in the chart.
    pub fn key(self) -> &'static str {
        match self {
            Self::Devarrow => "devarrow",
            Self::Pinned => "pinned",
            Self::Pageable => "pageable",
            Self::BufferByBuffer => "buffer_by_buffer",
        }
    }

    /// The short name printed above a column.
    pub fn short_label(self) -> &'static str {
        match self {
            Self::Devarrow => "devarrow",
            Self::Pinned => "raw pinned",
            Self::Pageable => "raw pageable",
            Self::BufferByBuffer => "buffer by buf.",
        }
    }

    /// The name printed.
    pub fn label(self) -> &'static str {
        match self {
            Self::Devarrow => "devarrow",
            Self::Pinned => "raw pinned copy",
            Self::Pageable => "raw pageable copy",
            Self::BufferByBuffer => "buffer by buffer",
        }
    }
}

/// A direction of transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host to device.
    HostToDevice,
    /// Device to host.
    DeviceToHost,
}

impl Direction {
    /// Both directions, in the order reported.
    pub const ALL: [Direction; 2] = [Direction::HostToDevice, Direction::DeviceToHost];

    /// The identifier used in JSON and in the chart.
    pub fn key(self) -> &'static str {
        match self {
            Self::HostToDevice => "host_to_device",
            Self::DeviceToHost => "device_to_host",
        }
    }

    /// The name printed.
    pub fn label(self) -> &'static str {
        match self {
            Self::HostToDevice => "host -> device",
            Self::DeviceToHost => "device -> host",
        }
    }

    /// The short name printed in tables and legends.
    pub fn short(self) -> &'static str {
        match self {
            Self::HostToDevice => "H2D",
            Self::DeviceToHost => "D2H",
        }
    }
}

/// The timings of one method in one direction.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    /// What was measured.
    pub method: Method,
    /// Which way.
    pub direction: Direction,
    /// Bytes moved per repetition.
    pub bytes: usize,
    /// Copies issued per repetition.
    pub copies: u64,
    /// devarrow's host time per stage, the mean of the timed repetitions.
    pub stages: Option<StageTimes>,
    /// The time of every timed repetition (the warm-up excluded).
    pub times: Vec<Duration>,
}

impl Timing {
    /// The fastest repetition.
    pub fn best(&self) -> Duration {
        self.times.iter().copied().min().unwrap_or_default()
    }

    /// The median repetition.
    pub fn median(&self) -> Duration {
        let mut t = self.times.clone();
        t.sort_unstable();
        t.get(t.len() / 2).copied().unwrap_or_default()
    }

    /// Bandwidth of the best repetition in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        gbps(self.bytes, self.best())
    }
}

/// `bytes` in `time`, in GB/s (0 for a zero time).
pub fn gbps(bytes: usize, time: Duration) -> f64 {
    let s = time.as_secs_f64();
    if s > 0.0 {
        bytes as f64 / s / 1e9
    } else {
        0.0
    }
}

/// Every measurement at one batch size.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// The batch size asked for, in rows.
    pub batch_rows: usize,
    /// The number of batches.
    pub batches: usize,
    /// Rows in all batches.
    pub rows: usize,
    /// The largest batch, in rows.
    pub max_batch_rows: usize,
    /// Every method in both directions.
    pub timings: Vec<Timing>,
    /// Whether every batch came back from the device equal to the input.
    pub verified: bool,
    /// devarrow on several devices at once (`--device cuda:0,1`, `cuda:all`); `None` on
    /// one device.
    pub multi: Option<MultiPoint>,
    /// The host's own ceilings for the same bytes, measured in the same run.
    pub ceilings: Option<HostCeilings>,
    /// Why devarrow's downloads fell back from pinned to pageable memory, if they did
    /// (`Transfer::host_memory_note`), and how many batches landed where.
    pub host_memory: Option<HostMemory>,
}

/// Where devarrow's downloads landed (the last timed repetition).
#[derive(Debug, Clone, PartialEq)]
pub struct HostMemory {
    /// Batches copied straight into pinned memory of the transfer's pool.
    pub pinned: u64,
    /// Batches that went through staging into pageable memory.
    pub pageable: u64,
    /// Why, where some did.
    pub note: Option<String>,
}

/// What the host itself does with the same bytes, in the same run: the ceilings of the
/// host side of a transfer, so that a host-side stall shows as a ratio beside them
/// (a link model hides it).
///
/// - `pinned`: a parallel copy (the threads devarrow packs with) from ordinary memory into
///   pinned staging memory: what packing an upload can reach;
/// - `faulted`: the same into ordinary memory already faulted in: what the host side of a
///   download into pageable memory can reach;
/// - `gather`: a parallel copy of the batches' own arrow-rs buffers, in order, split by
///   bytes over the same threads, into pinned memory: what packing can reach from the
///   memory the batches lie in (their buffers are many and scattered, where `pinned`
///   reads one contiguous range), so that the two ratios tell devarrow's own cost from
///   its source's.
///
/// Each is measured two ways: a plain `memcpy` (cached stores) and streaming
/// (non-temporal) stores (`devarrow::abi::device::copy`, what devarrow packs and unpacks
/// with), and is the better of the two ([`Ceiling::best`]). A ceiling is the best the host
/// can do: devarrow at more than 1.0x of one points to a wrong ceiling, not a fast
/// devarrow (a memcpy alone was such a ceiling: devarrow's streaming stores reached
/// 1.6-1.7x of it on a 2-core machine).
///
/// At most [`CEILING_BYTES`] are copied (the rate does not depend on more). The copies
/// take turns within each repetition (memcpy and streaming in alternating order), so that
/// a machine whose speed drifts (a shared VM) drifts for all of them alike.
#[derive(Debug, Clone, PartialEq)]
pub struct HostCeilings {
    /// Threads of each copy.
    pub threads: usize,
    /// Bytes of each copy into pinned and into faulted memory.
    pub bytes: usize,
    /// Into pinned memory.
    pub pinned: Ceiling,
    /// Into pre-faulted memory.
    pub faulted: Ceiling,
    /// The batches' buffers gathered into pinned memory (`bytes` 0: not measured).
    pub gather: Ceiling,
}

/// How a ceiling's copy writes its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyStores {
    /// A plain `memcpy` (`copy_from_slice`): cached stores, or whatever glibc chooses.
    Memcpy,
    /// Streaming (non-temporal) stores, as devarrow packs and unpacks.
    Streaming,
}

impl CopyStores {
    /// The name in JSON and in the report.
    pub fn key(self) -> &'static str {
        match self {
            Self::Memcpy => "memcpy",
            Self::Streaming => "streaming",
        }
    }
}

/// One host ceiling, measured with a plain memcpy and with streaming stores in the same
/// repetitions.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Ceiling {
    /// Bytes of each copy (0: not measured).
    pub bytes: usize,
    /// Every timed repetition with a plain memcpy.
    pub memcpy: Vec<Duration>,
    /// Every timed repetition with streaming stores.
    pub streaming: Vec<Duration>,
}

impl Ceiling {
    /// The plain memcpy's GB/s (best repetition); `None` when not measured.
    pub fn memcpy_gbps(&self) -> Option<f64> {
        rate(self.bytes, &self.memcpy)
    }

    /// The streaming stores' GB/s (best repetition); `None` when not measured.
    pub fn streaming_gbps(&self) -> Option<f64> {
        rate(self.bytes, &self.streaming)
    }

    /// The ceiling: the better of the two ways, and which it was; `None` when neither was
    /// measured.
    pub fn best(&self) -> Option<(f64, CopyStores)> {
        better(self.memcpy_gbps(), self.streaming_gbps())
    }

    /// The ceiling in GB/s (0 when not measured).
    pub fn gbps(&self) -> f64 {
        self.best().map_or(0.0, |(g, _)| g)
    }
}

/// `bytes` over the best of `times` in GB/s; `None` for no bytes, no times or a zero time.
fn rate(bytes: usize, times: &[Duration]) -> Option<f64> {
    (bytes > 0 && !times.is_empty())
        .then(|| gbps(bytes, best(times)))
        .filter(|g| *g > 0.0)
}

/// The better of a memcpy's and streaming stores' GB/s (a tie goes to the memcpy), and
/// which it was; `None` when neither was measured.
pub fn better(memcpy: Option<f64>, streaming: Option<f64>) -> Option<(f64, CopyStores)> {
    match (memcpy, streaming) {
        (Some(m), Some(s)) if s > m => Some((s, CopyStores::Streaming)),
        (Some(m), _) => Some((m, CopyStores::Memcpy)),
        (None, Some(s)) => Some((s, CopyStores::Streaming)),
        (None, None) => None,
    }
}

/// The most pinned host memory the job lets devarrow's downloads land in: 64 GiB.
pub const PINNED_POOL_MAX_BYTES: usize = 64 << 30;

/// The most bytes a ceiling copies: 1 GiB.
pub const CEILING_BYTES: usize = 1 << 30;

impl HostCeilings {
    /// The ceiling into pinned memory, GB/s (the better way, best repetition).
    pub fn pinned_gbps(&self) -> f64 {
        self.pinned.gbps()
    }

    /// The ceiling into pre-faulted memory, GB/s (the better way, best repetition).
    pub fn faulted_gbps(&self) -> f64 {
        self.faulted.gbps()
    }

    /// The gather of the batches' buffers into pinned memory, GB/s (the better way, best
    /// repetition); `None` when not measured.
    pub fn gather_gbps(&self) -> Option<f64> {
        self.gather.best().map(|(g, _)| g)
    }

    /// Measures all three, each with a memcpy and with streaming stores, on `device` (its
    /// staging memory) for `bytes` bytes (at most [`CEILING_BYTES`]), the gather from the
    /// buffers of `batches` (none: not measured), `reps` timed repetitions after one
    /// warm-up each.
    pub fn measure(
        device: &Arc<dyn Device>,
        bytes: usize,
        batches: &[RecordBatch],
        reps: usize,
    ) -> devarrow::abi::Result<Self> {
        let threads = devarrow::bridge::pack::Parallelism::new(0, 0).threads;
        let bytes = bytes.clamp(1, CEILING_BYTES);
        // The source: ordinary memory, written (faulted in) before anything is timed.
        let source = vec![0x5au8; bytes];
        let mut pinned = device.allocate_staging(bytes)?;
        let mut faulted = vec![0u8; bytes];
        faulted.fill(1);
        // The batches' buffers, as many as fit in `bytes`.
        let mut buffers = Vec::new();
        for batch in batches {
            for column in batch.columns() {
                crate::footprint::for_each_buffer(&column.to_data(), &mut |b| {
                    buffers.push(b.clone())
                });
            }
        }
        let mut gather_bytes = 0;
        let sources: Vec<&[u8]> = buffers
            .iter()
            .map(arrow_buffer::Buffer::as_slice)
            .take_while(|b| {
                gather_bytes += b.len();
                gather_bytes <= bytes
            })
            .collect();
        let gather_bytes: usize = sources.iter().map(|b| b.len()).sum();
        let mut ceilings = Self {
            threads,
            bytes,
            pinned: Ceiling {
                bytes,
                ..Ceiling::default()
            },
            faulted: Ceiling {
                bytes,
                ..Ceiling::default()
            },
            gather: Ceiling {
                bytes: gather_bytes,
                ..Ceiling::default()
            },
        };
        let timed = |f: &mut dyn FnMut()| {
            let start = Instant::now();
            f();
            start.elapsed()
        };
        for rep in 0..=reps {
            // Alternate which way goes first, so that neither always finds the caches as
            // the other left them.
            let order = if rep % 2 == 0 {
                [CopyStores::Memcpy, CopyStores::Streaming]
            } else {
                [CopyStores::Streaming, CopyStores::Memcpy]
            };
            for stores in order {
                let p = timed(&mut || {
                    parallel_copy(
                        &mut pinned.as_mut_slice()[..bytes],
                        &source,
                        threads,
                        stores,
                    )
                });
                let f = timed(&mut || parallel_copy(&mut faulted, &source, threads, stores));
                let g = timed(&mut || {
                    parallel_gather(
                        &mut pinned.as_mut_slice()[..gather_bytes],
                        &sources,
                        threads,
                        stores,
                    )
                });
                if rep == 0 {
                    continue;
                }
                for (ceiling, time) in [
                    (&mut ceilings.pinned, p),
                    (&mut ceilings.faulted, f),
                    (&mut ceilings.gather, g),
                ] {
                    if ceiling.bytes == 0 {
                        continue;
                    }
                    match stores {
                        CopyStores::Memcpy => ceiling.memcpy.push(time),
                        CopyStores::Streaming => ceiling.streaming.push(time),
                    }
                }
            }
        }
        Ok(ceilings)
    }
}

/// Copies `src` into `dst` (same length) with `stores`.
fn copy_with(dst: &mut [u8], src: &[u8], stores: CopyStores) {
    match stores {
        CopyStores::Memcpy => dst.copy_from_slice(src),
        CopyStores::Streaming => {
            assert_eq!(
                dst.len(),
                src.len(),
                "copy between ranges of different lengths"
            );
            // SAFETY: `dst` is valid for `src.len()` writes (same length, exclusively
            // borrowed), `src` for as many reads; a `&mut` and a `&` cannot overlap.
            unsafe { copy_bytes(dst.as_mut_ptr(), src.as_ptr(), src.len(), Stores::Streaming) }
        }
    }
}

/// Copies `sources`, one after the other, into `dst` (their total length) on `threads`
/// scoped threads, each an equal byte range of `dst` (a source may be split between two),
/// with `stores`.
fn parallel_gather(dst: &mut [u8], sources: &[&[u8]], threads: usize, stores: CopyStores) {
    let part = dst.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let mut sources = sources.iter().copied();
        let mut pending: &[u8] = &[];
        for chunk in dst.chunks_mut(part) {
            // The sources (and parts of them) that fill `chunk`.
            let mut pieces = Vec::new();
            let mut room = chunk.len();
            while room > 0 {
                if pending.is_empty() {
                    match sources.next() {
                        Some(next) => pending = next,
                        None => break,
                    }
                }
                let (piece, rest) = pending.split_at(pending.len().min(room));
                pieces.push(piece);
                room -= piece.len();
                pending = rest;
            }
            scope.spawn(move || {
                let mut at = 0;
                for piece in pieces {
                    copy_with(&mut chunk[at..at + piece.len()], piece, stores);
                    at += piece.len();
                }
            });
        }
    });
}

/// This machine's parallel copy rate into (the CPU device's) pinned memory, bytes per
/// second: 256 MiB with the threads devarrow packs with, the better of a memcpy and
/// streaming stores, best of 3 after a warm-up.
pub fn host_memcpy_rate() -> f64 {
    let device: Arc<dyn Device> = Arc::new(devarrow::abi::device::CpuDevice::new());
    match HostCeilings::measure(&device, 256 << 20, &[], 3) {
        Ok(c) => c.pinned_gbps() * 1e9,
        // The CPU device's staging is plain host memory: it fails only out of memory.
        Err(_) => 4e9,
    }
}

/// `src` copied into `dst` (same length) with `stores` on `threads` scoped threads, each
/// an equal part.
fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize, stores: CopyStores) {
    let part = src.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || copy_with(d, s, stores));
        }
    });
}

/// `bytes` of `batches` batches in memory rounded up by size class (at most a quarter)
/// and aligned per batch: what a pool must hold to keep them all.
fn with_headroom(bytes: usize, batches: usize) -> usize {
    bytes + bytes / 4 + batches * 4096
}

/// What a device's pool keeps for a repetition of `batches`: their bytes with headroom,
/// and never less than a pool's default 1 GiB.
fn pool_retention<'a>(batches: impl ExactSizeIterator<Item = &'a RecordBatch>) -> usize {
    let count = batches.len();
    let mut allocations = crate::footprint::Allocations::new();
    batches.for_each(|batch| allocations.add_batch(batch));
    with_headroom(allocations.bytes(), count).max(1 << 30)
}

/// devarrow's figures on one device of a run on several.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceShare {
    /// `cuda:N`.
    pub id: String,
    /// The batches this device got (round-robin).
    pub batches: usize,
    /// Device bytes of those batches, per repetition and direction.
    pub bytes: usize,
    /// Host to device: this device's time of every timed repetition, from the common
    /// start until its last batch had arrived.
    pub to_device: Vec<Duration>,
    /// Device to host: likewise, until its batches were rebuilt on the host.
    pub to_host: Vec<Duration>,
}

impl DeviceShare {
    /// Bandwidth of the best repetition in `direction`, in GB/s.
    pub fn gbps(&self, direction: Direction) -> f64 {
        gbps(self.bytes, self.best(direction))
    }

    /// The best repetition in `direction`.
    pub fn best(&self, direction: Direction) -> Duration {
        match direction {
            Direction::HostToDevice => best(&self.to_device),
            Direction::DeviceToHost => best(&self.to_host),
        }
    }
}

/// devarrow on several devices at once: each device's figures, and the wall time of the
/// whole (all devices, started together, until the last has finished).
#[derive(Debug, Clone, PartialEq)]
pub struct MultiPoint {
    /// One per device, in the order asked for.
    pub shares: Vec<DeviceShare>,
    /// Host to device: the wall time of every timed repetition.
    pub wall_to_device: Vec<Duration>,
    /// Device to host: the wall time of every timed repetition.
    pub wall_to_host: Vec<Duration>,
}

impl MultiPoint {
    /// Bytes moved per repetition and direction, all devices together.
    pub fn bytes(&self) -> usize {
        self.shares.iter().map(|s| s.bytes).sum()
    }

    /// The best wall time in `direction`.
    pub fn best_wall(&self, direction: Direction) -> Duration {
        match direction {
            Direction::HostToDevice => best(&self.wall_to_device),
            Direction::DeviceToHost => best(&self.wall_to_host),
        }
    }

    /// The wall times of every timed repetition in `direction`.
    pub fn walls(&self, direction: Direction) -> &[Duration] {
        match direction {
            Direction::HostToDevice => &self.wall_to_device,
            Direction::DeviceToHost => &self.wall_to_host,
        }
    }

    /// The aggregate bandwidth in `direction`: all bytes over the best wall time, GB/s.
    pub fn gbps(&self, direction: Direction) -> f64 {
        gbps(self.bytes(), self.best_wall(direction))
    }
}

/// The shortest of `times` (zero for none).
fn best(times: &[Duration]) -> Duration {
    times.iter().copied().min().unwrap_or_default()
}

impl Point {
    /// The timing of `method` in `direction`.
    pub fn timing(&self, method: Method, direction: Direction) -> Option<&Timing> {
        self.timings
            .iter()
            .find(|t| t.method == method && t.direction == direction)
    }

    /// `method`'s bandwidth as a percentage of the pinned copy's, in `direction`.
    pub fn percent_of_pinned(&self, method: Method, direction: Direction) -> Option<f64> {
        let pinned = self.timing(Method::Pinned, direction)?.gbps();
        let this = self.timing(method, direction)?.gbps();
        // Ratio first: the pinned copy against itself is exactly 100.
        (pinned > 0.0).then(|| this / pinned * 100.0)
    }
}

fn abi(what: &str) -> impl Fn(devarrow::abi::Error) -> JobError + '_ {
    move |e| JobError::new(format!("{what}: {e}"))
}

/// The time one method's timed repetitions may take before the job stops repeating it:
/// once they have passed this (the warm-up, which may pay one-off costs such as page
/// faults, is not counted), the best so far is its figure (the JSON's `times_s` lists the
/// repetitions that ran). On
/// large tables (TPC-H SF 10: 13 GB per pass, buffer by buffer at 1.4 GB/s is 9 s a
/// pass) `--reps` repetitions of every method would take minutes; on small ones every
/// repetition runs.
pub const REPETITION_BUDGET: Duration = Duration::from_secs(2);

/// Runs `reps + 1` repetitions of `f` on `state` (the first is a warm-up), each after
/// an untimed `reset` of it, and returns the times of the timed ones: all of them, or
/// fewer (at least one) once they pass [`REPETITION_BUDGET`]. Every
/// repetition is a step of `stage` (the skipped ones too).
fn repeat<S>(
    stage: &Stage,
    reps: usize,
    state: &mut S,
    reset: impl FnMut(&mut S) -> Result<(), JobError>,
    f: impl FnMut(&mut S) -> Result<(), JobError>,
) -> Result<Vec<Duration>, JobError> {
    repeat_within(REPETITION_BUDGET, stage, reps, state, reset, f)
}

/// [`repeat`] with `budget` for [`REPETITION_BUDGET`].
fn repeat_within<S>(
    budget: Duration,
    stage: &Stage,
    reps: usize,
    state: &mut S,
    mut reset: impl FnMut(&mut S) -> Result<(), JobError>,
    mut f: impl FnMut(&mut S) -> Result<(), JobError>,
) -> Result<Vec<Duration>, JobError> {
    let mut times = Vec::with_capacity(reps);
    let mut spent = Duration::ZERO;
    for rep in 0..=reps {
        if rep >= 2 && spent >= budget {
            stage.inc((reps + 1 - rep) as u64);
            break;
        }
        reset(state)?;
        let start = Instant::now();
        f(state)?;
        let elapsed = start.elapsed();
        if rep > 0 {
            spent += elapsed;
            times.push(elapsed);
        }
        stage.inc(1);
    }
    Ok(times)
}

/// The steps (repetitions, warm-ups included) [`measure_point`] counts on its stage.
pub fn steps(reps: usize) -> u64 {
    (Method::ALL.len() * Direction::ALL.len() * (reps + 1)) as u64
}

/// Measures every method on `batches` (one batch size), checking that devarrow brings
/// every batch back equal. Every repetition is a step of `stage` (see [`steps`]).
///
/// Host memory: besides `batches`, at most two more copies of their bytes at a time (on
/// the CPU device the "device" memory is host memory too): the device copy and the
/// batches brought back, then the raw copies' device buffer and one host buffer.
pub fn measure_point(
    measured: &Arc<dyn JobDevice>,
    batches: &[RecordBatch],
    batch_rows: usize,
    reps: usize,
    stage: &Stage,
) -> Result<Point, JobError> {
    let device: &Arc<dyn Device> = &(measured.clone() as Arc<dyn Device>);
    let sync = || {
        device
            .synchronize()
            .map_err(abi("synchronizing the device"))
    };
    let mut timings = Vec::with_capacity(8);

    // devarrow, host to device: `to_device_batches` moves every batch in one pipeline and
    // returns once the copies are enqueued, so the time runs until the events of every
    // batch have completed.
    stage.part("devarrow");
    // A repetition frees the last one's device memory and allocates as much again: the
    // device's pool keeps it for reuse, as an engine moving this much per cycle would set
    // it to (by default a pool keeps 1 GiB: beyond it, every repetition's allocations
    // would fault in, or map, fresh memory, and cost more per byte the more there is).
    measured
        .retain_freed_memory(Some(pool_retention(batches.iter())))
        .map_err(abi("sizing the device's memory pool"))?;
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let mut on_device: Vec<DeviceBatch> = Vec::with_capacity(batches.len());
    let mut copies = 0;
    // The stage times of every repetition, the warm-up first.
    let mut stages = Vec::with_capacity(reps + 1);
    let times = repeat(
        stage,
        reps,
        &mut on_device,
        |on_device| {
            // Free the last repetition's device memory outside the timed region.
            on_device.clear();
            sync()
        },
        |on_device| {
            let before = measured.copy_count();
            on_device.extend(
                transfer
                    .to_device_batches(batches)
                    .map_err(abi("moving the batches to the device"))?,
            );
            for batch in on_device.iter() {
                batch
                    .event()
                    .wait_host()
                    .map_err(abi("waiting for a transfer"))?;
            }
            copies = measured.copy_count() - before;
            stages.push(transfer.take_stats().to_device);
            Ok(())
        },
    )?;
    let bytes: usize = on_device.iter().map(DeviceBatch::device_bytes).sum();
    timings.push(Timing {
        method: Method::Devarrow,
        direction: Direction::HostToDevice,
        bytes,
        copies,
        stages: Some(mean_stages(&stages[1..])),
        times,
    });
    stages.clear();

    // Downloads land in pinned memory of the transfer's pool; the job holds every batch
    // of a repetition (to compare them), so the pool is sized to hold them all (size
    // classes round up by at most a quarter), up to PINNED_POOL_MAX_BYTES: beyond it,
    // batches land in pageable memory and the report says so.
    // On a device whose memory the host reads directly (the CPU device without a link)
    // downloads are a memcpy into pageable memory of the transfer's host pool: sized
    // likewise, so that a repetition reuses the memory the last one faulted in.
    let need = with_headroom(bytes, on_device.len());
    if device.host_accessible() {
        transfer.set_host_pool(Some(Arc::new(HostPool::new(need))));
    } else {
        transfer.set_pinned_host_pool(Some(Arc::new(HostPool::pinned(
            device.clone(),
            need.clamp(
                TransferOptions::default().pinned_host_bytes,
                PINNED_POOL_MAX_BYTES,
            ),
        ))));
    }
    // devarrow, device to host: `to_host_batches` moves every batch in one pipeline and
    // returns the rebuilt batches once copied.
    let mut back: Vec<RecordBatch> = Vec::with_capacity(batches.len());
    let mut landed = (0, 0);
    let times = repeat(
        stage,
        reps,
        &mut back,
        |back| {
            back.clear();
            Ok(())
        },
        |back| {
            let before = measured.copy_count();
            back.extend(
                transfer
                    .to_host_batches(&on_device)
                    .map_err(abi("moving the batches back to the host"))?,
            );
            copies = measured.copy_count() - before;
            let stats = transfer.take_stats();
            stages.push(stats.to_host);
            landed = (stats.pinned_downloads, stats.pageable_downloads);
            Ok(())
        },
    )?;
    timings.push(Timing {
        method: Method::Devarrow,
        direction: Direction::DeviceToHost,
        bytes,
        copies,
        stages: Some(mean_stages(&stages[1..])),
        times,
    });
    if let Some(i) = (0..batches.len()).find(|&i| back[i] != batches[i]) {
        return Err(JobError::new(format!(
            "batch {i} of {} rows came back from the {} device different from the input",
            batches[i].num_rows(),
            device.device_type()
        )));
    }
    let host_memory = (landed != (0, 0)).then(|| HostMemory {
        pinned: landed.0,
        pageable: landed.1,
        note: transfer.host_memory_note().map(str::to_string),
    });
    // The pool back to its default before the batches' memory is freed into it.
    measured
        .retain_freed_memory(None)
        .map_err(abi("sizing the device's memory pool"))?;
    drop((back, on_device, transfer));
    sync()?;
    super::memory::release_free_memory();

    // The host's own ceilings for the same bytes.
    stage.part("host ceilings");
    let ceilings = HostCeilings::measure(device, bytes, batches, reps)
        .map_err(abi("measuring the host's memcpy ceilings"))?;

    // Raw copies of the same byte count, in one copy each.
    stage.part("raw copies");
    // One host buffer at a time: the pinned one is freed before the pageable one is
    // allocated (by its first copy, the untimed warm-up).
    let mut raw =
        RawCopy::lazy(device.clone(), bytes).map_err(abi("allocating the raw copy buffers"))?;
    type Step = fn(&mut RawCopy) -> devarrow::abi::Result<()>;
    let steps: [(Method, Direction, Step); 4] = [
        (
            Method::Pinned,
            Direction::HostToDevice,
            RawCopy::pinned_to_device,
        ),
        (
            Method::Pinned,
            Direction::DeviceToHost,
            RawCopy::pinned_to_host,
        ),
        (
            Method::Pageable,
            Direction::HostToDevice,
            RawCopy::pageable_to_device,
        ),
        (
            Method::Pageable,
            Direction::DeviceToHost,
            RawCopy::pageable_to_host,
        ),
    ];
    for (method, direction, step) in steps {
        let times = repeat(
            stage,
            reps,
            &mut raw,
            |_| Ok(()),
            |raw| step(raw).map_err(abi("a raw copy")),
        )?;
        if (method, direction) == (Method::Pinned, Direction::DeviceToHost) {
            raw.release_pinned();
        }
        timings.push(Timing {
            method,
            direction,
            bytes,
            copies: 1,
            stages: None,
            times,
        });
    }
    drop(raw);

    // Buffer by buffer: one allocation and one synchronous copy per buffer.
    stage.part("buffer by buffer");
    let per_batch: Vec<BufferByBuffer> = batches
        .iter()
        .map(|b| BufferByBuffer::new(device.clone(), b))
        .collect();
    let bbb_bytes: usize = per_batch.iter().map(BufferByBuffer::bytes).sum();
    let bbb_copies: u64 = per_batch.iter().map(|b| b.buffer_count() as u64).sum();
    let mut on_device = Vec::with_capacity(per_batch.len());
    let times = repeat(
        stage,
        reps,
        &mut on_device,
        |on_device| {
            on_device.clear();
            sync()
        },
        |on_device| {
            for b in &per_batch {
                on_device.push(b.to_device().map_err(abi("a buffer-by-buffer copy"))?);
            }
            Ok(())
        },
    )?;
    timings.push(Timing {
        method: Method::BufferByBuffer,
        direction: Direction::HostToDevice,
        bytes: bbb_bytes,
        copies: bbb_copies,
        stages: None,
        times,
    });
    // The host copies are kept until the repetition ends, as devarrow's batches are:
    // dropping each batch's copies at once would let the next batch reuse the same, still
    // cached, host memory.
    let mut back: Vec<Vec<Vec<u8>>> = Vec::with_capacity(per_batch.len());
    let times = repeat(
        stage,
        reps,
        &mut back,
        |back| {
            back.clear();
            Ok(())
        },
        |back| {
            for (b, memory) in per_batch.iter().zip(&on_device) {
                back.push(b.to_host(memory).map_err(abi("a buffer-by-buffer copy"))?);
            }
            Ok(())
        },
    )?;
    let moved: usize = back.iter().flatten().map(Vec::len).sum();
    drop(back);
    if moved != bbb_bytes {
        return Err(JobError::new(format!(
            "the buffer-by-buffer baseline moved {moved} bytes back instead of {bbb_bytes}"
        )));
    }
    timings.push(Timing {
        method: Method::BufferByBuffer,
        direction: Direction::DeviceToHost,
        bytes: bbb_bytes,
        copies: bbb_copies,
        stages: None,
        times,
    });
    drop(on_device);
    sync()?;

    Ok(Point {
        batch_rows,
        batches: batches.len(),
        rows: batches.iter().map(|b| b.num_rows()).sum(),
        max_batch_rows: batches.iter().map(|b| b.num_rows()).max().unwrap_or(0),
        timings,
        verified: true,
        multi: None,
        ceilings: Some(ceilings),
        host_memory,
    })
}

/// The steps (repetitions, warm-ups included) [`measure_several`] counts on its stage.
pub fn several_steps(reps: usize) -> u64 {
    (Direction::ALL.len() * (reps + 1)) as u64
}

/// One device's part of a run on several: its device, its own `Transfer`, the batches
/// dealt to it, and where they are.
struct Worker<'a> {
    id: &'a str,
    transfer: Transfer,
    batches: Vec<&'a RecordBatch>,
    on_device: Vec<DeviceBatch>,
    back: Vec<RecordBatch>,
}

impl Worker<'_> {
    fn move_to_device(&mut self) -> Result<(), JobError> {
        let id = self.id;
        let fail = |e: devarrow::abi::Error| JobError::new(format!("{id}: {e}"));
        let batches: Vec<RecordBatch> = self.batches.iter().map(|&b| b.clone()).collect();
        self.on_device
            .extend(self.transfer.to_device_batches(&batches).map_err(fail)?);
        for batch in &self.on_device {
            batch.event().wait_host().map_err(fail)?;
        }
        Ok(())
    }

    fn move_to_host(&mut self) -> Result<(), JobError> {
        let id = self.id;
        let back = self
            .transfer
            .to_host_batches(&self.on_device)
            .map_err(|e| JobError::new(format!("{id}: moving the batches back: {e}")))?;
        self.back.extend(back);
        Ok(())
    }
}

/// Runs `f` on every worker at once, one thread each, started together (a barrier), and
/// returns the wall time of the whole (until the last has finished) and each worker's
/// own time.
fn all_at_once<'a>(
    workers: &mut [Worker<'a>],
    f: fn(&mut Worker<'a>) -> Result<(), JobError>,
) -> Result<(Duration, Vec<Duration>), JobError> {
    let barrier = Barrier::new(workers.len() + 1);
    std::thread::scope(|scope| {
        let threads: Vec<_> = workers
            .iter_mut()
            .map(|worker| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    let result = f(worker);
                    (result, start.elapsed())
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let mut results = Vec::with_capacity(threads.len());
        for thread in threads {
            results.push(
                thread
                    .join()
                    .map_err(|_| JobError::new("a device's transfer thread panicked"))?,
            );
        }
        // The threads may start a moment before this one wakes: the wall is never
        // shorter than the longest device.
        let mut wall = start.elapsed();
        let mut times = Vec::with_capacity(results.len());
        for (result, time) in results {
            result?;
            wall = wall.max(time);
            times.push(time);
        }
        Ok((wall, times))
    })
}

/// Measures devarrow on several devices at once: the batches dealt round-robin (batch
/// `i` to device `i % n`), one thread per device, each with its own `Transfer`, started
/// together; host to device, then device to host. Checks that every batch comes back
/// equal. Every repetition (all devices) is a step of `stage` (see [`several_steps`]).
pub fn measure_several(
    devices: &[(String, Arc<dyn JobDevice>)],
    batches: &[RecordBatch],
    reps: usize,
    stage: &Stage,
) -> Result<MultiPoint, JobError> {
    let n = devices.len().max(1);
    stage.part(format!("devarrow on {n} devices"));
    let mut workers: Vec<Worker<'_>> = devices
        .iter()
        .enumerate()
        .map(|(d, (id, device))| Worker {
            id,
            transfer: Transfer::new(device.clone(), TransferOptions::default()),
            batches: batches.iter().skip(d).step_by(n).collect(),
            on_device: Vec::new(),
            back: Vec::new(),
        })
        .collect();
    let sync = || -> Result<(), JobError> {
        for (id, device) in devices {
            device
                .synchronize()
                .map_err(|e| JobError::new(format!("synchronizing {id}: {e}")))?;
        }
        Ok(())
    };
    // Each device's pool keeps its share of a repetition (see `measure_point`).
    for (worker, (id, device)) in workers.iter().zip(devices) {
        device
            .retain_freed_memory(Some(pool_retention(worker.batches.iter().copied())))
            .map_err(|e| JobError::new(format!("sizing the memory pool of {id}: {e}")))?;
    }
    let mut wall_to_device = Vec::with_capacity(reps);
    let mut times_to_device = vec![Vec::with_capacity(reps); workers.len()];
    for rep in 0..=reps {
        // The last repetition's device memory is freed outside the timed region.
        workers.iter_mut().for_each(|w| w.on_device.clear());
        sync()?;
        let (wall, times) = all_at_once(&mut workers, Worker::move_to_device)?;
        if rep > 0 {
            wall_to_device.push(wall);
            times_to_device
                .iter_mut()
                .zip(times)
                .for_each(|(all, t)| all.push(t));
        }
        stage.inc(1);
    }
    let mut wall_to_host = Vec::with_capacity(reps);
    let mut times_to_host = vec![Vec::with_capacity(reps); workers.len()];
    for rep in 0..=reps {
        workers.iter_mut().for_each(|w| w.back.clear());
        let (wall, times) = all_at_once(&mut workers, Worker::move_to_host)?;
        if rep > 0 {
            wall_to_host.push(wall);
            times_to_host
                .iter_mut()
                .zip(times)
                .for_each(|(all, t)| all.push(t));
        }
        stage.inc(1);
    }
    for (i, batch) in batches.iter().enumerate() {
        let worker = &workers[i % n];
        if worker.back.get(i / n) != Some(batch) {
            return Err(JobError::new(format!(
                "batch {i} of {} rows came back from {} different from the input",
                batch.num_rows(),
                worker.id
            )));
        }
    }
    let shares = workers
        .iter()
        .zip(times_to_device.into_iter().zip(times_to_host))
        .map(|(w, (to_device, to_host))| DeviceShare {
            id: w.id.to_string(),
            batches: w.batches.len(),
            bytes: w.on_device.iter().map(DeviceBatch::device_bytes).sum(),
            to_device,
            to_host,
        })
        .collect();
    for (id, device) in devices {
        device
            .retain_freed_memory(None)
            .map_err(|e| JobError::new(format!("sizing the memory pool of {id}: {e}")))?;
    }
    drop(workers);
    sync()?;
    Ok(MultiPoint {
        shares,
        wall_to_device,
        wall_to_host,
    })
}

/// The mean of stage times over repetitions (per repetition).
fn mean_stages(reps: &[StageTimes]) -> StageTimes {
    let mut sum = StageTimes::default();
    for r in reps {
        sum += *r;
    }
    let n = reps.len().max(1) as u32;
    let mean = |d: Duration| d / n;
    StageTimes {
        plan: mean(sum.plan),
        allocate: mean(sum.allocate),
        pack: mean(sum.pack),
        copy: mean(sum.copy),
        unpack: mean(sum.unpack),
        validate: mean(sum.validate),
        batches: sum.batches / n as u64,
        bytes: sum.bytes / n as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use devarrow::abi::device::CpuDevice;

    #[test]
    fn repetitions_stop_past_the_budget_after_one_timed_run() {
        for (budget, runs) in [(Duration::ZERO, 2), (Duration::MAX, 6)] {
            let stage = Stage::off();
            let mut count = 0;
            let run = |c: &mut usize| {
                *c += 1;
                Ok(())
            };
            let times = repeat_within(budget, &stage, 5, &mut count, |_| Ok(()), run).unwrap();
            // the warm-up and at least one timed run; the skipped ones still count as steps
            assert_eq!((count, times.len()), (runs, runs - 1), "budget {budget:?}");
            assert_eq!(stage.bar().position(), 6);
        }
    }

    #[test]
    fn a_ceiling_is_the_better_of_memcpy_and_streaming_stores() {
        use CopyStores::{Memcpy, Streaming};
        assert_eq!(better(Some(10.0), Some(16.5)), Some((16.5, Streaming)));
        assert_eq!(better(Some(16.5), Some(10.0)), Some((16.5, Memcpy)));
        // a tie goes to the plain memcpy
        assert_eq!(better(Some(12.0), Some(12.0)), Some((12.0, Memcpy)));
        assert_eq!(better(None, Some(3.0)), Some((3.0, Streaming)));
        assert_eq!(better(Some(3.0), None), Some((3.0, Memcpy)));
        assert_eq!(better(None, None), None);

        // best repetition of each way, then the better way: 1 GB in 100 ms (memcpy) against
        // 1 GB in 60 ms (streaming, its best of two)
        let ms = Duration::from_millis;
        let c = Ceiling {
            bytes: 1_000_000_000,
            memcpy: vec![ms(120), ms(100)],
            streaming: vec![ms(90), ms(60)],
        };
        assert_eq!(c.memcpy_gbps(), Some(10.0));
        assert!((c.streaming_gbps().unwrap() - 16.666).abs() < 0.01);
        assert_eq!(c.best().map(|(_, s)| s), Some(Streaming));
        assert_eq!(c.gbps(), c.streaming_gbps().unwrap());
        // not measured: no ceiling, and 0 GB/s where a figure is needed
        let none = Ceiling::default();
        assert_eq!((none.best(), none.gbps()), (None, 0.0));
        let untimed = Ceiling {
            bytes: 1000,
            memcpy: vec![Duration::ZERO],
            streaming: vec![],
        };
        assert_eq!(untimed.best(), None);
    }

    #[test]
    fn the_host_ceilings_measure_both_ways_and_keep_the_better() {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
        let batches = crate::tpch::lineitem(0.001, 2000);
        let c = HostCeilings::measure(&device, 4 << 20, &batches, 2).unwrap();
        assert_eq!(c.bytes, 4 << 20);
        for ceiling in [&c.pinned, &c.faulted, &c.gather] {
            assert!(ceiling.bytes > 0);
            assert_eq!((ceiling.memcpy.len(), ceiling.streaming.len()), (2, 2));
            let (m, s) = (
                ceiling.memcpy_gbps().unwrap(),
                ceiling.streaming_gbps().unwrap(),
            );
            assert_eq!(ceiling.gbps(), m.max(s), "{ceiling:?}");
        }
        assert_eq!(c.pinned_gbps(), c.pinned.gbps());
        assert_eq!(c.gather_gbps(), Some(c.gather.gbps()));
        // no batches: no gather, and nothing timed for it
        let c = HostCeilings::measure(&device, 1 << 20, &[], 1).unwrap();
        assert_eq!((c.gather.bytes, c.gather_gbps()), (0, None));
        assert!(c.gather.memcpy.is_empty() && c.gather.streaming.is_empty());
    }

    #[test]
    fn every_method_both_ways_on_the_cpu_device() {
        let device: Arc<dyn JobDevice> = Arc::new(CpuDevice::new());
        let batches = crate::tpch::lineitem(0.001, 2000);
        let stage = Stage::off();
        let point = measure_point(&device, &batches, 2000, 2, &stage).unwrap();
        assert_eq!(stage.bar().position(), steps(2));
        assert!(point.verified);
        assert_eq!(point.batches, batches.len());
        assert!(point.rows > 5000);
        assert_eq!(point.timings.len(), 8);
        for method in Method::ALL {
            for direction in Direction::ALL {
                let t = point.timing(method, direction).unwrap();
                assert_eq!(t.times.len(), 2);
                assert!(t.bytes > 0 && t.copies > 0, "{t:?}");
                assert!(t.best() <= t.median());
            }
        }
        let dev = point
            .timing(Method::Devarrow, Direction::HostToDevice)
            .unwrap();
        assert_eq!(
            dev.bytes,
            point
                .timing(Method::Pinned, Direction::HostToDevice)
                .unwrap()
                .bytes
        );
        let bbb = point
            .timing(Method::BufferByBuffer, Direction::HostToDevice)
            .unwrap();
        assert!(bbb.copies > dev.copies, "{} vs {}", bbb.copies, dev.copies);
        assert_eq!(
            point.percent_of_pinned(Method::Pinned, Direction::DeviceToHost),
            Some(100.0)
        );
    }

    #[test]
    fn several_devices_at_once_on_cpu_devices() {
        let devices: Vec<(String, Arc<dyn JobDevice>)> = (0..3)
            .map(|i| {
                let device: Arc<dyn JobDevice> = Arc::new(CpuDevice::new());
                (format!("cpu:{i}"), device)
            })
            .collect();
        let batches = crate::tpch::lineitem(0.001, 1000);
        assert!(batches.len() >= 4, "{}", batches.len());
        let stage = Stage::off();
        let multi = measure_several(&devices, &batches, 2, &stage).unwrap();
        assert_eq!(stage.bar().position(), several_steps(2));
        assert_eq!(multi.shares.len(), 3);
        assert_eq!(multi.wall_to_device.len(), 2);
        assert_eq!(multi.wall_to_host.len(), 2);
        let dealt: usize = multi.shares.iter().map(|s| s.batches).sum();
        assert_eq!(dealt, batches.len());
        for (i, share) in multi.shares.iter().enumerate() {
            assert_eq!(share.id, format!("cpu:{i}"));
            assert_eq!(share.batches, batches.iter().skip(i).step_by(3).count());
            assert!(share.bytes > 0);
            assert_eq!((share.to_device.len(), share.to_host.len()), (2, 2));
            for direction in Direction::ALL {
                // No device takes longer than the whole.
                assert!(share.best(direction) <= multi.best_wall(direction));
                assert!(share.gbps(direction) > 0.0);
            }
        }
        // The same bytes as one device moves.
        let one = measure_point(&devices[0].1, &batches, 1000, 1, &Stage::off()).unwrap();
        let single = one
            .timing(Method::Devarrow, Direction::HostToDevice)
            .unwrap();
        assert_eq!(multi.bytes(), single.bytes);
        assert!(multi.gbps(Direction::DeviceToHost) > 0.0);
    }

    #[test]
    fn bandwidth() {
        assert_eq!(gbps(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(gbps(1, Duration::ZERO), 0.0);
    }
}
