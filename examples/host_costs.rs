//! A/B of the host-side costs of a transfer on the CPU device, in one process, every
//! variant measured in turn (interleaved) so that the load of a shared machine hits all
//! alike: TPC-H `lineitem` to the device and back, per batch size, for
//!
//! - the device: staged (`CpuDevice::new`, a GPU stand-in: pack into staging, then a
//!   `memcpy` "DMA") or direct (`CpuDevice::direct`: pack straight into device memory);
//! - the host memory of downloads: `pool` (the transfer's host pool, the default),
//!   `fresh` (a new allocation per batch, huge pages advised from 4 MiB), `fresh-serial`
//!   (the same, unpacked on one thread: page faults on one thread only);
//! - buffer by buffer, on the same device.
//!
//! Prints the median and best GB/s of every variant, and the median stage times of
//! devarrow's.
//!
//! ```sh
//! cargo run --release --example host_costs -- [SCALE] [REPS] [ROWS...]
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use devarrow::abi::device::{CpuDevice, Device};
use devarrow::bridge::{DeviceBatch, StageTimes, Transfer, TransferOptions};
use devarrow_cli::baseline::BufferByBuffer;

struct Variant {
    name: String,
    device: Arc<dyn Device>,
    transfer: Option<Transfer>,
    h2d: Vec<Duration>,
    d2h: Vec<Duration>,
    stages: Vec<(StageTimes, StageTimes)>,
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale: f64 = args.first().map_or(0.1, |s| s.parse().expect("scale"));
    let reps: usize = args.get(1).map_or(9, |s| s.parse().expect("reps"));
    let sizes: Vec<usize> = if args.len() > 2 {
        args[2..].iter().map(|s| s.parse().expect("rows")).collect()
    } else {
        vec![1 << 10, 64 << 10, 1 << 20]
    };
    for rows in sizes {
        let batches = devarrow_cli::tpch::lineitem(scale, rows);
        run(&batches, rows, reps);
    }
}

fn run(batches: &[RecordBatch], rows: usize, reps: usize) {
    let staged: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let direct: Arc<dyn Device> = Arc::new(CpuDevice::direct());
    let fresh = TransferOptions::default().with_host_pool_bytes(0);
    let fresh_serial = fresh.with_pack_threads(1);
    let mut variants: Vec<Variant> = Vec::new();
    for (dev_name, device) in [("staged", &staged), ("direct", &direct)] {
        for (host, options) in [
            ("pool", TransferOptions::default()),
            ("fresh", fresh),
            ("fresh-serial", fresh_serial),
        ] {
            variants.push(Variant {
                name: format!("devarrow {dev_name} {host}"),
                device: device.clone(),
                transfer: Some(Transfer::new(device.clone(), options)),
                h2d: vec![],
                d2h: vec![],
                stages: vec![],
            });
        }
        variants.push(Variant {
            name: format!("buffer-by-buffer {dev_name}"),
            device: device.clone(),
            transfer: None,
            h2d: vec![],
            d2h: vec![],
            stages: vec![],
        });
    }
    let bbb: Vec<Vec<BufferByBuffer>> = variants
        .iter()
        .map(|v| {
            batches
                .iter()
                .map(|b| BufferByBuffer::new(v.device.clone(), b))
                .collect()
        })
        .collect();
    let mut bytes = 0;
    let bbb_bytes: usize = bbb[0].iter().map(BufferByBuffer::bytes).sum();
    for rep in 0..=reps {
        for (v, bbb) in variants.iter_mut().zip(&bbb) {
            match &mut v.transfer {
                Some(transfer) => {
                    transfer.take_stats();
                    let start = Instant::now();
                    let on_device: Vec<DeviceBatch> = batches
                        .iter()
                        .map(|b| transfer.to_device(b).unwrap())
                        .collect();
                    for d in &on_device {
                        d.event().wait_host().unwrap();
                    }
                    let h2d = start.elapsed();
                    let start = Instant::now();
                    let back = transfer.to_host_batches(&on_device).unwrap();
                    let d2h = start.elapsed();
                    bytes = on_device.iter().map(DeviceBatch::device_bytes).sum();
                    assert_eq!(back.len(), batches.len());
                    drop((back, on_device));
                    if rep > 0 {
                        v.h2d.push(h2d);
                        v.d2h.push(d2h);
                        let s = transfer.take_stats();
                        v.stages.push((s.to_device, s.to_host));
                    }
                }
                None => {
                    let start = Instant::now();
                    let on_device: Vec<_> = bbb.iter().map(|b| b.to_device().unwrap()).collect();
                    let h2d = start.elapsed();
                    let start = Instant::now();
                    for (b, m) in bbb.iter().zip(&on_device) {
                        drop(b.to_host(m).unwrap());
                    }
                    let d2h = start.elapsed();
                    drop(on_device);
                    if rep > 0 {
                        v.h2d.push(h2d);
                        v.d2h.push(d2h);
                    }
                }
            }
        }
    }
    println!(
        "\n{rows} rows per batch, {} batches, {:.1} MB (devarrow) / {:.1} MB (buffer by buffer); GB/s median (best) of {reps}",
        batches.len(),
        bytes as f64 / 1e6,
        bbb_bytes as f64 / 1e6
    );
    for v in &variants {
        let b = if v.transfer.is_some() {
            bytes
        } else {
            bbb_bytes
        };
        let best = |t: &[Duration]| *t.iter().min().unwrap();
        print!(
            "  {:<28} H2D {:>6.2} ({:>5.2})  D2H {:>6.2} ({:>5.2})",
            v.name,
            gbps(b, median(&v.h2d)),
            gbps(b, best(&v.h2d)),
            gbps(b, median(&v.d2h)),
            gbps(b, best(&v.d2h)),
        );
        if !v.stages.is_empty() {
            let ms = |f: &dyn Fn(&StageTimes) -> Duration, up: bool| {
                let t: Vec<Duration> = v
                    .stages
                    .iter()
                    .map(|(h2d, d2h)| f(if up { h2d } else { d2h }))
                    .collect();
                median(&t).as_secs_f64() * 1e3
            };
            print!(
                "  | H2D ms plan {:.1} alloc {:.1} pack {:.1} copy {:.1} | D2H ms plan {:.1} alloc {:.1} copy {:.1} unpack {:.1} validate {:.1}",
                ms(&|s| s.plan, true),
                ms(&|s| s.allocate, true),
                ms(&|s| s.pack, true),
                ms(&|s| s.copy, true),
                ms(&|s| s.plan, false),
                ms(&|s| s.allocate, false),
                ms(&|s| s.copy, false),
                ms(&|s| s.unpack, false),
                ms(&|s| s.validate, false),
            );
        }
        println!();
    }
}
