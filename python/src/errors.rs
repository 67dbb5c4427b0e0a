//! devarrow's errors as typed Python exceptions: `devarrow.DevarrowError` and one
//! subclass per kind of failure a caller may want to catch on its own.

use devarrow::abi::Error;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

create_exception!(
    devarrow,
    DevarrowError,
    PyException,
    "The base class of every error devarrow raises."
);
create_exception!(
    devarrow,
    ReleasedError,
    DevarrowError,
    "A C struct (in a PyCapsule) was already released or consumed, or a devarrow object was \
     consumed (a DeviceStream handed to a consumer)."
);
create_exception!(
    devarrow,
    DeviceMismatchError,
    DevarrowError,
    "The data lives on another device of the same type (another device_id)."
);
create_exception!(
    devarrow,
    UnsupportedDeviceError,
    DevarrowError,
    "The data lives on a device type this call does not accept."
);
create_exception!(
    devarrow,
    DeviceUnavailableError,
    DevarrowError,
    "The device asked for does not open (no driver, no such device); the message says why."
);
create_exception!(
    devarrow,
    UnsupportedTypeError,
    DevarrowError,
    "The operation does not support the data's type (e.g. DLPack of a string column)."
);
create_exception!(
    devarrow,
    SchemaMismatchError,
    DevarrowError,
    "A requested_schema devarrow cannot honour (it does not cast: only the data's own schema)."
);
create_exception!(
    devarrow,
    InvalidArrayError,
    DevarrowError,
    "A foreign array or schema is malformed (buffers, offsets, children, format)."
);
create_exception!(
    devarrow,
    DeviceError,
    DevarrowError,
    "The device failed (a CUDA error, out of memory, a failed copy)."
);

/// The Python exception for a devarrow error (its message is the error's `Display`).
pub fn to_py(error: Error) -> PyErr {
    let message = error.to_string();
    match error {
        Error::Released { .. } => ReleasedError::new_err(message),
        Error::DeviceMismatch { .. } => DeviceMismatchError::new_err(message),
        Error::UnsupportedDevice { .. } => UnsupportedDeviceError::new_err(message),
        Error::Device { .. } => DeviceError::new_err(message),
        Error::NullPointer { .. }
        | Error::UnexpectedSyncEvent { .. }
        | Error::BufferCount { .. }
        | Error::ChildCount { .. }
        | Error::Dictionary { .. }
        | Error::InvalidField { .. }
        | Error::NullBuffer { .. }
        | Error::MisalignedBuffer { .. }
        | Error::InvalidOffsets { .. }
        | Error::Schema(_)
        | Error::Metadata(_) => InvalidArrayError::new_err(message),
        Error::NotConvertible { .. } => UnsupportedTypeError::new_err(message),
        Error::Arrow(arrow_schema::ArrowError::NotYetImplemented(_)) => {
            UnsupportedTypeError::new_err(message)
        }
        // arrow-rs's validation of an import: values that break their type's rules
        Error::Arrow(arrow_schema::ArrowError::InvalidArgumentError(_)) => {
            InvalidArrayError::new_err(message)
        }
        _ => DevarrowError::new_err(message),
    }
}

/// `.map_err(to_py)` for devarrow results.
pub trait IntoPy<T> {
    /// The result with a devarrow error as its Python exception.
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPy<T> for devarrow::abi::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}
