//! # devarrow-bridge
//!
//! arrow-rs record batches to a device and back, over one device abstraction
//! ([`devarrow_abi::device::Device`]) that the CPU and CUDA implement.
#![warn(missing_docs)]

pub mod baseline;
pub mod pack;
pub mod pinned;
pub mod plan;
pub mod transfer;

pub use pinned::{pin_batch, pinned_buffer};
pub use transfer::{DeviceBatch, Transfer, TransferOptions};
