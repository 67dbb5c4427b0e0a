//! Copies from device memory to device memory ([`Device::copy_on_device`]): batches of
//! segments copied by `dvx_batched_copy` launches, their descriptor tables staged through
//! the device's two slots of pinned memory.
//!
//! [`Device::copy_on_device`]: devarrow_abi::device::Device::copy_on_device

use cudarc::driver::sys;
use devarrow_abi::device::DeviceCopy;

use crate::context;
use crate::driver;
use crate::error::{CudaError, DriverResultExt};
use crate::kernels::{self, CopySegment};
use crate::memory::{CudaMemory as _, DeviceBuffer, PinnedHostBuffer};

use super::{CudaDevice, DescriptorStaging};

/// The bytes of one descriptor of `dvx_batched_copy` (a [`CopySegment`]).
const DESCRIPTOR_BYTES: usize = std::mem::size_of::<CopySegment>();

impl CudaDevice {
    /// `dvx_batched_copy` launches on the device's stream for all `copies` (cut into
    /// pieces by [`kernels::plan_batched_copy`]): one per table of at most one wave of
    /// the kernel's resident warps (the size a plan has unless it copies more segments
    /// than that). Each table is written to one of two slots of pinned memory allocated
    /// when the device was made, uploaded with `cuMemcpyHtoDAsync` into a stream-ordered
    /// device table (freed in stream order after its kernel): no driver call that
    /// synchronizes, and nothing blocks the host unless the upload of the table before
    /// last has not yet run.
    ///
    /// # Safety
    /// As [`Device::copy_on_device`](devarrow_abi::device::Device::copy_on_device).
    pub(super) unsafe fn batched_copy_on_device(
        &self,
        copies: &[DeviceCopy],
    ) -> devarrow_abi::Result<()> {
        let segments: Vec<CopySegment> = copies
            .iter()
            .filter(|c| c.len > 0)
            .map(|c| CopySegment {
                src: c.src as u64,
                dst: c.dst as u64,
                len: c.len as u64,
            })
            .collect();
        if segments.is_empty() {
            return Ok(());
        }
        if segments.iter().any(|s| s.src == 0 || s.dst == 0) {
            return Err(CudaError::InvalidArgument(
                "copy on the device with a NULL pointer".into(),
            )
            .into());
        }
        self.bind()?;
        let pieces = kernels::plan_batched_copy(&self.stream, &segments)?;
        let mut tables = self.descriptors.lock().unwrap_or_else(|e| e.into_inner());
        if tables.buffer.is_none() {
            // Only where the allocation at open failed (then this one likely fails too):
            // a `cuMemHostAlloc` here is an implicit synchronization.
            tables.buffer = Some(PinnedHostBuffer::alloc(
                &self.device,
                DescriptorStaging::SLOTS * tables.capacity * DESCRIPTOR_BYTES,
            )?);
        }
        // One launch per `capacity` descriptors, each table written to the next slot of
        // the pinned memory once that slot's last upload has run: the table never grows,
        // whatever the number of copies.
        for chunk in pieces.chunks(tables.capacity) {
            let slot = tables.next;
            tables.next = (slot + 1) % DescriptorStaging::SLOTS;
            if let Some(event) = &tables.uploaded[slot] {
                context::sync_event(event)?;
            }
            let bytes = std::mem::size_of_val(chunk);
            let at = slot * tables.capacity * DESCRIPTOR_BYTES;
            let host = tables.buffer.as_mut().expect("allocated above");
            let host = &mut host.as_mut_slice()[at..at + bytes];
            for (out, piece) in host.chunks_exact_mut(DESCRIPTOR_BYTES).zip(chunk) {
                out[0..8].copy_from_slice(&piece.src.to_ne_bytes());
                out[8..16].copy_from_slice(&piece.dst.to_ne_bytes());
                out[16..24].copy_from_slice(&piece.len.to_ne_bytes());
            }
            let source = host.as_ptr();
            let table = DeviceBuffer::alloc(&self.stream, bytes)?;
            // `source` is `bytes` bytes of pinned memory (this slot), not written again
            // before the event recorded next has completed (waited for above, the next
            // time the slot comes round); `table` is a fresh allocation of `bytes` bytes.
            // SAFETY: so both ranges are valid for the copy; the context is bound.
            unsafe {
                driver::memcpy_htod_async(
                    table.device_ptr(),
                    source.cast(),
                    bytes,
                    self.stream.cu_stream(),
                )
            }?;
            let event = match tables.uploaded[slot].take() {
                Some(event) => Ok(event),
                None => self
                    .device
                    .context()
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                    .call("cuEventCreate"),
            };
            let recorded = event.and_then(|event| {
                event.record(&self.stream).call("cuEventRecord")?;
                Ok(event)
            });
            match recorded {
                Ok(event) => tables.uploaded[slot] = Some(event),
                Err(e) => {
                    // Without an event the slot must not be reused before the upload ran:
                    // wait for it here.
                    let _ = context::sync_stream(&self.stream);
                    return Err(e.into());
                }
            }
            // SAFETY: the table holds `chunk.len()` descriptors (uploaded before the
            // launch in stream order) and is freed in stream order after it (dropped
            // below); the ranges are the caller's guarantee.
            unsafe {
                kernels::launch_batched_copy(&self.stream, table.device_ptr(), chunk.len() as u64)
            }?;
            drop(table);
        }
        Ok(())
    }
}
