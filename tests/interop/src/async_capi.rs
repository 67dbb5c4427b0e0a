//! The async device stream functions of `libdevarrow_interop.so`: devarrow's producer
//! driving a foreign `ArrowAsyncDeviceStreamHandler`, and devarrow's consumer handler for
//! a foreign producer. Return codes and [`devarrow_interop_last_error`](crate::capi::devarrow_interop_last_error)
//! work as in [`crate::capi`].

use std::ffi::c_int;

use arrow_array::RecordBatch;
use devarrow_abi::async_stream::{
    async_handler, spawn_producer_with, AsyncDeviceArrayStream, Metadata, ProducerOptions,
    WithMetadata,
};
use devarrow_abi::cpu;
use devarrow_abi::error::{Error, Result};
use devarrow_abi::{ArrowAsyncDeviceStreamHandler, ArrowDeviceType, DeviceArray};

use crate::capi::{check_out, mismatch, run};
use crate::sample;

/// The per-task metadata key of the interop producer: the batch's index.
pub const BATCH_KEY: &str = "devarrow.interop.batch";

/// Sample `i % SAMPLES`: the batches of the async streams cycle through the samples.
fn cycled_sample(i: usize) -> RecordBatch {
    let which = (i % sample::SAMPLES as usize) as c_int;
    sample::sample(which).expect("which < SAMPLES")
}

fn cycled_sample_array(i: usize) -> DeviceArray {
    let which = (i % sample::SAMPLES as usize) as c_int;
    cpu::export_array_data(&sample::sample_data(which).expect("which < SAMPLES"))
}

/// Starts devarrow's async producer (on a thread of its own) driving `handler` with
/// `n_batches` CPU record batches: batch `i` is sample `i % devarrow_interop_sample_count()`,
/// its task's metadata `devarrow.interop.batch` = `i`; the producer's
/// `additional_metadata` has the stream's row and batch counts (`devarrow.num_rows`,
/// `devarrow.num_batches`).
///
/// Returns at once; the producer then calls `on_schema`, one `on_next_task` per unit
/// requested, the NULL end task and `release`. On failure the handler has been released
/// already unless it was NULL or had no `release` callback.
///
/// # Safety
/// `handler` must be NULL or point to a valid `ArrowAsyncDeviceStreamHandler` that stays
/// valid until its `release` is called.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_async_produce_samples(
    handler: *mut ArrowAsyncDeviceStreamHandler,
    n_batches: c_int,
) -> c_int {
    run(|| {
        let n = usize::try_from(n_batches)
            .map_err(|_| Error::InvalidArgument(format!("n_batches = {n_batches} < 0")))?;
        let rows: usize = (0..n).map(|i| cycled_sample(i).num_rows()).sum();
        let options = ProducerOptions::new()
            .with_num_rows(rows as u64)
            .with_num_batches(n as u64);
        let items = futures::stream::iter((0..n).map(|i| {
            let metadata = Metadata::new().with(BATCH_KEY, i.to_string());
            Ok::<_, Error>(WithMetadata::new(cycled_sample_array(i), metadata))
        }));
        // SAFETY: forwarded to the caller. The producer runs detached: the handle is
        // dropped, the driver thread ends after `release`.
        unsafe {
            spawn_producer_with(
                sample::every_type_schema(),
                ArrowDeviceType::CPU,
                items,
                options,
                handler,
            )
        }?;
        Ok(())
    })
}

/// A devarrow async consumer: the Rust stream behind a handler from
/// [`devarrow_interop_async_consumer_new`].
#[derive(Debug)]
pub struct DevarrowAsyncConsumer {
    stream: AsyncDeviceArrayStream,
}

/// Creates a devarrow async consumer (`async_handler(capacity)`): `*out_handler` is the
/// handler to give to a producer (which must release it), `*out` the consumer to check
/// and free with [`devarrow_interop_async_consumer_check`].
///
/// # Safety
/// `out` and `out_handler` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_async_consumer_new(
    capacity: i64,
    out: *mut *mut DevarrowAsyncConsumer,
    out_handler: *mut *mut ArrowAsyncDeviceStreamHandler,
) -> c_int {
    run(|| {
        check_out(out, "DevarrowAsyncConsumer* out")?;
        check_out(out_handler, "ArrowAsyncDeviceStreamHandler* out")?;
        let capacity = usize::try_from(capacity)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("capacity = {capacity} <= 0")))?;
        let (handler, stream) = async_handler(capacity);
        let consumer = Box::new(DevarrowAsyncConsumer { stream });
        // SAFETY: both pointers are non-null and valid for writes (caller contract).
        unsafe {
            *out_handler = handler.into_raw();
            *out = Box::into_raw(consumer);
        }
        Ok(())
    })
}

/// Reads a consumer's stream and frees the consumer (also on failure).
///
/// With `take < 0`, reads to the end and compares: the schema with the samples' schema,
/// and `n_batches` batches, batch `i` equal (values, schema metadata) to sample
/// `i % devarrow_interop_sample_count()`, then the end. With `take >= 0`, reads and checks
/// only the first `take` batches, then drops the stream early (which cancels the
/// producer). The producer's metadata must be absent (Arrow C++'s producer sends none):
/// no `additional_metadata`, empty metadata with every task. A failure of the producer
/// (its `on_error`) is returned with its code.
///
/// # Safety
/// `consumer` must be NULL or come from [`devarrow_interop_async_consumer_new`], not yet
/// freed.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_async_consumer_check(
    consumer: *mut DevarrowAsyncConsumer,
    n_batches: c_int,
    take: c_int,
) -> c_int {
    run(|| {
        if consumer.is_null() {
            return Err(Error::NullPointer {
                what: "DevarrowAsyncConsumer",
            });
        }
        // SAFETY: from `devarrow_interop_async_consumer_new` (caller contract); freed here.
        let consumer = unsafe { Box::from_raw(consumer) };
        let n = usize::try_from(n_batches)
            .map_err(|_| Error::InvalidArgument(format!("n_batches = {n_batches} < 0")))?;
        futures::executor::block_on(check_stream(consumer.stream, n, usize::try_from(take).ok()))
    })
}

async fn check_stream(
    mut stream: AsyncDeviceArrayStream,
    n_batches: usize,
    take: Option<usize>,
) -> Result<()> {
    let schema = stream.schema().await?;
    if let Some(metadata) = stream.additional_metadata() {
        return Err(mismatch(
            "the async stream's additional_metadata",
            format!("expected NULL, got {metadata:?}"),
        ));
    }
    let expected_schema = sample::every_type_schema();
    if schema != expected_schema {
        return Err(mismatch(
            "the async stream's schema",
            format!("expected {expected_schema:#?}\ngot {schema:#?}"),
        ));
    }
    let limit = take.unwrap_or(usize::MAX);
    let mut got = 0;
    while got < limit {
        let Some(item) = stream.next_with_metadata().await else {
            break;
        };
        let WithMetadata {
            data: array,
            metadata,
        } = item?;
        if !metadata.is_empty() {
            return Err(mismatch(
                &format!("the metadata of batch {got}"),
                format!("expected none, got {metadata:?}"),
            ));
        }
        if got >= n_batches {
            return Err(mismatch(
                "the async stream",
                format!("more than the {n_batches} expected batches"),
            ));
        }
        let batch = cpu::import_record_batch_with_schema(array, schema.clone())?;
        let expected = cycled_sample(got);
        if let Some(d) = sample::describe_difference(&expected, &batch) {
            return Err(mismatch(&format!("batch {got} of the async stream"), d));
        }
        got += 1;
    }
    if take.is_none() && got != n_batches {
        return Err(mismatch(
            "the async stream",
            format!("{got} batches, expected {n_batches}"),
        ));
    }
    Ok(())
}
