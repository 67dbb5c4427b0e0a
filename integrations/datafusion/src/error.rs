//! The typed errors of a [`DeviceExec`](crate::DeviceExec): each names the step and the
//! partition it failed in, and reaches DataFusion as `DataFusionError::External`, so a
//! caller finds it again with [`DeviceExecError::find`].

use datafusion::error::DataFusionError;

/// An error of a step's own code (a kernel launch, a CPU computation), boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a [`DeviceExec`](crate::DeviceExec) (or its codec) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceExecError {
    /// The device step returned an error.
    #[error("device step `{step}` failed on partition {partition}, batch {batch}: {source}")]
    Step {
        /// The step's name.
        step: String,
        /// The partition of the plan it ran for.
        partition: usize,
        /// The batch of that partition (0-based).
        batch: usize,
        /// The step's error.
        #[source]
        source: BoxError,
    },
    /// Uploading a batch of the child's partition failed (the child's own errors come
    /// through as they are, not as this).
    #[error("uploading partition {partition} to {device} failed: {source}")]
    Upload {
        /// The partition.
        partition: usize,
        /// The device (`cpu`, `cuda:N`).
        device: String,
        /// devarrow's error.
        #[source]
        source: Box<devarrow::abi::Error>,
    },
    /// Downloading the step's output failed.
    #[error("downloading partition {partition}, batch {batch} from {device} failed: {source}")]
    Download {
        /// The partition.
        partition: usize,
        /// The batch of that partition (0-based).
        batch: usize,
        /// The device (`cpu`, `cuda:N`).
        device: String,
        /// devarrow's error.
        #[source]
        source: Box<devarrow::abi::Error>,
    },
    /// The step's output does not have the schema the step declared.
    #[error(
        "device step `{step}` returned a batch of schema {found} on partition {partition}, \
         batch {batch}; it declared {expected}"
    )]
    OutputSchema {
        /// The step's name.
        step: String,
        /// The partition.
        partition: usize,
        /// The batch of that partition (0-based).
        batch: usize,
        /// The declared output (the columns the step adds, or all of them).
        expected: String,
        /// What it returned.
        found: String,
    },
    /// The step's output has another number of rows than its input (a step maps rows
    /// one to one: DataFusion's batch boundaries are kept).
    #[error(
        "device step `{step}` returned {found} rows for {expected} on partition {partition}, \
         batch {batch}"
    )]
    OutputRows {
        /// The step's name.
        step: String,
        /// The partition.
        partition: usize,
        /// The batch of that partition (0-based).
        batch: usize,
        /// The input's rows.
        expected: usize,
        /// The output's rows.
        found: usize,
    },
    /// The step does not accept the child's schema (a column it needs is missing or of
    /// another type).
    #[error("device step `{step}` does not accept its input: {reason}")]
    Input {
        /// The step's name.
        step: String,
        /// What is wrong.
        reason: String,
    },
    /// A plan names a step this process's [`StepRegistry`](crate::StepRegistry) does not
    /// hold (a Ballista executor started without it).
    #[error("no device step `{name}` is registered here (registered: {registered})")]
    UnknownStep {
        /// The name in the plan.
        name: String,
        /// The names registered, comma-separated.
        registered: String,
    },
    /// The device could not be opened.
    #[error("device `{spec}` is not available: {reason}")]
    Device {
        /// The device string.
        spec: String,
        /// Why.
        reason: String,
    },
    /// A serialized plan node that is not a `DeviceExec` of this version.
    #[error("not a devarrow DeviceExec node: {0}")]
    Codec(String),
    /// A device frame (a batch inside a device region) was built inconsistently: a
    /// column of another length, type or device (a bug of a device operator).
    #[error("inconsistent device frame: {0}")]
    Frame(String),
    /// A device operator of a region failed.
    #[error(
        "device operator `{operator}` failed on partition {partition}, batch {batch}: {source}"
    )]
    Operator {
        /// The operator (`DeviceFilterExec`, ...).
        operator: String,
        /// The partition.
        partition: usize,
        /// The batch of that partition (0-based).
        batch: usize,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// DataFusion's memory pool refused the device bytes a partition needed.
    #[error(
        "partition {partition} on {device} needs {bytes} more bytes of device memory, \
         which the memory pool refused: {reason}"
    )]
    Memory {
        /// The partition.
        partition: usize,
        /// The device (`cpu`, `cuda:N`).
        device: String,
        /// The bytes asked for.
        bytes: usize,
        /// The pool's answer.
        reason: String,
    },
    /// devarrow's session options (`devarrow.*`) are invalid.
    #[error("invalid devarrow option: {0}")]
    Config(String),
}

impl DeviceExecError {
    /// The `DeviceExecError` inside a DataFusion error, however deep DataFusion wrapped it
    /// (`Context`, `Shared`, `ArrowError::ExternalError`, ...).
    pub fn find(error: &DataFusionError) -> Option<&DeviceExecError> {
        let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(e) = current {
            if let Some(found) = e.downcast_ref::<DeviceExecError>() {
                return Some(found);
            }
            if let Some(DataFusionError::External(inner)) = e.downcast_ref::<DataFusionError>() {
                if let Some(found) = inner.downcast_ref::<DeviceExecError>() {
                    return Some(found);
                }
            }
            current = e.source();
        }
        None
    }

    /// The partition the error happened in, when it happened in one.
    pub fn partition(&self) -> Option<usize> {
        match self {
            Self::Step { partition, .. }
            | Self::Upload { partition, .. }
            | Self::Download { partition, .. }
            | Self::OutputSchema { partition, .. }
            | Self::OutputRows { partition, .. } => Some(*partition),
            _ => None,
        }
    }
}

impl From<DeviceExecError> for DataFusionError {
    fn from(e: DeviceExecError) -> Self {
        DataFusionError::External(Box::new(e))
    }
}
