//! # devarrow-interop
//!
//! A C-ABI shared library (`libdevarrow_interop.so`) over devarrow, used to check devarrow
//! against other Arrow implementations: `python/test_pyarrow_interop.py` drives it from
//! pyarrow (run by `tests/pyarrow.rs`), and `cpp/async_stream.cc` drives its async device
//! stream functions from Arrow C++ (pyarrow's `libarrow`; built and run by
//! `tests/arrow_cpp.rs`).
//!
//! - [`sample`]: the "every type" record batches (from the test-support crate
//!   `devarrow-testing`).
//! - [`capi`]: the exported `devarrow_interop_*` C functions (device arrays both ways,
//!   device streams both ways, and arrow-rs's plain C stream as the reference).
//! - [`async_capi`]: the exported `devarrow_interop_async_*` C functions (devarrow's async
//!   producer and consumer, driven by Arrow C++ in `tests/arrow_cpp.rs`).
#![warn(missing_docs)]

pub mod async_capi;
pub mod capi;
pub use devarrow_testing::sample;
