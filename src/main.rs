//! `devarrow`: the main job. Checks the machine's devices, moves a batch of Arrow data to
//! a device and back through the bridge, checks it comes back equal, and exports it
//! through the C Device Data Interface, printing what it measured.
//!
//! With a CUDA device it runs on CUDA device 0 ([`CudaTransferDevice`]: pinned staging,
//! asynchronous copies on its own stream) and prints a raw pinned-memory
//! `cuMemcpyHtoD`/`DtoH` baseline of the same byte count beside the bridge's staged
//! transfer. With no CUDA device (or no driver, or when device 0 fails to open) it runs on
//! the CPU device and says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, RecordBatchIterator, StringArray,
};
use devarrow::abi::cpu;
use devarrow::abi::device::{CpuDevice, Device};
use devarrow::abi::stream::{export_reader, DeviceArrayStreamReader};
use devarrow::bridge::{Transfer, TransferOptions};
use devarrow::cuda::{CudaTransferDevice, ImportedArray};

fn sample_batch(rows: usize) -> RecordBatch {
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows as i64));
    let prices: ArrayRef = Arc::new(Float64Array::from_iter(
        (0..rows).map(|i| (i % 7 != 0).then_some(i as f64 * 0.25)),
    ));
    let names: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|i| format!("item-{}", i % 1000)),
    ));
    RecordBatch::try_from_iter([("id", ids), ("price", prices), ("name", names)])
        .expect("valid batch")
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

fn best_of<T>(reps: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best = Duration::MAX;
    let mut last = None;
    for _ in 0..reps {
        let start = Instant::now();
        let out = f();
        best = best.min(start.elapsed());
        last = Some(out);
    }
    (best, last.expect("reps > 0"))
}

/// The device the job runs on: CUDA device 0 when the machine has one and it opens, else
/// the CPU device (saying why).
fn choose_device() -> (Arc<dyn Device>, Option<Arc<CudaTransferDevice>>) {
    match devarrow::cuda_device_summary() {
        Ok(summary) => {
            println!("CUDA: {summary}");
            match CudaTransferDevice::open(0) {
                Ok(cuda) => {
                    let cuda = Arc::new(cuda);
                    println!(
                        "running on the CUDA device cuda:0 ({})",
                        cuda.cuda_device().name()
                    );
                    (cuda.clone(), Some(cuda))
                }
                Err(e) => {
                    println!("cannot open CUDA device 0 ({e}): running on the CPU device");
                    (Arc::new(CpuDevice::new()), None)
                }
            }
        }
        Err(reason) => {
            println!("no CUDA device found ({reason}): running on the CPU device");
            (Arc::new(CpuDevice::new()), None)
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "devarrow {} (commit {})",
        env!("CARGO_PKG_VERSION"),
        devarrow::GIT_COMMIT
    );
    let (device, cuda) = choose_device();
    let rows = 1 << 20;
    let batch = sample_batch(rows);
    let bytes = batch.get_array_memory_size();
    println!(
        "batch: {rows} rows, {} columns, {:.1} MiB",
        batch.num_columns(),
        bytes as f64 / (1 << 20) as f64
    );

    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let reps = 5;
    // `to_device` returns once the copies are enqueued: time until they have completed.
    let (h2d, on_device) = best_of(reps, || {
        let on_device = transfer.to_device(&batch)?;
        on_device.event().wait_host()?;
        Ok::<_, devarrow::abi::Error>(on_device)
    });
    let on_device = on_device?;
    let moved = on_device.device_bytes();
    let (d2h, back) = best_of(reps, || transfer.to_host(&on_device));
    let back = back?;
    assert_eq!(back, batch, "the batch must come back equal");
    let (copy, _) = best_of(reps, || {
        let mut v = vec![0u8; moved];
        v.copy_from_slice(&vec![1u8; moved]);
        v
    });
    let mut rows_out = vec![
        ("host -> device (staged, packed)", h2d),
        ("device -> host (staged)", d2h),
        ("memcpy baseline (alloc + copy)", copy),
    ];
    if let Some(cuda) = &cuda {
        // The same byte count, one raw DMA each way from/to pinned memory, same run.
        let raw = cuda.pinned_copy_baseline(moved, reps)?;
        rows_out.push(("raw pinned cuMemcpyHtoD (baseline)", raw.host_to_device));
        rows_out.push(("raw pinned cuMemcpyDtoH (baseline)", raw.device_to_host));
    }
    println!(
        "{:<36} {:>10} {:>12} {:>10}",
        "direction", "bytes", "time", "GB/s"
    );
    for (name, t) in rows_out {
        println!(
            "{name:<36} {moved:>10} {:>12.3?} {:>10.2}",
            t,
            gbps(moved, t)
        );
    }
    println!("{} copies on {}", device.copy_count(), device.device_type());

    match &cuda {
        None => {
            let (export_import, _) = best_of(100, || {
                let (array, schema) = on_device.export().expect("export");
                cpu::import_record_batch(array, &schema).expect("import")
            });
            println!("export + validated import of the device batch: {export_import:?}");
        }
        Some(cuda) => {
            let consumer = cuda.cuda_device().new_stream()?;
            let (export_import, imported) = best_of(100, || {
                let (array, _schema) = on_device.export()?;
                Ok::<_, Box<dyn std::error::Error>>(ImportedArray::import(array, &consumer)?)
            });
            let imported = imported?;
            assert_eq!(imported.device_type(), device.device_type());
            assert_eq!(imported.array().length, rows as i64);
            println!(
                "export + import of the device batch (consumer stream waits on its CUevent): \
                 {export_import:?}"
            );
        }
    }

    let batches: Vec<_> = (0..64)
        .map(|i| Ok(batch.slice(i * (rows / 64), rows / 64)))
        .collect();
    let start = Instant::now();
    let stream = export_reader(Box::new(RecordBatchIterator::new(batches, batch.schema())));
    let streamed: usize = DeviceArrayStreamReader::try_new(stream)?
        .map(|b| b.map(|b| b.num_rows()))
        .sum::<Result<usize, _>>()?;
    assert_eq!(streamed, rows);
    println!(
        "device stream of 64 batches, {streamed} rows, in {:?}",
        start.elapsed()
    );
    println!("ok: the batch came back equal to the input");
    Ok(())
}
