//! Moving record batches between the host and a [`Device`], and the device-resident batch.
//!
//! A transfer plans the batch ([`crate::plan`]), allocates one device region for all its
//! buffers, and streams the packed image through a bounded set of staging buffers (pinned
//! on CUDA): while chunk *k* is copied by the device, chunk *k + 1* is packed on the host.
//! Small buffers therefore travel together in one copy, a slice moves only its bytes, and
//! no copy waits for another except to reuse a staging buffer.
//!
//! Chunks are packed and unpacked on several threads ([`crate::pack`]), and buffers that
//! already lie in pinned memory are copied straight from it ([`crate::pinned`]).

use std::collections::VecDeque;
use std::sync::Arc;

use arrow_array::{Array, RecordBatch, RecordBatchOptions, StructArray};
use arrow_buffer::{Buffer, MutableBuffer};
use arrow_data::ArrayData;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{DataType, SchemaRef};
use devarrow_abi::device::{Device, DeviceMemory, StagingMemory, SyncEvent, BUFFER_ALIGNMENT};
use devarrow_abi::export::{export_tree, ArrayNode};
use devarrow_abi::layout::{buffer_roles, offset_width, BufferRole};
use devarrow_abi::{DeviceArray, Error, Result};
use rayon::prelude::*;

use crate::pack::{
    advise_huge_pages, copy_to_uninit, pack_window, ramped_windows, windows, Parallelism,
};
use crate::pinned::{direct_runs, staged_groups};
use crate::plan::{plan_array, Node, Packer};

/// Default bound on staging memory per [`Transfer`]: 64 MiB.
pub const DEFAULT_STAGING_BYTES: usize = 64 << 20;

/// Default size of one staging chunk (one copy): 8 MiB, so the default 64 MiB of staging
/// is 8 chunks in flight.
pub const DEFAULT_CHUNK_BYTES: usize = 8 << 20;

/// Default size of the first and last chunks of a copy: 1 MiB (see
/// [`TransferOptions::first_chunk_bytes`]).
pub const DEFAULT_FIRST_CHUNK_BYTES: usize = 1 << 20;

/// Default size from which a pack or unpack is split over several threads: 1 MiB.
pub const DEFAULT_PARALLEL_MIN_BYTES: usize = 1 << 20;

/// Default size from which pinned host memory is copied directly: 256 KiB.
pub const DEFAULT_DIRECT_MIN_BYTES: usize = 256 << 10;

/// Options of a [`Transfer`].
///
/// Build them with struct update syntax, e.g.
/// `TransferOptions { staging_bytes: 1 << 20, ..Default::default() }`.
#[derive(Debug, Clone, Copy)]
pub struct TransferOptions {
    /// The most staging memory the transfer allocates, in `staging_bytes / chunk_bytes`
    /// (at least 2) buffers of one chunk each, used in turn so that packing a chunk
    /// overlaps the copies of the chunks before it.
    pub staging_bytes: usize,
    /// The size of one staging chunk: the bytes of one copy (clamped to at most half of
    /// `staging_bytes`, so at least two chunks alternate).
    ///
    /// Smaller chunks pipeline better: the first pack and the last copy are not
    /// overlapped with anything, so with 2 × 32 MiB a 64 MiB batch hardly overlaps at
    /// all, while with 8 × 8 MiB only 1/8 of it is exposed (less with the ramp of
    /// [`first_chunk_bytes`](Self::first_chunk_bytes)), and the host may run up to 8
    /// chunks ahead of the copy engine, which absorbs jitter of either. Chunks must stay
    /// large enough that the fixed cost of a copy (a few µs of driver and DMA setup) is
    /// small: an 8 MiB copy takes about 160 µs at 50 GB/s, so that cost stays near 2-3%.
    pub chunk_bytes: usize,
    /// The size of the first and the last chunk of a copy of more than 4 × this size:
    /// chunks then grow from this size, doubling, up to `chunk_bytes`, and shrink the same
    /// way at the end, so that the copy engine starts after a small pack (or the host
    /// starts unpacking after a small copy) and the last step, which overlaps nothing, is
    /// short. 0, or a value of at least `chunk_bytes`, cuts every copy in equal chunks.
    pub first_chunk_bytes: usize,
    /// The most threads one chunk is packed or unpacked with (threads of the rayon global
    /// pool); 0 (the default): the pool's size, at most 8.
    pub pack_threads: usize,
    /// Chunks of at least this size are packed or unpacked on several threads; smaller
    /// ones on the calling thread alone (handing work to other threads costs a few µs).
    pub parallel_min_bytes: usize,
    /// Runs of buffers at least this long that lie in pinned memory (see
    /// [`crate::pinned`] and [`Device::is_pinned`]) are copied directly to the device,
    /// skipping staging; smaller ones are packed with the others (one copy for many
    /// small buffers beats many tiny copies). `usize::MAX` disables direct copies.
    pub direct_min_bytes: usize,
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

/// A reusable transfer engine for one device: owns the staging buffers.
#[derive(Debug)]
pub struct Transfer {
    device: Arc<dyn Device>,
    options: TransferOptions,
    stages: Vec<Stage>,
    /// Host buffers that direct copies read, kept alive until the event completes.
    retained: VecDeque<(Arc<dyn SyncEvent>, Vec<Buffer>)>,
}

/// A record batch resident on a device: its schema, and an array tree whose buffers lie
/// in device memory, ready once `event` has completed.
///
/// Either packed (made by [`Transfer::to_device`]: every buffer in one allocation) or
/// imported (made by [`DeviceBatch::import`]: the buffers of a foreign `ArrowDeviceArray`,
/// zero-copy, kept alive until the last clone of the batch and the last export of it are
/// dropped). Cheap to clone.
#[derive(Debug, Clone)]
pub struct DeviceBatch {
    pub(crate) schema: SchemaRef,
    pub(crate) num_rows: usize,
    pub(crate) storage: Storage,
    pub(crate) event: Arc<dyn SyncEvent>,
    pub(crate) device: Arc<dyn Device>,
}

/// Where the buffers of a [`DeviceBatch`] lie.
#[derive(Debug, Clone)]
pub(crate) enum Storage {
    /// In one allocation, at the placements of a planned tree.
    Packed {
        root: Arc<Node>,
        memory: Arc<dyn DeviceMemory>,
    },
    /// In the buffers of a foreign array, kept alive (unreleased) by the batch.
    Foreign(Arc<crate::import::Foreign>),
}

/// What [`Transfer::to_host`] downloads: one packed image on the device, the tree that
/// points into it, and the event its data is ready after.
pub(crate) struct Download {
    pub(crate) schema: SchemaRef,
    pub(crate) num_rows: usize,
    pub(crate) root: Arc<Node>,
    pub(crate) memory: Arc<dyn DeviceMemory>,
    pub(crate) event: Arc<dyn SyncEvent>,
    /// Whether the image was planned by this crate from valid arrow-rs data (a batch
    /// [`Transfer::to_device`] uploaded), so rebuilding it on the host needs no validation.
    /// `false` for foreign data.
    pub(crate) trusted: bool,
}

impl DeviceBatch {
    /// The schema (with its metadata).
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
    /// The number of rows.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }
    /// The device the batch lives on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }
    /// The event that marks the batch's data as written.
    pub fn event(&self) -> &Arc<dyn SyncEvent> {
        &self.event
    }
    /// Bytes of device memory the batch occupies.
    ///
    /// For an imported batch: the bytes of the foreign buffers its arrays address, each
    /// array counted over its own `offset` and `length` as imported (a column sliced by
    /// its producer counts only its slice), every child and dictionary over its own
    /// whole range (not only the part a sliced parent uses), view types with all their
    /// variadic buffers. It approximates what [`Transfer::to_host`] packs and moves,
    /// which can be a little more (bitmapped arrays are cut at byte boundaries: up to 7
    /// more items per buffer) or less (fixed-width children are cut to the range their
    /// parent uses). See [`DeviceBatch::import`] for what a slice of it moves.
    pub fn device_bytes(&self) -> usize {
        match &self.storage {
            Storage::Packed { memory, .. } => memory.len(),
            Storage::Foreign(foreign) => foreign.device_bytes(),
        }
    }

    /// Whether the batch was imported ([`DeviceBatch::import`]) rather than packed by a
    /// [`Transfer`].
    pub fn is_imported(&self) -> bool {
        matches!(self.storage, Storage::Foreign(_))
    }

    /// Exports the batch as an `ArrowDeviceArray` (a struct array; `sync_event` set to the
    /// batch's event) and its `ArrowSchema`. Zero-copy: the device memory (for an imported
    /// batch, the foreign array, unreleased) stays alive until the consumer releases the
    /// array.
    pub fn export(&self) -> Result<(DeviceArray, FFI_ArrowSchema)> {
        let schema = FFI_ArrowSchema::try_from(self.schema.as_ref())?;
        let sync_event = self.event.as_sync_event_ptr();
        let (root, owner, device_type, device_id): (_, devarrow_abi::export::Owner, _, _) =
            match &self.storage {
                Storage::Packed { root, memory } => (
                    export_node(root, memory.address() as usize),
                    Arc::new((memory.clone(), self.event.clone())),
                    self.device.device_type(),
                    self.device.device_id(),
                ),
                Storage::Foreign(foreign) => (
                    foreign.export_root(),
                    Arc::new((foreign.clone(), self.event.clone())),
                    foreign.device_type(),
                    foreign.device_id(),
                ),
            };
        // Packed: the addresses lie in `memory`, an allocation of `device` laid out by this
        // crate's plan for the batch's own arrays (each buffer sized for its node). Foreign:
        // the tree is the imported DeviceArray's own, lengths and offsets included.
        // SAFETY: so the buffers meet `export_tree`'s contract (for foreign ones, by
        // `DeviceArray::try_new`'s); the owner keeps them and the batch's event alive, and
        // `sync_event` is that event's pointer, of the device's kind.
        let array = unsafe { export_tree(root, owner, device_type, device_id, sync_event) }?;
        Ok((array, schema))
    }

    /// What [`Transfer::to_host`] downloads: the packed image itself, or for an imported
    /// batch a packed copy of the bytes it addresses, made on `device` (one batched copy).
    pub(crate) fn download(&self, device: &Arc<dyn Device>) -> Result<Download> {
        match &self.storage {
            Storage::Packed { root, memory } => Ok(Download {
                schema: self.schema.clone(),
                num_rows: self.num_rows,
                root: root.clone(),
                memory: memory.clone(),
                event: self.event.clone(),
                trusted: true,
            }),
            Storage::Foreign(foreign) => foreign.pack(device, self),
        }
    }
}

/// Checks that `device` can copy the memory of a batch on `home`: both must be the same
/// device (device type and id; two handles on one device may differ, e.g. in their
/// streams). [`Error::UnsupportedDevice`] for another device type,
/// [`Error::DeviceMismatch`] for another id.
pub(crate) fn check_same_device(home: &dyn Device, device: &dyn Device) -> Result<()> {
    let (found, id) = (home.device_type(), home.device_id());
    if found != device.device_type() {
        return Err(Error::UnsupportedDevice {
            found,
            accepted: format!("{} (the transfer's device)", device.device_type()),
        });
    }
    if id != device.device_id() {
        return Err(Error::DeviceMismatch {
            device_type: found,
            expected: device.device_id(),
            found: id,
        });
    }
    Ok(())
}

fn export_node(node: &Node, base: usize) -> ArrayNode {
    ArrayNode {
        length: node.len as i64,
        null_count: node.null_count.map_or(-1, |n| n as i64),
        offset: node.offset as i64,
        buffers: node
            .buffers
            .iter()
            .map(|p| p.map_or(std::ptr::null(), |p| (base + p.offset) as *const _))
            .collect(),
        children: node.children.iter().map(|c| export_node(c, base)).collect(),
        dictionary: node
            .dictionary
            .as_ref()
            .map(|d| Box::new(export_node(d, base))),
    }
}

impl Transfer {
    /// A transfer engine for `device`.
    pub fn new(device: Arc<dyn Device>, options: TransferOptions) -> Self {
        Self {
            device,
            options,
            stages: Vec::new(),
            retained: VecDeque::new(),
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
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

    /// Keeps `buffers` (read by copies enqueued before `event`) alive until `event` has
    /// completed: at most [`MAX_RETAINED`] uploads are kept, the oldest waited for first
    /// (copies complete in stream order, so it is normally long done), and dropping the
    /// transfer waits for all.
    fn retain(&mut self, buffers: Vec<Buffer>, event: Arc<dyn SyncEvent>) -> Result<()> {
        while self.retained.len() >= MAX_RETAINED {
            if let Some((oldest, _buffers)) = self.retained.pop_front() {
                oldest.wait_host()?;
            }
        }
        self.retained.push_back((event, buffers));
        Ok(())
    }

    /// Moves a record batch to the device.
    pub fn to_device(&mut self, batch: &RecordBatch) -> Result<DeviceBatch> {
        let data = StructArray::from(batch.clone()).into_data();
        let plan = plan_array(&data)?;
        let memory = self.device.allocate(plan.image.total)?;
        let uploaded = self.upload(&plan.image, memory.as_ref());
        let event = self.settle(uploaded.and_then(|()| self.device.record_event()))?;
        Ok(DeviceBatch {
            schema: batch.schema(),
            num_rows: batch.num_rows(),
            storage: Storage::Packed {
                root: Arc::new(plan.root),
                memory,
            },
            event,
            device: self.device.clone(),
        })
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

    fn upload(&mut self, image: &Packer, memory: &dyn DeviceMemory) -> Result<()> {
        let total = image.total;
        if total == 0 {
            return Ok(());
        }
        let device = self.device.clone();
        let base = memory.address() as usize;
        // Runs already in pinned memory: one copy each, straight from the batch, enqueued
        // first so the copy engine starts on them while the rest is packed.
        let runs = direct_runs(
            device.as_ref(),
            &image.segments,
            self.options.direct_min_bytes,
        );
        if !runs.is_empty() {
            let mut sources = Vec::new();
            for run in &runs {
                // The run's segments lie at one displacement inside one allocation that
                // `is_pinned` vouched for; `retain` keeps their buffers alive until the
                // event recorded below (after this copy) completes.
                // SAFETY: `run.host` is valid for the run's span as above; the
                // destination lies inside the device region of `total` bytes.
                unsafe {
                    device.copy_to_device(
                        run.host,
                        (base + run.image.start) as *mut std::ffi::c_void,
                        run.image.len(),
                    )?
                };
                sources.extend(
                    image.segments[run.segments.clone()]
                        .iter()
                        .map(|(b, _)| b.clone()),
                );
            }
            let event = device.record_event()?;
            self.retain(sources, event)?;
        }
        // Everything else: packed into staging chunks (in parallel), chunk k + 1 packed
        // while chunk k is copied, each chunk one copy.
        let (chunk, stages) = self.geometry(total);
        let parallelism = self.parallelism();
        let mut k = 0;
        for group in staged_groups(image.segments.len(), &runs) {
            let segments = &image.segments[group];
            let (first, last) = (&segments[0], &segments[segments.len() - 1]);
            let (start, end) = (first.1, last.1 + last.0.len());
            for (window_start, window_end) in
                windows(start, end, self.options.first_chunk_bytes, chunk)
            {
                let staging = self.stage(k % stages, chunk)?;
                let out = &mut staging.as_mut_slice()[..window_end - window_start];
                pack_window(segments, window_start, out, parallelism);
                let dst = (base + window_start) as *mut std::ffi::c_void;
                // The staging buffer stays untouched until the event recorded below
                // completes (`stage` waits for it before reuse).
                // SAFETY: `out` holds the packed window; `dst` lies inside the fresh
                // device region of `total` bytes, outside every direct run.
                unsafe { device.copy_to_device(out.as_ptr(), dst, out.len())? };
                self.stages[k % stages].pending = Some(device.record_event()?);
                k += 1;
            }
        }
        Ok(())
    }

    /// Copies each `(src, len)` range of device memory to a new host buffer through the
    /// staging chunks, all ranges in one pipeline: up to one copy per staging buffer in
    /// flight, each chunk unpacked (in parallel) as soon as its copy completes and its
    /// slot refilled at once, so the copies of range k + 1 run while range k is
    /// unpacked. Only the first and the last chunk of the whole call are ramped (see
    /// [`windows`]). The host buffers are not zero-filled first: every byte is written by
    /// the unpacking.
    fn download(&mut self, sources: &[(*const std::ffi::c_void, usize)]) -> Result<Vec<Buffer>> {
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
        for k in 0..windows.len().min(stages) {
            enqueue(self, k)?;
        }
        let mut hosts: Vec<MutableBuffer> = sources
            .iter()
            .map(|&(_, len)| MutableBuffer::with_capacity(len))
            .collect();
        let mut outs: Vec<&mut [std::mem::MaybeUninit<u8>]> = hosts
            .iter_mut()
            .zip(sources)
            .map(|(host, &(_, len))| {
                // SAFETY: the buffer has capacity for `len` bytes; they are viewed as
                // uninitialized bytes and only written (never read) below.
                let out = unsafe {
                    std::slice::from_raw_parts_mut(
                        host.as_mut_ptr().cast::<std::mem::MaybeUninit<u8>>(),
                        len,
                    )
                };
                advise_huge_pages(out);
                out
            })
            .collect();
        let parallelism = self.parallelism();
        for (k, &(i, s, e)) in windows.iter().enumerate() {
            let stage = &mut self.stages[k % stages];
            if let Some(event) = stage.pending.take() {
                event.wait_host()?;
            }
            let staging = stage.memory.as_ref().expect("enqueued");
            copy_to_uninit(
                &mut outs[i][s..e],
                &staging.as_slice()[..e - s],
                parallelism,
            );
            if k + stages < windows.len() {
                enqueue(self, k + stages)?;
            }
        }
        drop(outs);
        Ok(hosts
            .into_iter()
            .zip(sources)
            .map(|(mut host, &(_, len))| {
                // SAFETY: the windows of this source cover `0..len` and each was copied
                // in full above, from staging memory (initialized at allocation, then
                // written by the copy).
                unsafe { host.set_len(len) };
                host.into()
            })
            .collect())
    }

    /// Moves a device-resident batch back to host memory (ordinary arrow-rs buffers).
    ///
    /// An imported batch is first packed on the device (one batched copy of the bytes its
    /// arrays address into one allocation), then moved like a packed one.
    ///
    /// The batch must live on this transfer's device (same device type and id):
    /// otherwise [`Error::UnsupportedDevice`] (another type) or [`Error::DeviceMismatch`]
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
        let downloaded = self.download(&sources);
        let hosts = self.settle(downloaded)?;
        downloads
            .iter()
            .zip(&hosts)
            .map(|(download, host)| {
                let data = build_host_node(&download.root, host, download.trusted)?;
                let strukt = StructArray::from(data);
                let options = RecordBatchOptions::new().with_row_count(Some(download.num_rows));
                Ok(RecordBatch::try_new_with_options(
                    download.schema.clone(),
                    strukt.columns().to_vec(),
                    &options,
                )?)
            })
            .collect()
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
        // So may the host buffers of direct copies.
        for (event, _buffers) in self.retained.drain(..) {
            let _ = event.wait_host();
        }
    }
}

/// Rebuilds arrow-rs array data from a planned tree over a host copy of its image.
///
/// `trusted`: the tree was planned by this crate from arrow-rs data that was valid (its
/// `ArrayData` invariants held), and the image is a byte-for-byte copy of what the planner
/// packed, so the arrays are built without validating them again (UTF-8, offsets: the bulk
/// of `to_host`'s host time otherwise). Foreign data is always validated in full.
pub(crate) fn build_host_node(node: &Node, host: &Buffer, trusted: bool) -> Result<ArrayData> {
    let slice =
        |p: &Option<crate::plan::Placement>| p.map(|p| host.slice_with_length(p.offset, p.len));
    let roles = buffer_roles(&node.data_type);
    let has_validity = roles.first() == Some(&BufferRole::Validity);
    let mut buffers: Vec<Buffer> = node
        .buffers
        .iter()
        .map(|p| slice(p).unwrap_or_default())
        .collect();
    let validity = if has_validity {
        slice(&node.buffers[0])
    } else {
        None
    };
    if has_validity {
        buffers.remove(0);
    }
    if matches!(node.data_type, DataType::Utf8View | DataType::BinaryView) {
        buffers.pop(); // the variadic sizes: arrow-rs keeps them as buffer lengths
    }
    // Building validates every array (UTF-8, offsets): the bulk of `to_host`'s host time
    // for string-heavy batches. Columns of a large batch are built on several threads.
    let mut children: Vec<ArrayData> =
        if node.children.len() > 1 && host.len() >= DEFAULT_PARALLEL_MIN_BYTES {
            node.children
                .par_iter()
                .map(|c| build_host_node(c, host, trusted))
                .collect::<Result<_>>()?
        } else {
            node.children
                .iter()
                .map(|c| build_host_node(c, host, trusted))
                .collect::<Result<_>>()?
        };
    if let Some(d) = &node.dictionary {
        children.push(build_host_node(d, host, trusted)?);
    }
    if let Some(base) = node.rebase {
        rebase_offsets(&node.data_type, &mut buffers, base)?;
    }
    let mut builder = ArrayData::builder(node.data_type.clone())
        .len(node.len)
        .offset(node.offset)
        .null_bit_buffer(validity)
        .buffers(buffers)
        .child_data(children)
        .align_buffers(true);
    if let Some(null_count) = node.null_count {
        builder = builder.null_count(null_count);
    }
    // Debug builds (the tests) validate trusted trees too, so a planner bug shows up as
    // a validation error there rather than as undefined behaviour.
    if trusted && !cfg!(debug_assertions) {
        // `trusted`: this crate planned the tree from valid arrow-rs data and `host` holds
        // the bytes it packed, unchanged (exported device memory is read-only to consumers).
        // SAFETY: so every invariant `build` would check held when the planner read the
        // input, and still holds.
        builder = unsafe { builder.skip_validation(true) };
    }
    // Validated; a panic of arrow-rs on malformed (foreign) data becomes an error.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder.build()))
        .map_err(Error::from_panic)?
        .map_err(Error::from)
}

/// Offsets (4 or 8 bytes each, native-endian) as `i64`s, whatever the buffer's alignment.
fn read_offsets(buffer: &Buffer, width: usize) -> impl Iterator<Item = i64> + '_ {
    buffer.as_slice().chunks_exact(width).map(move |b| {
        if width == 4 {
            i32::from_ne_bytes(b.try_into().expect("4 bytes")) as i64
        } else {
            i64::from_ne_bytes(b.try_into().expect("8 bytes"))
        }
    })
}

fn offsets_buffer(values: impl Iterator<Item = i64>, width: usize) -> Buffer {
    if width == 4 {
        // Truncation is intended: rebased 32-bit offsets wrap as the producer's would.
        Buffer::from_vec(values.map(|v| v as i32).collect::<Vec<i32>>())
    } else {
        Buffer::from_vec(values.collect::<Vec<i64>>())
    }
}

/// Applies a node's `rebase` to its buffers (validity already removed): offsets minus
/// `base`; for list views, offsets minus `base` where the size is positive, else 0.
fn rebase_offsets(data_type: &DataType, buffers: &mut [Buffer], base: i64) -> Result<()> {
    let missing = || Error::InvalidArgument(format!("a {data_type} array without offsets"));
    match data_type {
        DataType::Utf8
        | DataType::Binary
        | DataType::List(_)
        | DataType::Map(_, _)
        | DataType::LargeUtf8
        | DataType::LargeBinary
        | DataType::LargeList(_) => {
            let width = offset_width(data_type);
            let offsets = buffers.first_mut().ok_or_else(missing)?;
            *offsets = offsets_buffer(
                read_offsets(offsets, width).map(|o| o.wrapping_sub(base)),
                width,
            );
        }
        DataType::ListView(_) | DataType::LargeListView(_) => {
            let width = offset_width(data_type);
            let [offsets, sizes, ..] = buffers else {
                return Err(missing());
            };
            *offsets = offsets_buffer(
                read_offsets(offsets, width)
                    .zip(read_offsets(sizes, width))
                    .map(|(o, s)| if s > 0 { o.wrapping_sub(base) } else { 0 }),
                width,
            );
        }
        _ => {}
    }
    Ok(())
}
