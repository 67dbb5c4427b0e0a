//! Test support for the bridge: counting the release calls of exported arrays, and a
//! device that counts what the bridge asks of it.
#![allow(dead_code)]

pub mod random;

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use devarrow_abi::device::{CpuDevice, Device, DeviceCopy, DeviceMemory, StagingMemory, SyncEvent};
use devarrow_abi::{ArrowArray, ArrowDeviceType, DeviceArray};

struct Counted {
    release: unsafe extern "C" fn(*mut ArrowArray),
    private_data: *mut c_void,
    count: Arc<AtomicUsize>,
}

unsafe extern "C" fn counting_release(array: *mut ArrowArray) {
    // SAFETY: installed by `count_releases` on an unreleased array whose private data is a
    // Box<Counted>; the original release and private data are restored before chaining.
    unsafe {
        let array = &mut *array;
        let counted = Box::from_raw(array.private_data.cast::<Counted>());
        array.private_data = counted.private_data;
        array.release = Some(counted.release);
        (counted.release)(array);
        counted.count.fetch_add(1, Ordering::SeqCst);
    }
}

/// Wraps the release callback of `array` so calls are counted.
pub fn count_releases(array: DeviceArray) -> (DeviceArray, Arc<AtomicUsize>) {
    let count = Arc::new(AtomicUsize::new(0));
    let mut raw = array.into_raw();
    let counted = Box::new(Counted {
        release: raw.array.release.expect("unreleased"),
        private_data: raw.array.private_data,
        count: count.clone(),
    });
    raw.array.private_data = Box::into_raw(counted).cast();
    raw.array.release = Some(counting_release);
    (DeviceArray::try_new(raw).unwrap(), count)
}

/// The number of release calls so far.
pub fn releases(count: &Arc<AtomicUsize>) -> usize {
    count.load(Ordering::SeqCst)
}

/// The CPU device, counting its on-device batched copies and its device-to-host copies,
/// and optionally posing as another device type and id.
#[derive(Debug, Default)]
pub struct CountingDevice {
    inner: CpuDevice,
    /// `(device type, device id)` to report instead of the CPU's.
    pub pose_as: Option<(ArrowDeviceType, i64)>,
    on_device: AtomicU64,
    on_device_bytes: AtomicU64,
    to_host: AtomicU64,
}

impl CountingDevice {
    /// A counting CPU device.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    /// Calls of `copy_on_device` so far.
    pub fn on_device_copies(&self) -> u64 {
        self.on_device.load(Ordering::SeqCst)
    }
    /// Bytes copied by `copy_on_device` so far.
    pub fn on_device_bytes(&self) -> u64 {
        self.on_device_bytes.load(Ordering::SeqCst)
    }
    /// Calls of `copy_to_host` so far.
    pub fn host_copies(&self) -> u64 {
        self.to_host.load(Ordering::SeqCst)
    }
}

impl Device for CountingDevice {
    fn device_type(&self) -> ArrowDeviceType {
        self.pose_as.map_or(self.inner.device_type(), |p| p.0)
    }
    fn device_id(&self) -> i64 {
        self.pose_as.map_or(self.inner.device_id(), |p| p.1)
    }
    fn allocate(&self, len: usize) -> devarrow_abi::Result<Arc<dyn DeviceMemory>> {
        self.inner.allocate(len)
    }
    fn allocate_staging(&self, len: usize) -> devarrow_abi::Result<Box<dyn StagingMemory>> {
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
        self.to_host.fetch_add(1, Ordering::SeqCst);
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
