//! `Device::copy_on_device`: the CPU device's `memcpy`s, and the default implementation
//! (through host staging memory) that devices without their own get.

use std::ffi::c_void;
use std::sync::Arc;

use devarrow_abi::device::{
    CopyCounter, CpuDevice, Device, DeviceCopy, DeviceMemory, StagingMemory, SyncEvent,
};
use devarrow_abi::{ArrowDeviceType, Result};

/// A device that implements only what it must: `copy_on_device` is the trait's default.
#[derive(Debug, Default)]
struct Minimal(CpuDevice);

// SAFETY: delegates every call to a `CpuDevice`.
unsafe impl Device for Minimal {
    fn device_type(&self) -> ArrowDeviceType {
        self.0.device_type()
    }
    fn device_id(&self) -> i64 {
        self.0.device_id()
    }
    fn allocate(&self, len: usize) -> Result<Arc<dyn DeviceMemory>> {
        self.0.allocate(len)
    }
    fn allocate_staging(&self, len: usize) -> Result<Box<dyn StagingMemory>> {
        self.0.allocate_staging(len)
    }
    unsafe fn copy_to_device(&self, src: *const u8, dst: *mut c_void, len: usize) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.copy_to_device(src, dst, len) }
    }
    unsafe fn copy_to_host(&self, src: *const c_void, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.copy_to_host(src, dst, len) }
    }
    fn record_event(&self) -> Result<Arc<dyn SyncEvent>> {
        self.0.record_event()
    }
    unsafe fn wait_sync_event(&self, sync_event: *mut c_void) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.wait_sync_event(sync_event) }
    }
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
}

/// Copies `(from, to, len)` segments of a patterned allocation into a zeroed one on
/// `device` and checks every byte of the destination.
fn check(device: &dyn Device) {
    let n = 10_000;
    let src = device.allocate(n).unwrap();
    let dst = device.allocate(n).unwrap();
    let pattern: Vec<u8> = (0..n).map(|i| (i * 13 + 7) as u8).collect();
    // SAFETY: `src` holds `n` bytes; the pattern outlives the synchronize below.
    unsafe { device.copy_to_device(pattern.as_ptr(), src.address(), n) }.unwrap();
    device.synchronize().unwrap();
    let at = |m: &Arc<dyn DeviceMemory>, o: usize| (m.address() as usize + o) as *mut c_void;
    let segments = [(0, 5000, 17), (3, 0, 1), (100, 200, 0), (9000, 1000, 1000)];
    let copies: Vec<DeviceCopy> = segments
        .iter()
        .map(|&(from, to, len)| DeviceCopy {
            src: at(&src, from),
            dst: at(&dst, to),
            len,
        })
        .collect();
    // SAFETY: every range lies inside its allocation; destinations do not overlap each
    // other or the sources (another allocation).
    unsafe { device.copy_on_device(&copies) }.unwrap();
    let mut back = vec![0u8; n];
    // SAFETY: `back` holds `n` bytes and is read after the synchronize below.
    unsafe { device.copy_to_host(dst.address(), back.as_mut_ptr(), n) }.unwrap();
    device.synchronize().unwrap();
    let mut expected = vec![0u8; n];
    for (from, to, len) in segments {
        expected[to..to + len].copy_from_slice(&pattern[from..from + len]);
    }
    assert_eq!(back, expected);
}

#[test]
fn the_cpu_device_copies_on_device_with_memcpy() {
    let device = CpuDevice::new();
    check(&device);
    assert_eq!(
        device.copy_count(),
        2,
        "on-device copies are not host copies"
    );
    // SAFETY: nothing to copy.
    unsafe { device.copy_on_device(&[]) }.unwrap();
}

#[test]
fn the_default_goes_through_host_staging() {
    let device = Minimal::default();
    check(&device);
    // One copy there, one back; and per non-empty segment one to the host and one back
    // (the inner CPU device's count: each went through its copies).
    assert_eq!(device.0.copy_count(), 2 + 2 * 3);
    // SAFETY: nothing to copy.
    unsafe { device.copy_on_device(&[]) }.unwrap();
    assert_eq!(device.0.copy_count(), 8);
}
