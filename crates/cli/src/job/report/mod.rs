//! What a run prints (a table) and writes (JSON).

use std::fmt::Write as _;
use std::time::Duration;

use devarrow::abi::device::LinkModel;
use devarrow::cuda::CudaDeviceOptions;
use serde::Serialize;

use super::cuda_options::{self, CudaOptions};
use super::measure::{Ceiling, CopyStores, Direction, HostCeilings, Method, MultiPoint, Point};
use super::options::{JsonTarget, Options};
pub use super::text::thousands;

/// The device a run used, as reported.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// `cuda:N` or `cpu`.
    pub id: String,
    /// The GPU's name, or `CPU device`.
    pub name: String,
    /// The machine's CUDA devices (one line), or why there are none.
    pub cuda_summary: Result<String, String>,
    /// Why `auto` fell back to the CPU device.
    pub fallback: Option<String>,
    /// The link the CPU device modelled (`--link`).
    pub link: Option<LinkModel>,
    /// The options the CUDA device ran with (`None` on the CPU device).
    pub cuda_options: Option<CudaDeviceOptions>,
    /// On CUDA: whether the driver has `cuMemcpyBatchAsync` (`None`: never looked up, as
    /// when `batch_copies` is off) and how many calls of it the device made in the run.
    pub batched_copies: Option<(Option<bool>, u64)>,
    /// Every device of a run on several (`--device cuda:0,1`, `cuda:all`), as `(id,
    /// name)`, the first being the one described above; empty on one device.
    pub several: Vec<(String, String)>,
}

impl DeviceInfo {
    /// Which model of the CPU device ran (empty on CUDA), after a `; `.
    pub fn model_note(&self) -> String {
        match (&self.link, self.id == "cpu") {
            (_, false) => String::new(),
            (Some(link), true) => format!("; {}", link_words(link)),
            (None, true) => "; no link model (host memory, packed directly)".into(),
        }
    }
}

/// The build profile of this binary: `release` or `debug` (from `debug_assertions`,
/// which cargo's `release` profile turns off and `dev` and `test` turn on).
pub fn build_profile() -> &'static str {
    if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    }
}

/// The `build:` line of the table: the profile, with a warning in a debug build.
pub fn build_line() -> String {
    match build_profile() {
        "release" => "release".to_string(),
        profile => format!("{profile} (figures are not representative: use cargo run --release)"),
    }
}

/// Says that CUDA options were given but not used (the run is on the CPU device), or
/// `None` when they were used or none were given.
pub fn cuda_options_unused(cuda: &CudaOptions, on_cuda: bool) -> Option<String> {
    (cuda.given() && !on_cuda).then(|| {
        format!(
            "CUDA options from {} (`{}`) not used: the CPU device has none",
            cuda.source.label(),
            cuda.text.as_deref().unwrap_or_default()
        )
    })
}

/// `modelled link 4 GB/s + 10 us per copy`.
fn link_words(link: &LinkModel) -> String {
    format!(
        "modelled link {} GB/s + {} per copy",
        link.gbps(),
        human_duration(link.latency).replace(".000", "")
    )
}

/// The data a run moved (written to JSON as it is).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataInfo {
    /// `tpch-lineitem` or the input file's format.
    pub kind: String,
    /// The input file.
    pub path: Option<String>,
    /// The TPC-H scale of generated data.
    pub scale: Option<f64>,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub columns: usize,
    /// Bytes of Arrow buffers the data holds in host memory, every allocation counted
    /// once at its capacity (before cutting it into batches): see
    /// [`crate::footprint::arrow_bytes`].
    pub arrow_bytes: usize,
}

impl DataInfo {
    /// What the data is: the file, or the table and scale.
    fn what(&self) -> String {
        match (&self.path, self.scale) {
            (Some(path), _) => format!("{path} ({})", self.kind),
            (None, Some(scale)) => format!("TPC-H lineitem, scale {scale}"),
            (None, None) => self.kind.clone(),
        }
    }

    /// A short description: what and how many rows.
    pub fn short(&self) -> String {
        format!("{}, {}", self.what(), count(self.rows, "row", "rows"))
    }

    /// A one-line description.
    pub fn describe(&self) -> String {
        let what = self.what();
        format!(
            "{what}: {} rows, {} columns, {:.1} MB of Arrow buffers",
            thousands(self.rows as u64),
            self.columns,
            self.arrow_bytes as f64 / 1e6
        )
    }
}

/// Everything a run reports.
#[derive(Debug, Clone)]
pub struct Run {
    /// The options, resolved.
    pub options: Options,
    /// The device.
    pub device: DeviceInfo,
    /// The data.
    pub data: DataInfo,
    /// One point per batch size.
    pub points: Vec<Point>,
    /// The result of exporting a device batch through the C Device Data Interface and
    /// importing it.
    pub export_check: Option<String>,
}

/// `n` and the noun, singular or plural: `1 batch`, `2,048 batches`.
pub fn count(n: usize, one: &str, many: &str) -> String {
    format!(
        "{} {}",
        thousands(n as u64),
        if n == 1 { one } else { many }
    )
}

/// A duration with a unit that keeps 4 or 5 significant digits.
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.3} us", s * 1e6)
    }
}

/// `1024` as `1K`, `1048576` as `1M`, others as they are.
pub fn short_rows(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

impl Run {
    /// The device line.
    fn device_line(&self) -> String {
        let d = &self.device;
        if !d.several.is_empty() {
            let all: Vec<String> = d
                .several
                .iter()
                .map(|(id, name)| format!("{name} ({id})"))
                .collect();
            return all.join(", ");
        }
        match (&d.fallback, &d.cuda_summary) {
            (Some(why), _) => format!("{} ({why})", d.name),
            (None, _) if d.id != "cpu" => format!("{} ({})", d.name, d.id),
            (None, Ok(summary)) => format!("{} (as asked; CUDA: {summary})", d.name),
            (None, Err(reason)) => format!("{} (as asked; no CUDA device: {reason})", d.name),
        }
    }

    /// The human-readable report (what stdout shows).
    pub fn text(&self) -> String {
        let mut out = String::new();
        let o = &self.options;
        let _ = writeln!(
            out,
            "devarrow {} (commit {})",
            env!("CARGO_PKG_VERSION"),
            devarrow::GIT_COMMIT
        );
        let _ = writeln!(out, "build:   {}", build_line());
        let _ = writeln!(out, "device:  {}", self.device_line());
        if self.device.id == "cpu" {
            let model = match &self.device.link {
                Some(link) => format!(
                    "{} on a copy-engine thread, in stream order; copies from or to \
                     pageable memory synchronous (as a driver stages them)",
                    link_words(link)
                ),
                None => "no link: device memory is host memory, packed into and unpacked \
                         from directly (no staging copies)"
                    .into(),
            };
            let _ = writeln!(out, "model:   {model}");
        }
        if let (Ok(summary), true) = (&self.device.cuda_summary, self.device.id != "cpu") {
            let _ = writeln!(out, "CUDA:    {summary}");
        }
        if let Some(cuda) = &self.device.cuda_options {
            let from = match o.cuda_options.source {
                cuda_options::Source::Default => "the defaults".to_string(),
                source => format!("from {}", source.label()),
            };
            let _ = writeln!(
                out,
                "options: {} (CUDA device options, {from})",
                cuda_options::describe(cuda)
            );
        } else if let Some(unused) = cuda_options_unused(&o.cuda_options, false) {
            let _ = writeln!(out, "options: {unused}");
        }
        if let Some((available, calls)) = self.device.batched_copies {
            let _ = writeln!(
                out,
                "batched: cuMemcpyBatchAsync {}; devarrow's device made {calls} batched copy \
                 calls in this run",
                match available {
                    Some(true) => "available",
                    Some(false) => "NOT available (copies went one by one)",
                    None => "not looked up (batch_copies off, or never needed)",
                }
            );
        }
        let _ = writeln!(out, "data:    {}", self.data.describe());
        let fewest = self
            .points
            .iter()
            .flat_map(|p| &p.timings)
            .map(|t| t.times.len())
            .min()
            .unwrap_or(o.reps);
        let cut = if fewest < o.reps {
            format!(
                " (fewer, at least {fewest}, for a method whose timed repetitions passed {} s)",
                crate::job::measure::REPETITION_BUDGET.as_secs()
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "timing:  best of {}{cut} after 1 warm-up; GB/s = 10^9 bytes/s; raw copies move \
             the same bytes in one copy",
            o.reps
        );
        if let [point] = self.points.as_slice() {
            out.push('\n');
            point_table(&mut out, point);
        } else {
            out.push('\n');
            sweep_table(&mut out, &self.points);
        }
        host_lines(&mut out, &self.points);
        if let Some((first, _)) = self.device.several.first() {
            for point in &self.points {
                if let Some(multi) = &point.multi {
                    out.push('\n');
                    several_table(&mut out, point, multi, first);
                }
            }
        }
        out.push('\n');
        if self.points.iter().all(|p| p.verified) {
            let batches: usize = self.points.iter().map(|p| p.batches).sum();
            let _ = writeln!(
                out,
                "ok: every batch ({}) came back from the {} equal to the input",
                count(batches, "batch", "batches"),
                self.device.name
            );
        }
        if let Some(check) = &self.export_check {
            let _ = writeln!(out, "{check}");
        }
        if self.device.id == "cpu" && self.device.link.is_none() {
            let _ = writeln!(
                out,
                "note: on the CPU device every copy is a memcpy within host memory, so these \
                 figures show devarrow's host-side costs, not a host-device link"
            );
        }
        if let Some(path) = &o.chart {
            let _ = writeln!(out, "chart:   {}", path.display());
        }
        if let Some(JsonTarget::File(path)) = &o.json {
            let _ = writeln!(out, "json:    {}", path.display());
        }
        out
    }

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
            gbps: super::measure::gbps(bytes, best),
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

/// The host's ceilings beside devarrow (its share of a parallel copy of the same bytes
/// into pinned memory host to device, into pre-faulted memory device to host, each the
/// better of a memcpy and streaming stores, and both ways of each), and where devarrow's
/// downloads landed.
fn host_lines(out: &mut String, points: &[Point]) {
    let with: Vec<(&Point, &HostCeilings)> = points
        .iter()
        .filter_map(|p| p.ceilings.as_ref().map(|c| (p, c)))
        .collect();
    if let Some((_, first)) = with.first() {
        let _ = writeln!(
            out,
            "\nhost ceilings: the better of a parallel memcpy and parallel streaming stores of \
             the same bytes ({} threads, {} MB) beside each batch size:\n  one range into \
             pinned memory, into faulted memory, and the batches' own buffers into pinned \
             memory; devarrow above 1.00x of one points to a wrong ceiling",
            first.threads,
            thousands((first.bytes / 1_000_000) as u64)
        );
        let _ = writeln!(
            out,
            "  {:>10}  {:>14} {:>14} {:>16}  {:>22} {:>22} {:>22}",
            "rows/batch",
            "into pinned",
            "into faulted",
            "its buffers",
            "devarrow H2D / pinned",
            "H2D / its buffers",
            "devarrow D2H / faulted"
        );
        for (p, c) in &with {
            let ratio = |direction: Direction, ceiling: f64| {
                p.timing(Method::Devarrow, direction)
                    .filter(|_| ceiling > 0.0)
                    .map_or_else(
                        || "-".to_string(),
                        |t| format!("{:.2}x", t.gbps() / ceiling),
                    )
            };
            let gather = c.gather_gbps();
            let _ = writeln!(
                out,
                "  {:>10}  {:>9.2} GB/s {:>9.2} GB/s {:>16}  {:>22} {:>22} {:>22}",
                thousands(p.batch_rows as u64),
                c.pinned_gbps(),
                c.faulted_gbps(),
                gather.map_or_else(|| "-".to_string(), |g| format!("{g:.2} GB/s")),
                ratio(Direction::HostToDevice, c.pinned_gbps()),
                gather.map_or_else(|| "-".to_string(), |g| ratio(Direction::HostToDevice, g)),
                ratio(Direction::DeviceToHost, c.faulted_gbps()),
            );
        }
        let _ = writeln!(
            out,
            "  each ceiling both ways, GB/s: {} / {}",
            CopyStores::Memcpy.key(),
            CopyStores::Streaming.key()
        );
        for (p, c) in &with {
            let both = |c: &Ceiling| match (c.memcpy_gbps(), c.streaming_gbps()) {
                (None, None) => "-".to_string(),
                (m, s) => {
                    let g =
                        |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
                    format!("{} / {}", g(m), g(s))
                }
            };
            let _ = writeln!(
                out,
                "  {:>10}  {:>14} {:>14} {:>16}",
                thousands(p.batch_rows as u64),
                both(&c.pinned),
                both(&c.faulted),
                both(&c.gather),
            );
        }
    }
    for p in points {
        if let Some(m) = &p.host_memory {
            let rows = thousands(p.batch_rows as u64);
            match &m.note {
                None => {
                    let _ = writeln!(
                        out,
                        "downloads ({rows} rows/batch): {} landed in pinned host memory, copied \
                         there directly",
                        count(m.pinned as usize, "batch", "batches")
                    );
                }
                Some(note) => {
                    let _ = writeln!(
                        out,
                        "downloads ({rows} rows/batch): {} in pinned host memory, {} in pageable \
                         memory: {note}",
                        count(m.pinned as usize, "batch", "batches"),
                        count(m.pageable as usize, "batch", "batches")
                    );
                }
            }
        }
    }
}

/// The table of one batch size: bytes, time, GB/s and share of pinned per method and
/// direction.
fn point_table(out: &mut String, p: &Point) {
    let _ = writeln!(
        out,
        "{} rows per batch: {} in {}",
        thousands(p.batch_rows as u64),
        count(p.rows, "row", "rows"),
        count(p.batches, "batch", "batches")
    );
    let _ = writeln!(
        out,
        "  {:<15} {:<18} {:>7} {:>14} {:>12} {:>8} {:>9}",
        "direction", "method", "copies", "bytes", "time", "GB/s", "of pinned"
    );
    for direction in Direction::ALL {
        for (i, method) in Method::ALL.into_iter().enumerate() {
            let Some(t) = p.timing(method, direction) else {
                continue;
            };
            let share = p
                .percent_of_pinned(method, direction)
                .map_or_else(|| "-".to_string(), |s| format!("{s:.1}%"));
            let _ = writeln!(
                out,
                "  {:<15} {:<18} {:>7} {:>14} {:>12} {:>8.2} {:>9}",
                if i == 0 { direction.label() } else { "" },
                method.label(),
                thousands(t.copies),
                thousands(t.bytes as u64),
                human_duration(t.best()),
                t.gbps(),
                share
            );
        }
    }
}

/// devarrow on several devices at once at one batch size: bytes, time and GB/s per
/// device and direction, and the total (all bytes over the wall time of the whole).
fn several_table(out: &mut String, p: &Point, m: &MultiPoint, peers_on: &str) {
    let _ = writeln!(
        out,
        "{} rows per batch, devarrow on {} devices at once (batches round-robin, one thread \
         and Transfer per device, started together)",
        thousands(p.batch_rows as u64),
        m.shares.len()
    );
    let _ = writeln!(
        out,
        "  {:<15} {:<10} {:>8} {:>14} {:>12} {:>8}",
        "direction", "device", "batches", "bytes", "time", "GB/s"
    );
    for direction in Direction::ALL {
        for (i, s) in m.shares.iter().enumerate() {
            let _ = writeln!(
                out,
                "  {:<15} {:<10} {:>8} {:>14} {:>12} {:>8.2}",
                if i == 0 { direction.label() } else { "" },
                s.id,
                thousands(s.batches as u64),
                thousands(s.bytes as u64),
                human_duration(s.best(direction)),
                s.gbps(direction)
            );
        }
        let _ = writeln!(
            out,
            "  {:<15} {:<10} {:>8} {:>14} {:>12} {:>8.2}",
            "",
            "total",
            thousands(m.shares.iter().map(|s| s.batches as u64).sum()),
            thousands(m.bytes() as u64),
            human_duration(m.best_wall(direction)),
            m.gbps(direction)
        );
    }
    let _ = writeln!(
        out,
        "  total: all bytes over the wall time of the whole; the table above (devarrow \
         alone, raw copies, buffer by buffer) ran on {peers_on} only"
    );
}

/// The table of a sweep: GB/s per method, direction and batch size.
fn sweep_table(out: &mut String, points: &[Point]) {
    let _ = writeln!(
        out,
        "GB/s by batch size (best repetition); % = devarrow's share of the pinned copy"
    );
    let _ = write!(out, "  {:>10} {:>8}", "", "");
    for method in Method::ALL {
        let _ = write!(out, "  {:^15}", method.short_label());
    }
    let _ = writeln!(out, "  {:^13}", "% of pinned");
    let _ = write!(out, "  {:>10} {:>8}", "rows/batch", "batches");
    for _ in Method::ALL {
        let _ = write!(out, "  {:>7} {:>7}", "H2D", "D2H");
    }
    let _ = writeln!(out, "  {:>6} {:>6}", "H2D", "D2H");
    for p in points {
        let _ = write!(
            out,
            "  {:>10} {:>8}",
            thousands(p.batch_rows as u64),
            thousands(p.batches as u64)
        );
        for method in Method::ALL {
            for direction in Direction::ALL {
                match p.timing(method, direction) {
                    Some(t) => {
                        let _ = write!(out, " {:>7.2}", t.gbps());
                    }
                    None => {
                        let _ = write!(out, " {:>7}", "-");
                    }
                }
            }
            out.push(' ');
        }
        out.push(' ');
        for direction in Direction::ALL {
            match p.percent_of_pinned(Method::Devarrow, direction) {
                Some(s) => {
                    let _ = write!(out, " {:>5.0}%", s);
                }
                None => {
                    let _ = write!(out, " {:>6}", "-");
                }
            }
        }
        out.push('\n');
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::job::measure::Timing;
    use crate::job::options::DeviceChoice;
    use serde_json::{json, Value};

    pub(crate) fn sample_point(batch_rows: usize, scale: f64) -> Point {
        let mut timings = Vec::new();
        for (m, method) in Method::ALL.into_iter().enumerate() {
            for (d, direction) in Direction::ALL.into_iter().enumerate() {
                timings.push(Timing {
                    method,
                    direction,
                    bytes: 1_000_000,
                    copies: 1 + m as u64,
                    stages: None,
                    times: vec![
                        Duration::from_micros(((100 + 10 * m + d) as f64 * scale) as u64),
                        Duration::from_micros(200),
                    ],
                });
            }
        }
        Point {
            batch_rows,
            batches: 4,
            rows: 4 * batch_rows,
            max_batch_rows: batch_rows,
            timings,
            verified: true,
            multi: None,
            ceilings: None,
            host_memory: None,
        }
    }

    pub(crate) fn sample_run(points: Vec<Point>) -> Run {
        Run {
            options: Options {
                device: DeviceChoice::Auto,
                scale: 0.1,
                batch_sizes: points.iter().map(|p| p.batch_rows).collect(),
                reps: 2,
                input: None,
                json: Some(JsonTarget::Stdout),
                chart: None,
                link: None,
                progress: false,
                memory_check: true,
                cuda_options: CudaOptions::default(),
            },
            device: DeviceInfo {
                id: "cpu".into(),
                name: "CPU device".into(),
                cuda_summary: Err("no driver".into()),
                fallback: Some("no CUDA device found: no driver".into()),
                link: None,
                cuda_options: None,
                batched_copies: None,
                several: Vec::new(),
            },
            data: DataInfo {
                kind: "tpch-lineitem".into(),
                path: None,
                scale: Some(0.1),
                rows: 600_572,
                columns: 16,
                arrow_bytes: 138_000_000,
            },
            points,
            export_check: Some("export: ok".into()),
        }
    }

    #[test]
    fn formatting() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1234567), "1,234,567");
        assert_eq!(human_duration(Duration::from_micros(1500)), "1.500 ms");
        assert_eq!(human_duration(Duration::from_nanos(1500)), "1.500 us");
        assert_eq!(human_duration(Duration::from_millis(2500)), "2.500 s");
        assert_eq!(short_rows(1024), "1K");
        assert_eq!(short_rows(1 << 20), "1M");
        assert_eq!(short_rows(1000), "1000");
        assert_eq!(count(1, "batch", "batches"), "1 batch");
        assert_eq!(count(1000, "batch", "batches"), "1,000 batches");
    }

    #[test]
    fn the_table_has_every_method_and_direction() {
        let text = sample_run(vec![sample_point(65536, 1.0)]).text();
        assert!(
            text.contains("CPU device (no CUDA device found: no driver)"),
            "{text}"
        );
        let build = text.lines().find(|l| l.starts_with("build:   ")).unwrap();
        if cfg!(debug_assertions) {
            assert_eq!(
                build,
                "build:   debug (figures are not representative: use cargo run --release)"
            );
        } else {
            assert_eq!(build, "build:   release");
        }
        assert!(
            text.contains("65,536 rows per batch: 262,144 rows in 4 batches"),
            "{text}"
        );
        for label in [
            "devarrow",
            "raw pinned copy",
            "raw pageable copy",
            "buffer by buffer",
        ] {
            let rows = text
                .lines()
                .filter(|l| l.contains(&format!(" {label} ")))
                .count();
            assert_eq!(rows, 2, "{label}: {text}");
        }
        assert!(text.contains("host -> device") && text.contains("device -> host"));
        // pinned H2D: 1 MB in 110 us = 9.09 GB/s; devarrow: 100 us = 10 GB/s = 110%.
        assert!(text.contains("9.09"), "{text}");
        assert!(text.contains("110.0%"), "{text}");
        assert!(
            text.contains("ok: every batch (4 batches) came back"),
            "{text}"
        );

        let sweep = sample_run(vec![sample_point(1024, 1.0), sample_point(4096, 0.5)]).text();
        assert!(sweep.contains("rows/batch"), "{sweep}");
        assert!(sweep.contains("4,096"), "{sweep}");
        assert!(
            sweep.contains("ok: every batch (8 batches) came back"),
            "{sweep}"
        );
    }

    #[test]
    fn the_cuda_options_that_ran_are_reported() {
        use crate::job::cuda_options::{parse_flag, Source};
        use devarrow::cuda::HostWait;

        // On a CUDA device: all four, also at their defaults.
        let mut run = sample_run(vec![sample_point(1024, 1.0)]);
        run.device.id = "cuda:0".into();
        run.device.name = "NVIDIA H100".into();
        run.device.fallback = None;
        run.device.cuda_options = Some(CudaDeviceOptions::default());
        let text = run.text();
        assert!(
            text.contains(
                "options: batch_copies=true,register_pageable=off,host_wait=spin,\
                 reuse_events=true (CUDA device options, the defaults)"
            ),
            "{text}"
        );
        let v: Value = serde_json::from_str(&run.json_text().unwrap()).unwrap();
        assert_eq!(
            v["device"]["cuda_options"],
            json!({"batch_copies": true, "register_pageable_bytes": null,
                   "host_wait": "spin", "reuse_events": true})
        );

        let given = CudaDeviceOptions::default()
            .register_pageable(Some(1 << 20))
            .host_wait(HostWait::Block);
        run.device.cuda_options = Some(given);
        run.options.cuda_options = CudaOptions {
            options: given,
            source: Source::Env,
            text: Some("register_pageable=1MiB,host_wait=block".into()),
            env_overridden: false,
        };
        let text = run.text();
        assert!(
            text.contains(
                "options: batch_copies=true,register_pageable=1MiB,host_wait=block,\
                 reuse_events=true (CUDA device options, from DEVARROW_CUDA_OPTIONS)"
            ),
            "{text}"
        );
        let v: Value = serde_json::from_str(&run.json_text().unwrap()).unwrap();
        assert_eq!(
            v["device"]["cuda_options"],
            json!({"batch_copies": true, "register_pageable_bytes": 1048576,
                   "host_wait": "block", "reuse_events": true})
        );
        assert_eq!(
            v["options"]["cuda_options"],
            json!({"source": "DEVARROW_CUDA_OPTIONS",
                   "given": "register_pageable=1MiB,host_wait=block",
                   "env_overridden": false})
        );

        // On the CPU device: given, not used, and said so.
        let mut run = sample_run(vec![sample_point(1024, 1.0)]);
        run.options.cuda_options = CudaOptions::resolve(
            Some(parse_flag("batch_copies").unwrap()),
            Some(std::ffi::OsStr::new("host_wait=block")),
        )
        .unwrap();
        let text = run.text();
        assert!(
            text.contains(
                "options: CUDA options from --cuda-options (`batch_copies`) not used: the CPU \
                 device has none"
            ),
            "{text}"
        );
        let v: Value = serde_json::from_str(&run.json_text().unwrap()).unwrap();
        assert!(v["device"]["cuda_options"].is_null());
        assert_eq!(v["options"]["cuda_options"]["source"], "--cuda-options");
        assert_eq!(v["options"]["cuda_options"]["env_overridden"], true);
        // Nothing given on the CPU device: no line.
        let text = sample_run(vec![sample_point(1024, 1.0)]).text();
        assert!(!text.contains("options:"), "{text}");
    }

    #[test]
    fn several_devices_have_their_rows_and_a_total() {
        use crate::job::measure::{DeviceShare, MultiPoint};
        let ms = Duration::from_millis;
        // One device: no trace of several, in the table or the JSON.
        let one = sample_run(vec![sample_point(1024, 1.0)]);
        assert!(!one.text().contains("devices at once"));
        let v: Value = serde_json::from_str(&one.json_text().unwrap()).unwrap();
        let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert!(!keys(&v["device"]).contains(&"devices".to_string()), "{v}");
        assert!(
            !keys(&v["points"][0]).contains(&"devices".to_string()),
            "{v}"
        );
        assert!(!keys(&v["points"][0]).contains(&"total".to_string()), "{v}");

        let mut point = sample_point(1024, 1.0);
        let share = |id: &str, batches, to_device: u64, to_host: u64| DeviceShare {
            id: id.into(),
            batches,
            bytes: 1_000_000,
            to_device: vec![ms(to_device), ms(2 * to_device)],
            to_host: vec![ms(to_host)],
        };
        point.multi = Some(MultiPoint {
            shares: vec![share("cuda:0", 3, 1, 2), share("cuda:1", 2, 2, 1)],
            wall_to_device: vec![ms(4), ms(2)],
            wall_to_host: vec![ms(2)],
        });
        let mut run = sample_run(vec![point]);
        run.device.id = "cuda:0".into();
        run.device.fallback = None;
        run.device.several = vec![
            ("cuda:0".into(), "GPU A".into()),
            ("cuda:1".into(), "GPU B".into()),
        ];
        let text = run.text();
        assert!(
            text.contains("device:  GPU A (cuda:0), GPU B (cuda:1)"),
            "{text}"
        );
        assert!(text.contains("devarrow on 2 devices at once"), "{text}");
        // 1 MB in 1 ms = 1 GB/s; the total: 2 MB in 2 ms = 1 GB/s.
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.trim_start().starts_with("total "))
            .collect();
        assert_eq!(rows.len(), 2, "{text}");
        for row in rows {
            assert!(row.contains("2,000,000") && row.ends_with("1.00"), "{row}");
        }
        assert!(text.contains("ran on cuda:0 only"), "{text}");

        let v: Value = serde_json::from_str(&run.json_text().unwrap()).unwrap();
        assert_eq!(
            v["device"]["devices"],
            json!([{"id": "cuda:0", "name": "GPU A"}, {"id": "cuda:1", "name": "GPU B"}])
        );
        let p = &v["points"][0];
        assert_eq!(p["devices"][1]["id"], "cuda:1");
        assert_eq!(p["devices"][1]["batches"], 2);
        assert_eq!(p["devices"][1]["host_to_device"]["best_s"], 0.002);
        assert_eq!(p["devices"][1]["host_to_device"]["gbps"], 0.5);
        assert_eq!(p["devices"][0]["device_to_host"]["gbps"], 0.5);
        assert_eq!(p["total"]["bytes"], 2_000_000);
        assert_eq!(p["total"]["batches"], 5);
        assert_eq!(p["total"]["devices"], 2);
        assert_eq!(p["total"]["host_to_device"]["gbps"], 1.0);
        assert_eq!(
            p["total"]["host_to_device"]["times_s"],
            json!([0.004, 0.002])
        );
        assert_eq!(p["total"]["peers_on"], "cuda:0");
        assert_eq!(p["measurements"].as_array().unwrap().len(), 8);
    }

    #[test]
    fn json_shape() {
        let run = sample_run(vec![sample_point(1024, 1.0), sample_point(4096, 0.5)]);
        // Round trip through text: what `--json` writes parses.
        let text = run.json_text().unwrap();
        assert!(text.ends_with("}\n"));
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["commit"], devarrow::GIT_COMMIT);
        assert_eq!(
            v["build"],
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
        );
        assert!(v["unix_time"].as_u64().unwrap() > 1_600_000_000);
        assert!(v["host"]["cpus"].as_u64().unwrap() >= 1);
        assert_eq!(v["device"]["id"], "cpu");
        assert_eq!(v["device"]["cuda_unavailable"], "no driver");
        assert!(v["device"]["cuda_devices"].is_null());
        assert_eq!(v["options"]["device"], "auto");
        assert_eq!(v["options"]["batch_sizes"], json!([1024, 4096]));
        assert_eq!(v["options"]["reps"], 2);
        assert_eq!(v["options"]["json"], "-");
        assert_eq!(v["options"]["scale"], 0.1);
        assert_eq!(v["options"]["warmup_reps"], 1);
        assert_eq!(v["options"]["memory_check"], true);
        assert!(v["options"]["input"].is_null() && v["options"]["chart"].is_null());
        assert!(v["device"]["fallback_reason"].as_str().is_some());
        assert_eq!(v["data"]["kind"], "tpch-lineitem");
        assert_eq!(v["data"]["scale"], 0.1);
        assert!(v["data"]["path"].is_null());
        assert_eq!(v["data"]["arrow_bytes"], 138_000_000);
        assert_eq!(v["units"]["time"], "seconds");
        assert_eq!(v["export_check"], "export: ok");
        // The CPU device ran no CUDA options; none were asked for.
        assert!(v["device"]["cuda_options"].is_null());
        assert_eq!(
            v["options"]["cuda_options"],
            json!({"source": "default", "given": null, "env_overridden": false})
        );
        assert_eq!(v["devarrow_version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(v["host"]["os"], std::env::consts::OS);
        assert_eq!(v["data"]["rows"], 600_572);
        let points = v["points"].as_array().unwrap();
        assert_eq!(points.len(), 2);
        for p in points {
            assert_eq!(p["verified"], true);
            let m = p["measurements"].as_array().unwrap();
            assert_eq!(m.len(), 8);
            for x in m {
                for key in [
                    "method",
                    "direction",
                    "bytes",
                    "copies",
                    "best_s",
                    "median_s",
                    "gbps",
                ] {
                    assert!(!x[key].is_null(), "{key}: {x}");
                }
                assert_eq!(x["times_s"].as_array().unwrap().len(), 2);
                assert!(x["percent_of_pinned"].as_f64().unwrap() > 0.0);
            }
            let pinned = m
                .iter()
                .find(|x| x["method"] == "pinned" && x["direction"] == "host_to_device")
                .unwrap();
            assert_eq!(pinned["percent_of_pinned"], 100.0);
        }
    }
}
