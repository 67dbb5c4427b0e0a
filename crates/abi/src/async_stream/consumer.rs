//! The consumer side: an `ArrowAsyncDeviceStreamHandler` whose callbacks feed a Rust
//! [`futures::Stream`].

use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use arrow_array::RecordBatch;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{ArrowError, SchemaRef};
use futures::Stream;

use super::{lock, WithMetadata};
use crate::boundary::{catch_panic, swallow_panic};
use crate::cpu;
use crate::device_array::DeviceArray;
use crate::error::{errno, Error, Result};
use crate::ffi::{
    ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask, ArrowDeviceArray,
    ArrowDeviceType, ArrowSchema,
};
use crate::metadata::Metadata;

/// Why a stream ended early; turned into a fresh [`Error`] wherever it is reported.
#[derive(Clone, Debug)]
enum Failure {
    /// The producer called `on_error`.
    Producer { code: c_int, message: String },
    /// The producer broke the protocol.
    Protocol(String),
    /// The schema from `on_schema` could not be imported.
    Schema(String),
    /// The producer's metadata (per stream or per task) could not be decoded.
    Metadata(String),
    /// `release` came before the end of the stream (the producer was cancelled).
    Truncated,
}

impl Failure {
    fn to_error(&self) -> Error {
        match self {
            Failure::Producer { code, message } => Error::Callback {
                operation: "on_error",
                code: *code,
                message: message.clone(),
            },
            Failure::Protocol(message) => Error::Protocol(message.clone()),
            Failure::Schema(message) => Error::Schema(ArrowError::SchemaError(message.clone())),
            Failure::Metadata(message) => Error::Metadata(message.clone()),
            Failure::Truncated => Error::Callback {
                operation: "release",
                code: errno::ECANCELED,
                message: "the producer released the handler before the end of the stream \
                          (it was cancelled)"
                    .into(),
            },
        }
    }
}

/// A task copied out of `on_next_task`, extracted when the Rust side takes it.
struct QueuedTask(ArrowAsyncTask);

// SAFETY: the spec lets a consumer extract a task on whichever thread it likes (that is
// the point of tasks); the struct is two plain words.
unsafe impl Send for QueuedTask {}

impl QueuedTask {
    /// Calls `extract_data` once, with `out` (or NULL to discard the data).
    fn extract(mut self, out: *mut ArrowDeviceArray) -> c_int {
        match self.0.extract_data {
            // SAFETY: the copy of a task from `on_next_task` is extracted exactly once
            // (this consumes it); `out` is NULL or a writable ArrowDeviceArray.
            Some(extract) => unsafe { extract(&mut self.0, out) },
            None => errno::EINVAL,
        }
    }
}

/// Extracts `task` into a new array, checked to be on `expected`.
fn extract_task(task: QueuedTask, expected: Option<ArrowDeviceType>) -> Result<DeviceArray> {
    let mut out = ArrowDeviceArray::empty();
    let rc = task.extract(&mut out);
    if rc != 0 {
        // Release whatever a failing producer may have left there.
        // SAFETY: `out` is released or was filled by the task's producer; whoever
        // drives our handler's (unsafe) callbacks takes on the C data interface's
        // rules, so its arrays meet `DeviceArray::try_new`'s contract.
        drop(unsafe { DeviceArray::try_new(out) });
        return Err(Error::Callback {
            operation: "extract_data",
            code: rc,
            message: String::new(),
        });
    }
    // SAFETY: as above: the array comes from the producer driving our handler.
    let array = unsafe { DeviceArray::try_new(out) }.map_err(|_| {
        Error::Protocol("extract_data returned 0 but left the array released".into())
    })?;
    if Some(array.device_type()) != expected {
        return Err(Error::Protocol(format!(
            "the producer announced {} but delivered an array on {}",
            expected.map_or_else(|| "nothing".to_string(), |d| d.to_string()),
            array.device_type()
        )));
    }
    Ok(array)
}

enum Event {
    /// A task and the metadata that came with it.
    Task(QueuedTask, Metadata),
    /// A task extracted before the Rust side took it (when `on_error` arrived).
    Extracted(Result<DeviceArray>, Metadata),
    Failed(Failure),
    End,
}

#[derive(Default)]
struct State {
    schema: Option<SchemaRef>,
    device_type: Option<ArrowDeviceType>,
    /// The producer's `additional_metadata`, read in `on_schema` (`None`: NULL).
    additional_metadata: Option<Metadata>,
    /// Units requested from the producer so far, and tasks received.
    requested: u64,
    received: u64,
    queue: VecDeque<Event>,
    /// The NULL task, an error or `release` was seen: nothing more is accepted.
    finished: bool,
    /// Set with `finished` when it happened before `on_schema`.
    schema_failure: Option<Failure>,
    /// The Rust stream was dropped.
    dropped: bool,
    stream_waker: Option<Waker>,
    schema_wakers: Vec<Waker>,
}

impl State {
    fn wake_all(&mut self) {
        if let Some(w) = self.stream_waker.take() {
            w.wake();
        }
        for w in self.schema_wakers.drain(..) {
            w.wake();
        }
    }

    /// Ends the stream with `failure` unless it has ended already.
    fn fail(&mut self, failure: Failure) {
        if self.finished {
            return;
        }
        self.finished = true;
        if self.schema.is_none() {
            self.schema_failure = Some(failure.clone());
        }
        if !self.dropped {
            self.queue.push_back(Event::Failed(failure));
        }
        self.wake_all();
    }
}

/// The producer struct of the handler, guarded so that it is never used once released.
struct ProducerSlot {
    /// Set in `on_schema`, cleared in `release`.
    ptr: *mut ArrowAsyncProducer,
    cancelled: bool,
    consumer_dropped: bool,
}

thread_local! {
    /// The `Shared` whose producer this thread is calling (`request`/`cancel`), if any:
    /// lets a `release` from inside those calls avoid locking the slot it holds.
    static CALLING_PRODUCER: Cell<usize> = const { Cell::new(0) };
}

/// What the C handler (through `private_data`) and the Rust stream share.
struct Shared {
    capacity: u64,
    /// The C struct; owned here, freed when the last of the two sides lets go.
    handler: *mut ArrowAsyncDeviceStreamHandler,
    producer: Mutex<ProducerSlot>,
    /// `release` was called from inside a producer call of this thread.
    released_in_call: AtomicBool,
    state: Mutex<State>,
}

// SAFETY: `handler` is a heap struct only read through atomics or by the producer, and
// the producer pointer is only used under the `producer` mutex; all else is Mutex-guarded.
unsafe impl Send for Shared {}
// SAFETY: as above; every shared access goes through a Mutex or an atomic.
unsafe impl Sync for Shared {}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: `handler` came from Box::into_raw in `async_handler`; this is the last
        // owner (the C side gave its reference up in `release`).
        drop(unsafe { Box::from_raw(self.handler) });
    }
}

/// Resets [`CALLING_PRODUCER`] when a producer call returns (or unwinds).
struct CallingGuard(usize);

impl Drop for CallingGuard {
    fn drop(&mut self) {
        CALLING_PRODUCER.with(|c| c.set(self.0));
    }
}

impl Shared {
    /// Runs `f` on the producer slot, holding its lock; a `release` from inside `f` (on
    /// this thread) clears the pointer when `f` returns.
    fn with_producer<R>(&self, f: impl FnOnce(&mut ProducerSlot) -> R) -> R {
        let mut slot = lock(&self.producer);
        let me = self as *const Shared as usize;
        let _guard = CallingGuard(CALLING_PRODUCER.with(|c| c.replace(me)));
        let result = f(&mut slot);
        if self.released_in_call.swap(false, Ordering::AcqRel) {
            slot.ptr = std::ptr::null_mut();
        }
        result
    }

    /// Requests `n` more tasks, unless the stream is over.
    fn request(&self, n: u64) {
        {
            let mut state = lock(&self.state);
            if state.finished || state.dropped {
                return;
            }
            // Counted before the call: tasks may arrive before `request` returns.
            state.requested = state.requested.saturating_add(n);
        }
        self.with_producer(|slot| {
            if slot.ptr.is_null() || slot.cancelled {
                return;
            }
            // SAFETY: the pointer is set by `on_schema` and cleared by `release` under
            // this lock, so the producer is live; `request` never calls the handler
            // synchronously (spec).
            if let Some(request) = unsafe { (*slot.ptr).request } {
                // SAFETY: see above.
                unsafe { request(slot.ptr, i64::try_from(n).unwrap_or(i64::MAX)) };
            }
        });
    }

    fn on_schema(
        &self,
        handler: *mut ArrowAsyncDeviceStreamHandler,
        schema: Option<FFI_ArrowSchema>,
    ) -> Result<()> {
        // SAFETY: `handler` is our live struct; the producer populated `producer` before
        // calling `on_schema` (spec).
        let producer = unsafe { (*handler).producer };
        let imported = {
            let mut state = lock(&self.state);
            if state.dropped {
                return Err(Error::Callback {
                    operation: "on_schema",
                    code: errno::ECANCELED,
                    message: "the consumer is gone".into(),
                });
            }
            if state.finished || state.schema.is_some() {
                let failure = Failure::Protocol("on_schema called twice or too late".into());
                state.fail(failure.clone());
                return Err(failure.to_error());
            }
            let imported = match (producer.is_null(), schema) {
                (true, _) => Err(Failure::Protocol(
                    "handler->producer was not set before on_schema".into(),
                )),
                (false, None) => Err(Failure::Protocol("on_schema got a NULL schema".into())),
                // arrow-rs's own reader panics on some schemas: the guarded one never does.
                (false, Some(ffi)) => crate::schema::import_schema(&ffi)
                    .map(Arc::new)
                    .map_err(|e| Failure::Schema(e.to_string()))
                    .and_then(|schema| {
                        // SAFETY: checked non-null; the producer is live during on_schema and
                        // its `additional_metadata` is NULL or valid metadata (spec).
                        let metadata = unsafe { Metadata::from_c((*producer).additional_metadata) }
                            .map_err(|e| Failure::Metadata(format!("additional_metadata: {e}")))?;
                        Ok((schema, metadata))
                    }),
            };
            match imported {
                Ok((schema, metadata)) => {
                    state.schema = Some(schema);
                    state.additional_metadata = metadata;
                    // SAFETY: checked non-null above; the producer is live during on_schema.
                    state.device_type = Some(unsafe { (*producer).device_type });
                    state.wake_all();
                    Ok(())
                }
                Err(failure) => {
                    state.fail(failure.clone());
                    Err(failure.to_error())
                }
            }
        };
        imported?;
        let dropped = self.with_producer(|slot| {
            if !slot.consumer_dropped {
                slot.ptr = producer;
            }
            slot.consumer_dropped
        });
        if dropped {
            // The stream was dropped meanwhile: a non-zero return ends the producer.
            return Err(Error::Callback {
                operation: "on_schema",
                code: errno::ECANCELED,
                message: "the consumer is gone".into(),
            });
        }
        self.request(self.capacity);
        Ok(())
    }

    /// Returns the code for `on_next_task`, and a task to discard (extract with NULL): one
    /// accepted (code 0) after the Rust stream was dropped. A task refused (non-zero code)
    /// is never extracted here: it stays its producer's (see the module's protocol
    /// decisions).
    ///
    /// # Safety
    /// `metadata` must be NULL or valid C metadata for the duration of the call.
    unsafe fn on_next_task(
        &self,
        task: Option<QueuedTask>,
        metadata: *const c_char,
    ) -> (c_int, Option<QueuedTask>) {
        let mut state = lock(&self.state);
        if state.dropped {
            return (0, task);
        }
        if state.finished {
            // After the end, an error or a release: refused, the producer keeps it.
            return (errno::EINVAL, None);
        }
        if state.schema.is_none() {
            state.fail(Failure::Protocol(
                "on_next_task called before on_schema".into(),
            ));
            return (errno::EINVAL, None);
        }
        let Some(task) = task else {
            // The end takes no requested unit (see the module's protocol decisions).
            state.finished = true;
            state.queue.push_back(Event::End);
            state.wake_all();
            return (0, None);
        };
        if task.0.extract_data.is_none() {
            state.fail(Failure::Protocol("a task without extract_data".into()));
            return (errno::EINVAL, None);
        }
        if state.received >= state.requested {
            let message = format!(
                "the producer sent more tasks than the {} requested",
                state.requested
            );
            state.fail(Failure::Protocol(message));
            return (errno::EINVAL, None);
        }
        // SAFETY: per the contract.
        let metadata = match unsafe { Metadata::from_c(metadata) } {
            Ok(metadata) => metadata.unwrap_or_default(),
            Err(e) => {
                state.fail(Failure::Metadata(format!("a task's metadata: {e}")));
                return (errno::EINVAL, None);
            }
        };
        state.received += 1;
        state.queue.push_back(Event::Task(task, metadata));
        state.wake_all();
        (0, None)
    }

    fn on_error(&self, code: c_int, message: String) {
        // The tasks still queued are extracted now, not when the Rust side takes them: a
        // producer may reclaim the tasks of a failed stream once `on_error` returns
        // (devarrow's does, see the module documentation). Extracted outside the lock
        // (a foreign callback); callbacks are serialized, so no task arrives meanwhile,
        // and the Rust side finds an unfinished, empty queue and waits.
        let (queued, expected) = {
            let mut state = lock(&self.state);
            if state.finished {
                return;
            }
            let queued: Vec<Event> = state.queue.drain(..).collect();
            (queued, state.device_type)
        };
        let extracted: Vec<Event> = queued
            .into_iter()
            .map(|event| match event {
                Event::Task(task, metadata) => {
                    Event::Extracted(extract_task(task, expected), metadata)
                }
                other => other,
            })
            .collect();
        let mut state = lock(&self.state);
        if state.dropped {
            // Dropped meanwhile: the arrays are released here, outside the lock.
            drop(state);
            drop(extracted);
            return;
        }
        for event in extracted.into_iter().rev() {
            state.queue.push_front(event);
        }
        state.fail(Failure::Producer { code, message });
    }

    fn on_release(&self) {
        let me = self as *const Shared as usize;
        if CALLING_PRODUCER.with(|c| c.get()) == me {
            // Released from inside our own request/cancel call: the caller holds the slot
            // and clears the pointer when the call returns.
            self.released_in_call.store(true, Ordering::Release);
        } else {
            lock(&self.producer).ptr = std::ptr::null_mut();
        }
        let mut state = lock(&self.state);
        if state.schema.is_none() {
            state.fail(Failure::Protocol(
                "the producer released the handler without calling on_schema or on_error".into(),
            ));
        } else {
            state.fail(Failure::Truncated);
        }
        state.wake_all();
    }
}

// ---------------------------------------------------------------------------------------
// The C callbacks
// ---------------------------------------------------------------------------------------

/// The handler's `private_data`, read and written atomically.
///
/// # Safety
/// `handler` must point to a live handler made by [`async_handler`].
unsafe fn private_data<'a>(handler: *mut ArrowAsyncDeviceStreamHandler) -> &'a AtomicPtr<c_void> {
    // SAFETY: per the contract the field is live and aligned; AtomicPtr has the layout of
    // a raw pointer, and all our accesses to this field go through it.
    unsafe { AtomicPtr::from_ptr(std::ptr::addr_of_mut!((*handler).private_data)) }
}

/// A new strong reference to the shared state, or `None` after `release`.
///
/// # Safety
/// `handler` must be NULL or point to a live handler made by [`async_handler`].
unsafe fn shared_of(handler: *mut ArrowAsyncDeviceStreamHandler) -> Option<Arc<Shared>> {
    if handler.is_null() {
        return None;
    }
    // SAFETY: per the contract.
    let ptr = unsafe { private_data(handler) }.load(Ordering::Acquire) as *const Shared;
    if ptr.is_null() {
        return None;
    }
    // SAFETY: a non-null private_data holds the C side's strong count, given up only in
    // `release` (which nulls the field first); callbacks are serialized (spec).
    unsafe {
        Arc::increment_strong_count(ptr);
        Some(Arc::from_raw(ptr))
    }
}

fn code_of(result: Result<()>) -> c_int {
    match result {
        Ok(()) => 0,
        Err(e) => e.c_code(),
    }
}

unsafe extern "C" fn on_schema(
    handler: *mut ArrowAsyncDeviceStreamHandler,
    schema: *mut ArrowSchema,
) -> c_int {
    code_of(catch_panic(|| {
        // Take ownership of the schema first, so it is released whatever happens.
        let schema = (!schema.is_null()).then(|| {
            // SAFETY: a non-null schema is valid for the call; moving it out leaves a
            // released struct behind (spec: the consumer moves it).
            unsafe { FFI_ArrowSchema::from_raw(schema) }
        });
        // SAFETY: the producer calls us with our handler.
        let shared = unsafe { shared_of(handler) }
            .ok_or_else(|| Error::Protocol("on_schema called after release".into()))?;
        shared.on_schema(handler, schema)
    }))
}

unsafe extern "C" fn on_next_task(
    handler: *mut ArrowAsyncDeviceStreamHandler,
    task: *mut ArrowAsyncTask,
    metadata: *const c_char,
) -> c_int {
    let mut code = errno::EINVAL;
    let result = catch_panic(|| {
        // SAFETY: a non-null task is valid during this call; a bitwise copy is how a
        // consumer keeps it (spec), the producer's struct is not used again.
        let copy = (!task.is_null()).then(|| QueuedTask(unsafe { std::ptr::read(task) }));
        // SAFETY: the producer calls us with our handler. After `release` (a producer
        // bug) the task is refused and left to its producer.
        let (rc, discard) = match unsafe { shared_of(handler) } {
            // SAFETY: `metadata` is NULL or valid metadata for this call (spec).
            Some(shared) => unsafe { shared.on_next_task(copy, metadata) },
            None => (errno::EINVAL, None),
        };
        code = rc;
        if let Some(discard) = discard {
            // Accepted but unwanted (the Rust stream is gone): ours to clean up.
            discard.extract(std::ptr::null_mut());
        }
        Ok(())
    });
    match result {
        Ok(()) => code,
        Err(e) => e.c_code(),
    }
}

unsafe extern "C" fn on_error(
    handler: *mut ArrowAsyncDeviceStreamHandler,
    code: c_int,
    message: *const c_char,
    _metadata: *const c_char,
) {
    swallow_panic("in ArrowAsyncDeviceStreamHandler.on_error", || {
        let message = if message.is_null() {
            String::new()
        } else {
            // SAFETY: a non-null message is a NUL-terminated string valid for this call;
            // it is copied.
            unsafe { CStr::from_ptr(message) }
                .to_string_lossy()
                .into_owned()
        };
        // SAFETY: the producer calls us with our handler.
        if let Some(shared) = unsafe { shared_of(handler) } {
            shared.on_error(code, message);
        }
    });
}

unsafe extern "C" fn release(handler: *mut ArrowAsyncDeviceStreamHandler) {
    swallow_panic("in ArrowAsyncDeviceStreamHandler.release", || {
        if handler.is_null() {
            return;
        }
        // SAFETY: the producer calls us with our handler. Swapping NULL in first makes a
        // second release (or any later callback) a no-op while the struct is alive.
        let ptr = unsafe { private_data(handler) }.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if ptr.is_null() {
            return;
        }
        // SAFETY: the pointer is the C side's strong count from `async_handler`, taken
        // exactly once thanks to the swap above.
        let shared = unsafe { Arc::from_raw(ptr as *const Shared) };
        // SAFETY: the producer passes our handler, which `shared` owns, so it is alive
        // until `shared` drops below; callbacks are serialized (spec), so nothing else
        // touches it now. A NULL `release` marks the handler released (spec).
        unsafe { (*handler).release = None };
        shared.on_release();
        // Dropping the last reference frees the handler struct: nothing uses it after.
        drop(shared);
    });
}

// ---------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------

/// An `ArrowAsyncDeviceStreamHandler` made by [`async_handler`], not yet handed to a
/// producer. Dropping it releases the handler (the stream then ends with an error).
#[derive(Debug)]
pub struct AsyncStreamHandler {
    raw: *mut ArrowAsyncDeviceStreamHandler,
}

// SAFETY: the handler's callbacks are thread-safe (they lock the shared state) and may be
// called from any thread (spec: serialized, not necessarily on the same thread).
unsafe impl Send for AsyncStreamHandler {}

impl AsyncStreamHandler {
    /// Hands the handler over to a producer, which must call its `release` eventually.
    /// The pointer stays valid until then.
    pub fn into_raw(self) -> *mut ArrowAsyncDeviceStreamHandler {
        let this = std::mem::ManuallyDrop::new(self);
        this.raw
    }
}

impl Drop for AsyncStreamHandler {
    fn drop(&mut self) {
        // SAFETY: never handed over, so the handler is live and ours to release.
        unsafe { release(self.raw) };
    }
}

/// Creates a consumer: a handler to pass to an async producer, and the stream of the
/// device arrays it receives.
///
/// The stream requests `capacity` tasks (at least 1) as soon as `on_schema` arrives and
/// one more for each item taken, so at most `capacity` tasks are ever queued; each task's
/// data is extracted when its item is polled. A producer's `on_error` becomes an
/// [`Error::Callback`] item (`operation` `"on_error"`, its code and message), a protocol
/// violation an [`Error::Protocol`] item, undecodable metadata an [`Error::Metadata`]
/// item, and a `release` before the end of the stream an [`Error::Callback`] with
/// `ECANCELED`; the stream ends after such an item. A task it refuses (returning non-zero
/// from `on_next_task`) is left to its producer, never extracted.
///
/// The NULL task that ends the stream needs no requested unit (see the module's protocol
/// decisions); and since this consumer requests one more unit for every item taken,
/// `capacity` units are outstanding whenever its queue is empty, so even a producer that
/// waits for demand before sending the end gets it. The metadata of each task and the
/// producer's `additional_metadata` are kept
/// ([`AsyncDeviceArrayStream::with_metadata`],
/// [`AsyncDeviceArrayStream::additional_metadata`]). Dropping the stream early cancels
/// the producer; devarrow's producer then stops at once and releases the handler.
///
/// # Example
///
/// The consumer side: hand [`AsyncStreamHandler::into_raw`] to a producer (a C library
/// takes the `ArrowAsyncDeviceStreamHandler*` through its own API; devarrow's producer
/// here, on an endless source), read the schema, the stream's metadata and arrays with
/// their tasks' metadata, and drop the stream when done: that cancels the producer.
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, RecordBatch, StringArray};
/// use devarrow_abi::async_stream::{
///     async_handler, produce_record_batches_with, Metadata, ProducerOptions, WithMetadata,
/// };
/// use devarrow_abi::{cpu, ArrowAsyncDeviceStreamHandler, ArrowDeviceType, Error};
/// use futures::executor::block_on;
/// use futures::{stream, StreamExt};
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let part = |i: u64| -> Result<WithMetadata<RecordBatch>, Error> {
///     let names: ArrayRef = Arc::new(StringArray::from(vec![format!("part {i}")]));
///     let batch = RecordBatch::try_from_iter([("name", names)])?;
///     Ok(WithMetadata::new(batch, Metadata::new().with("part", i.to_string())))
/// };
/// let schema = part(0)?.data.schema();
///
/// // The consumer: at most 4 tasks requested ahead and queued.
/// let (handler, mut arrays) = async_handler(4);
/// let raw: *mut ArrowAsyncDeviceStreamHandler = handler.into_raw(); // what a producer takes
///
/// // A producer that would never end on its own.
/// let options = ProducerOptions::new().with_additional_metadata(Metadata::new().with("table", "parts"));
/// // SAFETY: a handler from `async_handler` stays valid until its release.
/// let producer = unsafe {
///     produce_record_batches_with(schema, stream::iter(0..).map(part), options, raw)
/// }?;
///
/// block_on(async {
///     let schema = arrays.schema().await?;
///     assert_eq!(arrays.device_type(), Some(ArrowDeviceType::CPU));
///     let stream_metadata = arrays.additional_metadata().expect("sent by the producer");
///     assert_eq!(stream_metadata.get("table"), Some("parts"));
///     for i in 0..3 {
///         let item = arrays.next_with_metadata().await.expect("an array")?;
///         assert_eq!(item.metadata.get("part"), Some(i.to_string().as_str()));
///         let batch = cpu::import_record_batch_with_schema(item.data, schema.clone())?;
///         assert_eq!(batch.num_rows(), 1);
///     }
///     Ok::<_, Error>(())
/// })?;
///
/// drop(arrays); // cancels the producer: it stops, releases the handler, and ends
/// producer.join()?;
/// # Ok(())
/// # }
/// ```
pub fn async_handler(capacity: usize) -> (AsyncStreamHandler, AsyncDeviceArrayStream) {
    let handler = Box::into_raw(Box::new(ArrowAsyncDeviceStreamHandler {
        on_schema: Some(on_schema),
        on_next_task: Some(on_next_task),
        on_error: Some(on_error),
        release: Some(release),
        producer: std::ptr::null_mut(),
        private_data: std::ptr::null_mut(),
    }));
    let shared = Arc::new(Shared {
        capacity: u64::try_from(capacity.max(1))
            .unwrap_or(u64::MAX)
            .min(i64::MAX as u64),
        handler,
        producer: Mutex::new(ProducerSlot {
            ptr: std::ptr::null_mut(),
            cancelled: false,
            consumer_dropped: false,
        }),
        released_in_call: AtomicBool::new(false),
        state: Mutex::new(State::default()),
    });
    // SAFETY: `handler` was just allocated; the C side's strong count goes into
    // private_data and comes back out in `release`.
    unsafe { (*handler).private_data = Arc::into_raw(shared.clone()) as *mut c_void };
    (
        AsyncStreamHandler { raw: handler },
        AsyncDeviceArrayStream {
            shared,
            done: false,
        },
    )
}

/// [`async_handler`] read as arrow-rs record batches on the CPU (see
/// [`AsyncDeviceArrayStream::into_record_batches`]).
pub fn async_record_batch_handler(capacity: usize) -> (AsyncStreamHandler, AsyncRecordBatchStream) {
    let (handler, stream) = async_handler(capacity);
    (handler, stream.into_record_batches())
}

/// The device arrays an async producer delivers to a handler made by [`async_handler`],
/// as a [`futures::Stream`].
///
/// Dropping it before the end extracts (with NULL) the tasks still queued and cancels the
/// producer once; the producer's `release` then frees the handler. devarrow's producer
/// stops at once on `cancel` (at most one task already under way still arrives, and is
/// discarded).
///
/// As a [`futures::Stream`] it yields the arrays alone; [`AsyncDeviceArrayStream::with_metadata`]
/// (or [`AsyncDeviceArrayStream::poll_next_with_metadata`]) yields them with the metadata
/// of their tasks.
pub struct AsyncDeviceArrayStream {
    shared: Arc<Shared>,
    done: bool,
}

impl std::fmt::Debug for AsyncDeviceArrayStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncDeviceArrayStream")
            .field("capacity", &self.shared.capacity)
            .field("device_type", &self.device_type())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl AsyncDeviceArrayStream {
    /// The schema from `on_schema`: `Pending` until it arrives, an error when the stream
    /// failed before it.
    pub fn poll_schema(&self, cx: &mut Context<'_>) -> Poll<Result<SchemaRef>> {
        let mut state = lock(&self.shared.state);
        if let Some(schema) = &state.schema {
            return Poll::Ready(Ok(schema.clone()));
        }
        if let Some(failure) = &state.schema_failure {
            return Poll::Ready(Err(failure.to_error()));
        }
        if !state.schema_wakers.iter().any(|w| w.will_wake(cx.waker())) {
            state.schema_wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Waits for the schema (see [`AsyncDeviceArrayStream::poll_schema`]).
    pub fn schema(&self) -> impl Future<Output = Result<SchemaRef>> + '_ {
        futures::future::poll_fn(move |cx| self.poll_schema(cx))
    }

    /// The producer's device type, known once the schema has arrived.
    pub fn device_type(&self) -> Option<ArrowDeviceType> {
        lock(&self.shared.state).device_type
    }

    /// The producer's stream-level metadata (`ArrowAsyncProducer.additional_metadata`,
    /// e.g. [`Metadata::num_rows`] and [`Metadata::num_batches`]), copied in `on_schema`:
    /// `None` before the schema has arrived or when the producer gave NULL.
    pub fn additional_metadata(&self) -> Option<Metadata> {
        lock(&self.shared.state).additional_metadata.clone()
    }

    /// The most tasks ever queued (and requested ahead).
    pub fn capacity(&self) -> usize {
        usize::try_from(self.shared.capacity).unwrap_or(usize::MAX)
    }

    /// Reads a CPU stream as arrow-rs record batches (zero-copy, validated).
    pub fn into_record_batches(self) -> AsyncRecordBatchStream {
        AsyncRecordBatchStream {
            inner: self,
            schema: None,
            done: false,
        }
    }

    fn extract(&self, task: QueuedTask) -> Result<DeviceArray> {
        extract_task(task, self.device_type())
    }
}

impl AsyncDeviceArrayStream {
    /// [`Stream::poll_next`], with the metadata of each array's task (empty when the
    /// producer passed NULL).
    pub fn poll_next_with_metadata(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<WithMetadata<DeviceArray>>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let event = {
            let mut state = lock(&self.shared.state);
            match state.queue.pop_front() {
                Some(event) => event,
                None if state.finished => {
                    drop(state);
                    self.done = true;
                    return Poll::Ready(None);
                }
                None => {
                    if !state
                        .stream_waker
                        .as_ref()
                        .is_some_and(|w| w.will_wake(cx.waker()))
                    {
                        state.stream_waker = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
            }
        };
        match event {
            Event::Task(task, metadata) => {
                let item = self.extract(task);
                self.shared.request(1);
                Poll::Ready(Some(item.map(|array| WithMetadata::new(array, metadata))))
            }
            Event::Extracted(item, metadata) => {
                // The stream has failed: no more requests.
                Poll::Ready(Some(item.map(|array| WithMetadata::new(array, metadata))))
            }
            Event::Failed(failure) => Poll::Ready(Some(Err(failure.to_error()))),
            Event::End => {
                self.done = true;
                Poll::Ready(None)
            }
        }
    }

    /// The next array with the metadata of its task (see
    /// [`AsyncDeviceArrayStream::poll_next_with_metadata`]).
    pub fn next_with_metadata(
        &mut self,
    ) -> impl Future<Output = Option<Result<WithMetadata<DeviceArray>>>> + '_ {
        futures::future::poll_fn(move |cx| self.poll_next_with_metadata(cx))
    }

    /// This stream as a [`futures::Stream`] of arrays with the metadata of their tasks.
    pub fn with_metadata(
        mut self,
    ) -> impl Stream<Item = Result<WithMetadata<DeviceArray>>> + Send + Unpin {
        futures::stream::poll_fn(move |cx| self.poll_next_with_metadata(cx))
    }
}

impl Stream for AsyncDeviceArrayStream {
    type Item = Result<DeviceArray>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_next_with_metadata(cx)
            .map(|item| item.map(|item| item.map(|item| item.data)))
    }
}

impl Drop for AsyncDeviceArrayStream {
    fn drop(&mut self) {
        let (events, finished) = {
            let mut state = lock(&self.shared.state);
            state.dropped = true;
            let events: Vec<Event> = state.queue.drain(..).collect();
            (events, state.finished)
        };
        // Outside the lock: extracted arrays are released here (foreign callbacks).
        for event in events {
            if let Event::Task(task, _) = event {
                task.extract(std::ptr::null_mut());
            }
        }
        self.shared.with_producer(|slot| {
            slot.consumer_dropped = true;
            if finished || slot.ptr.is_null() || slot.cancelled {
                return;
            }
            slot.cancelled = true;
            // SAFETY: the pointer is live (set in on_schema, cleared in release under this
            // lock); cancel may call on_error, which does not take this lock.
            if let Some(cancel) = unsafe { (*slot.ptr).cancel } {
                // SAFETY: see above.
                unsafe { cancel(slot.ptr) };
            }
        });
    }
}

/// The record batches of a CPU async stream (see
/// [`AsyncDeviceArrayStream::into_record_batches`]).
#[derive(Debug)]
pub struct AsyncRecordBatchStream {
    inner: AsyncDeviceArrayStream,
    schema: Option<SchemaRef>,
    done: bool,
}

impl AsyncRecordBatchStream {
    /// Waits for the schema (see [`AsyncDeviceArrayStream::poll_schema`]).
    pub fn schema(&self) -> impl Future<Output = Result<SchemaRef>> + '_ {
        self.inner.schema()
    }

    /// The underlying device array stream.
    pub fn device_stream(&self) -> &AsyncDeviceArrayStream {
        &self.inner
    }
}

impl AsyncRecordBatchStream {
    /// [`Stream::poll_next`], with the metadata of each batch's task (empty when the
    /// producer passed NULL).
    pub fn poll_next_with_metadata(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<WithMetadata<RecordBatch>>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let schema = match &self.schema {
            Some(schema) => schema.clone(),
            None => match self.inner.poll_schema(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Ok(schema)) => {
                    self.schema = Some(schema.clone());
                    schema
                }
            },
        };
        match self.inner.poll_next_with_metadata(cx) {
            Poll::Ready(Some(Ok(WithMetadata { data, metadata }))) => Poll::Ready(Some(
                cpu::import_record_batch_with_schema(data, schema)
                    .map(|batch| WithMetadata::new(batch, metadata)),
            )),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    /// The next batch with the metadata of its task (see
    /// [`AsyncRecordBatchStream::poll_next_with_metadata`]).
    pub fn next_with_metadata(
        &mut self,
    ) -> impl Future<Output = Option<Result<WithMetadata<RecordBatch>>>> + '_ {
        futures::future::poll_fn(move |cx| self.poll_next_with_metadata(cx))
    }

    /// This stream as a [`futures::Stream`] of batches with the metadata of their tasks.
    pub fn with_metadata(
        mut self,
    ) -> impl Stream<Item = Result<WithMetadata<RecordBatch>>> + Send + Unpin {
        futures::stream::poll_fn(move |cx| self.poll_next_with_metadata(cx))
    }
}

impl Stream for AsyncRecordBatchStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.poll_next_with_metadata(cx)
            .map(|item| item.map(|item| item.map(|item| item.data)))
    }
}
