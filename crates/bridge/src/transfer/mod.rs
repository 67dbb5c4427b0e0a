//! Moving record batches between the host and a [`Device`]: [`Transfer`], which makes and
//! downloads device-resident batches ([`DeviceBatch`], re-exported here).
//!
//! A transfer plans the batch (`plan/`), allocates one device region for all its
//! buffers, and streams the packed image through a bounded set of staging buffers (pinned
//! on CUDA): while chunk *k* is copied by the device, chunk *k + 1* is packed on the host.
//! Small buffers therefore travel together in one copy, a slice moves only its bytes, and
//! no copy waits for another except to reuse a staging buffer.
//!
//! Chunks are packed and unpacked on several threads (`transfer/pack.rs`), and buffers that
//! already lie in pinned memory are copied straight from it ([`crate::transfer::pinned`]). On a
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
//!
//! The code is split by direction. `transfer/mod.rs` holds [`Transfer`], its options, the
//! staging buffers both directions share, and the release of host memory registrations
//! (both directions register large host buffers for direct DMA; `transfer/in_flight.rs`
//! owns host memory that enqueued copies use until they complete). `transfer/to_device.rs`
//! is the upload side ([`Transfer::to_device`], [`Transfer::to_device_batches`]: planning,
//! direct copies, and the staged pipeline of `upload.rs` over the packing of
//! `transfer/pack.rs`). `transfer/to_host.rs` is the download side ([`Transfer::to_host`],
//! [`Transfer::to_host_batches`]: the host memory batches come back into, rebuilt by
//! `host.rs`); `transfer/download.rs` its copies, one path whether they land in pinned
//! blocks, registered pages or, through staging, pageable memory (`host_out.rs`).

use std::collections::VecDeque;
use std::sync::Arc;

use arrow_buffer::Buffer;
use devarrow_abi::device::{
    Device, HostPool, HostRegistration, StagingMemory, SyncEvent, BUFFER_ALIGNMENT,
};
use devarrow_abi::Result;

pub use crate::batch::DeviceBatch;
use crate::transfer::pack::Parallelism;
#[doc(inline)]
pub use crate::transfer::pack::DEFAULT_PARALLEL_MIN_BYTES;
#[doc(inline)]
pub use crate::transfer::stages::{StageTimes, TransferStats};
use in_flight::InFlight;
use landing::PinnedLanding;

mod download;
pub(crate) mod host;
mod host_out;
mod in_flight;
mod landing;
// Unstable, hidden: public for devarrow's benches, tests and command only (see lib.rs).
#[doc(hidden)]
pub mod pack;
pub mod pinned;
#[doc(hidden)]
pub mod stages;
mod to_device;
mod to_host;
mod upload;

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

/// Batches a call handles on the calling thread alone: planning or rebuilding one takes a
/// few µs, about what handing work to another thread costs.
const SERIAL_BATCHES: usize = 8;

/// `f(i)` for every batch `i` of `0..n`, in order: on the rayon pool's threads, in runs of
/// at least [`SERIAL_BATCHES`], when there are more. On an error, that of a failing batch
/// (not always the first).
fn per_batch<R: Send>(n: usize, f: impl Fn(usize) -> Result<R> + Sync + Send) -> Result<Vec<R>> {
    use rayon::prelude::*;
    if n <= SERIAL_BATCHES {
        return (0..n).map(f).collect();
    }
    (0..n)
        .into_par_iter()
        .with_min_len(SERIAL_BATCHES)
        .map(f)
        .collect()
}

/// Options of a [`Transfer`].
///
/// Build them from the defaults with the `with_*` methods (the struct is
/// `#[non_exhaustive]`: an option added later breaks no caller); the fields stay public
/// for reading.
///
/// ```
/// use devarrow_bridge::TransferOptions;
///
/// let options = TransferOptions::default()
///     .with_staging_bytes(1 << 20)
///     .with_chunk_bytes(256 << 10)
///     .with_pinned_host_bytes(0); // downloads always land in pageable memory
/// assert_eq!(options.staging_bytes, 1 << 20);
/// assert_eq!(options.chunk_bytes, 256 << 10);
/// assert_eq!(options.host_pool_bytes, devarrow_bridge::transfer::DEFAULT_HOST_POOL_BYTES);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
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
    /// `pack::upload_window_bytes`): each worker packs
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
    /// default): the pool's size, at most [`pack::DEFAULT_MAX_THREADS`] (16), and one
    /// fewer than the machine's cores (a core is left to the thread that enqueues the
    /// copies). Downloads through staging: the most threads one chunk is unpacked with
    /// (0: the pool's size, at most 16).
    pub pack_threads: usize,
    /// Uploads of less than this many staged bytes are packed by the calling thread
    /// alone, and staged download chunks smaller than this unpacked by it (handing work
    /// to other threads costs a few µs).
    pub parallel_min_bytes: usize,
    /// Runs of buffers at least this long that lie in pinned memory (see
    /// [`crate::transfer::pinned`] and [`Device::is_pinned`]) are copied directly to the device,
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
    /// On CUDA the pool's blocks are blocks of the pinned memory the device's context
    /// reserved (`CudaDevice::reserve_pinned`), taken and given back with no driver call
    /// (allocating pinned memory, `cuMemHostAlloc`, is documented as synchronizing the
    /// device): a download of a cold transfer waits for no other stream. Where the
    /// reserve has no room left, the pool counts as full.
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

impl TransferOptions {
    /// These options with [`staging_bytes`](Self::staging_bytes) set to `v`.
    pub fn with_staging_bytes(mut self, v: usize) -> Self {
        self.staging_bytes = v;
        self
    }

    /// These options with [`chunk_bytes`](Self::chunk_bytes) set to `v`.
    pub fn with_chunk_bytes(mut self, v: usize) -> Self {
        self.chunk_bytes = v;
        self
    }

    /// These options with [`first_chunk_bytes`](Self::first_chunk_bytes) set to `v`.
    pub fn with_first_chunk_bytes(mut self, v: usize) -> Self {
        self.first_chunk_bytes = v;
        self
    }

    /// These options with [`pack_threads`](Self::pack_threads) set to `v`.
    pub fn with_pack_threads(mut self, v: usize) -> Self {
        self.pack_threads = v;
        self
    }

    /// These options with [`parallel_min_bytes`](Self::parallel_min_bytes) set to `v`.
    pub fn with_parallel_min_bytes(mut self, v: usize) -> Self {
        self.parallel_min_bytes = v;
        self
    }

    /// These options with [`direct_min_bytes`](Self::direct_min_bytes) set to `v`.
    pub fn with_direct_min_bytes(mut self, v: usize) -> Self {
        self.direct_min_bytes = v;
        self
    }

    /// These options with [`host_pool_bytes`](Self::host_pool_bytes) set to `v`.
    pub fn with_host_pool_bytes(mut self, v: usize) -> Self {
        self.host_pool_bytes = v;
        self
    }

    /// These options with [`pinned_host_bytes`](Self::pinned_host_bytes) set to `v`.
    pub fn with_pinned_host_bytes(mut self, v: usize) -> Self {
        self.pinned_host_bytes = v;
        self
    }
}

#[derive(Debug, Default)]
struct Stage {
    memory: Option<Box<dyn StagingMemory>>,
    pending: Option<Arc<dyn SyncEvent>>,
}

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
/// has moved meanwhile); the driver drops them with the context (see [`InFlight`]).
/// Returns the first error.
fn release_registrations(
    device: &dyn Device,
    event: Option<&Arc<dyn SyncEvent>>,
    registrations: Vec<Box<dyn HostRegistration>>,
) -> Result<()> {
    if registrations.is_empty() {
        return event.map_or(Ok(()), |event| event.wait_host());
    }
    let mut registrations = InFlight::new(device, registrations);
    registrations.enqueued();
    registrations.settle(event).map(drop)
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
/// use devarrow_abi::device::{CopyCounter, CpuDevice, Device};
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
    /// Where downloads land: the pinned pool, or pageable memory after a refusal.
    landing: PinnedLanding,
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
            landing: PinnedLanding::default(),
            stats: TransferStats::default(),
        }
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

    /// Allocates now every staging chunk the transfer uses
    /// ([`TransferOptions::staging_bytes`] in all), instead of as the first transfers
    /// need them, and makes room in pinned memory for the pool its downloads land in (the
    /// pool set with [`Transfer::set_pinned_host_pool`], else
    /// [`TransferOptions::pinned_host_bytes`]); a no-op where the host reads the device's
    /// memory directly (no staging, no pinned landing).
    ///
    /// On CUDA the staging memory is a block of the pinned memory the device's context
    /// reserved (a `CudaDevice` reserves 128 MiB when its context's first is made, and
    /// never allocates pinned memory after that unless asked: beyond its reserve, staging
    /// is pageable, and slower, and downloads land in pageable memory, unpacked from
    /// staging at a fraction of the link's rate); this is such an ask, an explicit
    /// warm-up: it makes sure the reserve has room for the whole staging, then for the
    /// whole download pool ([`Device::reserve_staging`]), allocating pinned memory if not
    /// (`cuMemHostAlloc`, one of the calls NVIDIA documents as implicitly synchronizing:
    /// work enqueued afterwards on any stream of the device runs only after all the work
    /// enqueued before it, another library's included). Prepared or not, the transfers
    /// that follow make no such call: a stream held by someone else does not delay them.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use arrow_array::{ArrayRef, Int32Array, RecordBatch};
    /// use devarrow_abi::device::{CpuDevice, Device};
    /// use devarrow_bridge::{Transfer, TransferOptions};
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let device = Arc::new(CpuDevice::new());
    /// let options = TransferOptions::default().with_staging_bytes(4 << 20);
    /// let mut transfer = Transfer::new(device.clone(), options);
    /// transfer.prepare()?; // every staging chunk allocated now, not by the first upload
    ///
    /// let x: ArrayRef = Arc::new(Int32Array::from_iter_values(0..1000));
    /// let batch = RecordBatch::try_from_iter([("x", x)])?;
    /// let on_device = transfer.to_device(&batch)?;
    /// assert_eq!(on_device.num_rows(), 1000);
    /// # Ok(())
    /// # }
    /// ```
    pub fn prepare(&mut self) -> Result<()> {
        if self.device.host_accessible() {
            return Ok(());
        }
        let chunk = self.full_chunk();
        let (_, stages) = self.geometry(chunk);
        let held: usize = (0..stages)
            .filter(|&i| self.stages.get(i).is_some_and(|s| s.memory.is_some()))
            .count();
        self.device
            .reserve_staging((stages - held.min(stages)) * chunk)?;
        for i in 0..stages {
            self.stage(i, chunk)?;
        }
        // The download pool's room: its limit less what it holds already (in use or
        // cached), so that every block it may hand out comes from reserved memory.
        let landing = match self.landing.pool() {
            Some(pool) => {
                let stats = pool.stats();
                pool.limit()
                    .saturating_sub(stats.in_use_bytes + stats.cached_bytes)
            }
            None if self.landing.refused() => 0,
            None => self.options.pinned_host_bytes,
        };
        if let Err(e) = self.device.reserve_staging(landing) {
            // Not fatal: the downloads that find no room land in pageable memory.
            self.landing.unreserved(landing, &e);
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
    /// needs, so that it never grows (on CUDA a block of the context's pinned reserve,
    /// taken with no driver call).
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

    /// The size from which buffers are registered for direct DMA
    /// ([`Device::host_registration_min_bytes`], at least
    /// [`TransferOptions::direct_min_bytes`]), if the device registers any.
    fn register_from(&self) -> Option<usize> {
        self.device
            .host_registration_min_bytes()
            .map(|min| min.max(self.options.direct_min_bytes))
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
