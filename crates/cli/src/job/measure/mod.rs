//! The measurements: devarrow's transfer of a set of batches each way, raw pinned and
//! pageable copies of the same byte count, and the buffer-by-buffer baseline, all on
//! one device, each timed until its copies have completed.
//!
//! This file holds what is measured and the measurement on one device
//! ([`measure_point`]); `ceilings.rs` the host's own ceilings for the same bytes
//! ([`HostCeilings`]), `several.rs` devarrow on several devices at once
//! ([`measure_several`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::baseline::{BufferByBuffer, RawCopy};
use arrow_array::RecordBatch;
use devarrow::abi::device::{CopyCounter, Device, HostPool, MemoryPoolPolicy};
use devarrow::bridge::{DeviceBatch, StageTimes, Transfer, TransferOptions};

use super::progress::Stage;
use super::JobError;

mod ceilings;
mod several;

pub use ceilings::{host_memcpy_rate, Ceiling, CopyStores, HostCeilings};
#[cfg(test)]
pub use several::DeviceShare;
pub use several::{measure_several, several_steps, MultiPoint};

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

/// The most pinned host memory the job lets devarrow's downloads land in: 64 GiB.
pub const PINNED_POOL_MAX_BYTES: usize = 64 << 30;

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
    transfer_options: &TransferOptions,
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
    let mut transfer = Transfer::new(device.clone(), *transfer_options);
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
        // The explicit warm-up, outside the timing: the device's pinned memory gets
        // room for the whole pool now (on CUDA its reserve is 128 MiB; without this the
        // pool's blocks beyond it were refused and the batches landed in pageable
        // memory, unpacked from staging: the H200 run of 2026-11-29, at 0.18x).
        transfer
            .prepare()
            .map_err(abi("reserving pinned memory for the downloads"))?;
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
    fn every_method_both_ways_on_the_cpu_device() {
        let device: Arc<dyn JobDevice> = Arc::new(CpuDevice::new());
        let batches = crate::tpch::lineitem(0.001, 2000);
        let stage = Stage::off();
        let point = measure_point(
            &device,
            &batches,
            2000,
            2,
            &TransferOptions::default(),
            &stage,
        )
        .unwrap();
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
    fn bandwidth() {
        assert_eq!(gbps(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(gbps(1, Duration::ZERO), 0.0);
    }
}
