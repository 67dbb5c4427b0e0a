//! The device stream (`ArrowDeviceArrayStream`) on the CPU: producer and consumer, end of
//! stream, errors with `get_last_error`, release discipline, and misbehaving peers.

mod common;

use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arrow_array::{
    ArrayRef, Int64Array, RecordBatch, RecordBatchIterator, RecordBatchReader, StringArray,
};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use devarrow_abi::error::errno;
use devarrow_abi::stream::{
    export_reader, export_stream, DeviceArrayStream, DeviceArrayStreamReader, DeviceBatchSource,
};
use devarrow_abi::{
    cpu, ArrowDeviceArray, ArrowDeviceArrayStream, ArrowDeviceType, DeviceArray, Error,
};

fn schema() -> SchemaRef {
    Arc::new(
        Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ])
        .with_metadata(std::collections::HashMap::from([(
            "source".to_string(),
            "test".to_string(),
        )])),
    )
}

fn batch(start: i64, n: usize) -> RecordBatch {
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(start..start + n as i64));
    let names: ArrayRef = Arc::new(StringArray::from_iter(
        (0..n).map(|i| (i % 3 != 0).then(|| format!("n{i}"))),
    ));
    RecordBatch::try_new(schema(), vec![ids, names]).unwrap()
}

fn reader(items: Vec<Result<RecordBatch, ArrowError>>) -> Box<dyn RecordBatchReader + Send> {
    Box::new(RecordBatchIterator::new(items, schema()))
}

#[test]
fn reader_round_trip() {
    let batches = vec![batch(0, 10), batch(10, 0), batch(10, 7).slice(2, 4)];
    let stream = export_reader(reader(batches.iter().cloned().map(Ok).collect()));
    assert_eq!(stream.device_type(), ArrowDeviceType::CPU);
    let mut raw = ArrowDeviceArrayStream::empty();
    // SAFETY: `raw` is writable.
    unsafe { stream.move_into(&mut raw) };
    // SAFETY: `raw` holds an unreleased stream.
    let reader = unsafe { DeviceArrayStreamReader::from_raw(&mut raw) }.unwrap();
    assert!(raw.is_released(), "moving marks the source released");
    assert_eq!(reader.schema(), schema());
    let back: Vec<RecordBatch> = reader.collect::<Result<_, _>>().unwrap();
    assert_eq!(back, batches);
}

#[test]
fn end_of_stream_is_a_released_array_and_stays_the_end() {
    let mut stream = export_reader(reader(vec![Ok(batch(0, 3))]));
    assert!(stream.next_array().unwrap().is_some());
    assert!(stream.next_array().unwrap().is_none());
    assert!(stream.next_array().unwrap().is_none());
}

#[test]
fn source_errors_carry_code_and_message() {
    let mut stream = export_reader(reader(vec![
        Ok(batch(0, 2)),
        Err(ArrowError::IoError(
            "disk on fire".into(),
            std::io::Error::other("x"),
        )),
    ]));
    let schema = stream.schema().unwrap();
    cpu::import_record_batch(stream.next_array().unwrap().unwrap(), &schema).unwrap();
    let err = stream.next_array().unwrap_err();
    match err {
        Error::Callback {
            operation,
            code,
            message,
        } => {
            assert_eq!(operation, "get_next");
            assert_eq!(code, errno::EIO);
            assert!(message.contains("disk on fire"), "{message}");
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn reader_stops_after_an_error() {
    let stream = export_reader(reader(vec![
        Err(ArrowError::ComputeError("bad batch".into())),
        Ok(batch(0, 2)),
    ]));
    let mut reader = DeviceArrayStreamReader::try_new(stream).unwrap();
    let err = reader.next().unwrap().unwrap_err();
    assert!(err.to_string().contains("bad batch"), "{err}");
    assert!(reader.next().is_none());
}

/// Drives the raw C callbacks like a C consumer would.
#[test]
fn c_level_protocol() {
    let mut raw =
        export_reader(reader(vec![Err(ArrowError::ComputeError("boom".into()))])).into_raw();
    // SAFETY: `raw` is an unreleased stream we produced; each call gets valid out pointers.
    unsafe {
        assert!(
            (raw.get_last_error.unwrap())(&mut raw).is_null(),
            "no error yet"
        );
        let mut schema = FFI_ArrowSchema::empty();
        assert_eq!((raw.get_schema.unwrap())(&mut raw, &mut schema), 0);
        assert_eq!(schema.format(), "+s");
        let mut out = ArrowDeviceArray::empty();
        let code = (raw.get_next.unwrap())(&mut raw, &mut out);
        assert_eq!(code, errno::EINVAL);
        assert!(out.is_released());
        let msg = CStr::from_ptr((raw.get_last_error.unwrap())(&mut raw));
        assert!(msg.to_str().unwrap().contains("boom"));
        // NULL out pointers are reported, not dereferenced.
        assert_eq!(
            (raw.get_next.unwrap())(&mut raw, std::ptr::null_mut()),
            errno::EINVAL
        );
        assert_eq!(
            (raw.get_schema.unwrap())(&mut raw, std::ptr::null_mut()),
            errno::EINVAL
        );
        (raw.release.unwrap())(&mut raw);
        assert!(raw.is_released());
    }
}

struct PanickingSource;

impl DeviceBatchSource for PanickingSource {
    fn schema(&self) -> SchemaRef {
        schema()
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }
    fn next_array(&mut self) -> Option<devarrow_abi::Result<DeviceArray>> {
        panic!("source exploded")
    }
}

#[test]
fn a_panic_in_the_source_is_an_error_code_not_an_unwind() {
    let mut stream = export_stream(PanickingSource);
    let err = stream.next_array().unwrap_err();
    match err {
        Error::Callback { code, message, .. } => {
            assert_eq!(code, errno::EIO);
            assert!(message.contains("source exploded"), "{message}");
        }
        other => panic!("unexpected {other}"),
    }
}

struct WrongDeviceSource;

impl DeviceBatchSource for WrongDeviceSource {
    fn schema(&self) -> SchemaRef {
        schema()
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }
    fn next_array(&mut self) -> Option<devarrow_abi::Result<DeviceArray>> {
        let mut raw = cpu::export_batch_array(&batch(0, 1)).into_raw();
        raw.device_type = ArrowDeviceType::METAL;
        Some(DeviceArray::try_new(raw))
    }
}

#[test]
fn producer_refuses_arrays_of_another_device() {
    let mut stream = export_stream(WrongDeviceSource);
    let err = stream.next_array().unwrap_err();
    assert!(err.to_string().contains("ARROW_DEVICE_METAL"), "{err}");
}

#[test]
fn non_cpu_stream_is_refused_by_the_cpu_reader() {
    let mut raw = export_reader(reader(vec![])).into_raw();
    raw.device_type = ArrowDeviceType::CUDA;
    let stream = DeviceArrayStream::try_new(raw).unwrap();
    let err = DeviceArrayStreamReader::try_new(stream).unwrap_err();
    assert!(matches!(err, Error::UnsupportedDevice { .. }), "{err}");
}

#[test]
fn released_stream_is_detected() {
    let err = DeviceArrayStream::try_new(ArrowDeviceArrayStream::empty()).unwrap_err();
    assert!(matches!(err, Error::Released { .. }), "{err}");
    // SAFETY: NULL is explicitly allowed and reported.
    let err = unsafe { DeviceArrayStream::from_raw(std::ptr::null_mut()) }.unwrap_err();
    assert!(matches!(err, Error::NullPointer { .. }), "{err}");
}

// A foreign (C-style) producer that misbehaves, with counted releases.
static FOREIGN_RELEASES: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn foreign_get_schema(
    _: *mut ArrowDeviceArrayStream,
    out: *mut FFI_ArrowSchema,
) -> c_int {
    // SAFETY: the consumer passes a writable schema.
    unsafe { std::ptr::write(out, FFI_ArrowSchema::try_from(schema().as_ref()).unwrap()) };
    0
}

unsafe extern "C" fn foreign_get_next_wrong_device(
    _: *mut ArrowDeviceArrayStream,
    out: *mut ArrowDeviceArray,
) -> c_int {
    let mut raw = cpu::export_batch_array(&batch(0, 2)).into_raw();
    raw.device_type = ArrowDeviceType::CUDA;
    // SAFETY: the consumer passes a writable device array.
    unsafe { std::ptr::write(out, raw) };
    0
}

unsafe extern "C" fn foreign_get_last_error(_: *mut ArrowDeviceArrayStream) -> *const c_char {
    c"foreign failure".as_ptr()
}

unsafe extern "C" fn foreign_get_next_fails(
    _: *mut ArrowDeviceArrayStream,
    _: *mut ArrowDeviceArray,
) -> c_int {
    errno::ENOMEM
}

unsafe extern "C" fn foreign_release(stream: *mut ArrowDeviceArrayStream) {
    FOREIGN_RELEASES.fetch_add(1, Ordering::SeqCst);
    // SAFETY: the consumer passes its stream.
    unsafe { (*stream).release = None };
}

fn foreign(
    get_next: unsafe extern "C" fn(*mut ArrowDeviceArrayStream, *mut ArrowDeviceArray) -> c_int,
) -> ArrowDeviceArrayStream {
    ArrowDeviceArrayStream {
        device_type: ArrowDeviceType::CPU,
        get_schema: Some(foreign_get_schema),
        get_next: Some(get_next),
        get_last_error: Some(foreign_get_last_error),
        release: Some(foreign_release),
        private_data: std::ptr::null_mut(),
    }
}

#[test]
fn misbehaving_foreign_producers() {
    let before = FOREIGN_RELEASES.load(Ordering::SeqCst);
    // An array whose device type differs from the stream's.
    let mut reader = DeviceArrayStreamReader::try_new(
        DeviceArrayStream::try_new(foreign(foreign_get_next_wrong_device)).unwrap(),
    )
    .unwrap();
    let err = reader.next().unwrap().unwrap_err();
    assert!(err.to_string().contains("ARROW_DEVICE_CUDA"), "{err}");
    drop(reader);
    // An error code with a message from get_last_error.
    let mut stream = DeviceArrayStream::try_new(foreign(foreign_get_next_fails)).unwrap();
    match stream.next_array().unwrap_err() {
        Error::Callback { code, message, .. } => {
            assert_eq!(code, errno::ENOMEM);
            assert_eq!(message, "foreign failure");
        }
        other => panic!("unexpected {other}"),
    }
    drop(stream);
    // A stream missing a mandatory callback is released and refused.
    let mut incomplete = foreign(foreign_get_next_fails);
    incomplete.get_schema = None;
    assert!(matches!(
        DeviceArrayStream::try_new(incomplete),
        Err(Error::NullPointer { .. })
    ));
    assert_eq!(
        FOREIGN_RELEASES.load(Ordering::SeqCst) - before,
        3,
        "each stream released once"
    );
}

#[test]
fn relaying_a_device_stream_keeps_the_source_errno() {
    // A devarrow error travels through a RecordBatchReader as ArrowError::ExternalError;
    // re-exporting that reader must report the original code, not EINVAL.
    let failing = export_reader(reader(vec![
        Ok(batch(0, 1)),
        Err(ArrowError::IoError(
            "lost".into(),
            std::io::Error::other("x"),
        )),
    ]));
    let relay = DeviceArrayStreamReader::try_new(failing).unwrap();
    let mut relayed = export_reader(Box::new(relay));
    assert!(relayed.next_array().unwrap().is_some());
    match relayed.next_array().unwrap_err() {
        Error::Callback { code, message, .. } => {
            assert_eq!(code, errno::EIO);
            assert!(message.contains("lost"), "{message}");
        }
        other => panic!("unexpected {other}"),
    }
}
