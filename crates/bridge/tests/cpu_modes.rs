//! The bridge on the other modes of the CPU device: direct (the host packs into device
//! memory, no staging) and with a modelled link (copies on a copy-engine thread, events
//! that complete later); the host pool of downloads; the stage times of a transfer.

use std::sync::Arc;
use std::time::Duration;

use arrow_array::{Int64Array, RecordBatch, StringArray};
use devarrow_abi::device::{CopyCounter, CpuDevice, Device, HostPool, LinkModel};
use devarrow_bridge::{pin_batch, DeviceBatch, Transfer, TransferOptions};
use devarrow_testing::sample;

/// Miri interprets the tests about 1000 times slower: it runs them on batches and chunks
/// this many times smaller (the same number of chunks per batch, the same code paths).
const MIRI_SCALE: usize = if cfg!(miri) { 64 } else { 1 };

/// A batch of `rows / MIRI_SCALE` rows, large enough to take several staging chunks.
fn big_batch(rows: usize) -> RecordBatch {
    let rows = rows / MIRI_SCALE;
    RecordBatch::try_from_iter([
        (
            "i",
            Arc::new(Int64Array::from_iter(
                (0..rows as i64).map(|i| (i % 7 != 0).then_some(i * 3)),
            )) as _,
        ),
        (
            "s",
            Arc::new(StringArray::from_iter_values(
                (0..rows).map(|i| format!("value {i}")),
            )) as _,
        ),
    ])
    .unwrap()
}

/// Small chunks, so that a batch of a few MB goes through many copies in a pipeline.
fn small_chunks() -> TransferOptions {
    TransferOptions::default()
        .with_staging_bytes((1 << 20) / MIRI_SCALE)
        .with_chunk_bytes((256 << 10) / MIRI_SCALE)
        .with_first_chunk_bytes((64 << 10) / MIRI_SCALE)
}

fn round_trips(device: Arc<dyn Device>, options: TransferOptions) {
    let mut transfer = Transfer::new(device, options);
    let batches = vec![
        sample::every_type_batch(),
        sample::every_type_batch().slice(1, 3),
        big_batch(300_000),
        big_batch(300_000).slice(12_345 / MIRI_SCALE, 100_000 / MIRI_SCALE),
        big_batch(0),
    ];
    let on_device: Vec<DeviceBatch> = batches
        .iter()
        .map(|b| transfer.to_device(b).unwrap())
        .collect();
    let back = transfer.to_host_batches(&on_device).unwrap();
    assert_eq!(back, batches);
    for (batch, on_device) in batches.iter().zip(&on_device) {
        assert_eq!(&transfer.to_host(on_device).unwrap(), batch);
    }
}

#[test]
fn the_direct_cpu_device_round_trips_without_copies() {
    let device = Arc::new(CpuDevice::direct());
    assert!(device.host_accessible());
    assert!(!CpuDevice::new().host_accessible());
    round_trips(device.clone(), TransferOptions::default());
    round_trips(device.clone(), small_chunks());
    assert_eq!(device.copy_count(), 0, "packed and unpacked by the host");
}

#[test]
#[cfg_attr(
    miri,
    ignore = "the link engine waits out modelled time, far too slow interpreted; the abi's link tests run under Miri"
)]
fn a_modelled_link_round_trips_in_stream_order() {
    // Fast enough to keep the test short; the copies still run on the engine's thread.
    let link = LinkModel::new(20e9, Duration::from_micros(1));
    let device = Arc::new(CpuDevice::with_link(link));
    assert_eq!(device.link(), Some(link));
    assert!(!device.host_accessible());
    round_trips(device.clone(), TransferOptions::default());
    round_trips(device.clone(), small_chunks());
    assert!(device.copy_count() > 10);
    // A batch in staging ("pinned") memory is copied straight from it, asynchronously.
    let pinned = pin_batch(device.as_ref(), &big_batch(200_000)).unwrap();
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let on_device = transfer.to_device(&pinned).unwrap();
    on_device.event().wait_host().unwrap();
    assert_eq!(transfer.to_host(&on_device).unwrap(), pinned);
    // Exported for a CPU consumer: the data is complete when the array is handed out.
    let (array, schema) = on_device.export().unwrap();
    assert!(array.sync_event().is_null());
    let back = devarrow_abi::cpu::import_record_batch(array, &schema).unwrap();
    assert_eq!(back, pinned);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "the link engine waits out modelled time, far too slow interpreted; the abi's link tests run under Miri"
)]
fn batches_dropped_early_leave_the_link_consistent() {
    let device = Arc::new(CpuDevice::with_link(LinkModel::new(
        5e9,
        Duration::from_micros(5),
    )));
    let mut transfer = Transfer::new(device.clone(), small_chunks());
    let batch = big_batch(200_000);
    for _ in 0..5 {
        // Dropped before its copies have completed: its memory goes back to the pool,
        // and the next allocation reuses it behind those copies (stream order).
        drop(transfer.to_device(&batch).unwrap());
    }
    let on_device = transfer.to_device(&batch).unwrap();
    assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
    drop(on_device);
    device.synchronize().unwrap();
    assert!(device.memory_pool_stats().hits > 0);
    assert!(device.trim_memory_pool() > 0);
}

#[test]
fn downloads_reuse_the_host_pool() {
    for device in [
        Arc::new(CpuDevice::new()) as Arc<dyn Device>,
        Arc::new(CpuDevice::direct()),
    ] {
        // Pageable downloads (the pinned pool is the next test's).
        let pageable = TransferOptions::default().with_pinned_host_bytes(0);
        let mut transfer = Transfer::new(device.clone(), pageable);
        let pool = transfer.host_pool().expect("a pool by default").clone();
        let batch = big_batch(100_000);
        let on_device = transfer.to_device(&batch).unwrap();
        let first = transfer.to_host(&on_device).unwrap();
        assert_eq!(first, batch);
        assert_eq!(pool.stats().misses, 1);
        assert!(pool.stats().in_use_bytes >= on_device.device_bytes());
        // The memory stays with the batch (and its columns) until they are dropped.
        let column = first.column(1).clone();
        drop(first);
        assert_eq!(pool.stats().cached_bytes, 0);
        drop(column);
        assert!(pool.stats().cached_bytes >= on_device.device_bytes());
        let second = transfer.to_host(&on_device).unwrap();
        assert_eq!(second, batch);
        assert_eq!((pool.stats().hits, pool.stats().misses), (1, 1));

        // A pool of the caller's, shared; or none: fresh allocations.
        let shared = Arc::new(HostPool::new(1 << 30));
        transfer.set_host_pool(Some(shared.clone()));
        assert_eq!(transfer.to_host(&on_device).unwrap(), batch);
        assert_eq!(shared.stats().misses, 1);
        let mut fresh = Transfer::new(device, pageable.with_host_pool_bytes(0));
        assert!(fresh.host_pool().is_none());
        assert_eq!(fresh.to_host(&on_device).unwrap(), batch);
    }
}

/// Downloads land in the transfer's pool of pinned memory, copied there directly (one
/// copy per batch, no staging, nothing to unpack); a batch's memory goes back to the
/// pool when the batch is dropped, and the next download reuses it; a batch brought back
/// uploads again by direct copies; when the pool is full, downloads fall back to
/// pageable memory and say why.
#[test]
fn downloads_land_in_the_pinned_pool_and_reuse_it() {
    let device = Arc::new(CpuDevice::new());
    let batch = big_batch(100_000 / MIRI_SCALE);
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let on_device = transfer.to_device(&batch).unwrap();
    let before = device.copy_count();
    let first = transfer.to_host(&on_device).unwrap();
    assert_eq!(first, batch);
    assert_eq!(device.copy_count() - before, 1, "one direct copy");
    let pool = transfer.pinned_host_pool().expect("made").clone();
    assert!(pool.is_pinned());
    assert_eq!(pool.stats().misses, 1);
    assert_eq!(transfer.stats().to_host.unpack, Duration::ZERO);
    for column in first.columns() {
        let data = column.to_data();
        for buffer in data.buffers() {
            assert!(device.is_pinned(buffer.as_ptr(), buffer.len()));
        }
    }
    // The round trip: every buffer of the batch lies in one pinned block, copied up in
    // one direct copy.
    let before = device.copy_count();
    let again = transfer.to_device(&first).unwrap();
    assert_eq!(device.copy_count() - before, 1, "one direct copy up");
    assert_eq!(transfer.to_host(&again).unwrap(), batch);
    drop(first);
    let second = transfer.to_host(&on_device).unwrap();
    assert_eq!(second, batch);
    assert!(pool.stats().hits >= 1, "{:?}", pool.stats());
    assert_eq!(transfer.host_memory_note(), None);

    // A pool too small for two batches at once: the second falls back, and says so.
    let mut small = Transfer::new(
        device.clone(),
        TransferOptions::default().with_pinned_host_bytes(on_device.device_bytes() * 5 / 4 + 64),
    );
    let held = small.to_host(&on_device).unwrap();
    let fallback = small.to_host(&on_device).unwrap();
    assert_eq!((held, fallback.clone()), (batch.clone(), batch.clone()));
    let stats = small.stats();
    assert_eq!((stats.pinned_downloads, stats.pageable_downloads), (1, 1));
    let note = small.host_memory_note().expect("a note");
    assert!(note.contains("was full"), "{note}");
    assert!(fallback
        .column(0)
        .to_data()
        .buffers()
        .iter()
        .all(|b| !device.is_pinned(b.as_ptr(), b.len())));
}

#[test]
fn stage_times_add_up_per_direction() {
    let mut devices = vec![
        Arc::new(CpuDevice::new()) as Arc<dyn Device>,
        Arc::new(CpuDevice::direct()),
    ];
    // The link engine waits out modelled time, far too slow interpreted.
    if !cfg!(miri) {
        devices.push(Arc::new(CpuDevice::with_link(LinkModel::new(
            50e9,
            Duration::ZERO,
        ))));
    }
    for device in devices {
        let staged = !device.host_accessible();
        let mut transfer = Transfer::new(device, small_chunks());
        let batches = [big_batch(200_000), big_batch(1000)];
        let on_device: Vec<DeviceBatch> = batches
            .iter()
            .map(|b| transfer.to_device(b).unwrap())
            .collect();
        let bytes: usize = on_device.iter().map(DeviceBatch::device_bytes).sum();
        let stats = transfer.stats();
        let up = stats.to_device;
        assert_eq!((up.batches, up.bytes), (2, bytes as u64));
        assert!(
            up.plan > Duration::ZERO && up.pack > Duration::ZERO,
            "{up:?}"
        );
        if staged {
            assert!(up.copy > Duration::ZERO, "{up:?}");
        }
        assert_eq!((up.unpack, up.validate), (Duration::ZERO, Duration::ZERO));
        assert_eq!(stats.to_host, Default::default());

        let back = transfer.to_host_batches(&on_device).unwrap();
        assert_eq!(back, batches);
        let down = transfer.take_stats().to_host;
        assert_eq!((down.batches, down.bytes), (2, bytes as u64));
        // Staged downloads land in pinned memory, copied there directly: nothing to
        // unpack.
        assert_eq!(staged, down.unpack == Duration::ZERO, "{down:?}");
        assert!(down.validate > Duration::ZERO);
        assert_eq!(staged, down.copy > Duration::ZERO, "{down:?}");
        assert_eq!(down.pack, Duration::ZERO);
        assert!(down.total() >= down.unpack + down.validate);
        assert_eq!(transfer.stats(), Default::default(), "taken");
    }
}
