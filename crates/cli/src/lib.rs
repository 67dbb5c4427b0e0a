//! # devarrow-cli
//!
//! The `devarrow` command (`cargo run --release` at the top of the workspace): benchmarks
//! moving real Arrow data to a device and back with devarrow, beside its peers. It lives
//! apart from the library so that depending on `devarrow` pulls in no command-line,
//! report or data-generation crates.
//!
//! What the benchmarks and tests of the workspace share with the command is public:
//! - [`tpch`]: TPC-H `lineitem` generated in memory;
//! - [`baseline`]: the peers a transfer is measured against (a raw copy of the same byte
//!   count, and a buffer-by-buffer copy), on any device;
//! - [`footprint`]: the bytes of host memory batches hold, each allocation once;
//! - [`run`]: the command itself.
#![warn(missing_docs)]

pub mod baseline;
pub mod footprint;
mod job;
pub mod tpch;

/// Runs the `devarrow` command with the process's arguments and returns its exit code.
pub fn run() -> std::process::ExitCode {
    job::main()
}
