//! Importing foreign arrays as device batches on the CPU device: zero-copy, the sizes
//! that live on the device read back in one copy, and the foreign release run exactly
//! once, when the last user is gone.

// Not under Miri: every test moves the every-type batch (60 columns) through a Transfer,
// often once per offset or slice: more than 10 minutes per test under Miri. The same
// unsafe paths (foreign import, read-back, pack, download) run under Miri in
// bridge_bad_input.rs and c_boundary.rs, and natively under AddressSanitizer in the
// import_array fuzz target.
#![cfg(not(miri))]

mod common;

use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::{
    Array, ArrayRef, Int32Array, Int64Array, ListArray, RecordBatch, StringArray, StructArray,
};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::{DataType, Field};
use common::{count_releases, max_read_backs, releases, InstrumentedDevice};
use devarrow_abi::cpu;
use devarrow_abi::device::{CopyCounter, CpuDevice, Device};
use devarrow_abi::{slice_data, ArrowDeviceType, Error};
use devarrow_bridge::{ColumnBuffer, DeviceBatch, DeviceColumn, Transfer, TransferOptions};
use devarrow_testing::sample;

fn cpu() -> Arc<dyn Device> {
    Arc::new(CpuDevice::new())
}

/// Exports `data` (a struct array, sliced or not) as a CPU device array, imports it with
/// `schema`, moves it to the host and checks it equals `expected`; the foreign release
/// runs once, when the batch is dropped.
fn import_round_trip(data: &arrow_data::ArrayData, expected: &RecordBatch) {
    let device = InstrumentedDevice::new();
    let (array, count) = count_releases(cpu::export_array_data(data));
    let batch = DeviceBatch::import(device.clone(), array, expected.schema()).unwrap();
    assert!(batch.is_imported());
    assert_eq!(batch.num_rows(), expected.num_rows());
    assert!(
        device.host_copies() <= max_read_backs(&expected.schema())
            && device.on_device_copies() == device.host_copies(),
        "one gather and one read-back per level at most ({} on the device, {} to the host)",
        device.on_device_copies(),
        device.host_copies()
    );
    let (before_on, before_host) = (device.on_device_copies(), device.host_copies());
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let back = transfer.to_host(&batch).unwrap();
    assert_eq!(device.on_device_copies() - before_on, 1, "one packing copy");
    assert!(device.host_copies() - before_host <= 1, "one download");
    for column in back.columns() {
        column.to_data().validate_full().unwrap();
    }
    if let Some(diff) = sample::describe_difference(expected, &back) {
        panic!("{diff}");
    }
    assert_eq!(releases(&count), 0, "the batch keeps the foreign array");
    drop(batch);
    assert_eq!(releases(&count), 1);
}

#[test]
fn every_type_imports_zero_copy_and_comes_back() {
    let batch = sample::every_type_batch();
    let data = StructArray::from(batch.clone()).into_data();
    import_round_trip(&data, &batch);
}

#[test]
fn every_slice_of_every_type_imports_with_its_offsets() {
    let batch = sample::every_type_batch();
    let whole = StructArray::from(batch.clone()).into_data();
    let n = batch.num_rows();
    for offset in 0..=n {
        for len in 0..=n - offset {
            // An ArrayData slice keeps nonzero offsets in the children across the C
            // interface (a RecordBatch slice does too, in each column).
            import_round_trip(&slice_data(&whole, offset, len), &batch.slice(offset, len));
            let sliced = StructArray::from(batch.slice(offset, len)).into_data();
            import_round_trip(&sliced, &batch.slice(offset, len));
        }
    }
}

#[test]
fn the_sizes_on_the_device_are_read_back_in_one_copy() {
    let batch = sample::every_type_batch();
    let device = InstrumentedDevice::new();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
    assert_eq!(device.on_device_copies(), 1, "one gather on the device");
    assert_eq!(device.host_copies(), 1, "one device-to-host copy");
    assert_eq!(device.copy_count(), 1);
    assert_eq!(imported.schema(), batch.schema());

    // Fixed-width columns need nothing from the device.
    let ints = RecordBatch::try_from_iter([(
        "i",
        Arc::new(Int64Array::from(vec![Some(1), None, Some(3)])) as ArrayRef,
    )])
    .unwrap();
    let device = InstrumentedDevice::new();
    let (array, schema) = cpu::export_record_batch(&ints).unwrap();
    let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
    assert_eq!((device.on_device_copies(), device.host_copies()), (0, 0));
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    assert_eq!(transfer.to_host(&imported).unwrap(), ints);
}

#[test]
fn clones_and_exports_keep_the_foreign_array_until_the_last_is_dropped() {
    let batch = sample::every_type_batch().slice(1, 4);
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let (array, count) = count_releases(array);
    let imported = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
    let clone = imported.clone();
    let (exported, exported_schema) = imported.export().unwrap();
    drop(imported);
    drop(clone);
    assert_eq!(releases(&count), 0, "the export holds the foreign array");
    // The re-export is the foreign array itself (same buffers, same offsets).
    let back = cpu::import_record_batch(exported, &exported_schema).unwrap();
    assert_eq!(back, batch);
    assert_eq!(releases(&count), 0, "arrow-rs still holds the buffers");
    drop(back);
    assert_eq!(releases(&count), 1);
}

#[test]
fn a_transferred_batch_exports_and_imports_again() {
    let batch = sample::every_type_batch();
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    for b in sample::sample_batches() {
        let on_device = transfer.to_device(&b).unwrap();
        let (array, schema) = on_device.export().unwrap();
        drop(on_device);
        let imported = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
        assert_eq!(imported.num_rows(), b.num_rows());
        assert_eq!(transfer.to_host(&imported).unwrap(), b);
        // And round again: imported -> export -> import.
        let (array, schema) = imported.export().unwrap();
        let again = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
        drop(imported);
        assert_eq!(transfer.to_host(&again).unwrap(), b);
    }
    assert_eq!(
        batch.num_columns(),
        sample::every_type_schema().fields().len()
    );
}

#[test]
fn nested_children_with_their_own_offsets() {
    // list<int32> over a child sliced at 3, itself sliced: offsets at every level.
    let values = Int32Array::from_iter((0..40).map(|i| (i % 5 != 0).then_some(i)));
    let child = values.slice(3, 30);
    let list = ListArray::new(
        Arc::new(Field::new("item", DataType::Int32, true)),
        OffsetBuffer::new(ScalarBuffer::from(vec![2, 5, 5, 11, 20, 29])),
        Arc::new(child),
        Some(vec![true, false, true, true, true].into()),
    );
    let strings = StringArray::from_iter((0..40).map(|i| (i % 3 != 0).then(|| "x".repeat(i))));
    let batch = RecordBatch::try_from_iter([
        ("list", Arc::new(list) as ArrayRef),
        ("s", Arc::new(strings.slice(7, 5)) as ArrayRef),
    ])
    .unwrap();
    for (o, l) in [(0, 5), (1, 3), (4, 1), (5, 0)] {
        let data = slice_data(&StructArray::from(batch.clone()).into_data(), o, l);
        import_round_trip(&data, &batch.slice(o, l));
    }
    let lists = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![
        Some(vec![Some(1)]),
        None,
        Some(vec![]),
    ]);
    let batch = RecordBatch::try_from_iter([("l", Arc::new(lists) as ArrayRef)]).unwrap();
    import_round_trip(&StructArray::from(batch.clone()).into_data(), &batch);
}

#[test]
fn a_root_struct_with_an_offset_imports_its_rows() {
    let batch = sample::every_type_batch();
    let n = batch.num_rows();
    for offset in 0..=n {
        let (array, schema) = cpu::export_record_batch(&batch).unwrap();
        let (array, count) = count_releases(array);
        let mut raw = array.into_raw();
        // The C interface lets the root struct carry the slice itself.
        raw.array.offset = offset as i64;
        raw.array.length = (n - offset) as i64;
        // SAFETY: `raw` came from a DeviceArray; `offset + length` stays `n`, so every
        // buffer still covers the rows the struct addresses.
        let array = unsafe { devarrow_abi::DeviceArray::try_new(raw) }.unwrap();
        let imported = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
        let mut transfer = Transfer::new(cpu(), TransferOptions::default());
        let back = transfer.to_host(&imported).unwrap();
        let expected = batch.slice(offset, n - offset);
        if let Some(diff) = sample::describe_difference(&expected, &back) {
            panic!("offset {offset}: {diff}");
        }
        // The re-export keeps the root's offset.
        let (exported, schema) = imported.export().unwrap();
        assert_eq!(exported.array().offset, offset as i64);
        assert_eq!(
            cpu::import_record_batch(exported, &schema).unwrap(),
            expected
        );
        drop(imported);
        assert_eq!(releases(&count), 1);
    }
}

#[test]
fn an_imported_slice_moves_only_its_bytes() {
    let rows = 100_000;
    let strings: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|i| format!("value-{i}")),
    ));
    let ints: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..rows as i64).map(|i| (i % 3 != 0).then_some(i)),
    ));
    let batch = RecordBatch::try_from_iter([("s", strings), ("i", ints)]).unwrap();
    let moved = |b: &RecordBatch| {
        let device = InstrumentedDevice::new();
        let (array, schema) = cpu::export_record_batch(b).unwrap();
        let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
        let gathered = device.on_device_bytes();
        let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
        assert_eq!(&transfer.to_host(&imported).unwrap(), b);
        (device.on_device_bytes() - gathered, imported.device_bytes())
    };
    let (whole, whole_bytes) = moved(&batch);
    let (part, part_bytes) = moved(&batch.slice(rows / 2 + 3, 1000));
    assert!(
        (part as f64) < 0.0125 * whole as f64,
        "a 1% slice packed {part} bytes of {whole}"
    );
    assert!((part_bytes as f64) < 0.0125 * whole_bytes as f64);
}

#[test]
fn imported_batches_move_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<DeviceBatch>();
    let batch = sample::every_type_batch();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    let (array, count) = count_releases(array);
    let imported = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
    let clone = imported.clone();
    let back = std::thread::spawn(move || {
        let mut transfer = Transfer::new(cpu(), TransferOptions::default());
        transfer.to_host(&clone).unwrap()
    })
    .join()
    .unwrap();
    assert_eq!(back, batch);
    std::thread::spawn(move || drop(imported)).join().unwrap();
    assert_eq!(releases(&count), 1);
}

fn ints_and_strings() -> RecordBatch {
    RecordBatch::try_from_iter([
        (
            "i",
            Arc::new(Int64Array::from(vec![Some(1), None, Some(3)])) as ArrayRef,
        ),
        (
            "s",
            Arc::new(StringArray::from(vec![Some("ab"), None, Some("cde")])) as ArrayRef,
        ),
    ])
    .unwrap()
}

/// A device posing as ROCm device `id` (its memory is the CPU's).
fn rocm(id: i64) -> Arc<InstrumentedDevice> {
    Arc::new(InstrumentedDevice::default().posing_as(ArrowDeviceType::ROCM, id))
}

#[test]
fn a_transfer_refuses_a_batch_on_another_device() {
    let batch = ints_and_strings();
    let check = |on_device: &DeviceBatch| {
        // Another device type: its memory is not the CPU's to copy.
        let mut on_cpu = Transfer::new(cpu(), TransferOptions::default());
        let err = on_cpu.to_host(on_device).unwrap_err();
        assert!(
            matches!(err, Error::UnsupportedDevice { found, .. } if found == ArrowDeviceType::ROCM),
            "{err}"
        );
        // Another device of the same type.
        let other = rocm(0);
        let err = Transfer::new(other.clone(), TransferOptions::default())
            .to_host(on_device)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::DeviceMismatch {
                    expected: 0,
                    found: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            (other.on_device_copies(), other.host_copies()),
            (0, 0),
            "nothing was copied"
        );
        // So is a list with one batch of another device: nothing is copied.
        let other = rocm(0);
        let mut on_other = Transfer::new(other.clone(), TransferOptions::default());
        let here = on_other.to_device(&batch).unwrap();
        let copies = (other.on_device_copies(), other.host_copies());
        let err = on_other
            .to_host_batches(&[here.clone(), on_device.clone()])
            .unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
        assert_eq!((other.on_device_copies(), other.host_copies()), copies);
        assert_eq!(
            on_other.to_host_batches(&[here]).unwrap(),
            std::slice::from_ref(&batch)
        );
        // Another handle on the same device is fine.
        let mut same = Transfer::new(rocm(1), TransferOptions::default());
        assert_eq!(same.to_host(on_device).unwrap(), batch);
        let both = same
            .to_host_batches(&[on_device.clone(), on_device.clone()])
            .unwrap();
        assert_eq!(both, [batch.clone(), batch.clone()]);
    };
    // Packed by a transfer.
    let on_rocm = Transfer::new(rocm(1), TransferOptions::default())
        .to_device(&batch)
        .unwrap();
    check(&on_rocm);
    // Imported: the export of that batch (a ROCm device 1 array).
    let (array, _schema) = on_rocm.export().unwrap();
    drop(on_rocm);
    let (array, count) = count_releases(array);
    let imported = DeviceBatch::import(rocm(1), array, batch.schema()).unwrap();
    assert!(imported.is_imported());
    check(&imported);
    drop(imported);
    assert_eq!(releases(&count), 1);
}

#[test]
fn the_release_waits_for_the_last_pack_even_after_a_failed_wait() {
    let batch = ints_and_strings();
    let home = InstrumentedDevice::new();
    let (array, count) = count_releases(cpu::export_record_batch(&batch).unwrap().0);
    let imported = DeviceBatch::import(home.clone(), array, batch.schema()).unwrap();
    // Another handle on the same device (another stream, on a GPU) packs the download.
    let copier = InstrumentedDevice::new();
    let mut transfer = Transfer::new(copier.clone(), TransferOptions::default());
    assert_eq!(transfer.to_host(&imported).unwrap(), batch);
    // The next download cannot wait for the last pack's event: an error...
    copier.fail_waits(true);
    let err = transfer.to_host(&imported).unwrap_err();
    assert!(matches!(err, Error::Device { .. }), "{err}");
    drop(transfer);
    // ... after which the release still makes sure that pack is done, on its device.
    let (home_syncs, copier_syncs) = (home.synchronizations(), copier.synchronizations());
    drop(imported);
    assert_eq!(releases(&count), 1);
    assert_eq!(
        copier.synchronizations(),
        copier_syncs + 1,
        "the packing device is synchronized when its event fails"
    );
    assert_eq!(home.synchronizations(), home_syncs);
}

// ---- Device columns: typed access to the buffers of a device batch ----

/// Checks `column` against the C struct `node` that `DeviceBatch::export` makes of it: the
/// same buffers (addresses, NULLs), offset, length, null count, children and dictionary.
/// `root`: the root struct's `(offset, length)` when `column` is a top-level column,
/// which takes the root's offset on.
fn assert_column_is_the_export(
    column: &DeviceColumn<'_>,
    node: &devarrow_abi::ArrowArray,
    root: Option<(usize, usize)>,
    path: &str,
) {
    let (extra, rows) = root.unwrap_or((0, node.length as usize));
    assert_eq!(
        column.offset(),
        node.offset as usize + extra,
        "{path}: offset"
    );
    assert_eq!(column.len(), rows, "{path}: length");
    let whole = extra == 0 && rows == node.length as usize;
    let expected_nulls = match node.null_count {
        0 => Some(0),
        n if whole && n > 0 => Some(n as usize),
        _ => None,
    };
    assert_eq!(column.null_count(), expected_nulls, "{path}: null count");
    assert_eq!(
        column.n_buffers(),
        node.n_buffers as usize,
        "{path}: n_buffers"
    );
    assert_eq!(column.buffers().len(), column.n_buffers());
    for i in 0..column.n_buffers() {
        // SAFETY: the node belongs to an unreleased export the caller holds.
        let expected = unsafe { node.buffer(i) };
        match column.buffer(i) {
            None => assert!(expected.is_null(), "{path}: buffer {i} is not NULL"),
            Some(b) => {
                assert_eq!(b.as_ptr(), expected, "{path}: buffer {i}");
                assert_eq!(b.address(), expected as u64);
                assert_eq!(b.index(), i);
                assert_eq!(b.device_type(), column.device_type());
            }
        }
    }
    assert!(column.buffer(column.n_buffers()).is_none());
    assert_eq!(column.num_children(), node.n_children as usize, "{path}");
    for (i, child) in column.children().iter().enumerate() {
        // SAFETY: as above.
        let expected = unsafe { node.child(i) }.unwrap();
        assert_column_is_the_export(child, expected, None, &format!("{path}.children[{i}]"));
    }
    // SAFETY: as above.
    match (column.dictionary(), unsafe { node.dictionary() }) {
        (Some(dict), Some(expected)) => {
            assert_column_is_the_export(&dict, expected, None, &format!("{path}.dictionary"))
        }
        (None, None) => {}
        (found, expected) => panic!(
            "{path}: dictionary {} but exported {}",
            found.is_some(),
            expected.is_some()
        ),
    }
}

/// Checks every column of `batch` against its export.
fn assert_columns_are_the_export(batch: &DeviceBatch) {
    let (exported, _schema) = batch.export().unwrap();
    let root = exported.array();
    assert_eq!(batch.num_columns(), root.n_children as usize);
    assert_eq!(batch.columns().len(), batch.num_columns());
    for (i, field) in batch.schema().fields().iter().enumerate() {
        let column = batch.column(i).unwrap();
        assert_eq!(column.data_type(), field.data_type());
        assert_eq!(
            batch.column_by_name(field.name()).unwrap().data_type(),
            field.data_type()
        );
        // SAFETY: the export is unreleased and well-formed.
        let node = unsafe { root.child(i) }.unwrap();
        assert_column_is_the_export(
            &column,
            node,
            Some((root.offset as usize, root.length as usize)),
            field.name(),
        );
    }
    assert!(batch.column(batch.num_columns()).is_none());
    assert!(batch.column_by_name("no such column").is_none());
}

/// Every buffer of `column` and its descendants, with its path.
fn all_buffers<'a>(
    column: &DeviceColumn<'a>,
    path: String,
    out: &mut Vec<(String, ColumnBuffer<'a>)>,
) {
    for b in column.buffers().into_iter().flatten() {
        out.push((format!("{path}.buffers[{}]", b.index()), b));
    }
    for (i, child) in column.children().iter().enumerate() {
        all_buffers(child, format!("{path}.children[{i}]"), out);
    }
    if let Some(dict) = column.dictionary() {
        all_buffers(&dict, format!("{path}.dictionary"), out);
    }
}

/// The host memory ranges of every buffer of `data` and its descendants.
fn arrow_ranges(data: &arrow_data::ArrayData, out: &mut Vec<(usize, usize)>) {
    let mut add = |b: &arrow_buffer::Buffer| {
        if !b.is_empty() {
            out.push((b.as_ptr() as usize, b.as_ptr() as usize + b.len()));
        }
    };
    data.buffers().iter().for_each(&mut add);
    if let Some(nulls) = data.nulls() {
        add(nulls.buffer());
    }
    for child in data.child_data() {
        arrow_ranges(child, out);
    }
}

#[test]
fn device_columns_of_a_packed_batch_are_its_export() {
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    for batch in sample::sample_batches() {
        let on_device = transfer.to_device(&batch).unwrap();
        assert_columns_are_the_export(&on_device);
        // Packed: disjoint ranges of one allocation, which they fill up to its size.
        let mut buffers = Vec::new();
        for (i, column) in on_device.columns().iter().enumerate() {
            assert_eq!(column.device_type(), ArrowDeviceType::CPU);
            assert_eq!(column.device_id(), -1);
            all_buffers(column, format!("column {i}"), &mut buffers);
        }
        let mut ranges: Vec<(usize, usize)> = buffers
            .iter()
            .map(|(_, b)| (b.address() as usize, b.address() as usize + b.len()))
            .collect();
        ranges.sort();
        for pair in ranges.windows(2) {
            assert!(pair[0].1 <= pair[1].0, "overlapping buffers {pair:?}");
        }
        let total: usize = ranges.iter().map(|(s, e)| e - s).sum();
        assert!(total <= on_device.device_bytes());
        if let (Some(first), Some(last)) = (ranges.first(), ranges.last()) {
            assert!(last.1 - first.0 <= on_device.device_bytes());
        }
    }
}

#[test]
fn device_columns_of_an_imported_batch_are_its_export_and_stay_in_its_buffers() {
    let batch = sample::every_type_batch();
    let n = batch.num_rows();
    for (offset, len) in [(0, n), (1, n - 2), (n, 0)] {
        let data = StructArray::from(batch.clone()).into_data();
        let mut ranges = Vec::new();
        arrow_ranges(&data, &mut ranges);
        let (array, schema) = cpu::export_record_batch(&batch).unwrap();
        let mut raw = array.into_raw();
        // The root struct carries the slice: columns take its offset on.
        raw.array.offset = offset as i64;
        raw.array.length = len as i64;
        // SAFETY: `raw` came from a DeviceArray; `offset + length <= n` rows, which every
        // buffer covers.
        let array = unsafe { devarrow_abi::DeviceArray::try_new(raw) }.unwrap();
        let imported = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
        assert_columns_are_the_export(&imported);
        // Every length stays inside the arrow-rs buffer its address lies in.
        let mut buffers = Vec::new();
        for (i, column) in imported.columns().iter().enumerate() {
            all_buffers(column, batch.schema().field(i).name().clone(), &mut buffers);
        }
        let mut checked = 0;
        for (path, b) in &buffers {
            let (start, end) = (b.address() as usize, b.address() as usize + b.len());
            if let Some(range) = ranges.iter().find(|r| r.0 <= start && start < r.1) {
                assert!(
                    end <= range.1,
                    "{path} ({:?}): {start:#x}..{end:#x} overruns {range:x?}",
                    b.role()
                );
                checked += 1;
            }
        }
        assert!(
            checked > buffers.len() / 2,
            "{checked} of {} buffers checked",
            buffers.len()
        );
    }
}

#[test]
fn device_columns_reach_the_values() {
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    let batch = sample::every_type_batch();
    let expected = batch
        .column_by_name("int32")
        .unwrap()
        .as_any()
        .downcast_ref::<Int32Array>()
        .unwrap()
        .clone();
    let on_device = transfer.to_device(&batch).unwrap();
    let (array, schema) = on_device.export().unwrap();
    let imported = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
    for b in [&on_device, &imported] {
        let column = b.column_by_name("int32").unwrap();
        assert_eq!(column.data_type(), &DataType::Int32);
        assert_eq!(column.null_count(), Some(expected.null_count()));
        let values = column.values().unwrap();
        assert_eq!(values.role(), devarrow_abi::layout::BufferRole::Values);
        assert_eq!(values.len(), 4 * (column.offset() + column.len()));
        let validity = column.validity().unwrap();
        assert_eq!(validity.len(), (column.offset() + column.len()).div_ceil(8));
        // SAFETY: CPU device memory is host memory; the batch (borrowed) keeps it alive
        // and the CPU device's copies are complete when they return.
        let (got, bits) = unsafe {
            (
                std::slice::from_raw_parts(values.as_ptr().cast::<i32>(), values.len() / 4),
                std::slice::from_raw_parts(validity.as_ptr().cast::<u8>(), validity.len()),
            )
        };
        for i in 0..column.len() {
            let row = column.offset() + i;
            let valid = bits[row / 8] & (1 << (row % 8)) != 0;
            assert_eq!(valid, expected.is_valid(i), "row {i}");
            if valid {
                assert_eq!(got[row], expected.value(i), "row {i}");
            }
        }
        // Types without a values buffer have none; a string column has offsets and data.
        let utf8 = b.column_by_name("utf8").unwrap();
        assert!(utf8.values().is_none());
        assert_eq!(utf8.n_buffers(), 3);
        assert_eq!(
            utf8.buffer(1).unwrap().role(),
            devarrow_abi::layout::BufferRole::Offsets
        );
        let list = b.column_by_name("list").unwrap();
        assert_eq!(list.children().len(), 1);
        assert_eq!(list.child(0).unwrap().data_type(), &DataType::Int32);
        assert!(list.child(1).is_none());
        assert!(list.dictionary().is_none());
    }
}

/// A batch imported by `cpu::import_record_batch_trusting_utf8` (bytes that are not
/// UTF-8 under a `Utf8` field, as pyarrow lets a producer make) moves to the device and
/// back as the bytes it is: the download of devarrow's own batch trusts its planner (and,
/// in these debug builds, checks everything but UTF-8), while the import of the same
/// bytes as a foreign array checks them in full and refuses them.
#[test]
fn strings_trusted_on_import_come_back_as_their_bytes() {
    let data = arrow_data::ArrayData::builder(DataType::Binary)
        .len(2)
        .add_buffer(arrow_buffer::Buffer::from_slice_ref([0i32, 2, 3]))
        .add_buffer(arrow_buffer::Buffer::from_slice_ref([0xffu8, 0xfe, b'a']))
        .build()
        .unwrap();
    // SAFETY: a Utf8 array that breaks only the UTF-8 rule, never read as `str` here.
    let column = arrow_array::make_array(unsafe {
        data.into_builder()
            .data_type(DataType::Utf8)
            .build_unchecked()
    });
    let batch = RecordBatch::try_from_iter([("s", column)]).unwrap();
    let (array, schema) = cpu::export_record_batch(&batch).unwrap();
    // SAFETY: the strings are only compared as bytes below.
    let imported = unsafe { cpu::import_record_batch_trusting_utf8(array, &schema) }.unwrap();
    for device in [cpu(), InstrumentedDevice::new() as Arc<dyn Device>] {
        let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
        let on_device = transfer.to_device(&imported).unwrap();
        let back = transfer.to_host(&on_device).unwrap();
        let bytes = back.column(0).to_data();
        assert_eq!(bytes.buffers()[1].as_slice(), &[0xff, 0xfe, b'a']);
        // the same batch exported and imported as a foreign array: checked in full
        let (exported, schema) = on_device.export().unwrap();
        let foreign = DeviceBatch::import(
            device,
            exported,
            Arc::new(arrow_schema::Schema::try_from(&schema).unwrap()),
        )
        .unwrap();
        let err = transfer.to_host(&foreign).unwrap_err();
        assert!(err.to_string().contains("UTF8"), "{err}");
    }
}

/// A struct in a struct (with a dictionary and string views beside it, nulls at each
/// level) of a batch imported with a root offset downloads as its rows: on arrow-rs 59
/// (`.ci/arrow-lowest`, and the DataFusion integration) `make_array` of a struct of an
/// offset read the inner struct's rows past its children's and panicked, until the
/// download made every struct of an offset a struct of offset 0 (`struct_at_zero`).
#[test]
fn a_struct_in_a_struct_of_a_root_offset_downloads_its_rows() {
    let ints = Int32Array::from(
        (0..20)
            .map(|i| (i % 3 != 1).then_some(i))
            .collect::<Vec<_>>(),
    );
    let mut b = arrow_array::builder::StringViewBuilder::new().with_fixed_block_size(64);
    for i in 0..20 {
        if i % 4 == 2 {
            b.append_null()
        } else {
            b.append_value(format!("value number {i} long"))
        }
    }
    let strs = b.finish();
    let inner = StructArray::try_new(
        vec![Arc::new(Field::new("s", DataType::Utf8View, true))].into(),
        vec![Arc::new(strs) as ArrayRef],
        Some(arrow_buffer::NullBuffer::from(
            (0..20).map(|i| i % 5 != 3).collect::<Vec<_>>(),
        )),
    )
    .unwrap();
    let outer = StructArray::try_new(
        vec![
            Arc::new(Field::new("i", DataType::Int32, true)),
            Arc::new(Field::new("inner", inner.data_type().clone(), true)),
            Arc::new(Field::new(
                "d",
                DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8)),
                true,
            )),
        ]
        .into(),
        vec![
            Arc::new(ints) as ArrayRef,
            Arc::new(inner),
            Arc::new(
                (0..20)
                    .map(|i| {
                        (i % 6 != 3)
                            .then_some(["AIR", "a mode of more than twelve bytes", ""][i % 3])
                    })
                    .collect::<arrow_array::DictionaryArray<Int32Type>>(),
            ),
        ],
        Some(arrow_buffer::NullBuffer::from(
            (0..20).map(|i| i % 7 != 2).collect::<Vec<_>>(),
        )),
    )
    .unwrap();
    let batch = RecordBatch::try_from_iter([("o", Arc::new(outer) as ArrayRef)]).unwrap();
    let padded =
        arrow_select::concat::concat_batches(&batch.schema(), [&batch.slice(0, 7), &batch])
            .unwrap();
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    let whole = transfer.to_device(&padded).unwrap();
    let (array, _schema) = whole.export().unwrap();
    let mut raw = array.into_raw();
    raw.array.offset = 7;
    raw.array.length = 20;
    // SAFETY: the export's own struct, released by the import; only its root's offset
    // and length changed, to rows its children hold.
    let array = unsafe { devarrow_abi::DeviceArray::try_new(raw) }.unwrap();
    let imported = DeviceBatch::import(cpu(), array, batch.schema()).unwrap();
    let back = transfer.to_host(&imported).unwrap();
    assert_eq!(back, batch);
}
