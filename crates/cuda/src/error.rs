//! [`CudaError`]: everything that can go wrong talking to CUDA, as a typed error.

use cudarc::driver::{result::DriverError, sys};
use devarrow_abi::ArrowDeviceType;

/// A failure of the CUDA layer. Never a panic: a missing driver, a missing device and
/// an exhausted device memory are all reported here.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded.
    #[error("the CUDA driver library (libcuda) is not available on this machine")]
    NoDriver,
    /// The driver is present but reports no CUDA device.
    #[error("no CUDA device is available")]
    NoDevice,
    /// The device id is not below the number of devices.
    #[error("CUDA device {id} does not exist ({count} device(s) available)")]
    InvalidDeviceId {
        /// The id asked for.
        id: usize,
        /// How many devices there are.
        count: usize,
    },
    /// An allocation failed because the device (or pinned host) memory is exhausted.
    #[error("out of memory allocating {bytes} bytes")]
    OutOfMemory {
        /// The size of the failed allocation.
        bytes: usize,
    },
    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({code})")]
    Driver {
        /// The driver call (e.g. `cuMemAllocAsync`).
        call: &'static str,
        /// The numeric `CUresult`.
        code: u32,
        /// The `CUresult` name (e.g. `CUDA_ERROR_INVALID_VALUE`).
        name: String,
    },
    /// The data lives on a device type this call does not handle.
    #[error("unsupported device type {found} (expected {expected})")]
    UnsupportedDeviceType {
        /// The device type found.
        found: ArrowDeviceType,
        /// What the call accepts.
        expected: &'static str,
    },
    /// The data lives on another CUDA device than the stream or device given.
    #[error("data is on CUDA device {found}, but the stream belongs to device {expected}")]
    DeviceMismatch {
        /// The device of the stream or context.
        expected: i64,
        /// The device of the data.
        found: i64,
    },
    /// The device lacks a capability the call needs (e.g. managed memory).
    #[error("the device does not support {0}")]
    Unsupported(&'static str),
    /// A bad argument (length, alignment, layout the CUDA export cannot represent, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An error of the Arrow C Device interface layer.
    #[error("{0}")]
    Abi(String),
}

/// `Result` with [`CudaError`].
pub type Result<T, E = CudaError> = std::result::Result<T, E>;

impl CudaError {
    /// Wraps a driver error of `call`, mapping `CUDA_ERROR_OUT_OF_MEMORY` to
    /// [`CudaError::OutOfMemory`] with `bytes` when an allocation size is known.
    pub(crate) fn driver(call: &'static str, err: DriverError) -> Self {
        Self::driver_alloc(call, err, None)
    }

    pub(crate) fn driver_alloc(call: &'static str, err: DriverError, bytes: Option<usize>) -> Self {
        match (err.0, bytes) {
            (sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, Some(bytes)) => Self::OutOfMemory { bytes },
            (sys::CUresult::CUDA_ERROR_NO_DEVICE, _) => Self::NoDevice,
            (code, _) => Self::Driver {
                call,
                code: code as u32,
                name: format!("{code:?}"),
            },
        }
    }

    /// Whether this is [`CudaError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Self::OutOfMemory { .. })
    }
}

/// Adds the name of the failing driver call to a cudarc [`DriverError`].
pub(crate) trait DriverResultExt<T> {
    /// Maps the error to [`CudaError::Driver`] naming `call`.
    fn call(self, call: &'static str) -> Result<T>;
    /// Maps the error of an allocation of `bytes` (out of memory becomes
    /// [`CudaError::OutOfMemory`]).
    fn alloc(self, call: &'static str, bytes: usize) -> Result<T>;
}

impl<T> DriverResultExt<T> for std::result::Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|e| CudaError::driver(call, e))
    }

    fn alloc(self, call: &'static str, bytes: usize) -> Result<T> {
        self.map_err(|e| CudaError::driver_alloc(call, e, Some(bytes)))
    }
}

impl From<CudaError> for devarrow_abi::Error {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::UnsupportedDeviceType { found, expected } => {
                devarrow_abi::Error::UnsupportedDevice {
                    found,
                    accepted: expected.to_string(),
                }
            }
            CudaError::InvalidArgument(m) => devarrow_abi::Error::InvalidArgument(m),
            // Out of memory stays out of memory (ENOMEM at the C boundary), as on the CPU
            // device.
            e @ CudaError::OutOfMemory { .. } => devarrow_abi::Error::Arrow(
                arrow_schema::ArrowError::MemoryError(format!("CUDA: {e}")),
            ),
            CudaError::DeviceMismatch { expected, found } => devarrow_abi::Error::DeviceMismatch {
                device_type: ArrowDeviceType::CUDA,
                expected,
                found,
            },
            other => devarrow_abi::Error::Device {
                device: "CUDA",
                message: other.to_string(),
            },
        }
    }
}

impl From<devarrow_abi::Error> for CudaError {
    fn from(e: devarrow_abi::Error) -> Self {
        CudaError::Abi(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_is_typed() {
        let e = CudaError::driver_alloc(
            "cuMemAlloc",
            DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            Some(42),
        );
        assert!(e.is_out_of_memory());
        assert_eq!(e.to_string(), "out of memory allocating 42 bytes");
        let e = CudaError::driver(
            "cuMemcpy",
            DriverError(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
        );
        assert_eq!(
            e.to_string(),
            "cuMemcpy failed: CUDA_ERROR_INVALID_VALUE (1)"
        );
    }

    #[test]
    fn converts_to_abi_error() {
        let e: devarrow_abi::Error = CudaError::NoDriver.into();
        assert!(matches!(
            e,
            devarrow_abi::Error::Device { device: "CUDA", .. }
        ));
        assert_eq!(e.errno(), devarrow_abi::error::errno::EIO);
        let e: devarrow_abi::Error = CudaError::UnsupportedDeviceType {
            found: ArrowDeviceType::METAL,
            expected: "CUDA",
        }
        .into();
        assert!(matches!(e, devarrow_abi::Error::UnsupportedDevice { .. }));
        let e: devarrow_abi::Error = CudaError::OutOfMemory { bytes: 7 }.into();
        assert_eq!(e.errno(), devarrow_abi::error::errno::ENOMEM);
        assert!(e.to_string().contains("out of memory allocating 7 bytes"));
        let e: devarrow_abi::Error = CudaError::DeviceMismatch {
            expected: 0,
            found: 1,
        }
        .into();
        assert!(matches!(
            e,
            devarrow_abi::Error::DeviceMismatch {
                expected: 0,
                found: 1,
                ..
            }
        ));
    }
}
