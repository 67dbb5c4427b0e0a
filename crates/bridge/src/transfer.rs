//! Moving record batches between the host and a [`Device`], and the device-resident batch.
//!
//! A transfer plans the batch ([`crate::plan`]), allocates one device region for all its
//! buffers, and streams the packed image through a bounded set of staging buffers (pinned
//! on CUDA): while chunk *k* is copied by the device, chunk *k + 1* is packed on the host.
//! Small buffers therefore travel together in one copy, a slice moves only its bytes, and
//! no copy waits for another except to reuse a staging buffer.

use std::sync::Arc;

use arrow_array::{Array, RecordBatch, RecordBatchOptions, StructArray};
use arrow_buffer::{Buffer, MutableBuffer};
use arrow_data::ArrayData;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{DataType, SchemaRef};
use devarrow_abi::device::{Device, DeviceMemory, StagingMemory, SyncEvent, BUFFER_ALIGNMENT};
use devarrow_abi::export::{export_tree, ArrayNode};
use devarrow_abi::layout::{buffer_roles, BufferRole};
use devarrow_abi::{DeviceArray, Error, Result};

use crate::plan::{plan_array, Node, Packer};

/// Default bound on staging memory per [`Transfer`]: 64 MiB.
pub const DEFAULT_STAGING_BYTES: usize = 64 << 20;

/// Options of a [`Transfer`].
#[derive(Debug, Clone, Copy)]
pub struct TransferOptions {
    /// The most staging memory the transfer allocates (split in two buffers that
    /// alternate, so packing overlaps copying).
    pub staging_bytes: usize,
}

impl Default for TransferOptions {
    fn default() -> Self {
        Self {
            staging_bytes: DEFAULT_STAGING_BYTES,
        }
    }
}

#[derive(Debug, Default)]
struct Stage {
    memory: Option<Box<dyn StagingMemory>>,
    pending: Option<Arc<dyn SyncEvent>>,
}

/// A reusable transfer engine for one device: owns the staging buffers.
#[derive(Debug)]
pub struct Transfer {
    device: Arc<dyn Device>,
    options: TransferOptions,
    stages: [Stage; 2],
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
    /// Bytes of device memory the batch occupies (for an imported batch: the bytes its
    /// arrays address in the foreign buffers).
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
        let array = export_tree(root, owner, device_type, device_id, sync_event)?;
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
            }),
            Storage::Foreign(foreign) => foreign.pack(device, self),
        }
    }
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
            stages: Default::default(),
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    fn chunk_size(&self, total: usize) -> usize {
        (self.options.staging_bytes / 2)
            .max(BUFFER_ALIGNMENT)
            .min(total.max(1))
    }

    /// Takes stage `i`, waiting for its last copy to finish and allocating it if needed.
    fn stage(&mut self, i: usize, chunk: usize) -> Result<&mut Box<dyn StagingMemory>> {
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
            stage.memory = Some(self.device.allocate_staging(chunk)?);
        }
        Ok(stage.memory.as_mut().expect("allocated above"))
    }

    /// Moves a record batch to the device.
    pub fn to_device(&mut self, batch: &RecordBatch) -> Result<DeviceBatch> {
        let data = StructArray::from(batch.clone()).into_data();
        let plan = plan_array(&data)?;
        let memory = self.device.allocate(plan.image.total)?;
        self.upload(&plan.image, memory.as_ref())?;
        let event = self.device.record_event()?;
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

    fn upload(&mut self, image: &Packer, memory: &dyn DeviceMemory) -> Result<()> {
        let total = image.total;
        if total == 0 {
            return Ok(());
        }
        let chunk = self.chunk_size(total);
        let mut next_segment = 0;
        for (k, window_start) in (0..total).step_by(chunk).enumerate() {
            let window_end = (window_start + chunk).min(total);
            let device = self.device.clone();
            let staging = self.stage(k % 2, chunk)?;
            let out = staging.as_mut_slice();
            // Pack every segment overlapping the window (segments are in image order).
            while next_segment < image.segments.len() {
                let (bytes, at) = &image.segments[next_segment];
                let (seg_start, seg_end) = (*at, at + bytes.len());
                if seg_start >= window_end {
                    break;
                }
                let from = seg_start.max(window_start);
                let to = seg_end.min(window_end);
                out[from - window_start..to - window_start]
                    .copy_from_slice(&bytes.as_slice()[from - seg_start..to - seg_start]);
                if seg_end > window_end {
                    break; // continues in the next window
                }
                next_segment += 1;
            }
            let dst = (memory.address() as usize + window_start) as *mut std::ffi::c_void;
            // SAFETY: the staging buffer holds `window_end - window_start` packed bytes and
            // stays untouched until the event recorded below completes (`stage` waits for
            // it); `dst` lies inside the freshly allocated device region of `total` bytes.
            unsafe { device.copy_to_device(out.as_ptr(), dst, window_end - window_start)? };
            self.stages[k % 2].pending = Some(device.record_event()?);
        }
        Ok(())
    }

    /// Moves a device-resident batch back to host memory (ordinary arrow-rs buffers).
    ///
    /// An imported batch is first packed on the device (one batched copy of the bytes its
    /// arrays address into one allocation), then moved like a packed one.
    pub fn to_host(&mut self, batch: &DeviceBatch) -> Result<RecordBatch> {
        let batch = &batch.download(&self.device)?;
        let total = batch.memory.len();
        // SAFETY: the pointer comes from the batch's own live event.
        unsafe {
            self.device
                .wait_sync_event(batch.event.as_sync_event_ptr())?
        };
        let mut host = MutableBuffer::from_len_zeroed(total);
        if total > 0 {
            let chunk = self.chunk_size(total);
            let windows: Vec<(usize, usize)> = (0..total)
                .step_by(chunk)
                .map(|s| (s, (s + chunk).min(total)))
                .collect();
            // Enqueue window k + 1 before unpacking window k.
            let enqueue = |this: &mut Self, k: usize| -> Result<()> {
                let (s, e) = windows[k];
                let device = this.device.clone();
                let staging = this.stage(k % 2, chunk)?;
                let src = (batch.memory.address() as usize + s) as *const std::ffi::c_void;
                // SAFETY: the staging buffer is not read until the event recorded next has
                // completed; the source range lies inside the batch's device memory.
                unsafe { device.copy_to_host(src, staging.as_mut_slice().as_mut_ptr(), e - s)? };
                this.stages[k % 2].pending = Some(device.record_event()?);
                Ok(())
            };
            enqueue(self, 0)?;
            for k in 0..windows.len() {
                if k + 1 < windows.len() {
                    enqueue(self, k + 1)?;
                }
                let (s, e) = windows[k];
                let stage = &mut self.stages[k % 2];
                if let Some(event) = stage.pending.take() {
                    event.wait_host()?;
                }
                let staging = stage.memory.as_ref().expect("enqueued");
                host.as_slice_mut()[s..e].copy_from_slice(&staging.as_slice()[..e - s]);
            }
        }
        let host: Buffer = host.into();
        let data = build_host_node(&batch.root, &host)?;
        let strukt = StructArray::from(data);
        let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows));
        Ok(RecordBatch::try_new_with_options(
            batch.schema.clone(),
            strukt.columns().to_vec(),
            &options,
        )?)
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
    }
}

/// Rebuilds arrow-rs array data from a planned tree over a host copy of its image.
pub(crate) fn build_host_node(node: &Node, host: &Buffer) -> Result<ArrayData> {
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
    let mut children: Vec<ArrayData> = node
        .children
        .iter()
        .map(|c| build_host_node(c, host))
        .collect::<Result<_>>()?;
    if let Some(d) = &node.dictionary {
        children.push(build_host_node(d, host)?);
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

/// The width in bytes of the offsets of a variable-length type.
pub(crate) fn offset_width(data_type: &DataType) -> usize {
    match data_type {
        DataType::LargeUtf8
        | DataType::LargeBinary
        | DataType::LargeList(_)
        | DataType::LargeListView(_) => 8,
        _ => 4,
    }
}
