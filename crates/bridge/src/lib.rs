//! # devarrow-bridge
//!
//! arrow-rs record batches to a device and back, over one device abstraction
//! ([`devarrow_abi::device::Device`]) that the CPU and CUDA implement.
//!
//! - [`transfer`]: one batch at a time ([`Transfer`], [`DeviceBatch`]).
//! - Device data you can reach: each column of a [`DeviceBatch`] as a [`DeviceColumn`]
//!   (data type, rows, null count, children, dictionary) and its buffers as
//!   [`ColumnBuffer`]s (address, bytes, device); with the `cuda` feature, as cudarc views
//!   on the caller's stream (`ColumnBuffer::cuda_view`, `DeviceColumn::cuda_values`), and
//!   batches made of cudarc slices (`DeviceBatch::from_cuda_arrays`).
//! - [`batch_stream`]: device streams (`ArrowDeviceArrayStream`) whose uploads overlap the
//!   consumer's work ([`Uploader`], [`export_reader_to_device`]), and their consumer
//!   ([`DeviceStreamReader`], [`HostStreamReader`]).
//! - [`async_batch_stream`]: the async device stream on a device, both sides ([`UploadStream`],
//!   [`spawn_device_producer`]; [`device_batch_handler`], [`AsyncDeviceBatchStream`]).
#![warn(missing_docs)]

pub mod async_batch_stream;
pub mod batch_stream;
pub mod pack;
pub mod pinned;
pub mod plan;
pub mod select;
pub mod transfer;

pub use async_batch_stream::{
    device_batch_handler, spawn_device_producer, spawn_device_producer_into,
    AsyncDeviceBatchStream, AsyncHostBatchStream, UploadStream,
};
pub use batch_stream::{
    export_reader_to_device, DeviceStreamReader, HostStreamReader, StreamOptions, Uploader,
    DEFAULT_READ_AHEAD,
};
pub use column::{ColumnBuffer, DeviceColumn};
pub use pinned::{pin_batch, pinned_buffer};
pub use transfer::{DeviceBatch, Transfer, TransferOptions};

mod batch;
mod column;
#[cfg(feature = "cuda")]
mod cuda;
mod foreign;
mod host;
