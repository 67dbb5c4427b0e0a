//! Criterion benchmarks of the C Device Data Interface on the CPU device: export plus
//! validated import of a 100-column batch (CPU time per call), and the bridge's staged
//! transfer to the CPU device and back (the same code path CUDA uses).
//!
//! And on the benchmark device (CUDA device 0, or the CPU device with a printed note):
//! export of a 100-column [`DeviceBatch`](devarrow::bridge::DeviceBatch) as an
//! `ArrowDeviceArray` plus its import by a consumer (`ImportedArray::import` on CUDA,
//! making the consumer stream wait on the batch's event; the validated CPU import on the
//! CPU device), CPU time per call.

mod common;

use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, StructArray};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use devarrow::abi::cpu;
use devarrow::abi::device::CpuDevice;
use devarrow::bridge::{Transfer, TransferOptions};

fn batch(columns: usize, rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter((0..columns).map(|c| {
        let col: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..rows as i64).map(|i| (i % 11 != 0).then_some(i ^ c as i64)),
        ));
        (format!("c{c}"), col)
    }))
    .expect("valid batch")
}

/// devarrow's CPU export plus validated import of a 100-column, 1,000-row batch, beside
/// its peer measured in the same run: arrow-rs's own `to_ffi` + `from_ffi` +
/// `validate_full` over the same batch (as a struct array, which is how a batch crosses
/// the C data interface), and the same without `validate_full`.
fn export_import(c: &mut Criterion) {
    let batch = batch(100, 1000);
    let mut group = c.benchmark_group("cpu/export+import/100 columns");
    group.bench_function("devarrow", |b| {
        b.iter(|| {
            let (array, schema) = cpu::export_record_batch(&batch).unwrap();
            cpu::import_record_batch(array, &schema).unwrap()
        })
    });
    for validate in [true, false] {
        let id = if validate {
            "arrow-rs to_ffi+from_ffi+validate_full"
        } else {
            "arrow-rs to_ffi+from_ffi"
        };
        group.bench_function(id, |b| {
            b.iter(|| {
                // From the batch, as devarrow's export starts: a batch crosses as the
                // data of its struct array.
                let data = StructArray::from(batch.clone()).into_data();
                let (array, schema) = arrow_array::ffi::to_ffi(&data).unwrap();
                // SAFETY: `array` and `schema` were exported by arrow-rs just above from
                // host data, and are consumed here once.
                let imported = unsafe { arrow_array::ffi::from_ffi(array, &schema) }.unwrap();
                if validate {
                    imported.validate_full().unwrap();
                }
                RecordBatch::from(StructArray::from(imported))
            })
        });
    }
    group.finish();
}

fn bridge(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu/bridge");
    for (columns, rows) in [(100, 1000), (4, 1 << 20)] {
        let batch = batch(columns, rows);
        let mut transfer = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
        let on_device = transfer.to_device(&batch).unwrap();
        group.throughput(Throughput::Bytes(on_device.device_bytes() as u64));
        let shape = format!("{columns}x{rows}");
        group.bench_with_input(BenchmarkId::new("to_device", &shape), &batch, |b, batch| {
            b.iter(|| transfer.to_device(batch).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("to_host", &shape), &on_device, |b, d| {
            b.iter(|| transfer.to_host(d).unwrap())
        });
    }
    group.finish();
}

fn device_export_import(c: &mut Criterion) {
    let dev = common::BenchDevice::open("ffi");
    let batch = batch(100, 1000);
    let mut transfer = Transfer::new(dev.device(), TransferOptions::default());
    let on_device = transfer.to_device(&batch).unwrap();
    on_device.event().wait_host().unwrap();
    let name = format!("{}/device export+import/100 columns", dev.label());
    match &dev {
        common::BenchDevice::Cuda(cuda) => {
            let consumer = cuda.primary_context().new_stream().unwrap();
            c.bench_function(&name, |b| {
                b.iter(|| {
                    let (array, schema) = on_device.export().unwrap();
                    let imported = devarrow::cuda::ImportedArray::import(array, &consumer);
                    (imported.unwrap(), schema)
                })
            });
        }
        common::BenchDevice::Cpu(_) => {
            c.bench_function(&name, |b| {
                b.iter(|| {
                    let (array, schema) = on_device.export().unwrap();
                    cpu::import_record_batch(array, &schema).unwrap()
                })
            });
        }
    }
}

criterion_group! {
    name = benches;
    config = common::criterion_config();
    targets = export_import, bridge, device_export_import
}
criterion_main!(benches);
