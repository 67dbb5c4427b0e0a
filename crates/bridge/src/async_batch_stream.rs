//! The async device stream on a device: uploads from a Rust [`futures::Stream`] of record
//! batches, ahead of the consumer and off the executor's threads.
//!
//! - [`UploadStream`]: a [`futures::Stream`] of [`DeviceBatch`]es uploaded on a
//!   background thread from a [`futures::Stream`] of `RecordBatch`es, with the bounded
//!   read-ahead of [`crate::batch_stream`] (polling it never blocks on an upload).
//! - [`spawn_device_producer`] / [`spawn_device_producer_into`]: drive a (foreign or
//!   devarrow) `ArrowAsyncDeviceStreamHandler` with those batches, exported as device
//!   arrays whose `sync_event` marks their upload, through
//!   [`devarrow_abi::async_stream::spawn_producer`]: the consumer's `request(n)` is the
//!   back-pressure (the producer polls the upload stream for requested tasks, and one
//!   batch ahead of them to see the end without a request), and uploads run at most
//!   `read_ahead + 1` batches ahead of those requests.
//! - [`device_batch_handler`]: the consumer side, a handler whose producer's arrays
//!   arrive as a [`futures::Stream`] of [`DeviceBatch`]es on a device
//!   ([`AsyncDeviceBatchStream`]), imported zero-copy off the executor's threads, and
//!   optionally downloaded to record batches ([`AsyncHostBatchStream`]).
//!
//! # arrow-rs async streams
//!
//! Both ends speak arrow-rs's [`RecordBatchStream`]
//! (`arrow_array::nonblocking::RecordBatchStream`: a [`futures::Stream`] of
//! `Result<RecordBatch, ArrowError>` with a `schema()`, the shape of DataFusion's
//! `SendableRecordBatchStream`):
//!
//! - [`UploadStream::from_record_batch_stream`] uploads one, boxed as
//!   `Pin<Box<dyn RecordBatchStream + Send>>` or any other `Pin<Box<S>>`, taking the
//!   schema from the trait (any other stream of record batches goes to
//!   [`UploadStream::spawn`] with its schema).
//! - [`AsyncHostBatchStream::ready`] waits for the producer's schema and returns a
//!   [`HostRecordBatchStream`], which implements the trait.
//!
//! Why a `ready().await` step rather than implementing the trait on
//! [`AsyncHostBatchStream`] itself: the trait's `schema()` is synchronous and returns a
//! reference, but an async consumer learns the schema only when the producer calls
//! `on_schema`, some time after the handler was handed over (and a producer may fail
//! before that). Implemented on the stream that may not have it yet, `schema()` would have
//! to block the executor's thread, panic, or return a placeholder that the batches then
//! contradict. Waiting once, asynchronously, for the schema (or the producer's error,
//! returned by `ready`) gives a type whose `schema()` is always the producer's, never
//! blocks and never fails; it costs one `await` before the first batch, which a consumer
//! waits for anyway.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use arrow_array::nonblocking::RecordBatchStream;
use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, SchemaRef};
use devarrow_abi::async_stream::{
    async_handler, spawn_producer, AsyncDeviceArrayStream, AsyncStreamHandler, ProducerHandle,
};
use devarrow_abi::device::Device;
use devarrow_abi::{ArrowAsyncDeviceStreamHandler, DeviceArray, Error, Result};
use futures::{FutureExt, Stream, StreamExt};

use crate::batch::DeviceBatch;
use crate::batch_stream::{Pipeline, Pull, StreamOptions};
use crate::transfer::{Transfer, TransferOptions};

/// Record batches from a [`futures::Stream`] uploaded to a device on a background
/// thread, as a [`futures::Stream`] of [`DeviceBatch`]es.
///
/// The source stream is polled on the background thread (with its own executor,
/// `futures::executor::block_on`), at most `read_ahead` items ahead of the polls of this
/// stream; it must therefore not need to be polled from a particular runtime. The
/// stream ends after its first error (of the source, of an upload, or a panic in
/// either). Dropping it stops the background thread (interrupting a pending poll of the
/// source) and waits for it.
#[derive(Debug)]
pub struct UploadStream {
    pipeline: Pipeline,
}

impl UploadStream {
    /// Starts uploading `batches` (each of `schema`'s fields) to `device`; the first
    /// `options.read_ahead` are uploaded right away. Fails only when the thread cannot be
    /// started.
    pub fn spawn<S, E>(
        schema: SchemaRef,
        batches: S,
        device: Arc<dyn Device>,
        options: StreamOptions,
    ) -> Result<Self>
    where
        S: Stream<Item = Result<RecordBatch, E>> + Send + 'static,
        E: Into<Error> + 'static,
    {
        let mut batches = Box::pin(batches);
        let pull: Pull = Box::new(move |shared| {
            futures::executor::block_on(futures::future::poll_fn(|cx| {
                shared.register_stop(cx.waker());
                if shared.is_stopped() {
                    return Poll::Ready(None);
                }
                batches
                    .as_mut()
                    .poll_next(cx)
                    .map(|item| item.map(|item| item.map_err(Into::into)))
            }))
        });
        Ok(Self {
            pipeline: Pipeline::spawn(schema, pull, device, options)?,
        })
    }

    /// Starts uploading the batches of an arrow-rs [`RecordBatchStream`] to `device`, as
    /// [`UploadStream::spawn`] does with the stream's own `schema()`: DataFusion's
    /// `SendableRecordBatchStream` (`Pin<Box<dyn RecordBatchStream + Send>>`) goes in as
    /// it is, a stream of a concrete type through `Box::pin`.
    ///
    /// The read-ahead and the back-pressure are [`UploadStream::spawn`]'s: the source is
    /// polled for at most `options.read_ahead` batches beyond those this stream was
    /// polled for. An error of the source is delivered (as a devarrow [`Error`], the
    /// conversion of the `ArrowError`, which keeps the errno of a devarrow error that
    /// travelled inside it) after the batches before it, and ends the stream; the source
    /// is dropped, and every upload not handed out freed, before it is delivered. Fails
    /// only when the thread cannot be started.
    ///
    /// ```
    /// use std::pin::Pin;
    /// use std::sync::Arc;
    /// use std::task::{Context, Poll};
    ///
    /// use arrow_array::nonblocking::RecordBatchStream;
    /// use arrow_array::{ArrayRef, Int64Array, RecordBatch};
    /// use arrow_schema::{ArrowError, SchemaRef};
    /// use devarrow_abi::device::CpuDevice;
    /// use devarrow_bridge::{StreamOptions, Transfer, TransferOptions, UploadStream};
    /// use futures::stream::{self, BoxStream};
    /// use futures::{Stream, StreamExt};
    ///
    /// /// A stream with its schema, as an engine hands it over.
    /// struct WithSchema(SchemaRef, BoxStream<'static, Result<RecordBatch, ArrowError>>);
    ///
    /// impl Stream for WithSchema {
    ///     type Item = Result<RecordBatch, ArrowError>;
    ///     fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
    ///         self.1.poll_next_unpin(cx)
    ///     }
    /// }
    ///
    /// impl RecordBatchStream for WithSchema {
    ///     fn schema(&self) -> &SchemaRef {
    ///         &self.0
    ///     }
    /// }
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let batch = RecordBatch::try_from_iter([(
    ///     "x",
    ///     Arc::new(Int64Array::from_iter_values(0..100)) as ArrayRef,
    /// )])?;
    /// let batches = vec![Ok(batch.clone()), Ok(batch.slice(10, 5))];
    /// let source: Pin<Box<dyn RecordBatchStream + Send>> =
    ///     Box::pin(WithSchema(batch.schema(), stream::iter(batches).boxed()));
    ///
    /// let device = Arc::new(CpuDevice::new());
    /// let options = StreamOptions::default().with_read_ahead(2);
    /// let uploads = UploadStream::from_record_batch_stream(source, device.clone(), options)?;
    /// assert_eq!(uploads.schema(), batch.schema());
    ///
    /// let mut transfer = Transfer::new(device, TransferOptions::default());
    /// let on_device: Vec<_> = futures::executor::block_on(uploads.collect::<Vec<_>>());
    /// assert_eq!(on_device.len(), 2);
    /// assert_eq!(transfer.to_host(on_device[1].as_ref().unwrap())?, batch.slice(10, 5));
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_record_batch_stream<S>(
        batches: Pin<Box<S>>,
        device: Arc<dyn Device>,
        options: StreamOptions,
    ) -> Result<Self>
    where
        S: RecordBatchStream + Send + ?Sized + 'static,
    {
        let schema = batches.schema().clone();
        Self::spawn(schema, batches, device, options)
    }

    /// The schema of the batches.
    pub fn schema(&self) -> SchemaRef {
        self.pipeline.schema()
    }

    /// The device the batches are uploaded to.
    pub fn device(&self) -> &Arc<dyn Device> {
        self.pipeline.device()
    }

    /// The stream of the exported device arrays (struct arrays, `sync_event` set), as
    /// [`spawn_producer`] takes them.
    pub fn into_device_arrays(self) -> impl Stream<Item = Result<DeviceArray>> + Send + 'static {
        self.map(|item| item.and_then(|batch| batch.export().map(|(array, _schema)| array)))
    }
}

impl Stream for UploadStream {
    type Item = Result<DeviceBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.pipeline.poll_next(cx)
    }
}

/// Starts an async producer on `device`: uploads `batches` as [`UploadStream`] does and
/// drives `handler` with them through [`spawn_producer`] (see its documentation for the
/// protocol: `on_schema`, one `on_next_task` per requested unit, a NULL task at the end
/// (requested or not; the producer takes one batch ahead of the demand to see it),
/// `on_error` for an error of the source or of an upload, `release` last).
///
/// An arrow-rs [`RecordBatchStream`] goes in with its own `schema()` (`stream.schema().clone()`
/// as `schema`).
///
/// The handler is taken over in every case once it is validated: should the upload
/// thread fail to start, the handler is told so with `on_error` when it first requests
/// data (and [`ProducerHandle::join`] returns the error).
///
/// # Safety
/// As for [`spawn_producer`]: `handler` must be NULL or point to a valid
/// `ArrowAsyncDeviceStreamHandler` that stays valid until its `release` is called.
pub unsafe fn spawn_device_producer<S, E>(
    schema: SchemaRef,
    batches: S,
    device: Arc<dyn Device>,
    options: StreamOptions,
    handler: *mut ArrowAsyncDeviceStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<RecordBatch, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    let device_type = device.device_type();
    let arrays = match UploadStream::spawn(schema.clone(), batches, device, options) {
        Ok(uploads) => uploads.into_device_arrays().left_stream(),
        Err(error) => futures::stream::once(futures::future::ready(Err(error))).right_stream(),
    };
    // SAFETY: forwarded from the caller.
    unsafe { spawn_producer::<_, Error>(schema, device_type, arrays, handler) }
}

/// [`spawn_device_producer`] into a handler made by
/// [`devarrow_abi::async_stream::async_handler`] (or this crate's consumer): safe, since
/// such a handler stays valid until its `release`.
pub fn spawn_device_producer_into<S, E>(
    schema: SchemaRef,
    batches: S,
    device: Arc<dyn Device>,
    options: StreamOptions,
    handler: AsyncStreamHandler,
) -> Result<ProducerHandle>
where
    S: Stream<Item = Result<RecordBatch, E>> + Send + 'static,
    E: Into<Error> + 'static,
{
    // SAFETY: a handler from `async_handler` is valid, and owned by the C side (hence by
    // this producer) from `into_raw` until its `release`.
    unsafe { spawn_device_producer(schema, batches, device, options, handler.into_raw()) }
}

// ---------------------------------------------------------------------------------------
// The async consumer on a device
// ---------------------------------------------------------------------------------------

type Job = Box<dyn FnOnce() + Send>;

/// A thread that runs the imports (and downloads) of an async consumer, so that polling
/// never blocks on the device: an import reads a few sizes back from the device after
/// waiting for the producer's event, a download waits for its copies.
#[derive(Debug)]
struct Offload {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Offload {
    fn spawn() -> Result<Self> {
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("devarrow-import".into())
            .spawn(move || {
                for job in queue {
                    job();
                }
            })
            .map_err(|e| {
                Error::Arrow(arrow_schema::ArrowError::IoError(
                    format!("cannot start the import thread: {e}"),
                    e,
                ))
            })?;
        Ok(Self {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Runs `f` on the thread; its result (or its panic, as an error) arrives on the
    /// receiver.
    fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> futures::channel::oneshot::Receiver<Result<T>> {
        let (tx, rx) = futures::channel::oneshot::channel();
        let job: Job = Box::new(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
                .unwrap_or_else(|payload| Err(Error::from_panic(payload)));
            // A receiver dropped meanwhile drops the result here (releasing it).
            let _ = tx.send(result);
        });
        if let Some(jobs) = &self.jobs {
            // A send error drops the job and its sender: the receiver reports it.
            let _ = jobs.send(job);
        }
        rx
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        // Closing the queue ends the thread after the job in progress, if any.
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the offload thread makes of each array.
type Convert<T> = Arc<dyn Fn(DeviceArray, SchemaRef) -> Result<T> + Send + Sync>;

/// The common part of the async consumers: arrays from an [`AsyncDeviceArrayStream`],
/// converted one at a time on the offload thread.
struct Converting<T> {
    inner: AsyncDeviceArrayStream,
    schema: Option<SchemaRef>,
    convert: Convert<T>,
    pending: Option<futures::channel::oneshot::Receiver<Result<T>>>,
    done: bool,
    // Dropped last: waits for the conversion in progress.
    offload: Offload,
}

impl<T: Send + 'static> Converting<T> {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<T>>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.pending.is_none() {
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
            let array = match self.inner.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(array))) => array,
            };
            let convert = self.convert.clone();
            self.pending = Some(self.offload.run(move || convert(array, schema)));
        }
        let pending = self.pending.as_mut().expect("set above");
        let result = match pending.poll_unpin(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Ok(result)) => result,
            Poll::Ready(Err(_cancelled)) => Err(Error::Panic(
                "the import thread stopped before converting an array".into(),
            )),
        };
        self.pending = None;
        if result.is_err() {
            self.done = true;
        }
        Poll::Ready(Some(result))
    }
}

/// Creates an async consumer on `device`: a handler to pass to an async producer
/// (devarrow's or a foreign one), and the [`futures::Stream`] of the [`DeviceBatch`]es
/// it delivers, imported zero-copy ([`DeviceBatch::import`]).
///
/// Back-pressure is the abi consumer's ([`async_handler`]): `capacity` tasks requested
/// ahead, one more per batch taken. Each array is imported on a thread of the stream's
/// own (polling never blocks on the device); the import makes `device`'s stream wait on
/// the array's `sync_event`, and the batch's [`DeviceBatch::event`] follows that wait.
/// Fails only when that thread cannot be started.
pub fn device_batch_handler(
    device: Arc<dyn Device>,
    capacity: usize,
) -> Result<(AsyncStreamHandler, AsyncDeviceBatchStream)> {
    let offload = Offload::spawn()?;
    let (handler, arrays) = async_handler(capacity);
    let import_device = device.clone();
    let convert: Convert<DeviceBatch> =
        Arc::new(move |array, schema| DeviceBatch::import(import_device.clone(), array, schema));
    Ok((
        handler,
        AsyncDeviceBatchStream {
            inner: Converting {
                inner: arrays,
                schema: None,
                convert,
                pending: None,
                done: false,
                offload,
            },
            device,
        },
    ))
}

/// The device batches an async producer delivers to a handler made by
/// [`device_batch_handler`], as a [`futures::Stream`].
///
/// A producer's `on_error` (or a failed import) is an error item after which the stream
/// ends. Dropping it before the end cancels the producer (as [`AsyncDeviceArrayStream`]
/// does) and waits for an import in progress.
pub struct AsyncDeviceBatchStream {
    inner: Converting<DeviceBatch>,
    device: Arc<dyn Device>,
}

impl std::fmt::Debug for AsyncDeviceBatchStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncDeviceBatchStream")
            .field("device", &self.device)
            .field("arrays", &self.inner.inner)
            .field("done", &self.inner.done)
            .finish_non_exhaustive()
    }
}

impl AsyncDeviceBatchStream {
    /// Waits for the producer's schema.
    pub fn schema(&self) -> impl Future<Output = Result<SchemaRef>> + '_ {
        self.inner.inner.schema()
    }

    /// The device the batches are imported on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The array stream underneath (device type, capacity).
    pub fn device_arrays(&self) -> &AsyncDeviceArrayStream {
        &self.inner.inner
    }

    /// Downloads every batch to host memory (on the import thread, with a [`Transfer`]
    /// of `options`): a [`futures::Stream`] of arrow-rs record batches.
    pub fn into_record_batches(self, options: TransferOptions) -> AsyncHostBatchStream {
        let AsyncDeviceBatchStream { inner, device } = self;
        let Converting {
            inner: arrays,
            schema,
            convert,
            pending,
            done,
            offload,
        } = inner;
        let transfer = Arc::new(Mutex::new(Transfer::new(device.clone(), options)));
        let pending = pending.map(|rx| {
            let transfer = transfer.clone();
            // The import already queued runs first (one thread, jobs in order): download
            // its batch right after.
            offload.run(move || {
                let batch = futures::executor::block_on(rx).unwrap_or_else(|_| {
                    Err(Error::Panic(
                        "the import thread stopped before converting an array".into(),
                    ))
                })?;
                to_host(&transfer, &batch)
            })
        });
        let download: Convert<RecordBatch> = Arc::new(move |array, schema| {
            let batch = convert(array, schema)?;
            to_host(&transfer, &batch)
        });
        AsyncHostBatchStream {
            inner: Converting {
                inner: arrays,
                schema,
                convert: download,
                pending,
                done,
                offload,
            },
        }
    }
}

fn to_host(transfer: &Mutex<Transfer>, batch: &DeviceBatch) -> Result<RecordBatch> {
    transfer
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .to_host(batch)
}

impl Stream for AsyncDeviceBatchStream {
    type Item = Result<DeviceBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.poll_next(cx)
    }
}

/// The record batches of an [`AsyncDeviceBatchStream`] downloaded to host memory (see
/// [`AsyncDeviceBatchStream::into_record_batches`]).
pub struct AsyncHostBatchStream {
    inner: Converting<RecordBatch>,
}

impl std::fmt::Debug for AsyncHostBatchStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncHostBatchStream")
            .field("arrays", &self.inner.inner)
            .field("done", &self.inner.done)
            .finish_non_exhaustive()
    }
}

impl AsyncHostBatchStream {
    /// Waits for the producer's schema.
    pub fn schema(&self) -> impl Future<Output = Result<SchemaRef>> + '_ {
        self.inner.inner.schema()
    }

    /// Waits for the producer's schema and returns these batches as an arrow-rs
    /// [`RecordBatchStream`] ([`HostRecordBatchStream`]), whose `schema()` is that schema
    /// (see the [module documentation](self) for why this is a step of its own). Fails
    /// with the producer's error when it fails before its schema (the producer is then
    /// cancelled, as by a drop of this stream); dropping the future before it is ready
    /// drops the stream too. Batches already taken as device batches (before
    /// [`AsyncDeviceBatchStream::into_record_batches`]) are not seen again: the host stream
    /// goes on from the next one, in order.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use arrow_array::nonblocking::RecordBatchStream;
    /// use arrow_array::{ArrayRef, Int64Array, RecordBatch};
    /// use arrow_schema::ArrowError;
    /// use devarrow_abi::device::{CpuDevice, Device};
    /// use devarrow_bridge::{
    ///     device_batch_handler, spawn_device_producer_into, StreamOptions, TransferOptions,
    /// };
    /// use futures::{stream, StreamExt};
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let batch = RecordBatch::try_from_iter([(
    ///     "x",
    ///     Arc::new(Int64Array::from_iter_values(0..100)) as ArrayRef,
    /// )])?;
    /// let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    ///
    /// // An async producer on the device, and a consumer on the same device.
    /// let (handler, on_device) = device_batch_handler(device.clone(), 2)?;
    /// let producer = spawn_device_producer_into(
    ///     batch.schema(),
    ///     stream::iter(vec![batch.clone(); 3].into_iter().map(Ok::<_, ArrowError>)),
    ///     device,
    ///     StreamOptions::default(),
    ///     handler,
    /// )?;
    ///
    /// futures::executor::block_on(async {
    ///     let host = on_device.into_record_batches(TransferOptions::default()).ready().await?;
    ///     assert_eq!(host.schema(), &batch.schema());
    ///     // What a DataFusion operator takes: `SendableRecordBatchStream`.
    ///     let mut engine_input: std::pin::Pin<Box<dyn RecordBatchStream + Send>> = Box::pin(host);
    ///     while let Some(back) = engine_input.next().await {
    ///         assert_eq!(back?, batch);
    ///     }
    ///     Ok::<_, devarrow_abi::Error>(())
    /// })?;
    /// producer.join()
    /// # }
    /// ```
    pub async fn ready(mut self) -> Result<HostRecordBatchStream> {
        let schema = match &self.inner.schema {
            Some(schema) => schema.clone(),
            None => {
                let schema = self.inner.inner.schema().await?;
                self.inner.schema = Some(schema.clone());
                schema
            }
        };
        Ok(HostRecordBatchStream {
            inner: self.inner,
            schema,
        })
    }
}

impl Stream for AsyncHostBatchStream {
    type Item = Result<RecordBatch>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.poll_next(cx)
    }
}

/// The record batches of an [`AsyncHostBatchStream`] once its schema arrived
/// ([`AsyncHostBatchStream::ready`]): an arrow-rs [`RecordBatchStream`], e.g. to hand to
/// an engine as its `SendableRecordBatchStream` (`Box::pin` it).
///
/// Every batch has the schema `schema()` returns (the producer's, from `on_schema`).
/// Errors are `ArrowError`s, as the trait requires: a devarrow [`Error`] travels inside
/// `ArrowError::ExternalError` (an arrow-rs error as itself), and
/// `devarrow_abi::Error::from(arrow_error)` gets it back with its errno. The stream ends
/// after its first error. Dropping it before the end cancels the producer and waits for a
/// download in progress, as dropping an [`AsyncHostBatchStream`] does.
pub struct HostRecordBatchStream {
    inner: Converting<RecordBatch>,
    schema: SchemaRef,
}

impl std::fmt::Debug for HostRecordBatchStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRecordBatchStream")
            .field("schema", &self.schema)
            .field("arrays", &self.inner.inner)
            .field("done", &self.inner.done)
            .finish_non_exhaustive()
    }
}

impl HostRecordBatchStream {
    /// The array stream underneath (device type, capacity, metadata).
    pub fn device_arrays(&self) -> &AsyncDeviceArrayStream {
        &self.inner.inner
    }
}

impl Stream for HostRecordBatchStream {
    type Item = Result<RecordBatch, ArrowError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner
            .poll_next(cx)
            .map(|item| item.map(|item| item.map_err(ArrowError::from)))
    }
}

impl RecordBatchStream for HostRecordBatchStream {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }
}
