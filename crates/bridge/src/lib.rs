//! # devarrow-bridge
//!
//! arrow-rs record batches to a device and back, over one device abstraction
//! ([`devarrow_abi::device::Device`]) that the CPU and CUDA implement: the same code moves
//! a batch to the CPU device in CI and to a GPU in production.
//!
//! ## In four steps
//!
//! 1. **Pick a device**: [`select::select_device`] opens CUDA device 0 when there is one
//!    and the CPU device otherwise, saying why; or build one yourself
//!    (`devarrow_abi::device::CpuDevice`, `devarrow_cuda::CudaDevice`).
//! 2. **Upload**: a [`Transfer`] on that device moves a `RecordBatch` into one device
//!    allocation ([`Transfer::to_device`]): only the bytes the batch's slices use, packed
//!    through pinned staging, pipelined, with one sync event at the end.
//! 3. **Hand it over**: [`DeviceBatch::export`] gives the `ArrowDeviceArray` (its
//!    `sync_event` marks when the data is ready) and its schema; a consumer's array comes
//!    in, zero-copy, with [`DeviceBatch::import`].
//! 4. **Download**: [`Transfer::to_host`] (one batch) or [`Transfer::to_host_batches`]
//!    (many, in one pipeline) rebuild arrow-rs batches in host memory.
//!
//! ```
//! use std::sync::Arc;
//!
//! use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
//! use devarrow_bridge::select::{select_device, DeviceRequest};
//! use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
//!
//! # fn main() -> devarrow_abi::Result<()> {
//! let batch = RecordBatch::try_from_iter([
//!     ("id", Arc::new(Int64Array::from_iter_values(0..1000)) as ArrayRef),
//!     ("name", Arc::new(StringArray::from_iter_values((0..1000).map(|i| format!("n{i}")))) as ArrayRef),
//! ])?;
//!
//! // 1. The CPU device here (it runs anywhere); `DeviceRequest::Auto` would pick a GPU.
//! let device = select_device(DeviceRequest::Cpu).expect("the CPU device").device;
//!
//! // 2. Upload a slice: only its 10 rows' bytes move.
//! let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
//! let on_device = transfer.to_device(&batch.slice(500, 10))?;
//! assert_eq!(on_device.num_rows(), 10);
//!
//! // 3. Export as an ArrowDeviceArray + ArrowSchema, and import it back (what a C
//! //    consumer and producer would do on either side).
//! let (array, schema) = on_device.export()?;
//! let imported = DeviceBatch::import_with_ffi_schema(device, array, &schema)?;
//!
//! // 4. Download.
//! let back = transfer.to_host(&imported)?;
//! assert_eq!(back, batch.slice(500, 10));
//! # Ok(())
//! # }
//! ```
//!
//! Where next, each with a runnable example: [`DeviceBatch`] (a batch's life: packed,
//! exported, imported, copied to another device, downloaded), [`DeviceBatch::column`] (its
//! columns and buffers), [`pinned`] (batches in pinned memory, moved without staging),
//! [`Transfer::to_device_batches`] (many batches in one pipeline), and the streams below.
//!
//! The modules:
//! - [`transfer`]: one batch at a time ([`Transfer`], [`DeviceBatch`]).
//! - Device data you can reach: each column of a [`DeviceBatch`] as a [`DeviceColumn`]
//!   (data type, rows, null count, children, dictionary) and its buffers as
//!   [`ColumnBuffer`]s (address, bytes, device); with the `cuda` feature, as cudarc views
//!   on the caller's stream (`ColumnBuffer::cuda_view`, `DeviceColumn::cuda_values`), and
//!   batches made of cudarc slices (`DeviceBatch::from_cuda_arrays`).
//! - [`batch_stream`]: device streams (`ArrowDeviceArrayStream`) whose uploads overlap the
//!   consumer's work ([`Uploader`], [`export_reader_to_device`]), and their consumer
//!   ([`DeviceStreamReader`], [`HostStreamReader`]).
//! - [`async_batch_stream`]: the async device stream on a device, both sides
//!   ([`UploadStream`], [`spawn_device_producer`]; [`device_batch_handler`],
//!   [`AsyncDeviceBatchStream`]); both ends speak arrow-rs's async `RecordBatchStream`
//!   ([`UploadStream::from_record_batch_stream`], [`HostRecordBatchStream`]).
//! - [`select`]: choosing the device.
#![warn(missing_docs)]

pub mod async_batch_stream;
pub mod batch_stream;
pub mod select;
pub mod transfer;

/// Batches in pinned host memory (`transfer/pinned.rs`), at the path users know.
pub use transfer::pinned;

// The unstable door. `plan` (the planner), `pack` (the packing and its windows) and
// `stages` (the stage timings' module; its types are re-exported below) are public only
// so that devarrow's own benches (benches/), tests and command (crates/cli) can drive and
// measure the transfer's parts. They are not the API: no semver promise, they change with
// the implementation, and the docs do not show them. Users call `Transfer`.
#[doc(hidden)]
pub mod plan;
#[doc(hidden)]
pub use transfer::pack;
#[doc(hidden)]
pub use transfer::stages;

pub use async_batch_stream::{
    device_batch_handler, spawn_device_producer, spawn_device_producer_into,
    AsyncDeviceBatchStream, AsyncHostBatchStream, HostRecordBatchStream, UploadStream,
};
pub use batch_stream::{
    export_reader_to_device, DeviceStreamReader, HostStreamReader, StreamOptions, Uploader,
    DEFAULT_READ_AHEAD,
};
pub use column::{ColumnBuffer, DeviceColumn};
/// Bulk host copies with cached or streaming stores (`devarrow_abi::device::copy`), as
/// packing and unpacking use them.
pub use devarrow_abi::device::copy;
/// The C `ArrowSchema` (arrow-rs's `FFI_ArrowSchema`), so users need no `arrow-schema`
/// dependency of their own.
pub use devarrow_abi::ArrowSchema;
pub use export_options::{ExportOptions, ImportOptions};
pub use pinned::{pin_batch, pinned_buffer, pinned_gather};
pub use transfer::{DeviceBatch, StageTimes, Transfer, TransferOptions, TransferStats};

mod batch;
mod c_boundary;
mod column;
#[cfg(feature = "cuda")]
mod cuda;
mod export_convert;
mod export_options;
mod foreign;
mod slicing;

/// The README's example (crates.io shows it), compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
