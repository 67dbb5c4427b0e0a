//! Importing malformed structs: each case gets a clear typed error, and the struct is
//! still released exactly once.

use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::{Array, ArrayRef, BinaryArray, Int32Array, ListArray, StringArray};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::DataType;
use devarrow_abi::cpu;
use devarrow_abi::{ArrowDeviceArray, ArrowDeviceType, DeviceArray, Error};
use devarrow_testing::release::{count_releases, releases};

/// Exports `array`, lets `corrupt` damage the C struct, imports it, and checks the
/// release count. Returns the import error.
fn import_corrupted(array: &dyn Array, corrupt: impl FnOnce(&mut ArrowDeviceArray)) -> Error {
    let (exported, schema) = cpu::export_array(array).unwrap();
    import_corrupted_with_schema(exported, &schema, corrupt)
}

fn import_corrupted_with_schema(
    exported: DeviceArray,
    schema: &FFI_ArrowSchema,
    corrupt: impl FnOnce(&mut ArrowDeviceArray),
) -> Error {
    let (exported, count) = count_releases(exported);
    let mut raw = exported.into_raw();
    corrupt(&mut raw);
    // Every corruption in this file keeps the pointers valid for their counts: it lowers
    // counts, nulls pointers, or changes what the importer rejects before reading the bytes
    // it governs (negative lengths and offsets, a shorter child, a foreign device type, a
    // sync event on the CPU, whose pointee is never read).
    // SAFETY: `raw` came from a DeviceArray, and the corruption (see above) leaves it
    // well-formed with nothing the importer reads before rejecting it.
    let device_array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let err = cpu::import_array(device_array, schema).unwrap_err();
    assert_eq!(releases(&count), 1, "released exactly once after: {err}");
    err
}

fn ints() -> Int32Array {
    Int32Array::from(vec![Some(1), None, Some(3)])
}

fn strings() -> StringArray {
    StringArray::from(vec![Some("ab"), None, Some("cde")])
}

#[test]
fn released_struct_is_detected() {
    // SAFETY: a released array is always allowed (and refused).
    let err = unsafe { DeviceArray::try_new(ArrowDeviceArray::empty()) }.unwrap_err();
    assert!(matches!(err, Error::Released { .. }), "{err}");
    assert!(err.to_string().contains("released"));
}

#[test]
fn released_schema_is_detected() {
    let (exported, _schema) = cpu::export_array(&ints()).unwrap();
    let (exported, count) = count_releases(exported);
    let err = cpu::import_array(exported, &FFI_ArrowSchema::empty()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Released {
                what: "ArrowSchema"
            }
        ),
        "{err}"
    );
    assert_eq!(releases(&count), 1);
}

#[test]
fn device_type_not_accepted() {
    let err = import_corrupted(&ints(), |raw| {
        raw.device_type = ArrowDeviceType::CUDA;
        raw.device_id = 0;
    });
    assert!(
        matches!(err, Error::UnsupportedDevice { found, .. } if found == ArrowDeviceType::CUDA),
        "{err}"
    );
}

#[test]
fn unknown_device_type_is_carried_into_the_error() {
    let err = import_corrupted(&ints(), |raw| raw.device_type = ArrowDeviceType(99));
    assert!(err.to_string().contains("UNKNOWN(99)"), "{err}");
}

#[test]
fn sync_event_on_the_cpu_is_rejected() {
    let mut event = 0u64;
    let err = import_corrupted(&ints(), |raw| {
        raw.sync_event = (&mut event as *mut u64).cast()
    });
    assert!(matches!(err, Error::UnexpectedSyncEvent { .. }), "{err}");
}

#[test]
fn n_buffers_not_matching_the_schema() {
    let err = import_corrupted(&ints(), |raw| raw.array.n_buffers = 1);
    assert!(
        matches!(err, Error::BufferCount { expected: ref e, found: 1, .. } if e == "2"),
        "{err}"
    );
}

#[test]
fn n_children_not_matching_the_schema() {
    let list = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1)])]);
    let err = import_corrupted(&list, |raw| raw.array.n_children = 0);
    assert!(
        matches!(
            err,
            Error::ChildCount {
                expected: 1,
                found: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn negative_length() {
    let err = import_corrupted(&ints(), |raw| raw.array.length = -1);
    assert!(
        matches!(
            err,
            Error::InvalidField {
                field: "length",
                value: -1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn negative_offset() {
    let err = import_corrupted(&ints(), |raw| raw.array.offset = -2);
    assert!(
        matches!(
            err,
            Error::InvalidField {
                field: "offset",
                value: -2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn negative_null_count() {
    let err = import_corrupted(&ints(), |raw| raw.array.null_count = -5);
    assert!(
        matches!(
            err,
            Error::InvalidField {
                field: "null_count",
                value: -5,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn unknown_null_count_is_accepted() {
    let (exported, schema) = cpu::export_array(&ints()).unwrap();
    let mut raw = exported.into_raw();
    raw.array.null_count = -1;
    // SAFETY: `raw` came from a DeviceArray; an unknown null count (-1) keeps it valid.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let back = cpu::import_array(array, &schema).unwrap();
    assert_eq!(back.null_count(), 1, "computed from the bitmap");
}

#[test]
fn null_data_buffer() {
    let err = import_corrupted(&ints(), |raw| {
        // SAFETY: `buffers` points to n_buffers = 2 writable pointers owned by the exporter.
        unsafe { *raw.array.buffers.add(1) = std::ptr::null() };
    });
    assert!(
        matches!(
            err,
            Error::NullBuffer {
                index: 1,
                role: "values",
                bytes: 12,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn null_validity_with_nulls() {
    let err = import_corrupted(&ints(), |raw| {
        // SAFETY: as above.
        unsafe { *raw.array.buffers = std::ptr::null() };
    });
    assert!(matches!(err, Error::NullBuffer { index: 0, .. }), "{err}");
}

#[test]
fn null_string_data_buffer_with_bytes() {
    let err = import_corrupted(&strings(), |raw| {
        // SAFETY: `buffers` points to n_buffers = 3 writable pointers owned by the exporter.
        unsafe { *raw.array.buffers.add(2) = std::ptr::null() };
    });
    assert!(
        matches!(
            err,
            Error::NullBuffer {
                index: 2,
                bytes: 5,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn list_offsets_past_the_child() {
    let list = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![
        Some(vec![Some(1), Some(2)]),
        Some(vec![Some(3)]),
    ]);
    let err = import_corrupted(&list, |raw| {
        // Shorten the child so the last offset (3) points past it.
        // SAFETY: the exported list has one child, owned by the exporter and writable.
        unsafe { (**raw.array.children).length = 2 };
    });
    assert!(matches!(err, Error::InvalidOffsets { .. }), "{err}");
    assert!(err.to_string().contains("past the end"), "{err}");
}

fn binary_with_offsets(offsets: &[i32], values: &[u8]) -> ArrayRef {
    let data = ArrayData::builder(DataType::Binary)
        .len(offsets.len() - 1)
        .add_buffer(Buffer::from_slice_ref(offsets))
        .add_buffer(Buffer::from_slice_ref(values));
    // SAFETY: deliberately invalid offsets, only exported and never read by this test.
    Arc::new(BinaryArray::from(unsafe { data.build_unchecked() }))
}

#[test]
fn offsets_not_monotonic() {
    let array = binary_with_offsets(&[0, 3, 1, 4], b"abcd");
    let err = import_corrupted(array.as_ref(), |_| {});
    assert!(matches!(err, Error::InvalidOffsets { .. }), "{err}");
    assert!(err.to_string().contains("decrease at item 1"), "{err}");
}

#[test]
fn negative_first_offset() {
    let array = binary_with_offsets(&[-1, 3], b"abc");
    let err = import_corrupted(array.as_ref(), |_| {});
    assert!(matches!(err, Error::InvalidOffsets { .. }), "{err}");
}

#[test]
fn format_string_that_does_not_parse() {
    let (exported, _) = cpu::export_array(&ints()).unwrap();
    let schema = FFI_ArrowSchema::try_new("not-a-format", vec![], None).unwrap();
    let err = import_corrupted_with_schema(exported, &schema, |_| {});
    assert!(matches!(err, Error::Schema(_)), "{err}");
}

#[test]
fn schema_of_another_type() {
    // A Utf8 array under an Int32 schema: the buffer count does not match.
    let (exported, _) = cpu::export_array(&strings()).unwrap();
    let schema = FFI_ArrowSchema::try_from(&DataType::Int32).unwrap();
    let err = import_corrupted_with_schema(exported, &schema, |_| {});
    assert!(matches!(err, Error::BufferCount { .. }), "{err}");
}

#[test]
fn invalid_utf8_is_caught_by_full_validation() {
    let data = ArrayData::builder(DataType::Binary)
        .len(1)
        .add_buffer(Buffer::from_slice_ref([0i32, 2]))
        .add_buffer(Buffer::from_slice_ref([0xffu8, 0xfe]))
        .build()
        .unwrap();
    let (exported, _) = cpu::export_array(&BinaryArray::from(data)).unwrap();
    let schema = FFI_ArrowSchema::try_from(&DataType::Utf8).unwrap();
    let err = import_corrupted_with_schema(exported, &schema, |_| {});
    assert!(matches!(err, Error::Arrow(_)), "{err}");
}

#[test]
fn dictionary_missing() {
    let dict: arrow_array::DictionaryArray<Int32Type> = vec!["a", "b", "a"].into_iter().collect();
    let err = import_corrupted(&dict, |raw| {
        // Detach the dictionary (leaked by the exporter's private data, which still owns
        // and frees it at release).
        raw.array.dictionary = std::ptr::null_mut();
    });
    assert!(matches!(err, Error::Dictionary { .. }), "{err}");
}

#[test]
fn errors_name_the_path_of_the_offending_child() {
    let list = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1)])]);
    let err = import_corrupted(&list, |raw| {
        // SAFETY: the exported list has one writable child.
        unsafe { (**raw.array.children).offset = -1 };
    });
    assert!(
        err.to_string()
            .starts_with("array.children[0]: invalid offset"),
        "{err}"
    );
}
