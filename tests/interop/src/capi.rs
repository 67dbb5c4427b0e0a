//! The C functions of `libdevarrow_interop.so`.
//!
//! Every function returns 0 on success or an errno-compatible code, with a description
//! of the failure in [`devarrow_interop_last_error`] (per thread). No panic crosses the
//! boundary: a panic is reported as `EIO`.
//!
//! Structs passed in (`ArrowDeviceArray`, `ArrowSchema`, `ArrowDeviceArrayStream`) are
//! always *moved* in, success or not: the caller's struct is marked released and the
//! library releases the data. Structs passed out are written to caller-allocated, released
//! storage and belong to the caller on success; on failure they are left untouched.
//!
//! The samples (`which`) are those of [`crate::sample::sample`]: 0 the every-type batch,
//! 1 its slice of rows 1..5 (every column with a nonzero offset), 2 an empty slice.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};

use arrow_array::ffi_stream::FFI_ArrowArrayStream;
use arrow_array::{RecordBatch, RecordBatchIterator};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{ArrowError, SchemaRef};
use devarrow_abi::boundary::catch_panic;
use devarrow_abi::cpu;
use devarrow_abi::error::{errno, Error, Result};
use devarrow_abi::stream::{self, DeviceArrayStreamReader, DeviceBatchSource};
use devarrow_abi::{ArrowDeviceArray, ArrowDeviceArrayStream, ArrowDeviceType, DeviceArray};

use crate::sample;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let message = CString::new(message.replace('\0', " ")).expect("NULs were replaced");
    LAST_ERROR.with(|e| *e.borrow_mut() = message);
}

/// Runs `f`, catching panics, and turns its outcome into a return code.
pub(crate) fn run(f: impl FnOnce() -> Result<()>) -> c_int {
    match catch_panic(f) {
        Ok(()) => {
            set_last_error("");
            0
        }
        Err(e) => {
            set_last_error(&e.to_string());
            match e.errno() {
                0 => errno::EINVAL,
                code => code,
            }
        }
    }
}

/// A mismatch between what was received and what was expected.
pub(crate) fn mismatch(what: &str, details: String) -> Error {
    Error::InvalidArgument(format!("{what} differs from the expected data:\n{details}"))
}

fn sample_or_err(which: c_int) -> Result<RecordBatch> {
    sample::sample(which).ok_or_else(|| {
        Error::InvalidArgument(format!("no sample {which} (there are {})", sample::SAMPLES))
    })
}

/// Moves a schema out of caller storage (marking it released); NULL is an error.
///
/// # Safety
/// `schema` must be NULL or point to a valid, writable `ArrowSchema`.
unsafe fn take_schema(schema: *mut FFI_ArrowSchema) -> Result<FFI_ArrowSchema> {
    if schema.is_null() {
        return Err(Error::NullPointer {
            what: "ArrowSchema",
        });
    }
    // SAFETY: the caller guarantees `schema` is valid for reads and writes; swapping in a
    // released schema is the C data interface's "move".
    let schema = unsafe { std::ptr::replace(schema, FFI_ArrowSchema::empty()) };
    cpu::check_schema(&schema)?;
    Ok(schema)
}

/// Moves a device array and its schema in (both, whatever happens), then imports them
/// with devarrow as a field and an array.
///
/// # Safety
/// Each pointer must be NULL or point to a valid, writable struct of its type.
unsafe fn take_array_and_schema(
    array: *mut ArrowDeviceArray,
    schema: *mut FFI_ArrowSchema,
) -> Result<(DeviceArray, FFI_ArrowSchema)> {
    // SAFETY: forwarded to the caller; both are moved before either can fail.
    let array = unsafe { DeviceArray::from_raw(array) };
    // SAFETY: as above.
    let schema = unsafe { take_schema(schema) };
    Ok((array?, schema?))
}

pub(crate) fn check_out<T>(ptr: *mut T, what: &'static str) -> Result<()> {
    if ptr.is_null() {
        return Err(Error::NullPointer { what });
    }
    Ok(())
}

/// The description of the last failure of a `devarrow_interop_*` call on this thread (an
/// empty string after a success). Valid until the next call on this thread.
#[no_mangle]
pub extern "C" fn devarrow_interop_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The number of samples (valid `which` are `0..count`).
#[no_mangle]
pub extern "C" fn devarrow_interop_sample_count() -> c_int {
    sample::SAMPLES
}

/// Exports sample `which` with devarrow as a CPU device array (a struct array: the record
/// batch) and its schema (schema and field metadata included).
///
/// # Safety
/// `out` and `out_schema` must point to writable storage for their structs.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_export_sample(
    which: c_int,
    out: *mut ArrowDeviceArray,
    out_schema: *mut FFI_ArrowSchema,
) -> c_int {
    run(|| {
        check_out(out, "ArrowDeviceArray out")?;
        check_out(out_schema, "ArrowSchema out")?;
        let batch = sample_or_err(which)?;
        let data = sample::sample_data(which).expect("every sample has data");
        let schema = FFI_ArrowSchema::try_from(batch.schema().as_ref())?;
        let array = cpu::export_array_data(&data);
        // SAFETY: both pointers are non-null and valid for writes (caller contract); the
        // structs move to the caller, who now owns their release.
        unsafe {
            std::ptr::write(out_schema, schema);
            array.move_into(out);
        }
        Ok(())
    })
}

/// Imports a CPU device array and its schema with devarrow (validated, zero-copy) as a
/// record batch and compares it with sample `which`: the schema with its metadata, every
/// field with its metadata, and every value. Returns 0 when equal, `EINVAL` with the
/// differences in the last error otherwise. Both structs are moved in.
///
/// # Safety
/// `array` and `schema` must be NULL or point to valid, writable structs of their types.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_check_sample(
    which: c_int,
    array: *mut ArrowDeviceArray,
    schema: *mut FFI_ArrowSchema,
) -> c_int {
    run(|| {
        // SAFETY: forwarded to the caller.
        let (array, schema) = unsafe { take_array_and_schema(array, schema)? };
        let expected = sample_or_err(which)?;
        let batch = cpu::import_record_batch(array, &schema)?;
        match sample::describe_difference(&expected, &batch) {
            None => Ok(()),
            Some(d) => Err(mismatch(&format!("the record batch (sample {which})"), d)),
        }
    })
}

/// Imports a CPU device array and its schema with devarrow (validated, zero-copy; any
/// type, e.g. a record batch's struct array) and exports the result again with devarrow
/// into `out` and `out_schema`. Name, nullability and metadata of the schema are kept.
/// The input structs are moved in.
///
/// # Safety
/// `array` and `schema` must be NULL or point to valid, writable structs; `out` and
/// `out_schema` must point to writable storage for their structs.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_echo_device_array(
    array: *mut ArrowDeviceArray,
    schema: *mut FFI_ArrowSchema,
    out: *mut ArrowDeviceArray,
    out_schema: *mut FFI_ArrowSchema,
) -> c_int {
    run(|| {
        // SAFETY: forwarded to the caller.
        let (array, schema) = unsafe { take_array_and_schema(array, schema)? };
        check_out(out, "ArrowDeviceArray out")?;
        check_out(out_schema, "ArrowSchema out")?;
        let (field, imported) = cpu::import_field_array(array, &schema)?;
        let (exported, exported_schema) = cpu::export_field_array(&field, imported.as_ref())?;
        // SAFETY: both pointers are non-null and valid for writes (caller contract).
        unsafe {
            std::ptr::write(out_schema, exported_schema);
            exported.move_into(out);
        }
        Ok(())
    })
}

/// A device batch source over the samples, exported with their `ArrayData` offsets,
/// optionally failing after some batches.
struct SampleSource {
    schema: SchemaRef,
    next: c_int,
    fail_at: Option<c_int>,
}

impl DeviceBatchSource for SampleSource {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }

    fn next_array(&mut self) -> Option<Result<DeviceArray>> {
        if self.fail_at == Some(self.next) {
            self.fail_at = None;
            self.next = sample::SAMPLES;
            return Some(Err(Error::Arrow(ArrowError::IoError(
                "devarrow-interop: the sample source failed on purpose".into(),
                std::io::Error::other("failing on purpose"),
            ))));
        }
        let data = sample::sample_data(self.next)?;
        self.next += 1;
        Some(Ok(cpu::export_array_data(&data)))
    }
}

/// Exports the samples (0, 1, 2 in order) with devarrow as a CPU `ArrowDeviceArrayStream`.
///
/// # Safety
/// `out` must point to writable storage for an `ArrowDeviceArrayStream`.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_export_device_stream(
    out: *mut ArrowDeviceArrayStream,
) -> c_int {
    // SAFETY: forwarded to the caller.
    unsafe { export_sample_stream(out, None) }
}

/// Like [`devarrow_interop_export_device_stream`], but `get_next` fails (with `EIO` and a
/// message from `get_last_error`) instead of producing batch `fail_at`.
///
/// # Safety
/// `out` must point to writable storage for an `ArrowDeviceArrayStream`.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_export_failing_device_stream(
    out: *mut ArrowDeviceArrayStream,
    fail_at: c_int,
) -> c_int {
    // SAFETY: forwarded to the caller.
    unsafe { export_sample_stream(out, Some(fail_at)) }
}

/// # Safety
/// `out` must point to writable storage for an `ArrowDeviceArrayStream`.
unsafe fn export_sample_stream(out: *mut ArrowDeviceArrayStream, fail_at: Option<c_int>) -> c_int {
    run(|| {
        check_out(out, "ArrowDeviceArrayStream out")?;
        let stream = stream::export_stream(SampleSource {
            schema: sample::every_type_schema(),
            next: 0,
            fail_at,
        });
        // SAFETY: `out` is non-null and valid for writes (caller contract).
        unsafe { stream.move_into(out) };
        Ok(())
    })
}

fn export_c_stream(batches: Vec<RecordBatch>, schema: SchemaRef, out: *mut FFI_ArrowArrayStream) {
    let reader = RecordBatchIterator::new(batches.into_iter().map(Ok), schema);
    let stream = FFI_ArrowArrayStream::new(Box::new(reader));
    // SAFETY: callers check `out` is non-null; the C caller guarantees it is writable.
    unsafe { std::ptr::write(out, stream) };
}

/// Exports the same samples as [`devarrow_interop_export_device_stream`] through arrow-rs's
/// plain C stream (`ArrowArrayStream`), as the reference to compare with.
///
/// # Safety
/// `out` must point to writable storage for an `ArrowArrayStream`.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_export_c_stream(out: *mut FFI_ArrowArrayStream) -> c_int {
    run(|| {
        check_out(out, "ArrowArrayStream out")?;
        export_c_stream(sample::sample_batches(), sample::every_type_schema(), out);
        Ok(())
    })
}

/// Reads a foreign CPU `ArrowDeviceArrayStream` to its end with devarrow's
/// `DeviceArrayStreamReader` (each array validated and imported zero-copy), then exports
/// the batches read through arrow-rs's plain C stream into `out`. A failure of the foreign
/// stream is returned with its code and message. The stream is moved in.
///
/// # Safety
/// `stream` must be NULL or point to a valid, writable `ArrowDeviceArrayStream`; `out`
/// must point to writable storage for an `ArrowArrayStream`.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_echo_device_stream(
    stream: *mut ArrowDeviceArrayStream,
    out: *mut FFI_ArrowArrayStream,
) -> c_int {
    run(|| {
        // SAFETY: forwarded to the caller; the stream is moved in first.
        let reader = unsafe { DeviceArrayStreamReader::from_raw(stream)? };
        check_out(out, "ArrowArrayStream out")?;
        let schema = arrow_array::RecordBatchReader::schema(&reader);
        let mut batches = Vec::new();
        let mut reader = reader;
        while let Some(batch) = reader.next_batch()? {
            batches.push(batch);
        }
        export_c_stream(batches, schema, out);
        Ok(())
    })
}

/// Re-exports what a [`DeviceArrayStreamReader`] reads. Unlike `stream::export_reader`,
/// which sees the reader's errors as `ArrowError`s (reported as `EINVAL`), this keeps the
/// foreign stream's own error code.
struct RelaySource(DeviceArrayStreamReader);

impl DeviceBatchSource for RelaySource {
    fn schema(&self) -> SchemaRef {
        arrow_array::RecordBatchReader::schema(&self.0)
    }

    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }

    fn next_array(&mut self) -> Option<Result<DeviceArray>> {
        self.0
            .next_batch()
            .map(|batch| batch.map(|b| cpu::export_batch_array(&b)))
            .transpose()
    }
}

/// Relays a foreign CPU `ArrowDeviceArrayStream` through devarrow lazily: `out` is a
/// devarrow device stream whose every `get_next` pulls one array from the foreign stream
/// with `DeviceArrayStreamReader`, imports (validates) it and exports it again. Errors of
/// the foreign stream come out of `out`'s `get_next` with their code and message. The
/// stream is moved in.
///
/// # Safety
/// `stream` must be NULL or point to a valid, writable `ArrowDeviceArrayStream`; `out`
/// must point to writable storage for one.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_relay_device_stream(
    stream: *mut ArrowDeviceArrayStream,
    out: *mut ArrowDeviceArrayStream,
) -> c_int {
    run(|| {
        // SAFETY: forwarded to the caller; the stream is moved in first.
        let reader = unsafe { DeviceArrayStreamReader::from_raw(stream)? };
        check_out(out, "ArrowDeviceArrayStream out")?;
        let relayed = stream::export_stream(RelaySource(reader));
        // SAFETY: `out` is non-null and valid for writes (caller contract).
        unsafe { relayed.move_into(out) };
        Ok(())
    })
}

/// Reads a foreign CPU `ArrowDeviceArrayStream` with devarrow's `DeviceArrayStreamReader`
/// and compares it with the samples: the schema (with metadata) with the samples' schema,
/// and batch `i` with sample `i`, values included, for every sample and no more batches.
/// Returns 0 when equal, `EINVAL` with the differences in the last error otherwise, or the
/// stream's own error. The stream is moved in.
///
/// # Safety
/// `stream` must be NULL or point to a valid, writable `ArrowDeviceArrayStream`.
#[no_mangle]
pub unsafe extern "C" fn devarrow_interop_check_device_stream(
    stream: *mut ArrowDeviceArrayStream,
) -> c_int {
    run(|| {
        // SAFETY: forwarded to the caller; the stream is moved in first.
        let mut reader = unsafe { DeviceArrayStreamReader::from_raw(stream)? };
        let expected_schema = sample::every_type_schema();
        let schema = arrow_array::RecordBatchReader::schema(&reader);
        if schema != expected_schema {
            return Err(mismatch(
                "the stream's schema",
                format!("expected {expected_schema:#?}\ngot {schema:#?}"),
            ));
        }
        let expected = sample::sample_batches();
        let mut got = 0;
        while let Some(batch) = reader.next_batch()? {
            let Some(e) = expected.get(got) else {
                return Err(mismatch(
                    "the stream",
                    format!("more than the {} expected batches", expected.len()),
                ));
            };
            if let Some(d) = sample::describe_difference(e, &batch) {
                return Err(mismatch(&format!("batch {got} of the stream"), d));
            }
            got += 1;
        }
        if got != expected.len() {
            return Err(mismatch(
                "the stream",
                format!("{got} batches, expected {}", expected.len()),
            ));
        }
        Ok(())
    })
}
