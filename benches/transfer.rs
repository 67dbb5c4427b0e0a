//! Criterion benchmarks of host-to-device and device-to-host transfers of record batches:
//! devarrow's [`Transfer`] (staged, and from a batch already in pinned memory,
//! [`pin_batch`]) beside the baselines of [`devarrow_cli::baseline`]: one raw copy of
//! the same byte count from pinned and from pageable memory, and buffer-by-buffer copies.
//!
//! Shapes: `wide` (4 × Int64/Float64, 16 M rows), `narrow` (100 × Int32, 200 k rows),
//! `strings` (Utf8 of realistic lengths, 4 M rows), `nested` (List<List<Int32>> and
//! List<Struct<Int32, Float64>>, 1 M rows) and TPC-H `lineitem` (scale factor 1). Every
//! size is multiplied by `DEVARROW_BENCH_SCALE` (default 1.0 on a GPU; 0.05 on the CPU
//! device, so a CPU-only run stays short); `DEVARROW_BENCH_SHAPES=lineitem,wide` runs only
//! the shapes named. Runs on CUDA device 0, or on the CPU device
//! (with a printed note) when there is none; there `DEVARROW_BENCH_LINK=4GB/s,10us` models
//! a host-device link (see `common`).
//!
//! `h2d/devarrow` is one `to_device_batches` call, `h2d/devarrow-per-batch` one
//! `to_device` per batch; `devarrow-serial-2x32MiB` is the engine with one thread and two
//! 32 MiB chunks, `devarrow-equal-chunks` the default engine with every window a whole
//! chunk (`first_chunk_bytes: 0`), both one call per batch; `d2h/devarrow` is one
//! `to_host_batches` call landing in pinned memory, `d2h/devarrow-pageable` the same
//! into pageable memory through staging, `d2h/devarrow-per-batch` one `to_host` per
//! batch. The `threads/*` groups are the thread-scaling table (1 to 16 threads, beside a
//! parallel memcpy into pinned memory with as many, and the same with streaming stores),
//! and the `pack/*` groups time
//! packing alone (serial vs parallel).
//!
//! Throughput is the bytes each method moves: the device image for devarrow and the raw
//! copies, the whole arrow-rs buffers for buffer-by-buffer. Every host-to-device sample
//! ends when its copies have completed (the last event waited for).

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow_array::{
    Array, ArrayRef, Float64Array, Int32Array, Int64Array, ListArray, RecordBatch, StringArray,
    StructArray,
};
use arrow_buffer::{NullBuffer, OffsetBuffer};
use arrow_schema::{DataType, Field, Fields};
use common::{scale, scaled, BenchDevice};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use devarrow::bridge::copy::{copy_bytes, Stores};
use devarrow::bridge::pack::{pack_window, Parallelism};
use devarrow::bridge::plan::plan_array;
use devarrow::bridge::{pin_batch, DeviceBatch, Transfer, TransferOptions};
use devarrow_cli::baseline::{BufferByBuffer, RawCopy};

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn nulls(&mut self, len: usize, per_mille: u64) -> Option<NullBuffer> {
        Some(NullBuffer::from_iter(
            (0..len).map(|_| self.below(1000) >= per_mille),
        ))
    }
}

fn batch<N: AsRef<str>>(columns: Vec<(N, ArrayRef)>) -> RecordBatch {
    RecordBatch::try_from_iter(columns).expect("valid batch")
}

/// 4 wide columns: Int64 and Float64, with and without nulls.
fn wide(rows: usize) -> RecordBatch {
    let mut rng = Rng(1);
    let ints = || (0..rows as i64).map(|i| i.wrapping_mul(2_654_435_761));
    let floats = || (0..rows).map(|i| i as f64 * 0.25);
    batch(vec![
        ("id", Arc::new(Int64Array::from_iter_values(ints()))),
        (
            "qty",
            Arc::new(Int64Array::new(ints().collect(), rng.nulls(rows, 10))),
        ),
        ("price", Arc::new(Float64Array::from_iter_values(floats()))),
        (
            "discount",
            Arc::new(Float64Array::new(floats().collect(), rng.nulls(rows, 50))),
        ),
    ])
}

/// 100 narrow Int32 columns, every fourth with nulls.
fn narrow(rows: usize) -> RecordBatch {
    let mut rng = Rng(2);
    batch(
        (0..100)
            .map(|c| {
                let values = (0..rows as i32).map(|i| i ^ c).collect();
                let nulls = if c % 4 == 0 {
                    rng.nulls(rows, 20)
                } else {
                    None
                };
                let column: ArrayRef = Arc::new(Int32Array::new(values, nulls));
                (format!("c{c}"), column)
            })
            .collect(),
    )
}

/// Strings of realistic lengths: names (5-20 bytes), comments (10-100 bytes, 5% null),
/// short codes (1-3 bytes), beside an Int64 key.
fn strings(rows: usize) -> RecordBatch {
    let mut rng = Rng(3);
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let text = |rng: &mut Rng, lo: u64, hi: u64| -> String {
        let len = lo + rng.below(hi - lo + 1);
        (0..len)
            .map(|_| ALPHABET[rng.below(ALPHABET.len() as u64) as usize] as char)
            .collect()
    };
    let names: StringArray = (0..rows).map(|_| Some(text(&mut rng, 5, 20))).collect();
    let comments: StringArray = (0..rows)
        .map(|_| (rng.below(100) >= 5).then(|| text(&mut rng, 10, 100)))
        .collect();
    let codes: StringArray = (0..rows).map(|_| Some(text(&mut rng, 1, 3))).collect();
    batch(vec![
        (
            "key",
            Arc::new(Int64Array::from_iter_values(0..rows as i64)),
        ),
        ("name", Arc::new(names)),
        ("comment", Arc::new(comments)),
        ("code", Arc::new(codes)),
    ])
}

/// Nested lists: List<List<Int32>> (0-4 lists of 0-8 values) and List<Struct<x: Int32,
/// y: Float64>> (0-6 structs), 2% null rows each.
fn nested(rows: usize) -> RecordBatch {
    let mut rng = Rng(4);
    let outer: Vec<usize> = (0..rows).map(|_| rng.below(5) as usize).collect();
    let inner: Vec<usize> = (0..outer.iter().sum::<usize>())
        .map(|_| rng.below(9) as usize)
        .collect();
    let values =
        Int32Array::from_iter_values((0..inner.iter().sum::<usize>() as i32).map(|i| i * 3));
    let item = Arc::new(Field::new("item", DataType::Int32, false));
    let inner_list = ListArray::new(
        item,
        OffsetBuffer::from_lengths(inner),
        Arc::new(values),
        None,
    );
    let inner_field = Arc::new(Field::new("item", inner_list.data_type().clone(), false));
    let lists = ListArray::new(
        inner_field,
        OffsetBuffer::from_lengths(outer),
        Arc::new(inner_list),
        rng.nulls(rows, 20),
    );

    let counts: Vec<usize> = (0..rows).map(|_| rng.below(7) as usize).collect();
    let n = counts.iter().sum::<usize>();
    let fields = Fields::from(vec![
        Field::new("x", DataType::Int32, false),
        Field::new("y", DataType::Float64, true),
    ]);
    let structs = StructArray::new(
        fields.clone(),
        vec![
            Arc::new(Int32Array::from_iter_values(0..n as i32)),
            Arc::new(Float64Array::new(
                (0..n).map(|i| i as f64 / 7.0).collect(),
                rng.nulls(n, 30),
            )),
        ],
        None,
    );
    let struct_field = Arc::new(Field::new("item", DataType::Struct(fields), false));
    let points = ListArray::new(
        struct_field,
        OffsetBuffer::from_lengths(counts),
        Arc::new(structs),
        rng.nulls(rows, 20),
    );
    batch(vec![
        ("lists", Arc::new(lists)),
        ("points", Arc::new(points)),
    ])
}

/// Every batch in one call (`to_device_batches`), until its copies have completed.
fn to_device_all(transfer: &mut Transfer, batches: &[RecordBatch]) -> Vec<DeviceBatch> {
    let on_device = transfer
        .to_device_batches(batches)
        .expect("to_device_batches");
    // One event for the call, after every copy.
    if let Some(last) = on_device.last() {
        last.event().wait_host().expect("wait");
    }
    on_device
}

/// One `to_device` call per batch, until the copies have completed.
fn to_device_each(transfer: &mut Transfer, batches: &[RecordBatch]) -> Vec<DeviceBatch> {
    let on_device: Vec<DeviceBatch> = batches
        .iter()
        .map(|b| transfer.to_device(b).expect("to_device"))
        .collect();
    // One stream: the last batch's event completes after every copy before it.
    if let Some(last) = on_device.last() {
        last.event().wait_host().expect("wait");
    }
    on_device
}

fn bench_shape(c: &mut Criterion, dev: &BenchDevice, name: &str, batches: Vec<RecordBatch>) {
    let device = dev.device();
    let total: usize = batches.iter().map(|b| b.get_array_memory_size()).sum();
    // Downloads land in pinned memory: a pool large enough for every batch of a sample
    // (the sample's batches are dropped before the next).
    let options = TransferOptions::default().with_pinned_host_bytes(
        (total + total / 2).max(TransferOptions::default().pinned_host_bytes),
    );
    let mut transfer = Transfer::new(device.clone(), options);
    // Downloads into pageable memory, through staging (the fallback).
    let mut pageable = Transfer::new(
        device.clone(),
        TransferOptions::default().with_pinned_host_bytes(0),
    );
    // The engine as it was before parallel packing: one thread, 2 chunks of 32 MiB.
    let mut serial = Transfer::new(
        device.clone(),
        TransferOptions::default()
            .with_chunk_bytes(32 << 20)
            .with_pack_threads(1),
    );
    // The default engine with every chunk the same size (no ramp at the ends).
    let mut equal = Transfer::new(
        device.clone(),
        TransferOptions::default().with_first_chunk_bytes(0),
    );
    // Every staging chunk and the download pool in pinned memory, reserved now (the
    // explicit warm-up): beyond the 128 MiB a CUDA device reserves at open, staging is
    // pageable (the H200 run of 2026-11-29 timed the third transfer's pageable staging).
    for t in [&mut transfer, &mut pageable, &mut serial, &mut equal] {
        t.prepare().expect("prepare");
    }
    let on_device = to_device_all(&mut transfer, &batches);
    let bytes: usize = on_device.iter().map(|d| d.device_bytes()).sum();
    let pinned: Vec<RecordBatch> = batches
        .iter()
        .map(|b| pin_batch(device.as_ref(), b).expect("pin_batch"))
        .collect();
    let mut raw = RawCopy::new(device.clone(), bytes).expect("raw copy buffers");
    let bbb: Vec<BufferByBuffer> = batches
        .iter()
        .map(|b| BufferByBuffer::new(device.clone(), b))
        .collect();
    let bbb_bytes: usize = bbb.iter().map(|b| b.bytes()).sum();
    let bbb_on_device: Vec<_> = bbb.iter().map(|b| b.to_device().expect("bbb")).collect();
    println!(
        "[transfer/{name}] {} batch(es), {} rows, {:.1} MiB on the device, {} buffers",
        batches.len(),
        batches.iter().map(|b| b.num_rows()).sum::<usize>(),
        bytes as f64 / (1 << 20) as f64,
        bbb.iter().map(|b| b.buffer_count()).sum::<usize>()
    );

    let mut group = c.benchmark_group(format!("transfer/{}/{name}", dev.label()));
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    if bytes >= 64 << 20 {
        group.sample_size(10);
    }
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("h2d/devarrow", |b| {
        b.iter_with_large_drop(|| to_device_all(&mut transfer, &batches))
    });
    group.bench_function("h2d/devarrow-per-batch", |b| {
        b.iter_with_large_drop(|| to_device_each(&mut transfer, &batches))
    });
    group.bench_function("h2d/devarrow-serial-2x32MiB", |b| {
        b.iter_with_large_drop(|| to_device_each(&mut serial, &batches))
    });
    group.bench_function("h2d/devarrow-equal-chunks", |b| {
        b.iter_with_large_drop(|| to_device_each(&mut equal, &batches))
    });
    group.bench_function("h2d/devarrow-pinned-batch", |b| {
        b.iter_with_large_drop(|| to_device_all(&mut transfer, &pinned))
    });
    group.bench_function("h2d/raw-pinned", |b| {
        b.iter(|| raw.pinned_to_device().expect("copy"))
    });
    group.bench_function("h2d/raw-pageable", |b| {
        b.iter(|| raw.pageable_to_device().expect("copy"))
    });
    group.throughput(Throughput::Bytes(bbb_bytes as u64));
    group.bench_function("h2d/buffer-by-buffer", |b| {
        b.iter_with_large_drop(|| {
            bbb.iter()
                .map(|x| x.to_device().expect("copy"))
                .collect::<Vec<_>>()
        })
    });
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("d2h/devarrow", |b| {
        b.iter_with_large_drop(|| transfer.to_host_batches(&on_device).expect("to_host"))
    });
    group.bench_function("d2h/devarrow-pageable", |b| {
        b.iter_with_large_drop(|| pageable.to_host_batches(&on_device).expect("to_host"))
    });
    group.bench_function("d2h/devarrow-per-batch", |b| {
        b.iter_with_large_drop(|| {
            on_device
                .iter()
                .map(|d| transfer.to_host(d).expect("to_host"))
                .collect::<Vec<_>>()
        })
    });
    group.bench_function("d2h/devarrow-serial-2x32MiB", |b| {
        b.iter_with_large_drop(|| {
            on_device
                .iter()
                .map(|d| serial.to_host(d).expect("to_host"))
                .collect::<Vec<_>>()
        })
    });
    group.bench_function("d2h/devarrow-equal-chunks", |b| {
        b.iter_with_large_drop(|| {
            on_device
                .iter()
                .map(|d| equal.to_host(d).expect("to_host"))
                .collect::<Vec<_>>()
        })
    });
    group.bench_function("d2h/raw-pinned", |b| {
        b.iter(|| raw.pinned_to_host().expect("copy"))
    });
    group.bench_function("d2h/raw-pageable", |b| {
        b.iter(|| raw.pageable_to_host().expect("copy"))
    });
    group.throughput(Throughput::Bytes(bbb_bytes as u64));
    group.bench_function("d2h/buffer-by-buffer", |b| {
        b.iter_with_large_drop(|| {
            bbb.iter()
                .zip(&bbb_on_device)
                .map(|(x, d)| x.to_host(d).expect("copy"))
                .collect::<Vec<_>>()
        })
    });
    group.finish();

    thread_scaling(c, dev, name, &batches, &on_device, bytes);

    // Packing alone (host work only): the whole image of each batch into one buffer.
    let plans: Vec<_> = batches
        .iter()
        .map(|b| plan_array(&StructArray::from(b.clone()).into_data()).expect("plan"))
        .collect();
    let largest = plans.iter().map(|p| p.image.total).max().unwrap_or(0);
    let mut out = vec![0u8; largest];
    let mut group = c.benchmark_group(format!("pack/{name}"));
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes(
        plans.iter().map(|p| p.image.payload_bytes() as u64).sum(),
    ));
    for (label, parallelism) in [
        ("serial", Parallelism::serial()),
        ("parallel", Parallelism::new(0, 1 << 20)),
    ] {
        group.bench_function(label, |b| {
            b.iter(|| {
                for plan in &plans {
                    let image = &plan.image;
                    pack_window(&image.segments, 0, &mut out[..image.total], parallelism);
                }
            })
        });
    }
    group.finish();
}

/// The thread-scaling table: devarrow both ways (downloads into pageable memory, whose
/// host side is the parallel unpack) with 1, 2, 4, 8 and 16 packing threads, beside a
/// parallel memcpy of the same bytes into pinned staging memory with as many threads (the
/// host's ceiling for packing), so that a machine with more cores than this one can be
/// read from it. Thread counts above twice the cores are left out.
/// `DEVARROW_BENCH_THREADS=1,4,16` chooses others.
fn thread_scaling(
    c: &mut Criterion,
    dev: &BenchDevice,
    name: &str,
    batches: &[RecordBatch],
    on_device: &[DeviceBatch],
    bytes: usize,
) {
    let device = dev.device();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let counts: Vec<usize> = match std::env::var("DEVARROW_BENCH_THREADS") {
        Ok(list) => list
            .split(',')
            .filter_map(|t| t.trim().parse().ok())
            .collect(),
        Err(_) => [1, 2, 4, 8, 16]
            .into_iter()
            .filter(|&t| t <= 2 * cores)
            .collect(),
    };
    let ceiling_bytes = bytes.clamp(1, 1 << 30);
    let source = vec![0x5au8; ceiling_bytes];
    // Room in the device's pinned memory first: beyond CUDA's reserve, staging is pageable.
    device
        .reserve_staging(ceiling_bytes)
        .expect("pinned memory");
    let mut pinned = device.allocate_staging(ceiling_bytes).expect("staging");
    let mut group = c.benchmark_group(format!("threads/{}/{name}", dev.label()));
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(2));
    if bytes >= 64 << 20 {
        group.sample_size(10);
    }
    for &threads in &counts {
        let options = TransferOptions::default()
            .with_pack_threads(threads)
            .with_pinned_host_bytes(0);
        let mut transfer = Transfer::new(device.clone(), options);
        transfer.prepare().expect("prepare"); // its staging pinned, as above
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(format!("h2d-devarrow/{threads}"), |b| {
            b.iter_with_large_drop(|| to_device_all(&mut transfer, batches))
        });
        group.bench_function(format!("d2h-devarrow-pageable/{threads}"), |b| {
            b.iter_with_large_drop(|| transfer.to_host_batches(on_device).expect("to_host"))
        });
        group.throughput(Throughput::Bytes(ceiling_bytes as u64));
        // A plain memcpy, then the streaming stores devarrow packs and unpacks with: how
        // much of the two ceilings' difference this host's memory system gives.
        for (name, stores) in [("memcpy", Stores::Cached), ("streaming", Stores::Streaming)] {
            group.bench_function(format!("{name}-into-pinned/{threads}"), |b| {
                b.iter(|| {
                    let dst = &mut pinned.as_mut_slice()[..ceiling_bytes];
                    parallel_copy(dst, &source, threads, stores)
                })
            });
        }
    }
    group.finish();
}

/// `dst.copy_from_slice(src)` on `threads` scoped threads, each an equal part, with
/// `stores` (`Cached`: the platform's `memcpy`).
fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize, stores: Stores) {
    let part = src.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || match stores {
                Stores::Cached => d.copy_from_slice(s),
                // SAFETY: `d` and `s` are equal-length parts of two distinct allocations.
                Stores::Streaming => unsafe {
                    copy_bytes(d.as_mut_ptr(), s.as_ptr(), s.len(), stores)
                },
            });
        }
    });
}

fn transfers(c: &mut Criterion) {
    let dev = BenchDevice::open("transfer");
    let s = scale(dev.is_gpu(), 0.05);
    if !dev.is_gpu() {
        println!(
            "[transfer] scale {s} (DEVARROW_BENCH_SCALE); CPU-device numbers measure host \
             packing and memcpy, or a modelled link (DEVARROW_BENCH_LINK), not a PCIe link"
        );
    }
    // DEVARROW_BENCH_SHAPES=lineitem,wide runs only those shapes (data is generated only
    // for them), so a run can be split across calls of limited length.
    let only = std::env::var("DEVARROW_BENCH_SHAPES").ok();
    let wanted = |shape: &str| {
        only.as_deref()
            .is_none_or(|list| list.split(',').any(|s| s.trim() == shape))
    };
    for name in ["wide", "narrow", "strings", "nested", "lineitem"] {
        if !wanted(name) {
            continue;
        }
        let batches = match name {
            "wide" => vec![wide(scaled(16 << 20, s, 1024))],
            "narrow" => vec![narrow(scaled(200_000, s, 1000))],
            "strings" => vec![strings(scaled(4 << 20, s, 1024))],
            "nested" => vec![nested(scaled(1 << 20, s, 1024))],
            _ => devarrow_cli::tpch::lineitem(s, 1 << 20),
        };
        bench_shape(c, &dev, name, batches);
    }
}

criterion_group! {
    name = benches;
    config = common::criterion_config();
    targets = transfers
}
criterion_main!(benches);
