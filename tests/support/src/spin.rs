//! `testing.ptx`: the test kernels, loaded once per context through cudarc, and the
//! timed spin, a kernel that keeps a stream busy for a chosen time.
//!
//! A timed spin cannot make a test's precondition hold: a host call between its launch
//! and the test's check that waits for the whole device (an implicitly synchronizing
//! driver call) waits it out unseen, and so does a slow host. On the only real GPU run
//! (an H200, 2026-11-28, at `9615f3d`; nothing since has run on a GPU) two ordering tests found their 300 ms spin already over right
//! after its launch. Tests that rely on a kernel still running use
//! [`crate::gate::Gate`], whose kernel ends only when the test opens it; the spin remains
//! for simulated work of a chosen length (the streams bench), and for the diagnostic GPU
//! test `the_timer_spin_keeps_its_stream_busy_diagnostic` (crates/cuda/tests/gpu.rs),
//! which reports how it behaves on the device.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

/// The PTX of the test kernels (`tests/support/testing.ptx`).
pub const TESTING_PTX: &str = include_str!("../testing.ptx");

/// The kernel `name` of `testing.ptx` in `stream`'s context, its module loaded on first
/// use there.
pub(crate) fn testing_function(
    stream: &CudaStream,
    name: &str,
) -> Result<CudaFunction, DriverError> {
    static LOADED: OnceLock<Mutex<HashMap<(u64, String), CudaFunction>>> = OnceLock::new();
    let ctx = stream.context();
    // By context id: a primary context reset keeps the handle but not the module.
    let mut key = 0;
    // SAFETY: the driver checks the context and writes the id to our local.
    unsafe { cudarc::driver::sys::cuCtxGetId(ctx.cu_ctx(), &mut key) }.result()?;
    let mut map = LOADED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(f) = map.get(&(key, name.to_owned())) {
        return Ok(f.clone());
    }
    let module = ctx.load_module(Ptx::from_src(TESTING_PTX))?;
    for kernel in ["dvx_spin_fill_u32", "dvx_gate_fill_u32"] {
        let f = module.load_function(kernel)?;
        map.insert((key, kernel.to_owned()), f);
    }
    map.get(&(key, name.to_owned())).cloned().ok_or(DriverError(
        cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_FOUND,
    ))
}

/// Enqueues `dvx_spin_fill_u32` (one block of 256 threads): spins on the GPU until
/// `%globaltimer` has advanced by `spin_ns` nanoseconds, then writes `dst[i] = value + i`
/// for `i < n` (`u32`s). GPU work of a chosen length; not a way to keep a stream busy
/// until a test has checked something (see the module's documentation: use
/// [`crate::gate::Gate`]).
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
    let function = testing_function(stream, "dvx_spin_fill_u32")?;
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
