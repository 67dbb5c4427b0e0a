//! Criterion benchmark of device streams: do uploads overlap the consumer's work?
//!
//! The same batches are moved to a device and processed there, either
//!
//! - `sequential`: upload batch *k*, process it, wait, then upload batch *k + 1*; or
//! - `streamed/read_ahead=R`: through a device stream ([`export_reader_to_device`]) whose
//!   background thread uploads up to `R` batches ahead while the consumer processes the
//!   current one (`R = 0`: the stream's hand-off without overlap).
//!
//! With a CUDA device (device 0) it runs on CUDA: the producer uploads on a stream of its
//! own, the consumer imports each `ARROW_DEVICE_CUDA` array on its own stream (waiting on
//! the array's `sync_event`) and runs GPU work there (a valid-row count of every column
//! and a fixed spin standing for real work). Without one it says so and runs on the
//! `CpuDevice`: uploads are host copies on the background thread, the consumer's work is
//! a host computation over the batch (the overlap then needs two free cores).

mod common;

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{ArrayRef, Int64Array, RecordBatch, RecordBatchIterator};
use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use devarrow::abi::device::{CpuDevice, Device};
use devarrow::abi::{cpu, DeviceArray};
use devarrow::bridge::{export_reader_to_device, StreamOptions, Transfer, TransferOptions};
use devarrow::cuda::ImportedArray;
use devarrow::cuda::{kernels, CudaDevice, CudaMemory as _, CudaStream, DeviceBuffer};

const BATCHES: usize = 16;
const COLUMNS: usize = 4;

fn batches(rows: usize) -> Vec<RecordBatch> {
    (0..BATCHES)
        .map(|k| {
            RecordBatch::try_from_iter((0..COLUMNS).map(|c| {
                let col: ArrayRef = Arc::new(Int64Array::from_iter(
                    (0..rows as i64).map(|i| (i % 7 != 0).then_some(i ^ (k * COLUMNS + c) as i64)),
                ));
                (format!("c{c}"), col)
            }))
            .expect("valid batch")
        })
        .collect()
}

fn reader_of(batches: &[RecordBatch]) -> Box<dyn arrow_array::RecordBatchReader + Send> {
    Box::new(RecordBatchIterator::new(
        batches.iter().cloned().map(Ok).collect::<Vec<_>>(),
        batches[0].schema(),
    ))
}

/// Bytes of Arrow buffers, every allocation once (as the main job's `data:` line).
fn payload_bytes(batches: &[RecordBatch]) -> u64 {
    devarrow_cli::footprint::arrow_bytes(batches) as u64
}

/// Benchmarks `consume` (given each batch exported on `device`, and its index) over
/// `batches`, moved one at a time (`sequential`) and through a device stream
/// (`streamed/read_ahead=R`); what `consume` returns is folded into a black box.
fn bench_modes(
    group: &mut BenchmarkGroup<'_, WallTime>,
    batches: &[RecordBatch],
    device: &Arc<dyn Device>,
    mut consume: impl FnMut(DeviceArray, usize) -> i64,
) {
    let shape = format!("{BATCHES}x{COLUMNS}x{}", batches[0].num_rows());
    group.bench_function(BenchmarkId::new("sequential", &shape), |b| {
        b.iter(|| {
            // A transfer per pass, as a stream has one per stream (staging included).
            let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
            let mut acc = 0;
            for (k, batch) in batches.iter().enumerate() {
                let (array, _) = transfer.to_device(batch).unwrap().export().unwrap();
                acc ^= consume(array, k);
            }
            black_box(acc)
        })
    });
    for read_ahead in [0, 2] {
        let id = BenchmarkId::new(format!("streamed/read_ahead={read_ahead}"), &shape);
        group.bench_function(id, |b| {
            b.iter(|| {
                let options = StreamOptions::default().with_read_ahead(read_ahead);
                let mut stream =
                    export_reader_to_device(reader_of(batches), device.clone(), options).unwrap();
                let (mut acc, mut k) = (0, 0);
                while let Some(array) = stream.next_array().unwrap() {
                    acc ^= consume(array, k);
                    k += 1;
                }
                black_box(acc)
            })
        });
    }
}

// ---------------------------------------------------------------------------------------
// CPU device
// ---------------------------------------------------------------------------------------

/// The consumer's work on the CPU: a few passes over every value of the batch.
fn cpu_work(array: DeviceArray, schema: arrow_schema::SchemaRef) -> i64 {
    let batch = cpu::import_record_batch_with_schema(array, schema).expect("valid import");
    let mut acc = 0i64;
    for pass in 1..=3i64 {
        for column in batch.columns() {
            let column = column.as_primitive::<Int64Type>();
            acc = column
                .iter()
                .flatten()
                .fold(acc, |a, v| a.wrapping_mul(31).wrapping_add(v ^ pass));
        }
    }
    acc
}

fn bench_cpu(c: &mut Criterion) {
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let batches = batches(1 << 18);
    let schema = batches[0].schema();
    let mut group = c.benchmark_group("streams/cpu");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(payload_bytes(&batches)));
    bench_modes(&mut group, &batches, &device, |array, _| {
        cpu_work(array, schema.clone())
    });
    group.finish();
}

// ---------------------------------------------------------------------------------------
// CUDA
// ---------------------------------------------------------------------------------------

/// GPU time the consumer spends on each batch besides counting (its "real work").
const SPIN_NS: u64 = 2_000_000;

struct GpuConsumer {
    stream: Arc<CudaStream>,
    counts: DeviceBuffer,
    scratch: DeviceBuffer,
}

impl GpuConsumer {
    /// Enqueues the consumer's work on batch `k` (a struct array of nullable Int64
    /// columns imported on the consumer stream).
    fn enqueue(&self, imported: &ImportedArray, k: usize) {
        for c in 0..imported.array().n_children as usize {
            // SAFETY: the array of an import (a DeviceArray) is well-formed.
            let node = unsafe { imported.array().child(c) }.expect("a child per column");
            let (offset, len) = (node.offset as usize, node.length as usize);
            // SAFETY: buffer 0 of a nullable Int64 child is its validity bitmap, covering
            // offset + length bits; NULL (no nulls) is skipped.
            if let Some(bitmap) = unsafe { imported.buffer(node, 0, (offset + len).div_ceil(8)) } {
                // SAFETY: `counts` holds 8 bytes per column of every batch and outlives
                // the consumer stream's work (synchronized before it is dropped).
                unsafe {
                    kernels::launch_count_set_bits(
                        &self.stream,
                        bitmap.device_ptr(),
                        offset as u64,
                        len as u64,
                        self.counts.device_ptr() + 8 * (k * COLUMNS + c) as u64,
                    )
                    .expect("launch")
                };
            }
        }
        // SAFETY: `scratch` holds 4 * 256 bytes and outlives the stream's work.
        unsafe {
            devarrow_testing::spin::launch_spin_fill_u32(
                &self.stream,
                self.scratch.device_ptr(),
                256,
                k as u32,
                SPIN_NS,
            )
            .expect("launch")
        };
    }
}

fn bench_cuda(c: &mut Criterion, device: Arc<CudaDevice>) {
    let dev = device.primary_context().clone();
    let consumer = GpuConsumer {
        stream: dev.new_stream().expect("a consumer stream"),
        counts: DeviceBuffer::zeroed(device.stream(), 8 * BATCHES * COLUMNS).expect("counts"),
        scratch: DeviceBuffer::zeroed(device.stream(), 4 * 256).expect("scratch"),
    };
    device.synchronize().expect("synchronize");
    kernels::Kernels::for_stream(&consumer.stream).expect("kernels load");
    let upload: Arc<dyn Device> = device.clone();
    let batches = batches(1 << 20);
    let mut group = c.benchmark_group("streams/cuda");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    group.throughput(Throughput::Bytes(payload_bytes(&batches)));
    bench_modes(&mut group, &batches, &upload, |array, k| {
        let imported = ImportedArray::import(array, &consumer.stream).unwrap();
        consumer.enqueue(&imported, k);
        // Waits for batch k's work (then releases it): sequential, strictly one batch at a
        // time; streamed, while the background thread uploads the next batches on the
        // upload stream.
        drop(imported);
        0
    });
    group.finish();
    consumer.stream.synchronize().expect("synchronize");
}

fn streams(c: &mut Criterion) {
    match CudaDevice::open(0) {
        Ok(device) => {
            eprintln!(
                "streams bench: on CUDA device 0 ({}), consumer work = valid-row counts plus a \
                 {} ms spin per batch",
                device.primary_context().name(),
                SPIN_NS as f64 / 1e6
            );
            bench_cuda(c, Arc::new(device));
        }
        Err(e) => {
            eprintln!(
                "streams bench: no CUDA device ({e}); running on the CpuDevice (host copies on \
                 the background thread overlap host work on the consumer's)"
            );
            bench_cpu(c);
        }
    }
}

criterion_group! {
    name = benches;
    config = common::criterion_config();
    targets = streams
}
criterion_main!(benches);
