//! [`CudaError`]: everything that can go wrong talking to CUDA, as a typed error.

use cudarc::driver::{sys, DriverError};
use devarrow_abi::ArrowDeviceType;

/// A failure of the CUDA layer. Never a panic: a missing driver, a missing device and
/// an exhausted device memory are all reported here.
///
/// A failed driver call keeps cudarc's [`DriverError`] as its
/// [`source`](std::error::Error::source) ([`CudaError::driver_result`] gives its
/// `CUresult`), and an error of the ABI layer is kept as it is ([`CudaError::Abi`]), so
/// the cause and its errno code survive conversions to [`devarrow_abi::Error`] and
/// arrow-rs's `ArrowError` and back.
#[derive(thiserror::Error)]
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
    /// A CUDA driver call failed (e.g. `cuMemcpy failed: CUDA_ERROR_INVALID_VALUE (1)`).
    #[error("{call} failed: {name:?} ({code})", name = .source.0, code = .source.0 as u32)]
    Driver {
        /// The driver call (e.g. `cuMemAllocAsync`).
        call: &'static str,
        /// cudarc's error, holding the `CUresult` the call returned.
        #[source]
        source: DriverError,
    },
    /// The driver's JIT could not load a PTX module.
    #[error("loading the PTX module {module} failed: {:?}{}", .source.0, log_suffix(.log))]
    ModuleLoad {
        /// The module (`kernels/copy.ptx`, ...).
        module: &'static str,
        /// The JIT's error log, empty when it gave none.
        log: String,
        /// The driver's error.
        #[source]
        source: DriverError,
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
    /// The device claims a capability, but the driver refused the call that uses it with
    /// an error that leaves the context usable (not [sticky](is_sticky_error)): what
    /// restricted runtimes do, sandboxes such as gVisor's nvproxy (GKE Sandbox, hosted
    /// notebooks), which answer `CUDA_ERROR_OPERATING_SYSTEM` or
    /// `CUDA_ERROR_NOT_PERMITTED` to what they do not support (managed memory, say).
    /// [`CudaError::driver_result`] gives the driver's code.
    #[error(
        "{feature} is not available here: {call} failed with {name:?} ({code}); \
         restricted runtimes (sandboxes such as gVisor) refuse it",
        name = .source.0,
        code = .source.0 as u32
    )]
    Refused {
        /// What was refused (e.g. `managed memory`).
        feature: &'static str,
        /// The driver call (e.g. `cuMemAllocManaged`).
        call: &'static str,
        /// cudarc's error, holding the `CUresult` the call returned.
        #[source]
        source: DriverError,
    },
    /// A bad argument (length, alignment, layout the CUDA export cannot represent, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A stream of a context that devarrow does not work in: devarrow allocates, copies
    /// and records events in the **primary** context of each device, so a stream given
    /// to it must belong to that context (the CUDA runtime's and cudarc's
    /// `CudaContext::new` use it), not to a context made with `cuCtxCreate`.
    #[error(
        "the stream belongs to a context of CUDA device {device} other than its primary \
         context; devarrow works in the primary context of each device"
    )]
    NotPrimaryContext {
        /// The stream's device.
        device: usize,
    },
    /// The Rust element type does not fit the Arrow data type (e.g. `f32` values for an
    /// `Int32` array, or a view of `Utf8` values as `i32`).
    #[error("{native} elements do not fit the Arrow data type {data_type}")]
    TypeMismatch {
        /// The Arrow data type.
        data_type: arrow_schema::DataType,
        /// The Rust element type (e.g. `i32`).
        native: &'static str,
    },
    /// A buffer holds fewer bytes than its array needs.
    #[error("the {buffer} buffer holds {bytes} bytes, but {needed} are needed")]
    BufferTooShort {
        /// Which buffer (e.g. `validity`).
        buffer: &'static str,
        /// Its size in bytes.
        bytes: usize,
        /// What the array needs.
        needed: usize,
    },
    /// A device buffer cannot be viewed as a slice of the element type asked for: its
    /// address is not aligned for it, or its length is not a multiple of its size.
    #[error(
        "a buffer of {bytes} bytes at {address:#x} cannot be viewed as [{element}] \
         (size {size}, alignment {align})"
    )]
    NotViewable {
        /// The buffer's device address.
        address: u64,
        /// The buffer's length in bytes.
        bytes: usize,
        /// The element type asked for.
        element: &'static str,
        /// Its size in bytes.
        size: usize,
        /// Its alignment in bytes.
        align: usize,
    },
    /// An error of the Arrow C Device interface layer, kept as it is (its errno code
    /// included). Converting it back to a [`devarrow_abi::Error`] gives that error.
    #[error(transparent)]
    Abi(devarrow_abi::Error),
}

/// Like a derived `Debug`, except that the [`DriverError`] of [`CudaError::Driver`] is
/// shown by its `CUresult` only: cudarc's `Debug` (and `Display`) of a `DriverError` asks
/// the driver for its description, and would panic where the driver library is missing.
impl std::fmt::Debug for CudaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoDriver => f.write_str("NoDriver"),
            Self::NoDevice => f.write_str("NoDevice"),
            Self::InvalidDeviceId { id, count } => f
                .debug_struct("InvalidDeviceId")
                .field("id", id)
                .field("count", count)
                .finish(),
            Self::OutOfMemory { bytes } => {
                f.debug_struct("OutOfMemory").field("bytes", bytes).finish()
            }
            Self::Driver { call, source } => f
                .debug_struct("Driver")
                .field("call", call)
                .field("source", &format_args!("DriverError({:?})", source.0))
                .finish(),
            Self::ModuleLoad {
                module,
                log,
                source,
            } => f
                .debug_struct("ModuleLoad")
                .field("module", module)
                .field("log", log)
                .field("source", &format_args!("DriverError({:?})", source.0))
                .finish(),
            Self::UnsupportedDeviceType { found, expected } => f
                .debug_struct("UnsupportedDeviceType")
                .field("found", found)
                .field("expected", expected)
                .finish(),
            Self::DeviceMismatch { expected, found } => f
                .debug_struct("DeviceMismatch")
                .field("expected", expected)
                .field("found", found)
                .finish(),
            Self::Unsupported(what) => f.debug_tuple("Unsupported").field(what).finish(),
            Self::Refused {
                feature,
                call,
                source,
            } => f
                .debug_struct("Refused")
                .field("feature", feature)
                .field("call", call)
                .field("source", &format_args!("DriverError({:?})", source.0))
                .finish(),
            Self::InvalidArgument(message) => {
                f.debug_tuple("InvalidArgument").field(message).finish()
            }
            Self::NotPrimaryContext { device } => f
                .debug_struct("NotPrimaryContext")
                .field("device", device)
                .finish(),
            Self::TypeMismatch { data_type, native } => f
                .debug_struct("TypeMismatch")
                .field("data_type", data_type)
                .field("native", native)
                .finish(),
            Self::BufferTooShort {
                buffer,
                bytes,
                needed,
            } => f
                .debug_struct("BufferTooShort")
                .field("buffer", buffer)
                .field("bytes", bytes)
                .field("needed", needed)
                .finish(),
            Self::NotViewable {
                address,
                bytes,
                element,
                size,
                align,
            } => f
                .debug_struct("NotViewable")
                .field("address", &format_args!("{address:#x}"))
                .field("bytes", bytes)
                .field("element", element)
                .field("size", size)
                .field("align", align)
                .finish(),
            Self::Abi(e) => f.debug_tuple("Abi").field(e).finish(),
        }
    }
}

fn log_suffix(log: &str) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!("; the JIT says: {log}")
    }
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
            _ => Self::Driver { call, source: err },
        }
    }

    /// The `CUresult` of the failed driver call of a [`CudaError::Driver`] or
    /// [`CudaError::Refused`]; `None` for every other variant (including
    /// [`CudaError::OutOfMemory`] and [`CudaError::NoDevice`], which the driver's
    /// `CUDA_ERROR_OUT_OF_MEMORY` and `CUDA_ERROR_NO_DEVICE` become).
    pub fn driver_result(&self) -> Option<sys::CUresult> {
        match self {
            Self::Driver { source, .. } | Self::Refused { source, .. } => Some(source.0),
            _ => None,
        }
    }

    /// Whether this is a driver error that corrupted the context ([`is_sticky_error`]):
    /// every later call in the context fails with it, and nothing can fall back.
    pub fn is_sticky(&self) -> bool {
        self.driver_result().is_some_and(is_sticky_error)
    }

    /// Whether devarrow may answer this failure of an optional driver feature
    /// (`cuMemHostRegister`, `cuMemcpyBatchAsync`) by doing without it: a driver error
    /// that is not [sticky](is_sticky_error), and that does not say the context or the
    /// driver is gone (`CUDA_ERROR_NOT_INITIALIZED`, `_DEINITIALIZED`,
    /// `_INVALID_CONTEXT`, `_CONTEXT_IS_DESTROYED`: the plain path would fail the same
    /// way, and the error is better reported where it arose). Every other code counts,
    /// whatever the driver chose to say "not here" with: `CUDA_ERROR_NOT_SUPPORTED`
    /// from a driver without the feature, `CUDA_ERROR_OPERATING_SYSTEM` or
    /// `CUDA_ERROR_NOT_PERMITTED` from a sandbox (gVisor's nvproxy), and so on.
    pub(crate) fn allows_fallback(&self) -> bool {
        use sys::CUresult::*;
        match self.driver_result() {
            Some(
                CUDA_ERROR_NOT_INITIALIZED
                | CUDA_ERROR_DEINITIALIZED
                | CUDA_ERROR_INVALID_CONTEXT
                | CUDA_ERROR_CONTEXT_IS_DESTROYED,
            ) => false,
            Some(code) => !is_sticky_error(code),
            None => false,
        }
    }

    /// Whether this is [`CudaError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Self::OutOfMemory { .. })
    }
}

/// Whether `code` is a *sticky* driver error: one that corrupts the context, so that "any
/// further CUDA work will return the same error" and "the process must be terminated
/// and relaunched" (the words of NVIDIA's `cuda.h` for each of them):
/// `CUDA_ERROR_ILLEGAL_ADDRESS`, `_LAUNCH_TIMEOUT`, `_HARDWARE_STACK_ERROR`,
/// `_ILLEGAL_INSTRUCTION`, `_MISALIGNED_ADDRESS`, `_INVALID_ADDRESS_SPACE`,
/// `_INVALID_PC`, `_LAUNCH_FAILED`, and `_ASSERT` (a device-side assert: "the context
/// cannot be used anymore, and must be destroyed"); with them
/// `CUDA_ERROR_ECC_UNCORRECTABLE` (an uncorrectable ECC error found during execution:
/// the device memory can no longer be trusted). Every other code is an error of the one
/// call (a bad argument, an exhausted resource, a feature the driver or a sandbox
/// refuses), after which the context works on.
///
/// (CUDA 12.x's `CUDA_ERROR_CONTAINED`, also sticky, is not in the CUDA 12.8 bindings
/// devarrow is built with; it would count as not sticky.)
///
/// ```
/// use devarrow_cuda::cudarc::driver::sys::CUresult;
/// use devarrow_cuda::is_sticky_error;
///
/// // The context is corrupted: only resetting it (or a new process) recovers.
/// assert!(is_sticky_error(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS));
/// // An error of the one call: the context works on (optional features fall back).
/// assert!(!is_sticky_error(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
/// assert!(!is_sticky_error(CUresult::CUDA_ERROR_NOT_SUPPORTED));
/// ```
pub fn is_sticky_error(code: sys::CUresult) -> bool {
    use sys::CUresult::*;
    matches!(
        code,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_ECC_UNCORRECTABLE
    )
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
            // An ABI error that passed through the CUDA layer comes back as it was.
            CudaError::Abi(e) => e,
            other => devarrow_abi::Error::Device {
                device: "CUDA",
                source: Box::new(other),
            },
        }
    }
}

impl From<devarrow_abi::Error> for CudaError {
    /// [`CudaError::Abi`], except that a [`devarrow_abi::Error::Device`] made from a
    /// `CudaError` gives that `CudaError` back, so round trips do not nest.
    fn from(e: devarrow_abi::Error) -> Self {
        match e {
            devarrow_abi::Error::Device { device, source } => match source.downcast() {
                Ok(cuda) => *cuda,
                Err(source) => CudaError::Abi(devarrow_abi::Error::Device { device, source }),
            },
            e => CudaError::Abi(e),
        }
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
    fn sticky_errors_are_those_that_corrupt_the_context() {
        use sys::CUresult::*;
        for code in [
            CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_LAUNCH_FAILED,
            CUDA_ERROR_ILLEGAL_INSTRUCTION,
            CUDA_ERROR_MISALIGNED_ADDRESS,
            CUDA_ERROR_HARDWARE_STACK_ERROR,
            CUDA_ERROR_INVALID_PC,
            CUDA_ERROR_ECC_UNCORRECTABLE,
            CUDA_ERROR_ASSERT,
        ] {
            assert!(is_sticky_error(code), "{code:?}");
            let e = CudaError::driver("cuMemcpyBatchAsync", DriverError(code));
            assert!(e.is_sticky() && !e.allows_fallback(), "{code:?}");
        }
        for code in [
            CUDA_ERROR_NOT_SUPPORTED,
            CUDA_ERROR_NOT_FOUND,
            CUDA_ERROR_OPERATING_SYSTEM,
            CUDA_ERROR_NOT_PERMITTED,
            CUDA_ERROR_INVALID_VALUE,
            CUDA_ERROR_UNKNOWN,
        ] {
            assert!(!is_sticky_error(code), "{code:?}");
            let e = CudaError::driver("cuMemHostRegister", DriverError(code));
            assert!(!e.is_sticky() && e.allows_fallback(), "{code:?}");
        }
        for code in [CUDA_ERROR_CONTEXT_IS_DESTROYED, CUDA_ERROR_DEINITIALIZED] {
            assert!(!CudaError::driver("cuMemHostRegister", DriverError(code)).allows_fallback());
        }
        assert!(!CudaError::NoDevice.allows_fallback());
        let refused = CudaError::Refused {
            feature: "managed memory",
            call: "cuMemAllocManaged",
            source: DriverError(CUDA_ERROR_OPERATING_SYSTEM),
        };
        assert_eq!(refused.driver_result(), Some(CUDA_ERROR_OPERATING_SYSTEM));
        assert!(refused
            .to_string()
            .contains("managed memory is not available here"));
        assert!(format!("{refused:?}").contains("CUDA_ERROR_OPERATING_SYSTEM"));
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

    /// The errors of a source chain, outermost first.
    fn chain<'a>(
        e: &'a (dyn std::error::Error + 'static),
    ) -> Vec<&'a (dyn std::error::Error + 'static)> {
        let mut out = vec![e];
        while let Some(next) = out.last().unwrap().source() {
            out.push(next);
        }
        out
    }

    #[test]
    fn a_driver_error_survives_a_round_trip_through_abi_and_arrow_errors() {
        use arrow_schema::ArrowError;
        use devarrow_abi::error::errno;
        let invalid = sys::CUresult::CUDA_ERROR_INVALID_VALUE;
        let e = CudaError::driver("cuMemcpy", DriverError(invalid));
        assert_eq!(e.driver_result(), Some(invalid));
        // Debug shows the CUresult without asking the (here missing) driver library.
        assert!(
            format!("{e:?}").contains("CUDA_ERROR_INVALID_VALUE"),
            "{e:?}"
        );

        let abi: devarrow_abi::Error = e.into();
        assert_eq!(abi.errno(), errno::EIO);
        assert_eq!(
            abi.to_string(),
            "CUDA error: cuMemcpy failed: CUDA_ERROR_INVALID_VALUE (1)"
        );
        let arrow: ArrowError = abi.into();
        // ArrowError -> devarrow_abi::Error -> CudaError -> DriverError.
        let links = chain(&arrow);
        assert_eq!(links.len(), 4, "{arrow:?}");
        assert!(links[1].is::<devarrow_abi::Error>());
        let cuda = links[2].downcast_ref::<CudaError>().expect("a CudaError");
        assert_eq!(cuda.driver_result(), Some(invalid));
        assert_eq!(
            links[3].downcast_ref::<DriverError>().map(|d| d.0),
            Some(invalid)
        );

        let abi = devarrow_abi::Error::from(arrow);
        assert_eq!(abi.errno(), errno::EIO);
        let back = CudaError::from(abi);
        assert!(
            matches!(
                back,
                CudaError::Driver {
                    call: "cuMemcpy",
                    ..
                }
            ),
            "{back:?}"
        );
        assert_eq!(back.driver_result(), Some(invalid));
        assert_eq!(
            back.to_string(),
            "cuMemcpy failed: CUDA_ERROR_INVALID_VALUE (1)"
        );
        let links = chain(&back);
        assert_eq!(links.len(), 2);
        assert_eq!(
            links[1].downcast_ref::<DriverError>().map(|d| d.0),
            Some(invalid)
        );
        // Once more: the round trip does not nest.
        let again = CudaError::from(devarrow_abi::Error::from(back));
        assert!(matches!(again, CudaError::Driver { .. }), "{again:?}");
    }

    #[test]
    fn an_abi_error_keeps_its_errno_through_cuda_and_arrow_errors() {
        use arrow_schema::ArrowError;
        use devarrow_abi::error::errno;
        let callback = || devarrow_abi::Error::Callback {
            operation: "get_next",
            code: errno::ENOMEM,
            message: "the producer ran out of memory".into(),
        };
        let e = CudaError::from(callback());
        assert!(
            matches!(&e, CudaError::Abi(devarrow_abi::Error::Callback { .. })),
            "{e:?}"
        );
        assert_eq!(e.to_string(), callback().to_string());
        assert_eq!(e.driver_result(), None);

        let abi: devarrow_abi::Error = e.into();
        assert!(
            matches!(abi, devarrow_abi::Error::Callback { .. }),
            "{abi:?}"
        );
        assert_eq!(abi.errno(), errno::ENOMEM);
        let arrow: ArrowError = abi.into();
        let back = CudaError::from(devarrow_abi::Error::from(arrow));
        assert_eq!(devarrow_abi::Error::from(back).errno(), errno::ENOMEM);

        // A device error of another crate stays what it is.
        let other = devarrow_abi::Error::Device {
            device: "TEST",
            source: "refused".into(),
        };
        let e = CudaError::from(other);
        assert_eq!(e.to_string(), "TEST error: refused");
        let abi: devarrow_abi::Error = e.into();
        assert!(
            matches!(abi, devarrow_abi::Error::Device { device: "TEST", .. }),
            "{abi:?}"
        );
        assert_eq!(abi.errno(), errno::EIO);
    }
}
