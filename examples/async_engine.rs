//! An async engine's record batch stream through a device and back.
//!
//! The engine's output is an arrow-rs `RecordBatchStream` (`arrow_array::nonblocking`),
//! boxed as `Pin<Box<dyn RecordBatchStream + Send>>`: the shape of DataFusion's
//! `SendableRecordBatchStream`, built here from arrow-rs and `futures` alone. devarrow
//!
//! 1. uploads it to the device with read-ahead (`UploadStream::from_record_batch_stream`,
//!    on a background thread, two batches ahead of the consumer);
//! 2. the consumer works on each device batch (reads its device buffers, then a simulated
//!    kernel) while the next batches upload, and hands the batch on as an
//!    `ArrowDeviceArray` through the C async device stream (`spawn_producer_into`);
//! 3. the receiving end (`device_batch_handler`) imports each array zero-copy and
//!    downloads it, as a stream that implements `RecordBatchStream` again
//!    (`AsyncHostBatchStream::ready` -> `HostRecordBatchStream`);
//!
//! and the example checks that the values that come back equal the input, and prints how
//! long the consumer waited for uploads against how long it worked.
//!
//! Runs on a GPU when `select_device(DeviceRequest::Auto)` finds one, on the CPU device
//! otherwise:
//!
//! ```sh
//! cargo run --example async_engine -- [BATCHES] [ROWS]
//! ```

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arrow_array::nonblocking::RecordBatchStream;
use arrow_array::{ArrayRef, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use devarrow::abi::async_stream::spawn_producer_into;
use devarrow::bridge::{
    device_batch_handler, DeviceBatch, StreamOptions, TransferOptions, UploadStream,
};
use devarrow::{select_device, DeviceRequest};
use futures::executor::block_on;
use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt};

/// DataFusion's name for the stream an operator returns.
type SendableRecordBatchStream = Pin<Box<dyn RecordBatchStream + Send>>;

/// How long the consumer's simulated kernel takes per batch.
const WORK: Duration = Duration::from_millis(20);

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("price", DataType::Float64, true),
        Field::new("tag", DataType::Utf8, true),
    ]))
}

/// Batch `k` of the engine's output: `rows` rows, some nulls.
fn generate(k: usize, rows: usize) -> RecordBatch {
    let first = (k * rows) as i64;
    let ids = first..first + rows as i64;
    let id: ArrayRef = Arc::new(Int64Array::from_iter_values(ids.clone()));
    let price: ArrayRef = Arc::new(Float64Array::from_iter(
        ids.clone().map(|i| (i % 7 != 0).then_some(i as f64 * 0.25)),
    ));
    let tag: ArrayRef = Arc::new(StringArray::from_iter(
        ids.map(|i| (i % 11 != 0).then(|| format!("tag-{}", i % 1000))),
    ));
    RecordBatch::try_new(schema(), vec![id, price, tag]).expect("columns match the schema")
}

/// A stream of record batches with its schema: what an engine's operator returns.
struct EngineOutput {
    schema: SchemaRef,
    batches: BoxStream<'static, Result<RecordBatch, ArrowError>>,
}

impl Stream for EngineOutput {
    type Item = Result<RecordBatch, ArrowError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.batches.poll_next_unpin(cx)
    }
}

impl RecordBatchStream for EngineOutput {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }
}

/// `batches` batches of `rows` rows, generated as they are polled.
fn engine_output(batches: usize, rows: usize) -> SendableRecordBatchStream {
    Box::pin(EngineOutput {
        schema: schema(),
        batches: stream::iter(0..batches)
            .map(move |k| Ok(generate(k, rows)))
            .boxed(),
    })
}

/// What the consumer measured.
#[derive(Debug, Default)]
struct Consumer {
    batches: usize,
    device_bytes: usize,
    buffers: usize,
    first_wait: Duration,
    later_waits: Duration,
    work: Duration,
    last_done: Option<Instant>,
}

impl Consumer {
    /// The consumer's work on a batch on the device: reads its device buffers' layout
    /// (what a kernel launch needs), then the kernel itself (simulated).
    fn work(&mut self, batch: &DeviceBatch, started: Instant) {
        let now = Instant::now();
        match self.last_done {
            None => self.first_wait = now - started,
            Some(done) => self.later_waits += now - done,
        }
        for column in batch.columns() {
            for buffer in column.buffers().into_iter().flatten() {
                self.buffers += 1;
                self.device_bytes += buffer.len();
            }
        }
        std::thread::sleep(WORK);
        self.batches += 1;
        let done = Instant::now();
        self.work += done - now;
        self.last_done = Some(done);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let batches: usize = args.next().map_or(Ok(8), |a| a.parse())?;
    let rows: usize = args.next().map_or(Ok(20_000), |a| a.parse())?;

    let selected = select_device(DeviceRequest::Auto)?;
    match &selected.fallback {
        None => println!("device: {} ({})", selected.name, selected.id),
        Some(why) => println!("device: {} ({why})", selected.name),
    }
    let device = selected.device.clone();

    // The engine's output, as DataFusion would hand it over.
    let source = engine_output(batches, rows);
    let schema = source.schema().clone();
    let started = Instant::now();

    // 1. Upload, two batches ahead of the consumer.
    let options = StreamOptions::default().with_read_ahead(2);
    let uploads = UploadStream::from_record_batch_stream(source, device.clone(), options)?;

    // 2. The consumer's work on each device batch, overlapping the next uploads; then each
    //    batch goes on as a device array (its sync event marks the upload).
    let consumer = Arc::new(Mutex::new(Consumer::default()));
    let worked = {
        let consumer = consumer.clone();
        uploads.map(move |item| {
            let batch = item?;
            consumer.lock().expect("not poisoned").work(&batch, started);
            batch.export().map(|(array, _schema)| array)
        })
    };

    // 3. The receiving end, on the same device: imports, downloads, and is a
    //    RecordBatchStream once the producer's schema has arrived.
    let (handler, on_device) = device_batch_handler(device.clone(), 2)?;
    let producer = spawn_producer_into(schema.clone(), device.device_type(), worked, handler)?;
    let mut results: SendableRecordBatchStream = Box::pin(block_on(
        on_device
            .into_record_batches(TransferOptions::default())
            .ready(),
    )?);
    assert_eq!(results.schema(), &schema);

    let mut checked_rows = 0;
    let mut k = 0;
    while let Some(batch) = block_on(results.next()) {
        let batch = batch?;
        if batch != generate(k, rows) {
            return Err(format!("batch {k} came back different").into());
        }
        checked_rows += batch.num_rows();
        k += 1;
    }
    producer.join()?;
    let elapsed = started.elapsed();
    if k != batches {
        return Err(format!("{k} batches came back, {batches} went in").into());
    }

    let consumer = consumer.lock().expect("not poisoned");
    println!(
        "uploaded {} batches ({} rows, {:.1} MB in {} device buffers) with read-ahead 2",
        consumer.batches,
        checked_rows,
        consumer.device_bytes as f64 / 1e6,
        consumer.buffers
    );
    // Without read-ahead, every batch would wait about as long as the first one did.
    let later = consumer.batches.saturating_sub(1);
    let unhidden = consumer.first_wait * later as u32;
    let hidden = 1.0 - consumer.later_waits.as_secs_f64() / unhidden.as_secs_f64().max(1e-9);
    println!(
        "consumer: worked {:.0?} ({WORK:?} a batch); waited {:.1?} for the first upload, then \
         {:.1?} for the {later} later ones together, against ~{:.0?} without read-ahead \
         ({:.0}% of the upload time hidden behind its work)",
        consumer.work,
        consumer.first_wait,
        consumer.later_waits,
        unhidden,
        100.0 * hidden.max(0.0)
    );
    println!(
        "downloaded through a RecordBatchStream (schema {}): {k} batches equal to the input, \
         {elapsed:.0?} in all",
        results
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
