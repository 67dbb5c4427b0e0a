//! The slice matrix: what a small slice of a large column moves, per layout, on the CPU
//! device, when devarrow uploads it itself (`Transfer::to_device`, the planner cuts every
//! buffer to the slice) and when it is imported from C (arrow-rs's C export of the slice,
//! `DeviceBatch::import`, then `Transfer::to_host`).
//!
//! Bytes are those of the packed images, as `Transfer::stats` counts them
//! (`to_device.bytes`, `to_host.bytes`); the ratio is the import's bytes over the
//! upload's. Every download is checked against the slice. Also printed: the read-backs of
//! the import (device-to-host copies of sizes, offsets and views, counted by a wrapping
//! device).
//!
//! ```sh
//! cargo run --release -p devarrow-bridge --example slice_matrix -- [ROWS [OFFSET [LEN]]]
//! ```

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::ffi::FFI_ArrowSchema;
use devarrow_abi::cpu;
use devarrow_abi::device::{CpuDevice, Device, DeviceCopy, DeviceMemory, StagingMemory, SyncEvent};
use devarrow_abi::{ArrowDeviceType, DeviceArray, Result};
use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_testing::slices;

/// The CPU device, counting its device-to-host copies.
#[derive(Debug)]
struct Counting {
    inner: CpuDevice,
    to_host: AtomicU64,
    to_host_bytes: AtomicU64,
}

// SAFETY: every call is forwarded to the CPU device, whose promises therefore hold.
unsafe impl Device for Counting {
    fn device_type(&self) -> ArrowDeviceType {
        self.inner.device_type()
    }
    fn device_id(&self) -> i64 {
        self.inner.device_id()
    }
    fn allocate(&self, len: usize) -> Result<Arc<dyn DeviceMemory>> {
        self.inner.allocate(len)
    }
    fn allocate_staging(&self, len: usize) -> Result<Box<dyn StagingMemory>> {
        self.inner.allocate_staging(len)
    }
    unsafe fn copy_to_device(&self, src: *const u8, dst: *mut c_void, len: usize) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_device(src, dst, len) }
    }
    unsafe fn copy_to_host(&self, src: *const c_void, dst: *mut u8, len: usize) -> Result<()> {
        self.to_host.fetch_add(1, Ordering::Relaxed);
        self.to_host_bytes.fetch_add(len as u64, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_to_host(src, dst, len) }
    }
    unsafe fn copy_on_device(&self, copies: &[DeviceCopy]) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.copy_on_device(copies) }
    }
    fn record_event(&self) -> Result<Arc<dyn SyncEvent>> {
        self.inner.record_event()
    }
    unsafe fn wait_sync_event(&self, event: *mut c_void) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.wait_sync_event(event) }
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn is_pinned(&self, ptr: *const u8, len: usize) -> bool {
        self.inner.is_pinned(ptr, len)
    }
    fn host_accessible(&self) -> bool {
        self.inner.host_accessible()
    }
}

fn main() -> Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("ROWS OFFSET LEN: numbers"))
        .collect();
    let rows = args.first().copied().unwrap_or(slices::ROWS);
    let offset = args.get(1).copied().unwrap_or(slices::SLICE_OFFSET);
    let len = args.get(2).copied().unwrap_or(slices::SLICE_LEN);
    assert!(offset + len <= rows, "the slice must lie in the column");
    println!("{len} rows at {offset} of {rows}, CPU device\n");
    println!(
        "| column | export | slice uploaded (B) | imported slice moved (B) | ratio | read-backs \
         | read back (B) |"
    );
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: |");
    for (name, column) in slices::columns(rows) {
        let slice = slices::batch_of(name, column.slice(offset, len));
        let whole = slices::batch_of(name, column);
        for export in ["arrow-rs", "C"] {
            let exported = if export == "C" {
                slices::export_c_slice(&whole, offset, len)
            } else {
                cpu::export_record_batch(&slice)?
            };
            measure(name, export, &slice, exported)?;
        }
    }
    Ok(())
}

/// Uploads `slice` and downloads its import from `exported`; prints a row of the table.
fn measure(
    name: &str,
    export: &str,
    slice: &RecordBatch,
    (array, schema): (DeviceArray, FFI_ArrowSchema),
) -> Result<()> {
    let device = Arc::new(Counting {
        inner: CpuDevice::new(),
        to_host: AtomicU64::new(0),
        to_host_bytes: AtomicU64::new(0),
    });
    let mut upload = Transfer::new(device.clone(), TransferOptions::default());
    upload.to_device(slice)?;
    let own = upload.stats().to_device.bytes;
    let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema)?;
    let (reads, read_bytes) = (
        device.to_host.load(Ordering::Relaxed),
        device.to_host_bytes.load(Ordering::Relaxed),
    );
    let mut download = Transfer::new(device.clone(), TransferOptions::default());
    let back = download.to_host(&imported)?;
    assert_eq!(&back, slice, "{name}: the download is the slice");
    let moved = download.stats().to_host.bytes;
    println!(
        "| {name} | {export} | {own} | {moved} | {:.2} | {reads} | {read_bytes} |",
        moved as f64 / own as f64
    );
    Ok(())
}
