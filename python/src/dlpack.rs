//! DLPack (the Python array API's `__dlpack__` protocol) over a device buffer of a
//! `DeviceBatch`: `dltensor` capsules (`DLManagedTensor`, DLPack < 1.0) and
//! `dltensor_versioned` capsules (`DLManagedTensorVersioned`, DLPack 1.x).
//!
//! The tensor aliases devarrow's buffer (zero-copy) and keeps the batch alive (a clone
//! of the `DeviceBatch` in `manager_ctx`) until the consumer calls `deleter`. A capsule
//! no consumer took (still named `dltensor` / `dltensor_versioned`, not `used_...`)
//! calls `deleter` in its destructor; a consumer renames it and owns the tensor.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use devarrow::bridge::DeviceBatch;
use pyo3::prelude::*;
use pyo3::{ffi, PyErr};

// Device types: DLPack's `DLDeviceType` codes are the Arrow C Device interface's
// (`kDLCPU` = `ARROW_DEVICE_CPU` = 1, `kDLCUDA` = 2, `kDLCUDAHost` = 3, ...), so a
// `DLDevice` takes an `ArrowDeviceType`'s value as it is.

/// `kDLInt`, `kDLUInt`, `kDLFloat`.
pub const DL_INT: u8 = 0;
pub const DL_UINT: u8 = 1;
pub const DL_FLOAT: u8 = 2;

const LEGACY: &CStr = c"dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";

/// The DLPack version devarrow produces with `max_version >= (1, 0)`.
pub const VERSION: (u32, u32) = (1, 1);

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
#[derive(Debug)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
#[derive(Debug)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
#[derive(Debug)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
#[derive(Debug)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// A one-dimensional, contiguous view of device memory that a batch keeps alive.
#[derive(Debug, Clone)]
pub struct View {
    /// Keeps the memory alive.
    pub batch: DeviceBatch,
    /// The first element's address.
    pub address: u64,
    /// Elements.
    pub len: usize,
    pub dtype: DLDataType,
    pub device: DLDevice,
}

/// A tensor and what it points into, in one box (the tensor first: the consumer's
/// pointer is the box's).
#[repr(C)]
struct Managed<T> {
    tensor: T,
    shape: [i64; 1],
    strides: [i64; 1],
    _batch: DeviceBatch,
}

fn dl_tensor(view: &View) -> DLTensor {
    DLTensor {
        data: view.address as *mut c_void,
        device: view.device,
        ndim: 1,
        dtype: view.dtype,
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

/// The two kinds of managed tensors: where their `manager_ctx` and `DLTensor` are.
trait ManagedTensor {
    fn parts(&mut self) -> (&mut *mut c_void, &mut DLTensor);
}

impl ManagedTensor for DLManagedTensor {
    fn parts(&mut self) -> (&mut *mut c_void, &mut DLTensor) {
        (&mut self.manager_ctx, &mut self.dl_tensor)
    }
}

impl ManagedTensor for DLManagedTensorVersioned {
    fn parts(&mut self) -> (&mut *mut c_void, &mut DLTensor) {
        (&mut self.manager_ctx, &mut self.dl_tensor)
    }
}

/// `tensor` boxed with its shape, strides and a clone of the batch, pointing at them.
fn boxed<T: ManagedTensor>(tensor: T, view: &View) -> *mut c_void {
    let mut managed = Box::new(Managed {
        tensor,
        shape: [view.len as i64],
        strides: [1],
        _batch: view.batch.clone(),
    });
    let this: *mut Managed<T> = &mut *managed;
    let shape = managed.shape.as_mut_ptr();
    let strides = managed.strides.as_mut_ptr();
    let (ctx, dl) = managed.tensor.parts();
    *ctx = this.cast();
    dl.shape = shape;
    dl.strides = strides;
    Box::into_raw(managed).cast()
}

unsafe extern "C" fn delete_legacy(tensor: *mut DLManagedTensor) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if !tensor.is_null() {
            // SAFETY: `tensor` is the box made by `legacy_capsule`, deleted once (by its
            // consumer or by the capsule).
            drop(unsafe { Box::from_raw(tensor.cast::<Managed<DLManagedTensor>>()) });
        }
    }));
}

unsafe extern "C" fn delete_versioned(tensor: *mut DLManagedTensorVersioned) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if !tensor.is_null() {
            // SAFETY: as in `delete_legacy`, for `versioned_capsule`'s box.
            drop(unsafe { Box::from_raw(tensor.cast::<Managed<DLManagedTensorVersioned>>()) });
        }
    }));
}

/// Capsule destructor: a capsule still named `dltensor` was never consumed.
unsafe extern "C" fn destroy_legacy(capsule: *mut ffi::PyObject) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the dying capsule; IsValid only checks its name.
        if unsafe { ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) } != 1 {
            return; // renamed `used_dltensor`: the consumer owns the tensor
        }
        // SAFETY: valid, with our name: the pointer is our unconsumed tensor.
        let tensor = unsafe { ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()) };
        // SAFETY: the tensor was never handed to a consumer: delete it once, here.
        unsafe { delete_legacy(tensor.cast()) };
    }));
}

/// Capsule destructor: a capsule still named `dltensor_versioned` was never consumed.
unsafe extern "C" fn destroy_versioned(capsule: *mut ffi::PyObject) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the dying capsule; IsValid only checks its name.
        if unsafe { ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) } != 1 {
            return; // renamed `used_dltensor_versioned`: the consumer owns the tensor
        }
        // SAFETY: valid, with our name: the pointer is our unconsumed tensor.
        let tensor = unsafe { ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr()) };
        // SAFETY: the tensor was never handed to a consumer: delete it once, here.
        unsafe { delete_versioned(tensor.cast()) };
    }));
}

/// The DLPack capsule of `view`: versioned when `versioned`, else legacy.
pub fn capsule(py: Python<'_>, view: View, versioned: bool) -> PyResult<Bound<'_, PyAny>> {
    let (ptr, name, destructor): (*mut c_void, &CStr, Option<ffi::PyCapsule_Destructor>) =
        if versioned {
            let tensor = DLManagedTensorVersioned {
                version: DLPackVersion {
                    major: VERSION.0,
                    minor: VERSION.1,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags: 0,
                dl_tensor: dl_tensor(&view),
            };
            (boxed(tensor, &view), VERSIONED, Some(destroy_versioned))
        } else {
            let tensor = DLManagedTensor {
                dl_tensor: dl_tensor(&view),
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            };
            (boxed(tensor, &view), LEGACY, Some(destroy_legacy))
        };
    // SAFETY: `ptr` is the live box, owned by the capsule until a consumer renames it; the
    // name is static.
    let capsule = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), destructor) };
    if capsule.is_null() {
        // SAFETY: the capsule was not made: the box is still ours, deleted once here.
        unsafe {
            if versioned {
                delete_versioned(ptr.cast());
            } else {
                delete_legacy(ptr.cast());
            }
        }
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new, owned reference.
    Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
}
