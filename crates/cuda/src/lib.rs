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
//!   kept alive by its owner). Out of memory is [`CudaError::OutOfMemory`]. devarrow
//!   counts the device memory it allocates ([`memory_stats`]: live buffers and bytes per
//!   device, exact, unlike the driver's free memory).
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
//!
//! ## In four steps
//!
//! 1. **Open a device**: [`CudaDevice::open`] (device `N` on its primary context, with a
//!    stream of its own); on a machine without a GPU it returns
//!    [`CudaError::NoDriver`] or [`CudaError::NoDevice`], never a panic.
//! 2. **Put data on it**: [`DeviceBuffer::from_host`] (stream-ordered, from devarrow's
//!    pool), or [`PinnedHostBuffer`] / [`ManagedBuffer`].
//! 3. **Export** it as an `ArrowDeviceArray` with [`export_array_data`]: a `CUevent` is
//!    recorded on the producing stream and `sync_event` points to it.
//! 4. **Import** a device array on your stream with [`ImportedArray::import`]: the stream
//!    waits on the producer's event (`cuStreamWaitEvent`, no host wait), and the buffers
//!    keep the producer's array unreleased while they live. To move whole record batches,
//!    hand the [`CudaDevice`] to `devarrow-bridge`'s `Transfer`.
//!
//! ```
//! use std::sync::Arc;
//!
//! use arrow_data::ArrayData;
//! use arrow_schema::DataType;
//! use devarrow_abi::ArrowDeviceType;
//! use devarrow_cuda::{export_array_data, CudaDevice, CudaError, DeviceBuffer, ImportedArray};
//!
//! # fn main() -> devarrow_cuda::Result<()> {
//! // 1. Open CUDA device 0, or say why not (this runs on machines without a GPU too).
//! let device = match CudaDevice::open(0) {
//!     Ok(device) => device,
//!     Err(e @ (CudaError::NoDriver | CudaError::NoDevice)) => {
//! #       assert!(std::env::var("DEVARROW_REQUIRE_GPU").as_deref() != Ok("1"), "{e}");
//!         println!("no GPU here: {e}");
//!         return Ok(());
//!     }
//!     Err(e) => return Err(e),
//! };
//! let stream = device.stream().clone();
//!
//! // 2. Four i32 values in device memory.
//! let values = DeviceBuffer::from_host(&stream, &[1i32, 2, 3, 4])?;
//!
//! // 3. Export them as an Int32 array (no validity: null_count 0).
//! // SAFETY: the buffer is device memory that arrow-rs must never read on the host;
//! // it only travels inside the exported array.
//! let buffer = unsafe { values.into_arrow_buffer() };
//! // SAFETY: 4 values of 4 bytes, no nulls: the layout of an Int32 array of length 4.
//! let data = unsafe {
//!     ArrayData::builder(DataType::Int32).len(4).null_count(0).add_buffer(buffer).build_unchecked()
//! };
//! let array = export_array_data(data, ArrowDeviceType::CUDA, &stream)?;
//!
//! // 4. Import on another stream: it waits on the export's event, not the host.
//! let consumer = device.primary_context().new_stream()?;
//! let imported = ImportedArray::import(array, &consumer)?;
//! assert_eq!(imported.array().length, 4);
//! # Ok(())
//! # }
//! ```
//!
//! ## Where next
//!
//! Each has a runnable example (each returns early without a GPU): [`DeviceBuffer`],
//! [`PinnedHostBuffer`] (page-locked host memory, both ways), [`BorrowedSlice`] (someone
//! else's device memory on your stream, through cudarc), [`CudaArray`] (a kernel's output
//! as an Arrow array), [`CudaDevice`] and [`ImportedArray`].
#![warn(missing_docs)]

mod borrowed;
mod context;
mod device;
mod driver;
mod error;
mod event;
mod export;
mod host_register;
mod native;
mod primary_context;
mod slice_array;
mod stats;

mod import;
pub mod kernels;
pub mod memory;
pub mod pool;

pub use borrowed::{AfterUse, BorrowedSlice};
pub use cudarc;
pub use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
pub use device::{
    CudaDevice, CudaDeviceOptions, CudaSyncEvent, HostWait, PinnedStaging, PinnedStats,
    TransferMemory, DEFAULT_PINNED_RESERVE_BYTES,
};
pub use error::{is_sticky_error, CudaError, Result};
pub use export::export_array_data;
pub use host_register::{live_host_registrations, HostRegistration};
pub use import::ImportedArray;
pub use memory::{
    CudaMemory, CudaMemoryMut, DeviceBuffer, ForeignBuffer, ManagedBuffer, PinnedHostBuffer,
};
pub use native::DeviceNative;
pub use primary_context::{
    device_count, driver_available, list_devices, DeviceInfo, PrimaryContext,
};
pub use slice_array::CudaArray;
pub use stats::{memory_stats, MemoryStats};

/// The README's example (crates.io shows it), compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
