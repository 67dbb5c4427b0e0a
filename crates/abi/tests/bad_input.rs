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
use devarrow_testing::slices::{empty_offset_arrays, null_offsets};

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

/// Exports `array`, moves a copy of its C buffer `index` (`len` bytes) to an address
/// `misalign` bytes past a 64-byte boundary, and imports it. Returns the import error.
fn import_with_misaligned_buffer(
    array: &dyn Array,
    index: usize,
    len: usize,
    misalign: usize,
) -> Error {
    let (exported, schema) = cpu::export_array(array).unwrap();
    let (exported, count) = count_releases(exported);
    let raw = exported.into_raw();
    // The misaligned copy: the same bytes, `misalign` bytes into an 8-byte aligned block.
    let mut block = vec![0u64; (len + misalign).div_ceil(8) + 8];
    // SAFETY: `raw` came from a DeviceArray (well-formed), whose buffer `index` holds
    // `len` bytes (the caller's figure for this array); `block` holds `len + misalign` bytes and
    // outlives the import below.
    unsafe {
        let src = *raw.array.buffers.add(index) as *const u8;
        let dst = block.as_mut_ptr().cast::<u8>().add(misalign);
        std::ptr::copy_nonoverlapping(src, dst, len);
        *raw.array.buffers.add(index) = dst as *const std::ffi::c_void;
    }
    // SAFETY: only a buffer pointer was replaced, by one to a copy of the same bytes.
    let device_array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let err = cpu::import_array(device_array, &schema).unwrap_err();
    assert_eq!(releases(&count), 1, "released exactly once after: {err}");
    drop(block);
    err
}

/// Fuzzing found it (fuzz target `import_array`): arrow-rs reads the last offset of a
/// `LargeUtf8` array as an aligned `i64` in place; an unaligned offsets buffer (which the
/// C data interface allows) was undefined behaviour inside arrow-rs (a "misaligned
/// pointer dereference" abort in debug builds). Now a typed error.
#[test]
fn misaligned_large_utf8_offsets_are_refused() {
    let array = arrow_array::LargeStringArray::from(vec![Some("ab"), None, Some("cde")]);
    let err = import_with_misaligned_buffer(&array, 1, 4 * 8, 4);
    assert!(
        matches!(
            err,
            Error::MisalignedBuffer {
                index: 1,
                align: 8,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn misaligned_utf8_and_binary_offsets_are_refused() {
    let err = import_with_misaligned_buffer(&strings(), 1, 4 * 4, 2);
    assert!(
        matches!(
            err,
            Error::MisalignedBuffer {
                index: 1,
                align: 4,
                ..
            }
        ),
        "{err}"
    );
    let binary = BinaryArray::from(vec![Some(&b"xy"[..]), None]);
    let err = import_with_misaligned_buffer(&binary, 1, 3 * 4, 1);
    assert!(
        matches!(
            err,
            Error::MisalignedBuffer {
                index: 1,
                align: 4,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn misaligned_view_sizes_are_refused() {
    let long = "a string longer than twelve bytes";
    let views = arrow_array::StringViewArray::from(vec![Some(long), None, Some("short")]);
    // Buffers: validity, views, one data buffer, the variadic sizes (index 3: one i64).
    assert_eq!(views.data_buffers().len(), 1);
    let err = import_with_misaligned_buffer(&views, 3, 8, 4);
    assert!(
        matches!(
            err,
            Error::MisalignedBuffer {
                index: 3,
                align: 8,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn misaligned_values_are_realigned_not_refused() {
    // Buffers arrow-rs copies before reading (fixed-width values) may be unaligned.
    let (exported, schema) = cpu::export_array(&ints()).unwrap();
    let raw = exported.into_raw();
    let mut block = vec![0u64; 8];
    // SAFETY: the values buffer of a 3-item Int32Array holds 12 bytes; the copy lives in
    // `block` (64 bytes) past 1 byte, and outlives the imported array (dropped below).
    unsafe {
        let src = *raw.array.buffers.add(1) as *const u8;
        let dst = block.as_mut_ptr().cast::<u8>().add(1);
        std::ptr::copy_nonoverlapping(src, dst, 12);
        *raw.array.buffers.add(1) = dst as *const std::ffi::c_void;
    }
    // SAFETY: only a buffer pointer was replaced, by one to a copy of the same bytes.
    let device_array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let imported = cpu::import_array(device_array, &schema).unwrap();
    assert_eq!(imported.as_ref(), &ints() as &dyn Array);
    drop(imported);
    drop(block);
}

/// The C `struct ArrowSchema`, to build the foreign schemas arrow-rs would not make.
#[repr(C)]
struct RawSchema {
    format: *const std::ffi::c_char,
    name: *const std::ffi::c_char,
    metadata: *const std::ffi::c_char,
    flags: i64,
    n_children: i64,
    children: *mut *mut RawSchema,
    dictionary: *mut RawSchema,
    release: Option<unsafe extern "C" fn(*mut RawSchema)>,
    private_data: *mut std::ffi::c_void,
}

unsafe extern "C" fn raw_schema_release(schema: *mut RawSchema) {
    // SAFETY: called on a schema made by `foreign_schema`, whose private data is the
    // counter it was given (alive for the whole test).
    unsafe {
        let counter = &*((*schema).private_data as *const std::sync::atomic::AtomicUsize);
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        (*schema).release = None;
    }
}

/// A childless foreign schema with this `format` and `name` (NULL allowed), counting its
/// releases in `count`. The strings must outlive the schema.
fn foreign_schema(
    format: *const std::ffi::c_char,
    name: *const std::ffi::c_char,
    count: &std::sync::atomic::AtomicUsize,
) -> FFI_ArrowSchema {
    let mut raw = RawSchema {
        format,
        name,
        metadata: std::ptr::null(),
        flags: 2,
        n_children: 0,
        children: std::ptr::null_mut(),
        dictionary: std::ptr::null_mut(),
        release: Some(raw_schema_release),
        private_data: count as *const _ as *mut std::ffi::c_void,
    };
    // SAFETY: `RawSchema` is the C struct `ArrowSchema`, as `FFI_ArrowSchema` is; the
    // struct is well-formed (no children, NULL-or-C-string pointers); `from_raw` moves it.
    unsafe { FFI_ArrowSchema::from_raw((&mut raw as *mut RawSchema).cast()) }
}

/// Fuzzing found it (fuzz targets `import_schema`, `stream_import`): arrow-rs panics,
/// rather than failing, on a NULL or non-UTF-8 format string, a non-UTF-8 name, and a
/// list format without its child; that panic went through `cpu::import_*` (and the
/// stream and bridge importers) into the caller. Now an `Error::Schema`.
#[test]
fn schemas_arrow_rs_panics_on_are_schema_errors() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let not_utf8 = c"\xff\xfe";
    let cases: [(*const std::ffi::c_char, *const std::ffi::c_char, &str); 4] = [
        (std::ptr::null(), std::ptr::null(), "NULL format"),
        (not_utf8.as_ptr(), std::ptr::null(), "non-UTF-8 format"),
        (c"+l".as_ptr(), std::ptr::null(), "a list without its child"),
        (c"i".as_ptr(), not_utf8.as_ptr(), "non-UTF-8 name"),
    ];
    for (format, name, what) in cases {
        // `import_array` reads only the type, not the name.
        let importers = if name.is_null() { 0..3 } else { 1..3 };
        for importer in importers {
            let schema_releases = AtomicUsize::new(0);
            let schema = foreign_schema(format, name, &schema_releases);
            let (exported, _) = cpu::export_array(&ints()).unwrap();
            let (exported, count) = count_releases(exported);
            let err = match importer {
                0 => cpu::import_array(exported, &schema).unwrap_err(),
                1 => cpu::import_field_array(exported, &schema).unwrap_err(),
                _ => cpu::import_record_batch(exported, &schema).unwrap_err(),
            };
            // The name is read only for a field (a batch's schema is a struct of fields).
            if importer == 1 || name.is_null() {
                assert!(matches!(err, Error::Schema(_)), "{what}: {err}");
            }
            assert_eq!(releases(&count), 1, "{what}: the array is released once");
            drop(schema);
            assert_eq!(schema_releases.load(Ordering::SeqCst), 1, "{what}");
        }
    }
}

/// Fuzzing found it (fuzz target `import_schema`): a schema may give a dictionary any
/// index format (`"u"` with a dictionary parses as `Dictionary(Utf8, _)` in arrow-rs), and
/// a zero-length array of it made arrow-rs's `ArrayData::new_empty` panic inside
/// `cpu::import_array`, outside its panic guard. Now an `Error::Schema` from the layout
/// checks, before anything is read.
#[test]
fn dictionary_with_string_keys_is_a_schema_error() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let schema_releases = AtomicUsize::new(0);
    let mut values_schema = RawSchema {
        format: c"i".as_ptr(),
        name: std::ptr::null(),
        metadata: std::ptr::null(),
        flags: 2,
        n_children: 0,
        children: std::ptr::null_mut(),
        dictionary: std::ptr::null_mut(),
        release: None,
        private_data: std::ptr::null_mut(),
    };
    let mut raw_schema = RawSchema {
        format: c"u".as_ptr(),
        dictionary: &mut values_schema,
        release: Some(raw_schema_release),
        private_data: &schema_releases as *const _ as *mut std::ffi::c_void,
        ..values_schema
    };
    // SAFETY: `RawSchema` is the C struct; a dictionary-encoded schema whose dictionary
    // lives as long as the test; `from_raw` moves the root.
    let schema = unsafe { FFI_ArrowSchema::from_raw((&mut raw_schema as *mut RawSchema).cast()) };
    // Keys: an empty string array (its three buffers); the dictionary: an empty int32 array.
    let (keys, _) = cpu::export_array(&StringArray::from(Vec::<&str>::new())).unwrap();
    let (keys, count) = count_releases(keys);
    let (values, _) = cpu::export_array(&Int32Array::from(Vec::<i32>::new())).unwrap();
    let mut values = values.into_raw();
    let mut raw = keys.into_raw();
    raw.array.dictionary = &mut values.array;
    // SAFETY: a well-formed array from a DeviceArray with a well-formed dictionary attached
    // (which outlives it: released below, after the import).
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let err = cpu::import_array(array, &schema).unwrap_err();
    assert!(
        matches!(err, Error::Schema(_)) && err.to_string().contains("dictionary keys"),
        "{err}"
    );
    assert_eq!(releases(&count), 1);
    // SAFETY: the dictionary came from a DeviceArray and was not released by its parent
    // (arrow-rs's release frees only what its own export made).
    drop(unsafe { DeviceArray::try_new(values) });
    drop(schema);
    assert_eq!(schema_releases.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------------------
// NULL offsets of zero-length arrays (issue #25, item 3; see devarrow_abi::layout)
// ---------------------------------------------------------------------------------------

/// Exports `data`, lets `corrupt` change the C struct and imports it with
/// `cpu::import_array`; returns the import and the release count of the export.
fn import_changed(
    data: &ArrayData,
    corrupt: impl FnOnce(&mut ArrowDeviceArray),
) -> (Result<ArrayRef, Error>, Arc<std::sync::atomic::AtomicUsize>) {
    let (exported, schema) = cpu::export_array(&arrow_array::make_array(data.clone())).unwrap();
    let (exported, count) = count_releases(exported);
    let mut raw = exported.into_raw();
    corrupt(&mut raw);
    // SAFETY: `raw` came from a DeviceArray; only buffers of zero-length arrays were
    // NULLed (or, for the refusals, buffers the importer must refuse before reading).
    let device_array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let imported = cpu::import_array(device_array, &schema);
    // After an error: released at once. After an import: at most once (an empty array
    // holds none of the producer's buffers, so it may be released at once too).
    if imported.is_err() {
        assert_eq!(releases(&count), 1, "released once after the error");
    } else {
        assert!(releases(&count) <= 1, "released at most once");
    }
    (imported, count)
}

/// A zero-length string, binary, list or map array with a NULL offsets buffer (as
/// nanoarrow's CUDA copy of a 0-row column makes it) passes the layout checks and imports
/// as an empty array, as Arrow C++ imports it.
#[test]
fn zero_length_arrays_with_null_offsets_import_as_empty() {
    for data in empty_offset_arrays() {
        let dt = data.data_type().clone();
        let (array, count) = import_changed(&data, |raw| {
            // SAFETY: the root is arrow-rs's export of a type with offsets.
            unsafe { null_offsets(&mut raw.array) };
            // SAFETY: the struct is well-formed; its buffers are host memory.
            unsafe { devarrow_abi::layout::validate_structure(&raw.array, &dt, "array") }
                .unwrap_or_else(|e| panic!("{dt}: {e}"));
        });
        let array = array.unwrap_or_else(|e| panic!("{dt}: {e}"));
        assert_eq!(array.data_type(), &dt);
        assert_eq!(array.len(), 0);
        array.to_data().validate_full().unwrap();
        drop(array);
        assert_eq!(releases(&count), 1, "{dt}: released once");
    }
}

/// A zero-length array with NULL offsets under rows that reach none of it (the strings of
/// a list whose lists are all empty) imports too.
#[test]
fn a_zero_length_child_with_null_offsets_imports() {
    let lists = ListArray::new(
        Arc::new(arrow_schema::Field::new("item", DataType::Utf8, true)),
        arrow_buffer::OffsetBuffer::new(vec![0, 0, 0].into()),
        Arc::new(StringArray::from(Vec::<&str>::new())),
        None,
    );
    let (array, count) = import_changed(&lists.to_data(), |raw| {
        // SAFETY: the list has one child, arrow-rs's export of a Utf8 array.
        unsafe { null_offsets(&mut **raw.array.children) };
    });
    let array = array.unwrap();
    assert_eq!(array.as_ref(), &lists as &dyn Array);
    drop(array);
    assert_eq!(releases(&count), 1, "released once");
}

/// NULL offsets of an array with rows stay a typed error.
#[test]
fn null_offsets_with_rows_are_refused() {
    let list = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1)])]);
    for (data, bytes) in [(strings().to_data(), 16), (list.to_data(), 8)] {
        let err = import_changed(&data, |raw| {
            // SAFETY: arrow-rs's export of a type with offsets, two buffer slots at least.
            unsafe { *raw.array.buffers.add(1) = std::ptr::null() };
        })
        .0
        .unwrap_err();
        assert!(
            matches!(err, Error::NullBuffer { index: 1, role: "offsets", bytes: b, .. } if b == bytes),
            "{err}"
        );
    }
}

/// A record batch of `column` (field "c", nullable) exported and imported by
/// `cpu::import_record_batch_trusting_utf8`; the struct is released exactly once either
/// way.
fn import_batch_trusting_utf8(column: ArrayRef) -> Result<arrow_array::RecordBatch, Error> {
    let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
        "c",
        column.data_type().clone(),
        true,
    )]));
    let rows = column.len();
    // SAFETY: one column of the field's type and length (the columns below break only the
    // value rules the import is meant to check).
    let batch = unsafe { arrow_array::RecordBatch::new_unchecked(schema, vec![column], rows) };
    let (exported, schema) = cpu::export_record_batch(&batch).unwrap();
    let (exported, count) = count_releases(exported);
    // SAFETY: the strings are only compared as bytes below.
    let result = unsafe { cpu::import_record_batch_trusting_utf8(exported, &schema) };
    if result.is_err() {
        assert_eq!(releases(&count), 1, "released exactly once after an error");
    }
    result
}

/// An array of `data_type` built from `data` without validation, for the import to
/// check.
fn unvalidated(data: arrow_data::ArrayDataBuilder) -> ArrayRef {
    // SAFETY: the arrays below break value rules only (UTF-8, monotonic offsets, keys,
    // view ranges): every buffer is as large as its type's layout needs, so building and
    // exporting them reads nothing out of bounds; only the import under test reads values.
    arrow_array::make_array(unsafe { data.build_unchecked() })
}

#[test]
fn trusting_utf8_skips_only_the_utf8_check() {
    let strings = |offsets: &[i32], bytes: &[u8]| {
        unvalidated(
            ArrayData::builder(DataType::Utf8)
                .len(offsets.len() - 1)
                .add_buffer(Buffer::from_slice_ref(offsets))
                .add_buffer(Buffer::from_slice_ref(bytes)),
        )
    };
    // bytes that are not UTF-8, under a Utf8 field: imported as they are (the full
    // import refuses them, `invalid_utf8_is_caught_by_full_validation`)
    let batch = import_batch_trusting_utf8(strings(&[0, 2, 3], &[0xff, 0xfe, b'a'])).unwrap();
    let bytes = batch.column(0).to_data();
    assert_eq!(bytes.buffers()[1].as_slice(), &[0xff, 0xfe, b'a']);
    assert_eq!(batch.num_rows(), 2);

    // the same import still refuses what reads outside the buffers: decreasing offsets,
    // a negative first offset (the layout checks; arrow-rs does not walk them again)
    let err = import_batch_trusting_utf8(strings(&[0, 4, 2, 5], b"abcde")).unwrap_err();
    assert!(err.to_string().contains("offsets decrease"), "{err}");
    let err = import_batch_trusting_utf8(strings(&[-1, 2, 3], b"abc")).unwrap_err();
    assert!(matches!(err, Error::InvalidOffsets { .. }), "{err}");
    // a list whose last offset is past its child
    let item = Arc::new(arrow_schema::Field::new("item", DataType::Int32, true));
    let list = unvalidated(
        ArrayData::builder(DataType::List(item))
            .len(2)
            .add_buffer(Buffer::from_slice_ref([0i32, 2, 9]))
            .child_data(vec![Int32Array::from(vec![1, 2, 3]).into_data()]),
    );
    let err = import_batch_trusting_utf8(list).unwrap_err();
    assert!(
        matches!(err, Error::InvalidOffsets { .. }) && err.to_string().contains("past the end"),
        "{err}"
    );

    // a dictionary key past its values
    let values = StringArray::from(vec!["a", "b"]).into_data();
    let dict = unvalidated(
        ArrayData::builder(DataType::Dictionary(
            Box::new(DataType::Int32),
            Box::new(DataType::Utf8),
        ))
        .len(3)
        .add_buffer(Buffer::from_slice_ref([0i32, 7, 1]))
        .child_data(vec![values]),
    );
    let err = import_batch_trusting_utf8(dict).unwrap_err();
    assert!(matches!(err, Error::Arrow(_)), "{err}");

    // a string view whose bytes lie past its buffer (checked as a binary view's)
    let long = b"a string longer than twelve";
    let mut view = [0u8; 16];
    view[..4].copy_from_slice(&(long.len() as u32).to_le_bytes());
    view[4..8].copy_from_slice(&long[..4]);
    view[12..].copy_from_slice(&(1u32 << 20).to_le_bytes()); // offset far past the buffer
    let views = unvalidated(
        ArrayData::builder(DataType::Utf8View)
            .len(1)
            .add_buffer(Buffer::from_slice_ref(view))
            .add_buffer(Buffer::from_slice_ref(long)),
    );
    let err = import_batch_trusting_utf8(views).unwrap_err();
    assert!(matches!(err, Error::Arrow(_)), "{err}");
}
