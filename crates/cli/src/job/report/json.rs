//! What `--json` writes ([`JsonReport`]): a run's measurements, device, commit, host, data
//! and options, as serialized.

use std::time::Duration;

use serde::Serialize;

use super::super::cuda_options;
use super::super::measure::{Ceiling, Direction, Method};
use super::super::options::JsonTarget;
use super::{build_profile, DataInfo, Run};

impl Run {
    /// Every measurement, the device, the commit and the options: what `--json` writes.
    pub fn json(&self) -> JsonReport<'_> {
        let o = &self.options;
        let (cuda_devices, cuda_unavailable) = match &self.device.cuda_summary {
            Ok(s) => (Some(s.as_str()), None),
            Err(e) => (None, Some(e.as_str())),
        };
        let points = self
            .points
            .iter()
            .map(|p| JsonPoint {
                batch_rows: p.batch_rows,
                batches: p.batches,
                rows: p.rows,
                max_batch_rows: p.max_batch_rows,
                verified: p.verified,
                devices: p.multi.as_ref().map(|m| {
                    m.shares
                        .iter()
                        .map(|s| JsonShare {
                            id: s.id.clone(),
                            batches: s.batches,
                            bytes: s.bytes,
                            host_to_device: JsonFigure::new(s.bytes, &s.to_device),
                            device_to_host: JsonFigure::new(s.bytes, &s.to_host),
                        })
                        .collect()
                }),
                total: p.multi.as_ref().map(|m| JsonTotal {
                    devices: m.shares.len(),
                    batches: m.shares.iter().map(|s| s.batches).sum(),
                    bytes: m.bytes(),
                    host_to_device: JsonFigure::new(m.bytes(), m.walls(Direction::HostToDevice)),
                    device_to_host: JsonFigure::new(m.bytes(), m.walls(Direction::DeviceToHost)),
                    peers_on: m.shares.first().map(|s| s.id.clone()),
                }),
                host_ceilings: p.ceilings.as_ref().map(|c| {
                    let of = |direction: Direction, ceiling: f64| {
                        p.timing(Method::Devarrow, direction)
                            .filter(|_| ceiling > 0.0)
                            .map(|t| t.gbps() / ceiling)
                    };
                    JsonCeilings {
                        threads: c.threads,
                        bytes: c.bytes,
                        pinned: JsonCeiling::new(&c.pinned),
                        faulted: JsonCeiling::new(&c.faulted),
                        gather: (c.gather.bytes > 0).then(|| JsonCeiling::new(&c.gather)),
                        devarrow_h2d_of_pinned: of(Direction::HostToDevice, c.pinned_gbps()),
                        devarrow_h2d_of_gather: c
                            .gather_gbps()
                            .and_then(|g| of(Direction::HostToDevice, g)),
                        devarrow_d2h_of_faulted: of(Direction::DeviceToHost, c.faulted_gbps()),
                    }
                }),
                downloads_landed: p.host_memory.as_ref().map(|m| JsonLanded {
                    pinned: m.pinned,
                    pageable: m.pageable,
                    note: m.note.clone(),
                }),
                measurements: p
                    .timings
                    .iter()
                    .map(|t| JsonMeasurement {
                        method: t.method.key(),
                        direction: t.direction.key(),
                        bytes: t.bytes,
                        copies: t.copies,
                        best_s: t.best().as_secs_f64(),
                        median_s: t.median().as_secs_f64(),
                        times_s: t.times.iter().map(Duration::as_secs_f64).collect(),
                        gbps: t.gbps(),
                        percent_of_pinned: p.percent_of_pinned(t.method, t.direction),
                        stages_s: t.stages.as_ref().map(|s| {
                            s.stages()
                                .into_iter()
                                .map(|(name, d)| (name.to_string(), d.as_secs_f64()))
                                .collect()
                        }),
                    })
                    .collect(),
            })
            .collect();
        JsonReport {
            devarrow_version: env!("CARGO_PKG_VERSION"),
            commit: devarrow::GIT_COMMIT,
            build: build_profile(),
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            host: JsonHost::this_machine(),
            device: JsonDevice {
                id: &self.device.id,
                name: &self.device.name,
                cuda_devices,
                cuda_unavailable,
                fallback_reason: self.device.fallback.as_deref(),
                link: self.device.link.map(|l| JsonLink {
                    gbps: l.gbps(),
                    latency_s: l.latency.as_secs_f64(),
                }),
                cuda_options: self.device.cuda_options.map(|c| JsonCudaOptions {
                    batch_copies: c.batch_copies,
                    register_pageable_bytes: c.register_pageable,
                    host_wait: cuda_options::host_wait_name(c.host_wait),
                    reuse_events: c.reuse_events,
                }),
                batched_copies: self
                    .device
                    .batched_copies
                    .map(|(available, calls)| JsonBatched { available, calls }),
                devices: (!self.device.several.is_empty()).then(|| {
                    self.device
                        .several
                        .iter()
                        .map(|(id, name)| JsonDeviceName { id, name })
                        .collect()
                }),
            },
            options: JsonOptions {
                device: o.device.to_string(),
                scale: o.input.is_none().then_some(o.scale),
                batch_sizes: &o.batch_sizes,
                reps: o.reps,
                warmup_reps: 1,
                memory_check: o.memory_check,
                input: o.input.as_ref().map(|p| p.display().to_string()),
                chart: o.chart.as_ref().map(|p| p.display().to_string()),
                link: o.link.map(|l| l.to_string()),
                json: o.json.as_ref().map(|j| match j {
                    JsonTarget::Stdout => "-".to_string(),
                    JsonTarget::File(p) => p.display().to_string(),
                }),
                cuda_options: JsonCudaOptionsGiven {
                    source: o.cuda_options.source.label(),
                    given: o.cuda_options.text.as_deref(),
                    env_overridden: o.cuda_options.env_overridden,
                },
                transfer_options: o
                    .transfer_options
                    .text
                    .as_ref()
                    .map(|_| o.transfer_options.describe()),
            },
            data: &self.data,
            units: JsonUnits {
                time: "seconds",
                bandwidth: "GB/s (1e9 bytes per second, best repetition)",
            },
            points,
            export_check: self.export_check.as_deref(),
        }
    }

    /// [`Run::json`] as pretty-printed text, with a final newline.
    pub fn json_text(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(&self.json()).map(|text| text + "\n")
    }
}

/// What `--json` writes: every measurement, the device, the commit, the host, the data
/// and the options.
#[derive(Debug, Serialize)]
pub struct JsonReport<'a> {
    devarrow_version: &'static str,
    commit: &'static str,
    /// `release` or `debug`: figures of a debug build are not representative.
    build: &'static str,
    unix_time: u64,
    host: JsonHost,
    device: JsonDevice<'a>,
    options: JsonOptions<'a>,
    data: &'a DataInfo,
    units: JsonUnits,
    points: Vec<JsonPoint>,
    export_check: Option<&'a str>,
}

/// The machine the run ran on.
#[derive(Debug, Serialize)]
struct JsonHost {
    os: &'static str,
    arch: &'static str,
    cpus: usize,
    /// The CPU's model name (`/proc/cpuinfo`), where known.
    cpu_model: Option<String>,
    /// NUMA nodes with CPUs or memory (`/sys/devices/system/node`), where known: on more
    /// than one, where the batches and the staging memory lie against the GPU's node
    /// bounds what the host side reaches.
    numa_nodes: Option<usize>,
    /// The transparent huge page mode (`always`, `madvise` or `never`), where known.
    transparent_hugepages: Option<String>,
}

impl JsonHost {
    fn this_machine() -> Self {
        let read = |path: &str| std::fs::read_to_string(path).ok();
        Self {
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model: read("/proc/cpuinfo").and_then(|info| {
                info.lines()
                    .find(|line| line.starts_with("model name"))
                    .and_then(|line| line.split_once(':'))
                    .map(|(_, name)| name.trim().to_string())
            }),
            numa_nodes: std::fs::read_dir("/sys/devices/system/node")
                .ok()
                .map(|dir| {
                    dir.filter_map(|entry| entry.ok())
                        .filter(|entry| {
                            let name = entry.file_name();
                            let name = name.to_string_lossy();
                            name.strip_prefix("node")
                                .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
                        })
                        .count()
                }),
            // The mode in use is the bracketed one: "always [madvise] never".
            transparent_hugepages: read("/sys/kernel/mm/transparent_hugepage/enabled").and_then(
                |modes| {
                    let (_, rest) = modes.split_once('[')?;
                    let (mode, _) = rest.split_once(']')?;
                    Some(mode.to_string())
                },
            ),
        }
    }
}

/// The device, and what the machine said about CUDA.
#[derive(Debug, Serialize)]
struct JsonDevice<'a> {
    id: &'a str,
    name: &'a str,
    cuda_devices: Option<&'a str>,
    cuda_unavailable: Option<&'a str>,
    fallback_reason: Option<&'a str>,
    /// The link the CPU device modelled (`--link`), if any.
    link: Option<JsonLink>,
    /// The options the CUDA device ran with, all four (`null` on the CPU device).
    cuda_options: Option<JsonCudaOptions>,
    /// Whether the driver has `cuMemcpyBatchAsync` and how many calls the device made
    /// (absent on the CPU device).
    #[serde(skip_serializing_if = "Option::is_none")]
    batched_copies: Option<JsonBatched>,
    /// Every device of a run on several (absent on one device).
    #[serde(skip_serializing_if = "Option::is_none")]
    devices: Option<Vec<JsonDeviceName<'a>>>,
}

/// `cuMemcpyBatchAsync` on the device of the run: there (`null`: never looked up) and
/// used how often.
#[derive(Debug, Serialize)]
struct JsonBatched {
    available: Option<bool>,
    calls: u64,
}

/// A device of a run on several.
#[derive(Debug, Serialize)]
struct JsonDeviceName<'a> {
    id: &'a str,
    name: &'a str,
}

/// devarrow's figures on one device of a run on several.
#[derive(Debug, Serialize)]
struct JsonShare {
    id: String,
    batches: usize,
    bytes: usize,
    host_to_device: JsonFigure,
    device_to_host: JsonFigure,
}

/// All devices of a run on several together: the bytes of all over the wall time of the
/// whole.
#[derive(Debug, Serialize)]
struct JsonTotal {
    devices: usize,
    batches: usize,
    bytes: usize,
    host_to_device: JsonFigure,
    device_to_host: JsonFigure,
    /// The device the peer methods (raw copies, buffer by buffer) ran on, alone.
    peers_on: Option<String>,
}

/// Times of every timed repetition, the best, and the bandwidth of the best.
#[derive(Debug, Serialize)]
struct JsonFigure {
    best_s: f64,
    median_s: f64,
    times_s: Vec<f64>,
    gbps: f64,
}

impl JsonFigure {
    fn new(bytes: usize, times: &[Duration]) -> Self {
        let mut sorted = times.to_vec();
        sorted.sort_unstable();
        let best = sorted.first().copied().unwrap_or_default();
        Self {
            best_s: best.as_secs_f64(),
            median_s: sorted
                .get(sorted.len() / 2)
                .copied()
                .unwrap_or_default()
                .as_secs_f64(),
            times_s: times.iter().map(Duration::as_secs_f64).collect(),
            gbps: super::super::measure::gbps(bytes, best),
        }
    }
}

/// The options a CUDA device ran with ([`CudaDeviceOptions`]).
#[derive(Debug, Serialize)]
struct JsonCudaOptions {
    batch_copies: bool,
    /// `null`: no pageable buffer is registered.
    register_pageable_bytes: Option<usize>,
    /// `spin` or `block`.
    host_wait: &'static str,
    reuse_events: bool,
}

/// The CUDA options asked for: where from, and the list as given.
#[derive(Debug, Serialize)]
struct JsonCudaOptionsGiven<'a> {
    /// `default`, `DEVARROW_CUDA_OPTIONS` or `--cuda-options`.
    source: &'static str,
    given: Option<&'a str>,
    /// Whether `DEVARROW_CUDA_OPTIONS` was set but `--cuda-options` won over it.
    env_overridden: bool,
}

/// A modelled link: bandwidth (GB/s, 1e9 bytes per second) and latency per copy.
#[derive(Debug, Serialize)]
struct JsonLink {
    gbps: f64,
    latency_s: f64,
}

/// The options of the run, resolved.
#[derive(Debug, Serialize)]
struct JsonOptions<'a> {
    device: String,
    scale: Option<f64>,
    batch_sizes: &'a [usize],
    reps: usize,
    warmup_reps: usize,
    memory_check: bool,
    input: Option<String>,
    chart: Option<String>,
    link: Option<String>,
    json: Option<String>,
    cuda_options: JsonCudaOptionsGiven<'a>,
    /// `--transfer-options` as it ran (every value), `null` without the flag.
    transfer_options: Option<String>,
}

/// The units of the figures.
#[derive(Debug, Serialize)]
struct JsonUnits {
    time: &'static str,
    bandwidth: &'static str,
}

/// Every measurement at one batch size.
#[derive(Debug, Serialize)]
struct JsonPoint {
    batch_rows: usize,
    batches: usize,
    rows: usize,
    max_batch_rows: usize,
    verified: bool,
    /// devarrow's figures per device of a run on several (absent on one device).
    #[serde(skip_serializing_if = "Option::is_none")]
    devices: Option<Vec<JsonShare>>,
    /// All devices of a run on several together (absent on one device).
    #[serde(skip_serializing_if = "Option::is_none")]
    total: Option<JsonTotal>,
    measurements: Vec<JsonMeasurement>,
    /// The host's ceilings for the same bytes (see `HostCeilings`).
    #[serde(skip_serializing_if = "Option::is_none")]
    host_ceilings: Option<JsonCeilings>,
    /// Where devarrow's downloads landed.
    #[serde(skip_serializing_if = "Option::is_none")]
    downloads_landed: Option<JsonLanded>,
}

/// The host's ceilings: a parallel copy of the same bytes into pinned and into
/// pre-faulted memory, and of the batches' own buffers into pinned memory, each the better
/// of a memcpy and streaming stores, and devarrow's figures as multiples of them (above
/// 1.0: a wrong ceiling, not a fast devarrow).
#[derive(Debug, Serialize)]
struct JsonCeilings {
    threads: usize,
    bytes: usize,
    pinned: JsonCeiling,
    faulted: JsonCeiling,
    /// Absent when not measured.
    gather: Option<JsonCeiling>,
    /// devarrow host to device over the ceiling into pinned memory.
    devarrow_h2d_of_pinned: Option<f64>,
    /// devarrow host to device over the gather of the batches' buffers.
    devarrow_h2d_of_gather: Option<f64>,
    /// devarrow device to host over the ceiling into pre-faulted memory.
    devarrow_d2h_of_faulted: Option<f64>,
}

/// One ceiling both ways, and the better of them.
#[derive(Debug, Serialize)]
struct JsonCeiling {
    bytes: usize,
    /// The better of `memcpy_gbps` and `streaming_gbps`.
    gbps: f64,
    /// Which it was: `memcpy` or `streaming`.
    best: Option<&'static str>,
    memcpy_gbps: Option<f64>,
    streaming_gbps: Option<f64>,
    memcpy_times_s: Vec<f64>,
    streaming_times_s: Vec<f64>,
}

impl JsonCeiling {
    fn new(c: &Ceiling) -> Self {
        let secs = |t: &[Duration]| t.iter().map(Duration::as_secs_f64).collect();
        Self {
            bytes: c.bytes,
            gbps: c.gbps(),
            best: c.best().map(|(_, s)| s.key()),
            memcpy_gbps: c.memcpy_gbps(),
            streaming_gbps: c.streaming_gbps(),
            memcpy_times_s: secs(&c.memcpy),
            streaming_times_s: secs(&c.streaming),
        }
    }
}

/// Batches of devarrow's downloads that landed in pinned and in pageable memory.
#[derive(Debug, Serialize)]
struct JsonLanded {
    pinned: u64,
    pageable: u64,
    note: Option<String>,
}

/// One method in one direction.
#[derive(Debug, Serialize)]
struct JsonMeasurement {
    method: &'static str,
    direction: &'static str,
    bytes: usize,
    copies: u64,
    best_s: f64,
    median_s: f64,
    times_s: Vec<f64>,
    gbps: f64,
    percent_of_pinned: Option<f64>,
    /// Time per stage of devarrow's transfers (plan, allocate, pack, copy, unpack,
    /// validate), the mean over the timed repetitions.
    stages_s: Option<std::collections::BTreeMap<String, f64>>,
}
