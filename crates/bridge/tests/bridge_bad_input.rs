//! Importing malformed foreign arrays as device batches (CPU device): every case is a
//! typed error, the foreign `release` runs exactly once, and the producer's buffers are
//! all freed (their reference counts come back to what they were before the export).

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::{
    Array, ArrayRef, Int32Array, ListArray, RecordBatch, StringArray, StringViewArray,
};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};
use common::{count_releases, releases, InstrumentedDevice};
use devarrow_abi::cpu;
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::{ArrowArray, ArrowDeviceArray, ArrowDeviceType, DeviceArray, Error};
use devarrow_bridge::DeviceBatch;
use devarrow_testing::slices::{empty_offset_arrays, null_offsets};

/// Every buffer of `data` and its descendants (clones: they share the allocations).
fn all_buffers(data: &ArrayData, out: &mut Vec<Buffer>) {
    out.extend(data.buffers().iter().cloned());
    if let Some(nulls) = data.nulls() {
        out.push(nulls.buffer().clone());
    }
    for child in data.child_data() {
        all_buffers(child, out);
    }
}

/// Exports the struct array `data`, lets `corrupt` damage the C struct, imports it with
/// `schema` on `device`, and checks the release count and that every buffer of `data`
/// is referenced as often as before. Returns the import error.
fn import_corrupted_on(
    device: Arc<dyn Device>,
    data: &ArrayData,
    schema: SchemaRef,
    corrupt: impl FnOnce(&mut ArrowDeviceArray),
) -> Error {
    let mut buffers = Vec::new();
    all_buffers(data, &mut buffers);
    let counts: Vec<usize> = buffers.iter().map(|b| b.strong_count()).collect();
    let (exported, count) = count_releases(cpu::export_array_data(data));
    let mut raw = exported.into_raw();
    corrupt(&mut raw);
    // Every corruption in this file keeps the pointers valid for their counts (a raised
    // count is backed by caller-owned slots that outlive the import), lengthens only a
    // struct without buffers, or changes what the importer must refuse before reading the
    // bytes it governs: lowered counts, NULL pointers, negative lengths and offsets, bad
    // offsets within their buffers, a foreign device label (refused before the buffers or
    // the event are touched), a sync event on the CPU (its pointee is never read).
    // SAFETY: `raw` came from a DeviceArray, and the corruption (see above) leaves it
    // well-formed with nothing the importer reads before rejecting it.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let err = DeviceBatch::import(device, array, schema).unwrap_err();
    assert_eq!(releases(&count), 1, "released exactly once after: {err}");
    let after: Vec<usize> = buffers.iter().map(|b| b.strong_count()).collect();
    assert_eq!(counts, after, "buffers still referenced after: {err}");
    err
}

fn import_corrupted(
    data: &ArrayData,
    schema: SchemaRef,
    corrupt: impl FnOnce(&mut ArrowDeviceArray),
) -> Error {
    import_corrupted_on(Arc::new(CpuDevice::new()), data, schema, corrupt)
}

/// A record batch's struct data and schema.
fn batch_data(batch: &RecordBatch) -> (ArrayData, SchemaRef) {
    (
        arrow_array::StructArray::from(batch.clone()).into_data(),
        batch.schema(),
    )
}

fn ints_and_strings() -> RecordBatch {
    RecordBatch::try_from_iter([
        (
            "i",
            Arc::new(Int32Array::from(vec![Some(1), None, Some(3)])) as ArrayRef,
        ),
        (
            "s",
            Arc::new(StringArray::from(vec![Some("ab"), None, Some("cde")])) as ArrayRef,
        ),
    ])
    .unwrap()
}

/// A struct array with one column, built without validation (the column may be
/// malformed on purpose), and its schema.
fn one_column(name: &str, column: ArrayData) -> (ArrayData, SchemaRef) {
    let schema = Arc::new(Schema::new(vec![Field::new(
        name,
        column.data_type().clone(),
        true,
    )]));
    let len = column.len();
    let builder = ArrayData::builder(DataType::Struct(schema.fields().clone()))
        .len(len)
        .child_data(vec![column]);
    // SAFETY: the struct itself is well formed (one child of its length); the child may
    // not be, which is what the tests feed to the importer (never to arrow-rs readers).
    (unsafe { builder.build_unchecked() }, schema)
}

/// A Utf8 array over `data` with raw (possibly invalid) `offsets`.
fn utf8(offsets: &[i32], data: &[u8]) -> ArrayData {
    let builder = ArrayData::builder(DataType::Utf8)
        .len(offsets.len() - 1)
        .add_buffer(Buffer::from_slice_ref(offsets))
        .add_buffer(Buffer::from_slice_ref(data));
    // SAFETY: the buffer counts match the type; the offsets are only read by the
    // importer under test, which must reject them.
    unsafe { builder.build_unchecked() }
}

/// The child `i` of the root of `raw`.
fn child_mut(raw: &mut ArrowDeviceArray, i: usize) -> &mut ArrowArray {
    assert!((i as i64) < raw.array.n_children);
    // SAFETY: `i` is in range and the exporter filled `children` with valid pointers.
    unsafe { &mut **raw.array.children.add(i) }
}

#[test]
fn schema_with_another_field_count() {
    let (data, _) = batch_data(&ints_and_strings());
    let schema = Arc::new(Schema::new(vec![Field::new("i", DataType::Int32, true)]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(
            err,
            Error::ChildCount {
                expected: 1,
                found: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn schema_with_another_field_type() {
    let (data, _) = batch_data(&ints_and_strings());
    let schema = Arc::new(Schema::new(vec![
        Field::new("i", DataType::Utf8, true),
        Field::new("s", DataType::Utf8, true),
    ]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::BufferCount { ref path, found: 2, .. } if path == "array.children[0]"),
        "{err}"
    );
    // A nested type where a leaf was exported.
    let item = Arc::new(Field::new("item", DataType::Int32, true));
    let schema = Arc::new(Schema::new(vec![
        Field::new("i", DataType::List(item), true),
        Field::new("s", DataType::Utf8, true),
    ]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(matches!(err, Error::ChildCount { .. }), "{err}");
}

#[test]
fn buffers_that_do_not_fit_the_schema() {
    let (data, schema) = batch_data(&ints_and_strings());
    let err = import_corrupted(&data, schema.clone(), |raw| child_mut(raw, 0).n_buffers = 1);
    assert!(
        matches!(err, Error::BufferCount { ref expected, found: 1, .. } if expected == "2"),
        "{err}"
    );
    // One buffer too many, backed by a slot of our own (arrow-rs's release frees its
    // pointer arrays through its private data, not through `buffers`).
    let mut slots = [std::ptr::null::<c_void>(); 4];
    let slots_ptr = slots.as_mut_ptr();
    let err = import_corrupted(&data, schema.clone(), |raw| {
        let child = child_mut(raw, 1);
        assert_eq!(child.n_buffers, 3);
        // SAFETY: the utf8 child has three buffer slots; `slots` has room for four and
        // outlives the import.
        unsafe { std::ptr::copy_nonoverlapping(child.buffers, slots_ptr, 3) };
        child.buffers = slots_ptr;
        child.n_buffers = 4;
    });
    assert!(matches!(err, Error::BufferCount { found: 4, .. }), "{err}");
    // The values buffer of an int32 column is NULL.
    let err = import_corrupted(&data, schema, |raw| {
        let child = child_mut(raw, 0);
        // SAFETY: the int32 child has two buffer slots (arrow-rs's own pointer array,
        // not read by its release).
        unsafe { *child.buffers.add(1) = std::ptr::null() };
    });
    assert!(
        matches!(
            err,
            Error::NullBuffer {
                index: 1,
                bytes: 12,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn children_that_do_not_fit_the_schema() {
    let list =
        ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1), Some(2)]), None]);
    let batch = RecordBatch::try_from_iter([("l", Arc::new(list) as ArrayRef)]).unwrap();
    let (data, schema) = batch_data(&batch);
    let err = import_corrupted(&data, schema.clone(), |raw| {
        child_mut(raw, 0).n_children = 0
    });
    assert!(
        matches!(err, Error::ChildCount { expected: 1, found: 0, ref path, .. } if path == "array.children[0]"),
        "{err}"
    );
    // One child too many, backed by a (NULL) slot of our own, as above.
    let mut slots = [std::ptr::null_mut::<ArrowArray>(); 2];
    let slots_ptr = slots.as_mut_ptr();
    let err = import_corrupted(&data, schema.clone(), |raw| {
        assert_eq!(raw.array.n_children, 1);
        // SAFETY: the struct has one child slot; `slots` has room for two and outlives
        // the import.
        unsafe { std::ptr::copy_nonoverlapping(raw.array.children, slots_ptr, 1) };
        raw.array.children = slots_ptr;
        raw.array.n_children = 2;
    });
    assert!(matches!(err, Error::ChildCount { found: 2, .. }), "{err}");
    // A child shorter than the struct (whose only buffer, its validity, is NULL).
    let err = import_corrupted(&data, schema.clone(), |raw| {
        // SAFETY: the struct has one buffer slot (arrow-rs's pointer array).
        assert!(unsafe { *raw.array.buffers }.is_null());
        raw.array.length = 5;
    });
    assert!(
        matches!(
            err,
            Error::InvalidField {
                field: "length",
                ..
            }
        ),
        "{err}"
    );
    let err = import_corrupted(&data, schema, |raw| child_mut(raw, 0).offset = -1);
    assert!(
        matches!(
            err,
            Error::InvalidField {
                field: "offset",
                value: -1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn wrong_device_type() {
    let (data, schema) = batch_data(&ints_and_strings());
    let err = import_corrupted(&data, schema.clone(), |raw| {
        raw.device_type = ArrowDeviceType::CUDA;
        raw.device_id = 0;
    });
    assert!(
        matches!(err, Error::UnsupportedDevice { found, .. } if found == ArrowDeviceType::CUDA),
        "{err}"
    );
    let err = import_corrupted(&data, schema.clone(), |raw| {
        raw.device_type = ArrowDeviceType(99)
    });
    assert!(err.to_string().contains("UNKNOWN(99)"), "{err}");
    // A CPU array must not carry a sync event.
    let mut event = 0u64;
    let err = import_corrupted(&data, schema, |raw| {
        raw.sync_event = (&mut event as *mut u64).cast()
    });
    assert!(matches!(err, Error::UnexpectedSyncEvent { .. }), "{err}");
}

#[test]
fn wrong_device_id() {
    // A device posing as ROCm device 1 (its memory is the CPU's, so host-side types work).
    let rocm = || Arc::new(InstrumentedDevice::default().posing_as(ArrowDeviceType::ROCM, 1));
    let (data, schema) = batch_data(&ints_and_strings());
    let err = import_corrupted_on(rocm(), &data, schema.clone(), |raw| {
        raw.device_type = ArrowDeviceType::ROCM;
        raw.device_id = 0;
    });
    assert!(
        matches!(
            err,
            Error::DeviceMismatch {
                expected: 1,
                found: 0,
                ..
            }
        ),
        "{err}"
    );
    // Pinned host memory of any device is accepted.
    let (array, count) = count_releases(cpu::export_array_data(&data));
    let mut raw = array.into_raw();
    raw.device_type = ArrowDeviceType::ROCM_HOST;
    raw.device_id = 0;
    // SAFETY: `raw` came from a DeviceArray of host memory; `ROCM_HOST` labels host memory
    // too, which is what this importing device reads.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let batch = DeviceBatch::import(rocm(), array, schema).unwrap();
    assert_eq!(batch.num_rows(), 3);
    drop(batch);
    assert_eq!(releases(&count), 1);
}

#[test]
fn last_offset_before_the_first() {
    let (data, schema) = one_column("s", utf8(&[5, 6, 2], b"abcdefgh"));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref path, ref message }
            if path == "array.children[0]" && message.contains("less than the first")),
        "{err}"
    );
}

#[test]
fn negative_first_offset() {
    let (data, schema) = one_column("s", utf8(&[-1, 0, 2], b"ab"));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. } if message.contains("negative")),
        "{err}"
    );
}

#[test]
fn string_data_missing_where_offsets_address_bytes() {
    let (data, schema) = one_column("s", utf8(&[0, 3, 5], b"abcde"));
    let err = import_corrupted(&data, schema, |raw| {
        let child = child_mut(raw, 0);
        // SAFETY: the utf8 child has three buffer slots (arrow-rs's pointer array).
        unsafe { *child.buffers.add(2) = std::ptr::null() };
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

fn list_of(child: ArrayData, offsets: &[i32]) -> ArrayData {
    let field = Arc::new(Field::new("item", child.data_type().clone(), true));
    let builder = ArrayData::builder(DataType::List(field))
        .len(offsets.len() - 1)
        .add_buffer(Buffer::from_slice_ref(offsets))
        .child_data(vec![child]);
    // SAFETY: buffer and child counts match the type; the offsets are only read by the
    // importer under test.
    unsafe { builder.build_unchecked() }
}

#[test]
fn list_offsets_past_the_child() {
    let child = Int32Array::from(vec![1, 2, 3]).into_data();
    let (data, schema) = one_column("l", list_of(child, &[0, 2, 10]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref path, ref message }
            if path == "array.children[0]" && message.contains("past the end of the child")),
        "{err}"
    );
    // The same, with the child sliced: its offset shortens it.
    let child = Int32Array::from(vec![1, 2, 3, 4, 5])
        .into_data()
        .slice(3, 2);
    let (data, schema) = one_column("l", list_of(child, &[0, 1, 3]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. } if message.contains("(length 2)")),
        "{err}"
    );
}

#[test]
fn nested_offsets_out_of_range_name_their_path() {
    let strings = utf8(&[1, 2, 0], b"ab");
    let (data, schema) = one_column("l", list_of(strings, &[0, 2]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref path, .. } if path == "array.children[0].children[0]"),
        "{err}"
    );
}

#[test]
fn list_view_outside_its_child() {
    let field = Arc::new(Field::new("item", DataType::Int32, true));
    let builder = ArrayData::builder(DataType::ListView(field))
        .len(2)
        .add_buffer(Buffer::from_slice_ref([0i32, 2]))
        .add_buffer(Buffer::from_slice_ref([1i32, 5]))
        .child_data(vec![Int32Array::from(vec![1, 2, 3]).into_data()]);
    // SAFETY: buffer and child counts match; the views are only read by the importer.
    let view = unsafe { builder.build_unchecked() };
    let (data, schema) = one_column("v", view);
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. }
            if message.contains("list view 1 (offset 2, size 5)")),
        "{err}"
    );
}

#[test]
fn negative_variadic_buffer_size() {
    let views = StringViewArray::from(vec![Some("a string longer than twelve bytes"), None]);
    let batch = RecordBatch::try_from_iter([("v", Arc::new(views) as ArrayRef)]).unwrap();
    let (data, schema) = batch_data(&batch);
    let sizes = [-7i64];
    let err = import_corrupted(&data, schema, |raw| {
        let child = child_mut(raw, 0);
        assert_eq!(
            child.n_buffers, 4,
            "validity, views, one data buffer, sizes"
        );
        // SAFETY: slot 3 is the variadic sizes slot of arrow-rs's pointer array; `sizes`
        // outlives the import.
        unsafe { *child.buffers.add(3) = sizes.as_ptr().cast() };
    });
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. } if message.contains("negative size -7")),
        "{err}"
    );
}

#[test]
fn top_level_nulls() {
    let (data, schema) = batch_data(&ints_and_strings());
    let err = import_corrupted(&data, schema, |raw| raw.array.null_count = 1);
    // The struct claims a null but has no validity bitmap, or has one: either way an error.
    assert!(
        matches!(err, Error::NullBuffer { .. } | Error::InvalidArgument(_)),
        "{err}"
    );
}

#[test]
fn a_released_child() {
    let (data, schema) = batch_data(&ints_and_strings());
    let mut buffers = Vec::new();
    all_buffers(&data, &mut buffers);
    let counts: Vec<usize> = buffers.iter().map(|b| b.strong_count()).collect();
    let (exported, count) = count_releases(cpu::export_array_data(&data));
    let mut raw = exported.into_raw();
    // A consumer may move a child out (leaving it released), as the spec allows.
    let mut moved = std::mem::replace(child_mut(&mut raw, 1), ArrowArray::empty());
    // SAFETY: `raw` came from a DeviceArray; a child moved out leaves a released struct
    // behind, which keeps the parent well-formed.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let err = DeviceBatch::import(Arc::new(CpuDevice::new()), array, schema).unwrap_err();
    assert_eq!(releases(&count), 1);
    assert!(
        matches!(
            err,
            Error::Released {
                what: "ArrowArray child"
            }
        ),
        "{err}"
    );
    // The moved-out child is ours to release.
    let release = moved.release.expect("moved out unreleased");
    // SAFETY: `moved` is an unreleased array we own.
    unsafe { release(&mut moved) };
    assert!(moved.is_released());
    let after: Vec<usize> = buffers.iter().map(|b| b.strong_count()).collect();
    assert_eq!(counts, after, "nothing of the export is left");
}

#[test]
fn a_released_array_or_schema() {
    // A released device array cannot even be owned, so it never reaches the importer.
    // SAFETY: a released array is always allowed (and refused).
    let err = unsafe { DeviceArray::try_new(ArrowDeviceArray::empty()) }.unwrap_err();
    assert!(matches!(err, Error::Released { .. }), "{err}");
    // A released schema.
    let (array, _schema) = cpu::export_record_batch(&ints_and_strings()).unwrap();
    let (array, count) = count_releases(array);
    let err = DeviceBatch::import_with_ffi_schema(
        Arc::new(CpuDevice::new()),
        array,
        &FFI_ArrowSchema::empty(),
    )
    .unwrap_err();
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
    // A schema that is not a struct.
    let (array, _schema) = cpu::export_record_batch(&ints_and_strings()).unwrap();
    let (array, count) = count_releases(array);
    let schema = FFI_ArrowSchema::try_from(&DataType::Int32).unwrap();
    let err = DeviceBatch::import_with_ffi_schema(Arc::new(CpuDevice::new()), array, &schema)
        .unwrap_err();
    assert!(matches!(err, Error::Schema(_)), "{err}");
    assert_eq!(releases(&count), 1);
}

#[test]
fn invalid_values_found_on_the_host_are_typed_errors_too() {
    // Offsets in range at both ends but decreasing in the middle pass the import (only
    // the ends are read back) and fail, typed, when the batch is moved to the host.
    let (data, schema) = one_column("s", utf8(&[0, 4, 1, 5], b"abcde"));
    let (array, count) = count_releases(cpu::export_array_data(&data));
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let batch = DeviceBatch::import(device.clone(), array, schema).unwrap();
    let mut transfer =
        devarrow_bridge::Transfer::new(device, devarrow_bridge::TransferOptions::default());
    let err = transfer.to_host(&batch).unwrap_err();
    assert!(matches!(err, Error::Arrow(_)), "{err}");
    drop(batch);
    assert_eq!(releases(&count), 1);
    // A struct type whose fields differ only in their Rust-side names still imports.
    let fields = Fields::from(vec![Field::new("renamed", DataType::Int32, true)]);
    let ints = Int32Array::from(vec![1, 2]).into_data();
    let (data, _) = one_column("i", ints);
    let schema = Arc::new(Schema::new(fields));
    let batch = DeviceBatch::import(
        Arc::new(CpuDevice::new()),
        cpu::export_array_data(&data),
        schema,
    )
    .unwrap();
    assert_eq!(batch.schema().field(0).name(), "renamed");
}

/// A struct array of `columns`, built without validation (they may be malformed on
/// purpose), and its schema.
fn columns(columns: Vec<(&str, ArrayData)>) -> (ArrayData, SchemaRef) {
    let schema = Arc::new(Schema::new(
        columns
            .iter()
            .map(|(name, c)| Field::new(*name, c.data_type().clone(), true))
            .collect::<Vec<_>>(),
    ));
    let len = columns.first().map_or(0, |(_, c)| c.len());
    let builder = ArrayData::builder(DataType::Struct(schema.fields().clone()))
        .len(len)
        .child_data(columns.into_iter().map(|(_, c)| c).collect());
    // SAFETY: the struct itself is well formed (children of its length); the children
    // may not be, which is what the tests feed to the importer.
    (unsafe { builder.build_unchecked() }, schema)
}

/// A LargeBinary array over `data` with raw (possibly invalid) `offsets`.
fn large_binary(offsets: &[i64], data: &[u8]) -> ArrayData {
    let builder = ArrayData::builder(DataType::LargeBinary)
        .len(offsets.len() - 1)
        .add_buffer(Buffer::from_slice_ref(offsets))
        .add_buffer(Buffer::from_slice_ref(data));
    // SAFETY: the buffer counts match the type; the offsets are only read by the
    // importer under test.
    unsafe { builder.build_unchecked() }
}

#[test]
fn offsets_that_address_more_than_the_address_space_are_an_error() {
    // Each column addresses i64::MAX bytes: the download's sizes would wrap (two columns)
    // or exceed isize::MAX (one), and a wrapped size would allocate a tiny image that the
    // packing copy then overruns. Rejected at import, before any copy of the data.
    let huge = || large_binary(&[0, i64::MAX], b"ab");
    let cases = [
        columns(vec![("a", huge()), ("b", huge())]),
        columns(vec![("a", huge())]),
        columns(vec![
            ("s", utf8(&[0, 2], b"ab")),
            ("a", large_binary(&[1, i64::MAX], b"ab")),
        ]),
    ];
    for (data, schema) in cases {
        let device = InstrumentedDevice::new();
        let err = import_corrupted_on(device.clone(), &data, schema, |_| {});
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("overflows the address space")),
            "{err}"
        );
        assert_eq!(
            device.on_device_copies(),
            1,
            "only the read-back of the offsets"
        );
    }
}

#[test]
fn list_view_lengths_that_overflow_the_read_back_are_an_error() {
    let field = Arc::new(Field::new("item", DataType::Int32, true));
    let builder = ArrayData::builder(DataType::ListView(field))
        .len(2)
        .add_buffer(Buffer::from_slice_ref([0i32, 1]))
        .add_buffer(Buffer::from_slice_ref([1i32, 2]))
        .child_data(vec![Int32Array::from(vec![1, 2, 3]).into_data()]);
    // SAFETY: buffer and child counts match; the views are only read by the importer.
    let view = unsafe { builder.build_unchecked() };
    let (data, schema) = one_column("v", view);
    // A batch of 2^61 (2^60) rows whose list view claims as many: its offsets and sizes
    // to read back are 2^63 (2^62) bytes each, which wrapped (overflowed isize) the
    // scratch size. (Only the views of the batch's rows are read: a list view longer
    // than its batch reads no more.)
    for (length, fragment) in [
        (1i64 << 61, "larger than isize::MAX"),
        (1i64 << 60, "overflows the address space"),
    ] {
        let device = InstrumentedDevice::new();
        let err = import_corrupted_on(device.clone(), &data, schema.clone(), |raw| {
            raw.array.length = length;
            child_mut(raw, 0).length = length;
        });
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains(fragment)),
            "{err}"
        );
        assert_eq!(device.on_device_copies(), 0, "nothing was copied");
    }
}

#[test]
fn negative_fixed_sizes_are_an_error() {
    let fsb = arrow_array::FixedSizeBinaryArray::try_from_iter([b"ab", b"cd"].into_iter()).unwrap();
    let fsl = arrow_array::FixedSizeListArray::from_iter_primitive::<Int32Type, _, _>(
        [Some([Some(1), Some(2)]), None],
        2,
    );
    let item = Arc::new(Field::new("item", DataType::Int32, true));
    for (column, negative) in [
        (Arc::new(fsb) as ArrayRef, DataType::FixedSizeBinary(-1)),
        (Arc::new(fsl) as ArrayRef, DataType::FixedSizeList(item, -1)),
    ] {
        let batch = RecordBatch::try_from_iter([("c", column)]).unwrap();
        let (data, _) = batch_data(&batch);
        let schema = Arc::new(Schema::new(vec![Field::new("c", negative.clone(), true)]));
        let err = import_corrupted(&data, schema.clone(), |_| {});
        assert!(
            matches!(err, Error::Schema(ref e) if e.to_string().contains("negative size -1")),
            "{negative}: {err}"
        );
        // The same through a C schema ("w:-1", "+w:-1"), which arrow-rs parses.
        let ffi = FFI_ArrowSchema::try_from(schema.as_ref()).unwrap();
        let (array, count) = count_releases(cpu::export_array_data(&data));
        let err = DeviceBatch::import_with_ffi_schema(Arc::new(CpuDevice::new()), array, &ffi)
            .unwrap_err();
        assert!(matches!(err, Error::Schema(_)), "{negative}: {err}");
        assert_eq!(releases(&count), 1);
    }
}

/// Exports `(data, schema)` (one column) with the batch cut to `len` rows from row
/// `offset` at the C level (the column's own offset and length, its children whole),
/// imports it and returns the error.
fn import_sliced_corrupted(data: &ArrayData, schema: SchemaRef, offset: i64, len: i64) -> Error {
    import_corrupted(data, schema, |raw| {
        raw.array.length = len;
        let column = child_mut(raw, 0);
        column.offset += offset;
        column.length = len;
    })
}

#[test]
fn offsets_that_a_slice_reaches_out_of_range_name_their_path() {
    // The list's offsets at its own bounds (0 and 2) are fine; the slice's first item
    // reaches past the child.
    let child = Int32Array::from(vec![1, 2, 3]).into_data();
    let (data, schema) = one_column("l", list_of(child, &[0, 9, 2]));
    let err = import_sliced_corrupted(&data, schema, 0, 1);
    assert!(
        matches!(err, Error::InvalidOffsets { ref path, ref message }
            if path == "array.children[0]" && message.contains("last offset 9 is past the end of the child (length 3)")),
        "{err}"
    );
    // The strings' offsets at their own bounds (0 and 6) are fine; those of the one item
    // the sliced list reaches decrease: found when the child's cut is read back.
    let strings = utf8(&[0, 5, 2, 6], b"abcdefgh");
    let (data, schema) = one_column("l", list_of(strings, &[0, 1, 2, 3]));
    let err = import_sliced_corrupted(&data, schema, 1, 1);
    assert!(
        matches!(err, Error::InvalidOffsets { ref path, ref message }
            if path == "array.children[0].children[0]" && message.contains("last offset 2 is less than the first offset 5")),
        "{err}"
    );
}

/// A dense union of an int32 and a utf8 child (type ids 5 and 7), of raw (possibly
/// invalid) `type_ids` and `offsets`, children of 3 items each.
fn dense_union(type_ids: &[i8], offsets: &[i32]) -> ArrayData {
    let fields = arrow_schema::UnionFields::try_new(
        vec![5, 7],
        vec![
            Field::new("i", DataType::Int32, true),
            Field::new("s", DataType::Utf8, true),
        ],
    )
    .unwrap();
    let builder = ArrayData::builder(DataType::Union(fields, arrow_schema::UnionMode::Dense))
        .len(type_ids.len())
        .add_buffer(Buffer::from_slice_ref(type_ids))
        .add_buffer(Buffer::from_slice_ref(offsets))
        .child_data(vec![
            Int32Array::from(vec![1, 2, 3]).into_data(),
            StringArray::from(vec!["a", "b", "c"]).into_data(),
        ]);
    // SAFETY: buffer and child counts match; the type ids and offsets are only read by
    // the importer under test.
    unsafe { builder.build_unchecked() }
}

#[test]
fn dense_union_items_that_reach_outside_their_child() {
    // Fewer items than the children hold: the items' offsets are read back to cut them.
    let (data, schema) = one_column("u", dense_union(&[5, 7, 5, 7], &[0, 0, 1, 7]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref path, ref message }
            if path == "array.children[0]" && message.contains("item 3 has offset 7 into child 1 (type id 7), outside the child (length 3)")),
        "{err}"
    );
    let (data, schema) = one_column("u", dense_union(&[5, 7, 5, 7], &[0, 0, 1, -1]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. } if message.contains("offset -1")),
        "{err}"
    );
    let (data, schema) = one_column("u", dense_union(&[5, 6, 5, 7], &[0, 0, 1, 1]));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. } if message.contains("item 1 has type id 6, which no field has")),
        "{err}"
    );
}

/// A run-end encoded array of raw (possibly invalid) int32 `ends` over int32 values, of
/// `len` items.
fn run_end_encoded(ends: &[i32], len: usize) -> ArrayData {
    let data_type = DataType::RunEndEncoded(
        Arc::new(Field::new("run_ends", DataType::Int32, false)),
        Arc::new(Field::new("values", DataType::Int32, true)),
    );
    let values = Int32Array::from_iter_values(0..ends.len() as i32);
    let builder = ArrayData::builder(data_type).len(len).child_data(vec![
        Int32Array::from(ends.to_vec()).into_data(),
        values.into_data(),
    ]);
    // SAFETY: the child counts match; the run ends are only read by the importer.
    unsafe { builder.build_unchecked() }
}

#[test]
fn run_ends_that_do_not_increase_or_end_early() {
    // A slice whose runs are searched for: the run ends read decrease.
    let (data, schema) = one_column("r", run_end_encoded(&[2, 5, 4, 9, 12], 12));
    let err = import_sliced_corrupted(&data, schema, 3, 5);
    assert!(
        matches!(err, Error::InvalidOffsets { ref path, ref message }
            if path == "array.children[0]" && message.contains("run ends do not increase: run 1 ends at 5, run 2 at 4")),
        "{err}"
    );
    // Many runs (searched in several rounds), one of them out of order.
    let mut ends: Vec<i32> = (1..=10_000).map(|e| 2 * e).collect();
    ends[7_000] = 3;
    let (data, schema) = one_column("r", run_end_encoded(&ends, 20_000));
    let err = import_sliced_corrupted(&data, schema, 13_999, 10);
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. } if message.contains("run ends do not increase")),
        "{err}"
    );
    // The last run ends before the array does.
    let (data, schema) = one_column("r", run_end_encoded(&[2, 4], 6));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. }
            if message.contains("the last run end 4 is before the end of the array (6)")),
        "{err}"
    );
    // No runs at all.
    let (data, schema) = one_column("r", run_end_encoded(&[], 3));
    let err = import_corrupted(&data, schema, |_| {});
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. } if message.contains("no run ends for 3 items")),
        "{err}"
    );
}

/// A 16-byte view of `len` bytes at `offset` of variadic buffer `buffer`.
fn view(len: u32, buffer: u32, offset: u32) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[0..4].copy_from_slice(&len.to_le_bytes());
    v[8..12].copy_from_slice(&buffer.to_le_bytes());
    v[12..16].copy_from_slice(&offset.to_le_bytes());
    v
}

#[test]
fn views_that_reach_past_their_buffers() {
    // Two views over a buffer of 10 000 bytes: read back to cut it (they are far
    // smaller), and found to reach outside it.
    let data = vec![b'x'; 10_000];
    for (bad, fragment) in [
        (
            view(20, 0, 9_990),
            "view 1 (20 bytes at 9990) reaches past the end of variadic buffer 0 (10000 bytes)",
        ),
        (
            view(20, 3, 0),
            "view 1 points into variadic buffer 3, of 1 buffers",
        ),
    ] {
        let views: Vec<u8> = [view(20, 0, 100), bad].concat();
        let builder = ArrayData::builder(DataType::Utf8View)
            .len(2)
            .add_buffer(Buffer::from_vec(views))
            .add_buffer(Buffer::from_vec(data.clone()));
        // SAFETY: the buffer counts match the type; the views are only read by the
        // importer under test.
        let column = unsafe { builder.build_unchecked() };
        let (data, schema) = one_column("v", column);
        let err = import_corrupted(&data, schema, |_| {});
        assert!(
            matches!(err, Error::InvalidOffsets { ref path, ref message }
                if path == "array.children[0]" && message.contains(fragment)),
            "{err}"
        );
    }
}

#[test]
fn views_of_a_column_of_more_buffers_than_rows_that_reach_past_them() {
    // Two views over four buffers (more buffers than moved items: the views are read
    // first, then the sizes of the buffers they point into only), found to reach outside
    // them; a negative size of a buffer they point into; a NULL buffer they point into.
    let buffer = |len: usize| Buffer::from_vec(vec![b'x'; len]);
    let import = |views: Vec<u8>, sizes: Option<&[i64; 4]>, null_buffer: Option<usize>| {
        let builder = ArrayData::builder(DataType::Utf8View)
            .len(2)
            .add_buffer(Buffer::from_vec(views))
            .add_buffer(buffer(100))
            .add_buffer(buffer(100))
            .add_buffer(buffer(50))
            .add_buffer(buffer(100));
        // SAFETY: the buffer counts match the type; the views are only read by the
        // importer under test.
        let column = unsafe { builder.build_unchecked() };
        let (data, schema) = one_column("v", column);
        import_corrupted(&data, schema, |raw| {
            let child = child_mut(raw, 0);
            assert_eq!(child.n_buffers, 7, "validity, views, 4 data buffers, sizes");
            if let Some(sizes) = sizes {
                // SAFETY: slot 6 is the variadic sizes slot of arrow-rs's pointer array;
                // `sizes` outlives the import.
                unsafe { *child.buffers.add(6) = sizes.as_ptr().cast() };
            }
            if let Some(b) = null_buffer {
                // SAFETY: slot 2 + b < 6 is a data buffer slot of that pointer array.
                unsafe { *child.buffers.add(2 + b) = std::ptr::null() };
            }
        })
    };
    for (bad, fragment) in [
        (
            view(20, 2, 40),
            "view 1 (20 bytes at 40) reaches past the end of variadic buffer 2 (50 bytes)",
        ),
        (
            view(20, 4, 0),
            "view 1 points into variadic buffer 4, of 4 buffers",
        ),
    ] {
        let err = import([view(20, 3, 10), bad].concat(), None, None);
        assert!(
            matches!(err, Error::InvalidOffsets { ref path, ref message }
                if path == "array.children[0]" && message.contains(fragment)),
            "{err}"
        );
    }
    let views = || [view(20, 3, 10), view(20, 1, 0)].concat();
    let err = import(views(), Some(&[100, -5, 50, 100]), None);
    assert!(
        matches!(err, Error::InvalidOffsets { ref message, .. }
            if message.contains("variadic buffer 1 has negative size -5")),
        "{err}"
    );
    let err = import(views(), None, Some(1));
    assert!(
        matches!(
            err,
            Error::NullBuffer {
                index: 3,
                bytes: 100,
                ..
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------
// NULL offsets of zero-length arrays (issue #25, item 3)
// ---------------------------------------------------------------------------------------

/// Imports `data` (a struct array of `schema`) on the CPU device after `corrupt`, moves
/// it to the host and compares it with `data`; the foreign array is released once.
fn import_and_download(
    data: &ArrayData,
    schema: SchemaRef,
    corrupt: impl FnOnce(&mut ArrowDeviceArray),
) {
    let (exported, count) = count_releases(cpu::export_array_data(data));
    let mut raw = exported.into_raw();
    corrupt(&mut raw);
    // SAFETY: `raw` came from a DeviceArray; only buffers of zero-length arrays were
    // NULLed, which the C data interface reads as empty (see devarrow_abi::layout).
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let batch = DeviceBatch::import(device.clone(), array, schema.clone())
        .unwrap_or_else(|e| panic!("{schema:?}: {e}"));
    let mut transfer =
        devarrow_bridge::Transfer::new(device, devarrow_bridge::TransferOptions::default());
    let back = transfer.to_host(&batch).unwrap();
    let expected = RecordBatch::from(arrow_array::StructArray::from(data.clone()));
    assert_eq!(back, expected, "{schema:?}");
    assert_eq!(releases(&count), 0, "the batch holds the array");
    drop(batch);
    assert_eq!(releases(&count), 1, "released once");
}

/// Issue #25: a zero-length string, binary, list or map column whose offsets buffer is
/// NULL (as nanoarrow's CUDA copy makes it) imports as empty, as Arrow C++ imports it.
#[test]
fn zero_length_columns_with_null_offsets_import_as_empty() {
    for column in empty_offset_arrays() {
        let (data, schema) = one_column("c", column);
        import_and_download(&data, schema, |raw| {
            // SAFETY: the column is arrow-rs's export of an `empty_offset_arrays` type.
            unsafe { null_offsets(child_mut(raw, 0)) }
        });
    }
}

/// The same for a zero-length child under rows that reach none of it: the strings of a
/// list whose lists are all empty.
#[test]
fn a_zero_length_child_with_null_offsets_under_empty_lists_imports() {
    let strings = ArrayData::new_empty(&DataType::Utf8);
    let (data, schema) = one_column("l", list_of(strings, &[0, 0, 0]));
    import_and_download(&data, schema, |raw| {
        let list = child_mut(raw, 0);
        // SAFETY: the list has one child, the exporter's, writable: a Utf8 array.
        unsafe { null_offsets(&mut **list.children) };
    });
}

/// NULL offsets with rows to address stay a typed error, the array released once.
#[test]
fn null_offsets_with_rows_are_refused() {
    for (column, len) in [
        (utf8(&[0, 1, 3], b"abc"), 2),
        (
            list_of(Int32Array::from(vec![1, 2, 3]).into_data(), &[0, 2, 3]),
            2,
        ),
    ] {
        let (data, schema) = one_column("c", column);
        let err = import_corrupted(&data, schema, |raw| {
            let column = child_mut(raw, 0);
            // SAFETY: the column has at least two buffer slots (arrow-rs's, writable).
            unsafe { *column.buffers.add(1) = std::ptr::null() };
        });
        assert!(
            matches!(err, Error::NullBuffer { index: 1, role: "offsets", bytes, .. } if bytes == (len + 1) * 4),
            "{err}"
        );
    }
}
