//! The pinned fast path and parallel packing on the CPU device: batches in pinned
//! (staging) memory skip the staging copy, everything still round-trips exactly.

// Not under Miri: batches of up to 200 000 rows (1.6 MB a column) through the pinned
// staging pipeline: far too slow interpreted.
#![cfg(not(miri))]

mod common;

use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_buffer::ScalarBuffer;
use common::InstrumentedDevice;
use devarrow_abi::device::{CopyCounter, CpuDevice};
use devarrow_bridge::pack::{equal_windows, upload_window_bytes};
use devarrow_bridge::pinned::{pin_batch, pinned_buffer, pinned_bytes};
use devarrow_bridge::transfer::{DEFAULT_CHUNK_BYTES, DEFAULT_FIRST_CHUNK_BYTES};
use devarrow_bridge::{Transfer, TransferOptions};
use devarrow_testing::sample;

fn wide_batch(columns: usize, rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter((0..columns).map(|c| {
        let col: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..rows as i64).map(|i| (i % 7 != 0).then_some(i * c as i64)),
        ));
        (format!("c{c}"), col)
    }))
    .unwrap()
}

fn counting() -> (Arc<InstrumentedDevice>, Transfer) {
    let device = Arc::new(InstrumentedDevice::default().reporting_pinned());
    let transfer = Transfer::new(device.clone(), TransferOptions::default());
    (device, transfer)
}

#[test]
fn a_pinned_batch_moves_in_one_copy_without_staging() {
    let batch = wide_batch(100, 1000); // ~900 KB in 200 buffers
    let pinned = pin_batch(&CpuDevice::new(), &batch).unwrap();
    assert_eq!(pinned, batch);
    let (on, of) = pinned_bytes(&CpuDevice::new(), &pinned).unwrap();
    assert_eq!(on, of);

    let (device, mut transfer) = counting();
    let on_device = transfer.to_device(&pinned).unwrap();
    assert_eq!(
        device.copy_count(),
        1,
        "one direct copy for the whole batch"
    );
    assert_eq!(device.staging_allocations(), 0, "no staging used");
    drop(pinned); // the transfer keeps the source alive until its copy completed
    let back = transfer.to_host(&on_device).unwrap();
    assert_eq!(back, batch);
    // The same batch from pageable memory: one staged copy.
    let (device, mut transfer) = counting();
    let again = transfer.to_device(&batch).unwrap();
    assert_eq!(device.copy_count(), 1);
    assert_eq!(device.staging_allocations(), 1);
    assert_eq!(transfer.to_host(&again).unwrap(), batch);
}

#[test]
fn every_type_and_slice_round_trips_pinned() {
    let batch = sample::every_type_batch();
    let options = TransferOptions::default().with_direct_min_bytes(1); // everything pinned goes direct, however small
    for (offset, len) in [(0, batch.num_rows()), (1, 3), (2, 0), (3, 2)] {
        let slice = batch.slice(offset, len);
        let pinned = pin_batch(&CpuDevice::new(), &slice).unwrap();
        assert_eq!(pinned, slice);
        let device = Arc::new(InstrumentedDevice::default().reporting_pinned());
        let mut transfer = Transfer::new(device.clone(), options);
        let on_device = transfer.to_device(&pinned).unwrap();
        let back = transfer.to_host(&on_device).unwrap();
        for column in back.columns() {
            column.to_data().validate_full().unwrap();
        }
        if let Some(diff) = sample::describe_difference(&slice, &back) {
            panic!("slice {offset}+{len}: {diff}");
        }
        assert_eq!(back, slice, "slice {offset}+{len}");
    }
}

#[test]
fn large_pinned_buffers_go_direct_and_small_ones_are_packed() {
    let rows = 200_000; // 1.6 MB per column
    let device = CpuDevice::new();
    let big = pinned_buffer(&device, rows * 8, |b| {
        for (i, v) in b.chunks_exact_mut(8).enumerate() {
            v.copy_from_slice(&(i as i64 * 3).to_le_bytes());
        }
    })
    .unwrap();
    let pinned_col: ArrayRef = Arc::new(Int64Array::new(ScalarBuffer::new(big, 0, rows), None));
    let pageable_col: ArrayRef = Arc::new(Int64Array::from_iter_values(0..rows as i64));
    let small: ArrayRef = Arc::new(StringArray::from_iter_values((0..rows).map(|i| {
        if i % 2 == 0 {
            "a"
        } else {
            "bb"
        }
    })));
    let batch = RecordBatch::try_from_iter([
        ("small", small),
        ("pinned", pinned_col),
        ("pageable", pageable_col),
    ])
    .unwrap();
    let (counting, mut transfer) = counting();
    let on_device = transfer.to_device(&batch).unwrap();
    // The strings (before the pinned column) are staged, the pinned column one direct
    // copy, the pageable column staged: the staged ones in windows of a sixteenth of
    // what is staged (at least the first chunk's size).
    let strings = batch.column(0).to_data();
    let string_bytes: usize =
        strings.buffers().iter().map(|b| b.len()).sum::<usize>() + 64 - (rows + 1) * 4 % 64;
    let size = upload_window_bytes(
        string_bytes + rows * 8,
        DEFAULT_FIRST_CHUNK_BYTES,
        DEFAULT_CHUNK_BYTES,
    );
    assert_eq!(
        counting.copy_count() as usize,
        1 + string_bytes.div_ceil(size) + (rows * 8).div_ceil(size)
    );
    assert_eq!(
        counting.bytes_to_device() as usize,
        batch
            .columns()
            .iter()
            .map(|c| c.to_data().buffers().iter().map(|b| b.len()).sum::<usize>())
            .sum::<usize>()
            + 64
            - (rows + 1) * 4 % 64, // padding after the string offsets
        "every byte copied once"
    );
    assert_eq!(transfer.to_host(&on_device).unwrap(), batch);

    // Direct copies off: everything staged, in chunk-sized windows, or, by default, in
    // windows of a sixteenth of it, at least 1 MiB.
    for first_chunk_bytes in [0, DEFAULT_FIRST_CHUNK_BYTES] {
        let counting = Arc::new(InstrumentedDevice::default().reporting_pinned());
        let mut transfer = Transfer::new(
            counting.clone(),
            TransferOptions::default()
                .with_direct_min_bytes(usize::MAX)
                .with_first_chunk_bytes(first_chunk_bytes),
        );
        let on_device = transfer.to_device(&batch).unwrap();
        let bytes = on_device.device_bytes();
        assert!(bytes > 4 * DEFAULT_FIRST_CHUNK_BYTES);
        let expected = if first_chunk_bytes == 0 {
            bytes.div_ceil(DEFAULT_CHUNK_BYTES)
        } else {
            equal_windows(
                0,
                bytes,
                upload_window_bytes(bytes, first_chunk_bytes, DEFAULT_CHUNK_BYTES),
            )
            .len()
        };
        assert_eq!(counting.copy_count() as usize, expected);
        assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
    }
}

#[test]
fn parallel_packing_with_small_chunks_round_trips() {
    let batch = wide_batch(6, 300_000); // ~15 MB
    let strings: ArrayRef = Arc::new(StringArray::from_iter(
        (0..300_000).map(|i| (i % 5 != 0).then(|| "x".repeat(i % 37))),
    ));
    let batch = RecordBatch::try_from_iter(
        batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .zip(batch.columns().iter().cloned())
            .chain([("s".to_string(), strings)]),
    )
    .unwrap();
    for (staging, chunk, threads) in [
        (1 << 20, 256 << 10, 4),
        (4 << 20, 1 << 20, 3),
        (64 << 20, 8 << 20, 0),
        (8 << 20, 8 << 20, 1),
    ] {
        let device = Arc::new(InstrumentedDevice::default().reporting_pinned());
        let mut transfer = Transfer::new(
            device.clone(),
            TransferOptions::default()
                .with_staging_bytes(staging)
                .with_chunk_bytes(chunk)
                .with_pack_threads(threads)
                .with_parallel_min_bytes(0),
        );
        let on_device = transfer.to_device(&batch).unwrap();
        let chunk = chunk.min(staging / 2);
        let copies = device.copy_count();
        assert_eq!(
            copies as usize,
            equal_windows(
                0,
                on_device.device_bytes(),
                upload_window_bytes(on_device.device_bytes(), DEFAULT_FIRST_CHUNK_BYTES, chunk),
            )
            .len(),
            "one copy per window ({staging}, {chunk})"
        );
        if chunk <= DEFAULT_FIRST_CHUNK_BYTES {
            assert_eq!(copies as usize, on_device.device_bytes().div_ceil(chunk));
        }
        assert!(
            device.staging_allocations() <= staging / chunk,
            "staging stays within its bound"
        );
        let back = transfer.to_host(&on_device).unwrap();
        assert_eq!(back, batch, "({staging}, {chunk}, {threads})");
        // A second batch reuses the staging buffers.
        let before = device.staging_allocations();
        let _ = transfer.to_device(&batch).unwrap();
        assert_eq!(device.staging_allocations(), before);
    }
}

#[test]
fn staging_is_allocated_once_at_full_chunk_size() {
    // A small batch first, then larger ones with ramped chunks, in both directions:
    // every stage is allocated once, at the full chunk size, and never regrown (freeing
    // and allocating pinned memory mid-pipeline stalls every stream of a GPU).
    let device = Arc::new(InstrumentedDevice::default());
    let (staging, chunk) = (8 << 20, 2 << 20);
    let mut transfer = Transfer::new(
        device.clone(),
        TransferOptions::default()
            .with_staging_bytes(staging)
            .with_chunk_bytes(chunk)
            .with_first_chunk_bytes(256 << 10)
            .with_pinned_host_bytes(0), // downloads through staging too
    );
    for rows in [100, 1_000, 400_000, 100, 1_500_000] {
        let batch = wide_batch(3, rows);
        let on_device = transfer.to_device(&batch).unwrap();
        assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
    }
    let sizes = device.staging_sizes();
    assert!(
        !sizes.is_empty() && sizes.len() <= staging / chunk,
        "{sizes:?}"
    );
    assert!(sizes.iter().all(|&s| s == chunk), "{sizes:?}");
}

/// On a device that registers pageable memory (posed by the instrumented device), large
/// buffers skip staging both ways: an upload copies their whole pages straight from the
/// batch, in one batched call (the partial pages at their ends staged), and a download
/// copies its large output straight into host memory it allocates as whole pages; the
/// registrations live until the transfer has waited for those copies (an upload's until
/// the transfer is dropped at the latest), even when waiting fails, and the batches
/// round-trip exactly, on synchronous copies and on a modelled link's asynchronous ones.
#[test]
fn registered_pageable_buffers_go_direct_both_ways_and_are_all_released() {
    use devarrow_abi::device::LinkModel;
    use std::time::Duration;
    let batch = wide_batch(4, 100_000); // 4 x 800 KB of values, 12.5 KB of validity each
    for inner in [
        Arc::new(CpuDevice::new()),
        Arc::new(CpuDevice::with_link(LinkModel::new(
            20e9,
            Duration::from_micros(5),
        ))),
    ] {
        let device = Arc::new(InstrumentedDevice::wrapping(inner).registering_from(64 << 10));
        // Downloads into registered pageable memory, not the pinned pool.
        let options = TransferOptions::default().with_pinned_host_bytes(0);
        let mut transfer = Transfer::new(device.clone(), options);
        let on_device = transfer.to_device(&batch).unwrap();
        assert_eq!(device.batch_calls(), 1, "the direct copies in one call");
        let (_, made) = device.registrations();
        assert_eq!(
            made, 4,
            "the four value buffers (the bitmaps are too small)"
        );
        assert!(
            device.staging_sizes().iter().all(|&s| s <= 8 << 20),
            "{:?}",
            device.staging_sizes()
        );
        let back = transfer.to_host(&on_device).unwrap();
        drop(on_device);
        assert_eq!(back, batch);
        assert_eq!(device.registrations().1, 5, "and the download's output");
        // Only whole pages are registered, and copied directly: the partial pages at a
        // buffer's ends (shared with other allocations) are staged.
        assert_eq!(device.direct_copies_outside_registered_pages(), vec![]);
        assert_eq!(device.batch_calls(), 2);
        assert!(
            device.registrations().0 <= 4,
            "the download's is dropped already"
        );
        drop(transfer);
        assert_eq!(device.registrations().0, 0, "every registration dropped");

        // Waiting fails: the transfer synchronizes the device, then drops them.
        let mut transfer = Transfer::new(device.clone(), options);
        let on_device = transfer.to_device(&batch).unwrap();
        device.fail_waits(true);
        assert!(transfer.to_host(&on_device).is_err());
        device.fail_waits(false);
        drop(transfer);
        assert_eq!(
            device.registrations().0,
            0,
            "dropped after the failed waits too"
        );
        drop(on_device);
        assert_eq!(device.live(), 0);
    }
}

/// The upload pipeline gives up cleanly when the device fails in the middle of it: an
/// event that cannot be recorded after some windows' copies is an error (no hang, with
/// workers still waiting for windows); the same batch then round-trips on a sound device.
#[test]
fn a_device_failing_in_the_middle_of_the_pipeline_is_an_error_not_a_hang() {
    let batch = wide_batch(6, 300_000); // ~15 MB: windows of 1 MiB
    for after in [0, 1, 3, 7] {
        let device = Arc::new(InstrumentedDevice::default().failing_events_after(after));
        let mut transfer = Transfer::new(
            device.clone(),
            TransferOptions::default()
                .with_pack_threads(4)
                .with_parallel_min_bytes(0),
        );
        let failed = transfer.to_device(&batch);
        assert!(failed.is_err(), "failing after {after} events");
        let good = Arc::new(InstrumentedDevice::default());
        let mut transfer = Transfer::new(good, TransferOptions::default());
        let on_device = transfer.to_device(&batch).unwrap();
        assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
    }
}

/// A device that refuses to pin the memory downloads would land in: the download goes
/// through staging into pageable memory, says why, and the transfer does not ask again.
#[test]
fn downloads_fall_back_to_pageable_memory_when_pinning_is_refused() {
    let batch = wide_batch(4, 300_000); // ~10 MB, larger than a staging buffer
    let device = Arc::new(InstrumentedDevice::default().refusing_staging_from(8 << 20));
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let on_device = transfer.to_device(&batch).unwrap();
    assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
    let note = transfer.host_memory_note().expect("a note").to_string();
    assert!(note.contains("refused"), "{note}");
    assert_eq!(transfer.stats().pageable_downloads, 1);
    let asked = device.staging_sizes().len();
    assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
    assert_eq!(device.staging_sizes().len(), asked, "not asked again");
    assert_eq!(transfer.stats().pageable_downloads, 2);
}
