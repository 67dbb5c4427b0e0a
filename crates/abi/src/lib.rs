//! # devarrow-abi
//!
//! The Apache Arrow C Device Data Interface in Rust: the `#[repr(C)]` structs of the
//! canonical `abi.h` ([`ffi`]), owning wrappers that release exactly once
//! ([`DeviceArray`], [`DeviceArrayStream`]), validation of imported arrays against
//! their schema ([`layout`]), the device abstraction the bridge is written against
//! ([`device`]), and the CPU device end to end: arrays and record batches ([`cpu`]),
//! the device stream ([`stream`]) and the async device stream ([`async_stream`], with
//! its key/value [`metadata`]).
//!
//! ## In four steps
//!
//! 1. **Export** an arrow-rs `RecordBatch` as an owned [`DeviceArray`] plus its
//!    `ArrowSchema` ([`cpu::export_record_batch`]; zero-copy, `ARROW_DEVICE_CPU`).
//! 2. **Hand it to C**: [`DeviceArray::move_into`] writes the struct into storage the
//!    consumer owns; from then on the consumer calls `release`, exactly once.
//! 3. **Take it back**: [`DeviceArray::from_raw`] moves a C struct out (the source is
//!    marked released) and checks it; [`cpu::import_record_batch`] validates it against
//!    its schema and rebuilds the batch, zero-copy.
//! 4. **Stream** many batches: [`stream::export_reader`] turns any `RecordBatchReader`
//!    into an `ArrowDeviceArrayStream`; [`stream::DeviceArrayStreamReader`] reads one.
//!
//! ```
//! use std::sync::Arc;
//!
//! use arrow_array::{ArrayRef, Int32Array, RecordBatch, RecordBatchIterator};
//! use devarrow_abi::stream::{export_reader, DeviceArrayStreamReader};
//! use devarrow_abi::{cpu, ArrowDeviceArray, ArrowDeviceType, DeviceArray};
//!
//! # fn main() -> devarrow_abi::Result<()> {
//! let column: ArrayRef = Arc::new(Int32Array::from(vec![Some(1), None, Some(3)]));
//! let batch = RecordBatch::try_from_iter([("x", column)])?;
//!
//! // 1. Export.
//! let (array, schema) = cpu::export_record_batch(&batch)?;
//! assert_eq!(array.device_type(), ArrowDeviceType::CPU);
//!
//! // 2. Hand it to C: here the "C side" is a struct on our stack.
//! let mut c_struct = ArrowDeviceArray::empty();
//! // SAFETY: `c_struct` is valid for writes.
//! unsafe { array.move_into(&mut c_struct) };
//!
//! // 3. Take it back and import it against its schema.
//! // SAFETY: `c_struct` holds an unreleased device array, as moved in above.
//! let imported = unsafe { DeviceArray::from_raw(&mut c_struct) }?;
//! let back = cpu::import_record_batch(imported, &schema)?;
//! assert_eq!(back, batch);
//!
//! // 4. Stream.
//! let reader = RecordBatchIterator::new([Ok(batch.clone()), Ok(batch.slice(1, 2))], batch.schema());
//! let stream = export_reader(Box::new(reader));
//! let rows: usize = DeviceArrayStreamReader::try_new(stream)?
//!     .map(|b| b.map(|b| b.num_rows()))
//!     .sum::<Result<usize, _>>()?;
//! assert_eq!(rows, 5);
//! # Ok(())
//! # }
//! ```
//!
//! ## Where next
//!
//! Each has a runnable example:
//! - the async device stream, both sides driven by an executor: [`async_stream`] (a round
//!   trip), [`spawn_producer_into`](async_stream::spawn_producer_into) (a producer from a
//!   Rust stream), [`async_handler`](async_stream::async_handler) (a consumer, with
//!   metadata and cancellation);
//! - schemas across the C boundary ([`schema`]), and device memory exported without
//!   arrow-rs ever reading it ([`export_tree`]);
//! - the CPU device, [`device::CpuDevice`]: a [`device::Device`], the abstraction that
//!   `devarrow-cuda` implements for CUDA and that `devarrow-bridge` moves batches through.
//!
//! Errors are [`Error`]: each has the errno code it is reported with across the C
//! boundary ([`Error::errno`]) and keeps its cause (`std::error::Error::source`).
#![warn(missing_docs)]

pub mod async_stream;
mod device_array;
pub mod device_type;
mod empty_offsets;
pub mod error;
pub mod export_tree;
pub mod ffi;

pub use device_array::DeviceArray;
pub use device_type::ArrowDeviceType;
pub use error::{Error, Result};
pub use ffi::schema_is_released;
pub use ffi::{
    ArrowArray, ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask,
    ArrowDeviceArray, ArrowDeviceArrayStream, ArrowSchema,
};
pub use metadata::Metadata;
pub use schema::{move_schema_into, take_schema};
pub use slice_data::slice_data;
pub use stream::DeviceArrayStream;
pub mod boundary;
pub mod cpu;
pub mod device;
pub mod layout;
pub mod metadata;
mod panic;
pub mod pinned_registry;
pub mod schema;
mod slice_data;
pub mod stream;

/// The README's example (crates.io shows it), compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
