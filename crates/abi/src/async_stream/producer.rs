//! The producer side: drives a consumer's `ArrowAsyncDeviceStreamHandler` from a Rust
//! stream on a driver thread.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::task::Poll;
use std::thread::JoinHandle;

use arrow_array::RecordBatch;
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::SchemaRef;
use futures::task::AtomicWaker;
use futures::{Stream, StreamExt};

use super::lock;
use super::AsyncStreamHandler;
use crate::boundary::{catch_panic, swallow_panic};
use crate::cpu;
use crate::device_array::DeviceArray;
use crate::error::{Error, Result};
use crate::ffi::{
    ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask, ArrowDeviceArray,
    ArrowDeviceType, ArrowSchema,
};

// ---------------------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------------------

/// Ids of tasks; 0 is never used, so a task's `private_data` is never NULL before
/// extraction.
static NEXT_TASK_ID: AtomicUsize = AtomicUsize::new(1);

/// The arrays of the tasks not yet extracted, by id.
fn pending_tasks() -> &'static Mutex<HashMap<usize, DeviceArray>> {
    static TASKS: OnceLock<Mutex<HashMap<usize, DeviceArray>>> = OnceLock::new();
    TASKS.get_or_init(Default::default)
}

/// Wraps a device array in an `ArrowAsyncTask` whose `extract_data` hands it over exactly
/// once: into `out`, or released when `out` is NULL.
///
/// The task's `private_data` is an id in a process-wide registry, not a pointer, so the
/// task struct may be copied freely and outlives any producer. A second `extract_data` on
/// the task or on any copy of it returns `EINVAL` and touches nothing; so does one on a
/// struct whose `private_data` was not made here. A task that is never extracted keeps
/// its array alive until the process ends.
pub fn new_task(array: DeviceArray) -> ArrowAsyncTask {
    let id = NEXT_TASK_ID.fetch_add(1, Ordering::Relaxed);
    lock(pending_tasks()).insert(id, array);
    ArrowAsyncTask {
        extract_data: Some(extract_data),
        private_data: std::ptr::without_provenance_mut(id),
    }
}

/// Removes a task's array from the registry (`None` when already extracted).
fn take_task(id: usize) -> Option<DeviceArray> {
    lock(pending_tasks()).remove(&id)
}

unsafe extern "C" fn extract_data(task: *mut ArrowAsyncTask, out: *mut ArrowDeviceArray) -> c_int {
    let result = catch_panic(|| {
        if task.is_null() {
            return Err(Error::NullPointer {
                what: "ArrowAsyncTask",
            });
        }
        // SAFETY: a non-null `task` points to the task given to `on_next_task` or to a copy
        // the consumer made of it (spec: valid and writable for this call). The id is read
        // and the field cleared, so a repeated call on this very struct sees NULL.
        let id = unsafe { std::mem::replace(&mut (*task).private_data, std::ptr::null_mut()) };
        let array = take_task(id.addr()).ok_or_else(|| {
            Error::InvalidArgument(
                "extract_data called on a task that was already extracted (or not made by \
                 this producer)"
                    .into(),
            )
        })?;
        if out.is_null() {
            drop(array);
        } else {
            // SAFETY: a non-null `out` is a consumer-allocated, writable ArrowDeviceArray
            // (spec: extract_data); ownership of the array moves into it.
            unsafe { array.move_into(out) };
        }
        Ok(())
    });
    match result {
        Ok(()) => 0,
        Err(e) => e.c_code(),
    }
}

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
}

/// What the driver thread shares with `request`, `cancel` and [`ProducerHandle`].
#[derive(Default)]
struct ProducerShared {
    demand: Mutex<Demand>,
    /// Signalled on every change of `demand`.
    changed: Condvar,
    /// Wakes the driver while it waits on the source stream, on cancel or a bad request.
    interrupt: AtomicWaker,
}

enum Wait {
    Serve,
    Cancelled,
    Invalid(i64),
}

impl ProducerShared {
    fn request(&self, n: i64) {
        let mut demand = lock(&self.demand);
        if demand.cancelled {
            return;
        }
        if n <= 0 {
            demand.invalid_request.get_or_insert(n);
            drop(demand);
            self.interrupt.wake();
        } else {
            demand.outstanding = demand.outstanding.saturating_add(n as u64);
            drop(demand);
        }
        self.changed.notify_all();
    }

    fn cancel(&self) {
        let mut demand = lock(&self.demand);
        if demand.cancelled {
            return;
        }
        demand.cancelled = true;
        drop(demand);
        self.interrupt.wake();
        self.changed.notify_all();
    }

    fn is_cancelled(&self) -> bool {
        lock(&self.demand).cancelled
    }

    fn interrupted(&self) -> bool {
        let demand = lock(&self.demand);
        demand.cancelled || demand.invalid_request.is_some()
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

/// The `ProducerShared` behind a producer struct made by [`spawn_producer`].
///
/// # Safety
/// `producer` must be NULL or an `ArrowAsyncProducer` made by `spawn_producer` whose
/// handler has not been released yet (spec: the consumer may use it until then).
unsafe fn shared_of<'a>(producer: *mut ArrowAsyncProducer) -> Option<&'a ProducerShared> {
    if producer.is_null() {
        return None;
    }
    // SAFETY: per the contract `producer` is live, and its `private_data` holds a strong
    // count of the Arc<ProducerShared> that the driver drops only after `release`.
    unsafe { ((*producer).private_data as *const ProducerShared).as_ref() }
}

unsafe extern "C" fn request(producer: *mut ArrowAsyncProducer, n: i64) {
    swallow_panic("in ArrowAsyncProducer.request", || {
        // SAFETY: the consumer calls `request` on the live producer of its handler.
        if let Some(shared) = unsafe { shared_of(producer) } {
            shared.request(n);
        }
    });
}

unsafe extern "C" fn cancel(producer: *mut ArrowAsyncProducer) {
    swallow_panic("in ArrowAsyncProducer.cancel", || {
        // SAFETY: the consumer calls `cancel` on the live producer of its handler.
        if let Some(shared) = unsafe { shared_of(producer) } {
            shared.cancel();
        }
    });
}

// ---------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------

type OnSchema = unsafe extern "C" fn(*mut ArrowAsyncDeviceStreamHandler, *mut ArrowSchema) -> c_int;
type OnNextTask = unsafe extern "C" fn(
    *mut ArrowAsyncDeviceStreamHandler,
    *mut ArrowAsyncTask,
    *const c_char,
) -> c_int;
type OnError =
    unsafe extern "C" fn(*mut ArrowAsyncDeviceStreamHandler, c_int, *const c_char, *const c_char);
type Release = unsafe extern "C" fn(*mut ArrowAsyncDeviceStreamHandler);

type BoxedArrays = Pin<Box<dyn Stream<Item = Result<DeviceArray>> + Send>>;

/// Reports `error` through `on_error` (the message copied into a C string).
///
/// # Safety
/// `handler` must be a live handler whose `on_error` is `on_error`.
unsafe fn report(handler: *mut ArrowAsyncDeviceStreamHandler, on_error: OnError, error: &Error) {
    let code = error.c_code();
    let message =
        CString::new(error.to_string().replace('\0', "\\0")).expect("interior NULs were replaced");
    // SAFETY: per the contract; the message outlives the call, metadata is NULL.
    unsafe { on_error(handler, code, message.as_ptr(), std::ptr::null()) };
}

/// Makes the last calls of a producer exactly once, also when the driver never runs or
/// unwinds: `on_error` when an error is pending, then `release`, then frees the
/// `ArrowAsyncProducer` and its shared state.
struct Finisher {
    handler: *mut ArrowAsyncDeviceStreamHandler,
    on_error: OnError,
    release: Release,
    producer: *mut ArrowAsyncProducer,
    /// Reported with `on_error` before `release`.
    pending_error: Option<Error>,
}

impl Finisher {
    fn finish(&mut self) {
        if self.producer.is_null() {
            return;
        }
        if let Some(error) = self.pending_error.take() {
            // SAFETY: the handler is live until `release` below; it was validated to have
            // this `on_error` when the producer was spawned.
            unsafe { report(self.handler, self.on_error, &error) };
        }
        // SAFETY: the handler is live and this is the last call on it; `release` was
        // validated when the producer was spawned.
        unsafe { (self.release)(self.handler) };
        let producer = std::mem::replace(&mut self.producer, std::ptr::null_mut());
        // SAFETY: `producer` came from Box::into_raw in `spawn_producer`, and its
        // private_data from Arc::into_raw; the consumer may no longer use either after
        // `release` (spec: the producer cleans up after calling release).
        let producer = unsafe { Box::from_raw(producer) };
        // SAFETY: see above; this drops the strong count the C struct held.
        drop(unsafe { Arc::from_raw(producer.private_data as *const ProducerShared) });
    }
}

impl Drop for Finisher {
    fn drop(&mut self) {
        self.finish();
    }
}

/// How the driver's loop ended.
enum Outcome {
    /// The NULL task was delivered.
    Finished,
    /// `cancel` was called.
    Cancelled,
    /// An error to report with `on_error`.
    Failed(Error),
    /// The consumer returned non-zero: no `on_error`, the error is only for `join`.
    Rejected(Error),
}

struct Driver {
    // Fields drop in this order: the source first, the finisher (release) last.
    source: Option<BoxedArrays>,
    schema: Option<FFI_ArrowSchema>,
    shared: Arc<ProducerShared>,
    handler: *mut ArrowAsyncDeviceStreamHandler,
    on_schema: OnSchema,
    on_next_task: OnNextTask,
    device_type: ArrowDeviceType,
    n_fields: usize,
    finisher: Finisher,
}

// SAFETY: the raw pointers are the consumer's handler (which the spec lets the producer
// call from any thread, serialized — only the driver thread calls it) and the producer
// struct this driver owns; the source stream and schema are Send.
unsafe impl Send for Driver {}

impl Driver {
    fn run(mut self) -> Result<()> {
        // Should `drive` unwind, the finisher reports its pending "stopped unexpectedly".
        let outcome = self.drive();
        self.finisher.pending_error = None;
        let source = self.source.take();
        swallow_panic("while dropping the async producer's source", move || {
            drop(source)
        });
        let result = match outcome {
            Outcome::Finished | Outcome::Cancelled => Ok(()),
            Outcome::Failed(error) => {
                // SAFETY: the handler is live (not yet released) and has this on_error.
                unsafe { report(self.handler, self.finisher.on_error, &error) };
                Err(error)
            }
            Outcome::Rejected(error) => Err(error),
        };
        self.finisher.finish();
        result
    }

    fn drive(&mut self) -> Outcome {
        let mut schema = self.schema.take().unwrap_or_else(FFI_ArrowSchema::empty);
        // SAFETY: the handler is live; `handler->producer` was set before this first call;
        // the schema is valid for the call and the consumer may move it out.
        let rc = unsafe { (self.on_schema)(self.handler, &mut schema) };
        // Releases the schema unless the consumer moved it out.
        drop(schema);
        if rc != 0 {
            return Outcome::Rejected(callback_error("on_schema", rc));
        }
        loop {
            match self.shared.wait() {
                Wait::Serve => {}
                Wait::Cancelled => return Outcome::Cancelled,
                Wait::Invalid(n) => {
                    return Outcome::Failed(Error::InvalidArgument(format!(
                        "ArrowAsyncProducer.request needs n > 0, got {n}"
                    )))
                }
            }
            let array = match self.next_array() {
                Next::Interrupted => continue,
                Next::Item(Err(error)) => return Outcome::Failed(error),
                Next::Item(Ok(array)) => array,
                Next::End => {
                    // SAFETY: the handler is live; a NULL task marks the end of the stream.
                    let rc = unsafe {
                        (self.on_next_task)(self.handler, std::ptr::null_mut(), std::ptr::null())
                    };
                    return match rc {
                        0 => Outcome::Finished,
                        rc => Outcome::Rejected(callback_error("on_next_task", rc)),
                    };
                }
            };
            if let Err(error) = self.check(&array) {
                return Outcome::Failed(error);
            }
            if self.shared.is_cancelled() {
                return Outcome::Cancelled;
            }
            let mut task = new_task(array);
            let id = task.private_data.addr();
            // SAFETY: the handler is live; the task is valid for the duration of the call
            // (the consumer copies it to keep it).
            let rc = unsafe { (self.on_next_task)(self.handler, &mut task, std::ptr::null()) };
            if rc != 0 {
                // The consumer rejected the task: reclaim it unless it was extracted.
                drop(take_task(id));
                return Outcome::Rejected(callback_error("on_next_task", rc));
            }
        }
    }

    /// Polls the source for its next item, giving up when cancelled or on a bad request.
    fn next_array(&mut self) -> Next {
        let Some(source) = self.source.as_mut() else {
            return Next::End;
        };
        let shared = &*self.shared;
        let polled = catch_unwind(AssertUnwindSafe(|| {
            futures::executor::block_on(futures::future::poll_fn(|cx| {
                shared.interrupt.register(cx.waker());
                if shared.interrupted() {
                    return Poll::Ready(Next::Interrupted);
                }
                source.as_mut().poll_next(cx).map(|item| match item {
                    Some(item) => Next::Item(item),
                    None => Next::End,
                })
            }))
        }));
        polled.unwrap_or_else(|payload| {
            // A panicking stream is not polled again.
            let source = self.source.take();
            swallow_panic(
                "while dropping a panicked async producer source",
                move || drop(source),
            );
            Next::Item(Err(Error::from_panic(payload)))
        })
    }

    fn check(&self, array: &DeviceArray) -> Result<()> {
        if array.device_type() != self.device_type {
            return Err(Error::InvalidArgument(format!(
                "the async producer offers {} arrays, but the source yielded one on {}",
                self.device_type,
                array.device_type()
            )));
        }
        if array.array().n_children != self.n_fields as i64 {
            return Err(Error::InvalidArgument(format!(
                "the source yielded a struct array with {} children for a schema of {} fields",
                array.array().n_children,
                self.n_fields
            )));
        }
        Ok(())
    }
}

enum Next {
    Item(Result<DeviceArray>),
    End,
    Interrupted,
}

fn callback_error(operation: &'static str, code: c_int) -> Error {
    Error::Callback {
        operation,
        code,
        message: "the consumer returned an error code".into(),
    }
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
    /// calls `release` without `on_error`. Idempotent.
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

/// Starts an async producer that drives `handler` from `arrays` on a new thread.
///
/// Each item of `arrays` must be a struct array of `schema` (one per record batch) on
/// `device_type`. The producer sets `handler->producer`, calls `on_schema` with `schema`
/// (metadata included), then one `on_next_task` per unit the consumer requests, a NULL
/// task at the end, and `release` last; see the [module documentation](super) for the
/// rules it follows. An `Err` item, a panic in the stream, or an array on another device
/// or with the wrong number of children is reported with `on_error` and ends the stream.
///
/// The handler is taken over in every case: when this function fails after validating
/// it (no mandatory callback missing), it has called `on_error` and `release` already.
/// Fails with [`Error::NullPointer`] for a NULL handler, [`Error::Released`] when it has
/// no `release` callback, and otherwise when the schema cannot be exported or the thread
/// cannot be started.
///
/// # Demand and the end of the stream
///
/// Every `on_next_task` call takes one unit the consumer requested, **including the NULL
/// task that marks the end of the stream**. A consumer that requests exactly the `N`
/// arrays it expects gets them, but not the end (nor the `release` after it): the
/// producer waits for one more unit first. Such a consumer must request `N + 1`, or one
/// more after the last array. ([`async_handler`](super::async_handler)'s consumer
/// requests one more unit per item taken, so it always sees the end.)
///
/// # Cancellation
///
/// After `cancel` (the consumer's, or [`ProducerHandle::cancel`]) the producer stops at
/// once: it stops waiting for demand or for the source, makes no further `on_next_task`
/// call (only one already under way when `cancel` was called may still complete), sends
/// neither the NULL end task nor `on_error`, drops the source and calls `release`.
/// Later `request` and `cancel` calls (before `release`) are no-ops.
///
/// # Safety
/// `handler` must be NULL or point to a valid `ArrowAsyncDeviceStreamHandler` that stays
/// valid until its `release` is called (the producer is its sole user until then).
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
    let shared = Arc::new(ProducerShared::default());
    let producer = Box::into_raw(Box::new(ArrowAsyncProducer {
        device_type,
        request: Some(request),
        cancel: Some(cancel),
        additional_metadata: std::ptr::null(),
        private_data: Arc::into_raw(shared.clone()) as *mut c_void,
    }));
    // SAFETY: the handler is valid and writable; the producer member must be populated
    // before any callback (spec).
    unsafe { (*handler).producer = producer };
    let mut finisher = Finisher {
        handler,
        on_error,
        release,
        producer,
        pending_error: None,
    };
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
        source: Some(Box::pin(arrays.map(|item| item.map_err(Into::into)))),
        schema: Some(ffi_schema),
        shared: shared.clone(),
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
/// cancellation work as [`spawn_producer`] describes.
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
/// As for [`spawn_producer`].
pub unsafe fn produce_record_batches<S, E>(
    schema: SchemaRef,
    batches: S,
    handler: *mut ArrowAsyncDeviceStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<RecordBatch, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    let expected = schema.clone();
    let arrays = batches.map(move |item| {
        let batch = item.map_err(Into::into)?;
        if batch.schema().fields() != expected.fields() {
            return Err(Error::InvalidArgument(format!(
                "record batch fields {:?} do not match the stream's {:?}",
                batch.schema().fields(),
                expected.fields()
            )));
        }
        Ok(cpu::export_batch_array(&batch))
    });
    // SAFETY: forwarded from the caller.
    unsafe { spawn_producer::<_, Error>(schema, ArrowDeviceType::CPU, arrays, handler) }
}

/// [`produce_record_batches`] from an iterator (e.g. a `RecordBatchReader`).
///
/// # Safety
/// As for [`spawn_producer`].
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
