//! The device-resident record batch ([`DeviceBatch`]) and what keeps its memory alive
//! ([`Storage`]): one allocation a transfer packed the batch into, or the buffers of a
//! foreign array, imported zero-copy ([`crate::foreign`]).
//!
//! Re-exported as `devarrow_bridge::DeviceBatch` and
//! `devarrow_bridge::transfer::DeviceBatch`.

use std::sync::Arc;

use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::SchemaRef;
use devarrow_abi::device::{Device, DeviceMemory, SyncEvent};
use devarrow_abi::export_tree::{export_tree, ArrayNode};
use devarrow_abi::{ArrowDeviceType, DeviceArray, Result};

use crate::export_convert;
use crate::export_options::{normalize_root_offset, ExportOptions, ImportOptions};
use crate::foreign::Foreign;
use crate::plan::Node;
use crate::transfer::host::Download;

/// A record batch resident on a device: its schema, and an array tree whose buffers lie
/// in device memory, ready once `event` has completed.
///
/// Either packed (made by [`Transfer::to_device`](crate::Transfer::to_device): every
/// buffer in one allocation) or imported (made by [`DeviceBatch::import`]: the buffers of
/// a foreign `ArrowDeviceArray`, zero-copy, kept alive until the last clone of the batch
/// and the last export of it are dropped). Cheap to clone.
///
/// # Example
///
/// A batch's life, on the CPU device here (a `devarrow_cuda::CudaDevice` is used the same
/// way): packed by a transfer, exported to a consumer, imported from a producer, copied to
/// another device, downloaded. Its columns: [`DeviceBatch::column`].
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, Float64Array, RecordBatch};
/// use devarrow_abi::device::{CpuDevice, Device};
/// use devarrow_abi::{cpu, ArrowDeviceType};
/// use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let prices: ArrayRef = Arc::new(Float64Array::from(vec![1.5, 2.5, 4.0, 8.0]));
/// let batch = RecordBatch::try_from_iter([("price", prices)])?;
/// let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
/// let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
///
/// // Packed: a transfer moves the bytes of the slice's rows into one device allocation.
/// let packed = transfer.to_device(&batch.slice(1, 3))?;
/// assert!(!packed.is_imported());
/// assert_eq!((packed.num_rows(), packed.num_columns()), (3, 1));
///
/// // Exported, zero-copy: an ArrowDeviceArray whose sync_event is the batch's event, and
/// // its ArrowSchema. The memory lives until the consumer releases the array.
/// let (array, schema) = packed.export()?;
/// assert_eq!(array.device_type(), ArrowDeviceType::CPU);
///
/// // Imported, zero-copy: a producer's array on the device (here the export above, then
/// // arrow-rs's own batch, which is an ARROW_DEVICE_CPU array).
/// let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema)?;
/// assert!(imported.is_imported());
/// let (host_array, host_schema) = cpu::export_record_batch(&batch)?;
/// let whole = DeviceBatch::import_with_ffi_schema(device, host_array, &host_schema)?;
///
/// // Copied to another device, device to device, and downloaded there.
/// let other: Arc<dyn Device> = Arc::new(CpuDevice::new());
/// let copied = imported.copy_to(&other)?;
/// let mut on_other = Transfer::new(other, TransferOptions::default());
/// assert_eq!(on_other.to_host(&copied)?, batch.slice(1, 3));
/// assert_eq!(transfer.to_host(&whole)?, batch);
/// # Ok(())
/// # }
/// ```
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
    Foreign(Arc<Foreign>),
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
    /// Where the buffers lie: the device's type and id, or for an imported batch the
    /// foreign array's (`ARROW_DEVICE_CUDA_HOST` for pinned memory, say).
    pub(crate) fn buffers_placement(&self) -> (ArrowDeviceType, i64) {
        match &self.storage {
            Storage::Packed { .. } => (self.device.device_type(), self.device.device_id()),
            Storage::Foreign(foreign) => (foreign.device_type(), foreign.device_id()),
        }
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
    /// For an imported batch: the bytes of the foreign buffers that its rows reach, which
    /// is what [`Transfer::to_host`](crate::Transfer::to_host) packs and moves (without
    /// the 64-byte alignment between buffers): a slice counts only its bytes, at every
    /// level of nesting (see [`DeviceBatch::import`]).
    pub fn device_bytes(&self) -> usize {
        match &self.storage {
            Storage::Packed { memory, .. } => memory.len(),
            Storage::Foreign(foreign) => foreign.device_bytes(),
        }
    }

    /// Whether the batch was imported ([`DeviceBatch::import`]) rather than packed by a
    /// [`Transfer`](crate::Transfer).
    pub fn is_imported(&self) -> bool {
        matches!(self.storage, Storage::Foreign(_))
    }

    /// Exports the batch as an `ArrowDeviceArray` (a struct array; `sync_event` set to the
    /// batch's event) and its `ArrowSchema`. Zero-copy: the device memory (for an imported
    /// batch, the foreign array, unreleased) stays alive until the consumer releases the
    /// array. The release frees the packed memory in stream order on the device's stream,
    /// with no dependency on the consumer's streams (the C Device interface names none):
    /// the consumer must release only once its work reading the buffers has completed
    /// (see `devarrow_cuda::export_array_data`, "Release contract").
    pub fn export(&self) -> Result<(DeviceArray, FFI_ArrowSchema)> {
        self.export_with(ExportOptions::default())
    }

    /// [`DeviceBatch::export`] with [`ExportOptions`] (e.g. a root offset normalized for
    /// consumers that refuse one).
    pub fn export_with(&self, options: ExportOptions) -> Result<(DeviceArray, FFI_ArrowSchema)> {
        let (root, owner, mut device_type, mut device_id) = match &self.storage {
            Storage::Packed { root, memory } => (
                export_node(root, memory.address() as usize),
                Arc::new(memory.clone()) as Arc<dyn std::any::Any + Send + Sync>,
                self.device.device_type(),
                self.device.device_id(),
            ),
            Storage::Foreign(foreign) => (
                foreign.export_root(),
                Arc::new(foreign.clone()) as Arc<dyn std::any::Any + Send + Sync>,
                foreign.device_type(),
                foreign.device_id(),
            ),
        };
        let root = if options.normalize_root_offset {
            normalize_root_offset(root)?
        } else {
            root
        };
        let (root, schema, owner, event): (_, _, devarrow_abi::export_tree::Owner, _) =
            if options.rewrites() {
                let converted =
                    export_convert::convert(self.device.as_ref(), &self.schema, root, &options)?;
                if !converted.memory.is_empty() {
                    // New buffers are memory of the batch's device, whatever the foreign
                    // array's placement (CUDA_HOST buffers stay readable there).
                    device_type = self.device.device_type();
                    device_id = self.device.device_id();
                }
                let event = converted.event.unwrap_or_else(|| self.event.clone());
                let schema = match &converted.schema {
                    Some(schema) => FFI_ArrowSchema::try_from(schema)?,
                    None => FFI_ArrowSchema::try_from(self.schema.as_ref())?,
                };
                (
                    converted.root,
                    schema,
                    Arc::new((owner, converted.memory, self.event.clone(), event.clone())),
                    event,
                )
            } else {
                (
                    root,
                    FFI_ArrowSchema::try_from(self.schema.as_ref())?,
                    Arc::new((owner, self.event.clone())),
                    self.event.clone(),
                )
            };
        let sync_event = event.as_sync_event_ptr();
        // Packed: the addresses lie in `memory`, an allocation of `device` laid out by this
        // crate's plan for the batch's own arrays (each buffer sized for its node). Foreign:
        // the tree is the imported DeviceArray's own, lengths and offsets included.
        // Converted: the new buffers are device memory sized by the conversions for their
        // nodes (`export_convert`), the others as before.
        // SAFETY: so the buffers meet `export_tree`'s contract (for foreign ones, by
        // `DeviceArray::try_new`'s); the owner keeps them and the events alive, and
        // `sync_event` is the last event's pointer, of the device's kind.
        let array = unsafe { export_tree(root, owner, device_type, device_id, sync_event) }?;
        Ok((array, schema))
    }

    /// Imports a foreign struct array (a record batch) of `schema` living on `device`,
    /// zero-copy.
    ///
    /// The array must be on `device`: `ARROW_DEVICE_CPU` on the CPU device; on a CUDA
    /// device `ARROW_DEVICE_CUDA` with the device's id, or `ARROW_DEVICE_CUDA_HOST` /
    /// `ARROW_DEVICE_CUDA_MANAGED`; otherwise the device's own type and id. Its structure
    /// must match the schema, and its offsets, views, dense union offsets and run ends
    /// (those the batch's rows reach, read from the device) must be in range. The device's stream waits on the array's `sync_event`; the batch's
    /// [`DeviceBatch::event`] is recorded after that wait.
    ///
    /// The array is consumed: its `release` runs exactly once, when the last clone of the
    /// batch and the last export of it ([`DeviceBatch::export`]) are dropped, or before
    /// this returns an error; and only after the device work devarrow enqueued that reads
    /// its buffers (a download's pack, the callers' work on column views) has completed,
    /// which the drop waits for on the host: the producer may free them on its own stream
    /// and reuse the memory there at once.
    ///
    /// Arrays whose offsets address more bytes than one allocation can hold (in all, for
    /// the batch's download) are an error. [`crate::Transfer::to_host`] moves only the
    /// bytes the batch's rows reach, as devarrow's own slices do: however the producer
    /// sliced it (a column's own `offset` and `length`, a root struct with an offset,
    /// children left whole under a sliced parent), every array of the tree is cut to what
    /// its parent's moved items reach (children of lists, maps, list views, dense unions
    /// and run-end encoded arrays included, and the variadic buffers of view types, however
    /// many: only the bytes the moved views reach, gathered into one buffer);
    /// dictionaries move whole. Finding that reads back, at import, the offsets, views,
    /// type ids or run ends at the bounds of the moved items, one round (one gather and
    /// one device-to-host copy) per level of nesting that the slice cuts (two for view
    /// types: their views, and the sizes of the variadic buffers those point into).
    pub fn import(
        device: Arc<dyn Device>,
        array: DeviceArray,
        schema: SchemaRef,
    ) -> Result<DeviceBatch> {
        let (foreign, event) = Foreign::import(&device, array, &schema)?;
        Ok(Self::of_foreign(device, foreign, event, schema))
    }

    /// The batch of an imported array (`Foreign::import`'s) and its event.
    pub(crate) fn of_foreign(
        device: Arc<dyn Device>,
        foreign: Foreign,
        event: Arc<dyn SyncEvent>,
        schema: SchemaRef,
    ) -> DeviceBatch {
        DeviceBatch {
            schema,
            num_rows: foreign.num_rows(),
            storage: Storage::Foreign(Arc::new(foreign)),
            event,
            device,
        }
    }

    /// [`DeviceBatch::import`] with [`ImportOptions`]: with
    /// [`ImportOptions::copy_from_other_device`], an array in another device's memory
    /// (same device type, another `device_id`) is imported on that device and copied to
    /// `device` instead of refused.
    ///
    /// # Errors
    /// As [`DeviceBatch::import`]; [`Error::DeviceMismatch`](devarrow_abi::Error) for an
    /// array of another device without the option, or where `device` has no handle on
    /// that device ([`Device::peer_device`]); the errors of opening that device and of
    /// the copy. The array is released on error.
    pub fn import_with_options(
        device: Arc<dyn Device>,
        array: DeviceArray,
        schema: SchemaRef,
        options: ImportOptions,
    ) -> Result<DeviceBatch> {
        let (found, id) = (array.device_type(), array.device_id());
        let elsewhere = found == device.device_type()
            && found != ArrowDeviceType::CPU
            && id != device.device_id();
        if elsewhere && options.copy_from_other_device {
            if let Some(home) = device.peer_device(id)? {
                let imported = Self::import(home, array, schema)?;
                return imported.copy_to(&device);
            }
        }
        Self::import(device, array, schema)
    }

    /// [`DeviceBatch::import`] with the schema as a C `ArrowSchema` (a struct schema whose
    /// metadata becomes the batch's). A released schema is
    /// [`Error::Released`](devarrow_abi::Error::Released); the array is released on
    /// error, as by `import`.
    pub fn import_with_ffi_schema(
        device: Arc<dyn Device>,
        array: DeviceArray,
        schema: &FFI_ArrowSchema,
    ) -> Result<DeviceBatch> {
        let schema = devarrow_abi::schema::import_schema(schema)?;
        Self::import(device, array, Arc::new(schema))
    }

    /// Copies the batch to `device` (another GPU, or the CPU device), device to device:
    /// the packed image (for an imported batch, a packed copy of the bytes its rows
    /// reach, made on the batch's device first) moves in **one** copy where the two
    /// devices have a direct path ([`Device::copy_from_peer`]: CUDA devices that
    /// `cuDeviceCanAccessPeer`, with `cuMemcpyPeerAsync`; two CPU devices, `memcpy`),
    /// else staged through pinned host memory of the source (a copy to the host, a host
    /// wait, a copy to `device`, a host wait, so the staging memory outlives its copies).
    ///
    /// On the direct path nothing blocks the host: `device`'s stream waits on the batch's
    /// event (`cuStreamWaitEvent`), and the source's stream on the new batch's event, so
    /// the source memory, freed in stream order there, outlives the copy even if the
    /// batch is dropped at once. The new batch is packed, on `device`, with its own
    /// event; this one is unchanged.
    ///
    /// # Errors
    /// The devices' errors (an allocation, a copy, an event), typed as everywhere
    /// (`Error::Device` with the CUDA error as its source); what was allocated for the
    /// copy is freed.
    pub fn copy_to(&self, device: &Arc<dyn Device>) -> Result<DeviceBatch> {
        let source = &self.device;
        let (root, memory, event) = match &self.storage {
            Storage::Packed { root, memory } => (root.clone(), memory.clone(), self.event.clone()),
            Storage::Foreign(foreign) => {
                let packed = foreign.pack(source, &self.event)?;
                (packed.root, packed.memory, packed.event)
            }
        };
        let len = memory.len();
        let copy = device.allocate(len)?;
        let result = (|| {
            // SAFETY: `event` is an event of the source device, alive while `event` is; a
            // CUDA stream may wait on an event of another device's context.
            unsafe { device.wait_sync_event(event.as_sync_event_ptr()) }?;
            // SAFETY: `memory` (the source's) and `copy` (`device`'s, owned by the new batch)
            // hold `len` bytes; `memory` lives until the copy completed (the source's stream
            // waits for it before any later free, or we synchronize below).
            let direct = unsafe {
                device.copy_from_peer(source.as_ref(), memory.address(), copy.address(), len)
            }?;
            if !direct {
                return copy_staged(
                    source.as_ref(),
                    memory.address(),
                    device.as_ref(),
                    copy.address(),
                    len,
                );
            }
            let new_event = device.record_event()?;
            // SAFETY: `new_event` is `device`'s live event; the source's stream waits for
            // it, so the source memory's stream-ordered free runs after the copy.
            unsafe { source.wait_sync_event(new_event.as_sync_event_ptr()) }?;
            Ok(new_event)
        })();
        let new_event = match result {
            Ok(event) => event,
            Err(e) => {
                // A copy may have been enqueued: let it finish before the memory of both
                // ends is freed (a packed copy of a foreign batch is freed on the source's
                // stream, which may not wait for it).
                let _ = device.synchronize();
                return Err(e);
            }
        };
        drop(memory);
        Ok(DeviceBatch {
            schema: self.schema.clone(),
            num_rows: self.num_rows,
            storage: Storage::Packed { root, memory: copy },
            event: new_event,
            device: device.clone(),
        })
    }

    /// What [`Transfer::to_host`](crate::Transfer::to_host) downloads: the packed image
    /// itself, or for an imported batch a packed copy of the bytes it addresses, made on
    /// `device` (one batched copy).
    pub(crate) fn download(&self, device: &Arc<dyn Device>) -> Result<Download> {
        let (root, memory, event, trusted) = match &self.storage {
            Storage::Packed { root, memory } => {
                (root.clone(), memory.clone(), self.event.clone(), true)
            }
            Storage::Foreign(foreign) => {
                let packed = foreign.pack(device, &self.event)?;
                (packed.root, packed.memory, packed.event, false)
            }
        };
        Ok(Download {
            schema: self.schema.clone(),
            num_rows: self.num_rows,
            root,
            memory,
            event,
            trusted,
        })
    }
}

/// [`DeviceBatch::copy_to`] without a direct path: `len` bytes from `src` (memory of
/// `source`, ready on its stream) through pinned staging memory of `source` to `dst`
/// (memory of `target`, which waits on the source's copy with a host wait). Waits on the
/// host for both copies, so the staging memory outlives them; returns `target`'s event.
fn copy_staged(
    source: &dyn Device,
    src: *mut std::ffi::c_void,
    target: &dyn Device,
    dst: *mut std::ffi::c_void,
    len: usize,
) -> Result<Arc<dyn SyncEvent>> {
    let mut staging = source.allocate_staging(len)?;
    let host = staging.as_mut_slice().as_mut_ptr();
    let result = (|| {
        // SAFETY: `src` is `len` bytes of the source's memory (the caller keeps it alive
        // until we return); `host` is `len` bytes of staging memory, read only after the
        // wait below.
        unsafe { source.copy_to_host(src, host, len) }?;
        source.record_event()?.wait_host()?;
        // SAFETY: `host` holds the bytes copied above; `dst` is `len` bytes of `target`'s
        // memory; we wait for the copy before the staging memory drops.
        unsafe { target.copy_to_device(host, dst, len) }?;
        let event = target.record_event()?;
        event.wait_host()?;
        Ok(event)
    })();
    if result.is_err() {
        // A copy may still use the staging memory, freed when we return.
        let _ = source.synchronize();
        let _ = target.synchronize();
    }
    result
}

/// The tree of a packed batch for export: the placements of `node` as addresses from `base`.
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
