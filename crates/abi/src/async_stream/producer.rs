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

use super::{lock, AsyncStreamHandler, WithMetadata};
use crate::boundary::{catch_panic, swallow_panic};
use crate::cpu;
use crate::device_array::DeviceArray;
use crate::error::{Error, Result};
use crate::ffi::{
    ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask, ArrowDeviceArray,
    ArrowDeviceType, ArrowSchema,
};
use crate::metadata::Metadata;

// ---------------------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------------------

/// Ids of tasks; 0 is never used, so a task's `private_data` is never NULL before
/// extraction.
static NEXT_TASK_ID: AtomicUsize = AtomicUsize::new(1);

/// A task not yet extracted: its array, and the producer that handed it out, kept alive
/// until the task is extracted (or reclaimed after a refusal).
struct PendingTask {
    array: DeviceArray,
    _producer: Option<Arc<ProducerShared>>,
}

/// The tasks not yet extracted, by id.
fn pending_tasks() -> &'static Mutex<HashMap<usize, PendingTask>> {
    static TASKS: OnceLock<Mutex<HashMap<usize, PendingTask>>> = OnceLock::new();
    TASKS.get_or_init(Default::default)
}

/// Wraps a device array in an `ArrowAsyncTask` whose `extract_data` hands it over exactly
/// once: into `out`, or released when `out` is NULL.
///
/// The task's `private_data` is an id in a process-wide registry, not a pointer, so the
/// task struct may be copied freely and outlives any producer. A second `extract_data` on
/// the task or on any copy of it returns `EINVAL` and touches nothing; so does one on a
/// struct whose `private_data` was not made here. A task made here (not by a producer)
/// that is never extracted keeps its array alive until the process ends.
pub fn new_task(array: DeviceArray) -> ArrowAsyncTask {
    register_task(array, None)
}

/// [`new_task`], keeping `producer` (its `ArrowAsyncProducer` struct included) alive until
/// the task is extracted or reclaimed.
fn register_task(array: DeviceArray, producer: Option<Arc<ProducerShared>>) -> ArrowAsyncTask {
    let id = NEXT_TASK_ID.fetch_add(1, Ordering::Relaxed);
    lock(pending_tasks()).insert(
        id,
        PendingTask {
            array,
            _producer: producer,
        },
    );
    ArrowAsyncTask {
        extract_data: Some(extract_data),
        private_data: std::ptr::without_provenance_mut(id),
    }
}

/// Removes a task from the registry (`None` when already extracted). The caller drops it
/// outside the registry's lock: that releases its array (a foreign callback) and maybe
/// the last reference to its producer.
fn take_task(id: usize) -> Option<PendingTask> {
    lock(pending_tasks()).remove(&id)
}

/// Removes every task that `producer` handed out and that is not extracted yet, and
/// releases their arrays (outside the registry's lock); returns how many there were. A
/// later `extract_data` on one of them finds nothing and returns `EINVAL`.
fn reclaim_tasks_of(producer: &Arc<ProducerShared>) -> usize {
    let reclaimed: Vec<PendingTask> = {
        let mut tasks = lock(pending_tasks());
        let ids: Vec<usize> = tasks
            .iter()
            .filter(|(_, task)| {
                task._producer
                    .as_ref()
                    .is_some_and(|p| Arc::ptr_eq(p, producer))
            })
            .map(|(id, _)| *id)
            .collect();
        ids.iter().filter_map(|id| tasks.remove(id)).collect()
    };
    let n = reclaimed.len();
    swallow_panic(
        "while releasing the reclaimed tasks of a failed async stream",
        move || drop(reclaimed),
    );
    n
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
        let pending = take_task(id.addr()).ok_or_else(|| {
            Error::InvalidArgument(
                "extract_data called on a task that was already extracted (or not made by \
                 this producer)"
                    .into(),
            )
        })?;
        if out.is_null() {
            drop(pending.array);
        } else {
            // SAFETY: a non-null `out` is a consumer-allocated, writable ArrowDeviceArray
            // (spec: extract_data); ownership of the array moves into it.
            unsafe { pending.array.move_into(out) };
        }
        // `pending._producer` drops here, after the array moved: the producer struct may
        // be freed now, but this call no longer needs it.
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

type BoxedItems = Pin<Box<dyn Stream<Item = Result<WithMetadata<DeviceArray>>> + Send>>;

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
/// unwinds: `on_error` when an error is pending, then `release`. The producer struct is
/// not freed here: it lives as long as its [`ProducerShared`], which the driver, the
/// [`ProducerHandle`] and every task not yet extracted hold.
struct Finisher {
    handler: *mut ArrowAsyncDeviceStreamHandler,
    on_error: OnError,
    release: Release,
    shared: Arc<ProducerShared>,
    released: bool,
    /// Reported with `on_error` before `release`.
    pending_error: Option<Error>,
    /// The stream failed (an error was reported, or the consumer returned non-zero): the
    /// tasks not extracted by now are reclaimed before `release`.
    failed: bool,
}

impl Finisher {
    fn finish(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        if let Some(error) = self.pending_error.take() {
            self.failed = true;
            // SAFETY: the handler is live until `release` below; it was validated to have
            // this `on_error` when the producer was spawned.
            unsafe { report(self.handler, self.on_error, &error) };
        }
        if self.failed {
            // After `on_error` (a consumer may extract its queued tasks there, as
            // devarrow's does), before `release`: a consumer that drops its queue on an
            // error without extracting (Arrow C++'s) would leak them otherwise. See the
            // module documentation, "Tasks a consumer never extracts".
            reclaim_tasks_of(&self.shared);
        }
        // From here on `request` and `cancel` are no-ops (a consumer may still call them
        // while it holds tasks, as Arrow C++'s does).
        self.shared.finish();
        // SAFETY: the handler is live and this is the last call on it; `release` was
        // validated when the producer was spawned.
        unsafe { (self.release)(self.handler) };
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
    source: Option<BoxedItems>,
    schema: Option<FFI_ArrowSchema>,
    handler: *mut ArrowAsyncDeviceStreamHandler,
    on_schema: OnSchema,
    on_next_task: OnNextTask,
    device_type: ArrowDeviceType,
    n_fields: usize,
    finisher: Finisher,
}

// SAFETY: the raw pointer is the consumer's handler, which the spec lets the producer
// call from any thread, serialized (only the driver thread calls it); the source stream,
// the schema and the shared state are Send.
unsafe impl Send for Driver {}

impl Driver {
    fn shared(&self) -> &ProducerShared {
        &self.finisher.shared
    }

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
                self.finisher.failed = true;
                Err(error)
            }
            Outcome::Rejected(error) => {
                self.finisher.failed = true;
                Err(error)
            }
        };
        self.finisher.finish();
        result
    }

    fn stopped(wait: Wait) -> Option<Outcome> {
        match wait {
            Wait::Serve => None,
            Wait::Cancelled => Some(Outcome::Cancelled),
            Wait::Invalid(n) => Some(Outcome::Failed(Error::InvalidArgument(format!(
                "ArrowAsyncProducer.request needs n > 0, got {n}"
            )))),
        }
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
            // The source is polled before waiting for demand (one item ahead of it, as
            // Arrow C++'s producer does), so that its end is found and sent without a
            // request.
            let next = self.next_item();
            if let Some(outcome) = self.shared().stop().and_then(Self::stopped) {
                return outcome;
            }
            let item = match next {
                // Only when stopped, handled above.
                Next::Interrupted => continue,
                Next::Item(Err(error)) => return Outcome::Failed(error),
                Next::Item(Ok(item)) => item,
                Next::End => {
                    // SAFETY: the handler is live; a NULL task marks the end of the stream
                    // (it takes no requested unit).
                    let rc = unsafe {
                        (self.on_next_task)(self.handler, std::ptr::null_mut(), std::ptr::null())
                    };
                    return match rc {
                        0 => Outcome::Finished,
                        rc => Outcome::Rejected(callback_error("on_next_task", rc)),
                    };
                }
            };
            if let Err(error) = self.check(&item.data) {
                return Outcome::Failed(error);
            }
            let metadata = match encode_optional(&item.metadata) {
                Ok(metadata) => metadata,
                Err(error) => return Outcome::Failed(error),
            };
            if let Some(outcome) = Self::stopped(self.shared().wait()) {
                return outcome;
            }
            let mut task = register_task(item.data, Some(self.finisher.shared.clone()));
            let id = task.private_data.addr();
            let metadata_ptr = metadata
                .as_ref()
                .map_or(std::ptr::null(), |m| m.as_ptr().cast::<c_char>());
            // SAFETY: the handler is live; the task and the metadata are valid for the
            // duration of the call (the consumer copies them to keep them).
            let rc = unsafe { (self.on_next_task)(self.handler, &mut task, metadata_ptr) };
            if rc != 0 {
                // The consumer refused the task, so it is still ours (see the module's
                // protocol decisions): reclaim it. Should the consumer have extracted it
                // anyway, the registry finds nothing and nothing is freed twice.
                drop(take_task(id));
                return Outcome::Rejected(callback_error("on_next_task", rc));
            }
        }
    }

    /// Polls the source for its next item, giving up when cancelled or on a bad request.
    fn next_item(&mut self) -> Next {
        let Some(source) = self.source.as_mut() else {
            return Next::End;
        };
        let shared = &*self.finisher.shared;
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
    Item(Result<WithMetadata<DeviceArray>>),
    End,
    Interrupted,
}

/// The C encoding of `metadata`, `None` (NULL) when it is empty.
fn encode_optional(metadata: &Metadata) -> Result<Option<Box<[u8]>>> {
    if metadata.is_empty() {
        return Ok(None);
    }
    metadata.encode().map(|m| Some(m.into_boxed_slice()))
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
