//! # devarrow-bridge
//!
//! arrow-rs record batches to a device and back, over one device abstraction
//! ([`devarrow_abi::device::Device`]) that the CPU and CUDA implement.
#![warn(missing_docs)]

pub mod baseline;
pub mod plan;
pub mod transfer;

pub use transfer::{DeviceBatch, Transfer, TransferOptions};

mod import;
