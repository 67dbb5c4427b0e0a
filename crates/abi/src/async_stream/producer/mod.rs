//! The producer side: drives a consumer's `ArrowAsyncDeviceStreamHandler` from a Rust
//! stream on a driver thread.

mod driver;
mod tasks;

use driver::{encode_optional, Driver, Finisher};
pub use tasks::new_task;

use std::ffi::{c_char, c_void};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use arrow_array::RecordBatch;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::SchemaRef;
use futures::task::AtomicWaker;
use futures::{Stream, StreamExt};

use crate::async_stream::{lock, AsyncStreamHandler, WithMetadata};
use crate::boundary::swallow_panic;
use crate::cpu;
use crate::device_array::DeviceArray;
use crate::error::{Error, Result};
use crate::ffi::{ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowDeviceType};
use crate::metadata::Metadata;

// ---------------------------------------------------------------------------------------
// Demand, cancellation and the C callbacks of ArrowAsyncProducer
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Demand {
    /// Units requested and not yet served.
    outstanding: u64,
    cancelled: bool,
    /// The first `n <= 0` passed to `request`, answered with `on_error(EINVAL)`.
    invalid_request: Option<i64>,
    /// The handler is (about to be) released: `request` and `cancel` are no-ops.
    finished: bool,
}

/// What the driver thread shares with `request`, `cancel`, [`ProducerHandle`] and the
/// tasks handed out; it owns the `ArrowAsyncProducer` struct, so that struct lives as long
/// as any of them (see [`spawn_producer`], "Lifetime of the producer struct").
struct ProducerShared {
    demand: Mutex<Demand>,
    /// Signalled on every change of `demand`.
    changed: Condvar,
    /// Wakes the driver while it waits on the source stream, on cancel or a bad request.
    interrupt: AtomicWaker,
    /// The struct the consumer sees (from `Box::into_raw`; freed on drop). Its
    /// `private_data` points to this `ProducerShared`, its `additional_metadata` into
    /// `_additional_metadata`.
    raw: *mut ArrowAsyncProducer,
    /// The encoded `additional_metadata` (`None`: NULL).
    _additional_metadata: Option<Box<[u8]>>,
}

// SAFETY: `raw` is a heap struct written only before the `ProducerShared` is shared (in
// `ProducerShared::new`) and freed only by its drop; the consumer reads it from any
// thread, as the spec allows. Everything else is a Mutex, a Condvar or an AtomicWaker.
unsafe impl Send for ProducerShared {}
// SAFETY: as above.
unsafe impl Sync for ProducerShared {}

impl Drop for ProducerShared {
    fn drop(&mut self) {
        // SAFETY: `raw` came from Box::into_raw in `ProducerShared::new`, and the last
        // reference that could reach it (the driver's, a task's, the handle's or a
        // running `request`/`cancel` call's) is gone.
        drop(unsafe { Box::from_raw(self.raw) });
    }
}

enum Wait {
    Serve,
    Cancelled,
    Invalid(i64),
}

impl ProducerShared {
    /// A new state with its `ArrowAsyncProducer` struct (`private_data` pointing back here).
    fn new(device_type: ArrowDeviceType, additional_metadata: Option<Box<[u8]>>) -> Arc<Self> {
        let raw = Box::into_raw(Box::new(ArrowAsyncProducer {
            device_type,
            request: Some(request),
            cancel: Some(cancel),
            additional_metadata: std::ptr::null(),
            private_data: std::ptr::null_mut(),
        }));
        let shared = Arc::new(ProducerShared {
            demand: Mutex::default(),
            changed: Condvar::new(),
            interrupt: AtomicWaker::new(),
            raw,
            _additional_metadata: additional_metadata,
        });
        // The metadata's address is taken once it has its final place (moving the `Box`
        // into the state would invalidate a pointer taken before, under Rust's aliasing
        // rules: Miri's Stacked Borrows found it); it is never moved or written again.
        let metadata = shared
            ._additional_metadata
            .as_ref()
            .map_or(std::ptr::null(), |m| m.as_ptr().cast::<c_char>());
        // `private_data` does not own a reference: the struct lives exactly as long as
        // `shared` (its drop frees it), so the pointer is valid whenever the struct is;
        // so is `metadata`, owned by `shared` too.
        // SAFETY: `raw` was just allocated and is not shared yet; the pointers as above.
        unsafe {
            (*raw).additional_metadata = metadata;
            (*raw).private_data = Arc::as_ptr(&shared) as *mut c_void;
        }
        shared
    }

    fn request(&self, n: i64) {
        let mut demand = lock(&self.demand);
        if demand.cancelled || demand.finished {
            return;
        }
        if n <= 0 {
            demand.invalid_request.get_or_insert(n);
        } else {
            demand.outstanding = demand.outstanding.saturating_add(n as u64);
        }
        drop(demand);
        // The caller holds a reference to `self` (see `shared_of`), so the state outlives
        // these signals even if the driver finishes and drops its own meanwhile.
        if n <= 0 {
            self.interrupt.wake();
        }
        self.changed.notify_all();
    }

    fn cancel(&self) {
        let mut demand = lock(&self.demand);
        if demand.cancelled || demand.finished {
            return;
        }
        demand.cancelled = true;
        drop(demand);
        // As in `request`: the caller holds a reference.
        self.interrupt.wake();
        self.changed.notify_all();
    }

    /// Marks the stream finished: later `request` and `cancel` calls are no-ops.
    fn finish(&self) {
        lock(&self.demand).finished = true;
    }

    /// Why the driver must stop (cancelled, or a bad request), if it must.
    fn stop(&self) -> Option<Wait> {
        let demand = lock(&self.demand);
        if demand.cancelled {
            Some(Wait::Cancelled)
        } else {
            demand.invalid_request.map(Wait::Invalid)
        }
    }

    fn interrupted(&self) -> bool {
        self.stop().is_some()
    }

    /// Blocks until one unit can be served (and takes it), or the stream must stop.
    fn wait(&self) -> Wait {
        let mut demand = lock(&self.demand);
        loop {
            if demand.cancelled {
                return Wait::Cancelled;
            }
            if let Some(n) = demand.invalid_request {
                return Wait::Invalid(n);
            }
            if demand.outstanding > 0 {
                demand.outstanding -= 1;
                return Wait::Serve;
            }
            demand = self
                .changed
                .wait(demand)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// A new reference to the `ProducerShared` behind a producer struct made by
/// [`spawn_producer`], held by a `request` or `cancel` call for its whole duration.
///
/// # Safety
/// `producer` must be NULL or an `ArrowAsyncProducer` made by `spawn_producer` that is
/// still alive: its handler not released yet (spec), or the caller holding a task of it
/// not yet extracted (devarrow keeps the struct alive for those, see [`spawn_producer`]).
unsafe fn shared_of(producer: *mut ArrowAsyncProducer) -> Option<Arc<ProducerShared>> {
    if producer.is_null() {
        return None;
    }
    // SAFETY: per the contract the struct is alive, hence so is the `ProducerShared` that
    // owns it (the struct is freed only by that state's drop), whose `Arc` its
    // `private_data` points into: the strong count is positive while we increment it.
    unsafe {
        let shared = (*producer).private_data as *const ProducerShared;
        if shared.is_null() {
            return None;
        }
        Arc::increment_strong_count(shared);
        Some(Arc::from_raw(shared))
    }
}

unsafe extern "C" fn request(producer: *mut ArrowAsyncProducer, n: i64) {
    swallow_panic("in ArrowAsyncProducer.request", || {
        // SAFETY: the consumer calls `request` on a live producer (see `shared_of`).
        if let Some(shared) = unsafe { shared_of(producer) } {
            shared.request(n);
        }
    });
}

unsafe extern "C" fn cancel(producer: *mut ArrowAsyncProducer) {
    swallow_panic("in ArrowAsyncProducer.cancel", || {
        // SAFETY: the consumer calls `cancel` on a live producer (see `shared_of`).
        if let Some(shared) = unsafe { shared_of(producer) } {
            shared.cancel();
        }
    });
}

// ---------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------

/// A running async producer (see [`spawn_producer`]).
///
/// Dropping the handle detaches the driver thread: it runs on until the stream ends, the
/// consumer cancels it, or an error. A consumer that neither requests nor cancels keeps
/// the thread (and the source) parked; [`ProducerHandle::cancel`] ends it from Rust.
#[derive(Debug)]
pub struct ProducerHandle {
    thread: JoinHandle<Result<()>>,
    shared: Arc<ProducerShared>,
}

impl std::fmt::Debug for ProducerShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProducerShared").finish_non_exhaustive()
    }
}

impl ProducerHandle {
    /// Cancels the producer, as the consumer's `cancel` would: it stops at once (no further
    /// `on_next_task`, not even the NULL end task, beyond one already under way), then
    /// calls `release` without `on_error`. Idempotent; a no-op once the handler is
    /// released.
    pub fn cancel(&self) {
        self.shared.cancel();
    }

    /// Whether the driver thread has finished (the handler is released).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Waits for the driver thread to finish, which happens after the handler's
    /// `release`. `Ok` when the stream ended or was cancelled; otherwise the error that
    /// was reported with `on_error`, or an [`Error::Callback`] when the consumer returned
    /// an error code. Must not be called from inside a handler callback (it would wait
    /// for itself).
    pub fn join(self) -> Result<()> {
        self.thread
            .join()
            .unwrap_or_else(|payload| Err(Error::from_panic(payload)))
    }
}

/// Stream-level settings of an async producer ([`spawn_producer_with`]).
///
/// `#[non_exhaustive]`: build them with [`ProducerOptions::new`] and the `with_*` methods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProducerOptions {
    /// `ArrowAsyncProducer.additional_metadata`, which the consumer can read from
    /// `on_schema` on (devarrow's: [`AsyncDeviceArrayStream::additional_metadata`](super::AsyncDeviceArrayStream::additional_metadata));
    /// empty means NULL.
    pub additional_metadata: Metadata,
}

impl ProducerOptions {
    /// No additional metadata.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `metadata` as the `additional_metadata`.
    pub fn with_additional_metadata(mut self, metadata: Metadata) -> Self {
        self.additional_metadata = metadata;
        self
    }

    /// Announces the stream's total number of rows ([`Metadata::NUM_ROWS`]).
    pub fn with_num_rows(mut self, rows: u64) -> Self {
        self.additional_metadata =
            std::mem::take(&mut self.additional_metadata).with_num_rows(rows);
        self
    }

    /// Announces the stream's number of batches ([`Metadata::NUM_BATCHES`]).
    pub fn with_num_batches(mut self, batches: u64) -> Self {
        self.additional_metadata =
            std::mem::take(&mut self.additional_metadata).with_num_batches(batches);
        self
    }

    /// Announces the row and batch counts of `batches`, the stream's record batches when
    /// they are known up front.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use arrow_array::{ArrayRef, Int32Array, RecordBatch};
    /// use devarrow_abi::async_stream::ProducerOptions;
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let x: ArrayRef = Arc::new(Int32Array::from(vec![1, 2, 3]));
    /// let batch = RecordBatch::try_from_iter([("x", x)])?;
    /// let options = ProducerOptions::new().counting(&[batch.clone(), batch]);
    /// assert_eq!(options.additional_metadata.num_rows()?, Some(6));
    /// assert_eq!(options.additional_metadata.num_batches()?, Some(2));
    /// # Ok(())
    /// # }
    /// ```
    pub fn counting(self, batches: &[RecordBatch]) -> Self {
        let rows = batches.iter().map(|b| b.num_rows() as u64).sum();
        self.with_num_rows(rows)
            .with_num_batches(batches.len() as u64)
    }
}

/// Starts an async producer that drives `handler` from `arrays` on a new thread.
///
/// [`spawn_producer_with`] with no metadata: no `additional_metadata`, and NULL metadata
/// for every task.
///
/// # Safety
/// As for [`spawn_producer_with`].
pub unsafe fn spawn_producer<S, E>(
    schema: SchemaRef,
    device_type: ArrowDeviceType,
    arrays: S,
    handler: *mut ArrowAsyncDeviceStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<DeviceArray, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    let items = arrays.map(|item| item.map(WithMetadata::from));
    // SAFETY: forwarded from the caller.
    unsafe { spawn_producer_with(schema, device_type, items, ProducerOptions::new(), handler) }
}

/// Starts an async producer that drives `handler` from `items` on a new thread: arrays
/// with the metadata of their tasks, and `options`' stream-level metadata.
///
/// Each item's array must be a struct array of `schema` (one per record batch) on
/// `device_type`; its metadata goes with its task (`on_next_task`'s `metadata`, NULL when
/// empty). The producer sets `handler->producer` (with `options.additional_metadata`),
/// calls `on_schema` with `schema` (metadata included), then one `on_next_task` per unit
/// the consumer requests, a NULL task at the end, and `release` last; see the [module
/// documentation](super) for the rules it follows. An `Err` item, a panic in the stream,
/// or an array on another device or with the wrong number of children is reported with
/// `on_error` and ends the stream.
///
/// The handler is taken over in every case: when this function fails after validating
/// it (no mandatory callback missing), it has called `on_error` and `release` already.
/// Fails with [`Error::NullPointer`] for a NULL handler, [`Error::Released`] when it has
/// no `release` callback, and otherwise when the schema or the metadata cannot be
/// exported or the thread cannot be started.
///
/// # Demand and the end of the stream
///
/// Every task takes one unit the consumer requested; **the NULL task that marks the end
/// of the stream does not**: it is sent as soon as the source ends, requested or not (as
/// Arrow C++'s `ExportAsyncRecordBatchReader` does). To find the end without a request,
/// the producer polls the source one item ahead of the demand: at most one item (the next
/// task's) is taken from the source before it is requested. A consumer that requests
/// exactly the `N` arrays of an `N`-array stream gets them, the end and `release`.
///
/// # Cancellation
///
/// After `cancel` (the consumer's, or [`ProducerHandle::cancel`]) the producer stops at
/// once: it stops waiting for demand or for the source, makes no further `on_next_task`
/// call (only one already under way when `cancel` was called may still complete), sends
/// neither the NULL end task nor `on_error`, drops the source and calls `release`.
/// Later `request` and `cancel` calls are no-ops.
///
/// # Lifetime of the producer struct
///
/// The specification promises the `ArrowAsyncProducer` only until the handler's
/// `release`; Arrow C++'s consumer relies on more: it calls `request(1)` on it for each
/// task still queued when the stream ended, after `release`. So the struct (and the
/// state behind it) lives until `release` **and** until every task handed out has been
/// extracted (or, refused by the consumer, reclaimed), and as long as the
/// [`ProducerHandle`]; `request` and `cancel` are no-ops once the handler is released.
///
/// # Tasks never extracted
///
/// When the stream fails (`on_error`, or a non-zero return from the consumer), the tasks
/// not extracted by then are reclaimed (their arrays released) after `on_error` and
/// before `release`; a later `extract_data` on one returns `EINVAL`. After a normal end or
/// a cancel, a task the consumer never extracts keeps its array and the producer struct
/// alive until the process ends (see the [module documentation](super), "Tasks a
/// consumer never extracts").
///
/// # Safety
/// `handler` must be NULL or point to a valid `ArrowAsyncDeviceStreamHandler` that stays
/// valid until its `release` is called (the producer is its sole user until then).
pub unsafe fn spawn_producer_with<S, E>(
    schema: SchemaRef,
    device_type: ArrowDeviceType,
    items: S,
    options: ProducerOptions,
    handler: *mut ArrowAsyncDeviceStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<WithMetadata<DeviceArray>, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    if handler.is_null() {
        return Err(Error::NullPointer {
            what: "ArrowAsyncDeviceStreamHandler",
        });
    }
    // SAFETY: the caller guarantees a non-null handler is valid for reads.
    let (on_schema, on_next_task, on_error, release) = unsafe {
        (
            (*handler).on_schema,
            (*handler).on_next_task,
            (*handler).on_error,
            (*handler).release,
        )
    };
    let Some(release) = release else {
        return Err(Error::Released {
            what: "ArrowAsyncDeviceStreamHandler",
        });
    };
    let (Some(on_schema), Some(on_next_task), Some(on_error)) = (on_schema, on_next_task, on_error)
    else {
        // SAFETY: the handler is valid and ours to release; nothing else can be called.
        unsafe { release(handler) };
        return Err(Error::InvalidArgument(
            "the ArrowAsyncDeviceStreamHandler lacks a mandatory callback".into(),
        ));
    };
    // A metadata that cannot be encoded is reported like a schema that cannot be
    // exported: on_error and release, through a producer without metadata.
    let (additional_metadata, metadata_error) = match encode_optional(&options.additional_metadata)
    {
        Ok(encoded) => (encoded, None),
        Err(error) => (None, Some(error)),
    };
    let shared = ProducerShared::new(device_type, additional_metadata);
    // SAFETY: the handler is valid and writable; the producer member must be populated
    // before any callback (spec).
    unsafe { (*handler).producer = shared.raw };
    let mut finisher = Finisher {
        handler,
        on_error,
        release,
        shared: shared.clone(),
        released: false,
        pending_error: None,
        failed: false,
    };
    if let Some(error) = metadata_error {
        let message = match &error {
            Error::Metadata(message) => message.clone(),
            other => other.to_string(),
        };
        finisher.pending_error = Some(Error::Metadata(message));
        finisher.finish();
        return Err(error);
    }
    let ffi_schema = match FFI_ArrowSchema::try_from(schema.as_ref()) {
        Ok(s) => s,
        Err(e) => {
            let reported = arrow_schema::ArrowError::SchemaError(e.to_string());
            finisher.pending_error = Some(Error::Schema(reported));
            finisher.finish();
            return Err(Error::Schema(e));
        }
    };
    // Reported if the driver is dropped without running (spawn failed) or unwinds.
    finisher.pending_error = Some(Error::Panic(
        "the async producer's driver thread stopped unexpectedly".into(),
    ));
    let driver = Driver {
        source: Some(Box::pin(items.map(|item| item.map_err(Into::into)))),
        schema: Some(ffi_schema),
        handler,
        on_schema,
        on_next_task,
        device_type,
        n_fields: schema.fields().len(),
        finisher,
    };
    let thread = std::thread::Builder::new()
        .name("devarrow-async-producer".into())
        .spawn(move || driver.run())
        .map_err(|e| Error::InvalidArgument(format!("cannot start the producer thread: {e}")))?;
    Ok(ProducerHandle { thread, shared })
}

/// [`spawn_producer`] into a handler made by [`async_handler`](super::async_handler): safe,
/// since such a handler stays valid until its `release`. Demand, the end of the stream and
/// cancellation work as [`spawn_producer_with`] describes.
///
/// # Example
///
/// The producer side: any [`futures::Stream`] of device arrays (one struct array per
/// record batch of `schema`) becomes the tasks of the stream. Here the arrays are CPU
/// arrays ([`cpu::export_batch_array`]); a GPU producer hands over arrays of its device
/// the same way, naming that device.
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, Int64Array, RecordBatch};
/// use devarrow_abi::async_stream::{async_handler, spawn_producer_into};
/// use devarrow_abi::{cpu, ArrowDeviceType, Error};
/// use futures::executor::block_on;
/// use futures::{stream, StreamExt};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let batch = |n: i64| {
///     let values: ArrayRef = Arc::new(Int64Array::from_iter_values(0..n));
///     RecordBatch::try_from_iter([("v", values)])
/// };
/// let schema = batch(0)?.schema();
///
/// // The source: produced lazily, as the consumer asks for more.
/// let arrays = stream::iter(1..=4).map(move |n| Ok::<_, Error>(cpu::export_batch_array(&batch(n)?)));
///
/// let (handler, mut consumer) = async_handler(1);
/// let producer = spawn_producer_into(schema.clone(), ArrowDeviceType::CPU, arrays, handler)?;
///
/// let mut rows = 0;
/// while let Some(array) = block_on(consumer.next()) {
///     let array = array?; // a source error would arrive here, through on_error
///     rows += cpu::import_record_batch_with_schema(array, schema.clone())?.num_rows();
/// }
/// assert_eq!(rows, 1 + 2 + 3 + 4);
/// producer.join()?;
/// # Ok(())
/// # }
/// ```
pub fn spawn_producer_into<S, E>(
    schema: SchemaRef,
    device_type: ArrowDeviceType,
    arrays: S,
    handler: AsyncStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<DeviceArray, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    // SAFETY: a handler from `async_handler` is valid, and owned by the C side (hence by
    // this producer) from `into_raw` until its `release`.
    unsafe { spawn_producer(schema, device_type, arrays, handler.into_raw()) }
}

/// [`spawn_producer`] for arrow-rs record batches on the CPU: each batch is exported
/// zero-copy as a struct array; a batch whose fields differ from `schema`'s is reported
/// with `on_error(EINVAL)`.
///
/// # Safety
/// As for [`spawn_producer_with`].
pub unsafe fn produce_record_batches<S, E>(
    schema: SchemaRef,
    batches: S,
    handler: *mut ArrowAsyncDeviceStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<RecordBatch, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    let items = batches.map(|item| item.map(WithMetadata::from));
    // SAFETY: forwarded from the caller.
    unsafe { produce_record_batches_with(schema, items, ProducerOptions::new(), handler) }
}

/// [`produce_record_batches`] with metadata: each batch's goes with its task, `options`'
/// is the stream's (see [`spawn_producer_with`]).
///
/// For a consumer that reads it (and for a source that never ends), see
/// [`async_handler`](super::async_handler#example).
///
/// # Safety
/// As for [`spawn_producer_with`].
pub unsafe fn produce_record_batches_with<S, E>(
    schema: SchemaRef,
    batches: S,
    options: ProducerOptions,
    handler: *mut ArrowAsyncDeviceStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<WithMetadata<RecordBatch>, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    let expected = schema.clone();
    let items = batches.map(move |item| {
        let WithMetadata { data, metadata } = item.map_err(Into::into)?;
        if data.schema().fields() != expected.fields() {
            return Err(Error::InvalidArgument(format!(
                "record batch fields {:?} do not match the stream's {:?}",
                data.schema().fields(),
                expected.fields()
            )));
        }
        Ok(WithMetadata::new(cpu::export_batch_array(&data), metadata))
    });
    // SAFETY: forwarded from the caller.
    unsafe {
        spawn_producer_with::<_, Error>(schema, ArrowDeviceType::CPU, items, options, handler)
    }
}

/// [`produce_record_batches`] from an iterator (e.g. a `RecordBatchReader`).
///
/// # Safety
/// As for [`spawn_producer_with`].
pub unsafe fn produce_record_batch_iter<I, E>(
    schema: SchemaRef,
    batches: I,
    handler: *mut ArrowAsyncDeviceStreamHandler,
) -> Result<ProducerHandle>
where
    I: IntoIterator<Item = Result<RecordBatch, E>>,
    I::IntoIter: Send + 'static,
    E: Into<Error> + 'static,
{
    // SAFETY: forwarded from the caller.
    unsafe { produce_record_batches(schema, futures::stream::iter(batches), handler) }
}
