//! The C device stream interface (`ArrowDeviceArrayStream`), both sides.
//!
//! - Producer: [`export_stream`] turns any [`DeviceBatchSource`] into a C stream;
//!   [`export_reader`] does so for an arrow-rs `RecordBatchReader` on the CPU.
//! - Consumer: [`DeviceArrayStream`] owns a foreign C stream (schema, next array, errors
//!   with `get_last_error`), and [`DeviceArrayStreamReader`] reads a CPU stream as an
//!   arrow-rs `RecordBatchReader`.
//!
//! Return codes are errno-compatible; the end of the stream is a released array; an error
//! from the source is reported with its code and message, and the stream stays usable for
//! `get_last_error` and `release`.

use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{ArrowError, SchemaRef};

use crate::boundary::{catch_panic, swallow_panic};
use crate::cpu;
use crate::device_array::DeviceArray;
use crate::error::{Error, Result};
use crate::ffi::{ArrowDeviceArray, ArrowDeviceArrayStream, ArrowDeviceType};
use crate::panic::drop_payload;

/// What a device stream producer draws from: a schema and a sequence of struct arrays
/// (one per record batch) on one device type.
pub trait DeviceBatchSource: Send {
    /// The schema every array has.
    fn schema(&self) -> SchemaRef;
    /// The device type every array lives on.
    fn device_type(&self) -> ArrowDeviceType;
    /// The next array, `None` at the end.
    fn next_array(&mut self) -> Option<Result<DeviceArray>>;
}

/// A [`DeviceBatchSource`] over an arrow-rs `RecordBatchReader`, on the CPU device.
pub struct CpuReaderSource {
    reader: Box<dyn RecordBatchReader + Send>,
}

impl std::fmt::Debug for CpuReaderSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuReaderSource")
            .field("schema", &self.reader.schema())
            .finish_non_exhaustive()
    }
}

impl CpuReaderSource {
    /// Wraps a reader.
    pub fn new(reader: Box<dyn RecordBatchReader + Send>) -> Self {
        Self { reader }
    }
}

impl DeviceBatchSource for CpuReaderSource {
    fn schema(&self) -> SchemaRef {
        self.reader.schema()
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }
    fn next_array(&mut self) -> Option<Result<DeviceArray>> {
        let schema = self.reader.schema();
        Some(self.reader.next()?.map_err(Error::from).and_then(|batch| {
            if batch.schema().fields() != schema.fields() {
                return Err(Error::InvalidArgument(format!(
                    "the reader produced a batch of schema {} but its schema is {}",
                    batch.schema(),
                    schema
                )));
            }
            Ok(cpu::export_batch_array(&batch))
        }))
    }
}

struct ProducerState {
    source: Box<dyn DeviceBatchSource>,
    last_error: Option<CString>,
}

impl ProducerState {
    /// Records `err` for `get_last_error` and returns its (non-zero) code.
    ///
    /// Formatting and dropping the error run under `catch_unwind`: either may call user
    /// code (an `ArrowError::ExternalError` from a source).
    fn fail(&mut self, err: Error) -> c_int {
        let code = err.c_code();
        let msg = catch_unwind(AssertUnwindSafe(move || err.to_string())).unwrap_or_else(|p| {
            drop_payload(p);
            "the error's message could not be formatted (its Display panicked)".into()
        });
        let msg = msg.replace('\0', " ");
        self.last_error = Some(CString::new(msg).expect("NULs were replaced"));
        code
    }
}

/// Exports `source` as a C device stream. Move it to the consumer with
/// [`DeviceArrayStream::move_into`] or [`DeviceArrayStream::into_raw`].
pub fn export_stream(source: impl DeviceBatchSource + 'static) -> DeviceArrayStream {
    let device_type = source.device_type();
    let state = Box::new(ProducerState {
        source: Box::new(source),
        last_error: None,
    });
    DeviceArrayStream {
        raw: ArrowDeviceArrayStream {
            device_type,
            get_schema: Some(stream_get_schema),
            get_next: Some(stream_get_next),
            get_last_error: Some(stream_get_last_error),
            release: Some(stream_release),
            private_data: Box::into_raw(state).cast(),
        },
    }
}

/// Exports an arrow-rs `RecordBatchReader` as a CPU device stream.
///
/// # Example
///
/// A producer hands the stream to C, a consumer takes it back and reads it; the
/// stream's `release` runs once, when the reader drops.
///
/// ```
/// use std::sync::Arc;
///
/// use arrow_array::{ArrayRef, RecordBatch, RecordBatchIterator, RecordBatchReader, StringArray};
/// use devarrow_abi::stream::{export_reader, DeviceArrayStreamReader};
/// use devarrow_abi::ArrowDeviceArrayStream;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let names: ArrayRef = Arc::new(StringArray::from(vec!["a", "b", "c"]));
/// let batch = RecordBatch::try_from_iter([("name", names)])?;
/// let reader = RecordBatchIterator::new(vec![Ok(batch.clone()), Ok(batch.slice(0, 1))], batch.schema());
///
/// let mut c_stream = ArrowDeviceArrayStream::empty();
/// // SAFETY: `c_stream` is valid for writes.
/// unsafe { export_reader(Box::new(reader)).move_into(&mut c_stream) };
///
/// // SAFETY: `c_stream` holds an unreleased stream, as moved in above.
/// let reader = unsafe { DeviceArrayStreamReader::from_raw(&mut c_stream) }?;
/// assert_eq!(reader.schema(), batch.schema());
/// let batches = reader.collect::<Result<Vec<_>, _>>()?;
/// assert_eq!(batches, [batch.clone(), batch.slice(0, 1)]);
/// # Ok(())
/// # }
/// ```
pub fn export_reader(reader: Box<dyn RecordBatchReader + Send>) -> DeviceArrayStream {
    export_stream(CpuReaderSource::new(reader))
}

/// # Safety
/// `stream` must be NULL or one of our exported, unreleased streams.
unsafe fn producer_state<'a>(stream: *mut ArrowDeviceArrayStream) -> Option<&'a mut ProducerState> {
    // SAFETY: a non-null stream exported by `export_stream` has a `ProducerState` as its
    // private data until release; the C stream interface serializes calls on one stream.
    unsafe {
        let stream = stream.as_mut()?;
        stream.release?;
        stream.private_data.cast::<ProducerState>().as_mut()
    }
}

unsafe extern "C" fn stream_get_schema(
    stream: *mut ArrowDeviceArrayStream,
    out: *mut FFI_ArrowSchema,
) -> c_int {
    // SAFETY: C calls this on our own stream.
    let Some(state) = (unsafe { producer_state(stream) }) else {
        return crate::error::errno::EINVAL;
    };
    // Everything that runs user code (the source's `schema()`) is inside the guard.
    let result = catch_panic(|| {
        if out.is_null() {
            return Err(Error::NullPointer {
                what: "ArrowSchema out",
            });
        }
        let schema = state.source.schema();
        let ffi = FFI_ArrowSchema::try_from(schema.as_ref())?;
        // SAFETY: `out` is non-null and points to consumer-allocated storage.
        unsafe { std::ptr::write(out, ffi) };
        Ok(())
    });
    match result {
        Ok(()) => 0,
        Err(e) => state.fail(e),
    }
}

unsafe extern "C" fn stream_get_next(
    stream: *mut ArrowDeviceArrayStream,
    out: *mut ArrowDeviceArray,
) -> c_int {
    // SAFETY: C calls this on our own stream.
    let Some(state) = (unsafe { producer_state(stream) }) else {
        return crate::error::errno::EINVAL;
    };
    // Everything that runs user code (the source's `device_type()` and `next_array()`,
    // and the release of a refused array) is inside the guard.
    let result = catch_panic(|| {
        if out.is_null() {
            return Err(Error::NullPointer {
                what: "ArrowDeviceArray out",
            });
        }
        let device_type = state.source.device_type();
        match state.source.next_array().transpose()? {
            Some(array) if array.device_type() != device_type => Err(Error::UnsupportedDevice {
                found: array.device_type(),
                accepted: device_type.to_string(),
            }),
            Some(array) => {
                // SAFETY: `out` is non-null consumer storage; ownership moves to the consumer.
                unsafe { array.move_into(out) };
                Ok(())
            }
            None => {
                let mut end = ArrowDeviceArray::empty();
                end.device_type = device_type;
                // SAFETY: as above; a released array marks the end of the stream.
                unsafe { std::ptr::write(out, end) };
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => 0,
        Err(e) => state.fail(e),
    }
}

unsafe extern "C" fn stream_get_last_error(stream: *mut ArrowDeviceArrayStream) -> *const c_char {
    // SAFETY: C calls this on our own stream.
    match unsafe { producer_state(stream) } {
        Some(state) => state
            .last_error
            .as_ref()
            .map_or(std::ptr::null(), |e| e.as_ptr()),
        None => std::ptr::null(),
    }
}

unsafe extern "C" fn stream_release(stream: *mut ArrowDeviceArrayStream) {
    swallow_panic("in ArrowDeviceArrayStream.release", || {
        // SAFETY: C calls release on our own stream at most once while unreleased.
        let Some(stream) = (unsafe { stream.as_mut() }) else {
            return;
        };
        if stream.release.is_none() {
            return;
        }
        if !stream.private_data.is_null() {
            // SAFETY: private_data is the Box<ProducerState> made by `export_stream`, freed
            // only here, and the release field is cleared right after.
            drop(unsafe { Box::from_raw(stream.private_data.cast::<ProducerState>()) });
        }
        stream.private_data = std::ptr::null_mut();
        stream.release = None;
    })
}

/// An owned, unreleased `ArrowDeviceArrayStream` (ours or a foreign producer's); dropping it
/// calls `release` exactly once.
#[derive(Debug)]
pub struct DeviceArrayStream {
    raw: ArrowDeviceArrayStream,
}

// SAFETY: the C stream interface lets a stream be used from any thread as long as calls
// are not concurrent, which `&mut self` on every call guarantees.
unsafe impl Send for DeviceArrayStream {}

impl DeviceArrayStream {
    /// Takes ownership of a stream by value; fails with [`Error::Released`] if it is
    /// released, and with [`Error::NullPointer`] (after releasing it) if it lacks a
    /// callback.
    ///
    /// # Safety
    /// `raw` must be released, or filled by a producer following the C Device Data
    /// Interface and not released since: its callbacks are sound to call as the interface
    /// describes (serialized, from any thread, with `private_data` as the producer left
    /// it), and every array `get_next` returns meets the contract of
    /// [`DeviceArray::try_new`] (devarrow wraps them without further checks of their
    /// pointers).
    pub unsafe fn try_new(raw: ArrowDeviceArrayStream) -> Result<Self> {
        if raw.is_released() {
            return Err(Error::Released {
                what: "ArrowDeviceArrayStream",
            });
        }
        if raw.get_schema.is_none() || raw.get_next.is_none() || raw.get_last_error.is_none() {
            let this = Self { raw };
            drop(this);
            return Err(Error::NullPointer {
                what: "ArrowDeviceArrayStream callback",
            });
        }
        Ok(Self { raw })
    }

    /// Moves a stream out of `ptr`, marking the source released.
    ///
    /// # Safety
    /// `ptr` must be NULL or point to a valid, writable `ArrowDeviceArrayStream` that meets
    /// the contract of [`DeviceArrayStream::try_new`].
    pub unsafe fn from_raw(ptr: *mut ArrowDeviceArrayStream) -> Result<Self> {
        if ptr.is_null() {
            return Err(Error::NullPointer {
                what: "ArrowDeviceArrayStream",
            });
        }
        // SAFETY: the caller guarantees validity; replacing with a released struct is a move.
        let raw = unsafe { std::ptr::replace(ptr, ArrowDeviceArrayStream::empty()) };
        // SAFETY: the caller guarantees the stream meets `try_new`'s contract.
        unsafe { Self::try_new(raw) }
    }

    /// Gives up ownership; whoever holds the result must release it.
    pub fn into_raw(self) -> ArrowDeviceArrayStream {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again.
        unsafe { std::ptr::read(&this.raw) }
    }

    /// Moves the stream into consumer-allocated storage.
    ///
    /// # Safety
    /// `out` must be valid for writes.
    pub unsafe fn move_into(self, out: *mut ArrowDeviceArrayStream) {
        // SAFETY: the caller guarantees `out` is valid for writes.
        unsafe { std::ptr::write(out, self.into_raw()) }
    }

    /// The device type of the stream's arrays.
    pub fn device_type(&self) -> ArrowDeviceType {
        self.raw.device_type
    }

    fn last_error(&mut self) -> String {
        let get_last_error = self.raw.get_last_error.expect("checked in try_new");
        // SAFETY: the stream is unreleased; get_last_error returns NULL or a C string
        // valid until the next call on the stream, which we copy at once.
        unsafe {
            let msg = get_last_error(&mut self.raw);
            if msg.is_null() {
                String::new()
            } else {
                CStr::from_ptr(msg).to_string_lossy().into_owned()
            }
        }
    }

    /// Calls `get_schema`.
    pub fn schema(&mut self) -> Result<FFI_ArrowSchema> {
        let get_schema = self.raw.get_schema.expect("checked in try_new");
        let mut out = FFI_ArrowSchema::empty();
        // SAFETY: the stream is unreleased and `out` is a valid released schema to fill.
        let code = unsafe { get_schema(&mut self.raw, &mut out) };
        if code != 0 {
            return Err(Error::Callback {
                operation: "get_schema",
                code,
                message: self.last_error(),
            });
        }
        if crate::ffi::schema_is_released(&out) {
            return Err(Error::Released {
                what: "ArrowSchema",
            });
        }
        Ok(out)
    }

    /// Calls `get_next`: `Ok(None)` at the end of the stream.
    ///
    /// Checks that the array's device type is the stream's.
    pub fn next_array(&mut self) -> Result<Option<DeviceArray>> {
        let get_next = self.raw.get_next.expect("checked in try_new");
        let mut out = ArrowDeviceArray::empty();
        // SAFETY: the stream is unreleased and `out` is a valid released array to fill.
        let code = unsafe { get_next(&mut self.raw, &mut out) };
        if code != 0 {
            // A conforming producer leaves `out` released on error; release it if not.
            // SAFETY: `out` is released or was filled by the stream's producer, whose
            // arrays meet `DeviceArray::try_new`'s contract (contract of `Self::try_new`).
            drop(unsafe { DeviceArray::try_new(out) });
            return Err(Error::Callback {
                operation: "get_next",
                code,
                message: self.last_error(),
            });
        }
        if out.is_released() {
            return Ok(None);
        }
        // SAFETY: `out` was filled by the stream's producer, whose arrays meet
        // `DeviceArray::try_new`'s contract (contract of `Self::try_new`).
        let array = unsafe { DeviceArray::try_new(out) }?;
        if array.device_type() != self.raw.device_type {
            return Err(Error::UnsupportedDevice {
                found: array.device_type(),
                accepted: format!("{} (the stream's device type)", self.raw.device_type),
            });
        }
        Ok(Some(array))
    }
}

impl Drop for DeviceArrayStream {
    fn drop(&mut self) {
        if let Some(release) = self.raw.release {
            // SAFETY: the stream is unreleased and owned by us.
            unsafe { release(&mut self.raw) };
            self.raw.release = None;
        }
    }
}

/// Reads a CPU device stream as an arrow-rs `RecordBatchReader`.
///
/// After the first error (or the end) it yields nothing more. Errors are devarrow
/// [`Error`]s wrapped in `ArrowError::ExternalError`.
#[derive(Debug)]
pub struct DeviceArrayStreamReader {
    stream: DeviceArrayStream,
    schema: SchemaRef,
    done: bool,
}

impl DeviceArrayStreamReader {
    /// Reads the stream's schema; fails if the stream is not on the CPU.
    pub fn try_new(mut stream: DeviceArrayStream) -> Result<Self> {
        if stream.device_type() != ArrowDeviceType::CPU {
            return Err(Error::UnsupportedDevice {
                found: stream.device_type(),
                accepted: ArrowDeviceType::CPU.to_string(),
            });
        }
        let ffi = stream.schema()?;
        let schema = Arc::new(crate::schema::import_schema(&ffi)?);
        Ok(Self {
            stream,
            schema,
            done: false,
        })
    }

    /// Moves a foreign stream out of `ptr` and reads its schema.
    ///
    /// # Safety
    /// As [`DeviceArrayStream::from_raw`].
    pub unsafe fn from_raw(ptr: *mut ArrowDeviceArrayStream) -> Result<Self> {
        // SAFETY: forwarded to the caller.
        Self::try_new(unsafe { DeviceArrayStream::from_raw(ptr)? })
    }

    /// The next batch as a devarrow result.
    pub fn next_batch(&mut self) -> Result<Option<RecordBatch>> {
        if self.done {
            return Ok(None);
        }
        let result = self.stream.next_array().and_then(|a| {
            a.map(|a| cpu::import_record_batch_with_schema(a, self.schema.clone()))
                .transpose()
        });
        if !matches!(result, Ok(Some(_))) {
            self.done = true;
        }
        result
    }
}

impl Iterator for DeviceArrayStreamReader {
    type Item = std::result::Result<RecordBatch, ArrowError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_batch().map_err(ArrowError::from).transpose()
    }
}

impl RecordBatchReader for DeviceArrayStreamReader {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}
