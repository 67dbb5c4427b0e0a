//! Quickstart: hand an arrow-rs `RecordBatch` across the C Device Data Interface and back,
//! then stream batches through an `ArrowDeviceArrayStream`, all on the CPU device.
//!
//! Run with `cargo run --example quickstart`.

use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, RecordBatch, RecordBatchIterator, StringArray};
use devarrow::abi::stream::{export_reader, DeviceArrayStreamReader};
use devarrow::abi::{cpu, ArrowDeviceArray};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batch = RecordBatch::try_from_iter([
        ("id", Arc::new(Int32Array::from(vec![1, 2, 3])) as ArrayRef),
        (
            "name",
            Arc::new(StringArray::from(vec![Some("a"), None, Some("c")])) as ArrayRef,
        ),
    ])?;

    // Export: an owned ArrowDeviceArray (ARROW_DEVICE_CPU) plus its ArrowSchema.
    let (array, schema) = cpu::export_record_batch(&batch)?;
    // Hand it to C: a consumer-allocated struct receives it (here, on our own stack).
    let mut c_struct = ArrowDeviceArray::empty();
    // SAFETY: `c_struct` is valid for writes.
    unsafe { array.move_into(&mut c_struct) };
    println!(
        "exported {} rows on {} (device_id {})",
        c_struct.array.length, c_struct.device_type, c_struct.device_id
    );

    // Import: move it back out (the source is marked released), validate, zero-copy.
    // SAFETY: `c_struct` holds an unreleased device array.
    let imported = unsafe { devarrow::abi::DeviceArray::from_raw(&mut c_struct) }?;
    let back = cpu::import_record_batch(imported, &schema)?;
    assert_eq!(back, batch);

    // The device stream: any RecordBatchReader becomes an ArrowDeviceArrayStream.
    let reader = RecordBatchIterator::new(
        vec![Ok(batch.clone()), Ok(batch.slice(1, 2))],
        batch.schema(),
    );
    let stream = export_reader(Box::new(reader));
    let rows: usize = DeviceArrayStreamReader::try_new(stream)?
        .map(|b| b.map(|b| b.num_rows()))
        .sum::<Result<usize, _>>()?;
    println!("streamed {rows} rows back");
    Ok(())
}
