//! `devarrow-emu`: a CPU emulation of the part of the CUDA driver API, and of the PTX,
//! that devarrow uses.
//!
//! It is **not** a GPU. It exists so that a machine with no GPU (CI) can *execute*
//! devarrow's CUDA code paths and its hand-written PTX kernels, and catch the bugs that
//! compile cleanly: wrong kernel arithmetic, out-of-bounds or misaligned accesses, a
//! device pointer dereferenced on the host, a missing stream wait, a call made without
//! a current context, a leak of device memory.
//!
//! - [`ptx`]: a parser and interpreter for the PTX subset of `crates/cuda/kernels/*.ptx` (SIMT
//!   threads, warps with `shfl.sync` and `vote.sync`, blocks with `bar.sync` and shared memory), with
//!   every global access bounds- and alignment-checked by a [`ptx::Memory`].
//! - [`driver`]: `extern "C"` functions with the driver API's names and signatures
//!   (`cuInit`, `cuMemAlloc_v2`, `cuLaunchKernel`, ...). Built as the cdylib
//!   `libdevarrow_emu.so`, linked as `libcuda.so` by `.ci/emulated-gpu`, it is what
//!   cudarc loads in place of the NVIDIA driver.
//!
//! What it cannot tell: anything about speed, real caching/coherence behaviour, or
//! driver quirks. Results on a real GPU are recorded in `docs/gpu-results.md`.

pub mod driver;
pub mod ptx;
