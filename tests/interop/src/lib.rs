//! # devarrow-interop
//!
//! A C-ABI shared library (`libdevarrow_interop.so`) over devarrow, used to check devarrow
//! against other Arrow implementations: `python/test_pyarrow_interop.py` drives it from
//! pyarrow (run by `tests/pyarrow.rs`), and `cpp/async_stream.cc` drives its async device
//! stream functions from Arrow C++ (pyarrow's `libarrow`; built and run by
//! `tests/arrow_cpp.rs`), and `c/device_interop.c`, a C program using only
//! `include/arrow_c_device.h` and the CUDA driver, drives its device functions (built and
//! run by `tests/c_program.rs`).
//!
//! - [`sample`]: the "every type" record batches (from the test-support crate
//!   `devarrow-testing`).
//! - [`capi`]: the exported `devarrow_interop_*` C functions (device arrays both ways,
//!   device streams both ways, and arrow-rs's plain C stream as the reference).
//! - [`async_capi`]: the exported `devarrow_interop_async_*` C functions (devarrow's async
//!   producer and consumer, driven by Arrow C++ in `tests/arrow_cpp.rs`).
//! - [`device_capi`]: the exported device functions (`devarrow_interop_open`,
//!   `devarrow_interop_device_*`): devarrow's device arrays, device stream and async
//!   producer on the CPU device or CUDA device 0, and its importer and async consumer
//!   there, driven by the C program `c/device_interop.c` (`tests/c_program.rs`).
#![warn(missing_docs)]

pub mod async_capi;
pub mod capi;
pub mod device_capi;
pub use devarrow_testing::sample;
