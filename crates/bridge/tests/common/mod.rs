//! Test support for the bridge: counting the release calls of exported arrays (shared
//! with the abi's tests, from `devarrow-testing`), a device that counts what the bridge asks of it, and the GPU
//! skip logic of the CUDA test binaries.
#![allow(dead_code)]

#[allow(unused_imports)]
pub use devarrow_testing::random;

pub mod libcudf;
#[allow(unused_imports)]
pub use devarrow_testing::release::{count_releases, releases};

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arrow_array::{RecordBatch, RecordBatchIterator, RecordBatchReader};
use devarrow_abi::device::{
    CopyCounter, CpuDevice, Device, DeviceCopy, DeviceMemory, DeviceToHost, HostRegistration,
    HostToDevice, StagingMemory, SyncEvent,
};
use devarrow_abi::{ArrowDeviceType, Error};
use devarrow_cuda::CudaDevice;

/// Device 0 with the test lock held, or `None` after printing why the test is skipped
/// (panics instead when `DEVARROW_REQUIRE_GPU=1`).
pub fn gpu() -> Option<(MutexGuard<'static, ()>, Arc<CudaDevice>)> {
    devarrow_testing::gpu::open_or_skip(|| CudaDevice::open(0).map(Arc::new))
}

/// [`gpu`], or returns from the test.
#[allow(unused_macros)]
macro_rules! gpu_or_skip {
    () => {
        match $crate::common::gpu() {
            Some(held) => held,
            None => return,
        }
    };
}
#[allow(unused_imports)]
pub(crate) use gpu_or_skip;

/// A reader of `batches` (at least one).
pub fn reader_of(batches: &[RecordBatch]) -> Box<dyn RecordBatchReader + Send> {
    Box::new(RecordBatchIterator::new(
        batches.iter().cloned().map(Ok).collect::<Vec<_>>(),
        batches[0].schema(),
    ))
}

/// The levels of arrays under a column of type `data_type`: 1 for a flat column, one more
/// per level of children (dictionary values included).
pub fn nesting(data_type: &arrow_schema::DataType) -> usize {
    let below = match data_type {
        arrow_schema::DataType::Dictionary(_, values) => nesting(values),
        dt => devarrow_abi::layout::child_types(dt)
            .into_iter()
            .map(nesting)
            .max()
            .unwrap_or(0),
    };
    1 + below
}

/// The most read-backs the import of a small batch (columns of at most 64 rows and runs)
/// of `schema` takes: what its rows reach is read back level by level (a level of
/// offsets, list views, views or dense unions: one read-back; a run-end encoded level
/// with up to 64 runs: two), the sizes at every array's own bounds with the first.
pub fn max_read_backs(schema: &arrow_schema::Schema) -> u64 {
    let depth = schema
        .fields()
        .iter()
        .map(|f| nesting(f.data_type()))
        .max()
        .unwrap_or(0);
    1 + 2 * depth as u64
}

/// Asserts the batches are equal, saying where they differ first.
pub fn assert_batches_eq(expected: &[RecordBatch], actual: &[RecordBatch]) {
    assert_eq!(expected.len(), actual.len(), "number of batches");
    for (k, (e, a)) in expected.iter().zip(actual).enumerate() {
        if let Some(diff) = devarrow_testing::sample::describe_difference(e, a) {
            panic!("batch {k}: {diff}");
        }
        assert_eq!(e, a, "batch {k}");
    }
}

/// A device wrapping another one (the CPU device by default), forwarding every call and
/// counting what is asked of it: allocations (and the live ones, device and staging
/// memory), staging sizes, bytes copied to the device, copies to the host and batched
/// copies on the device, synchronizations. Optionally it poses as another device type and
/// id, refuses allocations after a number of them, fails the host waits of its events
/// ([`InstrumentedDevice::fail_waits`]), or reports the inner device's pinned memory
/// (otherwise it reports none, as the trait's default does).
#[derive(Debug)]
pub struct InstrumentedDevice {
    inner: Arc<dyn CountedDevice>,
    /// `(device type, device id)` to report instead of the inner device's.
    pub pose_as: Option<(ArrowDeviceType, i64)>,
    /// Refuse every `allocate` from this many on.
    pub fail_allocations_after: Option<usize>,
    /// Staging allocations of at least this many bytes are refused (a runtime that will
    /// not pin that much host memory).
    pub refuse_staging_from: Option<usize>,
    /// Fail every `record_event` from this many on.
    pub fail_events_after: Option<usize>,
    /// Forward `is_pinned` to the inner device.
    pub report_pinned: bool,
    /// Pose as a device that registers pageable memory from this size on
    /// (`register_host` hands out counted registrations of a range's whole pages, and
    /// changes nothing else).
    pub register_from: Option<usize>,
    registrations: Arc<AtomicUsize>,
    /// The whole-page ranges `register_host` registered, and the host ranges of the
    /// batched (direct) copies.
    registered_pages: Mutex<Vec<std::ops::Range<usize>>>,
    batched_host_ranges: Mutex<Vec<std::ops::Range<usize>>>,
    registered: AtomicUsize,
    batch_calls: AtomicU64,
    /// While set, `wait_host` fails on every event this device recorded (before or after).
    fail_waits: Arc<AtomicBool>,
    /// Host waits on the events this device recorded.
    event_waits: Arc<AtomicU64>,
    synchronizations: AtomicU64,
    allocations: AtomicUsize,
    events: AtomicUsize,
    live: Arc<AtomicUsize>,
    staging: Mutex<Vec<usize>>,
    bytes_to_device: AtomicU64,
    to_host: AtomicU64,
    bytes_to_host: AtomicU64,
    on_device: AtomicU64,
    on_device_bytes: AtomicU64,
}

/// A device that counts its host-device copies: what [`InstrumentedDevice`] wraps (the
/// CPU and CUDA devices are).
pub trait CountedDevice: Device + CopyCounter {}

impl<T: Device + CopyCounter + ?Sized> CountedDevice for T {}

/// The inner device's count.
impl CopyCounter for InstrumentedDevice {
    fn copy_count(&self) -> u64 {
        self.inner.copy_count()
    }
}

impl Default for InstrumentedDevice {
    fn default() -> Self {
        Self::wrapping(Arc::new(CpuDevice::new()))
    }
}

impl InstrumentedDevice {
    /// An instrumented CPU device.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    /// Instruments `inner`.
    pub fn wrapping(inner: Arc<dyn CountedDevice>) -> Self {
        Self {
            inner,
            pose_as: None,
            fail_allocations_after: None,
            refuse_staging_from: None,
            fail_events_after: None,
            report_pinned: false,
            register_from: None,
            registrations: Arc::new(AtomicUsize::new(0)),
            registered_pages: Mutex::new(Vec::new()),
            batched_host_ranges: Mutex::new(Vec::new()),
            registered: AtomicUsize::new(0),
            batch_calls: AtomicU64::new(0),
            fail_waits: Arc::new(AtomicBool::new(false)),
            event_waits: Arc::new(AtomicU64::new(0)),
            synchronizations: AtomicU64::new(0),
            allocations: AtomicUsize::new(0),
            events: AtomicUsize::new(0),
            live: Arc::new(AtomicUsize::new(0)),
            staging: Mutex::new(Vec::new()),
            bytes_to_device: AtomicU64::new(0),
            to_host: AtomicU64::new(0),
            bytes_to_host: AtomicU64::new(0),
            on_device: AtomicU64::new(0),
            on_device_bytes: AtomicU64::new(0),
        }
    }
    /// Reports `device_type` and `device_id` instead of the inner device's.
    pub fn posing_as(mut self, device_type: ArrowDeviceType, device_id: i64) -> Self {
        self.pose_as = Some((device_type, device_id));
        self
    }
    /// Refuses every `allocate` after the first `n`.
    pub fn failing_allocations_after(mut self, n: usize) -> Self {
        self.fail_allocations_after = Some(n);
        self
    }
    /// Fails every `record_event` after the first `n`.
    pub fn refusing_staging_from(mut self, bytes: usize) -> Self {
        self.refuse_staging_from = Some(bytes);
        self
    }

    pub fn failing_events_after(mut self, n: usize) -> Self {
        self.fail_events_after = Some(n);
        self
    }
    /// Reports the inner device's pinned memory as pinned.
    pub fn reporting_pinned(mut self) -> Self {
        self.report_pinned = true;
        self
    }
    /// Poses as a device that registers pageable memory from `bytes` on.
    pub fn registering_from(mut self, bytes: usize) -> Self {
        self.register_from = Some(bytes);
        self
    }
    /// The host ranges of batched (direct) copies that lie in no whole-page range
    /// `register_host` registered: what a real driver would take for pageable memory.
    pub fn direct_copies_outside_registered_pages(&self) -> Vec<std::ops::Range<usize>> {
        let pages = self.registered_pages.lock().unwrap();
        let copies = self.batched_host_ranges.lock().unwrap();
        copies
            .iter()
            .filter(|c| !pages.iter().any(|p| p.start <= c.start && c.end <= p.end))
            .cloned()
            .collect()
    }
    /// `(alive, made)`: registrations of `register_host` alive now, and made so far.
    pub fn registrations(&self) -> (usize, usize) {
        (
            self.registrations.load(Ordering::SeqCst),
            self.registered.load(Ordering::SeqCst),
        )
    }
    /// Calls of `copy_batch_to_device` and `copy_batch_to_host` so far.
    pub fn batch_calls(&self) -> u64 {
        self.batch_calls.load(Ordering::SeqCst)
    }
    /// Device and staging allocations still alive.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }
    /// The sizes of the staging allocations so far.
    pub fn staging_sizes(&self) -> Vec<usize> {
        self.staging.lock().unwrap().clone()
    }
    /// Calls of `allocate_staging` so far.
    pub fn staging_allocations(&self) -> usize {
        self.staging.lock().unwrap().len()
    }
    /// Bytes copied by `copy_to_device` so far.
    pub fn bytes_to_device(&self) -> u64 {
        self.bytes_to_device.load(Ordering::SeqCst)
    }
    /// Calls of `copy_to_host` so far.
    pub fn host_copies(&self) -> u64 {
        self.to_host.load(Ordering::SeqCst)
    }
    /// Bytes copied by `copy_to_host` and `copy_batch_to_host` so far: what crossed
    /// the link from the device.
    pub fn bytes_to_host(&self) -> u64 {
        self.bytes_to_host.load(Ordering::SeqCst)
    }
    /// Calls of `copy_on_device` so far.
    pub fn on_device_copies(&self) -> u64 {
        self.on_device.load(Ordering::SeqCst)
    }
    /// Bytes copied by `copy_on_device` so far.
    pub fn on_device_bytes(&self) -> u64 {
        self.on_device_bytes.load(Ordering::SeqCst)
    }
    /// Makes `wait_host` fail (`true`) or work again (`false`) on every event this device
    /// recorded.
    pub fn fail_waits(&self, fail: bool) {
        self.fail_waits.store(fail, Ordering::SeqCst);
    }
    /// Calls of `synchronize` so far.
    pub fn synchronizations(&self) -> u64 {
        self.synchronizations.load(Ordering::SeqCst)
    }
    /// Times the host waited for the device so far: host waits on its events and calls
    /// of `synchronize`.
    pub fn host_waits(&self) -> u64 {
        self.event_waits.load(Ordering::SeqCst) + self.synchronizations()
    }
}

/// An event of an [`InstrumentedDevice`]: the inner device's, whose host wait fails while
/// the device's `fail_waits` is set.
#[derive(Debug)]
struct FailableEvent {
    inner: Arc<dyn SyncEvent>,
    fail: Arc<AtomicBool>,
    waits: Arc<AtomicU64>,
}

// SAFETY: waits on the wrapped event (or fails); the pointer is the wrapped event's.
unsafe impl SyncEvent for FailableEvent {
    fn as_sync_event_ptr(&self) -> *mut c_void {
        self.inner.as_sync_event_ptr()
    }
    fn wait_host(&self) -> devarrow_abi::Result<()> {
        self.waits.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return Err(Error::Device {
                device: "TEST",
                source: "event wait refused".into(),
            });
        }
        self.inner.wait_host()
    }
}

/// A registration of an [`InstrumentedDevice`]: counted alive until dropped.
#[derive(Debug)]
struct TestRegistration(Arc<AtomicUsize>);

impl HostRegistration for TestRegistration {}

impl Drop for TestRegistration {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Memory of an [`InstrumentedDevice`]: the inner device's, counted live until dropped.
#[derive(Debug)]
struct Counted<T> {
    inner: T,
    live: Arc<AtomicUsize>,
}

impl<T> Counted<T> {
    fn new(inner: T, live: &Arc<AtomicUsize>) -> Self {
        live.fetch_add(1, Ordering::SeqCst);
        Self {
            inner,
            live: live.clone(),
        }
    }
}

impl<T> Drop for Counted<T> {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

// SAFETY: delegates to the wrapped memory.
unsafe impl DeviceMemory for Counted<Arc<dyn DeviceMemory>> {
    fn address(&self) -> *mut c_void {
        self.inner.address()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

// SAFETY: delegates to the wrapped memory.
unsafe impl StagingMemory for Counted<Box<dyn StagingMemory>> {
    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.inner.as_mut_slice()
    }
    fn as_slice(&self) -> &[u8] {
        self.inner.as_slice()
    }
}

// SAFETY: delegates to the wrapped device, only counting calls and injecting failures
// (errors, which the contract allows).
unsafe impl Device for InstrumentedDevice {
    fn device_type(&self) -> ArrowDeviceType {
        self.pose_as.map_or(self.inner.device_type(), |p| p.0)
    }
    fn device_id(&self) -> i64 {
        self.pose_as.map_or(self.inner.device_id(), |p| p.1)
    }
    fn allocate(&self, len: usize) -> devarrow_abi::Result<Arc<dyn DeviceMemory>> {
        let n = self.allocations.fetch_add(1, Ordering::SeqCst);
        if self.fail_allocations_after.is_some_and(|limit| n >= limit) {
            return Err(Error::Device {
                device: "TEST",
                source: format!("allocation {n} of {len} bytes refused").into(),
            });
        }
        let inner = self.inner.allocate(len)?;
        Ok(Arc::new(Counted::new(inner, &self.live)))
    }
    fn allocate_staging(&self, len: usize) -> devarrow_abi::Result<Box<dyn StagingMemory>> {
        if self.refuse_staging_from.is_some_and(|from| len >= from) {
            return Err(Error::Device {
                device: "TEST",
                source: format!("{len} bytes of pinned memory refused").into(),
            });
        }
        self.staging.lock().unwrap().push(len);
        let inner = self.inner.allocate_staging(len)?;
        Ok(Box::new(Counted::new(inner, &self.live)))
    }
    fn try_allocate_staging(
        &self,
        len: usize,
    ) -> devarrow_abi::Result<Option<Box<dyn StagingMemory>>> {
        if self.refuse_staging_from.is_some_and(|from| len >= from) {
            return Err(Error::Device {
                device: "TEST",
                source: format!("{len} bytes of pinned memory refused").into(),
            });
        }
        let Some(inner) = self.inner.try_allocate_staging(len)? else {
            return Ok(None);
        };
        self.staging.lock().unwrap().push(len);
        Ok(Some(Box::new(Counted::new(inner, &self.live))))
    }
    fn reserve_staging(&self, bytes: usize) -> devarrow_abi::Result<()> {
        self.inner.reserve_staging(bytes)
    }
    unsafe fn copy_to_device(
        &self,
        src: *const u8,
        dst: *mut c_void,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        self.bytes_to_device.fetch_add(len as u64, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_device(src, dst, len) }
    }
    unsafe fn copy_to_host(
        &self,
        src: *const c_void,
        dst: *mut u8,
        len: usize,
    ) -> devarrow_abi::Result<()> {
        self.to_host.fetch_add(1, Ordering::SeqCst);
        self.bytes_to_host.fetch_add(len as u64, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_host(src, dst, len) }
    }
    unsafe fn copy_on_device(&self, copies: &[DeviceCopy]) -> devarrow_abi::Result<()> {
        self.on_device.fetch_add(1, Ordering::SeqCst);
        let bytes: usize = copies.iter().map(|c| c.len).sum();
        self.on_device_bytes
            .fetch_add(bytes as u64, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_on_device(copies) }
    }
    unsafe fn copy_batch_to_device(&self, copies: &[HostToDevice]) -> devarrow_abi::Result<()> {
        self.batch_calls.fetch_add(1, Ordering::SeqCst);
        self.batched_host_ranges.lock().unwrap().extend(
            copies
                .iter()
                .map(|c| c.src as usize..c.src as usize + c.len),
        );
        let bytes: usize = copies.iter().map(|c| c.len).sum();
        self.bytes_to_device
            .fetch_add(bytes as u64, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_batch_to_device(copies) }
    }
    unsafe fn copy_batch_to_host(&self, copies: &[DeviceToHost]) -> devarrow_abi::Result<()> {
        self.batch_calls.fetch_add(1, Ordering::SeqCst);
        self.batched_host_ranges.lock().unwrap().extend(
            copies
                .iter()
                .map(|c| c.dst as usize..c.dst as usize + c.len),
        );
        self.to_host
            .fetch_add(copies.len() as u64, Ordering::SeqCst);
        let bytes: usize = copies.iter().map(|c| c.len).sum();
        self.bytes_to_host.fetch_add(bytes as u64, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_batch_to_host(copies) }
    }
    fn host_registration_min_bytes(&self) -> Option<usize> {
        self.register_from
    }
    unsafe fn register_host(
        &self,
        ptr: *const u8,
        len: usize,
    ) -> devarrow_abi::Result<Option<Box<dyn HostRegistration>>> {
        let pages = devarrow_abi::device::whole_pages(ptr, len);
        if ptr.is_null() || pages.is_empty() || self.register_from.is_none_or(|from| len < from) {
            return Ok(None);
        }
        self.registered_pages.lock().unwrap().push(pages);
        self.registrations.fetch_add(1, Ordering::SeqCst);
        self.registered.fetch_add(1, Ordering::SeqCst);
        Ok(Some(Box::new(TestRegistration(self.registrations.clone()))))
    }
    fn record_event(&self) -> devarrow_abi::Result<Arc<dyn SyncEvent>> {
        let n = self.events.fetch_add(1, Ordering::SeqCst);
        if self.fail_events_after.is_some_and(|limit| n >= limit) {
            return Err(Error::Device {
                device: "TEST",
                source: format!("event {n} refused").into(),
            });
        }
        Ok(Arc::new(FailableEvent {
            inner: self.inner.record_event()?,
            fail: self.fail_waits.clone(),
            waits: self.event_waits.clone(),
        }))
    }
    unsafe fn wait_sync_event(&self, sync_event: *mut c_void) -> devarrow_abi::Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.wait_sync_event(sync_event) }
    }
    fn synchronize(&self) -> devarrow_abi::Result<()> {
        self.synchronizations.fetch_add(1, Ordering::SeqCst);
        self.inner.synchronize()
    }
    fn kernels(&self) -> Option<&dyn devarrow_abi::device::DeviceKernels> {
        self.inner.kernels()
    }
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        self.report_pinned && self.inner.is_pinned(ptr, len)
    }
}

#[allow(unused_imports)]
pub use devarrow_testing::watchdog::{watchdog, Watchdog};

/// A plain CPU device.
pub fn cpu() -> Arc<dyn Device> {
    Arc::new(CpuDevice::new())
}
