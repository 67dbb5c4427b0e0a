#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
pub use devarrow_abi as abi;
pub use devarrow_bridge as bridge;
pub use devarrow_cuda as cuda;

pub mod tpch;

/// The git commit this build was made from (`unknown` outside a git checkout).
pub const GIT_COMMIT: &str = env!("DEVARROW_GIT_COMMIT");

/// A one-line description of the CUDA devices of this machine, or why there are none
/// (no driver, no device). Never panics.
pub fn cuda_device_summary() -> Result<String, String> {
    let devices = cuda::list_devices().map_err(|e| e.to_string())?;
    if devices.is_empty() {
        return Err("the driver reports no device".to_string());
    }
    Ok(devices
        .iter()
        .map(|d| {
            format!(
                "cuda:{} {} (sm_{}{}, {:.0} GiB)",
                d.id,
                d.name,
                d.compute_capability.0,
                d.compute_capability.1,
                d.total_memory as f64 / (1u64 << 30) as f64
            )
        })
        .collect::<Vec<_>>()
        .join(", "))
}
