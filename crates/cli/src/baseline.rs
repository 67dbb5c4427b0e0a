//! The peers a transfer is measured against, on any [`Device`]:
//!
//! - [`RawCopy`]: one copy of `n` bytes from pinned (staging) memory and from pageable
//!   memory, each way: the bandwidth ceiling of the link (pinned) and what a plain
//!   `cuMemcpy` of ordinary memory gets (pageable);
//! - [`BufferByBuffer`]: what other implementations do: every buffer of a batch copied on
//!   its own, from its pageable arrow-rs memory into its own device allocation, each copy
//!   synchronous.
//!
//! Every method returns once the copies have completed, so callers time them directly.

use std::sync::Arc;

use arrow_array::{Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use devarrow::abi::device::{Device, DeviceMemory, StagingMemory};
use devarrow::abi::Result;

/// Raw copies of one byte count between the host and a device.
///
/// The pinned and the pageable host buffers are allocated by [`RawCopy::new`], or, with
/// [`RawCopy::lazy`], by the first copy that needs each; [`RawCopy::release_pinned`] and
/// [`RawCopy::release_pageable`] free them (the next copy allocates them again), so that
/// a caller measuring one kind after the other holds one host copy of the bytes at a
/// time.
#[derive(Debug)]
pub struct RawCopy {
    device: Arc<dyn Device>,
    device_memory: Arc<dyn DeviceMemory>,
    bytes: usize,
    pinned: Option<Box<dyn StagingMemory>>,
    pageable: Option<Vec<u8>>,
}

impl RawCopy {
    /// Allocates `bytes` of device memory, of pinned staging memory and of pageable memory.
    pub fn new(device: Arc<dyn Device>, bytes: usize) -> Result<Self> {
        let mut raw = Self::lazy(device, bytes)?;
        raw.pinned()?;
        raw.pageable();
        Ok(raw)
    }

    /// Allocates `bytes` of device memory; the host buffers come with the first copy
    /// that uses each.
    pub fn lazy(device: Arc<dyn Device>, bytes: usize) -> Result<Self> {
        let device_memory = device.allocate(bytes)?;
        Ok(Self {
            device,
            device_memory,
            bytes,
            pinned: None,
            pageable: None,
        })
    }

    /// The byte count of every copy.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The pinned buffer, allocated (and filled) if it is not there.
    fn pinned(&mut self) -> Result<&mut Box<dyn StagingMemory>> {
        let pinned = match self.pinned.take() {
            Some(pinned) => pinned,
            None => {
                // Room in the device's pinned memory first (CUDA reserves 128 MiB at open;
                // beyond it staging is pageable, and this would time a pageable copy: the
                // H200 run of 2026-11-29 timed 9 GB/s "pinned" that way).
                self.device.reserve_staging(self.bytes)?;
                let mut pinned = self.device.allocate_staging(self.bytes)?;
                pinned.as_mut_slice().fill(0x5a);
                pinned
            }
        };
        Ok(self.pinned.insert(pinned))
    }

    /// The pageable buffer, allocated (and filled) if it is not there.
    fn pageable(&mut self) -> &mut Vec<u8> {
        let bytes = self.bytes;
        self.pageable.get_or_insert_with(|| vec![0xa5; bytes])
    }

    /// Frees the pinned buffer (the next pinned copy allocates it again).
    pub fn release_pinned(&mut self) {
        self.pinned = None;
    }

    /// Frees the pageable buffer (the next pageable copy allocates it again).
    pub fn release_pageable(&mut self) {
        self.pageable = None;
    }

    /// One host-to-device copy from pinned memory, then waits for it.
    pub fn pinned_to_device(&mut self) -> Result<()> {
        let (len, dst) = (self.bytes, self.device_memory.address());
        let src = self.pinned()?.as_slice().as_ptr();
        // SAFETY: `src` and the device memory both hold `bytes()` bytes and outlive the
        // copy, which `synchronize` waits for before returning.
        unsafe { self.device.copy_to_device(src, dst, len)? };
        self.device.synchronize()
    }

    /// One device-to-host copy into pinned memory, then waits for it.
    pub fn pinned_to_host(&mut self) -> Result<()> {
        let (len, src) = (self.bytes, self.device_memory.address());
        let dst = self.pinned()?.as_mut_slice().as_mut_ptr();
        // SAFETY: as in `pinned_to_device`; the pinned buffer is not read before the copy
        // has completed.
        unsafe { self.device.copy_to_host(src, dst, len)? };
        self.device.synchronize()
    }

    /// One host-to-device copy from pageable memory, then waits for it.
    pub fn pageable_to_device(&mut self) -> Result<()> {
        let (len, dst) = (self.bytes, self.device_memory.address());
        let src = self.pageable().as_ptr();
        // SAFETY: as in `pinned_to_device`.
        unsafe { self.device.copy_to_device(src, dst, len)? };
        self.device.synchronize()
    }

    /// One device-to-host copy into pageable memory, then waits for it.
    pub fn pageable_to_host(&mut self) -> Result<()> {
        let (len, src) = (self.bytes, self.device_memory.address());
        let dst = self.pageable().as_mut_ptr();
        // SAFETY: as in `pinned_to_host`.
        unsafe { self.device.copy_to_host(src, dst, len)? };
        self.device.synchronize()
    }
}

/// A batch moved buffer by buffer: one device allocation and one synchronous copy per
/// buffer of every array (validity, offsets, values, children, dictionaries), whole
/// buffers as arrow-rs holds them.
#[derive(Debug)]
pub struct BufferByBuffer {
    device: Arc<dyn Device>,
    host: Vec<Buffer>,
}

impl BufferByBuffer {
    /// Collects the buffers of `batch`.
    pub fn new(device: Arc<dyn Device>, batch: &RecordBatch) -> Self {
        let mut host = Vec::new();
        for column in batch.columns() {
            collect_buffers(&column.to_data(), &mut host);
        }
        Self { device, host }
    }

    /// The number of buffers (and of copies each way).
    pub fn buffer_count(&self) -> usize {
        self.host.len()
    }

    /// The bytes moved each way.
    pub fn bytes(&self) -> usize {
        self.host.iter().map(|b| b.len()).sum()
    }

    /// Allocates and copies every buffer to the device, waiting for each copy.
    pub fn to_device(&self) -> Result<Vec<Arc<dyn DeviceMemory>>> {
        self.host
            .iter()
            .map(|buffer| {
                let memory = self.device.allocate(buffer.len())?;
                // SAFETY: `buffer` and `memory` hold `buffer.len()` bytes and outlive the
                // copy, which `synchronize` waits for.
                unsafe {
                    self.device
                        .copy_to_device(buffer.as_ptr(), memory.address(), buffer.len())?
                };
                self.device.synchronize()?;
                Ok(memory)
            })
            .collect()
    }

    /// Copies every buffer back into its own new host allocation, waiting for each copy.
    pub fn to_host(&self, on_device: &[Arc<dyn DeviceMemory>]) -> Result<Vec<Vec<u8>>> {
        on_device
            .iter()
            .map(|memory| {
                let mut host = Vec::<u8>::with_capacity(memory.len());
                // SAFETY: `host` has capacity for `memory.len()` bytes and is only given a
                // length after `synchronize` returned, once the copy wrote every byte.
                unsafe {
                    self.device
                        .copy_to_host(memory.address(), host.as_mut_ptr(), memory.len())?;
                    self.device.synchronize()?;
                    host.set_len(memory.len());
                }
                Ok(host)
            })
            .collect()
    }
}

fn collect_buffers(data: &ArrayData, out: &mut Vec<Buffer>) {
    if let Some(nulls) = data.nulls() {
        out.push(nulls.buffer().clone());
    }
    out.extend(data.buffers().iter().filter(|b| !b.is_empty()).cloned());
    for child in data.child_data() {
        collect_buffers(child, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int32Array, StringArray};
    use devarrow::abi::device::{CopyCounter, CpuDevice};

    #[test]
    fn baselines_copy_every_byte_on_the_cpu_device() {
        let cpu = Arc::new(CpuDevice::new());
        let device: Arc<dyn Device> = cpu.clone();
        let mut raw = RawCopy::new(device.clone(), 1000).unwrap();
        raw.pinned_to_device().unwrap();
        raw.pageable_to_host().unwrap();
        assert!(raw.pageable().iter().all(|&b| b == 0x5a));
        raw.pageable().fill(7);
        raw.pageable_to_device().unwrap();
        raw.pinned_to_host().unwrap();
        assert!(raw.pinned().unwrap().as_slice().iter().all(|&b| b == 7));

        // Lazy: one host buffer at a time, allocated by the copy that needs it.
        let mut raw = RawCopy::lazy(device.clone(), 1000).unwrap();
        assert!(raw.pinned.is_none() && raw.pageable.is_none());
        raw.pinned_to_device().unwrap();
        raw.pinned_to_host().unwrap();
        assert!(raw.pinned.is_some() && raw.pageable.is_none());
        raw.release_pinned();
        raw.pageable_to_host().unwrap();
        assert!(raw.pageable().iter().all(|&b| b == 0x5a));
        assert!(raw.pinned.is_none());
        raw.release_pageable();
        assert!(raw.pageable.is_none());

        let batch = RecordBatch::try_from_iter([
            (
                "a",
                Arc::new(Int32Array::from(vec![Some(1), None, Some(3)])) as _,
            ),
            (
                "s",
                Arc::new(StringArray::from(vec!["x", "yy", "zzz"])) as _,
            ),
        ])
        .unwrap();
        let bbb = BufferByBuffer::new(device.clone(), &batch);
        assert_eq!(bbb.buffer_count(), 4); // validity + values, offsets + data
        let before = cpu.copy_count();
        let on_device = bbb.to_device().unwrap();
        let back = bbb.to_host(&on_device).unwrap();
        assert_eq!(cpu.copy_count() - before, 8);
        for (h, b) in bbb.host.iter().zip(&back) {
            assert_eq!(h.as_slice(), b.as_slice());
        }
    }
}
