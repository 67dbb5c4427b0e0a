#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
pub use devarrow_abi as abi;
pub use devarrow_bridge as bridge;
pub use devarrow_cuda as cuda;

/// The git commit this build was made from (`unknown` outside a git checkout).
pub const GIT_COMMIT: &str = env!("DEVARROW_GIT_COMMIT");

/// A one-line description of the CUDA devices of this machine, or why there are none
/// (no driver, no device). Never panics.
pub fn cuda_device_summary() -> Result<String, String> {
    Err("CUDA support is not built yet".to_string())
}
