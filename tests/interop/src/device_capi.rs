//! The device functions of `libdevarrow_interop.so`, for a C program that uses only
//! `include/arrow_c_device.h` and the CUDA driver (`c/device_interop.c`, built and run by
//! `tests/c_program.rs`): devarrow's device arrays, device stream and async producer read
//! by C, and C's device arrays and async producer read by devarrow, on the CPU device or
//! on CUDA device 0. Return codes and
//! [`devarrow_interop_last_error`](crate::capi::devarrow_interop_last_error) work as in
//! [`crate::capi`].
//!
//! The data are the "C batches" ([`c_batch`]), simple enough for the C program to know
//! every value: 20 rows of a nullable int32 column `i` and a nullable utf8 column `s`;
//! `which` 0 is all of them, 1 and 2 rows 3..14 (the C program exports 1 with offsets on
//! the columns, 2 with the offset on the root struct; devarrow exports both as it likes).

use std::ffi::{c_char, c_int, CString};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use arrow_array::{ArrayRef, Int32Array, RecordBatch, RecordBatchIterator, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use devarrow_abi::async_stream::{spawn_producer, ProducerHandle};
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::error::{errno, Error, Result};
use devarrow_abi::{
    take_schema, ArrowAsyncDeviceStreamHandler, ArrowDeviceArray, ArrowDeviceArrayStream,
    ArrowSchema, DeviceArray,
};
use devarrow_bridge::select::{select_device, DeviceRequest};
use devarrow_bridge::{
    device_batch_handler, export_reader_to_device, AsyncHostBatchStream, DeviceBatch,
    ExportOptions, StreamOptions, Transfer, TransferOptions, UploadStream,
};
use devarrow_testing::release::count_releases;
use futures::StreamExt;

use crate::capi::{check_out, mismatch, run};
use crate::sample::describe_difference;

/// Rows of the C batch `which` = 0.
pub const C_ROWS: usize = 20;
/// The rows of the sliced C batches (`which` 1 and 2): `C_SLICE.0 .. C_SLICE.0 + C_SLICE.1`.
pub const C_SLICE: (usize, usize) = (3, 11);

/// The schema of the C batches: `i` (int32, nullable), `s` (utf8, nullable), no metadata.
pub fn c_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("i", DataType::Int32, true),
        Field::new("s", DataType::Utf8, true),
    ]))
}

/// C batch `which` (0, 1 or 2; see the module documentation). Row `r` of the whole batch:
/// `i` = `7 r - 50`, null when `r % 3 == 1`; `s` null when `r % 4 == 2`, else `r % 5 == 0`
/// ? "" : the `r % 7 + 1` letters `'a' + (r + k) % 26`. The C program computes the same.
pub fn c_batch(which: c_int) -> Option<RecordBatch> {
    let i = Int32Array::from_iter((0..C_ROWS as i32).map(|r| (r % 3 != 1).then_some(7 * r - 50)));
    let s = StringArray::from_iter((0..C_ROWS).map(|r| {
        (r % 4 != 2).then(|| {
            let len = if r % 5 == 0 { 0 } else { r % 7 + 1 };
            (0..len)
                .map(|k| char::from(b'a' + ((r + k) % 26) as u8))
                .collect::<String>()
        })
    }));
    let columns: Vec<ArrayRef> = vec![Arc::new(i), Arc::new(s)];
    let batch = RecordBatch::try_new(c_schema(), columns).expect("the columns match");
    match which {
        0 => Some(batch),
        1 | 2 => Some(batch.slice(C_SLICE.0, C_SLICE.1)),
        _ => None,
    }
}

fn c_batch_or_err(which: c_int) -> Result<RecordBatch> {
    c_batch(which).ok_or_else(|| Error::InvalidArgument(format!("no C batch {which} (0..=2)")))
}

/// A device opened by [`devarrow_interop_open`].
#[derive(Debug)]
pub struct DevarrowInteropDevice {
    device: Arc<dyn Device>,
    description: CString,
}

/// # Safety
/// `device` must be NULL or come from [`devarrow_interop_open`], not yet closed.
unsafe fn device_ref<'a>(
    device: *const DevarrowInteropDevice,
) -> Result<&'a DevarrowInteropDevice> {
    // SAFETY: the caller's guarantee.
    unsafe { device.as_ref() }.ok_or(Error::NullPointer {
        what: "DevarrowInteropDevice",
    })
}

/// Opens the CPU device (`cuda == 0`) or CUDA device 0 (`cuda != 0`, on its primary
/// context, with a stream of its own) into `*out`. Fails (`EIO`, the reason in the last
/// error) when CUDA device 0 does not open. Close it with [`devarrow_interop_close`].
///
/// # Safety
/// `out` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_open(
    cuda: c_int,
    out: *mut *mut DevarrowInteropDevice,
) -> c_int {
    run(|| {
        check_out(out, "DevarrowInteropDevice* out")?;
        let device: Arc<dyn Device> = if cuda == 0 {
            Arc::new(CpuDevice::new())
        } else {
            select_device(DeviceRequest::Cuda(0))
                .map_err(|e| Error::Device {
                    device: "CUDA",
                    source: Box::new(e),
                })?
                .device
        };
        let description = format!("{:?} device {}", device.device_type(), device.device_id());
        let opened = Box::new(DevarrowInteropDevice {
            device,
            description: CString::new(description).expect("no NUL"),
        });
        // SAFETY: `out` is non-null and valid for writes (caller contract).
        unsafe { *out = Box::into_raw(opened) };
        Ok(())
    })
}

/// Closes a device from [`devarrow_interop_open`] (NULL: nothing). What was exported from
/// it stays valid.
///
/// # Safety
/// `device` must be NULL or come from [`devarrow_interop_open`], not yet closed.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_close(device: *mut DevarrowInteropDevice) {
    if !device.is_null() {
        // SAFETY: from `devarrow_interop_open` (caller contract), freed once.
        drop(unsafe { Box::from_raw(device) });
    }
}

/// The device's type and id in words (valid until it is closed); "" for NULL.
///
/// # Safety
/// `device` must be NULL or come from [`devarrow_interop_open`], not yet closed.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_describe(
    device: *const DevarrowInteropDevice,
) -> *const c_char {
    // SAFETY: the caller's guarantee.
    match unsafe { device.as_ref() } {
        Some(device) => device.description.as_ptr(),
        None => c"".as_ptr(),
    }
}

/// Uploads C batch `which` to the device with a devarrow `Transfer` and exports it into
/// `out` and `out_schema` (`DeviceBatch::export_to`): a struct array whose `sync_event`
/// (on CUDA a `CUevent*`) marks the upload.
///
/// # Safety
/// `device` as for [`devarrow_interop_close`]; `out` and `out_schema` must be valid for
/// writes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_export(
    device: *const DevarrowInteropDevice,
    which: c_int,
    out: *mut ArrowDeviceArray,
    out_schema: *mut ArrowSchema,
) -> c_int {
    run(|| {
        // SAFETY: the caller's guarantee.
        let device = unsafe { device_ref(device)? };
        let batch = c_batch_or_err(which)?;
        let mut transfer = Transfer::new(device.device.clone(), TransferOptions::default());
        let on_device = transfer.to_device(&batch)?;
        // SAFETY: the caller guarantees both destinations are writable.
        unsafe { on_device.export_to(ExportOptions::default(), out, out_schema) }
    })
}

/// Exports C batches 0, 1 and 0 as a device stream of the device's type
/// (`export_reader_to_device`: uploaded ahead on a thread of its own) into `out`.
///
/// # Safety
/// `device` as for [`devarrow_interop_close`]; `out` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_export_stream(
    device: *const DevarrowInteropDevice,
    out: *mut ArrowDeviceArrayStream,
) -> c_int {
    run(|| {
        // SAFETY: the caller's guarantee.
        let device = unsafe { device_ref(device)? };
        check_out(out, "ArrowDeviceArrayStream out")?;
        let batches = [0, 1, 0].map(|which| Ok(c_batch(which).expect("0 and 1 exist")));
        let reader = RecordBatchIterator::new(batches, c_schema());
        let stream = export_reader_to_device(
            Box::new(reader),
            device.device.clone(),
            StreamOptions::default(),
        )?;
        // SAFETY: `out` is non-null and valid for writes (caller contract).
        unsafe { stream.move_into(out) };
        Ok(())
    })
}

/// Imports a C producer's device array and schema on the device
/// (`DeviceBatch::import_raw`: the device's stream waits on its `sync_event`), downloads
/// the batch with a `Transfer` and compares it with C batch `which`: 0 when equal, `EINVAL`
/// with the differences otherwise, or the import's error (an array on another device, or
/// not matching its schema). Both structs are moved in, whatever happens: the schema is
/// released before this returns, the array once devarrow is done with it (at the latest
/// before this returns).
///
/// # Safety
/// `device` as for [`devarrow_interop_close`]; `array` and `schema` as for
/// `DeviceBatch::import_raw`.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_import_check(
    device: *const DevarrowInteropDevice,
    which: c_int,
    array: *mut ArrowDeviceArray,
    schema: *mut ArrowSchema,
) -> c_int {
    run(|| {
        // SAFETY: the caller's guarantee.
        let device = match unsafe { device_ref(device) } {
            Ok(device) => device.device.clone(),
            Err(e) => {
                // Moved in all the same: released here.
                // SAFETY: the caller's guarantee for `schema` and `array`.
                drop(unsafe { take_schema(schema) });
                // SAFETY: as above.
                drop(unsafe { DeviceArray::from_raw(array) });
                return Err(e);
            }
        };
        // SAFETY: the caller's guarantee.
        let batch = unsafe { DeviceBatch::import_raw(device.clone(), array, schema)? };
        let host = Transfer::new(device, TransferOptions::default()).to_host(&batch)?;
        drop(batch);
        let expected = c_batch_or_err(which)?;
        match describe_difference(&expected, &host) {
            None => Ok(()),
            Some(d) => Err(mismatch(&format!("the imported C batch {which}"), d)),
        }
    })
}

/// A devarrow async consumer on a device, from [`devarrow_interop_device_async_consumer_new`].
#[derive(Debug)]
pub struct DevarrowInteropAsyncConsumer {
    batches: AsyncHostBatchStream,
}

/// Creates devarrow's async consumer on the device (`device_batch_handler(capacity)`,
/// batches downloaded with `into_record_batches`): `*out_handler` is the handler to give
/// to a producer (which must release it), `*out` the consumer to read and free with
/// [`devarrow_interop_device_async_consumer_read`].
///
/// # Safety
/// `device` as for [`devarrow_interop_close`]; `out` and `out_handler` must be valid for
/// writes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_async_consumer_new(
    device: *const DevarrowInteropDevice,
    capacity: i64,
    out: *mut *mut DevarrowInteropAsyncConsumer,
    out_handler: *mut *mut ArrowAsyncDeviceStreamHandler,
) -> c_int {
    run(|| {
        // SAFETY: the caller's guarantee.
        let device = unsafe { device_ref(device)? };
        check_out(out, "DevarrowInteropAsyncConsumer* out")?;
        check_out(out_handler, "ArrowAsyncDeviceStreamHandler* out")?;
        let capacity = usize::try_from(capacity)
            .ok()
            .filter(|&c| c > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("capacity = {capacity} <= 0")))?;
        let (handler, stream) = device_batch_handler(device.device.clone(), capacity)?;
        let consumer = Box::new(DevarrowInteropAsyncConsumer {
            batches: stream.into_record_batches(TransferOptions::default()),
        });
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
/// Batch `k` must equal C batch `k % 3`, and the schema the C batches' schema. With
/// `take < 0`, reads to the end, which must come after `n_batches` batches. With
/// `take >= 0`, reads `take` batches, then drops the stream, which cancels the producer
/// (devarrow calls `cancel` once, and discards tasks that still arrive by extracting them
/// with NULL). A producer's `on_error` is returned with its code.
///
/// # Safety
/// `consumer` must be NULL or come from [`devarrow_interop_device_async_consumer_new`],
/// not yet freed.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_async_consumer_read(
    consumer: *mut DevarrowInteropAsyncConsumer,
    take: c_int,
    n_batches: c_int,
) -> c_int {
    run(|| {
        if consumer.is_null() {
            return Err(Error::NullPointer {
                what: "DevarrowInteropAsyncConsumer",
            });
        }
        // SAFETY: from `devarrow_interop_device_async_consumer_new` (caller contract);
        // freed here.
        let consumer = unsafe { Box::from_raw(consumer) };
        let take = usize::try_from(take).ok();
        futures::executor::block_on(read_c_batches(consumer.batches, take, n_batches))
    })
}

async fn read_c_batches(
    mut batches: AsyncHostBatchStream,
    take: Option<usize>,
    n_batches: c_int,
) -> Result<()> {
    let schema = batches.schema().await?;
    if schema != c_schema() {
        return Err(mismatch(
            "the async stream's schema",
            format!("expected {:#?}\ngot {schema:#?}", c_schema()),
        ));
    }
    let mut got = 0;
    while take.is_none_or(|take| got < take) {
        let Some(batch) = batches.next().await else {
            break;
        };
        let batch = batch?;
        let expected = c_batch((got % 3) as c_int).expect("0..=2 exist");
        if let Some(d) = describe_difference(&expected, &batch) {
            return Err(mismatch(&format!("batch {got} of the async stream"), d));
        }
        got += 1;
    }
    let expected = match take {
        Some(take) => take,
        None => usize::try_from(n_batches).unwrap_or(0),
    };
    if got != expected {
        return Err(mismatch(
            "the async stream",
            format!("{got} batches, expected {expected}"),
        ));
    }
    // Dropping `batches` here cancels the producer when it has not ended.
    Ok(())
}

/// A devarrow async producer started by [`devarrow_interop_device_async_produce`].
#[derive(Debug)]
pub struct DevarrowInteropAsyncProducer {
    handle: ProducerHandle,
    /// The release counters of every array exported so far.
    releases: Arc<Mutex<Vec<Arc<AtomicUsize>>>>,
    /// Set when the producer dropped its source of record batches.
    source_dropped: Arc<AtomicBool>,
}

/// Sets its flag when dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Starts devarrow's async producer on the device driving `handler`: `n_batches` batches,
/// batch `k` being C batch `k % 2`, uploaded ahead as `spawn_device_producer` does
/// (`UploadStream`, then `spawn_producer`), each exported array's `release` counted.
/// Returns at once with the running producer in `*out`; finish it with
/// [`devarrow_interop_device_async_produce_finish`].
///
/// The handler is released in every case except a NULL handler or one without `release`
/// (on failure here too).
///
/// # Safety
/// `device` as for [`devarrow_interop_close`]; `handler` must be NULL or point to a valid
/// handler that stays valid until its `release`; `out` must be valid for writes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_async_produce(
    device: *const DevarrowInteropDevice,
    n_batches: c_int,
    handler: *mut ArrowAsyncDeviceStreamHandler,
    out: *mut *mut DevarrowInteropAsyncProducer,
) -> c_int {
    run(|| {
        let checked = (|| {
            // SAFETY: the caller's guarantee.
            let device = unsafe { device_ref(device)? }.device.clone();
            check_out(out, "DevarrowInteropAsyncProducer* out")?;
            let n = usize::try_from(n_batches)
                .map_err(|_| Error::InvalidArgument(format!("n_batches = {n_batches} < 0")))?;
            Ok((device, n))
        })();
        let (device, n) = match checked {
            Ok(checked) => checked,
            Err(e) => {
                // SAFETY: the caller's guarantee for `handler`.
                unsafe { release_handler(handler) };
                return Err(e);
            }
        };
        let source_dropped = Arc::new(AtomicBool::new(false));
        let flag = DropFlag(source_dropped.clone());
        let source = futures::stream::iter(0..n).map(move |k| {
            let _alive = &flag;
            Ok::<_, Error>(c_batch((k % 2) as c_int).expect("0 and 1 exist"))
        });
        let releases = Arc::new(Mutex::new(Vec::new()));
        let counters = releases.clone();
        let count = move |array: DeviceArray| {
            let (array, count) = count_releases(array);
            counters
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(count);
            array
        };
        let device_type = device.device_type();
        let arrays = match UploadStream::spawn(c_schema(), source, device, StreamOptions::default())
        {
            Ok(uploads) => uploads
                .into_device_arrays()
                .map(move |item| item.map(&count))
                .left_stream(),
            Err(e) => futures::stream::once(futures::future::ready(Err(e))).right_stream(),
        };
        // SAFETY: the caller's guarantee for `handler`.
        let handle =
            unsafe { spawn_producer::<_, Error>(c_schema(), device_type, arrays, handler)? };
        let producer = Box::new(DevarrowInteropAsyncProducer {
            handle,
            releases,
            source_dropped,
        });
        // SAFETY: `out` is non-null and valid for writes (checked above; caller contract).
        unsafe { *out = Box::into_raw(producer) };
        Ok(())
    })
}

/// Releases a handler devarrow was handed but never used.
///
/// # Safety
/// `handler` must be NULL or point to a valid handler.
unsafe fn release_handler(handler: *mut ArrowAsyncDeviceStreamHandler) {
    // SAFETY: the caller's guarantee.
    if let Some(handler) = unsafe { handler.as_mut() } {
        if let Some(release) = handler.release {
            // SAFETY: a valid, unreleased handler; released once.
            unsafe { release(handler) };
        }
    }
}

/// Waits for a producer from [`devarrow_interop_device_async_produce`] to finish (after
/// it released the handler) and frees it. Returns 0 when its outcome's errno (0 when the
/// stream ended or was cancelled; the consumer's code when `on_next_task` returned one;
/// the code given to `on_error`) is `expected_rc`, it dropped its source, and every array
/// it exported (those extracted, and those it still held: a refused task's, the one it
/// took ahead) was released exactly once; `EINVAL` saying what differs otherwise.
/// `*out_arrays` (when not NULL) gets the number of arrays exported.
///
/// # Safety
/// `producer` must be NULL or come from [`devarrow_interop_device_async_produce`], not yet
/// finished; `out_arrays` must be NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_device_async_produce_finish(
    producer: *mut DevarrowInteropAsyncProducer,
    expected_rc: c_int,
    out_arrays: *mut c_int,
) -> c_int {
    run(|| {
        if producer.is_null() {
            return Err(Error::NullPointer {
                what: "DevarrowInteropAsyncProducer",
            });
        }
        // SAFETY: from `devarrow_interop_device_async_produce` (caller contract); freed here.
        let producer = unsafe { Box::from_raw(producer) };
        let outcome = producer.handle.join();
        let rc = match &outcome {
            Ok(()) => 0,
            Err(e) => match e.errno() {
                0 => errno::EINVAL,
                code => code,
            },
        };
        let counts: Vec<usize> = producer
            .releases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|count| count.load(Ordering::SeqCst))
            .collect();
        if !out_arrays.is_null() {
            // SAFETY: non-null, valid for writes (caller contract).
            unsafe { *out_arrays = counts.len() as c_int };
        }
        let mut problems = Vec::new();
        if rc != expected_rc {
            problems.push(format!(
                "the producer ended with errno {rc} ({outcome:?}), expected {expected_rc}"
            ));
        }
        if !producer.source_dropped.load(Ordering::SeqCst) {
            problems.push("the producer did not drop its source".to_string());
        }
        if counts.iter().any(|&c| c != 1) {
            problems.push(format!(
                "release calls of the exported arrays, in order: {counts:?} (each must be 1)"
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(mismatch("the async producer", problems.join("\n")))
        }
    })
}
