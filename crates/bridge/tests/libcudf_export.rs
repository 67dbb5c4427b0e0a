//! `ExportOptions::for_libcudf` on the CPU device (the same conversion code runs on CUDA:
//! `gpu_bridge` runs the round trips of `common::libcudf` there): conversions of every
//! kind, slices and foreign offsets, exact null counts, a batch that needs nothing
//! exported untouched, refusals that name the column, releases exactly once, no leak.

mod common;

use std::sync::Arc;
use std::time::Duration;

use arrow_array::builder::StringViewBuilder;
use arrow_array::types::UInt8Type;
use arrow_array::{
    Array, ArrayRef, DictionaryArray, Int32Array, Int64Array, ListArray, ListViewArray,
    RecordBatch, StringArray, StructArray,
};
use arrow_buffer::ScalarBuffer;
use arrow_schema::{DataType, Field, Fields};
use common::libcudf::{check_round_trip, input, null_counts, round_trips, rows};
use common::{count_releases, releases};
use devarrow_abi::device::{CopyCounter, CpuDevice, Device, LinkModel};
use devarrow_abi::ffi::ArrowArray;
use devarrow_abi::{cpu, DeviceArray, Error};
use devarrow_bridge::{DeviceBatch, ExportOptions, Transfer, TransferOptions};

fn devices() -> Vec<(&'static str, Arc<dyn Device>)> {
    vec![
        ("staged", Arc::new(CpuDevice::new())),
        ("direct", Arc::new(CpuDevice::direct())),
        (
            "link",
            Arc::new(CpuDevice::with_link(LinkModel::new(
                20e9,
                Duration::from_micros(2),
            ))),
        ),
    ]
}

#[test]
fn every_conversion_round_trips_on_each_cpu_device_mode() {
    // under Miri (interpreted) the staged mode only: the others run the same kernels
    let modes = if cfg!(miri) { 1 } else { 3 };
    for (name, device) in devices().into_iter().take(modes) {
        eprintln!("{name}");
        round_trips(&device);
    }
}

/// The conversions wait once per level of nesting, not once per column.
#[test]
fn the_conversions_wait_once_per_level_of_nesting() {
    common::libcudf::check_waits_per_level(Arc::new(CpuDevice::new()));
}

/// A foreign array keeps the offsets arrow-rs's slices give its columns (and their
/// children): the conversions read from those offsets.
#[test]
fn foreign_columns_with_offsets_convert() {
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let n = common::libcudf::ROWS;
    let batch = input(n);
    for (offset, len) in [(0, n), (13, n - 20), (n - 1, 1), (n / 2, 0)] {
        let expected = batch.slice(offset, len);
        let (array, schema) = cpu::export_record_batch(&expected).unwrap();
        let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
        check_round_trip(&device, &imported, &expected);
    }
}

/// Imports `batch` with its root struct at `offset` (its columns whole), as a producer
/// that slices the root does.
fn import_with_root_offset(
    device: &Arc<dyn Device>,
    batch: &RecordBatch,
    offset: usize,
) -> DeviceBatch {
    let (array, schema) = cpu::export_record_batch(batch).unwrap();
    let mut raw = array.into_raw();
    raw.array.offset = offset as i64;
    raw.array.length = (batch.num_rows() - offset) as i64;
    // SAFETY: `raw` came from a DeviceArray; `offset + length` stays the batch's rows.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap()
}

/// libcudf ignores a root offset and reads a null count of -1 as "no nulls": the root
/// offset moves into the columns, whose null counts are then counted on the device.
#[test]
fn a_root_offset_moves_into_the_columns_with_exact_null_counts() {
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let batch = RecordBatch::try_from_iter([
        (
            "a",
            Arc::new(Int64Array::from_iter(
                (0..100).map(|v| (v % 3 != 0).then_some(v)),
            )) as ArrayRef,
        ),
        (
            "b",
            Arc::new(StringArray::from_iter(
                (0..100).map(|v| (v % 4 != 1).then(|| format!("v{v}"))),
            )) as ArrayRef,
        ),
        (
            "c",
            Arc::new(Int32Array::from_iter_values(0..100)) as ArrayRef,
        ),
    ])
    .unwrap();
    let imported = import_with_root_offset(&device, &batch, 5);
    let (plain, _) = imported
        .export_with(ExportOptions::default().normalize_root_offset(true))
        .unwrap();
    assert!(
        null_counts(plain.array()).contains(&-1),
        "the plain normalization leaves counts unknown"
    );
    drop(plain);

    let (array, schema) = imported.export_with(ExportOptions::for_libcudf()).unwrap();
    assert_eq!(array.array().offset, 0);
    let expected = batch.slice(5, 95);
    let counts = null_counts(array.array());
    let want: Vec<i64> = std::iter::once(0)
        .chain(expected.columns().iter().map(|c| c.null_count() as i64))
        .collect();
    assert_eq!(counts, want);
    let back = cpu::import_record_batch(array, &schema).unwrap();
    assert_eq!(back, expected);
}

/// What a batch that needs no conversion costs: nothing. The export is the plain one,
/// buffer for buffer, with the batch's own event, and no copy or allocation.
#[test]
fn a_batch_that_needs_nothing_is_exported_untouched() {
    let device = Arc::new(CpuDevice::new());
    let dyn_device: Arc<dyn Device> = device.clone();
    let list = ListArray::from_iter_primitive::<arrow_array::types::Int32Type, _, _>(
        (0..50).map(|i| (i % 5 != 0).then(|| vec![Some(i), None, Some(i + 1)])),
    );
    let batch = RecordBatch::try_from_iter([
        (
            "a",
            Arc::new(Int64Array::from_iter(
                (0..50).map(|v| (v % 3 != 0).then_some(v)),
            )) as ArrayRef,
        ),
        (
            "b",
            Arc::new(StringArray::from_iter_values(
                (0..50).map(|v| format!("v{v}")),
            )) as ArrayRef,
        ),
        ("c", Arc::new(list) as ArrayRef),
    ])
    .unwrap();
    let mut transfer = Transfer::new(dyn_device, TransferOptions::default());
    let on_device = transfer.to_device(&batch).unwrap();
    let copies = device.copy_count();
    let in_use = device.memory_pool_stats().in_use_bytes;
    let (plain, _) = on_device.export().unwrap();
    let (converted, schema) = on_device.export_with(ExportOptions::for_libcudf()).unwrap();
    assert_eq!(device.copy_count(), copies, "no copy, no readback");
    assert_eq!(
        device.memory_pool_stats().in_use_bytes,
        in_use,
        "no allocation"
    );
    assert_eq!(plain.sync_event(), converted.sync_event());
    fn buffers(a: &ArrowArray) -> Vec<usize> {
        // SAFETY: an exported array has `n_buffers` buffer pointers and `n_children`
        // children.
        let mut out: Vec<usize> = (0..a.n_buffers as usize)
            .map(|i| unsafe { *a.buffers.add(i) } as usize)
            .collect();
        for i in 0..a.n_children as usize {
            // SAFETY: as above.
            out.extend(buffers(unsafe { &**a.children.add(i) }));
        }
        out
    }
    assert_eq!(buffers(plain.array()), buffers(converted.array()));
    assert_eq!(cpu::import_record_batch(converted, &schema).unwrap(), batch);
}

fn half_floats() -> ArrayRef {
    let data = arrow_data::ArrayData::builder(DataType::Float16)
        .len(2)
        // from u16s: aligned for half floats (Miri's allocator does not 2-align bytes)
        .add_buffer(arrow_buffer::Buffer::from_vec(vec![0u16; 2]))
        .build()
        .unwrap();
    arrow_array::make_array(data)
}

fn not_convertible(result: Result<impl Sized, Error>) -> (String, String) {
    match result {
        Err(Error::NotConvertible { path, reason, .. }) => (path, reason),
        Err(other) => panic!("expected NotConvertible, got {other}"),
        Ok(_) => panic!("expected NotConvertible, got an export"),
    }
}

/// What libcudf would refuse is refused at the export, naming the column; and an export
/// that fails releases nothing twice and leaks nothing.
#[test]
fn what_libcudf_refuses_is_a_typed_error_naming_the_column() {
    let device = Arc::new(CpuDevice::new());
    let dyn_device: Arc<dyn Device> = device.clone();
    let mut transfer = Transfer::new(dyn_device.clone(), TransferOptions::default());
    let half = RecordBatch::try_from_iter([
        ("ok", Arc::new(Int32Array::from(vec![1, 2])) as ArrayRef),
        ("half", half_floats()),
    ])
    .unwrap();
    let (path, reason) = not_convertible(
        transfer
            .to_device(&half)
            .unwrap()
            .export_with(ExportOptions::for_libcudf()),
    );
    assert_eq!(path, "half");
    assert!(reason.contains("Float32"), "{reason}");

    // nested: a struct's binary child, after its view was converted
    let mut views = arrow_array::builder::BinaryViewBuilder::new();
    views.append_value(b"bytes");
    let st = StructArray::new(
        Fields::from(vec![Field::new("raw", DataType::BinaryView, true)]),
        vec![Arc::new(views.finish()) as ArrayRef],
        None,
    );
    let nested = RecordBatch::try_from_iter([("s", Arc::new(st) as ArrayRef)]).unwrap();
    let in_use = device.memory_pool_stats().in_use_bytes;
    let on_device = transfer.to_device(&nested).unwrap();
    let (path, reason) = not_convertible(on_device.export_with(ExportOptions::for_libcudf()));
    assert_eq!(path, "s.raw");
    assert!(reason.contains("binary"), "{reason}");
    drop(on_device);
    assert_eq!(
        device.memory_pool_stats().in_use_bytes,
        in_use,
        "a failed export leaks nothing"
    );

    // several columns refused: the first one's error, though a later column's comes in
    // an earlier round of the walk (its type is refused at once, the first column's
    // child only once its offsets were read back)
    views.append_value(b"more bytes");
    let list_of_views = arrow_array::LargeListArray::new(
        Arc::new(Field::new("item", DataType::BinaryView, true)),
        arrow_buffer::OffsetBuffer::from_lengths([1]),
        Arc::new(views.finish()),
        None,
    );
    let two = RecordBatch::try_from_iter([
        ("first", Arc::new(list_of_views) as ArrayRef),
        ("second", half_floats().slice(0, 1)),
    ])
    .unwrap();
    let (path, _) = not_convertible(
        transfer
            .to_device(&two)
            .unwrap()
            .export_with(ExportOptions::for_libcudf()),
    );
    assert_eq!(path, "first.item", "the first column's error");

    // unsigned dictionary indices over too many values for the signed type
    let dict = DictionaryArray::<UInt8Type>::new(
        vec![0u8, 200].into(),
        Arc::new(Int32Array::from_iter_values(0..201)),
    );
    let batch = RecordBatch::try_from_iter([("d", Arc::new(dict) as ArrayRef)]).unwrap();
    let (path, _) = not_convertible(
        transfer
            .to_device(&batch)
            .unwrap()
            .export_with(ExportOptions::for_libcudf()),
    );
    assert_eq!(path, "d");

    // list views out of order over a child that cannot be gathered (lists)
    let child: ArrayRef = Arc::new(ListArray::from_iter_primitive::<
        arrow_array::types::Int32Type,
        _,
        _,
    >([
        Some(vec![Some(1)]),
        Some(vec![]),
        Some(vec![Some(2), Some(3)]),
    ]));
    let lv = ListViewArray::new(
        Arc::new(Field::new("item", child.data_type().clone(), true)),
        ScalarBuffer::from(vec![2, 0]),
        ScalarBuffer::from(vec![1, 2]),
        child,
        None,
    );
    let batch = RecordBatch::try_from_iter([("lv", Arc::new(lv) as ArrayRef)]).unwrap();
    let (path, reason) = not_convertible(
        transfer
            .to_device(&batch)
            .unwrap()
            .export_with(ExportOptions::for_libcudf()),
    );
    assert_eq!(path, "lv.item");
    assert!(reason.contains("not in order"), "{reason}");

    // (a root with nulls of its own, which libcudf would drop, never gets here: the
    // import already refuses it, as a record batch has no row validity)
}

/// The export of a converted foreign batch keeps the foreign array alive until the
/// consumer's release, and releases it exactly once.
#[test]
fn a_converted_foreign_batch_is_released_once() {
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let batch = input(common::libcudf::ROWS / 2);
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let (array, count) = count_releases(array);
    let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
    let (export, schema) = imported.export_with(common::libcudf::options()).unwrap();
    drop(imported);
    assert_eq!(releases(&count), 0, "the export keeps it");
    let back = DeviceBatch::import_with_ffi_schema(device.clone(), export, &schema).unwrap();
    let host = Transfer::new(device, TransferOptions::default())
        .to_host(&back)
        .unwrap();
    assert_eq!(
        rows(host.column(0).as_ref()),
        rows(batch.column(0).as_ref())
    );
    drop(back);
    assert_eq!(releases(&count), 1);
}

/// Strings that reference more bytes than their data buffers hold (views repeating one
/// long value) convert to as many bytes as the rows hold, in `Utf8` while they fit.
#[test]
fn repeated_views_are_gathered_once_per_row() {
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let mut b = StringViewBuilder::new();
    let long = "x".repeat(1000);
    let handle = b.append_block(arrow_buffer::Buffer::from(long.as_bytes()));
    let rows = if cfg!(miri) { 20 } else { 500 };
    for _ in 0..rows {
        b.try_append_view(handle, 0, 1000).unwrap();
    }
    let batch = RecordBatch::try_from_iter([("s", Arc::new(b.finish()) as ArrayRef)]).unwrap();
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let on_device = transfer.to_device(&batch).unwrap();
    let (array, schema) = on_device.export_with(ExportOptions::for_libcudf()).unwrap();
    let back = DeviceBatch::import_with_ffi_schema(device, array, &schema).unwrap();
    let host = transfer.to_host(&back).unwrap();
    let strings = host
        .column(0)
        .as_any()
        .downcast_ref::<StringArray>()
        .unwrap();
    assert_eq!(strings.value_data().len(), rows * 1000);
    assert!(strings.iter().all(|s| s == Some(long.as_str())));
}

/// Strings whose rows reference 2^31 bytes or more become `LargeUtf8` (libcudf's large
/// strings): 500 rows of one 4.3 MB value, 2.15 GB once gathered. Checked on the
/// exported buffers directly (CPU memory), without a download.
#[test]
#[cfg_attr(miri, ignore = "2 GB of copies, interpreted")]
fn strings_past_two_gigabytes_become_large_utf8() {
    let device: Arc<dyn Device> = Arc::new(CpuDevice::direct());
    let mut b = StringViewBuilder::new();
    let len = 4_300_000u32;
    let long: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
    let handle = b.append_block(arrow_buffer::Buffer::from(long.clone()));
    let rows = 500usize;
    for _ in 0..rows {
        b.try_append_view(handle, 0, len).unwrap();
    }
    let batch = RecordBatch::try_from_iter([("s", Arc::new(b.finish()) as ArrayRef)]).unwrap();
    let mut transfer = Transfer::new(device, TransferOptions::default());
    let on_device = transfer.to_device(&batch).unwrap();
    let (array, schema) = on_device.export_with(ExportOptions::for_libcudf()).unwrap();
    assert_eq!(schema.child(0).format(), "U", "large utf8");
    // SAFETY: the export's one column, on the direct CPU device (host memory): 3
    // buffers, offsets of rows + 1 int64s, data of the last offset's bytes.
    unsafe {
        let column = &**array.array().children.add(0);
        assert_eq!(column.n_buffers, 3);
        let offsets = std::slice::from_raw_parts((*column.buffers.add(1)).cast::<i64>(), rows + 1);
        assert_eq!(offsets[rows], rows as i64 * len as i64);
        assert!(offsets.windows(2).all(|w| w[1] - w[0] == len as i64));
        let data = (*column.buffers.add(2)).cast::<u8>();
        for row in [0, 1, rows / 2, rows - 1] {
            let value = std::slice::from_raw_parts(data.add(offsets[row] as usize), len as usize);
            assert!(value == long.as_slice(), "row {row}");
        }
    }
}
