//! What a run prints (a table) and writes (JSON): this file holds the run and its text,
//! `tables.rs` the text's tables, `json.rs` the JSON.

use std::fmt::Write as _;
use std::time::Duration;

use devarrow::abi::device::LinkModel;
use devarrow::cuda::CudaDeviceOptions;
use serde::Serialize;

use super::cuda_options::{self, CudaOptions};
use super::measure::Point;
#[cfg(test)]
use super::measure::{Direction, Method};
use super::options::{JsonTarget, Options};
pub use super::text::thousands;

mod json;
mod tables;

use tables::{host_lines, point_table, several_table, sweep_table};

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
        if o.transfer_options.text.is_some() {
            let _ = writeln!(
                out,
                "transfer: {} (devarrow's transfer, from --transfer-options)",
                o.transfer_options.describe()
            );
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
                transfer_options: Default::default(),
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
