//! Device streams that overlap uploads with the consumer's work.
//!
//! - [`Uploader`] reads an arrow-rs `RecordBatchReader` on a background thread and
//!   uploads its batches to a [`Device`] with a [`Transfer`] of its own, at most
//!   [`StreamOptions::read_ahead`] batches ahead of what the consumer asked for, so that
//!   the upload of batch *k + 1* overlaps the consumer's work on batch *k*. It is an
//!   iterator of [`DeviceBatch`]es, and a [`DeviceBatchSource`]: [`export_reader_to_device`]
//!   exports it as a C `ArrowDeviceArrayStream` of the device's type (e.g.
//!   `ARROW_DEVICE_CUDA` on a `CudaDevice`), each array's `sync_event` marking
//!   its upload.
//! - The async producer ([`UploadStream`](crate::UploadStream)) shares the same upload
//!   pipeline.
//! - [`DeviceStreamReader`] is the consumer side: a (foreign or devarrow) C device stream
//!   as an iterator of device-resident [`DeviceBatch`]es ([`DeviceBatch::import`], each
//!   waited on by event), and [`HostStreamReader`] the same downloaded to arrow-rs
//!   memory (a `RecordBatchReader`).
//!
//! # Read-ahead
//!
//! The bound is on batches pulled from the source: after the consumer asked for `k`
//! batches (`get_next` calls, or polls of the Rust iterator/stream), the source has been
//! pulled at most `k + read_ahead` times. With `read_ahead = 0` nothing is uploaded before
//! it is asked for (no overlap). "Uploaded" means that the copies are *enqueued* on the
//! device (and the staging memory packed); on CUDA they complete asynchronously on the
//! device's stream and the batch's event marks their completion.
//!
//! Device memory in use by a stream is therefore bounded by the batches the consumer
//! holds plus `read_ahead` uploaded ones; staging memory by the transfer's
//! [`TransferOptions::staging_bytes`].
//!
//! On CUDA, give the producer a device with a stream of its own (a `CudaDevice`
//! made for it, e.g. `CudaDevice::new(cuda_device.clone())`), so uploads do not
//! queue behind the consumer's work; the consumer runs its work on its own stream after
//! waiting on each array's `sync_event`. A batch's memory is freed in the order of the
//! upload stream when the consumer releases its array, so (as the specification asks of
//! any consumer) work that reads it must be complete, or ordered before, by then.
//!
//! # Errors and shutdown
//!
//! An error of the source (or of an upload, or a panic in either) is delivered in order,
//! after the batches uploaded before it, and ends the stream: the background thread
//! stops, and drops the source, before the error is delivered. An error that travelled
//! through the reader as a devarrow [`Error`] (in `ArrowError::ExternalError`) keeps its
//! errno. Through the C stream it is the return code of `get_next` (the error's errno:
//! `EIO` for I/O and device errors, `ENOMEM` for out of memory, `EINVAL` otherwise) with
//! the message from `get_last_error`; later `get_next` calls fail again with the same
//! code. Dropping the producer (releasing the C stream) stops the background thread and
//! waits for it: it finishes the source's `next()` or the upload in progress, if any,
//! then drops the source, its staging memory and every batch not handed out.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::{ArrowError, SchemaRef};
use devarrow_abi::boundary::swallow_panic;
use devarrow_abi::device::{check_stream_device, Device};
use devarrow_abi::stream::{export_stream, DeviceBatchSource};
use devarrow_abi::{ArrowDeviceType, DeviceArray, DeviceArrayStream, Error, Result};
use futures::task::AtomicWaker;

use crate::batch::DeviceBatch;
use crate::transfer::{Transfer, TransferOptions};

/// Default number of batches a producer uploads ahead of the consumer: 2.
pub const DEFAULT_READ_AHEAD: usize = 2;

/// Options of the uploading producers ([`Uploader`], [`UploadStream`](crate::UploadStream)).
///
/// `#[non_exhaustive]`: build them from the defaults with the `with_*` methods.
///
/// ```
/// use devarrow_bridge::{StreamOptions, TransferOptions};
///
/// let options = StreamOptions::default()
///     .with_read_ahead(4)
///     .with_transfer(TransferOptions::default().with_staging_bytes(8 << 20));
/// assert_eq!(options.read_ahead, 4);
/// assert_eq!(options.transfer.staging_bytes, 8 << 20);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct StreamOptions {
    /// How many batches the background thread may upload ahead of the consumer's
    /// requests (see the [module documentation](self)); 0 uploads on demand only.
    pub read_ahead: usize,
    /// Options of the background thread's [`Transfer`].
    pub transfer: TransferOptions,
}

impl Default for StreamOptions {
    fn default() -> Self {
        Self {
            read_ahead: DEFAULT_READ_AHEAD,
            transfer: TransferOptions::default(),
        }
    }
}

impl StreamOptions {
    /// These options with `read_ahead` batches of read-ahead.
    pub fn with_read_ahead(mut self, read_ahead: usize) -> Self {
        self.read_ahead = read_ahead;
        self
    }

    /// These options with `transfer` as the background thread's [`TransferOptions`].
    pub fn with_transfer(mut self, transfer: TransferOptions) -> Self {
        self.transfer = transfer;
        self
    }
}

// ---------------------------------------------------------------------------------------
// The upload pipeline shared by the sync and async producers
// ---------------------------------------------------------------------------------------

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the background thread and the consumer side of a [`Pipeline`] share.
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Signalled on every change of `state` (demand, items, end, stop).
    changed: Condvar,
    /// Wakes the background thread while it waits on an async source, on stop.
    stop_waker: AtomicWaker,
    read_ahead: u64,
}

#[derive(Default)]
struct State {
    /// Uploaded (or failed) items not yet taken by the consumer, in source order.
    queue: VecDeque<Result<DeviceBatch>>,
    /// Items the consumer asked for so far.
    requested: u64,
    /// Times the background thread pulled the source.
    pulled: u64,
    /// The background thread is done: nothing more will be queued.
    finished: bool,
    /// The consumer is gone: the background thread must stop.
    stopped: bool,
    /// The task of an async consumer waiting for an item.
    consumer_waker: Option<Waker>,
}

impl State {
    fn wake_consumer(&mut self) {
        if let Some(waker) = self.consumer_waker.take() {
            waker.wake();
        }
    }
}

impl Shared {
    /// Blocks until the source may be pulled once more (and counts the pull), or returns
    /// `false` when the consumer is gone.
    fn wait_for_demand(&self) -> bool {
        let mut state = lock(&self.state);
        loop {
            if state.stopped {
                return false;
            }
            if state.pulled < state.requested.saturating_add(self.read_ahead) {
                state.pulled += 1;
                return true;
            }
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn push(&self, item: Result<DeviceBatch>) {
        let mut state = lock(&self.state);
        if state.stopped {
            drop(state);
            drop(item);
            return;
        }
        state.queue.push_back(item);
        state.wake_consumer();
        drop(state);
        self.changed.notify_all();
    }

    fn finish(&self) {
        let mut state = lock(&self.state);
        state.finished = true;
        state.wake_consumer();
        drop(state);
        self.changed.notify_all();
    }

    /// Whether the consumer is gone.
    pub(crate) fn is_stopped(&self) -> bool {
        lock(&self.state).stopped
    }

    /// Registers the background thread's task, woken when the consumer goes away.
    pub(crate) fn register_stop(&self, waker: &Waker) {
        self.stop_waker.register(waker);
    }

    fn stop(&self) {
        let queued = {
            let mut state = lock(&self.state);
            state.stopped = true;
            std::mem::take(&mut state.queue)
        };
        self.changed.notify_all();
        self.stop_waker.wake();
        drop(queued);
    }
}

/// Pulls the next host batch from a producer's source (`None` at the end, or when the
/// consumer is gone).
pub(crate) type Pull = Box<dyn FnMut(&Shared) -> Option<Result<RecordBatch>> + Send>;

/// Marks the pipeline finished when the background thread ends, however it ends.
struct FinishGuard(Arc<Shared>);

impl Drop for FinishGuard {
    fn drop(&mut self) {
        self.0.finish();
    }
}

fn upload(transfer: &mut Transfer, schema: &SchemaRef, batch: &RecordBatch) -> Result<DeviceBatch> {
    if batch.schema().fields() != schema.fields() {
        return Err(Error::InvalidArgument(format!(
            "the source produced a batch of schema {} but its schema is {}",
            batch.schema(),
            schema
        )));
    }
    transfer.to_device(batch)
}

/// The background thread: pull, upload, queue, as long as there is demand.
fn work(
    shared: Arc<Shared>,
    mut pull: Pull,
    device: Arc<dyn Device>,
    options: TransferOptions,
    schema: SchemaRef,
) {
    let _finish = FinishGuard(shared.clone());
    let mut transfer = Transfer::new(device, options);
    let mut failure = None;
    while shared.wait_for_demand() {
        let item = match catch_unwind(AssertUnwindSafe(|| pull(&shared))) {
            Ok(None) => break,
            Ok(Some(Ok(batch))) => {
                catch_unwind(AssertUnwindSafe(|| upload(&mut transfer, &schema, &batch)))
                    .unwrap_or_else(|payload| Err(Error::from_panic(payload)))
            }
            Ok(Some(Err(error))) => Err(error),
            Err(payload) => Err(Error::from_panic(payload)),
        };
        match item {
            Ok(batch) => shared.push(Ok(batch)),
            Err(error) => {
                failure = Some(error);
                break;
            }
        }
    }
    // The source and the staging memory go before the consumer sees the end or the error.
    swallow_panic("while dropping a device stream's source", move || {
        drop(pull)
    });
    swallow_panic("while dropping a device stream's transfer", move || {
        drop(transfer)
    });
    if let Some(error) = failure {
        shared.push(Err(error));
    }
}

/// The consumer side of an upload pipeline: a background thread that pulls host batches
/// and uploads them, bounded by the read-ahead.
pub(crate) struct Pipeline {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    schema: SchemaRef,
    device: Arc<dyn Device>,
    /// The current request was counted (and not yet served).
    asked: bool,
    /// The end or an error was delivered: nothing more comes.
    done: bool,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = lock(&self.shared.state);
        f.debug_struct("Pipeline")
            .field("device", &self.device)
            .field("read_ahead", &self.shared.read_ahead)
            .field("queued", &state.queue.len())
            .field("requested", &state.requested)
            .field("pulled", &state.pulled)
            .field("finished", &state.finished)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Pipeline {
    /// Starts the background thread, which begins uploading at once.
    pub(crate) fn spawn(
        schema: SchemaRef,
        pull: Pull,
        device: Arc<dyn Device>,
        options: StreamOptions,
    ) -> Result<Self> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop_waker: AtomicWaker::new(),
            read_ahead: u64::try_from(options.read_ahead).unwrap_or(u64::MAX),
        });
        let worker = {
            let (shared, device, schema) = (shared.clone(), device.clone(), schema.clone());
            std::thread::Builder::new()
                .name("devarrow-upload".into())
                .spawn(move || work(shared, pull, device, options.transfer, schema))
                .map_err(|e| {
                    Error::Arrow(ArrowError::IoError(
                        format!("cannot start the upload thread: {e}"),
                        e,
                    ))
                })?
        };
        Ok(Self {
            shared,
            worker: Some(worker),
            schema,
            device,
            asked: false,
            done: false,
        })
    }

    pub(crate) fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    pub(crate) fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Counts the consumer's request for the next item, once per item.
    fn ask(&mut self) {
        if !self.asked {
            self.asked = true;
            lock(&self.shared.state).requested += 1;
            self.shared.changed.notify_all();
        }
    }

    /// The next item if there is one, `Some(None)` at the end, `None` to wait.
    fn take(state: &mut State) -> Option<Option<Result<DeviceBatch>>> {
        match state.queue.pop_front() {
            Some(item) => Some(Some(item)),
            None if state.finished => Some(None),
            None => None,
        }
    }

    /// Notes what was taken: the request is served; an error or the end is the last item.
    fn settle(&mut self, item: Option<Result<DeviceBatch>>) -> Option<Result<DeviceBatch>> {
        self.asked = false;
        if !matches!(item, Some(Ok(_))) {
            self.done = true;
        }
        item
    }

    /// The next uploaded batch, blocking until it is uploaded; `None` at the end and
    /// after an error.
    pub(crate) fn next_blocking(&mut self) -> Option<Result<DeviceBatch>> {
        if self.done {
            return None;
        }
        self.ask();
        let shared = self.shared.clone();
        let mut state = lock(&shared.state);
        loop {
            if let Some(item) = Self::take(&mut state) {
                drop(state);
                return self.settle(item);
            }
            state = shared
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Polls for the next uploaded batch without blocking.
    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<DeviceBatch>>> {
        if self.done {
            return Poll::Ready(None);
        }
        self.ask();
        let shared = self.shared.clone();
        let mut state = lock(&shared.state);
        match Self::take(&mut state) {
            Some(item) => {
                drop(state);
                Poll::Ready(self.settle(item))
            }
            None => {
                if !state
                    .consumer_waker
                    .as_ref()
                    .is_some_and(|w| w.will_wake(cx.waker()))
                {
                    state.consumer_waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.shared.stop();
        if let Some(worker) = self.worker.take() {
            // The thread catches every panic of the source and the uploads itself.
            let _ = worker.join();
        }
    }
}

// ---------------------------------------------------------------------------------------
// The device stream producer
// ---------------------------------------------------------------------------------------

/// Uploads the batches of a `RecordBatchReader` to a device on a background thread,
/// ahead of the consumer (see the [module documentation](self)).
///
/// An iterator of [`DeviceBatch`]es (which ends after the first error), and a
/// [`DeviceBatchSource`] for [`export_stream`] (whose `get_next` keeps failing after the
/// first error, with its errno code and message).
#[derive(Debug)]
pub struct Uploader {
    pipeline: Pipeline,
    /// The errno and message of the error that ended the C stream, repeated unchanged by
    /// later `get_next` calls ([`Error::Repeated`]).
    failure: Option<(i32, String)>,
}

impl Uploader {
    /// Starts uploading `reader`'s batches to `device`; the first `options.read_ahead`
    /// are uploaded right away. Fails only when the thread cannot be started.
    pub fn spawn(
        reader: Box<dyn RecordBatchReader + Send>,
        device: Arc<dyn Device>,
        options: StreamOptions,
    ) -> Result<Self> {
        let schema = reader.schema();
        let mut reader = reader;
        let pull: Pull = Box::new(move |_| reader.next().map(|item| item.map_err(Error::from)));
        Ok(Self {
            pipeline: Pipeline::spawn(schema, pull, device, options)?,
            failure: None,
        })
    }

    /// The reader's schema.
    pub fn schema(&self) -> SchemaRef {
        self.pipeline.schema()
    }

    /// The device the batches are uploaded to.
    pub fn device(&self) -> &Arc<dyn Device> {
        self.pipeline.device()
    }

    /// The next uploaded batch (blocking until its upload is enqueued); `Ok(None)` at the
    /// end and after an error.
    pub fn next_batch(&mut self) -> Result<Option<DeviceBatch>> {
        self.pipeline.next_blocking().transpose()
    }
}

impl Iterator for Uploader {
    type Item = Result<DeviceBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        self.pipeline.next_blocking()
    }
}

impl DeviceBatchSource for Uploader {
    fn schema(&self) -> SchemaRef {
        self.pipeline.schema()
    }

    fn device_type(&self) -> ArrowDeviceType {
        self.pipeline.device().device_type()
    }

    fn next_array(&mut self) -> Option<Result<DeviceArray>> {
        if let Some((code, message)) = &self.failure {
            // The same errno and message as the first failure: it is ours, not a peer's.
            return Some(Err(Error::Repeated {
                code: *code,
                message: message.clone(),
            }));
        }
        let item = self
            .pipeline
            .next_blocking()?
            .and_then(|batch| batch.export().map(|(array, _schema)| array));
        if let Err(error) = &item {
            self.failure = Some((error.errno(), error.to_string()));
        }
        Some(item)
    }
}

/// Exports `reader` as a C device stream on `device` (`ArrowDeviceArrayStream` of the
/// device's type), uploading ahead on a background thread as [`Uploader`] does. Move it
/// to the consumer with [`DeviceArrayStream::move_into`] or
/// [`DeviceArrayStream::into_raw`]; its release stops the thread.
///
/// # Example
///
/// Upload a reader's batches ahead of the consumer, hand the stream over as an
/// `ArrowDeviceArrayStream`, and read it back to the host on the other side:
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, Int32Array, RecordBatch, RecordBatchIterator};
/// use devarrow_abi::device::{CpuDevice, Device};
/// use devarrow_bridge::{
///     export_reader_to_device, DeviceStreamReader, StreamOptions, TransferOptions,
/// };
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let batch = RecordBatch::try_from_iter([
///     ("x", Arc::new(Int32Array::from_iter_values(0..100)) as ArrayRef),
/// ])?;
/// let batches = vec![Ok(batch.slice(0, 50)), Ok(batch.slice(50, 50))];
/// let reader = RecordBatchIterator::new(batches, batch.schema());
/// let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
///
/// // Producer side: read ahead by 2 batches (back-pressure beyond that).
/// let options = StreamOptions::default().with_read_ahead(2);
/// let stream = export_reader_to_device(Box::new(reader), device.clone(), options)?;
///
/// // Consumer side: device batches, or host batches as here.
/// let host = DeviceStreamReader::try_new(stream, device)?.into_host(TransferOptions::default());
/// let back = host.collect::<Result<Vec<_>, _>>()?;
/// assert_eq!(back, [batch.slice(0, 50), batch.slice(50, 50)]);
/// # Ok(())
/// # }
/// ```
pub fn export_reader_to_device(
    reader: Box<dyn RecordBatchReader + Send>,
    device: Arc<dyn Device>,
    options: StreamOptions,
) -> Result<DeviceArrayStream> {
    Ok(export_stream(Uploader::spawn(reader, device, options)?))
}

// ---------------------------------------------------------------------------------------
// The device stream consumer
// ---------------------------------------------------------------------------------------

/// Reads a (foreign or devarrow) C device stream as an iterator of device-resident
/// [`DeviceBatch`]es on `device`, zero-copy ([`DeviceBatch::import`]).
///
/// Each batch is waited on by event: the import makes `device`'s stream wait on the
/// array's `sync_event` (without blocking the host) and the batch's
/// [`DeviceBatch::event`] is recorded after that wait, so work enqueued on `device`'s
/// stream sees the data, and work on another stream must wait on the batch's event. A
/// batch keeps its array (unreleased) until it is dropped; the C stream may be released
/// before its batches.
///
/// After the first error (of `get_next` or of an import) or the end, it yields nothing
/// more. [`DeviceStreamReader::into_host`] downloads each batch to arrow-rs memory.
#[derive(Debug)]
pub struct DeviceStreamReader {
    stream: DeviceArrayStream,
    schema: SchemaRef,
    device: Arc<dyn Device>,
    done: bool,
}

impl DeviceStreamReader {
    /// Reads the stream's schema. Fails when `device` cannot import arrays of the
    /// stream's device type ([`Error::UnsupportedDevice`]), or `get_schema` fails (the
    /// stream is then released).
    pub fn try_new(mut stream: DeviceArrayStream, device: Arc<dyn Device>) -> Result<Self> {
        check_stream_device(device.as_ref(), stream.device_type())?;
        let ffi = stream.schema()?;
        let schema = Arc::new(devarrow_abi::schema::import_schema(&ffi)?);
        Ok(Self {
            stream,
            schema,
            device,
            done: false,
        })
    }

    /// Moves a foreign stream out of `ptr` (marking it released) and reads its schema.
    ///
    /// # Safety
    /// `ptr` must be NULL or point to a valid, writable `ArrowDeviceArrayStream`.
    pub unsafe fn from_raw(
        ptr: *mut devarrow_abi::ArrowDeviceArrayStream,
        device: Arc<dyn Device>,
    ) -> Result<Self> {
        // SAFETY: forwarded to the caller.
        let stream = unsafe { DeviceArrayStream::from_raw(ptr)? };
        Self::try_new(stream, device)
    }

    /// The stream's schema (with its metadata).
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The device the batches are imported on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The stream's device type.
    pub fn device_type(&self) -> ArrowDeviceType {
        self.stream.device_type()
    }

    /// The next batch: `Ok(None)` at the end, and after an error.
    pub fn next_batch(&mut self) -> Result<Option<DeviceBatch>> {
        if self.done {
            return Ok(None);
        }
        let result = self.stream.next_array().and_then(|array| {
            array
                .map(|array| DeviceBatch::import(self.device.clone(), array, self.schema.clone()))
                .transpose()
        });
        if !matches!(result, Ok(Some(_))) {
            self.done = true;
        }
        result
    }

    /// Downloads every batch to host memory with a [`Transfer`] of `options`: an arrow-rs
    /// `RecordBatchReader`.
    pub fn into_host(self, options: TransferOptions) -> HostStreamReader {
        let transfer = Transfer::new(self.device.clone(), options);
        HostStreamReader {
            inner: self,
            transfer,
        }
    }
}

impl Iterator for DeviceStreamReader {
    type Item = Result<DeviceBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().transpose()
    }
}

/// A C device stream read through [`DeviceStreamReader`] and downloaded batch by batch
/// ([`Transfer::to_host`], which waits for the batch's event): an arrow-rs
/// `RecordBatchReader` whose errors are devarrow [`Error`]s in
/// `ArrowError::ExternalError` (or the `ArrowError` itself).
#[derive(Debug)]
pub struct HostStreamReader {
    inner: DeviceStreamReader,
    transfer: Transfer,
}

impl HostStreamReader {
    /// The next batch in host memory: `Ok(None)` at the end, and after an error.
    pub fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        let Some(batch) = self.inner.next_batch()? else {
            return Ok(None);
        };
        let result = self.transfer.to_host(&batch);
        if result.is_err() {
            self.inner.done = true;
        }
        result.map(Some)
    }

    /// The device reader underneath.
    pub fn device_reader(&self) -> &DeviceStreamReader {
        &self.inner
    }
}

impl Iterator for HostStreamReader {
    type Item = std::result::Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().map_err(ArrowError::from).transpose()
    }
}

impl RecordBatchReader for HostStreamReader {
    fn schema(&self) -> SchemaRef {
        self.inner.schema()
    }
}
