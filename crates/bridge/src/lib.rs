//! # devarrow-bridge
//!
//! arrow-rs record batches to a device and back, over one device abstraction
//! ([`devarrow_abi::device::Device`]) that the CPU and CUDA implement; and foreign
//! `ArrowDeviceArray`s imported zero-copy as device-resident batches
//! ([`DeviceBatch::import`]): validated against their schema, the sizes that live on the
//! device read back in one copy, the producer's release run once the last user is gone.
#![warn(missing_docs)]

pub mod baseline;
pub mod plan;
pub mod transfer;

pub use transfer::{DeviceBatch, Transfer, TransferOptions};

mod import;
