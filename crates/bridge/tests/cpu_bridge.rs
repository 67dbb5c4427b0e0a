//! The bridge on the CPU device: the same planning, packing and rebuilding code that runs
//! on CUDA, checked in CI.

// Not under Miri: every test moves the every-type batch or large batches through a
// Transfer: more than 10 minutes per test under Miri. The same unsafe paths run under Miri
// in bridge_bad_input.rs and c_boundary.rs, and under AddressSanitizer in the import_array
// fuzz target.
#![cfg(not(miri))]

mod common;

use std::sync::Arc;

use arrow_array::{
    Array, ArrayRef, BinaryViewArray, Int64Array, NullArray, RecordBatch, StringArray,
    StringViewArray,
};
use common::InstrumentedDevice;
use devarrow_abi::cpu;
use devarrow_abi::device::{CopyCounter, CpuDevice, Device};
use devarrow_bridge::pack::ramped_windows;
use devarrow_bridge::plan::plan_array;
use devarrow_bridge::transfer::{DEFAULT_CHUNK_BYTES, DEFAULT_FIRST_CHUNK_BYTES};
use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_testing::sample;

fn transfer() -> (Arc<CpuDevice>, Transfer) {
    let device = Arc::new(CpuDevice::new());
    let transfer = Transfer::new(device.clone(), TransferOptions::default());
    (device, transfer)
}

fn round_trip(batch: &RecordBatch) -> RecordBatch {
    let (_, mut transfer) = transfer();
    let on_device = transfer.to_device(batch).unwrap();
    assert_eq!(on_device.num_rows(), batch.num_rows());
    let back = transfer.to_host(&on_device).unwrap();
    for column in back.columns() {
        column.to_data().validate_full().unwrap();
    }
    back
}

#[test]
fn every_type_round_trips() {
    let batch = sample::every_type_batch();
    let back = round_trip(&batch);
    if let Some(diff) = sample::describe_difference(&batch, &back) {
        panic!("{diff}");
    }
    assert_eq!(back, batch);
}

#[test]
fn every_slice_of_every_type_round_trips() {
    let batch = sample::every_type_batch();
    let n = batch.num_rows();
    for offset in 0..=n {
        for len in [0, 1, 2, 3, n - offset] {
            if offset + len > n {
                continue;
            }
            let slice = batch.slice(offset, len);
            let back = round_trip(&slice);
            if let Some(diff) = sample::describe_difference(&slice, &back) {
                panic!("slice {offset}+{len}: {diff}");
            }
            assert_eq!(back, slice, "slice {offset}+{len}");
        }
    }
}

#[test]
fn device_batch_exports_and_imports_as_a_cpu_device_array() {
    let batch = sample::every_type_batch().slice(1, 3);
    let (_, mut transfer) = transfer();
    let on_device = transfer.to_device(&batch).unwrap();
    let (array, schema) = on_device.export().unwrap();
    drop(on_device); // the export keeps the memory alive
    let back = cpu::import_record_batch(array, &schema).unwrap();
    assert_eq!(back, batch);
}

fn wide_batch(columns: usize, rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter((0..columns).map(|c| {
        let col: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..rows as i64).map(|i| (i % 7 != 0).then_some(i * c as i64)),
        ));
        (format!("c{c}"), col)
    }))
    .unwrap()
}

#[test]
fn a_hundred_small_columns_move_in_one_copy() {
    let batch = wide_batch(100, 1000);
    let (device, mut transfer) = transfer();
    let on_device = transfer.to_device(&batch).unwrap();
    assert_eq!(device.copy_count(), 1, "one DMA for the whole batch");
    let back = transfer.to_host(&on_device).unwrap();
    assert_eq!(device.copy_count(), 2, "and one back");
    assert_eq!(back, batch);
}

#[test]
fn many_batches_come_back_in_one_pipeline() {
    // Batches of about 5.7 MB (one of them sliced, one empty, one imported): through
    // pageable memory (no pinned pool), `to_host` ramps the chunks of each at both ends,
    // `to_host_batches` only the first and the last of the whole call.
    let sizes = [100_000, 0, 100_003, 120_000];
    let mut batches: Vec<RecordBatch> = sizes.iter().map(|&n| wide_batch(7, n)).collect();
    batches[3] = batches[3].slice(7, 100_001);
    let device = Arc::new(CpuDevice::new());
    let mut transfer = Transfer::new(
        device.clone(),
        TransferOptions::default().with_pinned_host_bytes(0),
    );
    let mut on_device: Vec<DeviceBatch> = batches
        .iter()
        .map(|b| transfer.to_device(b).unwrap())
        .collect();
    let (array, schema) = on_device[2].export().unwrap();
    on_device[2] = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
    assert!(on_device[2].is_imported());

    let before = device.copy_count();
    let one_by_one: Vec<RecordBatch> = on_device
        .iter()
        .map(|d| transfer.to_host(d).unwrap())
        .collect();
    let separate = device.copy_count() - before;
    let before = device.copy_count();
    let together = transfer.to_host_batches(&on_device).unwrap();
    let pipelined = device.copy_count() - before;
    assert_eq!(one_by_one, batches);
    assert_eq!(together, batches);
    for batch in &together {
        for column in batch.columns() {
            column.to_data().validate_full().unwrap();
        }
    }
    // The copies: the image of every batch in windows, ramped as described.
    let images: Vec<usize> = on_device.iter().map(|d| d.device_bytes()).collect();
    assert!(images
        .iter()
        .all(|&b| b == 0 || b > 4 * DEFAULT_FIRST_CHUNK_BYTES));
    let chunks = |len: usize, head: bool, tail: bool| {
        ramped_windows(
            0,
            len,
            DEFAULT_FIRST_CHUNK_BYTES,
            DEFAULT_CHUNK_BYTES,
            head,
            tail,
        )
        .len()
    };
    let last = images.len() - 1;
    let expected_separate: usize = images.iter().map(|&b| chunks(b, true, true)).sum();
    let expected_pipelined: usize = images
        .iter()
        .enumerate()
        .map(|(i, &b)| chunks(b, i == 0, i == last))
        .sum();
    assert_eq!(separate as usize, expected_separate);
    assert_eq!(pipelined as usize, expected_pipelined);
    assert!(pipelined < separate, "{pipelined} < {separate}");

    assert_eq!(transfer.to_host_batches(&[]).unwrap(), []);

    // Into pinned memory (the default): one direct copy per image, no staging.
    let (device, mut pinned) = self::transfer();
    let before = device.copy_count();
    let together = pinned.to_host_batches(&on_device).unwrap();
    assert_eq!(together, batches);
    let non_empty = images.iter().filter(|&&b| b > 0).count();
    assert_eq!((device.copy_count() - before) as usize, non_empty);
    assert_eq!(pinned.stats().pinned_downloads, 4);
    assert_eq!(pinned.stats().pageable_downloads, 0);
    assert_eq!(pinned.host_memory_note(), None);
}

#[test]
fn staging_is_bounded_and_chunks_are_pipelined() {
    let batch = wide_batch(4, 100_000); // ~3.3 MB
    let device = Arc::new(CpuDevice::new());
    let mut transfer = Transfer::new(
        device.clone(),
        TransferOptions::default().with_staging_bytes(1 << 20),
    );
    let on_device = transfer.to_device(&batch).unwrap();
    let copies = device.copy_count();
    let expected = on_device.device_bytes().div_ceil(1 << 19) as u64;
    assert_eq!(copies, expected, "one copy per 512 KiB staging chunk");
    assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
}

#[test]
fn a_slice_moves_only_its_bytes() {
    let rows = 100_000;
    let strings: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|i| format!("value-{i}")),
    ));
    let ints: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..rows as i64).map(|i| (i % 3 != 0).then_some(i)),
    ));
    let batch = RecordBatch::try_from_iter([("s", strings), ("i", ints)]).unwrap();
    let full = plan_array(&arrow_array::StructArray::from(batch.clone()).into_data()).unwrap();
    let slice = batch.slice(rows / 2 + 3, 1000);
    let part = plan_array(&arrow_array::StructArray::from(slice.clone()).into_data()).unwrap();
    let ratio = part.image.payload_bytes() as f64 / full.image.payload_bytes() as f64;
    assert!(
        ratio < 0.0125,
        "a 1% slice moved {:.2}% of the bytes",
        ratio * 100.0
    );
    assert_eq!(round_trip(&slice), slice);
}

#[test]
fn every_type_slices_move_bytes_proportional_to_the_slice() {
    // Repeat the sample so slices are small relative to the whole.
    let base = sample::every_type_batch();
    let big = arrow_select_concat(&vec![base.clone(); 64]);
    let full = plan_array(&arrow_array::StructArray::from(big.clone()).into_data()).unwrap();
    let part = plan_array(
        &arrow_array::StructArray::from(big.slice(base.num_rows() * 10 + 1, 2)).into_data(),
    )
    .unwrap();
    // Dictionaries travel whole (shared by every slice); everything else is cut.
    assert!(
        part.image.payload_bytes() * 8 < full.image.payload_bytes(),
        "slice {} bytes vs whole {}",
        part.image.payload_bytes(),
        full.image.payload_bytes()
    );
}

#[test]
fn null_columns_export_with_every_item_null() {
    let batch = RecordBatch::try_from_iter([
        ("n", Arc::new(NullArray::new(5)) as ArrayRef),
        (
            "i",
            Arc::new(Int64Array::from(vec![1, 2, 3, 4, 5])) as ArrayRef,
        ),
    ])
    .unwrap();
    for (offset, len) in [(0, 5), (1, 3), (5, 0)] {
        let slice = batch.slice(offset, len);
        let plan = plan_array(&arrow_array::StructArray::from(slice.clone()).into_data()).unwrap();
        assert_eq!(plan.root.children[0].null_count, Some(len));
        let (_, mut transfer) = transfer();
        let on_device = transfer.to_device(&slice).unwrap();
        let (array, schema) = on_device.export().unwrap();
        // SAFETY: the exporter filled `children` with two valid pointers.
        let null_count = unsafe { (**array.array().children).null_count };
        assert_eq!(null_count, len as i64, "as arrow-rs's FFI export says");
        assert_eq!(cpu::import_record_batch(array, &schema).unwrap(), slice);
        assert_eq!(transfer.to_host(&on_device).unwrap(), slice);
    }
}

#[test]
fn a_view_slice_moves_bytes_proportional_to_the_slice() {
    let rows = 1_000_000;
    let strings = StringViewArray::from_iter_values(
        (0..rows).map(|i| format!("a string longer than twelve bytes, number {i}")),
    );
    let batch = RecordBatch::try_from_iter([("s", Arc::new(strings) as ArrayRef)]).unwrap();
    let full = plan_array(&arrow_array::StructArray::from(batch.clone()).into_data()).unwrap();
    let slice = batch.slice(rows / 2 + 3, 10);
    let device = InstrumentedDevice::new();
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let on_device = transfer.to_device(&slice).unwrap();
    let moved = device.bytes_to_device();
    // 10 views (160 bytes) and 10 strings of ~50 bytes, with their alignment padding.
    assert!(
        moved < 4096 && on_device.device_bytes() < 4096,
        "a 10-row slice moved {moved} bytes ({} on the device) of {}",
        on_device.device_bytes(),
        full.image.payload_bytes()
    );
    let back = transfer.to_host(&on_device).unwrap();
    back.column(0).to_data().validate_full().unwrap();
    assert_eq!(back, slice);

    // Most of the buffers used: they travel as they are, zero-copy (no rewrite).
    let data_buffer = batch.column(0).to_data().buffers()[1].clone();
    let half = batch.slice(0, rows * 3 / 4);
    let plan = plan_array(&arrow_array::StructArray::from(half.clone()).into_data()).unwrap();
    assert!(
        plan.image
            .segments
            .iter()
            .any(|(b, _)| b.as_ptr() == data_buffer.as_ptr()),
        "the variadic buffers are not copied"
    );
    assert_eq!(round_trip(&half), half);

    // Binary views and null slots too.
    let binary = BinaryViewArray::from_iter(
        (0..10_000).map(|i| (i % 3 != 0).then(|| vec![i as u8; 20 + i % 30])),
    );
    let batch = RecordBatch::try_from_iter([("b", Arc::new(binary) as ArrayRef)]).unwrap();
    let full = plan_array(&arrow_array::StructArray::from(batch.clone()).into_data()).unwrap();
    let slice = batch.slice(5_000, 7);
    let part = plan_array(&arrow_array::StructArray::from(slice.clone()).into_data()).unwrap();
    assert!(
        part.image.payload_bytes() * 500 < full.image.payload_bytes(),
        "{} of {}",
        part.image.payload_bytes(),
        full.image.payload_bytes()
    );
    assert_eq!(round_trip(&slice), slice);
}

fn arrow_select_concat(batches: &[RecordBatch]) -> RecordBatch {
    arrow_select::concat::concat_batches(&batches[0].schema(), batches).unwrap()
}

/// `DeviceBatch::copy_to` on the CPU device (the same code as between GPUs): a packed
/// batch of every type, and an imported one, copied to another CPU device (one `memcpy`
/// of the image: `copy_from_peer`), to a device in direct mode and one with a modelled
/// link, come back equal; the copy is packed, on the target, with its own event, and the
/// source is unchanged.
#[test]
fn batches_copy_to_another_device() {
    let batch = sample::every_type_batch();
    let source: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let mut transfer = Transfer::new(source.clone(), TransferOptions::default());
    let on_source = transfer.to_device(&batch).unwrap();
    let imported = {
        let (array, schema) = on_source.export().unwrap();
        DeviceBatch::import_with_ffi_schema(source.clone(), array, &schema).unwrap()
    };
    let mut targets: Vec<Arc<dyn Device>> = vec![
        Arc::new(CpuDevice::new()),
        Arc::new(CpuDevice::direct()),
        Arc::new(CpuDevice::with_link(devarrow_abi::device::LinkModel::new(
            1e9,
            std::time::Duration::from_micros(5),
        ))),
    ];
    if cfg!(miri) {
        // One target is enough for Miri's checks of the copies' memory accesses.
        targets.truncate(1);
    }
    for target in &targets {
        for from in [&on_source, &imported] {
            let copy = from.copy_to(target).unwrap();
            assert!(Arc::ptr_eq(copy.device(), target));
            assert!(!copy.is_imported());
            assert_eq!(copy.num_rows(), batch.num_rows());
            let mut back = Transfer::new(target.clone(), TransferOptions::default());
            assert_eq!(back.to_host(&copy).unwrap(), batch);
            // A copy of the copy, back on the source device.
            let again = copy.copy_to(&source).unwrap();
            drop(copy);
            assert_eq!(transfer.to_host(&again).unwrap(), batch);
        }
    }
    assert_eq!(transfer.to_host(&on_source).unwrap(), batch);
}
