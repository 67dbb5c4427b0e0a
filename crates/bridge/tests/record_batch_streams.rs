//! arrow-rs's async `RecordBatchStream` (`arrow_array::nonblocking`, DataFusion's
//! `SendableRecordBatchStream` shape) at both ends of the bridge's async streams, on the
//! CPU device: round trips through the trait types, errors of the source (in order, the
//! source dropped, nothing leaked), the read-ahead bound against a slow consumer
//! (counting the polls of the source), and the schema step of the host stream.
//!
//! Every test runs background threads (the upload pipeline, the async producer, the
//! import thread); those that wait for the threads to settle (the back-pressure bounds)
//! sleep, which Miri cannot do in reasonable time, and are ignored under it.

mod common;

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arrow_array::nonblocking::RecordBatchStream;
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use common::{assert_batches_eq, cpu, watchdog, InstrumentedDevice};
use devarrow_abi::device::Device;
use devarrow_abi::error::errno;
use devarrow_abi::Error;
use devarrow_bridge::{
    device_batch_handler, spawn_device_producer_into, HostRecordBatchStream, StreamOptions,
    Transfer, TransferOptions, UploadStream,
};
use devarrow_testing::sample;
use futures::executor::block_on;
use futures::{Stream, StreamExt};

// ---------------------------------------------------------------------------------------
// Test data, a counting RecordBatchStream, guards
// ---------------------------------------------------------------------------------------

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("i", DataType::Int64, true),
        Field::new("s", DataType::Utf8, false),
    ]))
}

fn batch(k: usize) -> RecordBatch {
    let rows = 20 + k % 5;
    let i: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..rows as i64).map(|r| (r % 3 != 0).then_some(r * k as i64)),
    ));
    let s: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..rows).map(|r| format!("{k}-{r}")),
    ));
    RecordBatch::try_new(schema(), vec![i, s]).unwrap()
}

#[derive(Clone, Default)]
struct Counters {
    /// Calls of `poll_next`.
    polls: Arc<AtomicUsize>,
    /// Items it returned (batches and errors).
    items: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
}

impl Counters {
    fn polls(&self) -> usize {
        self.polls.load(Ordering::SeqCst)
    }
    fn items(&self) -> usize {
        self.items.load(Ordering::SeqCst)
    }
    fn drops(&self) -> usize {
        self.drops.load(Ordering::SeqCst)
    }

    /// A `SendableRecordBatchStream`-shaped source of `items`, counting into `self`.
    fn source<I>(&self, schema: SchemaRef, items: I) -> Pin<Box<dyn RecordBatchStream + Send>>
    where
        I: IntoIterator<Item = Result<RecordBatch, ArrowError>>,
        I::IntoIter: Send + 'static,
    {
        Box::pin(CountingSource {
            schema,
            items: Box::new(items.into_iter()),
            counters: self.clone(),
        })
    }

    /// Waits until the polls reach `expected`, then checks they stay there.
    fn settle_at(&self, expected: usize, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.polls() < expected && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(self.polls(), expected, "{what}");
    }
}

/// A record batch stream over an iterator, always ready, counting its polls, items and
/// drops.
struct CountingSource {
    schema: SchemaRef,
    items: Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send>,
    counters: Counters,
}

impl Stream for CountingSource {
    type Item = Result<RecordBatch, ArrowError>;
    fn poll_next(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.counters.polls.fetch_add(1, Ordering::SeqCst);
        let item = self.items.next();
        if item.is_some() {
            self.counters.items.fetch_add(1, Ordering::SeqCst);
        }
        Poll::Ready(item)
    }
}

impl RecordBatchStream for CountingSource {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }
}

impl Drop for CountingSource {
    fn drop(&mut self) {
        self.counters.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// The every-type batch, a slice of it and an empty slice: one schema, every type.
fn every_type_batches() -> Vec<RecordBatch> {
    let whole = sample::every_type_batch();
    let n = whole.num_rows();
    vec![whole.clone(), whole.slice(1, n - 2), whole.slice(n / 2, 0)]
}

/// The batches an async producer on `producer_device` delivers to a consumer on the CPU
/// device, as the trait type (boxed as an engine takes it), with the producer.
fn host_stream(
    source: Pin<Box<dyn RecordBatchStream + Send>>,
    producer_device: Arc<dyn Device>,
    options: StreamOptions,
    capacity: usize,
) -> (
    Pin<Box<dyn RecordBatchStream + Send>>,
    devarrow_abi::async_stream::ProducerHandle,
) {
    let (handler, on_device) = device_batch_handler(cpu(), capacity).unwrap();
    let producer = spawn_device_producer_into(
        source.schema().clone(),
        source,
        producer_device,
        options,
        handler,
    )
    .unwrap();
    let ready = on_device
        .into_record_batches(TransferOptions::default())
        .ready();
    let host: HostRecordBatchStream = block_on(ready).unwrap();
    (Box::pin(host), producer)
}

// ---------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------

#[test]
// Background threads and every-type batches through the staging pipeline: minutes
// interpreted.
#[cfg_attr(miri, ignore)]
fn every_type_round_trips_from_a_record_batch_stream_to_device_batches() {
    let _w = watchdog("every_type_round_trips_from_a_record_batch_stream_to_device_batches");
    let batches = every_type_batches();
    let counters = Counters::default();
    let device = InstrumentedDevice::new();
    let source = counters.source(
        batches[0].schema(),
        batches.clone().into_iter().map(Ok).collect::<Vec<_>>(),
    );
    let uploads =
        UploadStream::from_record_batch_stream(source, device.clone(), StreamOptions::default())
            .unwrap();
    assert_eq!(uploads.schema(), batches[0].schema(), "the trait's schema");
    let on_device: Vec<_> = block_on(uploads.collect::<Vec<_>>());
    assert_eq!(counters.drops(), 1, "the source is dropped at its end");
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    let back: Vec<_> = on_device
        .iter()
        .map(|b| transfer.to_host(b.as_ref().unwrap()).unwrap())
        .collect();
    assert_batches_eq(&batches, &back);
    drop(on_device);
    assert_eq!(device.live(), 0, "nothing leaked");
}

#[test]
// Background threads and every-type batches through the staging pipeline: minutes
// interpreted.
#[cfg_attr(miri, ignore)]
fn every_type_round_trips_through_the_trait_types_at_both_ends() {
    let _w = watchdog("every_type_round_trips_through_the_trait_types_at_both_ends");
    let batches = every_type_batches();
    let device = InstrumentedDevice::new();
    let source = Counters::default().source(
        batches[0].schema(),
        batches.clone().into_iter().map(Ok).collect::<Vec<_>>(),
    );
    let (mut host, producer) = host_stream(source, device.clone(), StreamOptions::default(), 2);
    assert_eq!(host.schema(), &sample::every_type_schema());
    let mut back = Vec::new();
    while let Some(batch) = block_on(host.next()) {
        let batch = batch.unwrap();
        assert_eq!(&batch.schema(), host.schema(), "every batch has schema()");
        back.push(batch);
    }
    assert_batches_eq(&batches, &back);
    producer.join().unwrap();
    drop(host);
    assert_eq!(device.live(), 0, "every array released");
}

#[test]
// Background threads (upload pipeline, async producer, import thread): slow interpreted.
#[cfg_attr(miri, ignore)]
fn the_host_stream_goes_on_after_batches_taken_on_the_device() {
    let _w = watchdog("the_host_stream_goes_on_after_batches_taken_on_the_device");
    let device = InstrumentedDevice::new();
    let source = Counters::default().source(schema(), (0..5).map(|k| Ok(batch(k))));
    let (handler, mut on_device) = device_batch_handler(cpu(), 2).unwrap();
    let producer = spawn_device_producer_into(
        schema(),
        source,
        device.clone(),
        StreamOptions::default(),
        handler,
    )
    .unwrap();
    let first = block_on(on_device.next()).unwrap().unwrap();
    let mut host = block_on(
        on_device
            .into_record_batches(TransferOptions::default())
            .ready(),
    )
    .unwrap();
    assert_eq!(host.schema(), &schema());
    let rest: Vec<_> = block_on((&mut host).map(Result::unwrap).collect::<Vec<_>>());
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    let mut back = vec![transfer.to_host(&first).unwrap()];
    back.extend(rest);
    assert_batches_eq(&(0..5).map(batch).collect::<Vec<_>>(), &back);
    producer.join().unwrap();
    drop((first, host));
    assert_eq!(device.live(), 0);
}

#[test]
fn the_host_stream_and_its_ready_future_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    let (handler, on_device) = device_batch_handler(cpu(), 1).unwrap();
    let host = on_device.into_record_batches(TransferOptions::default());
    let ready = host.ready();
    assert_send(&ready);
    // No producer: the handler released before any schema fails `ready` (a protocol
    // violation), rather than leaving a stream without a schema.
    drop(handler);
    let error = block_on(ready).unwrap_err();
    assert!(error.to_string().contains("on_schema"), "{error}");
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

#[test]
// Background threads (upload pipeline): slow interpreted.
#[cfg_attr(miri, ignore)]
fn a_source_error_ends_the_upload_stream_with_it_and_leaks_nothing() {
    let _w = watchdog("a_source_error_ends_the_upload_stream_with_it_and_leaks_nothing");
    let counters = Counters::default();
    let device = InstrumentedDevice::new();
    let items = vec![
        Ok(batch(0)),
        Ok(batch(1)),
        Err(ArrowError::MemoryError("out of room".into())),
        Ok(batch(3)),
    ];
    let uploads = UploadStream::from_record_batch_stream(
        counters.source(schema(), items),
        device.clone(),
        StreamOptions::default().with_read_ahead(4),
    )
    .unwrap();
    let got: Vec<_> = block_on(uploads.collect::<Vec<_>>());
    assert_eq!(got.len(), 3, "{got:?}");
    match &got[2] {
        Err(Error::Arrow(ArrowError::MemoryError(message))) => {
            assert!(message.contains("out of room"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(got[2].as_ref().unwrap_err().errno(), errno::ENOMEM);
    assert_eq!(counters.items(), 3, "nothing taken past the error");
    assert_eq!(counters.drops(), 1, "the source is dropped");
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    for (k, on_device) in got.iter().take(2).enumerate() {
        assert_eq!(
            transfer.to_host(on_device.as_ref().unwrap()).unwrap(),
            batch(k)
        );
    }
    assert_eq!(device.live(), 2, "only the batches handed out");
    drop(got);
    assert_eq!(device.live(), 0, "nothing leaked");
}

#[test]
// Background threads (upload pipeline): slow interpreted.
#[cfg_attr(miri, ignore)]
fn a_devarrow_error_inside_an_arrow_error_comes_out_as_itself() {
    let _w = watchdog("a_devarrow_error_inside_an_arrow_error_comes_out_as_itself");
    let device = InstrumentedDevice::new();
    let items = vec![
        Ok(batch(0)),
        Err(ArrowError::from(Error::InvalidArgument("bad row".into()))),
    ];
    let uploads = UploadStream::from_record_batch_stream(
        Counters::default().source(schema(), items),
        device.clone(),
        StreamOptions::default(),
    )
    .unwrap();
    let got: Vec<_> = block_on(uploads.collect::<Vec<_>>());
    assert_eq!(got.len(), 2);
    match &got[1] {
        Err(e @ Error::InvalidArgument(message)) => {
            assert_eq!(message, "bad row");
            assert_eq!(e.errno(), errno::EINVAL);
        }
        other => panic!("{other:?}"),
    }
    drop(got);
    assert_eq!(device.live(), 0);
}

#[test]
// Background threads (upload pipeline): slow interpreted.
#[cfg_attr(miri, ignore)]
fn a_batch_that_contradicts_the_streams_schema_is_einval() {
    let _w = watchdog("a_batch_that_contradicts_the_streams_schema_is_einval");
    let counters = Counters::default();
    let device = InstrumentedDevice::new();
    let other =
        RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef)])
            .unwrap();
    let uploads = UploadStream::from_record_batch_stream(
        counters.source(schema(), vec![Ok(batch(0)), Ok(other), Ok(batch(2))]),
        device.clone(),
        StreamOptions::default(),
    )
    .unwrap();
    let got: Vec<_> = block_on(uploads.collect::<Vec<_>>());
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[0].is_ok());
    assert_eq!(got[1].as_ref().unwrap_err().errno(), errno::EINVAL);
    assert_eq!(counters.drops(), 1);
    drop(got);
    assert_eq!(device.live(), 0);
}

#[test]
// Background threads (upload pipeline, async producer, import thread): slow interpreted.
#[cfg_attr(miri, ignore)]
fn a_source_error_reaches_the_host_stream_as_an_arrow_error_with_its_errno() {
    let _w = watchdog("a_source_error_reaches_the_host_stream_as_an_arrow_error_with_its_errno");
    let counters = Counters::default();
    let device = InstrumentedDevice::new();
    let items = vec![
        Ok(batch(0)),
        Err(ArrowError::MemoryError("out of room".into())),
        Ok(batch(2)),
    ];
    let (mut host, producer) = host_stream(
        counters.source(schema(), items),
        device.clone(),
        StreamOptions::default(),
        2,
    );
    assert_eq!(host.schema(), &schema());
    assert_eq!(block_on(host.next()).unwrap().unwrap(), batch(0));
    let error = block_on(host.next()).unwrap().unwrap_err();
    assert!(error.to_string().contains("out of room"), "{error}");
    match Error::from(error) {
        Error::Callback {
            operation: "on_error",
            code,
            ..
        } => assert_eq!(code, errno::ENOMEM),
        other => panic!("{other:?}"),
    }
    assert!(
        block_on(host.next()).is_none(),
        "the stream ends after its error"
    );
    assert_eq!(producer.join().unwrap_err().errno(), errno::ENOMEM);
    assert_eq!(counters.drops(), 1, "the source is dropped");
    drop(host);
    assert_eq!(device.live(), 0, "nothing leaked");
}

// ---------------------------------------------------------------------------------------
// Back-pressure: a slow consumer bounds the polls of the source
// ---------------------------------------------------------------------------------------

#[test]
// Waits for background threads to settle (sleeps): not in reasonable time under Miri.
#[cfg_attr(miri, ignore)]
fn a_slow_consumer_bounds_the_polls_of_the_source() {
    let _w = watchdog("a_slow_consumer_bounds_the_polls_of_the_source");
    for read_ahead in [0, 1, 3] {
        let counters = Counters::default();
        let device = InstrumentedDevice::new();
        let mut uploads = UploadStream::from_record_batch_stream(
            counters.source(schema(), (0..).map(|k| Ok(batch(k)))),
            device.clone(),
            StreamOptions::default().with_read_ahead(read_ahead),
        )
        .unwrap();
        counters.settle_at(read_ahead, "nothing taken yet: read-ahead only");
        let mut transfer = Transfer::new(cpu(), TransferOptions::default());
        for k in 0..4 {
            let on_device = block_on(uploads.next()).unwrap().unwrap();
            // The consumer's work on the batch: the source stays at the bound meanwhile.
            std::thread::sleep(Duration::from_millis(20));
            assert!(
                counters.polls() <= k + 1 + read_ahead,
                "read-ahead {read_ahead}"
            );
            assert_eq!(transfer.to_host(&on_device).unwrap(), batch(k));
            counters.settle_at(k + 1 + read_ahead, "k + 1 taken");
            assert!(
                device.live() <= 1 + read_ahead + device.staging_allocations(),
                "device memory: the batch held, the read-ahead and the staging"
            );
        }
        drop(uploads);
        assert_eq!(counters.drops(), 1, "read-ahead {read_ahead}");
        assert_eq!(device.live(), 0, "nothing leaked");
    }
}

#[test]
// Waits for background threads to settle (sleeps): not in reasonable time under Miri.
#[cfg_attr(miri, ignore)]
fn a_slow_host_stream_consumer_bounds_the_polls_of_the_source() {
    let _w = watchdog("a_slow_host_stream_consumer_bounds_the_polls_of_the_source");
    for (capacity, read_ahead) in [(1, 0), (2, 2)] {
        let counters = Counters::default();
        let device = InstrumentedDevice::new();
        let (mut host, producer) = host_stream(
            counters.source(schema(), (0..).map(|k| Ok(batch(k)))),
            device.clone(),
            StreamOptions::default().with_read_ahead(read_ahead),
            capacity,
        );
        // `capacity` tasks requested, one batch taken by the async producer ahead of the
        // demand (to see the end), `read_ahead` uploads ahead of the producer.
        counters.settle_at(capacity + 1 + read_ahead, "nothing taken yet");
        for k in 0..3 {
            assert_eq!(block_on(host.next()).unwrap().unwrap(), batch(k));
            std::thread::sleep(Duration::from_millis(20));
            counters.settle_at(capacity + k + 2 + read_ahead, "after k + 1 taken");
        }
        drop(host); // cancels the producer
        producer.join().unwrap();
        assert_eq!(counters.drops(), 1);
        assert_eq!(device.live(), 0, "nothing leaked");
    }
}
