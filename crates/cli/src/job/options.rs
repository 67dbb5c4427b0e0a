//! The command line of the main job (clap), and the parsers of its values.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use clap::Parser;
use devarrow::abi::device::LinkModel;

use super::cuda_options::{self, CudaOptions, CudaOptionsError};
use super::transfer_options;

/// TPC-H scale factor used when neither `--scale` nor `--input` is given: about 600,000
/// `lineitem` rows, some 140 MB of Arrow buffers; a few seconds on the CPU device in a
/// release build, well under a second of copies on a GPU.
pub const DEFAULT_SCALE: f64 = 0.1;

/// Rows per batch when `--batch-size` is not given and no chart is asked for.
pub const DEFAULT_BATCH_ROWS: usize = 64 << 10;

/// The batch sizes swept when `--chart` is given without `--batch-size`: 1K to 1M rows,
/// in steps of 4.
pub const DEFAULT_SWEEP: [usize; 6] = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20];

/// Examples shown at the end of `--help`.
const EXAMPLES: &str = "Examples:
  devarrow                                  lineitem at scale 0.1, 64K rows per batch
  devarrow --device cpu --scale 0.01 --json -
  devarrow --chart sweep.svg --json sweep.json
  devarrow --chart sweep.png --device cpu
  devarrow --input data.parquet --batch-size 64K,1M
  devarrow --device cuda --cuda-options batch_copies,register_pageable=1MiB
  DEVARROW_CUDA_OPTIONS=host_wait=block devarrow --device cuda";

/// Smallest accepted `--scale` (about 6,000 rows; the generator fails on much smaller
/// scales).
const MIN_SCALE: f64 = 0.001;

/// Largest accepted `--scale`.
const MAX_SCALE: f64 = 1000.0;

/// Largest accepted `--batch-size`.
const MAX_BATCH_ROWS: usize = 1 << 30;

/// Benchmarks host-to-device and device-to-host transfer of real Arrow data with
/// devarrow, beside raw pinned and pageable copies of the same byte count and a
/// buffer-by-buffer copy, and checks that every batch comes back equal.
#[derive(Debug, Clone, Parser)]
#[command(name = "devarrow", version, after_help = EXAMPLES)]
pub struct Cli {
    /// TPC-H scale factor of the generated `lineitem` table, 0.001 to 1000 (1.0 is about
    /// 6 million rows) [default: 0.1]
    #[arg(long, value_parser = parse_scale, conflicts_with = "input")]
    pub scale: Option<f64>,

    /// Device to run on: `cpu`, `cuda` (= `cuda:0`), `cuda:N`, or `auto` (cuda:0 when a
    /// CUDA device opens, else the CPU device); several CUDA devices at once with a list
    /// (`cuda:0,1`) or `cuda:all`: devarrow moves the batches round-robin to all of them
    /// together (the peer methods run on the first)
    #[arg(long, value_parser = parse_device, default_value = "auto")]
    pub device: DeviceChoice,

    /// Rows per batch: one size (`65536`, `64K`, `1M`), a list (`1K,16K,1M`) or a
    /// doubling range (`1K..1M`); K = 1024, M = 1024 * 1024 [default: 64K, or
    /// 1K,4K,16K,64K,256K,1M with --chart]
    #[arg(long, value_name = "ROWS", value_parser = parse_batch_sizes)]
    pub batch_size: Option<BatchSizes>,

    /// Timed repetitions of every measurement (the best is reported), after one
    /// untimed warm-up
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub reps: u32,

    /// Transfer the data of FILE instead of generated data: Parquet, or an Arrow IPC
    /// file or stream (detected from the magic bytes, else the extension: .parquet,
    /// .arrow/.feather, .arrows/.ipc)
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,

    /// Write every measurement, the device, the commit and the options as JSON to FILE,
    /// or to stdout with `-` (or no value), which silences everything else
    #[arg(long, value_name = "FILE|-", num_args = 0..=1, default_missing_value = "-")]
    pub json: Option<String>,

    /// On the CPU device, model a host-device link: copies run asynchronously on a
    /// copy-engine thread at BANDWIDTH (GB/s = 10^9 bytes/s) plus LATENCY per copy, e.g.
    /// `4GB/s,10us`; `host[,LATENCY]`: as fast as this machine's own parallel memcpy into
    /// pinned memory (measured at start), so that host-side stalls show [default: no
    /// link: transfers pack straight into the CPU device's memory]
    #[arg(long, value_name = "BANDWIDTH,LATENCY", value_parser = parse_link)]
    pub link: Option<LinkModel>,

    /// CUDA device options, comma-separated: batch_copies[=BOOL],
    /// register_pageable=SIZE|off (K/KiB, M/MiB, G/GiB: powers of 1024),
    /// host_wait=spin|block, reuse_events[=BOOL]; those not named keep their defaults
    /// (batch_copies=true, register_pageable=off, host_wait=spin, reuse_events=true).
    /// Without this flag the environment variable DEVARROW_CUDA_OPTIONS is read (same
    /// list); the flag wins over the variable, which is then ignored. Not used on the CPU
    /// device: with --device cpu the flag is an error; when auto falls back to the CPU,
    /// or the options come from the variable, a note says they were not used
    #[arg(long, value_name = "LIST", value_parser = cuda_options::parse_flag)]
    pub cuda_options: Option<cuda_options::Given>,

    /// devarrow's transfer options, comma-separated: staging=SIZE (the staging memory of
    /// an upload, 64MiB by default), chunk=SIZE (one staging buffer, 4MiB),
    /// first_chunk=SIZE (the smallest upload window, 1MiB), pack_threads=N (0: one
    /// fewer than the cores, at most 16); those not named keep their defaults. For
    /// comparing them on one machine beside the same ceilings
    #[arg(long, value_name = "LIST", value_parser = transfer_options::parse_flag)]
    pub transfer_options: Option<transfer_options::TransferGiven>,

    /// Write a chart of bandwidth against batch size for every method to FILE, as SVG
    /// or PNG by its extension (sweeps 1K..1M rows per batch unless --batch-size is
    /// given)
    #[arg(long, value_name = "FILE.svg|FILE.png", value_parser = parse_chart_path)]
    pub chart: Option<PathBuf>,

    /// Generate data even when the memory it needs is estimated to exceed the memory
    /// available (MemAvailable in /proc/meminfo)
    #[arg(long)]
    pub no_memory_check: bool,

    /// No progress on stderr
    #[arg(long, short)]
    pub quiet: bool,
}

/// The device asked for with `--device`: devarrow's one grammar of device strings
/// (`devarrow::DeviceSpec`, which documents it), every form of which the job takes.
pub type DeviceChoice = devarrow::DeviceSpec;

/// Batch sizes in rows: ascending, distinct, each at least 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSizes(pub Vec<usize>);

/// Where `--json` writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonTarget {
    /// Standard output (everything else is silenced).
    Stdout,
    /// A file.
    File(PathBuf),
}

/// The options of a run, resolved from the command line (defaults applied).
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// The device asked for.
    pub device: DeviceChoice,
    /// The TPC-H scale (ignored with `input`).
    pub scale: f64,
    /// The batch sizes to measure, ascending.
    pub batch_sizes: Vec<usize>,
    /// Timed repetitions per measurement.
    pub reps: usize,
    /// The file to read instead of generating data.
    pub input: Option<PathBuf>,
    /// Where to write JSON.
    pub json: Option<JsonTarget>,
    /// Where to write the chart (SVG or PNG, by the extension).
    pub chart: Option<PathBuf>,
    /// The link modelled on the CPU device.
    pub link: Option<LinkModel>,
    /// Whether progress goes to stderr.
    pub progress: bool,
    /// Whether to check, before generating data, that it fits in memory.
    pub memory_check: bool,
    /// The options of a CUDA device, and where they came from.
    pub cuda_options: CudaOptions,
    /// devarrow's transfer options (`--transfer-options`; the defaults without it).
    pub transfer_options: transfer_options::TransferGiven,
}

impl Cli {
    /// Applies the defaults; `env_cuda_options` is the value of
    /// [`cuda_options::ENV`], read only when `--cuda-options` is not given.
    pub fn resolve(self, env_cuda_options: Option<&OsStr>) -> Result<Options, CudaOptionsError> {
        let cuda_options = CudaOptions::resolve(self.cuda_options, env_cuda_options)?;
        let json = self.json.map(|j| match j.as_str() {
            "-" => JsonTarget::Stdout,
            _ => JsonTarget::File(PathBuf::from(j)),
        });
        let batch_sizes = match (self.batch_size, &self.chart) {
            (Some(BatchSizes(sizes)), _) => sizes,
            (None, Some(_)) => DEFAULT_SWEEP.to_vec(),
            (None, None) => vec![DEFAULT_BATCH_ROWS],
        };
        Ok(Options {
            device: self.device,
            scale: self.scale.unwrap_or(DEFAULT_SCALE),
            batch_sizes,
            reps: self.reps as usize,
            input: self.input,
            progress: !self.quiet && json != Some(JsonTarget::Stdout),
            json,
            chart: self.chart,
            memory_check: !self.no_memory_check,
            link: self.link,
            cuda_options,
            transfer_options: self.transfer_options.unwrap_or_default(),
        })
    }
}

/// Parses a positive, finite scale factor.
pub fn parse_scale(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (MIN_SCALE..=MAX_SCALE).contains(&v) => Ok(v),
        Ok(_) => Err(format!(
            "the scale must be between {MIN_SCALE} and {MAX_SCALE}"
        )),
        Err(_) => Err("the scale must be a number (e.g. 0.1)".into()),
    }
}

/// Accepts a chart file name ending in `.svg` or `.png`.
pub fn parse_chart_path(s: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(s);
    ChartFormat::of_path(&path)?;
    Ok(path)
}

/// Parses `auto`, `cpu`, `cuda`, `cuda:N`, a list `cuda:N,M,...` (distinct ordinals) or
/// `cuda:all`: [`DeviceChoice`]'s [`FromStr`](std::str::FromStr), its error as text for
/// clap.
pub fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    s.parse()
        .map_err(|e: devarrow::DeviceSpecError| e.to_string())
}

/// Parses a link model, `BANDWIDTH,LATENCY` (e.g. `4GB/s,10us`), or `host[,LATENCY]`: a
/// link as fast as this machine's own parallel memcpy into pinned memory (measured now,
/// with the threads devarrow packs with; latency 5 µs unless given), so that any stall
/// of the host side shows against it (a slow model hides them).
pub fn parse_link(s: &str) -> Result<LinkModel, String> {
    if let Some(rest) = s.trim().strip_prefix("host") {
        let latency = match rest.strip_prefix(',') {
            Some(latency) => format!("1GB/s,{latency}").parse::<LinkModel>()?.latency,
            None if rest.is_empty() => std::time::Duration::from_micros(5),
            None => {
                return Err(format!(
                    "`{s}`: expected host or host,LATENCY (e.g. host,5us)"
                ))
            }
        };
        return Ok(LinkModel::new(super::measure::host_memcpy_rate(), latency));
    }
    s.parse()
}

/// Parses a row count: digits with an optional `K` (1024) or `M` (1024 * 1024) suffix.
pub fn parse_rows(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().last() {
        Some((i, 'k' | 'K')) => (&s[..i], 1 << 10),
        Some((i, 'm' | 'M')) => (&s[..i], 1 << 20),
        _ => (s, 1),
    };
    let n = digits
        .trim()
        .replace('_', "")
        .parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("`{s}` is not a row count (e.g. 65536, 64K, 1M)"))?;
    if n == 0 || n > MAX_BATCH_ROWS {
        return Err(format!(
            "a batch size must be between 1 and {MAX_BATCH_ROWS} rows"
        ));
    }
    Ok(n)
}

/// Parses one batch size, a comma-separated list, or a doubling range `A..B`.
pub fn parse_batch_sizes(s: &str) -> Result<BatchSizes, String> {
    let mut sizes = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Some((from, to)) = part.split_once("..") {
            let (from, to) = (parse_rows(from)?, parse_rows(to.trim_start_matches('='))?);
            if from > to {
                return Err(format!("empty range `{part}`"));
            }
            let mut n = from;
            while n < to {
                sizes.push(n);
                n = n.saturating_mul(2);
            }
            sizes.push(to);
        } else {
            sizes.push(parse_rows(part)?);
        }
    }
    if sizes.is_empty() {
        return Err("no batch size given".into());
    }
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.len() > 64 {
        return Err("at most 64 batch sizes".into());
    }
    Ok(BatchSizes(sizes))
}

/// The file formats `--chart` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChartFormat {
    /// Scalable vector graphics (`.svg`).
    Svg,
    /// A PNG bitmap (`.png`).
    Png,
}

impl ChartFormat {
    /// The format of `path`, from its extension (case-insensitive).
    pub fn of_path(path: &Path) -> Result<Self, String> {
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match extension.as_deref() {
            Some("svg") => Ok(Self::Svg),
            Some("png") => Ok(Self::Png),
            Some(other) => Err(format!(
                "cannot draw a chart as .{other}: the chart's file name must end in .svg or .png"
            )),
            None => Err("the chart's file name must end in .svg or .png".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Cli::try_parse_from(std::iter::once("devarrow").chain(args.iter().copied()))
            .map(|cli| cli.resolve(None).expect("no environment"))
    }

    #[test]
    fn defaults() {
        let o = parse(&[]).unwrap();
        assert_eq!(o.device, DeviceChoice::Auto);
        assert_eq!(o.scale, DEFAULT_SCALE);
        assert_eq!(o.batch_sizes, vec![DEFAULT_BATCH_ROWS]);
        assert_eq!(o.reps, 5);
        assert_eq!((o.input, o.json, o.chart), (None, None, None));
        assert!(o.progress && o.memory_check);
        assert!(!parse(&["--no-memory-check"]).unwrap().memory_check);
    }

    #[test]
    fn every_option() {
        let o = parse(&[
            "--device",
            "cuda:1",
            "--batch-size",
            "1K,4k, 1M",
            "--reps",
            "3",
            "--input",
            "x.parquet",
            "--json",
            "out.json",
            "--chart",
            "c.svg",
        ])
        .unwrap();
        assert_eq!(o.device, DeviceChoice::Cuda(1));
        assert_eq!(o.batch_sizes, vec![1024, 4096, 1 << 20]);
        assert_eq!(o.reps, 3);
        assert_eq!(o.input, Some(PathBuf::from("x.parquet")));
        assert_eq!(o.json, Some(JsonTarget::File("out.json".into())));
        assert_eq!(o.chart, Some(PathBuf::from("c.svg")));
        assert!(o.progress);
        assert_eq!(o.link, None);
        let link = parse(&["--device", "cpu", "--link", "4GB/s,10us"])
            .unwrap()
            .link
            .unwrap();
        assert_eq!((link.gbps(), link.latency.as_micros()), (4.0, 10));
        assert_eq!(parse(&["--scale", "0.01"]).unwrap().scale, 0.01);
        assert_eq!(
            parse(&["--device", "cpu"]).unwrap().device,
            DeviceChoice::Cpu
        );
        assert_eq!(
            parse(&["--device", "cuda"]).unwrap().device,
            DeviceChoice::Cuda(0)
        );
    }

    #[test]
    fn json_to_stdout_is_quiet() {
        for args in [&["--json"][..], &["--json", "-"]] {
            let o = parse(args).unwrap();
            assert_eq!(o.json, Some(JsonTarget::Stdout));
            assert!(!o.progress);
        }
        assert!(!parse(&["-q"]).unwrap().progress);
        // `--json` without a value does not swallow the next option.
        let o = parse(&["--json", "--reps", "2"]).unwrap();
        assert_eq!((o.json, o.reps), (Some(JsonTarget::Stdout), 2));
    }

    #[test]
    fn a_chart_sweeps_batch_sizes() {
        assert_eq!(
            parse(&["--chart", "c.svg"]).unwrap().batch_sizes,
            DEFAULT_SWEEP.to_vec()
        );
        assert_eq!(
            parse(&["--chart", "c.PNG"]).unwrap().chart,
            Some(PathBuf::from("c.PNG"))
        );
        assert_eq!(
            parse(&["--chart", "c.svg", "--batch-size", "1K..8K"])
                .unwrap()
                .batch_sizes,
            vec![1024, 2048, 4096, 8192]
        );
    }

    #[test]
    fn several_devices() {
        let device = |s: &str| parse(&["--device", s]).unwrap().device;
        assert_eq!(device("cuda:0,1"), DeviceChoice::CudaList(vec![0, 1]));
        assert_eq!(
            device(" CUDA:2, 0 ,1"),
            DeviceChoice::CudaList(vec![2, 0, 1])
        );
        assert_eq!(device("cuda:all"), DeviceChoice::CudaAll);
        assert_eq!(device("cuda:3"), DeviceChoice::Cuda(3));
        // A one-device list is that device.
        assert_eq!(parse_device("cuda:1"), Ok(DeviceChoice::Cuda(1)));
        assert!(device("cuda:all").is_multi() && device("cuda:0,1").is_multi());
        assert!(!device("cuda:0").is_multi() && !device("auto").is_multi());
        assert_eq!(device("cuda:0,1").to_string(), "cuda:0,1");
        assert_eq!(device("cuda:all").to_string(), "cuda:all");
        // The messages name what is wrong.
        assert!(parse_device("cuda:0,0")
            .unwrap_err()
            .contains("cuda:0 is named twice"));
        assert!(parse_device("cuda:0,x")
            .unwrap_err()
            .contains("`x` is not a device number"));
        assert!(parse_device("cuda:0,")
            .unwrap_err()
            .contains("an empty device"));
        assert!(parse_device("tpu").unwrap_err().contains("cuda:all"));
    }

    #[test]
    fn batch_sizes() {
        assert_eq!(parse_rows("65536"), Ok(65536));
        assert_eq!(parse_rows("64K"), Ok(65536));
        assert_eq!(parse_rows("1m"), Ok(1 << 20));
        assert_eq!(parse_rows("1_000"), Ok(1000));
        for bad in ["", "0", "K", "-5", "1.5K", "2G", "99999999999999999999"] {
            assert!(parse_rows(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_batch_sizes("3K..10K").unwrap().0,
            vec![3072, 6144, 10240]
        );
        assert_eq!(parse_batch_sizes("8,8,2").unwrap().0, vec![2, 8]);
        assert!(parse_batch_sizes("8K..1K").is_err());
        assert!(parse_batch_sizes(",").is_err());
    }

    #[test]
    fn bad_options_are_errors() {
        for args in [
            &["--scale", "0"][..],
            &["--scale", "0.00001"],
            &["--scale", "inf"],
            &["--scale", "-1"],
            &["--scale", "nan"],
            &["--scale", "x"],
            &["--device", "tpu"],
            &["--device", "cuda:x"],
            &["--device", "cuda:0,"],
            &["--device", "cuda:0,0"],
            &["--device", "cuda:,1"],
            &["--device", "cuda:0,x"],
            &["--device", "cuda:al"],
            &["--device", "cuda:all,1"],
            &["--device", "cuda:-1,2"],
            &["--link", "fast"],
            &["--link", "4GB/s"],
            &["--link", "hostly"],
            &["--link", "host,fast"],
            &["--reps", "0"],
            &["--batch-size", "0"],
            &["--nope"],
            &["--scale", "0.1", "--input", "x.parquet"],
            &["--chart", "c.jpg"],
            &["--chart", "chart"],
            &["--cuda-options", "batch_copy"],
            &["--cuda-options", "host_wait=fast"],
        ] {
            let err = parse(args).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{args:?}");
        }
    }

    #[test]
    fn a_link_as_fast_as_the_hosts_memcpy() {
        let link = parse_link("host").unwrap();
        assert!(link.gbps() > 0.1, "{link}");
        assert_eq!(link.latency.as_micros(), 5);
        assert_eq!(parse_link("host,20us").unwrap().latency.as_micros(), 20);
    }
}
