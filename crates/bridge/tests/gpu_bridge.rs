//! The bridge on CUDA ([`CudaTransferDevice`]), in one test binary: the same planning,
//! packing and rebuilding code that `cpu_bridge.rs` checks on the CPU device, now with
//! device memory, pinned staging, asynchronous copies and `CUevent` sync events.
//!
//! Without a usable GPU each test prints `skipping: <reason>` and passes, unless the
//! environment sets `DEVARROW_REQUIRE_GPU=1`, in which case it fails.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch};
use devarrow_abi::device::{Device, DeviceMemory, StagingMemory, SyncEvent};
use devarrow_abi::ArrowDeviceType;
use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_cuda::cudarc::driver::{result, sys};
use devarrow_cuda::{
    kernels, CudaDevice, CudaMemory as _, CudaTransferDevice, DeviceBuffer, ImportedArray,
};
use devarrow_interop::sample;

/// Device 0 with the test lock held, or `None` after printing why the test is skipped
/// (panics instead when `DEVARROW_REQUIRE_GPU=1`).
fn gpu() -> Option<(MutexGuard<'static, ()>, Arc<CudaTransferDevice>)> {
    devarrow_cuda::gpu_test::open_or_skip(|| CudaTransferDevice::open(0).map(Arc::new))
}

macro_rules! gpu_or_skip {
    () => {
        match gpu() {
            Some(held) => held,
            None => return,
        }
    };
}

fn transfer(device: &Arc<CudaTransferDevice>) -> Transfer {
    Transfer::new(device.clone(), TransferOptions::default())
}

/// Host -> CUDA -> host, checking the device batch and validating what came back.
fn round_trip(transfer: &mut Transfer, batch: &RecordBatch) -> RecordBatch {
    let on_device = transfer.to_device(batch).unwrap();
    assert_eq!(on_device.num_rows(), batch.num_rows());
    assert_eq!(on_device.device().device_type(), ArrowDeviceType::CUDA);
    let back = transfer.to_host(&on_device).unwrap();
    for column in back.columns() {
        column.to_data().validate_full().unwrap();
    }
    back
}

fn wide_batch(columns: usize, rows: usize) -> RecordBatch {
    RecordBatch::try_from_iter((0..columns).map(|c| {
        let col: ArrayRef = Arc::new(Int64Array::from_iter(
            (0..rows as i64).map(|i| (i % 7 != 0).then_some(i * (c as i64 + 1))),
        ));
        (format!("c{c}"), col)
    }))
    .unwrap()
}

/// Free device memory after synchronizing and trimming the pool.
fn free_memory(dev: &CudaDevice) -> usize {
    dev.synchronize().unwrap();
    dev.trim_memory_pool().unwrap();
    dev.memory_info().unwrap().0
}

/// The `CUevent` a `sync_event` points to.
fn event_of(sync_event: *mut c_void) -> sys::CUevent {
    assert!(
        !sync_event.is_null(),
        "a CUDA export must carry a sync event"
    );
    // SAFETY: for ARROW_DEVICE_CUDA the bridge's sync_event points to a live CUevent,
    // kept alive by the (unreleased) export the caller holds.
    unsafe { *sync_event.cast::<sys::CUevent>() }
}

#[test]
fn every_type_round_trips_through_cuda() {
    let (_lock, device) = gpu_or_skip!();
    let batch = sample::every_type_batch();
    let mut transfer = transfer(&device);
    let back = round_trip(&mut transfer, &batch);
    if let Some(diff) = sample::describe_difference(&batch, &back) {
        panic!("{diff}");
    }
    assert_eq!(back, batch);
    assert!(device.cuda_device().context().check_err().is_ok());
}

#[test]
fn every_slice_of_every_type_round_trips_through_cuda() {
    let (_lock, device) = gpu_or_skip!();
    let batch = sample::every_type_batch();
    let n = batch.num_rows();
    let mut transfer = transfer(&device);
    for offset in 0..=n {
        for len in [0, 1, 2, 3, n - offset] {
            if offset + len > n {
                continue;
            }
            let slice = batch.slice(offset, len);
            let back = round_trip(&mut transfer, &slice);
            if let Some(diff) = sample::describe_difference(&slice, &back) {
                panic!("slice {offset}+{len}: {diff}");
            }
            assert_eq!(back, slice, "slice {offset}+{len}");
        }
    }
    let sliced = sample::sliced_every_type_batch();
    assert_eq!(round_trip(&mut transfer, &sliced), sliced);
}

#[test]
fn a_hundred_small_columns_move_in_one_copy_each_way() {
    let (_lock, device) = gpu_or_skip!();
    let batch = wide_batch(100, 1000);
    let mut transfer = transfer(&device);
    let on_device = transfer.to_device(&batch).unwrap();
    assert_eq!(device.copy_count(), 1, "one DMA for the whole batch");
    let back = transfer.to_host(&on_device).unwrap();
    assert_eq!(device.copy_count(), 2, "and one back");
    assert_eq!(back, batch);
}

/// A device that records the staging allocations of the CUDA device it wraps.
#[derive(Debug)]
struct RecordingDevice {
    inner: Arc<CudaTransferDevice>,
    staging: Mutex<Vec<usize>>,
}

impl Device for RecordingDevice {
    fn device_type(&self) -> ArrowDeviceType {
        self.inner.device_type()
    }
    fn device_id(&self) -> i64 {
        self.inner.device_id()
    }
    fn allocate(&self, len: usize) -> devarrow_abi::Result<Arc<dyn DeviceMemory>> {
        self.inner.allocate(len)
    }
    fn allocate_staging(&self, len: usize) -> devarrow_abi::Result<Box<dyn StagingMemory>> {
        self.staging.lock().unwrap().push(len);
        self.inner.allocate_staging(len)
    }
    unsafe fn copy_to_device(
        &self,
        src: *const u8,
        dst: *mut c_void,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_device(src, dst, len) }
    }
    unsafe fn copy_to_host(
        &self,
        src: *const c_void,
        dst: *mut u8,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_host(src, dst, len) }
    }
    fn record_event(&self) -> devarrow_abi::Result<Arc<dyn SyncEvent>> {
        self.inner.record_event()
    }
    unsafe fn wait_sync_event(&self, sync_event: *mut c_void) -> devarrow_abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.wait_sync_event(sync_event) }
    }
    fn synchronize(&self) -> devarrow_abi::Result<()> {
        self.inner.synchronize()
    }
    fn copy_count(&self) -> u64 {
        self.inner.copy_count()
    }
}

#[test]
fn staging_is_bounded_and_copies_are_chunked() {
    let (_lock, device) = gpu_or_skip!();
    let batch = wide_batch(4, 100_000); // ~3.3 MB
    let bound = 1 << 20;
    let recording = Arc::new(RecordingDevice {
        inner: device.clone(),
        staging: Mutex::new(Vec::new()),
    });
    let mut transfer = Transfer::new(
        recording.clone(),
        TransferOptions {
            staging_bytes: bound,
            ..Default::default()
        },
    );
    let on_device = transfer.to_device(&batch).unwrap();
    let chunks = on_device.device_bytes().div_ceil(bound / 2) as u64;
    assert!(chunks > 4, "the batch should need several chunks");
    assert_eq!(device.copy_count(), chunks, "one copy per 512 KiB chunk");
    let back = transfer.to_host(&on_device).unwrap();
    assert_eq!(device.copy_count(), 2 * chunks, "and as many back");
    assert_eq!(back, batch);
    let staging = recording.staging.lock().unwrap().clone();
    assert!(
        staging.len() <= 2 && staging.iter().sum::<usize>() <= bound,
        "staging allocations {staging:?} exceed the {bound}-byte bound"
    );
    // A second batch reuses the staging buffers.
    let again = transfer.to_device(&batch).unwrap();
    assert_eq!(transfer.to_host(&again).unwrap(), batch);
    assert_eq!(recording.staging.lock().unwrap().len(), staging.len());
}

#[test]
fn the_sync_event_is_a_stable_pointer_to_a_live_cuevent() {
    let (_lock, device) = gpu_or_skip!();
    let event = device.record_event().unwrap();
    let ptr = event.as_sync_event_ptr();
    let clone = event.clone();
    assert_eq!(clone.as_sync_event_ptr(), ptr);
    let handle = event_of(ptr);
    // SAFETY: the event is alive (we hold it).
    let state = unsafe { result::event::query(handle) };
    assert!(
        state.is_ok() || state == Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)),
        "not a live event: {state:?}"
    );
    event.wait_host().unwrap();
    // Waiting on a recorded event, and on none, enqueues without blocking.
    // SAFETY: `ptr` points to our live event.
    unsafe { device.wait_sync_event(ptr) }.unwrap();
    // SAFETY: NULL means "ready".
    unsafe { device.wait_sync_event(std::ptr::null_mut()) }.unwrap();
    device.synchronize().unwrap();
    // An empty allocation still has a real device address.
    let empty = device.allocate(0).unwrap();
    assert_eq!(empty.len(), 0);
    assert!(!empty.address().is_null());
    let staging = device.allocate_staging(4096).unwrap();
    assert_eq!(staging.as_slice().len(), 4096);
    let baseline = device.pinned_copy_baseline(8 << 20, 2).unwrap();
    println!("pinned baseline: {baseline:?}");
    assert!(baseline.host_to_device > Duration::ZERO);
    assert!(baseline.device_to_host > Duration::ZERO);
    assert_eq!(device.copy_count(), 0, "the baseline is not a bridge copy");
}

#[test]
fn export_carries_a_cuevent_and_imports_with_the_consumer_waiting() {
    let (_lock, device) = gpu_or_skip!();
    let dev = device.cuda_device().clone();
    // Everything that could synchronize the context is created before the spinning
    // producer is launched: the consumer stream, the staging buffers (a warm-up transfer).
    let consumer = dev.new_stream().unwrap();
    let rows = 1 << 16;
    let batch = wide_batch(3, rows);
    let mut transfer = transfer(&device);
    let warm = transfer.to_device(&batch).unwrap();
    assert_eq!(transfer.to_host(&warm).unwrap(), batch);
    drop(warm);
    let scratch = DeviceBuffer::alloc(device.stream(), 4 * 1024).unwrap();
    // Keep the transfer stream busy for 300 ms, so the copies to the device (enqueued
    // after the spin) are still pending when the batch is exported and imported.
    // SAFETY: `scratch` holds 4 * 1024 bytes and lives until the end of the test (after
    // the stream is synchronized).
    unsafe {
        kernels::testing::launch_spin_fill_u32(
            device.stream(),
            scratch.device_ptr(),
            1024,
            7,
            300_000_000,
        )
        .unwrap()
    };
    let on_device: DeviceBatch = transfer.to_device(&batch).unwrap();
    let (exported, _schema) = on_device.export().unwrap();
    assert_eq!(exported.device_type(), ArrowDeviceType::CUDA);
    assert_eq!(exported.device_id(), 0);
    assert_eq!(exported.array().length, rows as i64);
    assert_eq!(exported.array().n_children, 3);
    let event = event_of(exported.sync_event());
    // SAFETY: the event is alive (the export is unreleased).
    let pending = unsafe { result::event::query(event) };
    assert_eq!(
        pending,
        Err(result::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)),
        "the copies should still wait behind the spinning kernel"
    );
    drop(on_device); // the export keeps the memory and the event alive

    let t = Instant::now();
    let imported = ImportedArray::import(exported, &consumer).unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(150),
        "import must not block the host"
    );
    assert_eq!(imported.sync_event(), event);
    for (c, column) in batch.columns().iter().enumerate() {
        let column = column.as_any().downcast_ref::<Int64Array>().unwrap();
        let node = imported.array().child(c).unwrap();
        assert_eq!(node.length, rows as i64);
        assert_eq!(node.offset, 0);
        assert_eq!(node.null_count, column.null_count() as i64);
        // SAFETY: buffer 1 of an Int64 child holds `rows` values.
        let values = unsafe { imported.buffer(node, 1, 8 * rows) }.unwrap();
        assert_eq!(
            values.to_host(&consumer).unwrap(),
            column.values().inner().as_slice(),
            "column {c}: the consumer read before the producer's copies finished"
        );
        // SAFETY: buffer 0 is the validity bitmap of ceil(rows / 8) bytes.
        let bits = unsafe { imported.buffer(node, 0, rows.div_ceil(8)) }.unwrap();
        assert_eq!(
            bits.to_host(&consumer).unwrap(),
            column.nulls().unwrap().inner().sliced().as_slice(),
            "column {c} validity"
        );
    }
    drop(imported);
    device.synchronize().unwrap();
    drop(scratch);
    assert!(dev.context().check_err().is_ok());
}

#[test]
fn every_type_batch_exports_as_a_cuda_device_array() {
    let (_lock, device) = gpu_or_skip!();
    let consumer = device.cuda_device().new_stream().unwrap();
    let batch = sample::every_type_batch();
    let mut transfer = transfer(&device);
    for b in [batch.clone(), batch.slice(1, 4), batch.slice(0, 0)] {
        let on_device = transfer.to_device(&b).unwrap();
        let (exported, schema) = on_device.export().unwrap();
        assert_eq!(exported.device_type(), ArrowDeviceType::CUDA);
        assert_eq!(exported.device_id(), device.device_id());
        assert_eq!(exported.array().length, b.num_rows() as i64);
        assert_eq!(exported.array().n_children, b.num_columns() as i64);
        event_of(exported.sync_event());
        assert!(arrow_schema::Schema::try_from(&schema).is_ok());
        let imported = ImportedArray::import(exported, &consumer).unwrap();
        imported.synchronize_host().unwrap();
        // The device copy is intact after the export and import.
        assert_eq!(transfer.to_host(&on_device).unwrap(), b);
    }
}

#[test]
fn imports_release_the_device_memory_when_dropped() {
    let (_lock, device) = gpu_or_skip!();
    let dev = device.cuda_device().clone();
    let consumer = dev.new_stream().unwrap();
    let mut transfer = transfer(&device);
    let cycle = |transfer: &mut Transfer, batch: &RecordBatch| {
        let on_device = transfer.to_device(batch).unwrap();
        let (exported, _) = on_device.export().unwrap();
        drop(on_device);
        let imported = ImportedArray::import(exported, &consumer).unwrap();
        let node = imported.array().child(0).unwrap();
        // SAFETY: buffer 1 of the Int64 child holds num_rows values.
        let v = unsafe { imported.buffer(node, 1, 8 * batch.num_rows()) }.unwrap();
        drop(imported);
        assert_eq!(v.len(), 8 * batch.num_rows());
        drop(v); // the producer's release runs here
    };

    // One big batch: held while the import lives, freed when it drops.
    let big = wide_batch(8, 1 << 20); // 64 MiB of values
    cycle(&mut transfer, &wide_batch(8, 1024)); // warm up staging, pools
    let before = free_memory(&dev);
    let on_device = transfer.to_device(&big).unwrap();
    let (exported, _) = on_device.export().unwrap();
    drop(on_device);
    let imported = ImportedArray::import(exported, &consumer).unwrap();
    let during = free_memory(&dev);
    assert!(
        during + (32 << 20) <= before,
        "64 MiB should be in use while imported ({before} -> {during})"
    );
    // Released from another thread, which has no current context.
    std::thread::spawn(move || drop(imported)).join().unwrap();
    let after = free_memory(&dev);
    assert!(after + (4 << 20) >= before, "leaked: {before} -> {after}");

    // Many small cycles.
    let small = wide_batch(4, 10_000);
    cycle(&mut transfer, &small);
    let before = free_memory(&dev);
    for _ in 0..2000 {
        cycle(&mut transfer, &small);
    }
    assert!(dev.context().check_err().is_ok());
    let after = free_memory(&dev);
    println!("free device memory before {before}, after {after}");
    assert!(after + (4 << 20) >= before, "leaked: {before} -> {after}");
}
