//! Moving record batches between the host and a [`Device`]: [`Transfer`], which makes and
//! downloads device-resident batches ([`DeviceBatch`], re-exported here).
//!
//! A transfer plans the batch ([`crate::plan`]), allocates one device region for all its
//! buffers, and streams the packed image through a bounded set of staging buffers (pinned
//! on CUDA): while chunk *k* is copied by the device, chunk *k + 1* is packed on the host.
//! Small buffers therefore travel together in one copy, a slice moves only its bytes, and
//! no copy waits for another except to reuse a staging buffer.
//!
//! Chunks are packed and unpacked on several threads ([`crate::pack`]), and buffers that
//! already lie in pinned memory are copied straight from it ([`crate::pinned`]). On a
//! device whose memory the host reaches directly ([`Device::host_accessible`]: the CPU
//! device made by `CpuDevice::direct`) there is no staging: a batch is packed straight
//! into device memory and unpacked straight from it.
//!
//! On a device that page-locks pageable host memory for direct DMA
//! ([`Device::host_registration_min_bytes`]; on CUDA, `CudaDeviceOptions::register_pageable`),
//! large buffers skip staging as pinned ones do: an upload registers the whole pages
//! inside them and copies those straight from the batch (the partial pages at their ends
//! are staged with the small buffers), a download allocates its large outputs as whole
//! pages of their own, registers them and copies straight into them; the registrations
//! are dropped once those copies have completed.
//!
//! The host memory batches come back into is taken from a pool
//! ([`TransferOptions::host_pool_bytes`], [`Transfer::set_host_pool`]) that reuses the
//! memory of batches dropped since, so that it is not faulted in afresh for every batch.
//! Every call adds the host time of its stages to [`Transfer::stats`].

use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_buffer::{Buffer, MutableBuffer};
use devarrow_abi::device::{
    check_same_device, Device, DeviceMemory, DeviceToHost, HostPool, HostRegistration,
    HostToDevice, PooledMemory, StagingMemory, SyncEvent, BUFFER_ALIGNMENT,
};
use devarrow_abi::Result;

pub use crate::batch::DeviceBatch;
use crate::batch::Storage;
use crate::host::host_batch;
#[doc(inline)]
pub use crate::pack::DEFAULT_PARALLEL_MIN_BYTES;
use crate::pack::{
    advise_huge_pages, copy_to_uninit, pack_window_uninit, ramped_windows, upload_window_bytes,
    Parallelism,
};
use crate::pinned::{direct_runs, staged_ranges};
use crate::plan::{plan_batch, Packer};
#[doc(inline)]
pub use crate::stages::{StageTimes, TransferStats};

/// Default bound on staging memory per [`Transfer`]: 64 MiB.
pub const DEFAULT_STAGING_BYTES: usize = 64 << 20;

/// Default size of one staging chunk (the largest copy): 4 MiB, so the default 64 MiB of
/// staging is 16 buffers: 8 workers packing, each a window ahead, while 4 copies are
/// queued on the device (see the upload pipeline, `upload.rs`).
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

/// Default size of the first and last chunks of a copy: 1 MiB (see
/// [`TransferOptions::first_chunk_bytes`]).
pub const DEFAULT_FIRST_CHUNK_BYTES: usize = 1 << 20;

/// Default size from which pinned host memory is copied directly: 256 KiB.
pub const DEFAULT_DIRECT_MIN_BYTES: usize = 256 << 10;

/// Default bound on the host memory a transfer's pool keeps for reuse: 256 MiB (see
/// [`TransferOptions::host_pool_bytes`]).
pub const DEFAULT_HOST_POOL_BYTES: usize = 256 << 20;

/// Default bound on the pinned host memory downloads land in: 1 GiB (see
/// [`TransferOptions::pinned_host_bytes`]).
pub const DEFAULT_PINNED_HOST_BYTES: usize = 1 << 30;

/// Options of a [`Transfer`].
///
/// Build them with struct update syntax, e.g.
/// `TransferOptions { staging_bytes: 1 << 20, ..Default::default() }`.
#[derive(Debug, Clone, Copy)]
pub struct TransferOptions {
    /// The most staging memory the transfer allocates, in `staging_bytes / chunk_bytes`
    /// (at least 2) buffers of one chunk each, used in turn so that packing a window
    /// overlaps the copies of the windows before it.
    pub staging_bytes: usize,
    /// The size of one staging buffer: the most bytes of one copy (clamped to at most
    /// half of `staging_bytes`, so at least two buffers alternate).
    ///
    /// An upload is cut in windows of about a sixteenth of what it stages, at least
    /// [`first_chunk_bytes`](Self::first_chunk_bytes) and at most this (see
    /// [`pack::upload_window_bytes`](crate::pack::upload_window_bytes)): each worker packs
    /// a whole window into a buffer of its own while the copies of earlier windows run,
    /// so the buffers must outnumber the workers (8 by default) and the copies kept in
    /// flight (a quarter of the buffers): with the default 64 MiB, 16 buffers of 4 MiB.
    /// Windows must stay large enough that the fixed cost of a copy (a few µs of driver
    /// and DMA setup) is small: a 4 MiB copy takes about 80 µs at 50 GB/s.
    pub chunk_bytes: usize,
    /// Uploads: the smallest window (see [`chunk_bytes`](Self::chunk_bytes)); 0 cuts
    /// windows of `chunk_bytes`. Downloads through staging: the size of the first and
    /// the last chunk of a copy of more than 4 × this size: chunks then grow from this
    /// size, doubling, up to `chunk_bytes`, and shrink the same way at the end, so that
    /// the host starts unpacking after a small copy and the last step, which overlaps
    /// nothing, is short; 0, or a value of at least `chunk_bytes`, cuts every copy in
    /// equal chunks.
    pub first_chunk_bytes: usize,
    /// Uploads: how many worker threads (of the rayon global pool) pack windows; 0 (the
    /// default): the pool's size, at most 8, and one fewer than the machine's cores (a
    /// core is left to the thread that enqueues the copies). Downloads through staging:
    /// the most threads one chunk is unpacked with (0: the pool's size, at most 8).
    pub pack_threads: usize,
    /// Uploads of less than this many staged bytes are packed by the calling thread
    /// alone, and staged download chunks smaller than this unpacked by it (handing work
    /// to other threads costs a few µs).
    pub parallel_min_bytes: usize,
    /// Runs of buffers at least this long that lie in pinned memory (see
    /// [`crate::pinned`] and [`Device::is_pinned`]) are copied directly to the device,
    /// skipping staging; smaller ones are packed with the others (one copy for many
    /// small buffers beats many tiny copies). `usize::MAX` disables direct copies.
    pub direct_min_bytes: usize,
    /// The host memory of downloads comes from a pool of the transfer that keeps up to
    /// this many bytes of memory freed by dropped batches for reuse, so that it is
    /// written again without page faults; 0: every download allocates fresh host memory
    /// (advised to use huge pages from 4 MiB on). [`Transfer::set_host_pool`] shares one
    /// pool between transfers.
    pub host_pool_bytes: usize,
    /// Downloads land in pinned (page-locked) host memory of a pool of at most this many
    /// bytes, which the device copies into directly: no staging copy, no page faults,
    /// and a batch brought back uploads again by direct copies. The memory of a batch
    /// goes back to the pool when the batch (every buffer of it) is dropped. When the
    /// pool is full (batches still held), or the device refuses to pin memory, downloads
    /// land in pageable memory through staging instead, and
    /// [`Transfer::host_memory_note`] says why. 0: always pageable memory.
    ///
    /// The pool's first block of each size is allocated when a download first needs it
    /// (on CUDA `cuMemHostAlloc`, which NVIDIA documents as synchronizing: work enqueued
    /// afterwards on any stream of the device waits for all the work enqueued before);
    /// once the sizes of a workload are cached, downloads make no such call. A first
    /// download that must not wait for other streams follows a warm-up download of the
    /// same size, or sets this to 0 (after [`Transfer::prepare`]).
    pub pinned_host_bytes: usize,
}

impl Default for TransferOptions {
    fn default() -> Self {
        Self {
            staging_bytes: DEFAULT_STAGING_BYTES,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            first_chunk_bytes: DEFAULT_FIRST_CHUNK_BYTES,
            pack_threads: 0,
            parallel_min_bytes: DEFAULT_PARALLEL_MIN_BYTES,
            direct_min_bytes: DEFAULT_DIRECT_MIN_BYTES,
            host_pool_bytes: DEFAULT_HOST_POOL_BYTES,
            pinned_host_bytes: DEFAULT_PINNED_HOST_BYTES,
        }
    }
}

#[derive(Debug, Default)]
struct Stage {
    memory: Option<Box<dyn StagingMemory>>,
    pending: Option<Arc<dyn SyncEvent>>,
}

/// How many uploads with direct copies keep their source buffers alive at most before
/// the oldest is waited for (see [`Transfer::retain`]).
const MAX_RETAINED: usize = 4;

/// What the direct copies of an upload use until they complete: the host buffers they
/// read, and the registrations that made pageable ones directly DMA-able.
#[derive(Debug)]
struct Retained {
    event: Arc<dyn SyncEvent>,
    buffers: Vec<Buffer>,
    registrations: Vec<Box<dyn HostRegistration>>,
}

impl Retained {
    /// Waits for the copies, then lets the buffers and registrations go (see
    /// [`release_registrations`]).
    fn release(self, device: &dyn Device) -> Result<()> {
        let Retained {
            event,
            buffers,
            registrations,
        } = self;
        let released = release_registrations(device, Some(&event), registrations);
        drop(buffers);
        released
    }
}

/// Drops `registrations` (of host memory that copies enqueued on `device` use) once those
/// copies have completed: after `event`, or, without one or when waiting for it fails,
/// after synchronizing the device. Where even that fails, they are leaked rather than
/// undone under a DMA that may still run (which could read or write pages the system
/// has moved meanwhile); the driver drops them with the context. Returns the first
/// error.
fn release_registrations(
    device: &dyn Device,
    event: Option<&Arc<dyn SyncEvent>>,
    registrations: Vec<Box<dyn HostRegistration>>,
) -> Result<()> {
    let waited = match event {
        Some(event) => event.wait_host(),
        None if registrations.is_empty() => Ok(()),
        None => device.synchronize(),
    };
    let done = match &waited {
        Ok(()) => true,
        Err(_) => !registrations.is_empty() && device.synchronize().is_ok(),
    };
    if done {
        drop(registrations);
    } else {
        std::mem::forget(registrations);
    }
    waited
}

/// A reusable transfer engine for one device: owns the staging buffers.
///
/// Keep one per device and thread and reuse it: its pinned staging chunks are allocated
/// once, and many batches download in one pipeline ([`Transfer::to_host_batches`]).
///
/// # Example
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, Float64Array, Int32Array, RecordBatch};
/// use devarrow_abi::device::{CpuDevice, Device};
/// use devarrow_bridge::{Transfer, TransferOptions};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let batch = RecordBatch::try_from_iter([
///     ("a", Arc::new(Int32Array::from_iter_values(0..4096)) as ArrayRef),
///     ("b", Arc::new(Float64Array::from_iter_values((0..4096).map(f64::from))) as ArrayRef),
/// ])?;
/// let device = Arc::new(CpuDevice::new());
/// let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
///
/// let uploaded = (0..4)
///     .map(|i| transfer.to_device(&batch.slice(i * 1024, 1024)))
///     .collect::<devarrow_abi::Result<Vec<_>>>()?;
/// // Small buffers share a staging chunk: each batch went up in one copy.
/// assert_eq!(device.copy_count(), 4);
///
/// let back = transfer.to_host_batches(&uploaded)?; // one pipeline for all four
/// assert_eq!(back.len(), 4);
/// assert_eq!(back[3], batch.slice(3072, 1024));
/// println!("{:?}", transfer.stats().to_device);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Transfer {
    device: Arc<dyn Device>,
    options: TransferOptions,
    stages: Vec<Stage>,
    /// Host buffers (and registrations) that direct copies use, kept until the event
    /// completes.
    retained: VecDeque<Retained>,
    /// Where the host memory of downloads comes from (`None`: fresh allocations).
    host_pool: Option<Arc<HostPool>>,
    /// The pinned memory downloads land in (made on first use).
    pinned_pool: Option<Arc<HostPool>>,
    /// Set once the device refused to pin memory: downloads stay pageable.
    pinned_refused: bool,
    /// Why downloads last fell back to pageable memory.
    note: Option<String>,
    stats: TransferStats,
}

impl Transfer {
    /// A transfer engine for `device`.
    pub fn new(device: Arc<dyn Device>, options: TransferOptions) -> Self {
        let host_pool =
            (options.host_pool_bytes > 0).then(|| Arc::new(HostPool::new(options.host_pool_bytes)));
        Self {
            device,
            options,
            stages: Vec::new(),
            retained: VecDeque::new(),
            host_pool,
            pinned_pool: None,
            pinned_refused: false,
            note: None,
            stats: TransferStats::default(),
        }
    }

    /// Why the last downloads that fell back from pinned to pageable memory did so (the
    /// pool was full, or the device refused to pin memory); `None` if none did.
    pub fn host_memory_note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// The pool of pinned host memory downloads land in, once made (see
    /// [`TransferOptions::pinned_host_bytes`]).
    pub fn pinned_host_pool(&self) -> Option<&Arc<HostPool>> {
        self.pinned_pool.as_ref()
    }

    /// Lands downloads in `pool` (e.g. one shared by several transfers; a pool made by
    /// [`HostPool::pinned`] for this transfer's device), or, with `None`, in the pool
    /// this transfer makes on first use. Batches already downloaded keep their memory.
    pub fn set_pinned_host_pool(&mut self, pool: Option<Arc<HostPool>>) {
        self.pinned_pool = pool;
        self.pinned_refused = false;
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The host time of every stage of the transfers so far, per direction.
    pub fn stats(&self) -> TransferStats {
        self.stats
    }

    /// [`Transfer::stats`], and starts counting afresh.
    pub fn take_stats(&mut self) -> TransferStats {
        std::mem::take(&mut self.stats)
    }

    /// The pool the host memory of downloads comes from (`None`: fresh allocations).
    pub fn host_pool(&self) -> Option<&Arc<HostPool>> {
        self.host_pool.as_ref()
    }

    /// Takes the host memory of downloads from `pool` (e.g. one shared by several
    /// transfers), or, with `None`, from fresh allocations. Batches already downloaded
    /// keep their memory, which goes back to the pool it came from when they drop.
    pub fn set_host_pool(&mut self, pool: Option<Arc<HostPool>>) {
        self.host_pool = pool;
    }

    /// Allocates now every staging chunk the transfer uses
    /// ([`TransferOptions::staging_bytes`] in all), instead of as the first transfers
    /// need them; a no-op where the host reads the device's memory directly (no staging).
    ///
    /// On CUDA the staging memory is pinned, and allocating pinned memory
    /// (`cuMemHostAlloc`) is one of the calls NVIDIA documents as implicitly synchronizing:
    /// work enqueued afterwards on any stream of the device runs only after all the work
    /// enqueued before it, another library's included. Prepared at setup, the transfers
    /// that follow make no such call: a stream held by someone else does not delay them.
    /// (Staging given back by a dropped transfer of the same `CudaDevice` is reused
    /// without that call.)
    pub fn prepare(&mut self) -> Result<()> {
        if self.device.host_accessible() {
            return Ok(());
        }
        let chunk = self.full_chunk();
        let (_, stages) = self.geometry(chunk);
        for i in 0..stages {
            self.stage(i, chunk)?;
        }
        Ok(())
    }

    /// The chunk size and the number of staging buffers for an image of `total` bytes.
    fn geometry(&self, total: usize) -> (usize, usize) {
        let chunk = self.full_chunk();
        let stages = self.options.staging_bytes.max(2 * BUFFER_ALIGNMENT) / chunk;
        (chunk.min(total.max(1)), stages)
    }

    /// The configured chunk size, clamped so that at least two chunks fit the bound.
    fn full_chunk(&self) -> usize {
        let bound = self.options.staging_bytes.max(2 * BUFFER_ALIGNMENT);
        self.options.chunk_bytes.clamp(BUFFER_ALIGNMENT, bound / 2)
    }

    fn parallelism(&self) -> Parallelism {
        Parallelism::new(self.options.pack_threads, self.options.parallel_min_bytes)
    }

    /// Takes stage `i`, waiting for its last copy to finish and allocating it if needed.
    ///
    /// A stage is allocated once at the full chunk size, whatever the first transfer
    /// needs: growing it later would free and allocate pinned memory in the middle of a
    /// pipeline, and `cuMemFreeHost` / `cuMemHostAlloc` stall every stream of the device
    /// (other libraries' work too).
    fn stage(&mut self, i: usize, chunk: usize) -> Result<&mut Box<dyn StagingMemory>> {
        let size = chunk.max(self.full_chunk());
        if self.stages.len() <= i {
            self.stages.resize_with(i + 1, Stage::default);
        }
        let stage = &mut self.stages[i];
        if let Some(event) = stage.pending.take() {
            event.wait_host()?;
        }
        if stage
            .memory
            .as_ref()
            .is_none_or(|m| m.as_slice().len() < chunk)
        {
            stage.memory = None;
            stage.memory = Some(self.device.allocate_staging(size)?);
        }
        Ok(stage.memory.as_mut().expect("allocated above"))
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

    /// The size from which buffers are registered for direct DMA
    /// ([`Device::host_registration_min_bytes`], at least
    /// [`TransferOptions::direct_min_bytes`]), if the device registers any.
    fn register_from(&self) -> Option<usize> {
        self.device
            .host_registration_min_bytes()
            .map(|min| min.max(self.options.direct_min_bytes))
    }

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
    /// the order of `batches`; the first error returns, and no batch is returned then.
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
    /// use devarrow_abi::device::{CpuDevice, Device};
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
        let mut plans = Vec::with_capacity(batches.len());
        let mut memories = Vec::with_capacity(batches.len());
        for batch in batches {
            let start = Instant::now();
            let plan = plan_batch(batch)?;
            times.bytes += plan.image.total as u64;
            let planned = Instant::now();
            times.plan += planned - start;
            memories.push(self.device.allocate(plan.image.total)?);
            times.allocate += planned.elapsed();
            plans.push(plan);
        }
        let uploaded = if self.device.host_accessible() {
            for (plan, memory) in plans.iter().zip(&memories) {
                self.pack_into(&plan.image, memory.as_ref(), times);
            }
            Ok(())
        } else {
            let images: Vec<(&Packer, &dyn DeviceMemory)> = plans
                .iter()
                .zip(&memories)
                .map(|(plan, memory)| (&plan.image, memory.as_ref()))
                .collect();
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

    /// Passes `result` through; on an error, first waits for everything already enqueued
    /// on the device. A copy enqueued before the step that failed (typically a copy whose
    /// event could not be recorded) is tracked by nothing else: without the wait, it would
    /// still read or write the caller's buffers (a batch it may free on another stream
    /// as soon as the error returns, host buffers of direct copies) and the staging
    /// buffers (reused by the next call) after the error returned.
    fn settle<T>(&mut self, result: Result<T>) -> Result<T> {
        if result.is_err() {
            // If this fails too the device is unusable; the stages' events stay, for
            // `Drop` to try again.
            if self.device.synchronize().is_ok() {
                for stage in &mut self.stages {
                    stage.pending = None;
                }
            }
        }
        result
    }

    /// Packs `image` straight into `memory`, which the host may write
    /// ([`Device::host_accessible`]): the whole image in one parallel pack, no staging.
    fn pack_into(&self, image: &Packer, memory: &dyn DeviceMemory, times: &mut StageTimes) {
        let total = image.total;
        if total == 0 {
            return;
        }
        let start = Instant::now();
        // `host_accessible`: the address is a host address of `memory.len() >= total`
        // bytes, and no device work is pending on it; the allocation is fresh, so nothing
        // else reads or writes it yet.
        // SAFETY: so the range is valid for writes and exclusively ours while we pack.
        let out = unsafe {
            std::slice::from_raw_parts_mut(memory.address().cast::<MaybeUninit<u8>>(), total)
        };
        pack_window_uninit(&image.segments, 0, out, self.parallelism());
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
            crate::upload::cut_windows(i, ranges, size, &mut windows);
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
        let pipeline_images: Vec<crate::upload::Image<'_>> = images
            .iter()
            .map(|(image, memory)| crate::upload::Image {
                segments: &image.segments,
                dst_base: memory.address() as usize,
            })
            .collect();
        let mut pending: Vec<Option<Arc<dyn SyncEvent>>> = self.stages[..slots]
            .iter_mut()
            .map(|stage| stage.pending.take())
            .collect();
        times.copy += start.elapsed();
        let result = crate::upload::Pipeline {
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
    fn slots(&mut self, n: usize) -> Result<Vec<crate::upload::Slot>> {
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
            slots.push(crate::upload::Slot {
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

    /// Copies each `(src, len)` range of device memory to a new host buffer through the
    /// staging chunks, all ranges in one pipeline: up to one copy per staging buffer in
    /// flight, each chunk unpacked (in parallel) as soon as its copy completes and its
    /// slot refilled at once, so the copies of range k + 1 run while range k is
    /// unpacked. Only the first and the last chunk of the whole call are ramped (see
    /// [`windows`]). The host buffers are not zero-filled first: every byte is written by
    /// the unpacking.
    fn download(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        if let Some(pool) = self.pinned_pool()? {
            return self.download_pinned(sources, &pool, times);
        }
        if self.pinned_refused {
            // Pinning was refused earlier: these fall back too (the note says why).
            self.stats.pageable_downloads += sources.len() as u64;
        }
        if let Some(from) = self.register_from() {
            if sources.iter().any(|&(_, len)| len >= from) {
                return self.download_registering(sources, from, times);
            }
        }
        let pool = self.host_pool.clone();
        let hosts = self.staged_download(sources, times, |sources| {
            sources
                .iter()
                .map(|&(_, len)| HostOut::new(len, pool.as_ref()))
                .collect()
        })?;
        Ok(hosts
            .into_iter()
            // SAFETY: `staged_download` wrote every byte of every output.
            .map(|host| unsafe { host.into_buffer() })
            .collect())
    }

    /// [`Transfer::download`] where the device registers host memory for direct DMA
    /// ([`Device::register_host`]) from `from` bytes on: the outputs are allocated
    /// first, those of at least `from` bytes registered and copied into directly, all in
    /// one [`Device::copy_batch_to_host`], and the other sources downloaded through
    /// staging meanwhile; the registrations are dropped once the direct copies have
    /// completed.
    fn download_registering(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        from: usize,
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        let start = Instant::now();
        // The outputs to register are whole pages of their own, registered whole (a
        // registration never reaches into a neighbouring allocation's pages).
        let mut hosts = sources
            .iter()
            .map(|&(_, len)| match len >= from {
                true => HostOut::pages(len).map(Some),
                false => HostOut::new(len, self.host_pool.as_ref()).map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        let device = self.device.clone();
        let mut registrations = Vec::new();
        let mut direct = Vec::new();
        let mut staged = Vec::new();
        for (i, &(src, len)) in sources.iter().enumerate() {
            if len >= from {
                let host = hosts[i].as_mut().expect("allocated");
                let pages = host.capacity();
                let dst = host.as_uninit().as_mut_ptr().cast::<u8>();
                // SAFETY: the output (`pages` bytes) stays allocated in `hosts` until the
                // direct copies have completed: the registration is dropped after they have
                // (`release_registrations`, below), and `hosts` only after that.
                if let Some(registration) = unsafe { device.register_host(dst, pages) }? {
                    registrations.push(registration);
                    direct.push(DeviceToHost { src, dst, len });
                    continue;
                }
            }
            staged.push(i);
        }
        let enqueued = Instant::now();
        times.allocate += enqueued - start;
        let direct_done = if direct.is_empty() {
            None
        } else {
            // SAFETY: every destination is a registered output of its copy's length, not
            // read (nor otherwise written) until the event recorded next has completed;
            // the sources lie in the downloads' device memory.
            let copied = unsafe { device.copy_batch_to_host(&direct) };
            let event = copied.and_then(|()| device.record_event());
            match event {
                Ok(event) => Some(event),
                Err(e) => {
                    if release_registrations(device.as_ref(), None, registrations).is_err() {
                        // Copies may still write the outputs: leak them, as the
                        // registrations.
                        std::mem::forget(hosts);
                    }
                    return Err(e);
                }
            }
        };
        times.copy += enqueued.elapsed();
        let staged_sources: Vec<_> = staged.iter().map(|&i| sources[i]).collect();
        let staged_hosts: Vec<HostOut> = staged
            .iter()
            .map(|&i| hosts[i].take().expect("allocated"))
            .collect();
        let downloaded = if staged_sources.is_empty() {
            Ok(staged_hosts)
        } else {
            self.staged_download(&staged_sources, times, move |_| Ok(staged_hosts))
        };
        let waiting = Instant::now();
        let released = release_registrations(device.as_ref(), direct_done.as_ref(), registrations);
        times.copy += waiting.elapsed();
        if released.is_err() && direct_done.is_some() {
            if let Err(e) = device.synchronize() {
                // The direct copies may still write the outputs: leak them.
                std::mem::forget(hosts);
                return Err(e);
            }
        }
        let staged_hosts = downloaded?;
        released?;
        // SAFETY: a direct output was written in full by its copy, which has completed
        // (the event above); a staged one by `staged_download`.
        Ok(unsafe { into_buffers(hosts, &staged, staged_hosts) })
    }

    /// The pool of pinned memory downloads land in, made on first use
    /// ([`TransferOptions::pinned_host_bytes`]); `None` where there is none: the option
    /// is 0, the device's memory is host memory ([`Device::host_accessible`]), or it was
    /// given up ([`Transfer::host_memory_note`] says why).
    fn pinned_pool(&mut self) -> Result<Option<Arc<HostPool>>> {
        if self.pinned_pool.is_none()
            && !self.pinned_refused
            && self.options.pinned_host_bytes > 0
            && !self.device.host_accessible()
        {
            self.pinned_pool = Some(Arc::new(HostPool::pinned(
                self.device.clone(),
                self.options.pinned_host_bytes,
            )));
        }
        Ok(self.pinned_pool.clone())
    }

    /// [`Transfer::download`] into pinned memory of `pool`: each source is copied straight
    /// into a block of its own (one batched call for all), which becomes the batch's
    /// memory, with no staging copy and no page faults. Sources the pool has no room for
    /// (or all of them, when the device refuses to pin memory) go through the staging
    /// pipeline into pageable memory instead, and [`Transfer::host_memory_note`] says why.
    fn download_pinned(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        pool: &Arc<HostPool>,
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        let start = Instant::now();
        let mut hosts: Vec<Option<HostOut>> = Vec::with_capacity(sources.len());
        let mut direct = Vec::new();
        let mut staged = Vec::new();
        for (i, &(src, len)) in sources.iter().enumerate() {
            let tried = if self.pinned_refused {
                Ok(None)
            } else {
                pool.try_allocate(len)
            };
            let block = match tried {
                Ok(block) => block,
                Err(e) => {
                    // Pinning refused (a sandbox, a lock limit): pageable from now on.
                    self.pinned_refused = true;
                    self.pinned_pool = None;
                    self.note = Some(format!(
                        "pinned host memory refused ({e}): downloads land in pageable memory"
                    ));
                    None
                }
            };
            match block {
                Some(mut block) => {
                    let dst = block.as_uninit_mut().as_mut_ptr().cast::<u8>();
                    if len > 0 {
                        direct.push(DeviceToHost { src, dst, len });
                    }
                    hosts.push(Some(HostOut::Pooled(block)));
                    self.stats.pinned_downloads += 1;
                }
                None => {
                    if !self.pinned_refused {
                        let stats = pool.stats();
                        self.note = Some(format!(
                            "the pinned host memory pool ({} bytes, TransferOptions::\
                             pinned_host_bytes) was full ({} bytes held by batches not yet \
                             dropped): downloads beyond it land in pageable memory",
                            pool.limit(),
                            stats.in_use_bytes
                        ));
                    }
                    staged.push(i);
                    hosts.push(None);
                    self.stats.pageable_downloads += 1;
                }
            }
        }
        let enqueued = Instant::now();
        times.allocate += enqueued - start;
        let device = self.device.clone();
        let direct_done = if direct.is_empty() {
            None
        } else {
            // SAFETY: every destination is a block of the pool of its copy's length, owned
            // by `hosts` and not read (nor otherwise written) until the event recorded next
            // has completed; the sources lie in the downloads' device memory.
            let copied = unsafe { device.copy_batch_to_host(&direct) };
            match copied.and_then(|()| device.record_event()) {
                Ok(event) => Some(event),
                Err(e) => {
                    if device.synchronize().is_err() {
                        // Copies may still write the blocks: leak them.
                        std::mem::forget(hosts);
                    }
                    return Err(e);
                }
            }
        };
        times.copy += enqueued.elapsed();
        let staged_sources: Vec<_> = staged.iter().map(|&i| sources[i]).collect();
        let host_pool = self.host_pool.clone();
        let downloaded = if staged_sources.is_empty() {
            Ok(Vec::new())
        } else {
            self.staged_download(&staged_sources, times, |sources| {
                sources
                    .iter()
                    .map(|&(_, len)| HostOut::new(len, host_pool.as_ref()))
                    .collect()
            })
        };
        let waiting = Instant::now();
        let waited = direct_done
            .as_ref()
            .map_or(Ok(()), |event| event.wait_host());
        times.copy += waiting.elapsed();
        if waited.is_err() && device.synchronize().is_err() {
            // The direct copies may still write the blocks: leak them.
            std::mem::forget(hosts);
            return Err(waited.expect_err("checked above"));
        }
        let staged_hosts = downloaded?;
        waited?;
        // SAFETY: a pinned output was written in full by its copy, which has completed
        // (the event above); a staged one by `staged_download`.
        Ok(unsafe { into_buffers(hosts, &staged, staged_hosts) })
    }

    /// The staging pipeline of [`Transfer::download`]: copies each source into the
    /// output `outputs` gives for it (one per source, of its length), which is asked for
    /// once the first copies are enqueued (so that allocating the outputs overlaps them),
    /// and returns the outputs, every byte written.
    fn staged_download(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        times: &mut StageTimes,
        outputs: impl FnOnce(&[(*const std::ffi::c_void, usize)]) -> Result<Vec<HostOut>>,
    ) -> Result<Vec<HostOut>> {
        let largest = sources.iter().map(|&(_, len)| len).max().unwrap_or(0);
        let (chunk, stages) = self.geometry(largest);
        let last = sources.len().saturating_sub(1);
        // (source, start, end) of every copy, in order.
        let windows: Vec<(usize, usize, usize)> = sources
            .iter()
            .enumerate()
            .flat_map(|(i, &(_, len))| {
                let (head, tail) = (i == 0, i == last);
                ramped_windows(0, len, self.options.first_chunk_bytes, chunk, head, tail)
                    .into_iter()
                    .map(move |(s, e)| (i, s, e))
            })
            .collect();
        let enqueue = |this: &mut Self, k: usize| -> Result<()> {
            let (i, s, e) = windows[k];
            let device = this.device.clone();
            let staging = this.stage(k % stages, chunk)?;
            let from = (sources[i].0 as usize + s) as *const std::ffi::c_void;
            // SAFETY: the staging buffer is not read until the event recorded next has
            // completed; the source range lies inside the caller's device memory.
            unsafe { device.copy_to_host(from, staging.as_mut_slice().as_mut_ptr(), e - s)? };
            this.stages[k % stages].pending = Some(device.record_event()?);
            Ok(())
        };
        let start = Instant::now();
        for k in 0..windows.len().min(stages) {
            enqueue(self, k)?;
        }
        let allocating = Instant::now();
        times.copy += allocating - start;
        let mut hosts = outputs(sources)?;
        let mut outs: Vec<&mut [MaybeUninit<u8>]> =
            hosts.iter_mut().map(HostOut::as_uninit).collect();
        times.allocate += allocating.elapsed();
        let parallelism = self.parallelism();
        for (k, &(i, s, e)) in windows.iter().enumerate() {
            let start = Instant::now();
            let stage = &mut self.stages[k % stages];
            if let Some(event) = stage.pending.take() {
                event.wait_host()?;
            }
            let staging = stage.memory.as_ref().expect("enqueued");
            let unpacking = Instant::now();
            times.copy += unpacking - start;
            copy_to_uninit(
                &mut outs[i][s..e],
                &staging.as_slice()[..e - s],
                parallelism,
            );
            let unpacked = Instant::now();
            times.unpack += unpacked - unpacking;
            if k + stages < windows.len() {
                enqueue(self, k + stages)?;
                times.copy += unpacked.elapsed();
            }
        }
        drop(outs);
        // The windows of each source cover `0..len` and each was copied in full above,
        // from staging memory (initialized at allocation, then written by the copy).
        Ok(hosts)
    }

    /// [`Transfer::download`] from memory the host reads directly
    /// ([`Device::host_accessible`]): each source copied (in parallel) into host memory.
    fn download_direct(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        let parallelism = self.parallelism();
        sources
            .iter()
            .map(|&(src, len)| {
                let start = Instant::now();
                let mut host = HostOut::new(len, self.host_pool.as_ref())?;
                let unpacking = Instant::now();
                times.allocate += unpacking - start;
                if len > 0 {
                    // `host_accessible`: `src` is a host address of `len` initialized bytes
                    // of device memory, which no device work is writing (the batches'
                    // events have completed: the device never has work pending).
                    // SAFETY: so the range is valid for reads while the download lives.
                    let from = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) };
                    copy_to_uninit(host.as_uninit(), from, parallelism);
                }
                times.unpack += unpacking.elapsed();
                // SAFETY: every byte of `0..len` was copied above.
                Ok(unsafe { host.into_buffer() })
            })
            .collect()
    }

    /// Moves a device-resident batch back to host memory (ordinary arrow-rs buffers).
    ///
    /// An imported batch is first packed on the device (one batched copy of the bytes its
    /// arrays address into one allocation), then moved like a packed one.
    ///
    /// The batch must live on this transfer's device (same device type and id):
    /// otherwise [`Error::UnsupportedDevice`](devarrow_abi::Error::UnsupportedDevice)
    /// (another type) or [`Error::DeviceMismatch`](devarrow_abi::Error::DeviceMismatch)
    /// (another id), as this device cannot copy another one's memory.
    pub fn to_host(&mut self, batch: &DeviceBatch) -> Result<RecordBatch> {
        let mut batches = self.to_host_batches(std::slice::from_ref(batch))?;
        Ok(batches.pop().expect("one batch in, one out"))
    }

    /// Moves several device-resident batches back to host memory, in one pipeline: the
    /// copies of batch k + 1 run while batch k is unpacked, so the copy engine does not
    /// idle between batches as it does between calls of [`Transfer::to_host`] (which has
    /// to wait for a batch's first chunk, and leaves its last unpack overlapping
    /// nothing). Prefer it for many batches of a few MB.
    ///
    /// The result is in the order of `batches`. Every batch must live on this transfer's
    /// device, as for [`Transfer::to_host`]; the first error returns, and no batch is
    /// returned then.
    pub fn to_host_batches(&mut self, batches: &[DeviceBatch]) -> Result<Vec<RecordBatch>> {
        let mut times = StageTimes {
            batches: batches.len() as u64,
            ..Default::default()
        };
        let result = self.download_batches(batches, &mut times);
        self.stats.to_host += times;
        result
    }

    fn download_batches(
        &mut self,
        batches: &[DeviceBatch],
        times: &mut StageTimes,
    ) -> Result<Vec<RecordBatch>> {
        let start = Instant::now();
        for batch in batches {
            check_same_device(batch.device.as_ref(), self.device.as_ref())?;
        }
        let downloads = batches
            .iter()
            .map(|batch| batch.download(&self.device))
            .collect::<Result<Vec<_>>>()?;
        for download in &downloads {
            // SAFETY: the pointer comes from the download's own live event.
            unsafe {
                self.device
                    .wait_sync_event(download.event.as_sync_event_ptr())?
            };
        }
        let sources: Vec<_> = downloads
            .iter()
            .map(|d| (d.memory.address().cast_const(), d.memory.len()))
            .collect();
        times.bytes = sources.iter().map(|&(_, len)| len as u64).sum();
        times.plan += start.elapsed();
        let downloaded = if self.device.host_accessible() {
            self.download_direct(&sources, times)
        } else {
            self.download(&sources, times)
        };
        let hosts = self.settle(downloaded)?;
        let start = Instant::now();
        let batches = downloads
            .iter()
            .zip(&hosts)
            .map(|(download, host)| {
                host_batch(
                    download.schema.clone(),
                    download.num_rows,
                    &download.root,
                    host,
                    download.trusted,
                )
            })
            .collect();
        times.validate += start.elapsed();
        batches
    }
}

/// The outputs of a download as buffers, in order: `hosts`, where the direct copies
/// landed, with `staged_hosts[j]` (the staging pipeline's outputs) put in at index
/// `staged[j]`, the places left empty for them.
///
/// # Safety
/// Every output of `hosts` and of `staged_hosts` must have been written in full, and the
/// copies that wrote them completed.
unsafe fn into_buffers(
    mut hosts: Vec<Option<HostOut>>,
    staged: &[usize],
    staged_hosts: Vec<HostOut>,
) -> Vec<Buffer> {
    for (&i, host) in staged.iter().zip(staged_hosts) {
        hosts[i] = Some(host);
    }
    hosts
        .into_iter()
        .map(|host| {
            let host = host.expect("every output is back");
            // SAFETY: the caller's guarantee.
            unsafe { host.into_buffer() }
        })
        .collect()
}

/// Host memory a download is unpacked into: from the transfer's pool, or fresh.
enum HostOut {
    /// A block of the pool, wrapped in a `Buffer` that gives it back when it drops.
    Pooled(PooledMemory),
    /// A fresh allocation of `len` bytes (advised to use huge pages when large).
    Fresh(MutableBuffer, usize),
    /// Fresh whole pages of which the first `len` bytes are used: an output registered
    /// for direct DMA.
    Pages(PageAllocation, usize),
}

/// Page-aligned host memory of a whole number of pages, freed when dropped: memory a
/// device may register whole ([`Device::register_host`]) without reaching into another
/// allocation's pages.
struct PageAllocation {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is plain memory owned by this value alone; it never accesses
// the bytes itself (its users do, through the `Buffer` or the download that owns it).
unsafe impl Send for PageAllocation {}
// SAFETY: as above: `&PageAllocation` gives no access to the bytes.
unsafe impl Sync for PageAllocation {}

impl std::panic::RefUnwindSafe for PageAllocation {}

impl PageAllocation {
    /// At least `len` (> 0) bytes, rounded up to whole pages.
    fn new(len: usize) -> Result<Self> {
        let page = devarrow_abi::device::host_page_size();
        let layout = len
            .max(1)
            .checked_next_multiple_of(page)
            .and_then(|size| std::alloc::Layout::from_size_align(size, page).ok())
            .ok_or_else(|| {
                devarrow_abi::Error::InvalidArgument(format!("{len} bytes of host memory"))
            })?;
        // SAFETY: the layout's size is at least one page, not zero.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Ok(Self { ptr, layout })
    }
}

impl Drop for PageAllocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `PageAllocation::new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl HostOut {
    /// `len` bytes at the start of fresh whole pages of their own.
    fn pages(len: usize) -> Result<Self> {
        let pages = PageAllocation::new(len)?;
        // SAFETY: the allocation holds `layout.size()` bytes, exclusively owned here,
        // viewed as uninitialized bytes for the advice, which reads and writes none.
        advise_huge_pages(unsafe {
            std::slice::from_raw_parts_mut(pages.ptr.as_ptr().cast(), pages.layout.size())
        });
        Ok(Self::Pages(pages, len))
    }

    /// The bytes the output owns: its length, or more (the whole pages of
    /// [`HostOut::Pages`]).
    fn capacity(&self) -> usize {
        match self {
            Self::Pages(pages, _) => pages.layout.size(),
            _ => self.len(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Pooled(memory) => memory.len(),
            Self::Fresh(_, len) | Self::Pages(_, len) => *len,
        }
    }

    /// `len` bytes to unpack into.
    fn new(len: usize, pool: Option<&Arc<HostPool>>) -> Result<Self> {
        Ok(match pool {
            Some(pool) => Self::Pooled(pool.allocate(len)?),
            None => {
                let mut host = MutableBuffer::with_capacity(len);
                // SAFETY: the buffer has capacity for `len` bytes, viewed as uninitialized
                // bytes for the advice, which reads and writes none of them.
                advise_huge_pages(unsafe {
                    std::slice::from_raw_parts_mut(host.as_mut_ptr().cast(), len)
                });
                Self::Fresh(host, len)
            }
        })
    }

    /// The bytes, to be written (never read) by the unpacking.
    fn as_uninit(&mut self) -> &mut [MaybeUninit<u8>] {
        match self {
            Self::Pooled(memory) => memory.as_uninit_mut(),
            // SAFETY: the buffer has capacity for `len` bytes, exclusively borrowed; they
            // are viewed as uninitialized bytes and only written through the view.
            Self::Fresh(host, len) => unsafe {
                std::slice::from_raw_parts_mut(host.as_mut_ptr().cast(), *len)
            },
            // SAFETY: the allocation holds at least `len` bytes, owned by `self`,
            // exclusively borrowed.
            Self::Pages(pages, len) => unsafe {
                std::slice::from_raw_parts_mut(pages.ptr.as_ptr().cast(), *len)
            },
        }
    }

    /// The bytes as an arrow-rs `Buffer`.
    ///
    /// # Safety
    /// Every byte must have been written.
    unsafe fn into_buffer(self) -> Buffer {
        match self {
            Self::Pooled(memory) => {
                let (ptr, len) = (memory.as_ptr(), memory.len());
                let ptr = NonNull::new(ptr).unwrap_or(NonNull::dangling());
                // `memory` owns the block, kept alive by the `Buffer` (and its slices and
                // clones) until the last one drops, which gives it back to the pool.
                // SAFETY: `ptr` is valid for `len` bytes, initialized (the caller's
                // guarantee), for as long as the owner lives.
                unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(memory)) }
            }
            Self::Fresh(mut host, len) => {
                // SAFETY: the caller guarantees the first `len` bytes are written.
                unsafe { host.set_len(len) };
                host.into()
            }
            Self::Pages(pages, len) => {
                // `pages` owns the memory, kept alive by the `Buffer` (and its slices and
                // clones) until the last one drops.
                // SAFETY: `ptr` is valid for `len` bytes, initialized (the caller's
                // guarantee), for as long as the owner lives.
                unsafe { Buffer::from_custom_allocation(pages.ptr, len, Arc::new(pages)) }
            }
        }
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        // Staging memory may still be read by an enqueued copy: wait before freeing it.
        for stage in &mut self.stages {
            if let Some(event) = stage.pending.take() {
                let _ = event.wait_host();
            }
        }
        // So may the host buffers (and registrations) of direct copies.
        for retained in std::mem::take(&mut self.retained) {
            let _ = retained.release(self.device.as_ref());
        }
    }
}
