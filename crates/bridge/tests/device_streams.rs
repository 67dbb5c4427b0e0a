//! Device streams on the CPU device: the uploading producers (sync and async) against the
//! abi's CPU consumers and the bridge's device consumers: round trips of every type and
//! slice, the read-ahead bound, errors mid-stream with their errno, early drops (no leak,
//! no deadlock) and back-pressure.
//!
//! Not under Miri: these tests wait for threads to settle and run every-type batches
//! through background uploaders, which takes far beyond CI's time interpreted (one test
//! ran 20 minutes). The C and async stream state machines they drive run under Miri in
//! devarrow-abi's tests, and natively here.
#![cfg(not(miri))]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, Int64Array, RecordBatch, RecordBatchReader};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use common::{assert_batches_eq, cpu, reader_of, watchdog, InstrumentedDevice};
use devarrow_abi::async_stream::async_record_batch_handler;
use devarrow_abi::error::errno;
use devarrow_abi::stream::{export_stream, DeviceArrayStreamReader, DeviceBatchSource};
use devarrow_abi::{cpu, ArrowDeviceArrayStream, ArrowDeviceType, Error};
use devarrow_bridge::{
    device_batch_handler, export_reader_to_device, spawn_device_producer_into, DeviceBatch,
    DeviceStreamReader, StreamOptions, Transfer, TransferOptions, UploadStream, Uploader,
};
use devarrow_testing::sample;
use futures::executor::block_on;
use futures::{stream, Stream, StreamExt};

// ---------------------------------------------------------------------------------------
// Test data, devices, readers and guards
// ---------------------------------------------------------------------------------------

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("i", DataType::Int64, true),
        Field::new("j", DataType::Int64, false),
    ]))
}

fn batch(k: usize) -> RecordBatch {
    let rows = 100 + k % 7;
    let i: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..rows as i64).map(|r| (r % 5 != 0).then_some(r * k as i64)),
    ));
    let j: ArrayRef = Arc::new(Int64Array::from_iter_values(
        (0..rows as i64).map(|r| r - k as i64),
    ));
    RecordBatch::try_new(schema(), vec![i, j]).unwrap()
}

/// Every slice of the every-type batch, and the samples: one stream of many batches.
fn every_type_batches() -> Vec<RecordBatch> {
    let whole = sample::every_type_batch();
    let n = whole.num_rows();
    let mut batches = sample::sample_batches();
    batches.push(sample::sliced_every_type_batch());
    for offset in 0..=n {
        for len in [0, 1, 2, 3, n - offset] {
            if offset + len <= n {
                batches.push(whole.slice(offset, len));
            }
        }
    }
    batches
}

type Make = Box<dyn FnMut(usize) -> Option<Result<RecordBatch, ArrowError>> + Send>;

/// A reader that counts its pulls (`next` calls) and its drops.
struct CountingReader {
    schema: SchemaRef,
    make: Make,
    pulls: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
    delay: Duration,
}

#[derive(Clone, Default)]
struct Counters {
    pulls: Arc<AtomicUsize>,
    drops: Arc<AtomicUsize>,
}

impl Counters {
    fn pulls(&self) -> usize {
        self.pulls.load(Ordering::SeqCst)
    }
    fn drops(&self) -> usize {
        self.drops.load(Ordering::SeqCst)
    }
    fn reader(&self, make: Make) -> Box<dyn RecordBatchReader + Send> {
        Box::new(CountingReader {
            schema: schema(),
            make,
            pulls: self.pulls.clone(),
            drops: self.drops.clone(),
            delay: Duration::ZERO,
        })
    }
    fn slow_reader(&self, delay: Duration, make: Make) -> Box<dyn RecordBatchReader + Send> {
        Box::new(CountingReader {
            schema: schema(),
            make,
            pulls: self.pulls.clone(),
            drops: self.drops.clone(),
            delay,
        })
    }
    /// Waits until the pulls reach `expected`, then checks they stay there.
    fn settle_at(&self, expected: usize, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.pulls() < expected && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(self.pulls(), expected, "{what}");
    }
}

impl Iterator for CountingReader {
    type Item = Result<RecordBatch, ArrowError>;
    fn next(&mut self) -> Option<Self::Item> {
        let k = self.pulls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        (self.make)(k)
    }
}

impl RecordBatchReader for CountingReader {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}

impl Drop for CountingReader {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

fn first(n: usize) -> Make {
    Box::new(move |k| (k < n).then(|| Ok(batch(k))))
}

fn endless() -> Make {
    Box::new(|k| Some(Ok(batch(k))))
}

fn download_all(
    batches: impl IntoIterator<Item = devarrow_abi::Result<devarrow_bridge::DeviceBatch>>,
) -> Vec<RecordBatch> {
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    batches
        .into_iter()
        .map(|b| transfer.to_host(&b.unwrap()).unwrap())
        .collect()
}

/// Moves a stream through a raw C struct, as a foreign consumer would receive it.
fn through_c(stream: devarrow_abi::DeviceArrayStream) -> DeviceArrayStreamReader {
    let mut raw = ArrowDeviceArrayStream::empty();
    // SAFETY: `raw` is writable.
    unsafe { stream.move_into(&mut raw) };
    // SAFETY: `raw` holds an unreleased stream.
    let reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw) }.unwrap();
    assert!(raw.is_released());
    reader
}

// ---------------------------------------------------------------------------------------
// The device stream producer
// ---------------------------------------------------------------------------------------

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn every_type_and_slice_round_trips_through_the_c_stream() {
    let _w = watchdog("every_type_and_slice_round_trips_through_the_c_stream");
    let batches = every_type_batches();
    for read_ahead in [0, 1, 2, 5] {
        let stream = export_reader_to_device(
            reader_of(&batches),
            cpu(),
            StreamOptions::default().with_read_ahead(read_ahead),
        )
        .unwrap();
        assert_eq!(stream.device_type(), ArrowDeviceType::CPU);
        let reader = through_c(stream);
        assert_eq!(
            reader.schema(),
            sample::every_type_schema(),
            "metadata kept"
        );
        let back: Vec<RecordBatch> = reader.collect::<Result<_, _>>().unwrap();
        assert_batches_eq(&batches, &back);
    }
}

#[test]
fn the_uploader_iterates_device_batches() {
    let _w = watchdog("the_uploader_iterates_device_batches");
    let batches: Vec<RecordBatch> = (0..20).map(batch).collect();
    let device = InstrumentedDevice::new();
    let uploader = Uploader::spawn(
        reader_of(&batches),
        device.clone(),
        StreamOptions::default(),
    )
    .unwrap();
    assert_eq!(uploader.schema(), schema());
    assert_eq!(uploader.device().device_type(), ArrowDeviceType::CPU);
    let on_device: Vec<_> = uploader.collect::<Result<_, _>>().unwrap();
    assert!(on_device.iter().all(|b| b.schema() == schema()));
    assert_eq!(
        device.live(),
        on_device.len(),
        "one allocation per batch held; staging freed with the thread"
    );
    assert_batches_eq(&batches, &download_all(on_device.into_iter().map(Ok)));
    assert_eq!(device.live(), 0);
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn small_staging_chunks_round_trip() {
    let batches: Vec<RecordBatch> = (0..6).map(|k| batch(k * 1000)).collect();
    let options = StreamOptions::default()
        .with_read_ahead(3)
        .with_transfer(TransferOptions::default().with_staging_bytes(256));
    let reader = through_c(export_reader_to_device(reader_of(&batches), cpu(), options).unwrap());
    let back: Vec<RecordBatch> = reader.collect::<Result<_, _>>().unwrap();
    assert_batches_eq(&batches, &back);
}

#[test]
fn read_ahead_is_bounded_by_the_consumer_requests() {
    let _w = watchdog("read_ahead_is_bounded_by_the_consumer_requests");
    for read_ahead in [0, 1, 2, 4] {
        let counters = Counters::default();
        let mut uploader = Uploader::spawn(
            counters.reader(endless()),
            cpu(),
            StreamOptions::default().with_read_ahead(read_ahead),
        )
        .unwrap();
        counters.settle_at(
            read_ahead,
            "before any request, read_ahead batches are uploaded",
        );
        for k in 1..=5 {
            let b = uploader.next_batch().unwrap().unwrap();
            assert_eq!(b.num_rows(), batch(k - 1).num_rows());
            counters.settle_at(k + read_ahead, "after k requests");
        }
        drop(uploader);
        assert_eq!(counters.drops(), 1);
    }
}

#[test]
fn read_ahead_through_the_c_stream_counts_get_next_calls() {
    let _w = watchdog("read_ahead_through_the_c_stream_counts_get_next_calls");
    let counters = Counters::default();
    let mut stream =
        export_reader_to_device(counters.reader(first(6)), cpu(), StreamOptions::default())
            .unwrap();
    counters.settle_at(2, "default read-ahead: 2");
    let schema_ffi = stream.schema().unwrap();
    assert_eq!(Schema::try_from(&schema_ffi).unwrap(), *schema());
    counters.settle_at(2, "get_schema is not a request");
    for k in 0..6 {
        let array = stream.next_array().unwrap().unwrap();
        assert_eq!(array.device_type(), ArrowDeviceType::CPU);
        assert!(array.sync_event().is_null(), "no event on the CPU");
        let back = cpu::import_record_batch_with_schema(array, schema()).unwrap();
        assert_eq!(back, batch(k));
        // 6 batches then the end: the 7th pull returns None.
        counters.settle_at((k + 1 + 2).min(7), "after k + 1 get_next calls");
    }
    assert!(stream.next_array().unwrap().is_none());
    assert!(
        stream.next_array().unwrap().is_none(),
        "the end stays the end"
    );
    assert_eq!(counters.drops(), 1, "the reader is dropped at its end");
}

fn io_error(message: &str) -> ArrowError {
    ArrowError::IoError(message.into(), std::io::Error::other(message.to_string()))
}

#[test]
fn a_reader_error_mid_stream_is_get_next_with_its_errno() {
    let _w = watchdog("a_reader_error_mid_stream_is_get_next_with_its_errno");
    let cases: Vec<(ArrowError, i32, &str)> = vec![
        (io_error("disk on fire"), errno::EIO, "disk on fire"),
        (
            ArrowError::MemoryError("no room".into()),
            errno::ENOMEM,
            "no room",
        ),
        (
            ArrowError::ComputeError("bad row".into()),
            errno::EINVAL,
            "bad row",
        ),
        (
            ArrowError::ExternalError(Box::new(Error::Callback {
                operation: "get_next",
                code: errno::ECANCELED,
                message: "upstream cancelled".into(),
            })),
            errno::ECANCELED,
            "upstream cancelled",
        ),
    ];
    for (error, code, fragment) in cases {
        let counters = Counters::default();
        let mut error = Some(error);
        let make: Make = Box::new(move |k| match k {
            0 | 1 => Some(Ok(batch(k))),
            2 => Some(Err(error.take().unwrap())),
            _ => Some(Ok(batch(k))),
        });
        let mut stream =
            export_reader_to_device(counters.reader(make), cpu(), StreamOptions::default())
                .unwrap();
        for k in 0..2 {
            let array = stream.next_array().unwrap().unwrap();
            assert_eq!(
                cpu::import_record_batch_with_schema(array, schema()).unwrap(),
                batch(k)
            );
        }
        let first = match stream.next_array() {
            Err(Error::Callback {
                operation: "get_next",
                code: c,
                message: m,
            }) => {
                assert_eq!(c, code, "{m}");
                assert!(m.contains(fragment), "{m} should mention {fragment}");
                m
            }
            other => panic!("expected the reader's error, got {other:?}"),
        };
        // Later calls replay the first failure unchanged: same errno, same message.
        for _ in 0..2 {
            match stream.next_array() {
                Err(Error::Callback {
                    operation: "get_next",
                    code: c,
                    message: m,
                }) => {
                    assert_eq!(c, code, "the error sticks");
                    assert_eq!(m, first, "the message sticks, unwrapped");
                }
                other => panic!("expected the error again, got {other:?}"),
            }
        }
        assert_eq!(counters.pulls(), 3, "the thread stops at the error");
        assert_eq!(counters.drops(), 1, "and drops the reader");
        drop(stream);
    }
}

#[test]
fn an_uploader_source_replays_its_first_error_unchanged() {
    let make: Make = Box::new(|k| match k {
        0 => Some(Ok(batch(0))),
        1 => Some(Err(ArrowError::MemoryError("no room".into()))),
        _ => Some(Ok(batch(k))),
    });
    let counters = Counters::default();
    let mut uploader =
        Uploader::spawn(counters.reader(make), cpu(), StreamOptions::default()).unwrap();
    assert!(DeviceBatchSource::next_array(&mut uploader)
        .unwrap()
        .is_ok());
    let first = DeviceBatchSource::next_array(&mut uploader)
        .unwrap()
        .unwrap_err();
    assert_eq!(first.errno(), errno::ENOMEM, "{first}");
    for _ in 0..2 {
        let again = DeviceBatchSource::next_array(&mut uploader)
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(again, Error::Repeated { .. }),
            "not a peer's: {again:?}"
        );
        assert_eq!(again.errno(), first.errno());
        assert_eq!(again.to_string(), first.to_string());
    }
    assert_eq!(counters.pulls(), 2, "nothing is pulled after the error");
}

#[test]
fn a_reader_error_ends_the_abi_reader_and_the_uploader() {
    let make: Make = Box::new(|k| match k {
        0 => Some(Ok(batch(0))),
        1 => Some(Err(io_error("broken pipe"))),
        _ => None,
    });
    let counters = Counters::default();
    let mut reader = through_c(
        export_reader_to_device(counters.reader(make), cpu(), StreamOptions::default()).unwrap(),
    );
    assert_eq!(reader.next().unwrap().unwrap(), batch(0));
    let err = reader.next().unwrap().unwrap_err();
    assert!(err.to_string().contains("broken pipe"), "{err}");
    assert!(reader.next().is_none());

    let make: Make = Box::new(|k| match k {
        0 => Some(Ok(batch(0))),
        1 => Some(Err(io_error("broken pipe"))),
        _ => None,
    });
    let mut uploader = Uploader::spawn(
        Counters::default().reader(make),
        cpu(),
        StreamOptions::default(),
    )
    .unwrap();
    assert!(uploader.next_batch().unwrap().is_some());
    let err = uploader.next_batch().unwrap_err();
    assert_eq!(err.errno(), errno::EIO);
    assert!(
        uploader.next_batch().unwrap().is_none(),
        "the iterator ends"
    );
}

#[test]
fn a_batch_of_another_schema_is_einval() {
    let other =
        RecordBatch::try_from_iter([("x", Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef)])
            .unwrap();
    let make: Make = Box::new(move |k| match k {
        0 => Some(Ok(batch(0))),
        1 => Some(Ok(other.clone())),
        _ => None,
    });
    let mut stream = export_reader_to_device(
        Counters::default().reader(make),
        cpu(),
        StreamOptions::default(),
    )
    .unwrap();
    assert!(stream.next_array().unwrap().is_some());
    match stream.next_array() {
        Err(Error::Callback { code, message, .. }) => {
            assert_eq!(code, errno::EINVAL);
            assert!(message.contains("schema"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_panicking_reader_is_eio_and_the_stream_stays_usable() {
    let _w = watchdog("a_panicking_reader_is_eio_and_the_stream_stays_usable");
    let make: Make = Box::new(|k| match k {
        0 => Some(Ok(batch(0))),
        _ => panic!("reader bug"),
    });
    let counters = Counters::default();
    let mut stream =
        export_reader_to_device(counters.reader(make), cpu(), StreamOptions::default()).unwrap();
    assert!(stream.next_array().unwrap().is_some());
    match stream.next_array() {
        Err(Error::Callback { code, message, .. }) => {
            assert_eq!(code, errno::EIO);
            assert!(message.contains("reader bug"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    drop(stream);
    assert_eq!(counters.drops(), 1);
}

#[test]
fn an_upload_error_is_get_next_with_eio() {
    let _w = watchdog("an_upload_error_is_get_next_with_eio");
    // Two batches fit, the third allocation fails.
    let device = Arc::new(InstrumentedDevice::default().failing_allocations_after(2));
    let counters = Counters::default();
    let mut stream = export_reader_to_device(
        counters.reader(first(10)),
        device.clone(),
        StreamOptions::default(),
    )
    .unwrap();
    let held: Vec<_> = (0..2)
        .map(|_| stream.next_array().unwrap().unwrap())
        .collect();
    match stream.next_array() {
        Err(Error::Callback { code, message, .. }) => {
            assert_eq!(code, errno::EIO);
            assert!(message.contains("refused"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(counters.drops(), 1);
    assert_eq!(device.live(), 2, "only the two exported batches remain");
    for (k, array) in held.into_iter().enumerate() {
        assert_eq!(
            cpu::import_record_batch_with_schema(array, schema()).unwrap(),
            batch(k)
        );
    }
    drop(stream);
    assert_eq!(device.live(), 0);
}

#[test]
fn releasing_the_stream_early_stops_the_thread_without_leaks() {
    let _w = watchdog("releasing_the_stream_early_stops_the_thread_without_leaks");
    for read_ahead in [0, 1, 2, 8] {
        for taken in [0, 1, 3] {
            let device = InstrumentedDevice::new();
            let counters = Counters::default();
            let mut stream = export_reader_to_device(
                counters.reader(endless()),
                device.clone(),
                StreamOptions::default().with_read_ahead(read_ahead),
            )
            .unwrap();
            let held: Vec<_> = (0..taken)
                .map(|_| stream.next_array().unwrap().unwrap())
                .collect();
            counters.settle_at(taken + read_ahead, "the thread waits for demand");
            drop(stream); // release: stop, join
            assert_eq!(counters.drops(), 1, "the reader is dropped by the release");
            assert_eq!(
                device.live(),
                taken,
                "read-ahead batches and staging are freed; the taken arrays are not"
            );
            // Arrays outlive their stream.
            for (k, array) in held.into_iter().enumerate() {
                assert_eq!(
                    cpu::import_record_batch_with_schema(array, schema()).unwrap(),
                    batch(k)
                );
            }
            assert_eq!(device.live(), 0, "every release ran");
        }
    }
}

#[test]
fn dropping_the_uploader_while_the_reader_is_busy_waits_for_it() {
    let _w = watchdog("dropping_the_uploader_while_the_reader_is_busy_waits_for_it");
    let counters = Counters::default();
    let device = InstrumentedDevice::new();
    let uploader = Uploader::spawn(
        counters.slow_reader(Duration::from_millis(100), endless()),
        device.clone(),
        StreamOptions::default(),
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(20)); // inside the first next()
    drop(uploader);
    assert_eq!(counters.drops(), 1);
    assert_eq!(device.live(), 0);
    assert!(counters.pulls() <= 1);
}

#[test]
fn the_c_stream_feeds_the_abi_reader_from_another_thread() {
    let _w = watchdog("the_c_stream_feeds_the_abi_reader_from_another_thread");
    let batches: Vec<RecordBatch> = (0..50).map(batch).collect();
    let stream =
        export_reader_to_device(reader_of(&batches), cpu(), StreamOptions::default()).unwrap();
    let back =
        std::thread::spawn(move || through_c(stream).collect::<Result<Vec<_>, _>>().unwrap())
            .join()
            .unwrap();
    assert_batches_eq(&batches, &back);
}

// ---------------------------------------------------------------------------------------
// The async producer
// ---------------------------------------------------------------------------------------

/// A stream of batches counting its pulls (items yielded) and drops.
struct CountingStream<S> {
    inner: S,
    counters: Counters,
}

impl<S: Stream + Unpin> Stream for CountingStream<S> {
    type Item = S::Item;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        let polled = self.inner.poll_next_unpin(cx);
        if let std::task::Poll::Ready(Some(_)) = &polled {
            self.counters.pulls.fetch_add(1, Ordering::SeqCst);
        }
        polled
    }
}

impl<S> Drop for CountingStream<S> {
    fn drop(&mut self) {
        self.counters.drops.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting<S>(inner: S, counters: &Counters) -> CountingStream<S> {
    CountingStream {
        inner,
        counters: counters.clone(),
    }
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn the_upload_stream_round_trips_every_type() {
    let _w = watchdog("the_upload_stream_round_trips_every_type");
    let batches = every_type_batches();
    let uploads = UploadStream::spawn(
        batches[0].schema(),
        stream::iter(batches.clone().into_iter().map(Ok::<_, ArrowError>)),
        cpu(),
        StreamOptions::default(),
    )
    .unwrap();
    assert_eq!(uploads.schema(), batches[0].schema());
    let on_device: Vec<_> = block_on(uploads.collect::<Vec<_>>());
    assert_batches_eq(&batches, &download_all(on_device));
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn the_async_producer_feeds_the_abi_record_batch_handler() {
    let _w = watchdog("the_async_producer_feeds_the_abi_record_batch_handler");
    let batches = every_type_batches();
    for capacity in [1, 3] {
        let (handler, consumer) = async_record_batch_handler(capacity);
        let producer = spawn_device_producer_into(
            batches[0].schema(),
            stream::iter(batches.clone().into_iter().map(Ok::<_, ArrowError>)),
            cpu(),
            StreamOptions::default(),
            handler,
        )
        .unwrap();
        assert_eq!(
            block_on(consumer.schema()).unwrap(),
            sample::every_type_schema()
        );
        let back: Vec<RecordBatch> = block_on(consumer.map(|b| b.unwrap()).collect::<Vec<_>>());
        assert_batches_eq(&batches, &back);
        producer.join().unwrap();
    }
}

#[test]
fn the_async_producer_honours_back_pressure() {
    let _w = watchdog("the_async_producer_honours_back_pressure");
    for (capacity, read_ahead) in [(1, 0), (1, 2), (3, 1)] {
        let counters = Counters::default();
        let source = counting(
            stream::iter((0..).map(|k| Ok::<_, ArrowError>(batch(k)))),
            &counters,
        );
        let (handler, mut consumer) = async_record_batch_handler(capacity);
        let producer = spawn_device_producer_into(
            schema(),
            source,
            cpu(),
            StreamOptions::default().with_read_ahead(read_ahead),
            handler,
        )
        .unwrap();
        // The handler requests `capacity` tasks on the schema; the abi producer takes one
        // batch ahead of the demand (to see the end without a request), and the uploads
        // run `read_ahead` ahead of the producer.
        counters.settle_at(capacity + 1 + read_ahead, "before anything is taken");
        for k in 0..4 {
            let b = block_on(consumer.next()).unwrap().unwrap();
            assert_eq!(b, batch(k));
            counters.settle_at(capacity + k + 2 + read_ahead, "after k + 1 taken");
        }
        drop(consumer); // cancels the producer
        producer.join().unwrap();
        assert_eq!(counters.drops(), 1, "the source is dropped");
    }
}

#[test]
fn an_error_of_the_async_source_reaches_the_handler_with_its_errno() {
    let _w = watchdog("an_error_of_the_async_source_reaches_the_handler_with_its_errno");
    let items: Vec<Result<RecordBatch, ArrowError>> = vec![
        Ok(batch(0)),
        Ok(batch(1)),
        Err(ArrowError::MemoryError("out of room".into())),
        Ok(batch(3)),
    ];
    let (handler, consumer) = async_record_batch_handler(2);
    let producer = spawn_device_producer_into(
        schema(),
        stream::iter(items),
        cpu(),
        StreamOptions::default(),
        handler,
    )
    .unwrap();
    let got: Vec<_> = block_on(consumer.collect::<Vec<_>>());
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got[0].as_ref().unwrap(), &batch(0));
    assert_eq!(got[1].as_ref().unwrap(), &batch(1));
    match &got[2] {
        Err(Error::Callback {
            operation: "on_error",
            code,
            message,
        }) => {
            assert_eq!(*code, errno::ENOMEM);
            assert!(message.contains("out of room"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(producer.join().unwrap_err().errno(), errno::ENOMEM);
}

#[test]
fn an_upload_error_reaches_the_async_handler() {
    let _w = watchdog("an_upload_error_reaches_the_async_handler");
    let device = Arc::new(InstrumentedDevice::default().failing_allocations_after(1));
    let (handler, consumer) = async_record_batch_handler(1);
    let producer = spawn_device_producer_into(
        schema(),
        stream::iter((0..5).map(|k| Ok::<_, ArrowError>(batch(k)))),
        device.clone(),
        StreamOptions::default(),
        handler,
    )
    .unwrap();
    let got: Vec<_> = block_on(consumer.collect::<Vec<_>>());
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].as_ref().unwrap(), &batch(0));
    match &got[1] {
        Err(Error::Callback { code, message, .. }) => {
            assert_eq!(*code, errno::EIO);
            assert!(message.contains("refused"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(producer.join().is_err());
    drop(got);
    assert_eq!(device.live(), 0);
}

#[test]
fn dropping_the_async_consumer_early_stops_a_pending_source() {
    let _w = watchdog("dropping_the_async_consumer_early_stops_a_pending_source");
    let counters = Counters::default();
    let device = InstrumentedDevice::new();
    // Two batches, then a source that never yields again.
    let source = counting(
        stream::iter((0..2).map(|k| Ok::<_, ArrowError>(batch(k)))).chain(stream::pending()),
        &counters,
    );
    let (handler, mut consumer) = async_record_batch_handler(4);
    let producer = spawn_device_producer_into(
        schema(),
        source,
        device.clone(),
        StreamOptions::default(),
        handler,
    )
    .unwrap();
    assert_eq!(block_on(consumer.next()).unwrap().unwrap(), batch(0));
    assert_eq!(block_on(consumer.next()).unwrap().unwrap(), batch(1));
    counters.settle_at(2, "the source is pending");
    drop(consumer);
    producer.join().unwrap();
    assert_eq!(counters.drops(), 1);
    assert_eq!(device.live(), 0, "no batch or staging memory leaked");
}

#[test]
fn dropping_the_upload_stream_early_frees_everything() {
    let _w = watchdog("dropping_the_upload_stream_early_frees_everything");
    let counters = Counters::default();
    let device = InstrumentedDevice::new();
    let mut uploads = UploadStream::spawn(
        schema(),
        counting(
            stream::iter((0..).map(|k| Ok::<_, ArrowError>(batch(k)))),
            &counters,
        ),
        device.clone(),
        StreamOptions::default().with_read_ahead(3),
    )
    .unwrap();
    let first = block_on(uploads.next()).unwrap().unwrap();
    counters.settle_at(4, "one taken, three ahead");
    drop(uploads);
    assert_eq!(counters.drops(), 1);
    assert_eq!(device.live(), 1, "only the batch taken");
    drop(first);
    assert_eq!(device.live(), 0);
}

// ---------------------------------------------------------------------------------------
// The consumers: a C device stream as device batches, an async producer as a stream
// ---------------------------------------------------------------------------------------

/// Relays a C device stream, counting the release calls of every array it passes on.
struct CountingRelay {
    inner: devarrow_abi::DeviceArrayStream,
    schema: SchemaRef,
    releases: Arc<std::sync::Mutex<Vec<Arc<AtomicUsize>>>>,
}

impl DeviceBatchSource for CountingRelay {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
    fn device_type(&self) -> ArrowDeviceType {
        self.inner.device_type()
    }
    fn next_array(&mut self) -> Option<devarrow_abi::Result<devarrow_abi::DeviceArray>> {
        self.inner.next_array().transpose().map(|array| {
            array.map(|array| {
                let (array, count) = common::count_releases(array);
                self.releases.lock().unwrap().push(count);
                array
            })
        })
    }
}

fn release_counts(releases: &std::sync::Mutex<Vec<Arc<AtomicUsize>>>) -> Vec<usize> {
    releases
        .lock()
        .unwrap()
        .iter()
        .map(common::releases)
        .collect()
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn producer_to_device_reader_round_trips_every_type() {
    let _w = watchdog("producer_to_device_reader_round_trips_every_type");
    let batches = every_type_batches();
    let producer = InstrumentedDevice::new();
    let stream = export_reader_to_device(
        reader_of(&batches),
        producer.clone(),
        StreamOptions::default(),
    )
    .unwrap();
    let mut raw = ArrowDeviceArrayStream::empty();
    // SAFETY: `raw` is writable.
    unsafe { stream.move_into(&mut raw) };
    // SAFETY: `raw` holds an unreleased stream.
    let reader = unsafe { DeviceStreamReader::from_raw(&mut raw, cpu()) }.unwrap();
    assert_eq!(reader.schema(), sample::every_type_schema());
    assert_eq!(reader.device_type(), ArrowDeviceType::CPU);
    let on_device: Vec<DeviceBatch> = reader.collect::<Result<_, _>>().unwrap();
    assert_eq!(
        producer.live(),
        on_device.len(),
        "the imported batches hold the producer's memory, zero-copy"
    );
    assert!(on_device
        .iter()
        .all(|b| b.schema() == sample::every_type_schema()));
    assert_batches_eq(&batches, &download_all(on_device.into_iter().map(Ok)));
    assert_eq!(producer.live(), 0, "every array released");
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn producer_to_host_reader_round_trips_and_releases_each_array_once() {
    let _w = watchdog("producer_to_host_reader_round_trips_and_releases_each_array_once");
    let batches = every_type_batches();
    let releases = Arc::new(std::sync::Mutex::new(Vec::new()));
    let relay = CountingRelay {
        inner: export_reader_to_device(reader_of(&batches), cpu(), StreamOptions::default())
            .unwrap(),
        schema: batches[0].schema(),
        releases: releases.clone(),
    };
    let reader = DeviceStreamReader::try_new(export_stream(relay), cpu())
        .unwrap()
        .into_host(TransferOptions::default());
    assert_eq!(reader.schema(), sample::every_type_schema());
    let back: Vec<RecordBatch> = reader.collect::<Result<_, _>>().unwrap();
    assert_batches_eq(&batches, &back);
    let counts = release_counts(&releases);
    assert_eq!(counts.len(), batches.len());
    assert!(counts.iter().all(|&n| n == 1), "{counts:?}");
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn the_device_reader_reads_the_abi_cpu_producer() {
    let batches = every_type_batches();
    let reader = DeviceStreamReader::try_new(
        devarrow_abi::stream::export_reader(reader_of(&batches)),
        cpu(),
    )
    .unwrap();
    let back: Vec<RecordBatch> = reader
        .into_host(TransferOptions::default())
        .collect::<Result<_, _>>()
        .unwrap();
    assert_batches_eq(&batches, &back);
}

#[test]
fn the_device_reader_reports_errors_with_their_errno_then_ends() {
    let _w = watchdog("the_device_reader_reports_errors_with_their_errno_then_ends");
    let make: Make = Box::new(|k| match k {
        0 => Some(Ok(batch(0))),
        1 => Some(Err(io_error("sector not found"))),
        _ => Some(Ok(batch(k))),
    });
    let stream = export_reader_to_device(
        Counters::default().reader(make),
        cpu(),
        StreamOptions::default(),
    )
    .unwrap();
    let mut reader = DeviceStreamReader::try_new(stream, cpu()).unwrap();
    let first = reader.next_batch().unwrap().unwrap();
    match reader.next_batch() {
        Err(Error::Callback {
            operation: "get_next",
            code,
            message,
        }) => {
            assert_eq!(code, errno::EIO);
            assert!(message.contains("sector not found"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        reader.next_batch().unwrap().is_none(),
        "fused after the error"
    );
    assert!(reader.next().is_none());
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    assert_eq!(transfer.to_host(&first).unwrap(), batch(0));

    // Through the host reader, the error is an ArrowError carrying the devarrow error.
    let make: Make = Box::new(|k| match k {
        0 => Some(Err(ArrowError::MemoryError("full".into()))),
        _ => None,
    });
    let stream = export_reader_to_device(
        Counters::default().reader(make),
        cpu(),
        StreamOptions::default(),
    )
    .unwrap();
    let mut host = DeviceStreamReader::try_new(stream, cpu())
        .unwrap()
        .into_host(TransferOptions::default());
    let err = Error::from(host.next().unwrap().unwrap_err());
    assert_eq!(err.errno(), errno::ENOMEM, "{err}");
    assert!(host.next().is_none());
}

/// A source that claims a device type and yields nothing.
struct Claiming(ArrowDeviceType);

impl DeviceBatchSource for Claiming {
    fn schema(&self) -> SchemaRef {
        schema()
    }
    fn device_type(&self) -> ArrowDeviceType {
        self.0
    }
    fn next_array(&mut self) -> Option<devarrow_abi::Result<devarrow_abi::DeviceArray>> {
        None
    }
}

#[test]
fn the_device_reader_refuses_a_stream_of_another_device() {
    for claimed in [
        ArrowDeviceType::CUDA,
        ArrowDeviceType::CUDA_HOST,
        ArrowDeviceType::ROCM,
    ] {
        match DeviceStreamReader::try_new(export_stream(Claiming(claimed)), cpu()) {
            Err(Error::UnsupportedDevice { found, .. }) => assert_eq!(found, claimed),
            other => panic!("{other:?}"),
        }
    }
    let reader =
        DeviceStreamReader::try_new(export_stream(Claiming(ArrowDeviceType::CPU)), cpu()).unwrap();
    assert_eq!(reader.count(), 0);
}

#[test]
fn an_early_dropped_device_reader_releases_its_stream_and_arrays() {
    let _w = watchdog("an_early_dropped_device_reader_releases_its_stream_and_arrays");
    let producer = InstrumentedDevice::new();
    let counters = Counters::default();
    let stream = export_reader_to_device(
        counters.reader(endless()),
        producer.clone(),
        StreamOptions::default(),
    )
    .unwrap();
    let mut reader = DeviceStreamReader::try_new(stream, cpu()).unwrap();
    let kept = reader.next_batch().unwrap().unwrap();
    drop(reader);
    assert_eq!(counters.drops(), 1, "the producer's thread stopped");
    assert_eq!(producer.live(), 1, "only the batch kept");
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    assert_eq!(transfer.to_host(&kept).unwrap(), batch(0));
    drop(kept);
    assert_eq!(producer.live(), 0);
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn async_producer_to_async_device_consumer_round_trips_every_type() {
    let _w = watchdog("async_producer_to_async_device_consumer_round_trips_every_type");
    let batches = every_type_batches();
    for capacity in [1, 4] {
        let producer_device = InstrumentedDevice::new();
        let (handler, consumer) = device_batch_handler(cpu(), capacity).unwrap();
        let producer = spawn_device_producer_into(
            batches[0].schema(),
            stream::iter(batches.clone().into_iter().map(Ok::<_, ArrowError>)),
            producer_device.clone(),
            StreamOptions::default(),
            handler,
        )
        .unwrap();
        assert_eq!(
            block_on(consumer.schema()).unwrap(),
            sample::every_type_schema()
        );
        assert_eq!(consumer.device().device_type(), ArrowDeviceType::CPU);
        let on_device: Vec<_> = block_on(consumer.collect::<Vec<_>>());
        producer.join().unwrap();
        assert_eq!(producer_device.live(), batches.len(), "zero-copy imports");
        assert_batches_eq(&batches, &download_all(on_device));
        assert_eq!(producer_device.live(), 0, "every array released");
    }
}

#[test]
// Every type (or thousands of rows) through the staging pipeline: many minutes under Miri.
#[cfg_attr(miri, ignore)]
fn async_producer_to_async_host_consumer_round_trips() {
    let _w = watchdog("async_producer_to_async_host_consumer_round_trips");
    let batches = every_type_batches();
    let (handler, consumer) = device_batch_handler(cpu(), 2).unwrap();
    let producer = spawn_device_producer_into(
        batches[0].schema(),
        stream::iter(batches.clone().into_iter().map(Ok::<_, ArrowError>)),
        cpu(),
        StreamOptions::default(),
        handler,
    )
    .unwrap();
    let mut consumer = consumer;
    // One batch taken on the device, then the rest downloaded.
    let first = block_on(consumer.next()).unwrap().unwrap();
    let host = consumer.into_record_batches(TransferOptions::default());
    assert_eq!(
        block_on(host.schema()).unwrap(),
        sample::every_type_schema()
    );
    let mut back = vec![Transfer::new(cpu(), TransferOptions::default())
        .to_host(&first)
        .unwrap()];
    back.extend(block_on(host.map(|b| b.unwrap()).collect::<Vec<_>>()));
    assert_batches_eq(&batches, &back);
    producer.join().unwrap();
}

#[test]
fn the_async_device_consumer_applies_back_pressure() {
    let _w = watchdog("the_async_device_consumer_applies_back_pressure");
    for (capacity, read_ahead) in [(1, 0), (2, 2)] {
        let counters = Counters::default();
        let producer_device = InstrumentedDevice::new();
        let source = counting(
            stream::iter((0..).map(|k| Ok::<_, ArrowError>(batch(k)))),
            &counters,
        );
        let (handler, mut consumer) = device_batch_handler(cpu(), capacity).unwrap();
        let producer = spawn_device_producer_into(
            schema(),
            source,
            producer_device.clone(),
            StreamOptions::default().with_read_ahead(read_ahead),
            handler,
        )
        .unwrap();
        // `capacity` requested, one more taken by the abi producer ahead of the demand,
        // `read_ahead` uploads ahead of the producer.
        counters.settle_at(capacity + 1 + read_ahead, "nothing taken yet");
        let mut transfer = Transfer::new(cpu(), TransferOptions::default());
        for k in 0..3 {
            let b = block_on(consumer.next()).unwrap().unwrap();
            assert_eq!(transfer.to_host(&b).unwrap(), batch(k));
            counters.settle_at(capacity + k + 2 + read_ahead, "after k + 1 taken");
        }
        drop(consumer); // cancels the producer, releases the queued arrays
        producer.join().unwrap();
        assert_eq!(counters.drops(), 1);
        assert_eq!(producer_device.live(), 0, "nothing leaked");
    }
}

#[test]
fn the_async_device_consumer_reads_the_abi_cpu_producer_and_its_errors() {
    let _w = watchdog("the_async_device_consumer_reads_the_abi_cpu_producer_and_its_errors");
    let items: Vec<Result<RecordBatch, ArrowError>> =
        vec![Ok(batch(0)), Ok(batch(1)), Err(io_error("link down"))];
    let (handler, consumer) = device_batch_handler(cpu(), 2).unwrap();
    // SAFETY: a handler from `device_batch_handler` stays valid until its release.
    let producer = unsafe {
        devarrow_abi::async_stream::produce_record_batch_iter(schema(), items, handler.into_raw())
    }
    .unwrap();
    let got: Vec<_> = block_on(consumer.collect::<Vec<_>>());
    assert_eq!(got.len(), 3);
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    for (k, on_device) in got.iter().take(2).enumerate() {
        assert_eq!(
            transfer.to_host(on_device.as_ref().unwrap()).unwrap(),
            batch(k)
        );
    }
    match &got[2] {
        Err(Error::Callback {
            operation: "on_error",
            code,
            message,
        }) => {
            assert_eq!(*code, errno::EIO);
            assert!(message.contains("link down"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(producer.join().is_err());
}

// ---------------------------------------------------------------------------------------
// A consumer like Arrow C++'s, on a failing stream (issue #25)
// ---------------------------------------------------------------------------------------

/// What the Arrow-C++-like handler below records: the tasks it queued (never extracted),
/// the error, the release.
#[derive(Default)]
struct DroppingConsumer {
    tasks: std::sync::Mutex<Vec<devarrow_abi::ArrowAsyncTask>>,
    error: std::sync::Mutex<Option<std::ffi::c_int>>,
    released: (std::sync::Mutex<bool>, std::sync::Condvar),
}

// SAFETY: the tasks are two plain words each; the spec lets any thread handle them.
unsafe impl Send for DroppingConsumer {}
// SAFETY: as above; every field is behind a Mutex.
unsafe impl Sync for DroppingConsumer {}

/// # Safety
/// `handler` is one made in the test below, its consumer alive.
unsafe fn dropping<'a>(
    handler: *mut devarrow_abi::ArrowAsyncDeviceStreamHandler,
) -> &'a DroppingConsumer {
    // SAFETY: private_data is `Arc::as_ptr` of the consumer, which the test keeps alive.
    unsafe { &*((*handler).private_data as *const DroppingConsumer) }
}

unsafe extern "C" fn dropping_on_schema(
    handler: *mut devarrow_abi::ArrowAsyncDeviceStreamHandler,
    schema: *mut devarrow_abi::ArrowSchema,
) -> std::ffi::c_int {
    // SAFETY: valid for the call; moved out and released.
    drop(unsafe { arrow_schema::ffi::FFI_ArrowSchema::from_raw(schema) });
    // SAFETY: the producer set its struct before on_schema and it is live during it.
    unsafe {
        let producer = (*handler).producer;
        // Arrow C++'s default queue size.
        ((*producer).request.unwrap())(producer, 5);
    }
    0
}

unsafe extern "C" fn dropping_on_next_task(
    handler: *mut devarrow_abi::ArrowAsyncDeviceStreamHandler,
    task: *mut devarrow_abi::ArrowAsyncTask,
    _metadata: *const std::ffi::c_char,
) -> std::ffi::c_int {
    if !task.is_null() {
        // SAFETY: called by the producer with our handler; the task is valid during the
        // call and copied to keep it.
        unsafe {
            dropping(handler)
                .tasks
                .lock()
                .unwrap()
                .push(std::ptr::read(task))
        };
    }
    0
}

unsafe extern "C" fn dropping_on_error(
    handler: *mut devarrow_abi::ArrowAsyncDeviceStreamHandler,
    code: std::ffi::c_int,
    _message: *const std::ffi::c_char,
    _metadata: *const std::ffi::c_char,
) {
    // SAFETY: called by the producer with our handler.
    *unsafe { dropping(handler) }.error.lock().unwrap() = Some(code);
}

unsafe extern "C" fn dropping_release(handler: *mut devarrow_abi::ArrowAsyncDeviceStreamHandler) {
    // SAFETY: called by the producer with our handler.
    let c = unsafe { dropping(handler) };
    *c.released.0.lock().unwrap() = true;
    c.released.1.notify_all();
}

/// Arrow C++'s consumer returns a producer's error before it pops its queue and drops the
/// queued tasks without extracting them; the source fails after 3 batches, which the
/// producer uploaded and handed out (it reads one ahead, so the error overtakes them).
/// The producer reclaims them: no device upload stays allocated (before the fix: the
/// three uploads stayed for the life of the process).
#[test]
fn a_failing_device_producer_frees_the_uploads_a_consumer_like_arrow_cpp_drops() {
    let _w = watchdog("a_failing_device_producer_frees_the_uploads");
    let device = InstrumentedDevice::new();
    let consumer = Arc::new(DroppingConsumer::default());
    let mut handler = Box::new(devarrow_abi::ArrowAsyncDeviceStreamHandler {
        on_schema: Some(dropping_on_schema),
        on_next_task: Some(dropping_on_next_task),
        on_error: Some(dropping_on_error),
        release: Some(dropping_release),
        producer: std::ptr::null_mut(),
        private_data: Arc::as_ptr(&consumer) as *mut std::ffi::c_void,
    });
    let source = stream::iter((0..4).map(|k| {
        if k < 3 {
            Ok(batch(k))
        } else {
            Err(ArrowError::ComputeError("the source failed".into()))
        }
    }));
    // SAFETY: the handler outlives the producer (dropped after its release).
    let producer = unsafe {
        devarrow_bridge::spawn_device_producer(
            schema(),
            source,
            device.clone(),
            StreamOptions::default(),
            &mut *handler,
        )
    }
    .unwrap();
    assert!(producer.join().is_err());
    assert!(*consumer.released.0.lock().unwrap());
    assert_eq!(*consumer.error.lock().unwrap(), Some(errno::EINVAL));
    let tasks = std::mem::take(&mut *consumer.tasks.lock().unwrap());
    assert_eq!(tasks.len(), 3, "the error overtook the queued tasks");
    // Dropped without extract_data, as Arrow C++ does.
    drop(tasks);
    assert_eq!(device.live(), 0, "no device upload stays allocated");
    drop(handler);
}
