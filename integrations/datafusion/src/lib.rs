//! # devarrow-datafusion
//!
//! GPU plans on DataFusion, on CUDA or (without a GPU) devarrow's CPU device.
//!
//! 1. **A session whose plans run on devices**: [`device_session`] adds devarrow's
//!    options ([`DevarrowConfig`], `SET devarrow.devices = 'cuda:0,1'`) and the
//!    [`DevicePlacementRule`], which moves filters, projections, partial aggregates and
//!    hash joins into device regions: a [`DeviceLoadExec`], device operators
//!    ([`DeviceOperatorExec`]) handing each other device data ([`DeviceFrame`]), and a
//!    [`DeviceUnloadExec`]. A join's build side is a host child of its device operator;
//!    its probe side runs on in the region. What stays on the host says why
//!    ([`HostOnlyExec`]).
//! 2. **Devices are chosen when a partition runs** ([`config`]): the plan names none.
//! 3. **A step of your own** on every batch: [`DeviceExec`] with a [`DeviceStep`].
//! 4. **Plans on the wire** (Ballista): [`DeviceExecCodec`]; under Ballista's adaptive
//!    planner, the executor places the regions (`ballista::DevicePlacementEngine`, with
//!    the `ballista` feature).
//!
//! ```
//! use datafusion::prelude::SessionConfig;
//! use devarrow_datafusion::device_session;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> datafusion::error::Result<()> {
//! let ctx = device_session(SessionConfig::new());
//! ctx.sql("SET devarrow.devices = 'cpu'").await?.collect().await?;
//! ctx.sql("CREATE TABLE t (price DECIMAL(15, 2), qty INT) AS VALUES (1.50, 1), (2.25, 2), (3.00, 3)")
//!     .await?
//!     .collect()
//!     .await?;
//! let df = ctx.sql("SELECT sum(price * 2) AS s FROM t WHERE qty > 1").await?;
//! let plan = df.clone().create_physical_plan().await?;
//! let shown = datafusion::physical_plan::displayable(plan.as_ref()).indent(false).to_string();
//! assert!(shown.contains("DevicePartialAggregateExec"), "{shown}");
//! let batches = df.collect().await?;
//! let text = datafusion::arrow::util::pretty::pretty_format_batches(&batches)?.to_string();
//! assert!(text.contains("10.50"), "{text}");
//! # Ok(())
//! # }
//! ```
#![warn(missing_docs)]

#[cfg(feature = "ballista")]
pub mod ballista;
pub mod codec;
pub mod compute;
pub mod config;
pub mod error;
mod estimate;
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
pub use rule::{device_session, with_device_placement, DevicePlacementRule, HostOnlyExec};
pub use step::Preserves;
pub use step::{DeviceStep, ExecDevice, StepContext, StepFn, StepOutput, StepRegistry};
