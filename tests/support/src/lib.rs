//! # devarrow-testing
//!
//! What devarrow's test binaries, benches and test-support crates share, kept out of the
//! product crates (`publish = false`; only ever a dev-dependency):
//!
//! - [`gpu`]: the one rule for tests that need a GPU (skip with a printed reason, or fail
//!   under `DEVARROW_REQUIRE_GPU=1`), compute-sanitizer awareness, and the emulated
//!   driver's controls and counters ([`gpu::ImplicitSyncs`]);
//! - [`host_gate`]: a stream held by a host function until the test releases it;
//! - [`leaks`]: device memory leak checks that hold on a real GPU (devarrow's exact
//!   counts, and the free memory with a margin);
//! - [`release`]: counting the `release` calls of exported arrays;
//! - [`sample`]: the "every type" record batches; [`random`]: seeded random batches;
//!   [`slices`]: large columns of every layout a slice cuts;
//! - [`kernel_oracles`]: CPU reference implementations of the PTX kernels;
//! - [`gate`]: a kernel (`testing.ptx`) that keeps its stream busy until the test opens
//!   the gate, so that an ordering test's precondition (work still pending) holds by
//!   construction, with a time limit that fails the test instead of hanging it; a host
//!   call that waits for the device while the gate is closed shows as that failure;
//! - [`spin`]: the test kernels' PTX, and a timed spin (GPU work of a chosen length,
//!   which cannot keep a stream busy until a test has checked something: [`gate`] does).
#![warn(missing_docs)]

pub mod gate;
pub mod gpu;
pub mod host_gate;
pub mod kernel_oracles;
pub mod leaks;
pub mod random;
pub mod release;
pub mod sample;
pub mod slices;
pub mod spin;
pub mod watchdog;
