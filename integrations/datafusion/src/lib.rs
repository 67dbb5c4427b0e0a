//! # devarrow-datafusion
//!
//! devarrow inside DataFusion plans: [`DeviceExec`] streams each partition of its child
//! through a device (CUDA, or devarrow's CPU device without a GPU), running a
//! user-given [`DeviceStep`] on every uploaded batch; [`DeviceExecCodec`] ships the node
//! in a serialized physical plan (Ballista), the step looked up by name in each
//! process's [`StepRegistry`] and run on that process's device.
#![warn(missing_docs)]

pub mod codec;
pub mod compute;
pub mod config;
pub mod error;
pub mod exec;
pub mod frame;
pub mod logical;
pub mod region;
pub mod revenue;
pub mod rule;
pub mod step;

pub use codec::DeviceExecCodec;
pub use config::DevarrowConfig;
pub use error::{BoxError, DeviceExecError};
pub use exec::{DeviceBatchStream, DeviceExec, DEFAULT_READ_AHEAD};
pub use frame::{DeviceFrame, FrameColumn};
pub use logical::{DeviceExtensionPlanner, DeviceLogicalCodec, DevicePlanner, DeviceStepNode};
pub use region::{DeviceLoadExec, DeviceOperatorExec, DeviceUnloadExec};
pub use rule::{device_session, DevicePlacementRule, HostOnlyExec};
pub use step::Preserves;
pub use step::{DeviceStep, ExecDevice, StepContext, StepFn, StepOutput, StepRegistry};
