//! The Arrow PyCapsule interface's capsules, both ways.
//!
//! Made here: a capsule owns a boxed C struct (`ArrowSchema`, `ArrowArray`,
//! `ArrowDeviceArray`, `ArrowArrayStream`, `ArrowDeviceArrayStream`) under its canonical
//! name. A consumer moves the struct out (copying it and setting its `release` to NULL);
//! the capsule's destructor calls `release` only when it is still non-NULL (the struct
//! was never consumed), as pyarrow's do, then frees the box: every struct is released
//! exactly once, by its consumer or by the capsule. The destructor is a C callback and
//! never unwinds (a panic is caught and dropped).
//!
//! Taken here: [`take`] moves a foreign capsule's struct out, marking it released, so
//! the producer's capsule destructor does nothing more.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};

use arrow_array::ffi::FFI_ArrowArray;
use arrow_array::ffi_stream::FFI_ArrowArrayStream;
use arrow_schema::ffi::FFI_ArrowSchema;
use devarrow::abi::{ArrowDeviceArray, ArrowDeviceArrayStream};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::{ffi, PyErr};

/// `ArrowSchema` capsules.
pub const SCHEMA: &CStr = c"arrow_schema";
/// `ArrowArray` capsules.
pub const ARRAY: &CStr = c"arrow_array";
/// `ArrowDeviceArray` capsules.
pub const DEVICE_ARRAY: &CStr = c"arrow_device_array";
/// `ArrowArrayStream` capsules.
pub const STREAM: &CStr = c"arrow_array_stream";
/// `ArrowDeviceArrayStream` capsules.
pub const DEVICE_STREAM: &CStr = c"arrow_device_array_stream";

/// Counts of the capsules this module made, for the tests' exactly-once checks:
/// created, destroyed after a consumer took the struct, destroyed releasing it.
static CREATED: AtomicU64 = AtomicU64::new(0);
static DESTROYED_CONSUMED: AtomicU64 = AtomicU64::new(0);
static DESTROYED_RELEASING: AtomicU64 = AtomicU64::new(0);

/// (created, destroyed consumed, destroyed releasing) so far.
pub fn counts() -> (u64, u64, u64) {
    (
        CREATED.load(Ordering::Relaxed),
        DESTROYED_CONSUMED.load(Ordering::Relaxed),
        DESTROYED_RELEASING.load(Ordering::Relaxed),
    )
}

/// A C struct of the Arrow C (Device) Data Interface that a capsule can own.
pub trait CStruct: Sized + Send + 'static {
    /// The capsule's name.
    const NAME: &'static CStr;
    /// Whether a consumer released or moved it out (its `release` is NULL).
    fn is_released(&self) -> bool;
    /// Releases it (only called while `!is_released()`).
    fn release_struct(self);
}

impl CStruct for FFI_ArrowSchema {
    const NAME: &'static CStr = SCHEMA;
    fn is_released(&self) -> bool {
        self.release().is_none()
    }
    fn release_struct(self) {
        drop(self); // arrow-rs's Drop calls `release` when it is non-NULL
    }
}

impl CStruct for FFI_ArrowArray {
    const NAME: &'static CStr = ARRAY;
    fn is_released(&self) -> bool {
        FFI_ArrowArray::is_released(self)
    }
    fn release_struct(self) {
        drop(self); // arrow-rs's Drop calls `release` when it is non-NULL
    }
}

impl CStruct for FFI_ArrowArrayStream {
    const NAME: &'static CStr = STREAM;
    fn is_released(&self) -> bool {
        FFI_ArrowArrayStream::release(self).is_none()
    }
    fn release_struct(self) {
        drop(self); // arrow-rs's Drop calls `release` when it is non-NULL
    }
}

/// The raw `ArrowDeviceArray` (devarrow's `#[repr(C)]` struct, no `Drop`), owned.
pub struct RawDeviceArray(pub ArrowDeviceArray);
// SAFETY: the C Device interface lets an unreleased array move between threads (its
// release may be called from any thread); only its owner touches it.
unsafe impl Send for RawDeviceArray {}

impl CStruct for RawDeviceArray {
    const NAME: &'static CStr = DEVICE_ARRAY;
    fn is_released(&self) -> bool {
        self.0.array.release.is_none()
    }
    fn release_struct(mut self) {
        if let Some(release) = self.0.array.release {
            // SAFETY: the array is unreleased and owned by the capsule; the spec's release
            // of an ArrowDeviceArray is its embedded ArrowArray's.
            unsafe { release(&mut self.0.array) };
        }
    }
}

/// The raw `ArrowDeviceArrayStream`, owned.
pub struct RawDeviceStream(pub ArrowDeviceArrayStream);
// SAFETY: as for `RawDeviceArray`: a stream may be used (not concurrently) and released
// from any thread.
unsafe impl Send for RawDeviceStream {}

impl CStruct for RawDeviceStream {
    const NAME: &'static CStr = DEVICE_STREAM;
    fn is_released(&self) -> bool {
        self.0.release.is_none()
    }
    fn release_struct(mut self) {
        if let Some(release) = self.0.release {
            // SAFETY: the stream is unreleased and owned by the capsule.
            unsafe { release(&mut self.0) };
        }
    }
}

/// The capsule destructor: releases the struct if no consumer took it, frees the box.
unsafe extern "C" fn destroy<T: CStruct>(capsule: *mut ffi::PyObject) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: called by Python with the dying capsule, made by `new` with this name and
        // a pointer from `Box::<T>::into_raw` that nothing else frees.
        let ptr = unsafe { ffi::PyCapsule_GetPointer(capsule, T::NAME.as_ptr()) };
        if ptr.is_null() {
            // SAFETY: GetPointer set an exception (the name changed): not ours to raise here.
            unsafe { ffi::PyErr_Clear() };
            return;
        }
        // SAFETY: see above: the box is ours, freed only here.
        let boxed = unsafe { Box::from_raw(ptr.cast::<T>()) };
        if boxed.is_released() {
            DESTROYED_CONSUMED.fetch_add(1, Ordering::Relaxed);
            // A consumer moved the struct out: nothing to release, only the box to free.
            std::mem::forget(*boxed);
        } else {
            DESTROYED_RELEASING.fetch_add(1, Ordering::Relaxed);
            boxed.release_struct();
        }
    }));
}

/// A new capsule owning `value` under `T::NAME`.
pub fn new<T: CStruct>(py: Python<'_>, value: T) -> PyResult<Bound<'_, PyAny>> {
    let ptr = Box::into_raw(Box::new(value));
    // SAFETY: `ptr` is a live box handed to the capsule, which frees it in `destroy`; the
    // name is a static C string, as the capsule keeps the pointer.
    let capsule = unsafe { ffi::PyCapsule_New(ptr.cast(), T::NAME.as_ptr(), Some(destroy::<T>)) };
    if capsule.is_null() {
        // SAFETY: the capsule was not made: the box is still ours.
        let value = unsafe { Box::from_raw(ptr) };
        value.release_struct();
        return Err(PyErr::fetch(py));
    }
    CREATED.fetch_add(1, Ordering::Relaxed);
    // SAFETY: a new, owned reference.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}

/// The pointer of a capsule named `name`, or a `TypeError` saying what was expected.
pub fn pointer(capsule: &Bound<'_, PyAny>, name: &CStr) -> PyResult<*mut c_void> {
    // SAFETY: `capsule` is a live object; IsValid checks its type and name.
    let valid = unsafe { ffi::PyCapsule_IsValid(capsule.as_ptr(), name.as_ptr()) };
    if valid != 1 {
        return Err(PyTypeError::new_err(format!(
            "expected a PyCapsule named {:?}, got {}",
            name.to_string_lossy(),
            describe(capsule)
        )));
    }
    // SAFETY: a valid capsule of that name (checked above).
    let ptr = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), name.as_ptr()) };
    if ptr.is_null() {
        return Err(PyErr::fetch(capsule.py()));
    }
    Ok(ptr)
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    // SAFETY: a live object; GetName on a non-capsule sets an error we clear.
    let name = unsafe { ffi::PyCapsule_GetName(obj.as_ptr()) };
    if name.is_null() {
        // SAFETY: clearing the error GetName may have set.
        unsafe { ffi::PyErr_Clear() };
        return format!(
            "a {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        );
    }
    // SAFETY: a capsule's name is a NUL-terminated string the capsule keeps alive.
    let name = unsafe { CStr::from_ptr(name) };
    format!("a PyCapsule named {:?}", name.to_string_lossy())
}

/// Moves the `ArrowSchema` out of an `arrow_schema` capsule (marking it released).
pub fn take_schema(capsule: &Bound<'_, PyAny>) -> PyResult<FFI_ArrowSchema> {
    let ptr = pointer(capsule, SCHEMA)?;
    // SAFETY: an `arrow_schema` capsule points to a valid, writable ArrowSchema, which
    // `take_schema` moves out (leaving a released one) or refuses if released.
    unsafe { devarrow::abi::take_schema(ptr.cast()) }.map_err(crate::errors::to_py)
}

/// Borrows the `ArrowSchema` of an `arrow_schema` capsule (a requested schema), as an
/// arrow-rs schema, without consuming it.
pub fn read_schema(capsule: &Bound<'_, PyAny>) -> PyResult<arrow_schema::Schema> {
    let ptr = pointer(capsule, SCHEMA)?;
    // SAFETY: an `arrow_schema` capsule points to a valid ArrowSchema that the capsule
    // keeps alive while we read it.
    let schema = unsafe { &*ptr.cast::<FFI_ArrowSchema>() };
    devarrow::abi::schema::import_schema(schema).map_err(crate::errors::to_py)
}

/// Moves the `ArrowArray` out of an `arrow_array` capsule.
pub fn take_array(capsule: &Bound<'_, PyAny>) -> PyResult<FFI_ArrowArray> {
    let ptr = pointer(capsule, ARRAY)?;
    // SAFETY: an `arrow_array` capsule points to a valid, writable ArrowArray; from_raw
    // moves it out and leaves a released one.
    let array = unsafe { FFI_ArrowArray::from_raw(ptr.cast()) };
    if array.is_released() {
        return Err(crate::errors::ReleasedError::new_err(
            "ArrowArray is released (its release callback is NULL)",
        ));
    }
    Ok(array)
}

/// Moves the `ArrowDeviceArray` out of an `arrow_device_array` capsule.
pub fn take_device_array(capsule: &Bound<'_, PyAny>) -> PyResult<devarrow::abi::DeviceArray> {
    let ptr = pointer(capsule, DEVICE_ARRAY)?;
    // SAFETY: an `arrow_device_array` capsule points to a valid, writable
    // ArrowDeviceArray filled by a producer of the C Device interface.
    unsafe { devarrow::abi::DeviceArray::from_raw(ptr.cast()) }.map_err(crate::errors::to_py)
}

/// Moves the `ArrowDeviceArrayStream` out of an `arrow_device_array_stream` capsule.
pub fn take_device_stream(
    capsule: &Bound<'_, PyAny>,
) -> PyResult<devarrow::abi::DeviceArrayStream> {
    let ptr = pointer(capsule, DEVICE_STREAM)?;
    // SAFETY: an `arrow_device_array_stream` capsule points to a valid, writable stream
    // filled by a producer of the C Device interface.
    unsafe { devarrow::abi::DeviceArrayStream::from_raw(ptr.cast()) }.map_err(crate::errors::to_py)
}

/// Moves the `ArrowArrayStream` out of an `arrow_array_stream` capsule.
pub fn take_stream(
    capsule: &Bound<'_, PyAny>,
) -> PyResult<arrow_array::ffi_stream::RecordBatchStreamReader> {
    let ptr = pointer(capsule, STREAM)?;
    // SAFETY: an `arrow_array_stream` capsule points to a valid, writable stream; from_raw
    // moves it out (leaving a released one) or refuses a released one.
    unsafe { arrow_array::ffi_stream::RecordBatchStreamReader::from_raw(ptr.cast()) }
        .map_err(|e| crate::errors::to_py(e.into()))
}
