//! # devarrow-abi
//!
//! The Apache Arrow C Device Data Interface in Rust: the `#[repr(C)]` structs of the
//! canonical `abi.h` ([`ffi`]), owning wrappers that release exactly once
//! ([`DeviceArray`], [`DeviceArrayStream`]), validation of imported arrays against
//! their schema ([`layout`]), and the CPU device end to end: arrays and record batches
//! ([`cpu`]), the device stream ([`stream`]) and the async device stream
//! ([`async_stream`], with its key/value [`metadata`]).
#![warn(missing_docs)]

pub mod async_stream;
mod device_array;
pub mod device_type;
pub mod error;
pub mod export_tree;
pub mod ffi;

pub use device_array::DeviceArray;
pub use device_type::ArrowDeviceType;
pub use error::{Error, Result};
pub use ffi::{
    ArrowArray, ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask,
    ArrowDeviceArray, ArrowDeviceArrayStream, ArrowSchema,
};
pub use metadata::Metadata;
pub use stream::DeviceArrayStream;
pub mod boundary;
pub mod cpu;
pub mod device;
pub mod layout;
pub mod metadata;
mod panic;
pub mod pinned_registry;
pub mod stream;
