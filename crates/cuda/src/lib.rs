//! # devarrow-cuda
//!
//! Where devarrow meets the GPU: the Apache Arrow C Device Data Interface on CUDA,
//! through [cudarc](https://docs.rs/cudarc) (loaded dynamically: this crate builds, and
//! its non-GPU tests pass, on machines without CUDA; every entry point returns
//! [`CudaError::NoDriver`] there instead of panicking).
//!
//! - [`PrimaryContext`]: a device opened on its **primary** context (interoperable with the
//!   CUDA runtime and libraries such as libcudf), [`list_devices`], [`device_count`].
//! - Memory ([`memory`]): [`DeviceBuffer`] (stream-ordered where memory pools are
//!   supported, from devarrow's own [`pool`] that keeps freed memory for reuse), [`PinnedHostBuffer`] (`ARROW_DEVICE_CUDA_HOST`), [`ManagedBuffer`]
//!   (`ARROW_DEVICE_CUDA_MANAGED`) and [`ForeignBuffer`] (a view of someone else's memory
//!   kept alive by its owner). Out of memory is [`CudaError::OutOfMemory`].
//! - The C Device interface: [`export_array_data`] (an event recorded on the producing
//!   stream, `sync_event` pointing to it, everything kept alive until `release`) and
//!   [`ImportedArray`] (the consumer stream waits on the producer's event; buffer views
//!   keep the producer's array unreleased).
//! - [`kernels`]: hand-written PTX for validity bitmaps and copies, embedded at build
//!   time and loaded once per context, with CPU reference implementations.
//! - [`CudaDevice`]: one device and its own stream, or the caller's
//!   ([`CudaDevice::on_stream`]), as a [`devarrow_abi::device::Device`] (stream-ordered
//!   device memory, pinned staging, asynchronous copies, `CUevent` sync events), which
//!   `devarrow-bridge` moves record batches through.
//! - cudarc interop: [`BorrowedSlice`] (someone else's device memory, e.g. a column of a
//!   device-resident batch, as a cudarc slice/view on the caller's stream, which never
//!   frees it) and [`CudaArray`] (an Arrow array built from cudarc slices, e.g. a
//!   kernel's output, checked against its [`DeviceNative`] type and exportable).
#![warn(missing_docs)]

mod borrowed;
mod context;
mod device;
mod driver;
mod error;
mod export;
mod native;
mod primary_context;
mod slice_array;

mod import;
pub mod kernels;
pub mod memory;
pub mod pool;

pub use borrowed::{AfterUse, BorrowedSlice};
pub use cudarc;
pub use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
pub use device::{CudaDevice, CudaSyncEvent, PinnedStaging, TransferMemory};
pub use error::{CudaError, Result};
pub use export::export_array_data;
pub use import::ImportedArray;
pub use memory::{
    CudaMemory, CudaMemoryMut, DeviceBuffer, ForeignBuffer, ManagedBuffer, PinnedHostBuffer,
};
pub use native::DeviceNative;
pub use primary_context::{
    device_count, driver_available, list_devices, DeviceInfo, PrimaryContext,
};
pub use slice_array::CudaArray;
