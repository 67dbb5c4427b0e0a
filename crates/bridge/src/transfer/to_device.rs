//! The upload side of a [`Transfer`]: a batch planned ([`crate::plan`]) into one device
//! allocation, the runs already in pinned (or registered) host memory copied directly,
//! and the rest through the staging pipeline ([`crate::transfer::upload`], packing with
//! [`crate::transfer::pack`]); or, where the host writes the device's memory, packed straight into
//! it.

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use devarrow_abi::device::{DeviceMemory, HostToDevice, SyncEvent, BUFFER_ALIGNMENT};
use devarrow_abi::Result;

use super::{per_batch, release_registrations, DeviceBatch, Retained, Stage, Transfer};
use crate::batch::Storage;
use crate::plan::{plan_batch, Packer};
use crate::transfer::pack::{fill_outputs, pack_range_with, upload_window_bytes};
use crate::transfer::pinned::{direct_runs, staged_ranges};
use crate::transfer::stages::StageTimes;

/// How many uploads with direct copies keep their source buffers alive at most before
/// the oldest is waited for (see [`Transfer::retain`]).
const MAX_RETAINED: usize = 4;

impl Transfer {
    /// Moves a record batch to the device.
    pub fn to_device(&mut self, batch: &RecordBatch) -> Result<DeviceBatch> {
        let mut batches = self.to_device_batches(std::slice::from_ref(batch))?;
        Ok(batches.pop().expect("one batch in, one out"))
    }

    /// Moves several record batches to the device in one pipeline: their windows are
    /// packed by the same workers and copied back to back, so the copy engine does not
    /// idle between batches as it does between calls of [`Transfer::to_device`] (each of
    /// which starts with an empty pipeline and ends with a copy that overlaps nothing).
    /// Prefer it for many batches of a few MB.
    ///
    /// The batches share one sync event, recorded after the last copy. The result is in
    /// the order of `batches`. On an error, no batch is returned: the error is that of a
    /// failing batch (the batches are planned in parallel, so not always the first).
    ///
    /// # Example
    ///
    /// Many batches up in one pipeline, back into pinned memory of the transfer's pool
    /// (one direct copy each), and up again by direct copies:
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use arrow_array::{ArrayRef, Int64Array, RecordBatch};
    /// use devarrow_abi::device::{CopyCounter, CpuDevice, Device};
    /// use devarrow_bridge::{Transfer, TransferOptions};
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let batches: Vec<RecordBatch> = (0..4)
    ///     .map(|i| {
    ///         let values: ArrayRef = Arc::new(Int64Array::from_iter_values(i..i + 10_000));
    ///         RecordBatch::try_from_iter([("v", values)])
    ///     })
    ///     .collect::<Result<_, _>>()?;
    /// let device = Arc::new(CpuDevice::new()); // staged, as a GPU is
    /// let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    /// let on_device = transfer.to_device_batches(&batches)?;
    /// let back = transfer.to_host_batches(&on_device)?;
    /// assert_eq!(back, batches);
    /// assert_eq!(transfer.stats().pinned_downloads, 4);
    /// assert_eq!(transfer.host_memory_note(), None); // none fell back to pageable memory
    ///
    /// // What came back lies in pinned memory: it goes up again in one direct copy each.
    /// let before = device.copy_count();
    /// let again = transfer.to_device_batches(&back)?;
    /// assert_eq!(device.copy_count() - before, 4);
    /// # drop(again);
    /// # Ok(())
    /// # }
    /// ```
    pub fn to_device_batches(&mut self, batches: &[RecordBatch]) -> Result<Vec<DeviceBatch>> {
        let mut times = StageTimes {
            batches: batches.len() as u64,
            ..Default::default()
        };
        let result = self.upload_batches(batches, &mut times);
        self.stats.to_device += times;
        result
    }

    fn upload_batches(
        &mut self,
        batches: &[RecordBatch],
        times: &mut StageTimes,
    ) -> Result<Vec<DeviceBatch>> {
        let start = Instant::now();
        // Many small batches spend as long planning as packing (587 batches of 1,024
        // `lineitem` rows: 1.8 ms of planning, 5.4 ms of packing on 2 threads).
        let plans = per_batch(batches.len(), |i| plan_batch(&batches[i]))?;
        times.bytes += plans.iter().map(|p| p.image.total as u64).sum::<u64>();
        let planned = Instant::now();
        times.plan += planned - start;
        let memories = plans
            .iter()
            .map(|plan| self.device.allocate(plan.image.total))
            .collect::<Result<Vec<_>>>()?;
        times.allocate += planned.elapsed();
        let images: Vec<(&Packer, &dyn DeviceMemory)> = plans
            .iter()
            .zip(&memories)
            .map(|(plan, memory)| (&plan.image, memory.as_ref()))
            .collect();
        let uploaded = if self.device.host_accessible() {
            self.pack_into(&images, times);
            Ok(())
        } else {
            self.upload(&images, times)
        };
        let start = Instant::now();
        let event = self.settle(uploaded.and_then(|()| self.device.record_event()));
        times.copy += start.elapsed();
        let event = event?;
        Ok(batches
            .iter()
            .zip(plans.into_iter().zip(memories))
            .map(|(batch, (plan, memory))| DeviceBatch {
                schema: batch.schema(),
                num_rows: batch.num_rows(),
                storage: Storage::Packed {
                    root: Arc::new(plan.root),
                    memory,
                },
                event: event.clone(),
                device: self.device.clone(),
            })
            .collect())
    }

    /// Packs every image straight into its memory, which the host may write
    /// ([`Device::host_accessible`](devarrow_abi::device::Device::host_accessible)): all
    /// images in one parallel pass (see [`fill_outputs`]), no staging.
    fn pack_into(&self, images: &[(&Packer, &dyn DeviceMemory)], times: &mut StageTimes) {
        let start = Instant::now();
        let outputs = images
            .iter()
            .filter(|(image, _)| image.total > 0)
            .map(|(image, memory)| {
                // `host_accessible`: the address is a host address of `memory.len() >=
                // total` bytes, and no device work is pending on it; the allocation is
                // fresh, so nothing else reads or writes it yet.
                // SAFETY: so the range is valid for writes and exclusively ours while we
                // pack.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(
                        memory.address().cast::<MaybeUninit<u8>>(),
                        image.total,
                    )
                };
                (&image.segments[..], out)
            })
            .collect();
        fill_outputs(
            outputs,
            self.parallelism(),
            |segments, offset, out, stores| pack_range_with(segments, offset, out, stores),
        );
        times.pack += start.elapsed();
    }

    /// Enqueues the upload of every `(image, device memory)` pair: the runs that lie in
    /// pinned (or registered) host memory as direct copies first, then everything else
    /// through the staging pipeline (`upload.rs`), all images in one pipeline.
    fn upload(
        &mut self,
        images: &[(&Packer, &dyn DeviceMemory)],
        times: &mut StageTimes,
    ) -> Result<()> {
        let mut staged = Vec::with_capacity(images.len());
        for (image, memory) in images {
            if image.total == 0 {
                staged.push(Vec::new());
                continue;
            }
            staged.push(self.upload_direct(image, *memory, times)?);
        }
        let start = Instant::now();
        let parallelism = self.parallelism();
        let staged_total: usize = staged.iter().flatten().map(|r| r.len()).sum();
        let chunk = self.full_chunk();
        let size = upload_window_bytes(staged_total, self.options.first_chunk_bytes, chunk);
        let mut windows = Vec::new();
        for (i, ranges) in staged.iter().enumerate() {
            crate::transfer::upload::cut_windows(i, ranges, size, &mut windows);
        }
        if windows.is_empty() {
            return Ok(());
        }
        // Only as many staging buffers as there are windows: pinned memory is costly to
        // allocate (and its allocation synchronizes the device).
        let bound = (self.options.staging_bytes.max(2 * BUFFER_ALIGNMENT) / chunk).max(2);
        let slots = bound.min(windows.len());
        let slot_list = self.slots(slots)?;
        let workers = if staged_total < parallelism.min_bytes || windows.len() < 2 {
            0
        } else if self.options.pack_threads == 0 {
            // By default one core is left to the calling thread, which enqueues the
            // copies (and to the driver's threads, or a modelled link's copy engine):
            // on a machine of few cores, workers on every core starve it (on 2 cores, 2
            // workers and a modelled copy engine moved half what 1 worker did).
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            parallelism.threads.min(cores.saturating_sub(1)).max(1)
        } else {
            parallelism.threads
        };
        let pipeline_images: Vec<crate::transfer::upload::Image<'_>> = images
            .iter()
            .map(|(image, memory)| crate::transfer::upload::Image {
                segments: &image.segments,
                dst_base: memory.address() as usize,
            })
            .collect();
        let mut pending: Vec<Option<Arc<dyn SyncEvent>>> = self.stages[..slots]
            .iter_mut()
            .map(|stage| stage.pending.take())
            .collect();
        times.copy += start.elapsed();
        let result = crate::transfer::upload::Pipeline {
            images: &pipeline_images,
            windows: &windows,
            slots: &slot_list,
            pending: &mut pending,
            workers,
            in_flight: (bound / 4).max(2),
        }
        .run(self.device.as_ref(), times);
        for (stage, event) in self.stages.iter_mut().zip(pending) {
            stage.pending = event;
        }
        result
    }

    /// The first `n` staging buffers, allocated (at the full chunk size) where missing,
    /// as the pipeline's slots. Their pending copies are not waited for here.
    fn slots(&mut self, n: usize) -> Result<Vec<crate::transfer::upload::Slot>> {
        let size = self.full_chunk();
        if self.stages.len() < n {
            self.stages.resize_with(n, Stage::default);
        }
        let mut slots = Vec::with_capacity(n);
        for stage in &mut self.stages[..n] {
            if stage
                .memory
                .as_ref()
                .is_none_or(|m| m.as_slice().len() < size)
            {
                // A smaller buffer (of a call with other options) may still be read by
                // a copy: wait for it before freeing it.
                if let Some(event) = stage.pending.take() {
                    event.wait_host()?;
                }
                stage.memory = None;
                stage.memory = Some(self.device.allocate_staging(size)?);
            }
            let memory = stage.memory.as_mut().expect("allocated above");
            let bytes = memory.as_mut_slice();
            slots.push(crate::transfer::upload::Slot {
                ptr: bytes.as_mut_ptr(),
                len: bytes.len(),
            });
        }
        Ok(slots)
    }

    /// The direct copies of one image (see [`Transfer::upload`]); returns the image
    /// ranges left to stage.
    fn upload_direct(
        &mut self,
        image: &Packer,
        memory: &dyn DeviceMemory,
        times: &mut StageTimes,
    ) -> Result<Vec<std::ops::Range<usize>>> {
        let start = Instant::now();
        let device = self.device.clone();
        let base = memory.address() as usize;
        // Runs already in pinned memory, and large buffers the device registers for
        // direct DMA: one copy each, straight from the batch, all enqueued first (in one
        // call) so the copy engine starts on them while the rest is packed.
        let register_from = self.register_from();
        let mut registrations = Vec::new();
        // SAFETY: the batch's buffers outlive the copies (`retain` keeps them until the
        // event recorded after the copies completes), and so do the registrations
        // (`retain`, or `release_registrations` on errors).
        let runs = unsafe {
            direct_runs(
                device.as_ref(),
                &image.segments,
                self.options.direct_min_bytes,
                register_from,
                &mut registrations,
            )
        }?;
        // Registering is making host memory ready for the copies: counted as allocation.
        if register_from.is_some() {
            times.allocate += start.elapsed();
        } else {
            times.copy += start.elapsed();
        }
        let start = Instant::now();
        if !runs.is_empty() {
            let copies: Vec<HostToDevice> = runs
                .iter()
                .map(|run| HostToDevice {
                    src: run.host,
                    dst: (base + run.image.start) as *mut std::ffi::c_void,
                    len: run.image.len(),
                })
                .collect();
            // The runs' segments lie at one displacement inside one allocation that
            // `is_pinned` vouched for, or are the whole pages of single buffers
            // registered above.
            // SAFETY: every source is valid for its span as above, kept alive until the
            // copies complete (see above); the destinations lie inside the device region
            // of `total` bytes, one run each, not overlapping.
            let enqueued = unsafe { device.copy_batch_to_device(&copies) }
                .and_then(|()| device.record_event());
            let event = match enqueued {
                Ok(event) => event,
                Err(e) => {
                    let _ = release_registrations(device.as_ref(), None, registrations);
                    return Err(e);
                }
            };
            let buffers = runs
                .iter()
                .flat_map(|run| image.segments[run.segments.clone()].iter())
                .map(|(b, _)| b.clone())
                .collect();
            self.retain(Retained {
                event,
                buffers,
                registrations,
            })?;
        }
        times.copy += start.elapsed();
        Ok(staged_ranges(&image.segments, &runs))
    }

    /// Keeps what copies enqueued before `retained.event` use (buffers they read,
    /// registrations) until that event has completed: at most [`MAX_RETAINED`] uploads
    /// are kept, the oldest waited for first (copies complete in stream order, so it is
    /// normally long done), and dropping the transfer waits for all.
    fn retain(&mut self, retained: Retained) -> Result<()> {
        self.retained.push_back(retained);
        while self.retained.len() > MAX_RETAINED {
            if let Some(oldest) = self.retained.pop_front() {
                oldest.release(self.device.as_ref())?;
            }
        }
        Ok(())
    }
}
