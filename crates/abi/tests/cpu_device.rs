//! The CPU device end to end: export and import of arrays and record batches, ownership
//! and release discipline, and interoperation with arrow-rs's own C data interface.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::ffi::{from_ffi, to_ffi};
use arrow_array::types::{Int32Type, Int8Type};
use arrow_array::{
    Array, ArrayRef, DictionaryArray, Int32Array, ListArray, RecordBatch, StringArray, StructArray,
};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{DataType, Field, Schema};
use devarrow_abi::cpu::{self, CPU_DEVICE_ID};
use devarrow_abi::{ArrowDeviceArray, ArrowDeviceType, DeviceArray, Error};
use devarrow_testing::release::{count_releases, releases};

fn sample_batch() -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int32Array::from(vec![
        Some(1),
        None,
        Some(3),
        Some(4),
        None,
    ]));
    let strings: ArrayRef = Arc::new(StringArray::from(vec![
        Some("a"),
        Some("bc"),
        None,
        Some("déf"),
        Some(""),
    ]));
    let lists: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(vec![
        Some(vec![Some(1), Some(2)]),
        None,
        Some(vec![]),
        Some(vec![None, Some(5)]),
        Some(vec![Some(6)]),
    ]));
    let dict: ArrayRef = Arc::new(
        vec![Some("x"), Some("y"), None, Some("x"), Some("z")]
            .into_iter()
            .collect::<DictionaryArray<Int8Type>>(),
    );
    let mut field_meta = HashMap::new();
    field_meta.insert(
        "ARROW:extension:name".to_string(),
        "devarrow.test".to_string(),
    );
    let schema = Schema::new(vec![
        Field::new("ints", DataType::Int32, true).with_metadata(field_meta),
        Field::new("strings", DataType::Utf8, true),
        Field::new("lists", lists.data_type().clone(), true),
        Field::new("dict", dict.data_type().clone(), true),
    ])
    .with_metadata(HashMap::from([(
        "origin".to_string(),
        "devarrow".to_string(),
    )]));
    RecordBatch::try_new(Arc::new(schema), vec![ints, strings, lists, dict]).unwrap()
}

#[test]
fn exported_batch_is_a_cpu_struct_array_with_zeroed_reserved_words() {
    let batch = sample_batch();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let raw = array.as_raw();
    assert_eq!(raw.device_type, ArrowDeviceType::CPU);
    assert_eq!(raw.device_id, CPU_DEVICE_ID);
    assert!(raw.sync_event.is_null());
    assert_eq!(raw.reserved, [0; 3]);
    assert_eq!(raw.array.length, 5);
    assert_eq!(raw.array.n_children, 4);
    assert_eq!(schema.format(), "+s");
}

#[test]
fn record_batch_round_trip_keeps_values_and_metadata() {
    let batch = sample_batch();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let back = cpu::import_record_batch(array, &schema).unwrap();
    assert_eq!(back, batch);
    assert_eq!(back.schema().metadata()["origin"], "devarrow");
    assert_eq!(
        back.schema().field(0).metadata()["ARROW:extension:name"],
        "devarrow.test"
    );
}

#[test]
fn import_is_zero_copy() {
    let batch = sample_batch();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let back = cpu::import_record_batch(array, &schema).unwrap();
    let ptr = |b: &RecordBatch| b.column(0).to_data().buffers()[0].as_ptr();
    assert_eq!(ptr(&back), ptr(&batch));
}

#[test]
fn sliced_batches_and_arrays_round_trip() {
    let batch = sample_batch();
    for (offset, len) in [(0, 0), (1, 3), (2, 3), (4, 1), (5, 0)] {
        let slice = batch.slice(offset, len);
        let (array, schema) = cpu::export_record_batch(&slice).unwrap();
        assert_eq!(cpu::import_record_batch(array, &schema).unwrap(), slice);
        for column in slice.columns() {
            let (array, schema) = cpu::export_array(column.as_ref()).unwrap();
            let back = cpu::import_array(array, &schema).unwrap();
            assert_eq!(&back, column);
        }
    }
}

#[test]
fn empty_batch_round_trips() {
    let batch = sample_batch().slice(0, 0);
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let back = cpu::import_record_batch(array, &schema).unwrap();
    assert_eq!(back.num_rows(), 0);
    assert_eq!(back.schema(), batch.schema());
}

#[test]
fn field_array_round_trip_keeps_field() {
    let field = Field::new("s", DataType::Utf8, false)
        .with_metadata(HashMap::from([("k".to_string(), "v".to_string())]));
    let array = StringArray::from(vec!["a", "b"]);
    let (exported, schema) = cpu::export_field_array(&field, &array).unwrap();
    let (field_back, back) = cpu::import_field_array(exported, &schema).unwrap();
    assert_eq!(field_back, field);
    assert_eq!(back.as_ref(), &array as &dyn Array);
}

#[test]
fn dropping_an_exported_array_releases_once() {
    let (array, _schema) = cpu::export_record_batch(&sample_batch()).unwrap();
    let (array, count) = count_releases(array);
    assert_eq!(releases(&count), 0);
    drop(array);
    assert_eq!(releases(&count), 1);
}

#[test]
fn imported_array_releases_once_when_the_last_buffer_drops() {
    let (array, schema) = cpu::export_record_batch(&sample_batch()).unwrap();
    let (array, count) = count_releases(array);
    let back = cpu::import_record_batch(array, &schema).unwrap();
    let column = back.column(1).clone();
    drop(back);
    assert_eq!(releases(&count), 0, "a column still shares the buffers");
    drop(column);
    assert_eq!(releases(&count), 1);
}

#[test]
fn moving_from_a_raw_pointer_marks_the_source_released() {
    let (array, _schema) = cpu::export_record_batch(&sample_batch()).unwrap();
    let (array, count) = count_releases(array);
    let mut slot = ArrowDeviceArray::empty();
    // SAFETY: `slot` is a valid, writable ArrowDeviceArray.
    unsafe { array.move_into(&mut slot) };
    assert!(!slot.is_released());
    // SAFETY: `slot` holds an unreleased device array.
    let moved = unsafe { DeviceArray::from_raw(&mut slot) }.unwrap();
    assert!(slot.is_released(), "the source must be marked released");
    assert_eq!(releases(&count), 0, "moving must not release");
    // Moving out of a released struct is detected, not used.
    // SAFETY: `slot` is valid (released).
    let again = unsafe { DeviceArray::from_raw(&mut slot) };
    assert!(matches!(again, Err(Error::Released { .. })));
    drop(moved);
    assert_eq!(releases(&count), 1);
}

#[test]
fn null_pointer_is_an_error() {
    // SAFETY: NULL is explicitly allowed and reported.
    let result = unsafe { DeviceArray::from_raw(std::ptr::null_mut()) };
    assert!(matches!(result, Err(Error::NullPointer { .. })));
}

#[test]
fn arrow_rs_consumes_the_embedded_array() {
    let batch = sample_batch();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let (ffi, device_type, device_id, _) = array.into_ffi();
    assert_eq!((device_type, device_id), (ArrowDeviceType::CPU, -1));
    // SAFETY: the array was produced by devarrow for this schema, on the CPU.
    let data = unsafe { from_ffi(ffi, &schema) }.unwrap();
    let back = RecordBatch::from(StructArray::from(data));
    assert_eq!(back.columns(), batch.columns());
}

#[test]
fn arrow_rs_produces_the_embedded_array() {
    let batch = sample_batch();
    let data = StructArray::from(batch.clone()).into_data();
    let (ffi, _) = to_ffi(&data).unwrap();
    let schema = FFI_ArrowSchema::try_from(batch.schema().as_ref()).unwrap();
    // SAFETY: arrow-rs exported host memory, so the CPU placement (no event) is true.
    let device =
        unsafe { DeviceArray::from_ffi(ffi, ArrowDeviceType::CPU, -1, std::ptr::null_mut()) }
            .unwrap();
    let back = cpu::import_record_batch(device, &schema).unwrap();
    assert_eq!(back, batch);
}

#[test]
fn struct_array_with_top_level_nulls_is_not_a_record_batch() {
    let strukt = StructArray::new(
        vec![Field::new("a", DataType::Int32, true)].into(),
        vec![Arc::new(Int32Array::from(vec![1, 2])) as ArrayRef],
        Some(vec![true, false].into()),
    );
    let (array, _) = cpu::export_array(&strukt).unwrap();
    let (array, count) = count_releases(array);
    let schema =
        FFI_ArrowSchema::try_from(&Schema::new(vec![Field::new("a", DataType::Int32, true)]))
            .unwrap();
    let err = cpu::import_record_batch(array, &schema).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert_eq!(releases(&count), 1);
}

/// A producer may slice a batch with the C struct's own `offset` and `length` (the
/// children left whole): the batch imported is that slice, each release run once.
#[test]
fn a_struct_offset_of_the_producer_slices_the_batch() {
    let batch = sample_batch();
    for (offset, len) in [(2, 3), (1, 0), (0, 4), (5, 0)] {
        let (array, schema) = cpu::export_record_batch(&batch).unwrap();
        let (array, count) = count_releases(array);
        let mut raw = array.into_raw();
        raw.array.offset = offset;
        raw.array.length = len;
        // SAFETY: `raw` came from a DeviceArray; a smaller window of its own rows leaves
        // every buffer and child large enough for what the struct now says.
        let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
        let back = cpu::import_record_batch(array, &schema).unwrap();
        assert_eq!(back, batch.slice(offset as usize, len as usize));
        drop(back);
        assert_eq!(releases(&count), 1);
    }
}

/// A column with nulls under a field that says it has none is a typed error (as
/// `RecordBatch::try_new` reports it), and the array is released once.
#[test]
fn nulls_in_a_non_nullable_field_are_an_error() {
    let batch = sample_batch();
    let (array, _) = cpu::export_record_batch(&batch).unwrap();
    let (array, count) = count_releases(array);
    let fields: Vec<Field> = batch
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone().with_nullable(false))
        .collect();
    let schema = FFI_ArrowSchema::try_from(&Schema::new(fields)).unwrap();
    let err = cpu::import_record_batch(array, &schema).unwrap_err();
    assert!(
        matches!(&err, Error::Arrow(e) if e.to_string().contains("non-nullable")),
        "{err}"
    );
    assert_eq!(releases(&count), 1);
}
