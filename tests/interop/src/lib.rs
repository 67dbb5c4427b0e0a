//! # devarrow-interop
//!
//! A C-ABI shared library (`libdevarrow_interop.so`) over devarrow, used to check devarrow
//! against other Arrow implementations: `python/test_pyarrow_interop.py` drives it from
//! pyarrow (run by `tests/pyarrow.rs`).
//!
//! - [`sample`]: the "every type" record batches (from the test-support crate
//!   `devarrow-testing`).
//! - [`capi`]: the exported `devarrow_interop_*` C functions (device arrays both ways,
//!   device streams both ways, and arrow-rs's plain C stream as the reference).
#![warn(missing_docs)]

pub mod capi;
pub use devarrow_testing::sample;
