//! `devarrow`: the main job. Checks the machine's devices and moves a batch of Arrow data
//! through the C Device Data Interface, printing what it measured.
//!
//! With no CUDA device (or no driver) it runs on the CPU device and says so.

use std::sync::Arc;
use std::time::Instant;

use arrow_array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, RecordBatchIterator, StringArray,
};
use devarrow::abi::stream::{export_reader, DeviceArrayStreamReader};
use devarrow::abi::{cpu, ArrowDeviceType};

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!(
        "devarrow {} (commit {})",
        env!("CARGO_PKG_VERSION"),
        devarrow::GIT_COMMIT
    );
    match devarrow::cuda_device_summary() {
        Ok(summary) => println!("CUDA: {summary}"),
        Err(reason) => println!("no CUDA device found ({reason}): running on the CPU device"),
    }
    let device = ArrowDeviceType::CPU;
    let rows = 1 << 20;
    let batch = sample_batch(rows);
    let bytes = batch.get_array_memory_size();
    println!(
        "batch: {rows} rows, {} columns, {:.1} MiB",
        batch.num_columns(),
        bytes as f64 / (1 << 20) as f64
    );

    let reps = 1000;
    let start = Instant::now();
    for _ in 0..reps {
        let (array, schema) = cpu::export_record_batch(&batch)?;
        let back = cpu::import_record_batch(array, &schema)?;
        assert_eq!(back.num_rows(), rows);
    }
    let per_call = start.elapsed() / reps;
    println!(
        "{device}: export + validated import of the batch (zero-copy): {per_call:?} per round trip"
    );

    let batches: Vec<_> = (0..64)
        .map(|i| Ok(batch.slice(i * (rows / 64), rows / 64)))
        .collect();
    let start = Instant::now();
    let stream = export_reader(Box::new(RecordBatchIterator::new(batches, batch.schema())));
    let streamed: usize = DeviceArrayStreamReader::try_new(stream)?
        .map(|b| b.map(|b| b.num_rows()))
        .sum::<Result<usize, _>>()?;
    println!(
        "{device}: device stream of 64 batches, {streamed} rows, in {:?}",
        start.elapsed()
    );
    assert_eq!(streamed, rows);
    println!("ok: every batch came back equal in length and validated");
    Ok(())
}
