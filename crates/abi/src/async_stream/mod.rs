//! The experimental async device stream interface (`ArrowAsyncDeviceStreamHandler`,
//! `ArrowAsyncProducer`, `ArrowAsyncTask`), both sides.
//!
//! - Producer: [`spawn_producer`] drives a consumer's handler from any Rust
//!   [`futures::Stream`] of [`DeviceArray`](crate::DeviceArray)s on a thread of its own,
//!   honouring `request(n)` back-pressure and `cancel`; [`produce_record_batches`] and
//!   [`produce_record_batch_iter`] do so for arrow-rs record batches on the CPU.
//! - Consumer: [`async_handler`] builds a handler ([`AsyncStreamHandler`]) whose callbacks
//!   feed an [`AsyncDeviceArrayStream`], a [`futures::Stream`] with bounded buffering;
//!   [`AsyncDeviceArrayStream::into_record_batches`] reads a CPU stream as record batches.
//!
//! # Protocol decisions
//!
//! - The producer calls `on_schema` first (with `handler->producer` already set), then
//!   one `on_next_task` per requested unit, the end of the stream as a NULL task (which
//!   also takes one requested unit: a consumer that requests exactly the `N` arrays it
//!   expects must request one more to see the end), and `release` as the very last call;
//!   it frees its `ArrowAsyncProducer` only after `release` returned. Every handler call
//!   comes from the producer's driver thread, never from inside `request` or `cancel`.
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
//!   freeing twice. A task whose `on_next_task` returned non-zero is reclaimed by the
//!   producer. A consumer that never calls `extract_data` leaks its array (the
//!   specification makes that call mandatory). A failing `extract_data` (only ever a
//!   repeated call) returns its code but does not end the stream with `on_error`.
//! - The producer ignores the consumer's `cancel`/`request` only in the sense the
//!   specification requires (no-ops after `cancel`); calling either after the handler's
//!   `release` is a use after free, as the specification forbids it.
//! - The consumer takes ownership of the schema in `on_schema` (also when it fails),
//!   requests its capacity from inside `on_schema`, then one more unit per item taken, so
//!   at most `capacity` tasks are ever queued. Tasks are copied out of `on_next_task` and
//!   extracted when the Rust side polls. A producer that breaks the protocol (more tasks
//!   than requested, tasks after the end, no schema first) gets a non-zero return and the
//!   Rust side an [`Error::Protocol`](crate::Error::Protocol) item; callbacks after
//!   `release` are ignored (and their tasks extracted with NULL) for as long as the Rust
//!   stream is alive, since the handler struct is owned by the stream's shared state.
//! - Dropping the Rust stream extracts (with NULL) every queued task and calls `cancel`
//!   once (unless the stream already ended); tasks that still arrive are discarded.

mod consumer;
mod producer;

pub use consumer::{
    async_handler, async_record_batch_handler, AsyncDeviceArrayStream, AsyncRecordBatchStream,
    AsyncStreamHandler,
};
pub use producer::{
    new_task, produce_record_batch_iter, produce_record_batches, spawn_producer,
    spawn_producer_into, ProducerHandle,
};

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, ignoring poisoning: the state it guards stays consistent across the few
/// panics that can happen while it is held (none of which are in this module).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
