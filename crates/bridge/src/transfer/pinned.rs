//! The pinned fast path: record batches whose buffers already lie in memory the device can
//! DMA directly, so a transfer copies them straight to the device with no staging copy.
//!
//! Staging costs one host copy of every byte (packing), which parallel packing makes fast
//! but not free. A producer that builds its batches in pinned memory skips it:
//!
//! - [`pin_batch`] copies a batch once into **one** pinned allocation of the device
//!   (page-locked on CUDA), laid out exactly as the device image a [`Transfer`] makes of
//!   it (buffers cut to the slice, offsets rebased, 64-byte aligned), and returns it as an
//!   ordinary arrow-rs [`RecordBatch`] over that memory. Transferring it is then **one**
//!   DMA (plus one small staged copy for the few buffers a plan always recomputes, such as
//!   the variadic sizes of view types), whatever the number of columns.
//! - [`pinned_buffer`] allocates one pinned arrow-rs [`Buffer`] for a producer to fill in
//!   place (e.g. a decoder writing a column), to build arrays from.
//!
//! How a [`Transfer`] uses it: after planning, consecutive segments of the image that lie
//! in host memory at the same displacement as in the image (as `pin_batch` lays them out)
//! are merged into runs; a run (or a lone segment) of at least
//! [`TransferOptions::direct_min_bytes`] that the device reports pinned
//! ([`Device::is_pinned`]) is copied directly from the batch's memory, in one copy. The
//! rest travels packed through staging as usual. The transfer keeps the batch's buffers
//! alive until those copies have completed.
//!
//! On a device that page-locks pageable memory for direct DMA
//! ([`Device::host_registration_min_bytes`]; on CUDA, `CudaDeviceOptions::register_pageable`),
//! buffers that are not pinned but at least that large (and at least `direct_min_bytes`)
//! are registered for the transfer ([`Device::register_host`]: their whole pages, the
//! partial pages at their ends staged) and copied directly too;
//! the transfer drops the registrations (unregistering the pages) once those copies
//! have completed. All direct copies of an upload are enqueued in one
//! [`Device::copy_batch_to_device`] (one `cuMemcpyBatchAsync` where the CUDA device's
//! options ask for it).
//!
//! # Example
//!
//! On the CPU device (whose staging memory stands for pinned memory; on CUDA it is
//! page-locked): a batch copied once into pinned memory, and a column built in place
//! there; both then move to the device without staging.
//!
//! ```
//! use std::sync::Arc;
//!
//! use arrow_array::{ArrayRef, Int64Array, RecordBatch};
//! use arrow_buffer::ScalarBuffer;
//! use devarrow_abi::device::{CpuDevice, Device};
//! use devarrow_bridge::pinned::{pin_batch, pinned_buffer, pinned_bytes};
//! use devarrow_bridge::{Transfer, TransferOptions};
//!
//! # fn main() -> devarrow_abi::Result<()> {
//! let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
//!
//! // A batch copied once into pinned memory: every byte a transfer moves is pinned.
//! let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..100_000));
//! let batch = RecordBatch::try_from_iter([("id", ids)])?;
//! assert_eq!(pinned_bytes(device.as_ref(), &batch)?, (0, 800_000)); // pageable
//! let pinned = pin_batch(device.as_ref(), &batch)?;
//! assert_eq!(pinned_bytes(device.as_ref(), &pinned)?, (800_000, 800_000));
//! assert_eq!(pinned, batch);
//!
//! // A column written in place into pinned memory (as a decoder would write it).
//! let n = 50_000;
//! let buffer = pinned_buffer(device.as_ref(), n * 8, |bytes| {
//!     for (i, value) in bytes.chunks_exact_mut(8).enumerate() {
//!         value.copy_from_slice(&(i as i64).to_le_bytes());
//!     }
//! })?;
//! let values: ArrayRef = Arc::new(Int64Array::new(ScalarBuffer::new(buffer, 0, n), None));
//! let built = RecordBatch::try_from_iter([("v", values)])?;
//!
//! // Both move in direct copies from their own memory.
//! let mut transfer = Transfer::new(device, TransferOptions::default());
//! let on_device = transfer.to_device(&pinned)?;
//! drop(pinned); // the transfer keeps its memory alive until the copies have completed
//! assert_eq!(transfer.to_host(&on_device)?, batch);
//! let on_device = transfer.to_device(&built)?;
//! assert_eq!(transfer.to_host(&on_device)?, built);
//! # Ok(())
//! # }
//! ```
//!
//! [`Transfer`]: crate::Transfer
//! [`TransferOptions::direct_min_bytes`]: crate::TransferOptions::direct_min_bytes

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use arrow_array::{Array, RecordBatch, StructArray};
use arrow_buffer::alloc::Allocation;
use arrow_buffer::Buffer;
use devarrow_abi::device::{whole_pages, Device, HostRegistration, StagingMemory};
use devarrow_abi::{Error, Result};

use crate::plan::plan_array;
use crate::transfer::host::host_batch;
use crate::transfer::pack::{pack_window, Parallelism};

/// Keeps a staging allocation alive behind arrow-rs [`Buffer`]s. Never accessed: the
/// mutex only makes the (`Send`) allocation `Sync`, as [`Allocation`] requires.
struct StagingOwner(#[allow(dead_code)] Mutex<Box<dyn StagingMemory>>);

/// Allocates `len` bytes of `device`'s staging memory (pinned on CUDA: a block of the
/// context's pinned reserve, which this first grows where it has no room for `len`
/// bytes, [`Device::reserve_staging`], an explicit and synchronizing allocation of
/// pinned memory; see `CudaDevice::reserve_pinned`; zeroed), lets
/// `init` fill them, and returns them as an arrow-rs [`Buffer`] that owns the allocation
/// (freed when the last clone or slice of the `Buffer` drops).
///
/// Arrays built over such buffers (e.g. `Int64Array::new(ScalarBuffer::new(buffer, 0,
/// n), None)`) are transferred by [`crate::Transfer::to_device`] without staging copies
/// when their buffers are at least [`crate::TransferOptions::direct_min_bytes`] long.
pub fn pinned_buffer(
    device: &dyn Device,
    len: usize,
    init: impl FnOnce(&mut [u8]),
) -> Result<Buffer> {
    device.reserve_staging(len)?;
    let mut staging = device.allocate_staging(len)?;
    let bytes = staging.as_mut_slice();
    if bytes.len() < len {
        return Err(Error::InvalidArgument(format!(
            "the device returned {} bytes of staging memory for {len}",
            bytes.len()
        )));
    }
    let bytes = &mut bytes[..len];
    // Staging memory is initialized but holds what its last user wrote: zeroed here, as
    // documented, for an `init` that leaves bytes alone.
    bytes.fill(0);
    init(bytes);
    let ptr = NonNull::new(bytes.as_mut_ptr()).unwrap_or(NonNull::dangling());
    let owner: Arc<dyn Allocation> = Arc::new(StagingOwner(Mutex::new(staging)));
    // `owner` keeps the staging allocation alive and never touches it again (moving the
    // box does not move the memory it points to); the Buffer ties its lifetime to its own.
    // SAFETY: `ptr` is valid for `len` initialized bytes (zeroed, then written by `init`)
    // for as long as `owner` lives.
    Ok(unsafe { Buffer::from_custom_allocation(ptr, len, owner) })
}

/// One arrow-rs [`Buffer`] of `len` bytes of `device`'s staging memory
/// ([`Device::allocate_staging`]: pinned on CUDA while the pinned memory the device
/// reserved has room, pageable past it, never an allocation that synchronizes the
/// device; unlike [`pinned_buffer`], nothing is reserved) holding `parts` (`(bytes, offset)`: each part's bytes
/// at its offset, in offset order, not overlapping, inside `len`), written by up to 16
/// threads with the stores a large pack uses; the bytes no part covers (alignment
/// padding) are zeroed, and nothing else is written twice.
///
/// This is how a producer concatenates many small buffers straight into memory the
/// device copies directly: the gather *is* the one host copy a staged upload would make
/// anyway, so coalescing small batches this way costs no copy of its own (the DataFusion
/// integration's load writes the fixed-width columns of the batches it coalesces so).
///
/// ```
/// use arrow_buffer::Buffer;
/// use devarrow_abi::device::{CpuDevice, Device};
/// use devarrow_bridge::pinned::pinned_gather;
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let device = CpuDevice::new();
/// let (a, b) = (Buffer::from_vec(vec![1u8; 100]), Buffer::from_vec(vec![2u8; 50]));
/// let gathered = pinned_gather(&device, 192, &[(a, 0), (b, 128)])?;
/// assert!(device.is_pinned(gathered.as_ptr(), gathered.len()));
/// assert_eq!(&gathered[..100], &[1u8; 100][..]);
/// assert_eq!(&gathered[100..128], &[0u8; 28][..]);
/// assert_eq!(&gathered[128..178], &[2u8; 50][..]);
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// [`Error::InvalidArgument`] when a part lies outside `len` or overlaps the part before
/// it; the device's allocation errors.
pub fn pinned_gather(device: &dyn Device, len: usize, parts: &[(Buffer, usize)]) -> Result<Buffer> {
    let mut end = 0;
    for (bytes, at) in parts {
        let part_end = at.checked_add(bytes.len()).filter(|e| *e <= len);
        match part_end {
            Some(part_end) if *at >= end => end = part_end,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "a part of {} bytes at {at} of a {len}-byte gather is out of order or \
                     out of bounds",
                    bytes.len()
                )))
            }
        }
    }
    let mut staging = device.allocate_staging(len)?;
    let bytes = staging.as_mut_slice();
    if bytes.len() < len {
        return Err(Error::InvalidArgument(format!(
            "the device returned {} bytes of staging memory for {len}",
            bytes.len()
        )));
    }
    let bytes = &mut bytes[..len];
    // The padding between parts (and after the last): zeroed, as the image a transfer
    // packs has it.
    let mut at = 0;
    for (part, offset) in parts {
        bytes[at..*offset].fill(0);
        at = offset + part.len();
    }
    bytes[at..].fill(0);
    pack_window(parts, 0, bytes, Parallelism::new(0, 1 << 20));
    let ptr = NonNull::new(bytes.as_mut_ptr()).unwrap_or(NonNull::dangling());
    let owner: Arc<dyn Allocation> = Arc::new(StagingOwner(Mutex::new(staging)));
    // SAFETY: `ptr` is valid for `len` initialized bytes (every byte written above: the
    // parts by the pack, the rest zeroed) for as long as `owner` lives, which the Buffer
    // keeps alive.
    Ok(unsafe { Buffer::from_custom_allocation(ptr, len, owner) })
}

/// Copies `batch` into one staging (pinned, on CUDA) allocation of `device`, laid out as a
/// [`crate::Transfer`] lays it out on the device, and returns the copy: equal to `batch`
/// (same schema and values; slices are cut to their rows, so every array has offset 0).
///
/// The copy is packed on up to 16 threads. Transferring the result to a device copies its
/// buffers directly, in about one copy (see the [module docs](self)). Worth it when a
/// batch is transferred more than once, or when the producer can build it here in the
/// first place; for a single transfer it costs about what staging costs.
pub fn pin_batch(device: &dyn Device, batch: &RecordBatch) -> Result<RecordBatch> {
    let data = StructArray::from(batch.clone()).into_data();
    let plan = plan_array(&data)?;
    let image = &plan.image;
    let parallelism = Parallelism::new(0, 1 << 20);
    let memory = pinned_buffer(device, image.total, |out| {
        pack_window(&image.segments, 0, out, parallelism)
    })?;
    host_batch(batch.schema(), batch.num_rows(), &plan.root, &memory, true)
}

/// Bytes of the buffers a transfer of `batch` moves (its planned payload), and how many of
/// them lie in memory `device` reports pinned.
pub fn pinned_bytes(device: &dyn Device, batch: &RecordBatch) -> Result<(usize, usize)> {
    let data = StructArray::from(batch.clone()).into_data();
    let plan = plan_array(&data)?;
    let pinned = plan
        .image
        .segments
        .iter()
        .filter(|(b, _)| device.is_pinned(b.as_ptr(), b.len()))
        .map(|(b, _)| b.len())
        .sum();
    Ok((pinned, plan.image.payload_bytes()))
}

/// Segments of a packed image that a transfer copies straight from host memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DirectRun {
    /// The segments (indices into the image's segments).
    pub segments: Range<usize>,
    /// The image range copied directly: from the first segment's start to the last's
    /// end, or, for a registered segment, the part of it in whole pages
    /// ([`whole_pages`]), its ends staged.
    pub image: Range<usize>,
    /// Where the range starts in host memory.
    pub host: *const u8,
}

/// The runs of `segments` (in image order) to copy directly: maximal groups of consecutive
/// segments lying in host memory at one displacement from their image offsets, spanning at
/// least `min_bytes`, that `device` reports pinned as a whole; or, when a group is not,
/// its single segments of at least `min_bytes` that are pinned, or (from
/// `register_from` bytes on, when given) that `device` registers for direct DMA
/// ([`Device::register_host`]: the run is then the segment's whole pages, the partial
/// pages at its ends left to staging), the registrations pushed to `registrations`.
/// Returned in image order.
///
/// # Safety
/// The segments' buffers must stay alive, and `registrations` must be dropped only after
/// every copy of the runs has completed (the contract of [`Device::register_host`]).
pub(crate) unsafe fn direct_runs(
    device: &dyn Device,
    segments: &[(Buffer, usize)],
    min_bytes: usize,
    register_from: Option<usize>,
    registrations: &mut Vec<Box<dyn HostRegistration>>,
) -> Result<Vec<DirectRun>> {
    let displacement = |i: usize| (segments[i].0.as_ptr() as usize).wrapping_sub(segments[i].1);
    let run = |r: Range<usize>| {
        let (first, last) = (&segments[r.start], &segments[r.end - 1]);
        DirectRun {
            image: first.1..last.1 + last.0.len(),
            host: first.0.as_ptr(),
            segments: r,
        }
    };
    let mut runs = Vec::new();
    let mut i = 0;
    while i < segments.len() {
        let mut j = i + 1;
        while j < segments.len() && displacement(j) == displacement(i) {
            j += 1;
        }
        let group = run(i..j);
        let span = group.image.len();
        if span >= min_bytes {
            if device.is_pinned(group.host, span) {
                runs.push(group);
            } else {
                // Segment by segment: a group's span may include memory between its
                // buffers, which only a pinned allocation vouches for.
                for (s, (b, _)) in segments.iter().enumerate().take(j).skip(i) {
                    if b.len() < min_bytes {
                        continue;
                    }
                    if j - i > 1 && device.is_pinned(b.as_ptr(), b.len()) {
                        runs.push(run(s..s + 1));
                    } else if register_from.is_some_and(|from| b.len() >= from) {
                        // SAFETY: the buffer lives as long as the caller keeps it (its
                        // guarantee), and so does the registration (dropped only after
                        // the copies, the caller's guarantee).
                        if let Some(r) = unsafe { device.register_host(b.as_ptr(), b.len())? } {
                            registrations.push(r);
                            let pages = whole_pages(b.as_ptr(), b.len());
                            let at = segments[s].1 + (pages.start - b.as_ptr() as usize);
                            runs.push(DirectRun {
                                segments: s..s + 1,
                                image: at..at + pages.len(),
                                host: pages.start as *const u8,
                            });
                        }
                    }
                }
            }
        }
        i = j;
    }
    Ok(runs)
}

/// The image ranges the staging pipeline packs: what lies between `runs` (and before the
/// first and after the last), cut to the bytes of `segments` it holds (the padding at
/// its ends left out); empty ones are skipped. A registered run's partial pages belong
/// to the ranges on either side of it.
pub(crate) fn staged_ranges(segments: &[(Buffer, usize)], runs: &[DirectRun]) -> Vec<Range<usize>> {
    let end_of = |(bytes, at): &(Buffer, usize)| at + bytes.len();
    let Some(last) = segments.last() else {
        return Vec::new();
    };
    let (start, end) = (segments[0].1, end_of(last));
    let gaps = std::iter::once(start)
        .chain(runs.iter().map(|run| run.image.end))
        .zip(runs.iter().map(|run| run.image.start).chain([end]));
    gaps.filter_map(|(from, to)| {
        // The first segment ending after `from`, and the last starting before `to`.
        let first = segments.partition_point(|s| end_of(s) <= from);
        let last = segments.partition_point(|(_, at)| *at < to);
        if first >= last {
            return None;
        }
        let from = from.max(segments[first].1);
        let to = to.min(end_of(&segments[last - 1]));
        (from < to).then_some(from..to)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int64Array, StringArray};
    use devarrow_abi::device::CpuDevice;

    #[test]
    fn gather_places_parts_and_zeroes_the_padding() {
        let device = CpuDevice::new();
        // 4 MB in all (every core packs it) where it runs natively; small under Miri.
        let (part, stride) = if cfg!(miri) {
            (1_000, 1_024)
        } else {
            (100_000, 100_032)
        };
        let parts: Vec<(Buffer, usize)> = (0..40u8)
            .map(|i| (Buffer::from_vec(vec![i + 1; part]), i as usize * stride))
            .collect();
        let len = 40 * stride;
        let gathered = pinned_gather(&device, len, &parts).unwrap();
        assert!(device.is_pinned(gathered.as_ptr(), len));
        for (i, chunk) in gathered.chunks(stride).enumerate() {
            assert!(chunk[..part].iter().all(|b| *b == i as u8 + 1));
            assert!(chunk[part..].iter().all(|b| *b == 0));
        }
        let overlapping = [(parts[0].0.clone(), 0), (parts[1].0.clone(), 50)];
        assert!(matches!(
            pinned_gather(&device, len, &overlapping),
            Err(Error::InvalidArgument(_))
        ));
        let outside = [(parts[0].0.clone(), len - 10)];
        assert!(matches!(
            pinned_gather(&device, len, &outside),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn runs_merge_contiguous_pinned_segments_only() {
        let device = CpuDevice::new();
        let pinned = pinned_buffer(&device, 4096, |b| b.fill(1)).unwrap();
        let pageable = Buffer::from_vec(vec![0u8; 4096]);
        let segments = vec![
            (pinned.slice_with_length(0, 100), 0),
            (pinned.slice_with_length(128, 1000), 128), // same displacement: one run
            (pageable.slice_with_length(0, 2000), 1152),
            (pinned.slice_with_length(3200, 10), 3200), // too small alone
            (pinned.slice_with_length(3300, 700), 3300),
        ];
        let direct = |min| {
            let mut registrations = Vec::new();
            // SAFETY: the CPU device registers nothing; the buffers outlive the runs.
            let runs = unsafe { direct_runs(&device, &segments, min, Some(1), &mut registrations) };
            assert!(registrations.is_empty());
            runs.unwrap()
        };
        let runs = direct(500);
        assert_eq!(runs.len(), 2, "{runs:?}");
        assert_eq!(runs[0].segments, 0..2);
        assert_eq!(runs[0].image, 0..1128);
        assert_eq!(runs[0].host, pinned.as_ptr());
        // Segments 3 and 4 lie at one displacement (3200 - 3200 == 3300 - 3300).
        assert_eq!(runs[1].segments, 3..5);
        assert_eq!(staged_ranges(&segments, &runs), vec![1152..3152]);
        assert!(direct(5000).is_empty());
        assert_eq!(staged_ranges(&segments, &[]), vec![0..4000]);
        assert_eq!(staged_ranges(&[], &[]), Vec::<Range<usize>>::new());
    }

    #[test]
    fn pinned_batches_are_equal_and_pinned() {
        let device = CpuDevice::new();
        let batch = RecordBatch::try_from_iter([
            (
                "i",
                Arc::new(Int64Array::from_iter(
                    (0..1000).map(|i| (i % 3 != 0).then_some(i)),
                )) as _,
            ),
            (
                "s",
                Arc::new(StringArray::from_iter_values(
                    (0..1000).map(|i| format!("s{i}")),
                )) as _,
            ),
        ])
        .unwrap();
        let slice = batch.slice(7, 500);
        let pinned = pin_batch(&device, &slice).unwrap();
        assert_eq!(pinned, slice);
        let (on, of) = pinned_bytes(&device, &pinned).unwrap();
        assert_eq!(on, of, "every buffer of a pinned batch is pinned");
        assert_eq!(pinned_bytes(&device, &slice).unwrap().0, 0);
    }
}
