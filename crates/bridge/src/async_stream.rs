//! The async device stream on a device: uploads from a Rust [`futures::Stream`] of record
//! batches, ahead of the consumer and off the executor's threads.
//!
//! - [`UploadStream`]: a [`futures::Stream`] of [`DeviceBatch`]es uploaded on a
//!   background thread from a [`futures::Stream`] of `RecordBatch`es, with the bounded
//!   read-ahead of [`crate::stream`] (polling it never blocks on an upload).
//! - [`spawn_device_producer`] / [`spawn_device_producer_into`]: drive a (foreign or
//!   devarrow) `ArrowAsyncDeviceStreamHandler` with those batches, exported as device
//!   arrays whose `sync_event` marks their upload, through
//!   [`devarrow_abi::async_stream::spawn_producer`]: the consumer's `request(n)` is the
//!   back-pressure (the producer polls the upload stream only for requested tasks), and
//!   uploads run at most `read_ahead` batches ahead of those requests.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use devarrow_abi::async_stream::{spawn_producer, AsyncStreamHandler, ProducerHandle};
use devarrow_abi::device::Device;
use devarrow_abi::{ArrowAsyncDeviceStreamHandler, DeviceArray, Error, Result};
use futures::{Stream, StreamExt};

use crate::stream::{Pipeline, Pull, StreamOptions};
use crate::transfer::DeviceBatch;

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
/// protocol: `on_schema`, one `on_next_task` per requested unit, a NULL task at the end,
/// `on_error` for an error of the source or of an upload, `release` last).
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
