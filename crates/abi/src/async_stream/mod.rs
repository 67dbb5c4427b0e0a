//! The experimental async device stream interface (`ArrowAsyncDeviceStreamHandler`,
//! `ArrowAsyncProducer`, `ArrowAsyncTask`), both sides.
//!
//! - Producer: [`spawn_producer`] drives a consumer's handler from any Rust
//!   [`futures::Stream`] of [`DeviceArray`](crate::DeviceArray)s on a thread of its own,
//!   honouring `request(n)` back-pressure and `cancel`; [`produce_record_batches`] and
//!   [`produce_record_batch_iter`] do so for arrow-rs record batches on the CPU;
//!   [`spawn_producer_with`] and [`produce_record_batches_with`] add metadata.
//! - Consumer: [`async_handler`] builds a handler ([`AsyncStreamHandler`]) whose callbacks
//!   feed an [`AsyncDeviceArrayStream`], a [`futures::Stream`] with bounded buffering;
//!   [`AsyncDeviceArrayStream::into_record_batches`] reads a CPU stream as record batches.
//!
//! # Example
//!
//! Both sides in one process: the consumer makes a handler (the C struct a producer
//! drives) and the Rust stream it feeds; a producer thread drives the handler from three
//! record batches; an executor reads the stream (`futures::executor::block_on` here: any
//! executor works, the stream wakes its task when a task or the end arrives).
//!
//! ```
//! use std::sync::Arc;
//!
//! use arrow_array::{ArrayRef, Int32Array, RecordBatch};
//! use arrow_schema::ArrowError;
//! use devarrow_abi::async_stream::{async_record_batch_handler, produce_record_batch_iter};
//! use futures::executor::block_on;
//! use futures::TryStreamExt;
//!
//! # fn main() -> devarrow_abi::Result<()> {
//! let batches = (0..3)
//!     .map(|i| {
//!         let x: ArrayRef = Arc::new(Int32Array::from(vec![i, 10 * i]));
//!         RecordBatch::try_from_iter([("x", x)])
//!     })
//!     .collect::<Result<Vec<_>, ArrowError>>()?;
//! let schema = batches[0].schema();
//!
//! // Consumer: a handler that keeps at most 2 tasks queued, and its stream.
//! let (handler, stream) = async_record_batch_handler(2);
//!
//! // Producer: a driver thread calls the handler's callbacks (on_schema, on_next_task as
//! // the consumer requests, the end, release).
//! let source = batches.clone().into_iter().map(Ok::<_, ArrowError>);
//! // SAFETY: a handler from `async_record_batch_handler` stays valid until its release.
//! let producer = unsafe { produce_record_batch_iter(schema.clone(), source, handler.into_raw()) }?;
//!
//! // Consumer: the schema first, then the batches, with an executor.
//! assert_eq!(block_on(stream.schema())?, schema);
//! let received: Vec<RecordBatch> = block_on(stream.try_collect())?;
//! assert_eq!(received, batches);
//! producer.join()?; // the driver thread has called release and ended
//! # Ok(())
//! # }
//! ```
//!
//! # Metadata
//!
//! Both sides carry the interface's metadata ([`Metadata`], encoded as
//! `ArrowSchema.metadata`): per task ([`WithMetadata`] items: the producer's
//! [`spawn_producer_with`] / [`produce_record_batches_with`] take them, the consumer's
//! [`AsyncDeviceArrayStream::with_metadata`] / [`AsyncRecordBatchStream::with_metadata`]
//! yield them) and per stream (`ArrowAsyncProducer.additional_metadata`:
//! [`ProducerOptions`] on the producer, [`AsyncDeviceArrayStream::additional_metadata`] on
//! the consumer), including the stream's row and batch counts when the producer knows
//! them ([`Metadata::NUM_ROWS`], [`Metadata::NUM_BATCHES`]). Empty metadata is passed as
//! NULL. `on_error`'s metadata is neither sent nor read.
//!
//! # Protocol decisions
//!
//! Where the specification leaves room, devarrow follows what Arrow C++ (26,
//! `cpp/src/arrow/c/bridge.cc`: `AsyncProducer`, `AsyncRecordBatchIterator`) does, so that
//! each side works with Arrow C++'s other side.
//!
//! - **End of the stream without demand.** The producer calls `on_schema` first (with
//!   `handler->producer` already set), then one `on_next_task` per requested unit, then
//!   the end of the stream as a NULL task, which takes **no** requested unit: it is sent
//!   as soon as the source ends, requested or not (Arrow C++'s producer sends it when its
//!   generator ends, without waiting for demand; its consumer does not count it). A
//!   consumer that requests exactly the `N` arrays of an `N`-array stream sees the end.
//!   To find the end without a request, the producer polls its source one item ahead of
//!   the demand (as Arrow C++'s does): at most one item is taken from the source before
//!   it is requested. `release` is the very last call. Every handler call comes from the
//!   producer's driver thread, never from inside `request` or `cancel`.
//! - **Lifetime of the producer struct.** The specification promises the
//!   `ArrowAsyncProducer` only until `release`; Arrow C++'s consumer calls `request(1)`
//!   for each task it takes from its queue, also after `release` (its own producer keeps
//!   the struct alive from every task). devarrow's producer struct and the state behind
//!   it therefore live until `release` **and** until every task handed out has been
//!   extracted or reclaimed (after a refusal or a failure); `request` and `cancel` are
//!   no-ops once the handler is released. `request` and `cancel` hold a reference to that
//!   state for their whole duration, so a driver finishing meanwhile cannot free it under
//!   them.
//! - **Refused tasks belong to the producer.** A task whose `on_next_task` returned
//!   non-zero was not taken: the producer still owns it and cleans it up, and the consumer
//!   must not call `extract_data` on it. (The specification says the task is owned by
//!   the producer and that the consumer's `extract_data` call is what hands it over, and a
//!   non-zero return means the call failed; Arrow C++'s producer frees a refused task's
//!   private data itself, so a consumer that also extracted it would free it twice.)
//!   devarrow's consumer never extracts a task it refuses; devarrow's producer reclaims
//!   every refused task, and since its tasks are registry ids rather than pointers, a
//!   consumer that extracts a refused task anyway (as devarrow's once did) frees nothing
//!   twice either.
//! - `request(n)` with `n <= 0` is answered by `on_error(EINVAL)` and `release`, from the
//!   driver thread. `request` after `cancel` is a no-op.
//! - `cancel` is idempotent and thread-safe; the producer stops at once, before the next
//!   `on_next_task` (a task in flight when `cancel` is called may still arrive), drops its
//!   source and calls `release` without `on_error` and without the NULL end task.
//! - An error from the source (or a panic in it) becomes `on_error(code, message)` then
//!   `release`; a non-zero return from `on_schema` or `on_next_task` leads to `release`
//!   only.
//! - Tasks are entries of a process-wide registry, their `private_data` being the entry's
//!   id rather than a pointer: `extract_data` removes the entry, so a second call on the
//!   same task (or on any copy of it) finds nothing and returns `EINVAL` instead of
//!   freeing twice. What happens to a task that is never extracted: see "Tasks a
//!   consumer never extracts" below. A failing `extract_data` (a repeated call, or one
//!   on a task reclaimed after a failure) returns its code but does not end the stream
//!   with `on_error`.
//! - The consumer takes ownership of the schema in `on_schema` (also when it fails),
//!   copies the producer's `additional_metadata` there, requests its capacity from inside
//!   `on_schema`, then one more unit per item taken, so at most `capacity` tasks are ever
//!   queued. Tasks are copied out of `on_next_task` (with their metadata, decoded) and
//!   extracted when the Rust side polls. A producer that breaks the protocol (more tasks
//!   than requested, tasks after the end, no schema first, undecodable metadata) gets a
//!   non-zero return (its task left to it) and the Rust side an
//!   [`Error::Protocol`](crate::Error::Protocol) (or [`Error::Metadata`](crate::Error::Metadata))
//!   item; callbacks after `release` are refused for as long as the Rust stream is alive,
//!   since the handler struct is owned by the stream's shared state. After `release` the
//!   consumer never calls `request` or `cancel`.
//! - Dropping the Rust stream extracts (with NULL) every queued task and calls `cancel`
//!   once (unless the stream already ended); tasks that still arrive are accepted
//!   (return 0) and extracted with NULL at once. On `on_error` the consumer extracts
//!   every task still queued at once (before returning), so the arrays that came before
//!   the error are still yielded, in order, before it.
//!
//! # Tasks a consumer never extracts
//!
//! The specification makes `extract_data` mandatory for every task, but Arrow C++'s
//! consumer (`CreateAsyncDeviceStreamHandler`, 26) returns a producer's error before it
//! pops its queue and then drops the tasks still queued without extracting them. Since
//! the producer reads its source one item ahead of the demand, a source error overtakes
//! every task in that queue (up to its size, 5 by default). devarrow's producer
//! therefore **reclaims the tasks of a failed stream**:
//!
//! - When the stream fails (the producer calls `on_error`, or the consumer returned
//!   non-zero from `on_schema` or `on_next_task`), every task it handed out and that is
//!   not extracted yet is reclaimed after `on_error` returns and before `release`: its
//!   array is released (exactly once: the registry entry is removed first) and its hold
//!   on the producer struct let go. A later `extract_data` on such a task returns
//!   `EINVAL` and leaves `out` untouched (released), like a repeated call.
//! - When the stream ends normally (the NULL task) or is cancelled, tasks are **not**
//!   reclaimed: consumers (Arrow C++'s and devarrow's) extract the tasks they queued
//!   after `release`. A consumer that drops such a task without extracting it keeps its
//!   array and the producer struct alive until the process ends.

mod consumer;
mod producer;

pub use crate::metadata::Metadata;
pub use consumer::{
    async_handler, async_record_batch_handler, AsyncDeviceArrayStream, AsyncRecordBatchStream,
    AsyncStreamHandler,
};
pub use producer::{
    new_task, produce_record_batch_iter, produce_record_batches, produce_record_batches_with,
    spawn_producer, spawn_producer_into, spawn_producer_with, ProducerHandle, ProducerOptions,
};

use std::sync::{Mutex, MutexGuard, PoisonError};

/// An item of an async stream with the metadata of its task (`on_next_task`'s
/// `metadata`): what the producer's [`spawn_producer_with`] takes and the consumer's
/// [`AsyncDeviceArrayStream::with_metadata`] yields. Empty metadata travels as NULL.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WithMetadata<T> {
    /// The array or record batch.
    pub data: T,
    /// Its task's metadata.
    pub metadata: Metadata,
}

impl<T> WithMetadata<T> {
    /// `data` with `metadata`.
    pub fn new(data: T, metadata: Metadata) -> Self {
        Self { data, metadata }
    }
}

impl<T> From<T> for WithMetadata<T> {
    /// `data` without metadata.
    fn from(data: T) -> Self {
        Self::new(data, Metadata::new())
    }
}

/// Locks `m`, ignoring poisoning: the state it guards stays consistent across the few
/// panics that can happen while it is held (none of which are in this module).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
