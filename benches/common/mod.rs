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

#![allow(dead_code)] // each bench uses a part

use std::sync::Arc;

use devarrow::abi::device::{CpuDevice, Device, LinkModel};
use devarrow::cuda::CudaDevice;

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
                println!(
                    "[{bench}] benchmarking CUDA device 0 ({})",
                    device.primary_context().name()
                );
                Self::Cuda(Arc::new(device))
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
            Self::Cuda(_) => "cuda".into(),
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

/// The criterion configuration of every bench: no plots. Criterion draws its comparison
/// plots with plotters, which needs system fonts and panics where there are none (a bare
/// CI machine or GPU box); the figures are in the text output and in
/// `target/criterion/**/estimates.json`.
pub fn criterion_config() -> criterion::Criterion {
    criterion::Criterion::default().without_plots()
}
