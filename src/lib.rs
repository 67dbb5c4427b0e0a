#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
pub use devarrow_abi as abi;
pub use devarrow_bridge as bridge;
#[cfg(feature = "cuda")]
pub use devarrow_cuda as cuda;

pub use devarrow_bridge::select::{select_device, DeviceRequest, SelectedDevice};

/// The git commit this build was made from (`unknown` outside a git checkout), so
/// measurements can name the code they measured.
pub const GIT_COMMIT: &str = env!("DEVARROW_GIT_COMMIT");
