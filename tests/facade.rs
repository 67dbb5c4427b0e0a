//! The `devarrow` facade re-exports every crate of the workspace.

use std::sync::Arc;

use arrow_array::{ArrayRef, Float64Array, RecordBatch};
use devarrow::abi::{cpu, ArrowDeviceType};

#[test]
fn facade_reaches_the_cpu_device() {
    let batch = RecordBatch::try_from_iter([(
        "x",
        Arc::new(Float64Array::from(vec![1.5, f64::NAN, -0.0])) as ArrayRef,
    )])
    .unwrap();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    assert_eq!(array.device_type(), ArrowDeviceType::CPU);
    let back = cpu::import_record_batch(array, &schema).unwrap();
    assert_eq!(back.num_rows(), 3);
    assert!(back.column(0).to_data().ptr_eq(&batch.column(0).to_data()));
}
