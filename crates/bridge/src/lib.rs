//! # devarrow-bridge
//!
//! arrow-rs record batches to a device and back, over one device abstraction
//! ([`devarrow_abi::device::Device`]) that the CPU and CUDA implement.
//!
//! - [`transfer`]: one batch at a time ([`Transfer`], [`DeviceBatch`]).
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
pub mod stages;
pub mod transfer;

pub use async_batch_stream::{
    device_batch_handler, spawn_device_producer, spawn_device_producer_into,
    AsyncDeviceBatchStream, AsyncHostBatchStream, UploadStream,
};
pub use batch_stream::{
    export_reader_to_device, DeviceStreamReader, HostStreamReader, StreamOptions, Uploader,
    DEFAULT_READ_AHEAD,
};
pub use pinned::{pin_batch, pinned_buffer};
pub use transfer::{DeviceBatch, StageTimes, Transfer, TransferOptions, TransferStats};

mod batch;
mod foreign;
mod host;
