//! The one error type of devarrow's ABI layer.

use crate::ArrowDeviceType;
use arrow_schema::ArrowError;

/// Everything that can go wrong moving Arrow data across the C Device Data Interface.
///
/// Errors about a malformed struct carry the `path` of the offending array inside the
/// imported one (`"array"`, `"array.children[1]"`, `"array.dictionary"`, ...).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A NULL pointer was passed where a struct was expected.
    #[error("{what} pointer is NULL")]
    NullPointer {
        /// What the pointer should have pointed to.
        what: &'static str,
    },
    /// The struct is released (its `release` callback is NULL) and cannot be used.
    #[error("{what} is released (its release callback is NULL)")]
    Released {
        /// Which struct.
        what: &'static str,
    },
    /// The data lives on a device this call does not accept.
    #[error("data on {found} is not accepted here (accepted: {accepted})")]
    UnsupportedDevice {
        /// The device type of the data.
        found: ArrowDeviceType,
        /// What the call accepts.
        accepted: String,
    },
    /// The data lives on a device of the accepted type, but on another device (its
    /// `device_id` differs).
    #[error(
        "data on {device_type} device {found} is not accepted here (expected device {expected})"
    )]
    DeviceMismatch {
        /// The device type of the data.
        device_type: ArrowDeviceType,
        /// The `device_id` accepted.
        expected: i64,
        /// The `device_id` of the data.
        found: i64,
    },
    /// A `sync_event` was given where the device type has no event type.
    #[error("{device_type} has no event type, but sync_event is not NULL")]
    UnexpectedSyncEvent {
        /// The device type of the data.
        device_type: ArrowDeviceType,
    },
    /// `n_buffers` does not match the layout of the schema's type.
    #[error("{path}: a {data_type} array has {expected} buffers, found n_buffers = {found}")]
    BufferCount {
        /// Where in the array.
        path: String,
        /// The type from the schema.
        data_type: String,
        /// What the layout requires.
        expected: String,
        /// What the struct said.
        found: i64,
    },
    /// `n_children` does not match the schema.
    #[error("{path}: a {data_type} array has {expected} children, found n_children = {found}")]
    ChildCount {
        /// Where in the array.
        path: String,
        /// The type from the schema.
        data_type: String,
        /// What the schema requires.
        expected: usize,
        /// What the struct said.
        found: i64,
    },
    /// A dictionary is missing, or present on a non-dictionary type.
    #[error("{path}: {message}")]
    Dictionary {
        /// Where in the array.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// `length`, `offset` or `null_count` is negative (or `null_count` exceeds the length).
    #[error("{path}: invalid {field} = {value}")]
    InvalidField {
        /// Where in the array.
        path: String,
        /// `length`, `offset` or `null_count`.
        field: &'static str,
        /// The value found.
        value: i64,
    },
    /// A buffer pointer is NULL where the layout requires data.
    #[error("{path}: buffer {index} ({role}) is NULL but {bytes} bytes are required")]
    NullBuffer {
        /// Where in the array.
        path: String,
        /// The buffer index in the C struct.
        index: usize,
        /// What the buffer holds (`validity`, `offsets`, `values`, ...).
        role: &'static str,
        /// How many bytes the layout requires.
        bytes: usize,
    },
    /// A buffer is not aligned as an importer needs it: arrow-rs reads the last offset of
    /// a string or binary array and the variadic buffer sizes of a view array in place, as
    /// `i32`/`i64`s (the C data interface lets a consumer refuse unaligned buffers).
    #[error("{path}: buffer {index} ({role}) at {address:#x} is not aligned to {align} bytes")]
    MisalignedBuffer {
        /// Where in the array.
        path: String,
        /// The buffer index in the C struct.
        index: usize,
        /// What the buffer holds (`offsets`, `variadic buffer sizes`).
        role: &'static str,
        /// The buffer's address.
        address: usize,
        /// The alignment required, in bytes.
        align: usize,
    },
    /// Offsets are negative, not monotonic, or point past their target.
    #[error("{path}: invalid offsets: {message}")]
    InvalidOffsets {
        /// Where in the array.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The schema is malformed (e.g. a format string that does not parse).
    #[error("invalid schema: {0}")]
    Schema(#[source] ArrowError),
    /// The data does not pass arrow-rs validation, or another arrow-rs error.
    #[error(transparent)]
    Arrow(ArrowError),
    /// A stream or async callback of a foreign producer or consumer returned an error code.
    #[error("{operation} failed with code {code} ({}): {message}", errno_name(*.code))]
    Callback {
        /// The callback (`get_next`, `on_schema`, ...).
        operation: &'static str,
        /// The errno-compatible code.
        code: i32,
        /// The peer's message (from `get_last_error` or `on_error`), or empty.
        message: String,
    },
    /// An earlier error reported again, unchanged: the errno code and message it was first
    /// reported with (e.g. by a stream's `get_next` after its first failure).
    #[error("{message}")]
    Repeated {
        /// The errno-compatible code of the first report.
        code: i32,
        /// The first report's message (that error's `Display`).
        message: String,
    },
    /// The peer broke the protocol (e.g. called a callback twice, or out of order).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A Rust panic was caught at the C boundary.
    #[error("panic caught at the C boundary: {0}")]
    Panic(String),
    /// Key/value metadata that is malformed (a negative count or length, bytes that are
    /// not UTF-8, a count that is not a number) or too large to encode.
    #[error("invalid metadata: {0}")]
    Metadata(String),
    /// Invalid argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An export asked for a dialect of the interface (libcudf's, say) that an array of the
    /// batch cannot be put in: a type the consumer refuses and devarrow does not convert,
    /// or a conversion the data does not allow (offsets past `int32`, say).
    #[error("{path}: {data_type} cannot be exported for {dialect}: {reason}")]
    NotConvertible {
        /// The column (`"x"`, `"x.item"`, ...).
        path: String,
        /// Its Arrow type.
        data_type: String,
        /// Who would refuse it (e.g. `"libcudf"`).
        dialect: &'static str,
        /// Why it cannot be converted, and what to do instead.
        reason: String,
    },
    /// A device-specific failure (CUDA errors and the like), from the device crates,
    /// which keep their own error as the source (e.g. `devarrow_cuda::CudaError`, whose
    /// own source is the driver's error); a plain message boxes as well
    /// (`"what failed".into()`).
    #[error("{device} error: {source}")]
    Device {
        /// The device (e.g. `CUDA`).
        device: &'static str,
        /// What failed: the device crate's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

/// `Result` with devarrow's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The errno-compatible code this error is reported as across the C boundary.
    ///
    /// ```
    /// use devarrow_abi::{ArrowDeviceArray, DeviceArray, Error};
    ///
    /// let mut released = ArrowDeviceArray::empty();
    /// // SAFETY: an empty struct is a released one.
    /// let err = unsafe { DeviceArray::from_raw(&mut released) }.unwrap_err();
    /// assert!(matches!(err, Error::Released { .. }));
    /// assert_eq!(err.errno(), 22); // EINVAL
    /// println!("{err}");
    /// ```
    pub fn errno(&self) -> i32 {
        match self {
            Error::Callback { code, .. } => *code,
            Error::Repeated { code, .. } => *code,
            Error::UnsupportedDevice { .. } | Error::NotConvertible { .. } => errno::ENOSYS,
            Error::Panic(_) | Error::Device { .. } => errno::EIO,
            Error::Arrow(ArrowError::IoError(..)) => errno::EIO,
            Error::Arrow(ArrowError::MemoryError(_)) => errno::ENOMEM,
            _ => errno::EINVAL,
        }
    }

    /// The code to return from a C callback for this error: [`Error::errno`], except that
    /// a code that is no errno value becomes `EIO`: 0 (which would read as success, e.g.
    /// an [`Error::Callback`] whose peer reported 0) and negative codes (a foreign
    /// producer's `-1`, relayed through a devarrow stream: found by fuzzing, target
    /// `stream_export`; the C stream interfaces want errno-compatible codes, which are
    /// positive).
    pub(crate) fn c_code(&self) -> i32 {
        match self.errno() {
            code if code <= 0 => errno::EIO,
            code => code,
        }
    }

    /// Turns a caught panic payload into [`Error::Panic`].
    ///
    /// The payload is dropped without unwinding, even if its `Drop` panics (that second
    /// payload is leaked), so this is safe to call at the C boundary.
    pub fn from_panic(payload: Box<dyn std::any::Any + Send>) -> Self {
        let msg = crate::panic::panic_message(&*payload).to_string();
        crate::panic::drop_payload(payload);
        Error::Panic(msg)
    }
}

/// The errno values the interface uses, as the C side of the target platform numbers them.
///
/// `EIO`, `ENOMEM` and `EINVAL` are the same everywhere devarrow runs. `ENOSYS` and
/// `ECANCELED` differ: Apple platforms (macOS, iOS) get their own numbers; every other
/// target gets the Linux numbers, which are right on Linux (where devarrow is built and
/// tested) and Android, but not on, e.g., the BSDs or Windows.
pub mod errno {
    /// I/O error: a failure of the producer's source.
    pub const EIO: i32 = 5;
    /// Out of memory.
    pub const ENOMEM: i32 = 12;
    /// Invalid argument: malformed data or a bad call.
    pub const EINVAL: i32 = 22;
    /// Function not implemented: an unsupported device or feature (Linux: 38).
    #[cfg(not(target_vendor = "apple"))]
    pub const ENOSYS: i32 = 38;
    /// Function not implemented: an unsupported device or feature (Apple: 78).
    #[cfg(target_vendor = "apple")]
    pub const ENOSYS: i32 = 78;
    /// Operation canceled (Linux: 125).
    #[cfg(not(target_vendor = "apple"))]
    pub const ECANCELED: i32 = 125;
    /// Operation canceled (Apple: 89).
    #[cfg(target_vendor = "apple")]
    pub const ECANCELED: i32 = 89;
}

fn errno_name(code: i32) -> &'static str {
    match code {
        errno::EIO => "EIO",
        errno::ENOMEM => "ENOMEM",
        errno::EINVAL => "EINVAL",
        errno::ENOSYS => "ENOSYS",
        errno::ECANCELED => "ECANCELED",
        _ => "errno",
    }
}

impl From<ArrowError> for Error {
    /// Keeps a devarrow error that travelled inside an `ArrowError::ExternalError` (as
    /// through a `RecordBatchReader`) as itself, so its errno code survives.
    fn from(e: ArrowError) -> Self {
        match e {
            ArrowError::ExternalError(inner) if inner.is::<Error>() => {
                *inner.downcast::<Error>().expect("checked by is::<Error>()")
            }
            e => Error::Arrow(e),
        }
    }
}

impl From<Error> for ArrowError {
    fn from(e: Error) -> Self {
        match e {
            Error::Arrow(a) => a,
            e => ArrowError::ExternalError(Box::new(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The platform's own `strerror` names each code as expected, so the numbers are the
    /// C side's on this target.
    #[test]
    fn errno_values_are_the_platforms() {
        let text = |code| std::io::Error::from_raw_os_error(code).to_string();
        assert!(
            text(errno::EIO).contains("nput/output"),
            "{}",
            text(errno::EIO)
        );
        assert!(
            text(errno::ENOMEM).contains("memory"),
            "{}",
            text(errno::ENOMEM)
        );
        assert!(
            text(errno::EINVAL).contains("nvalid argument"),
            "{}",
            text(errno::EINVAL)
        );
        assert!(
            text(errno::ENOSYS).contains("not implemented"),
            "{}",
            text(errno::ENOSYS)
        );
        assert!(
            text(errno::ECANCELED).contains("anceled"),
            "{}",
            text(errno::ECANCELED)
        );
    }

    #[test]
    fn a_zero_code_is_never_returned_to_c() {
        let err = Error::Callback {
            operation: "get_next",
            code: 0,
            message: String::new(),
        };
        assert_eq!(err.errno(), 0);
        assert_eq!(err.c_code(), errno::EIO);
        assert_eq!(Error::Protocol(String::new()).c_code(), errno::EINVAL);
    }

    #[test]
    fn a_negative_code_is_never_returned_to_c() {
        for code in [-1, -61, i32::MIN] {
            let err = Error::Callback {
                operation: "get_next",
                code,
                message: String::new(),
            };
            assert_eq!(err.errno(), code, "the error keeps the peer's code");
            assert_eq!(err.c_code(), errno::EIO);
        }
    }
}
