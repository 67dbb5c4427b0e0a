//! What the benchmarks share: the device they run on (CUDA device 0, or the CPU device
//! with a printed note when there is none) and the size knob.
//!
//! On the CPU device, `DEVARROW_BENCH_LINK=4GB/s,10us` models a host-device link
//! (`CpuDevice::with_link`: copies on a copy-engine thread at that bandwidth and latency),
//! and `DEVARROW_BENCH_LINK=direct` runs the CPU device whose memory the host packs into
//! directly (`CpuDevice::direct`); without it the CPU device stands in for a GPU
//! (`CpuDevice::new`: synchronous `memcpy` copies, every transfer staged). The model that
//! ran is printed and named in the benchmark ids (`cpu`, `cpu-direct`,
//! `cpu-link-4GBps-10us`).
//!
//! On CUDA, the device's options that a GPU run decides (`CudaDeviceOptions`, see
//! `docs/gpu-results.md`) come from the environment, are printed, and are named in the ids
//! when not the defaults (`cuda-batch-reg1MiB`):
//! - `DEVARROW_BENCH_BATCH_COPY=on|off`: `batch_copies` (`cuMemcpyBatchAsync` for the direct
//!   copies of a transfer; off by default);
//! - `DEVARROW_BENCH_REGISTER_PAGEABLE=SIZE|off` (`SIZE` in bytes, or with a `KiB`, `MiB`
//!   or `GiB` suffix): `register_pageable` (pageable buffers from `SIZE` on page-locked for
//!   direct DMA instead of staged; off by default).

#![allow(dead_code)] // each bench uses a part

use std::sync::Arc;

use devarrow::abi::device::{CpuDevice, Device, LinkModel};
use devarrow::cuda::{CudaDevice, CudaDeviceOptions};

/// The device a benchmark runs on.
pub enum BenchDevice {
    /// CUDA device 0.
    Cuda(Arc<CudaDevice>),
    /// No GPU here: the CPU device (the same bridge code, host memcpys for copies).
    Cpu(Arc<CpuDevice>),
}

impl BenchDevice {
    /// CUDA device 0 when the driver and a device are there, else the CPU device; prints
    /// which, and why.
    pub fn open(bench: &str) -> Self {
        if !devarrow::cuda::driver_available() {
            println!("[{bench}] no CUDA driver on this machine: benchmarking the CPU device");
            return Self::cpu(bench);
        }
        match CudaDevice::open(0) {
            Ok(device) => {
                let options = cuda_options();
                println!(
                    "[{bench}] benchmarking CUDA device 0 ({}) with {options:?}",
                    device.primary_context().name()
                );
                Self::Cuda(Arc::new(device.with_options(options)))
            }
            Err(e) => {
                println!(
                    "[{bench}] CUDA device 0 does not open ({e}): benchmarking the CPU device"
                );
                Self::cpu(bench)
            }
        }
    }

    /// The CPU device in the mode `DEVARROW_BENCH_LINK` asks for (see the module docs).
    fn cpu(bench: &str) -> Self {
        let device = match std::env::var("DEVARROW_BENCH_LINK").ok().as_deref() {
            None | Some("") | Some("none") => {
                println!(
                    "[{bench}] CPU device: synchronous memcpy copies, staged (a GPU stand-in)"
                );
                CpuDevice::new()
            }
            Some("direct") => {
                println!(
                    "[{bench}] CPU device, direct: transfers pack into its memory, no staging"
                );
                CpuDevice::direct()
            }
            Some(link) => {
                let model: LinkModel = link
                    .parse()
                    .unwrap_or_else(|e| panic!("DEVARROW_BENCH_LINK={link:?}: {e}"));
                println!(
                    "[{bench}] CPU device with a modelled link: {} GB/s + {:?} per copy, on a \
                     copy-engine thread",
                    model.gbps(),
                    model.latency
                );
                CpuDevice::with_link(model)
            }
        };
        Self::Cpu(Arc::new(device))
    }

    /// The device as the bridge sees it.
    pub fn device(&self) -> Arc<dyn Device> {
        match self {
            Self::Cuda(d) => d.clone(),
            Self::Cpu(d) => d.clone(),
        }
    }

    /// Whether this is a GPU.
    pub fn is_gpu(&self) -> bool {
        matches!(self, Self::Cuda(_))
    }

    /// `cuda`, or the CPU device's mode (`cpu`, `cpu-direct`, `cpu-link-4GBps-10us`), for
    /// benchmark names.
    pub fn label(&self) -> String {
        match self {
            Self::Cuda(d) => {
                let options = d.options();
                let mut label = String::from("cuda");
                if options.batch_copies {
                    label.push_str("-batch");
                }
                if let Some(min) = options.register_pageable {
                    label.push_str(&format!("-reg{}", size_label(min)));
                }
                label
            }
            Self::Cpu(d) => match d.link() {
                Some(link) => format!(
                    "cpu-link-{}GBps-{}us",
                    link.gbps(),
                    link.latency.as_secs_f64() * 1e6
                ),
                None if d.host_accessible() => "cpu-direct".into(),
                None => "cpu".into(),
            },
        }
    }
}

/// `DEVARROW_BENCH_SCALE` (a positive number), else 1.0 on a GPU and `cpu_default` on the
/// CPU device (so a CPU-only run stays short). Sizes of every shape scale with it; for
/// TPC-H `lineitem` it is the scale factor.
pub fn scale(gpu: bool, cpu_default: f64) -> f64 {
    match std::env::var("DEVARROW_BENCH_SCALE") {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => s,
            _ => panic!("DEVARROW_BENCH_SCALE={v:?} is not a positive number"),
        },
        Err(_) if gpu => 1.0,
        Err(_) => cpu_default,
    }
}

/// `n` scaled by `scale`, at least `min`.
pub fn scaled(n: usize, scale: f64, min: usize) -> usize {
    ((n as f64 * scale) as usize).max(min)
}

/// The CUDA device's options from `DEVARROW_BENCH_BATCH_COPY` and
/// `DEVARROW_BENCH_REGISTER_PAGEABLE` (see the module docs).
fn cuda_options() -> CudaDeviceOptions {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let batch = match var("DEVARROW_BENCH_BATCH_COPY").as_deref().map(str::trim) {
        None | Some("off") => false,
        Some("on") => true,
        Some(other) => panic!("DEVARROW_BENCH_BATCH_COPY={other:?}: want on or off"),
    };
    let register = match var("DEVARROW_BENCH_REGISTER_PAGEABLE")
        .as_deref()
        .map(str::trim)
    {
        None | Some("off") => None,
        Some(size) => Some(parse_size(size).unwrap_or_else(|| {
            panic!("DEVARROW_BENCH_REGISTER_PAGEABLE={size:?}: want a size (1048576, 1MiB) or off")
        })),
    };
    CudaDeviceOptions::default()
        .batch_copies(batch)
        .register_pageable(register)
}

/// `1048576`, `64KiB`, `1MiB`, `2GiB` (also `K`, `M`, `G`, `KB`, `MB`, `GB`: powers of 2).
fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let digits = text.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let scale = match text[digits.len()..].to_ascii_lowercase().as_str() {
        "" | "b" => 1usize,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    digits.trim().parse::<usize>().ok()?.checked_mul(scale)
}

/// `bytes` for a benchmark id: `1MiB`, `64KiB`, or the byte count.
fn size_label(bytes: usize) -> String {
    for (unit, size) in [("GiB", 1usize << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

/// The criterion configuration of every bench: no plots. Criterion draws its comparison
/// plots with plotters, which needs system fonts and panics where there are none (a bare
/// CI machine or GPU box); the figures are in the text output and in
/// `target/criterion/**/estimates.json`.
pub fn criterion_config() -> criterion::Criterion {
    criterion::Criterion::default().without_plots()
}
