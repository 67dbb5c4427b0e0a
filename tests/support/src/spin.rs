//! `testing.ptx`: a kernel that keeps a stream busy for a chosen time, loaded once per
//! context through cudarc.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// The PTX of the test kernels (`tests/support/testing.ptx`).
pub const TESTING_PTX: &str = include_str!("../testing.ptx");

/// `dvx_spin_fill_u32` of `stream`'s context, loaded on first use there.
fn spin_fill_u32(stream: &CudaStream) -> Result<CudaFunction, DriverError> {
    static LOADED: OnceLock<Mutex<HashMap<u64, CudaFunction>>> = OnceLock::new();
    let ctx = stream.context();
    // By context id: a primary context reset keeps the handle but not the module.
    let mut key = 0;
    // SAFETY: the driver checks the context and writes the id to our local.
    unsafe { cudarc::driver::sys::cuCtxGetId(ctx.cu_ctx(), &mut key) }.result()?;
    let mut map = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(f) = map.get(&key) {
        return Ok(f.clone());
    }
    let module = ctx.load_module(Ptx::from_src(TESTING_PTX))?;
    let f = module.load_function("dvx_spin_fill_u32")?;
    map.insert(key, f.clone());
    Ok(f)
}

/// Enqueues `dvx_spin_fill_u32` (one block of 256 threads): spins on the GPU for
/// `spin_ns` nanoseconds, then writes `dst[i] = value + i` for `i < n` (`u32`s). Keeps a
/// producer stream busy so tests can show that a consumer really waits on the
/// producer's event.
///
/// # Safety
/// `dst` must be writable for `4 * n` bytes until the kernel completes.
pub unsafe fn launch_spin_fill_u32(
    stream: &CudaStream,
    dst: u64,
    n: u64,
    value: u32,
    spin_ns: u64,
) -> Result<(), DriverError> {
    let function = spin_fill_u32(stream)?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&function);
    b.arg(&dst).arg(&n).arg(&value).arg(&spin_ns);
    // SAFETY: the arguments match the kernel's (u64, u64, u32, u64); `dst` is the
    // caller's guarantee.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
