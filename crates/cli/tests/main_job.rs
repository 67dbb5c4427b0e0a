//! The main job (`devarrow`), run as a process: exit codes, the CPU fallback message,
//! one-line errors, `--json -`, `--chart`, `--input`. Small scales, so it is quick in a
//! debug build.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, RecordBatch, StringArray};

fn devarrow(args: &[&str]) -> Output {
    devarrow_with_cuda_options(args, None)
}

/// Runs the job with `DEVARROW_CUDA_OPTIONS` set to `env` (removed with `None`, so that a
/// value in the tests' own environment changes nothing).
fn devarrow_with_cuda_options(args: &[&str], env: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_devarrow"));
    command.args(args).env_remove("RUST_BACKTRACE");
    match env {
        Some(value) => command.env("DEVARROW_CUDA_OPTIONS", value),
        None => command.env_remove("DEVARROW_CUDA_OPTIONS"),
    };
    command.output().expect("the devarrow binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Whether this machine has a CUDA device that the job would pick.
fn has_gpu() -> bool {
    devarrow::bridge::select::cuda_summary().is_ok()
}

/// Whether a CUDA-only test runs: `true` with a CUDA device; without one it prints that it
/// skips and returns `false`, or fails under `DEVARROW_REQUIRE_GPU=1`.
fn gpu_or_skip() -> bool {
    if has_gpu() {
        return true;
    }
    assert!(
        std::env::var("DEVARROW_REQUIRE_GPU").as_deref() != Ok("1"),
        "DEVARROW_REQUIRE_GPU=1 but no CUDA device"
    );
    eprintln!("skipped: no CUDA device");
    false
}

/// A directory of its own under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("devarrow-main-job-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A failure: non-zero exit, exactly one line on stderr, starting `devarrow: error:`,
/// and no panic.
fn assert_one_line_error(out: &Output, code: i32) -> String {
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "stderr: {stderr}");
    assert!(stderr.starts_with("devarrow: error: "), "stderr: {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "stdout: {}", text(&out.stdout));
    stderr
}

#[test]
fn a_plain_run_succeeds_and_names_its_device() {
    let out = devarrow(&["--scale", "0.001", "--reps", "1"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    if has_gpu() {
        assert!(stdout.contains("(cuda:0)"), "{stdout}");
    } else {
        assert!(
            stdout.contains("device:  CPU device (no CUDA device found: "),
            "{stdout}"
        );
        assert!(stderr.contains("running on the CPU device"), "{stderr}");
    }
    assert!(
        stdout.contains(&format!("commit {}", devarrow::GIT_COMMIT)),
        "{stdout}"
    );
    assert!(stdout.contains("TPC-H lineitem, scale 0.001"), "{stdout}");
    for row in [
        "devarrow",
        "raw pinned copy",
        "raw pageable copy",
        "buffer by buffer",
    ] {
        assert!(stdout.contains(row), "{row}: {stdout}");
    }
    assert!(stdout.contains("came back from the") && stdout.contains("equal to the input"));
    assert!(stderr.contains("generating TPC-H lineitem"), "{stderr}");
    // stderr is not a terminal here: lines, no progress bars (no cursor movement).
    assert!(
        !stderr.contains('\r') && !stderr.contains('\x1b'),
        "{stderr:?}"
    );
    assert!(
        stderr.lines().all(|l| l.starts_with("devarrow: ")),
        "{stderr}"
    );
}

#[test]
fn json_to_stdout_parses_and_silences_stderr() {
    let out = devarrow(&[
        "--scale", "0.001", "--reps", "2", "--device", "cpu", "--json", "-",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(out.stderr.is_empty(), "stderr: {}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    assert_eq!(v["commit"], devarrow::GIT_COMMIT);
    assert_eq!(v["device"]["id"], "cpu");
    assert_eq!(v["options"]["scale"], 0.001);
    assert_eq!(v["options"]["reps"], 2);
    assert!(v["data"]["rows"].as_u64().unwrap() > 5000);
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 1);
    assert_eq!(points[0]["verified"], true);
    let measurements = points[0]["measurements"].as_array().unwrap();
    assert_eq!(measurements.len(), 8);
    for m in measurements {
        assert_eq!(m["times_s"].as_array().unwrap().len(), 2, "{m}");
        assert!(m["bytes"].as_u64().unwrap() > 0, "{m}");
    }
}

#[test]
fn chart_json_file_and_input_file() {
    let dir = TempDir::new("files");
    // A small Parquet file as input.
    let input = dir.path("small.parquet");
    let batch = RecordBatch::try_from_iter([
        ("x", Arc::new(Int32Array::from_iter(0..5000)) as ArrayRef),
        (
            "s",
            Arc::new(StringArray::from_iter(
                (0..5000).map(|i| (i % 3 != 0).then(|| format!("s{i}"))),
            )) as ArrayRef,
        ),
    ])
    .unwrap();
    let mut writer = parquet::arrow::ArrowWriter::try_new(
        std::fs::File::create(&input).unwrap(),
        batch.schema(),
        None,
    )
    .unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();

    let (chart, json) = (dir.path("chart.svg"), dir.path("out.json"));
    let out = devarrow(&[
        "--input",
        &input,
        "--device",
        "cpu",
        "--reps",
        "1",
        "--batch-size",
        "1K..4K",
        "--chart",
        &chart,
        "--json",
        &json,
        "--quiet",
    ]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "stdout: {stdout}\nstderr: {}",
        text(&out.stderr)
    );
    assert!(out.stderr.is_empty(), "--quiet: {}", text(&out.stderr));
    assert!(
        stdout.contains("small.parquet (parquet): 5,000 rows, 2 columns"),
        "{stdout}"
    );
    assert!(
        stdout.contains("rows/batch"),
        "a sweep prints its table: {stdout}"
    );

    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("Host-device transfer bandwidth on the CPU device"));
    for method in [
        "devarrow",
        "raw pinned copy",
        "raw pageable copy",
        "buffer by buffer",
    ] {
        for direction in ["H2D", "D2H"] {
            let series = format!("{method} {direction}");
            assert!(svg.contains(&series), "{series}");
        }
    }

    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["data"]["kind"], "parquet");
    assert!(v["options"]["scale"].is_null());
    let points = v["points"].as_array().unwrap();
    let sizes: Vec<u64> = points
        .iter()
        .map(|p| p["batch_rows"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [1024, 2048, 4096]);
    assert_eq!(points[0]["batches"], 5); // 5000 rows in batches of 1024
}

#[test]
fn a_bad_input_path_is_a_one_line_error() {
    let out = devarrow(&["--input", "/nonexistent/devarrow/lineitem.parquet"]);
    let stderr = assert_one_line_error(&out, 1);
    assert!(
        stderr.contains("/nonexistent/devarrow/lineitem.parquet"),
        "{stderr}"
    );

    let dir = TempDir::new("bad");
    let garbage = dir.path("garbage.bin");
    std::fs::write(&garbage, b"this is not arrow").unwrap();
    let stderr = assert_one_line_error(&devarrow(&["--input", &garbage]), 1);
    assert!(stderr.contains("neither Parquet nor Arrow IPC"), "{stderr}");

    let fake = dir.path("fake.arrow");
    std::fs::write(&fake, b"this is not arrow").unwrap();
    let stderr = assert_one_line_error(&devarrow(&["--input", &fake]), 1);
    assert!(
        stderr.contains("cannot read") && stderr.contains("fake.arrow"),
        "{stderr}"
    );

    let stderr = assert_one_line_error(
        &devarrow(&["--scale", "0.001", "--chart", "/nonexistent/devarrow/c.svg"]),
        1,
    );
    assert!(stderr.contains("not a directory"), "{stderr}");
}

#[test]
fn bad_options_are_one_line_errors_with_exit_code_2() {
    for args in [
        &["--device", "tpu"][..],
        &["--device", "cuda:0,0"],
        &["--device", "cuda:0,"],
        &["--scale", "-1"],
        &["--batch-size", "lots"],
        &["--no-such-option"],
        &["--reps", "0"],
    ] {
        let stderr = assert_one_line_error(&devarrow(args), 2);
        assert!(stderr.contains("--help"), "{args:?}: {stderr}");
    }
}

#[test]
fn an_explicit_cuda_device_that_is_missing_is_an_error() {
    if has_gpu() {
        // cuda:99 does not exist on any machine this runs on.
        let stderr =
            assert_one_line_error(&devarrow(&["--device", "cuda:99", "--scale", "0.001"]), 1);
        assert!(stderr.contains("cuda:99 is not available"), "{stderr}");
    } else {
        let stderr =
            assert_one_line_error(&devarrow(&["--device", "cuda:0", "--scale", "0.001"]), 1);
        assert!(stderr.contains("cuda:0 is not available"), "{stderr}");
    }
}

#[test]
fn help_and_version_exit_0() {
    let out = devarrow(&["--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for option in [
        "--scale",
        "--device",
        "--batch-size",
        "--reps",
        "--input",
        "--json",
        "--chart",
    ] {
        assert!(help.contains(option), "{option}: {help}");
    }
    assert!(devarrow(&["--version"]).status.success());
    assert!(help.contains("--no-memory-check") && help.contains("FILE.png"));
}

/// The PNG signature, then an IHDR chunk.
fn is_png(bytes: &[u8]) -> bool {
    bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.get(12..16) == Some(&b"IHDR"[..])
}

#[test]
fn a_png_chart_or_a_clear_refusal() {
    let dir = TempDir::new("png");
    let png = dir.path("sweep.png");
    let out = devarrow(&[
        "--scale",
        "0.001",
        "--device",
        "cpu",
        "--reps",
        "1",
        "--batch-size",
        "2K,4K",
        "--chart",
        &png,
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&format!("chart:   {png}")));
    assert!(is_png(&std::fs::read(&png).unwrap()));

    // Any other extension is refused before anything runs.
    let jpg = dir.path("sweep.jpg");
    let stderr = assert_one_line_error(&devarrow(&["--chart", &jpg]), 2);
    assert!(stderr.contains(".svg or .png"), "{stderr}");
    assert!(!std::path::Path::new(&jpg).exists());
}

/// pyarrow writes Feather files compressed with lz4 by default (zstd on request).
#[test]
fn compressed_feather_input() {
    let dir = TempDir::new("feather");
    let batches = devarrow_cli::tpch::lineitem(0.001, 4000);
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    for (name, codec) in [
        ("lz4.feather", arrow_ipc::CompressionType::LZ4_FRAME),
        ("zstd.feather", arrow_ipc::CompressionType::ZSTD),
    ] {
        let path = dir.path(name);
        let options = arrow_ipc::writer::IpcWriteOptions::default()
            .try_with_compression(Some(codec))
            .unwrap();
        let mut w = arrow_ipc::writer::FileWriter::try_new_with_options(
            std::fs::File::create(&path).unwrap(),
            &devarrow_cli::tpch::lineitem_schema(),
            options,
        )
        .unwrap();
        for b in &batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
        let out = devarrow(&[
            "--input", &path, "--device", "cpu", "--reps", "1", "--json", "-",
        ]);
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["data"]["rows"], rows, "{name}");
        // Decompressed, the data is larger than the file.
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(v["data"]["arrow_bytes"].as_u64().unwrap() > size, "{name}");
    }
}

#[test]
fn a_scale_that_does_not_fit_is_a_one_line_error() {
    // Only where the check can run (Linux), and where scale 1000 (about 1.4 TB of Arrow
    // buffers) does not fit: everywhere this runs.
    let Some(available) = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    }) else {
        return;
    };
    if available > 1 << 40 {
        return;
    }
    let stderr = assert_one_line_error(&devarrow(&["--scale", "1000", "--device", "cpu"]), 1);
    for part in [
        "--scale 1000 needs about",
        "is available",
        "--no-memory-check",
    ] {
        assert!(stderr.contains(part), "{part}: {stderr}");
    }
}

#[test]
fn an_input_without_rows_is_an_error() {
    let dir = TempDir::new("empty");
    let path = dir.path("empty.arrows");
    let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
        "x",
        arrow_schema::DataType::Int32,
        false,
    )]));
    let mut w =
        arrow_ipc::writer::StreamWriter::try_new(std::fs::File::create(&path).unwrap(), &schema)
            .unwrap();
    w.finish().unwrap();
    let stderr = assert_one_line_error(&devarrow(&["--input", &path]), 1);
    assert!(stderr.contains("holds no rows"), "{stderr}");
}

#[test]
fn lineitem_from_an_arrow_ipc_file_cut_into_other_batch_sizes() {
    let dir = TempDir::new("lineitem");
    let path = dir.path("lineitem.arrow");
    let batches = devarrow_cli::tpch::lineitem(0.001, 4000);
    let mut w = arrow_ipc::writer::FileWriter::try_new(
        std::fs::File::create(&path).unwrap(),
        &devarrow_cli::tpch::lineitem_schema(),
    )
    .unwrap();
    for b in &batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();

    let out = devarrow(&[
        "--input",
        &path,
        "--device",
        "cpu",
        "--reps",
        "1",
        "--batch-size",
        "1000,5K",
        "--json",
        "-",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["data"]["kind"], "arrow-ipc-file");
    assert_eq!(v["data"]["rows"], rows);
    assert_eq!(v["data"]["columns"], 16);
    for p in v["points"].as_array().unwrap() {
        let size = p["batch_rows"].as_u64().unwrap() as usize;
        assert_eq!(p["batches"], rows.div_ceil(size), "{p}");
        assert_eq!(p["rows"], rows);
        assert_eq!(p["max_batch_rows"], size);
        assert_eq!(p["verified"], true);
    }
}

/// The four CUDA options, as an error message lists them.
const CUDA_OPTIONS: [&str; 4] = [
    "batch_copies",
    "register_pageable",
    "host_wait",
    "reuse_events",
];

#[test]
fn bad_cuda_options_name_the_item_and_list_the_valid_ones() {
    // The flag: a bad command line.
    let stderr = assert_one_line_error(
        &devarrow(&["--cuda-options", "batch_copies,host_wait=fast"]),
        2,
    );
    assert!(stderr.contains("`host_wait=fast`"), "{stderr}");
    for name in CUDA_OPTIONS {
        assert!(stderr.contains(name), "{name}: {stderr}");
    }
    // The variable: the same, said to come from it, before anything runs (also on the
    // CPU device, where the options would not be used).
    for (value, item) in [
        ("batch_copy", "`batch_copy`"),
        ("register_pageable=1MB", "`register_pageable=1MB`"),
        ("register_pageable", "`register_pageable`"),
    ] {
        let out = devarrow_with_cuda_options(&["--device", "cpu", "--scale", "0.001"], Some(value));
        let stderr = assert_one_line_error(&out, 2);
        assert!(
            stderr.starts_with("devarrow: error: DEVARROW_CUDA_OPTIONS: "),
            "{stderr}"
        );
        assert!(stderr.contains(item), "{value}: {stderr}");
        for name in CUDA_OPTIONS {
            assert!(stderr.contains(name), "{name}: {stderr}");
        }
    }
    // --cuda-options contradicts --device cpu.
    let stderr = assert_one_line_error(
        &devarrow(&["--device", "cpu", "--cuda-options", "batch_copies"]),
        1,
    );
    assert!(
        stderr.contains("--cuda-options") && stderr.contains("CPU device"),
        "{stderr}"
    );
}

#[test]
fn help_names_the_cuda_options_and_the_variable() {
    let help = text(&devarrow(&["--help"]).stdout);
    assert!(help.contains("--cuda-options <LIST>"), "{help}");
    assert!(help.contains("DEVARROW_CUDA_OPTIONS"), "{help}");
    assert!(help.contains("wins over the variable"), "{help}");
    for name in CUDA_OPTIONS {
        assert!(help.contains(name), "{name}: {help}");
    }
}

/// `--json -` of a small run on `device` with the flag (if any) and the variable (if any).
fn json_run(device: &str, flag: Option<&str>, env: Option<&str>) -> serde_json::Value {
    let mut args = vec![
        "--device", device, "--scale", "0.001", "--reps", "1", "--json", "-",
    ];
    if let Some(flag) = flag {
        args.extend(["--cuda-options", flag]);
    }
    let out = devarrow_with_cuda_options(&args, env);
    assert!(out.status.success(), "{}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

#[test]
fn cuda_options_from_the_variable_on_the_cpu_device_are_noted_not_used() {
    let out = devarrow_with_cuda_options(
        &["--device", "cpu", "--scale", "0.001", "--reps", "1"],
        Some("batch_copies,register_pageable=1MiB"),
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let note = "CUDA options from DEVARROW_CUDA_OPTIONS (`batch_copies,register_pageable=1MiB`) \
                not used: the CPU device has none";
    assert!(stderr.contains(note), "{stderr}");
    assert!(stdout.contains(&format!("options: {note}")), "{stdout}");

    let v = json_run("cpu", None, Some("host_wait=block"));
    assert!(v["device"]["cuda_options"].is_null(), "{v}");
    assert_eq!(
        v["options"]["cuda_options"],
        serde_json::json!({"source": "DEVARROW_CUDA_OPTIONS", "given": "host_wait=block",
                           "env_overridden": false})
    );
    let v = json_run("cpu", None, None);
    assert_eq!(v["options"]["cuda_options"]["source"], "default");
}

/// On a CUDA device (a GPU, or the emulated driver of `.ci/emulated-gpu`): the options
/// run, all four are reported, and the flag wins over the variable.
#[test]
fn cuda_options_run_on_the_cuda_device() {
    if !gpu_or_skip() {
        return;
    }
    let defaults = serde_json::json!({"batch_copies": true, "register_pageable_bytes": null,
                                      "host_wait": "spin", "reuse_events": true});
    let v = json_run("cuda", None, None);
    assert_eq!(v["device"]["cuda_options"], defaults, "{v}");
    assert_eq!(v["options"]["cuda_options"]["source"], "default");

    let v = json_run("cuda", None, Some("batch_copies,register_pageable=1MiB"));
    assert_eq!(
        v["device"]["cuda_options"],
        serde_json::json!({"batch_copies": true, "register_pageable_bytes": 1048576,
                           "host_wait": "spin", "reuse_events": true}),
        "{v}"
    );
    assert_eq!(
        v["options"]["cuda_options"]["source"],
        "DEVARROW_CUDA_OPTIONS"
    );
    assert!(v["points"][0]["verified"].as_bool().unwrap());

    let v = json_run(
        "cuda",
        Some("host_wait=block,reuse_events=false"),
        Some("batch_copies=false"),
    );
    assert_eq!(
        v["device"]["cuda_options"],
        serde_json::json!({"batch_copies": true, "register_pageable_bytes": null,
                           "host_wait": "block", "reuse_events": false}),
        "{v}"
    );
    assert_eq!(v["options"]["cuda_options"]["source"], "--cuda-options");
    assert_eq!(v["options"]["cuda_options"]["env_overridden"], true);
    assert!(v["points"][0]["verified"].as_bool().unwrap());

    // The table says which ran.
    let out = devarrow_with_cuda_options(
        &["--device", "cuda", "--scale", "0.001", "--reps", "1"],
        Some("host_wait=block"),
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.contains(
            "options: batch_copies=true,register_pageable=off,host_wait=block,\
             reuse_events=true (CUDA device options, from DEVARROW_CUDA_OPTIONS)"
        ),
        "{stdout}"
    );
}

/// `--device cuda:all` on two (emulated) devices: devarrow runs on both at once, and the
/// JSON has every device's figures and the total. On the emulated driver of
/// `.ci/emulated-gpu` the child gets `DEVARROW_EMU_DEVICES=2` (ignored by a real driver,
/// where the test needs two GPUs and skips with fewer).
#[test]
fn several_devices_report_each_device_and_the_total() {
    if !gpu_or_skip() {
        return;
    }
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_devarrow"))
            .args(args)
            .env("DEVARROW_EMU_DEVICES", "2")
            .env_remove("DEVARROW_CUDA_OPTIONS")
            .env_remove("RUST_BACKTRACE")
            .output()
            .expect("the devarrow binary runs")
    };
    let args = [
        "--device",
        "cuda:all",
        "--scale",
        "0.001",
        "--reps",
        "1",
        "--batch-size",
        "1K",
        "--json",
        "-",
    ];
    let out = run(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    let devices = v["device"]["devices"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if devices.len() < 2 {
        // A real machine with one GPU: `cuda:all` is that device, reported as today.
        assert!(v["points"][0]["devices"].is_null(), "{v}");
        eprintln!(
            "skipped: fewer than 2 CUDA devices (a real driver ignores DEVARROW_EMU_DEVICES)"
        );
        return;
    }
    assert_eq!(v["options"]["device"], "cuda:all");
    assert_eq!(v["device"]["id"], "cuda:0");
    assert_eq!(devices.len(), 2, "{v}");
    assert_eq!(devices[1]["id"], "cuda:1");
    let point = &v["points"][0];
    assert_eq!(point["verified"], true);
    let shares = point["devices"].as_array().expect("per-device figures");
    assert_eq!(shares.len(), 2, "{point}");
    let total = &point["total"];
    let batches = point["batches"].as_u64().unwrap();
    assert!(batches >= 2, "{point}");
    let mut bytes = 0;
    for (i, share) in shares.iter().enumerate() {
        assert_eq!(share["id"], format!("cuda:{i}"));
        // Round-robin: the first device gets the odd one out.
        let expected = (batches + 1 - i as u64) / 2;
        assert_eq!(share["batches"].as_u64(), Some(expected), "{share}");
        assert!(share["bytes"].as_u64().unwrap() > 0, "{share}");
        bytes += share["bytes"].as_u64().unwrap();
        for direction in ["host_to_device", "device_to_host"] {
            let figure = &share[direction];
            assert!(figure["gbps"].as_f64().unwrap() > 0.0, "{share}");
            assert_eq!(figure["times_s"].as_array().unwrap().len(), 1, "{share}");
            // No device takes longer than the whole.
            assert!(
                figure["best_s"].as_f64().unwrap() <= total[direction]["best_s"].as_f64().unwrap(),
                "{point}"
            );
        }
    }
    assert_eq!(total["devices"], 2);
    assert_eq!(total["batches"].as_u64(), Some(batches));
    assert_eq!(total["bytes"].as_u64(), Some(bytes));
    assert_eq!(total["peers_on"], "cuda:0");
    for direction in ["host_to_device", "device_to_host"] {
        assert!(total[direction]["gbps"].as_f64().unwrap() > 0.0, "{total}");
    }
    // devarrow alone on cuda:0 moved the same bytes.
    let single = point["measurements"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["method"] == "devarrow" && m["direction"] == "host_to_device")
        .unwrap();
    assert_eq!(single["bytes"].as_u64(), Some(bytes));

    // The table: a row per device and direction, and the totals.
    let out = run(&args[..args.len() - 2]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(stdout.contains("devarrow on 2 devices at once"), "{stdout}");
    assert!(
        stdout.contains("(cuda:0), ") && stdout.contains("(cuda:1)"),
        "{stdout}"
    );
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.trim_start().starts_with("cuda:1 "))
            .count(),
        2,
        "{stdout}"
    );
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.trim_start().starts_with("total "))
            .count(),
        2,
        "{stdout}"
    );
    assert!(stdout.contains("ran on cuda:0 only"), "{stdout}");

    // A device of a list that does not open is named.
    let stderr = assert_one_line_error(&run(&["--device", "cuda:0,7", "--scale", "0.001"]), 1);
    assert!(
        stderr.contains("--device cuda:0,7: CUDA device cuda:7 did not open"),
        "{stderr}"
    );
}

#[test]
fn several_devices_without_cuda_are_an_error() {
    if has_gpu() {
        eprintln!("skipped: a CUDA device is present");
        return;
    }
    let stderr = assert_one_line_error(&devarrow(&["--device", "cuda:all", "--scale", "0.001"]), 1);
    assert!(
        stderr.contains("--device cuda:all: no CUDA device to run on"),
        "{stderr}"
    );
    let stderr = assert_one_line_error(&devarrow(&["--device", "cuda:0,1", "--scale", "0.001"]), 1);
    assert!(
        stderr.contains("--device cuda:0,1: CUDA device cuda:0 did not open"),
        "{stderr}"
    );
}
