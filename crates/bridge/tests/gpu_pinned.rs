//! The pinned fast path and the parallel, many-chunk staging pipeline on CUDA
//! ([`CudaDevice`]): copies really are asynchronous here, so these tests check
//! that staging buffers are reused only after their copies completed and that direct
//! copies keep their source memory alive.
//!
//! Without a usable GPU each test prints `skipping: <reason>` and passes, unless the
//! environment sets `DEVARROW_REQUIRE_GPU=1`, in which case it fails.

// Not under Miri: needs the CUDA driver (dlopen), which Miri cannot load.
#![cfg(not(miri))]

mod common;

use std::sync::Arc;

use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, StringArray};
use common::gpu_or_skip;
use devarrow_abi::device::{CopyCounter, Device};
use devarrow_bridge::pinned::{pin_batch, pinned_bytes};
use devarrow_bridge::{Transfer, TransferOptions};
use devarrow_cuda::PinnedHostBuffer;
use devarrow_testing::sample;

fn big_batch(rows: usize) -> RecordBatch {
    let ints: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..rows as i64).map(|i| (i % 13 != 0).then_some(i * 31)),
    ));
    let strings: ArrayRef = Arc::new(StringArray::from_iter(
        (0..rows).map(|i| (i % 9 != 0).then(|| "abcdefghij".repeat(i % 5))),
    ));
    RecordBatch::try_from_iter([("i", ints), ("s", strings)]).unwrap()
}

#[test]
fn the_driver_and_the_registry_know_pinned_memory() {
    let (_lock, device) = gpu_or_skip!();
    let pageable = vec![1u8; 1 << 20];
    assert!(!device.is_pinned(pageable.as_ptr(), pageable.len()));
    let staging = device.allocate_staging(1 << 20).unwrap();
    let bytes = staging.as_slice();
    assert!(device.is_pinned(bytes.as_ptr(), bytes.len()));
    assert!(device.is_pinned(bytes[100..].as_ptr(), 1000));
    // Pinned memory the registry does not know: found through the driver.
    let other = PinnedHostBuffer::alloc(device.primary_context(), 1 << 16).unwrap();
    assert!(device.is_pinned(other.as_slice().as_ptr(), other.as_slice().len()));
    let address = bytes.as_ptr();
    drop(staging);
    // Given back to the device's pinned reserve, and handed out again.
    let again = device.allocate_staging(1 << 20).unwrap();
    assert_eq!(
        again.as_slice().as_ptr(),
        address,
        "staging given back is reused"
    );
    drop(again);
    // Given back to the context's pinned reserve, which every device of the context
    // shares: still pinned. Freed by an explicit trim: forgotten, and the driver no
    // longer knows it.
    let checker = devarrow_cuda::CudaDevice::new(device.primary_context().clone()).unwrap();
    drop(device);
    assert!(checker.is_pinned(address, 1), "kept by the reserve");
    assert!(checker.trim_pinned() > 0);
    assert!(
        !checker.is_pinned(address, 1),
        "trimmed staging is forgotten (and the driver no longer knows it)"
    );
}

#[test]
fn a_pinned_batch_moves_in_one_direct_copy() {
    let (_lock, device) = gpu_or_skip!();
    let batch = big_batch(500_000);
    let pinned = pin_batch(device.as_ref(), &batch).unwrap();
    assert_eq!(pinned, batch);
    let (on, of) = pinned_bytes(device.as_ref(), &pinned).unwrap();
    assert_eq!(on, of);
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let before = device.copy_count();
    let on_device = transfer.to_device(&pinned).unwrap();
    assert_eq!(device.copy_count() - before, 1, "one DMA, no staging");
    drop(pinned); // the transfer keeps the pinned memory alive until the DMA completed
    let back = transfer.to_host(&on_device).unwrap();
    assert_eq!(back, batch);
}

#[test]
fn pinned_every_type_batches_round_trip() {
    let (_lock, device) = gpu_or_skip!();
    let batch = sample::every_type_batch();
    let mut transfer = Transfer::new(
        device.clone(),
        TransferOptions::default().with_direct_min_bytes(1),
    );
    for (offset, len) in [(0, batch.num_rows()), (1, 3), (2, 0)] {
        let slice = batch.slice(offset, len);
        let pinned = pin_batch(device.as_ref(), &slice).unwrap();
        let on_device = transfer.to_device(&pinned).unwrap();
        drop(pinned);
        let back = transfer.to_host(&on_device).unwrap();
        for column in back.columns() {
            column.to_data().validate_full().unwrap();
        }
        assert_eq!(back, slice, "slice {offset}+{len}");
    }
}

#[test]
fn many_small_chunks_in_flight_round_trip() {
    let (_lock, device) = gpu_or_skip!();
    let batch = big_batch(2_000_000); // ~60 MB
    for (staging, chunk, threads) in [(8 << 20, 1 << 20, 4), (64 << 20, 8 << 20, 0)] {
        let mut transfer = Transfer::new(
            device.clone(),
            TransferOptions::default()
                .with_staging_bytes(staging)
                .with_chunk_bytes(chunk)
                .with_pack_threads(threads)
                .with_parallel_min_bytes(0),
        );
        for _ in 0..3 {
            let on_device = transfer.to_device(&batch).unwrap();
            let back = transfer.to_host(&on_device).unwrap();
            assert_eq!(back, batch, "({staging}, {chunk}, {threads})");
        }
    }
}
