//! The device stream (`ArrowDeviceArrayStream`) on the CPU: producer and consumer, end of
//! stream, errors with `get_last_error`, release discipline, and misbehaving peers.

use std::cell::Cell;
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arrow_array::{
    ArrayRef, Int64Array, RecordBatch, RecordBatchIterator, RecordBatchReader, StringArray,
};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use devarrow_abi::error::errno;
use devarrow_abi::export_tree::{export_tree, ArrayNode};
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

/// An empty struct array of [`schema`] on `device_type`, all of whose buffers are NULL
/// (so it may claim any device).
fn empty_batch_on(device_type: ArrowDeviceType) -> DeviceArray {
    let column = || ArrayNode {
        buffers: vec![std::ptr::null(); 2],
        ..Default::default()
    };
    let mut name = column();
    name.buffers.push(std::ptr::null());
    let root = ArrayNode {
        buffers: vec![std::ptr::null()],
        children: vec![column(), name],
        ..Default::default()
    };
    // SAFETY: every buffer address is NULL and there is no sync event, so the array
    // claims no memory on `device_type` at all.
    unsafe { export_tree(root, Arc::new(()), device_type, 0, std::ptr::null_mut()) }.unwrap()
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
        Some(Ok(empty_batch_on(ArrowDeviceType::METAL)))
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
    // SAFETY: our own exported stream; only its device type label changed, and the arrays
    // it returns are true CPU arrays (which a consumer checks against that label).
    let stream = unsafe { DeviceArrayStream::try_new(raw) }.unwrap();
    let err = DeviceArrayStreamReader::try_new(stream).unwrap_err();
    assert!(matches!(err, Error::UnsupportedDevice { .. }), "{err}");
}

#[test]
fn released_stream_is_detected() {
    // SAFETY: a released stream is always allowed (and refused).
    let err = unsafe { DeviceArrayStream::try_new(ArrowDeviceArrayStream::empty()) }.unwrap_err();
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
    let raw = empty_batch_on(ArrowDeviceType::CUDA).into_raw();
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

/// A foreign stream whose callbacks follow the interface (they write only valid structs
/// into the consumer's storage) but `get_next` misbehaves at the protocol level.
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
    // SAFETY: the foreign callbacks follow the interface (see `foreign`), and the array
    // `foreign_get_next_wrong_device` returns has only NULL buffers.
    let stream = unsafe { DeviceArrayStream::try_new(foreign(foreign_get_next_wrong_device)) };
    let mut reader = DeviceArrayStreamReader::try_new(stream.unwrap()).unwrap();
    let err = reader.next().unwrap().unwrap_err();
    assert!(err.to_string().contains("ARROW_DEVICE_CUDA"), "{err}");
    drop(reader);
    // An error code with a message from get_last_error.
    // SAFETY: the foreign callbacks follow the interface; `get_next` returns no array.
    let mut stream =
        unsafe { DeviceArrayStream::try_new(foreign(foreign_get_next_fails)) }.unwrap();
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
    // SAFETY: the callbacks present follow the interface; only `release` is ever called.
    let refused = unsafe { DeviceArrayStream::try_new(incomplete) };
    assert!(matches!(refused, Err(Error::NullPointer { .. })));
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

/// Found by fuzzing (target `stream_export`): a source error carrying a negative code
/// (a foreign producer's `-1`, relayed) was returned from `get_next` as is; the C stream
/// interface wants a positive errno value. It is now `EIO` (the message is kept).
#[test]
fn a_negative_source_code_is_reported_as_eio() {
    let foreign = Error::Callback {
        operation: "get_next",
        code: -1,
        message: "the foreign producer failed".into(),
    };
    let mut failing = export_reader(reader(vec![
        Ok(batch(0, 1)),
        Err(ArrowError::ExternalError(Box::new(foreign))),
    ]));
    assert!(failing.next_array().unwrap().is_some());
    match failing.next_array().unwrap_err() {
        Error::Callback { code, message, .. } => {
            assert_eq!(code, errno::EIO);
            assert!(message.contains("the foreign producer failed"), "{message}");
        }
        other => panic!("unexpected {other}"),
    }
}

/// A source whose `schema()` panics, or whose `device_type()` panics once the stream is
/// exported (`export_stream` asks it once).
struct PanicsInMetadata {
    schema_panics: bool,
    device_type_calls: Cell<usize>,
}

impl PanicsInMetadata {
    fn schema_panics() -> Self {
        Self {
            schema_panics: true,
            device_type_calls: Cell::new(0),
        }
    }

    fn device_type_panics() -> Self {
        Self {
            schema_panics: false,
            device_type_calls: Cell::new(0),
        }
    }
}

impl DeviceBatchSource for PanicsInMetadata {
    fn schema(&self) -> SchemaRef {
        if self.schema_panics {
            panic!("schema() exploded");
        }
        schema()
    }
    fn device_type(&self) -> ArrowDeviceType {
        let calls = self.device_type_calls.get();
        self.device_type_calls.set(calls + 1);
        if !self.schema_panics && calls > 0 {
            panic!("device_type() exploded");
        }
        ArrowDeviceType::CPU
    }
    fn next_array(&mut self) -> Option<devarrow_abi::Result<DeviceArray>> {
        None
    }
}

/// The message `get_last_error` reports on `raw` right now.
///
/// # Safety
/// `raw` must be an unreleased stream.
unsafe fn last_error_of(raw: &mut ArrowDeviceArrayStream) -> String {
    // SAFETY: per the contract; the message is copied at once.
    unsafe {
        let msg = (raw.get_last_error.unwrap())(raw);
        assert!(!msg.is_null(), "get_last_error has a message");
        CStr::from_ptr(msg).to_string_lossy().into_owned()
    }
}

/// Asserts `err` is a `get_next`/`get_schema` failure with EIO mentioning `needle`.
fn assert_eio(err: Error, operation: &str, needle: &str) {
    match err {
        Error::Callback {
            operation: op,
            code,
            message,
        } => {
            assert_eq!((op, code), (operation, errno::EIO));
            assert!(message.contains(needle), "{message}");
        }
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn a_panic_in_the_source_schema_is_an_error_code_not_an_abort() {
    let mut raw = export_stream(PanicsInMetadata::schema_panics()).into_raw();
    // SAFETY: `raw` is our unreleased stream; `out` is a valid released schema.
    unsafe {
        let mut out = FFI_ArrowSchema::empty();
        let code = (raw.get_schema.unwrap())(&mut raw, &mut out);
        assert_eq!(code, errno::EIO);
        assert!(
            devarrow_abi::schema_is_released(&out),
            "out is left released"
        );
        let message = last_error_of(&mut raw);
        assert!(message.contains("schema() exploded"), "{message}");
        (raw.release.unwrap())(&mut raw);
    }
    // And through the safe consumer.
    let mut stream = export_stream(PanicsInMetadata::schema_panics());
    assert_eio(
        stream.schema().unwrap_err(),
        "get_schema",
        "schema() exploded",
    );
}

#[test]
fn a_panic_in_the_source_device_type_is_an_error_code_not_an_abort() {
    let mut raw = export_stream(PanicsInMetadata::device_type_panics()).into_raw();
    // SAFETY: `raw` is our unreleased stream; `out` is a valid released array.
    unsafe {
        let mut out = ArrowDeviceArray::empty();
        let code = (raw.get_next.unwrap())(&mut raw, &mut out);
        assert_eq!(code, errno::EIO);
        assert!(out.is_released(), "out is left released");
        let message = last_error_of(&mut raw);
        assert!(message.contains("device_type() exploded"), "{message}");
        (raw.release.unwrap())(&mut raw);
    }
    // And through the safe consumer.
    let mut stream = export_stream(PanicsInMetadata::device_type_panics());
    assert_eio(
        stream.next_array().unwrap_err(),
        "get_next",
        "device_type() exploded",
    );
}

/// A source that fails with an `Error::Callback` of code 0 (as relaying a peer that
/// reported 0 could produce).
struct FailsWithCodeZero;

impl DeviceBatchSource for FailsWithCodeZero {
    fn schema(&self) -> SchemaRef {
        schema()
    }
    fn device_type(&self) -> ArrowDeviceType {
        ArrowDeviceType::CPU
    }
    fn next_array(&mut self) -> Option<devarrow_abi::Result<DeviceArray>> {
        Some(Err(Error::Callback {
            operation: "upstream",
            code: 0,
            message: "zero is not an error code".into(),
        }))
    }
}

#[test]
fn an_error_with_code_zero_is_reported_as_eio_not_success() {
    let mut raw = export_stream(FailsWithCodeZero).into_raw();
    // SAFETY: `raw` is our unreleased stream; `out` is a valid released array.
    unsafe {
        let mut out = ArrowDeviceArray::empty();
        let code = (raw.get_next.unwrap())(&mut raw, &mut out);
        assert_eq!(code, errno::EIO, "0 would claim `out` was written");
        assert!(out.is_released());
        let message = last_error_of(&mut raw);
        assert!(message.contains("zero is not an error code"), "{message}");
        (raw.release.unwrap())(&mut raw);
    }
    let mut stream = export_stream(FailsWithCodeZero);
    assert_eio(
        stream.next_array().unwrap_err(),
        "get_next",
        "zero is not an error code",
    );
}
