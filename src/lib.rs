//! # devarrow
//!
//! The Apache Arrow C Device Data Interface on CUDA, for arrow-rs. This facade re-exports
//! the workspace's crates: [`abi`] (the C ABI, owning wrappers, the CPU device), [`cuda`]
//! (CUDA memory, events and kernels) and [`bridge`] (record batches to a device and back).
pub use devarrow_abi as abi;
pub use devarrow_bridge as bridge;
pub use devarrow_cuda as cuda;
