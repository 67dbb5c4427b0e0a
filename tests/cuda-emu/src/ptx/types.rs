//! The interpreter's interface types: the [`Memory`] kernels access global memory
//! through, its [`Fault`]s, the parse and execution errors, kernel parameters, launch
//! geometry and counters, and the launch limits. Re-exported by [`crate::ptx`].
//!
//! A leaf module: every other module of the interpreter uses it, it uses none of them.

use thiserror::Error;

/// Where an emulated kernel's global memory lives. Implementations check every access
/// (bounds of a live allocation, and accessibility from the device).
pub trait Memory: Sync {
    /// Reads `buf.len()` bytes at device address `addr`.
    fn load(&self, addr: u64, buf: &mut [u8]) -> Result<(), Fault>;
    /// Writes `data` at device address `addr`.
    fn store(&self, addr: u64, data: &[u8]) -> Result<(), Fault>;
    /// Atomically adds `value` to the `u64` at `addr`; returns the old value.
    fn atomic_add_u64(&self, addr: u64, value: u64) -> Result<u64, Fault>;
    /// Atomically adds `value` to the `u32` at `addr`; returns the old value.
    fn atomic_add_u32(&self, addr: u64, value: u32) -> Result<u32, Fault>;
    /// Atomically replaces the `u64` at `addr` by `new` where it equals `expected`;
    /// returns the old value (`atom.cas.b64`).
    fn atomic_cas_u64(&self, addr: u64, expected: u64, new: u64) -> Result<u64, Fault>;
    /// Atomically replaces the `u32` at `addr` by `new` where it equals `expected`;
    /// returns the old value (`atom.cas.b32`).
    fn atomic_cas_u32(&self, addr: u64, expected: u32, new: u32) -> Result<u32, Fault>;
    /// `%globaltimer`: nanoseconds from a monotonic clock.
    fn global_timer_ns(&self) -> u64;
}

/// An invalid memory access.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{kind} of {size} bytes at {addr:#x}")]
pub struct Fault {
    /// The faulting address.
    pub addr: u64,
    /// The access size in bytes.
    pub size: usize,
    /// What was wrong ("out-of-bounds load", "misaligned store", ...).
    pub kind: String,
}

/// A PTX parse error.
#[derive(Debug, Clone, Error)]
#[error("PTX line {line}: {message}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What was wrong.
    pub message: String,
}

/// An error while executing a kernel.
#[derive(Debug, Clone, Error)]
pub enum ExecError {
    /// An invalid global or shared memory access, with the thread that made it.
    #[error(
        "{fault} by thread {thread:?} of block {block:?} in {kernel} (instruction `{instruction}`)"
    )]
    Fault {
        /// The access.
        fault: Fault,
        /// Thread index in the block.
        thread: [u32; 3],
        /// Block index in the grid.
        block: [u32; 3],
        /// Kernel name.
        kernel: String,
        /// The instruction's text.
        instruction: String,
    },
    /// Threads wait at barriers or warp collectives that can never complete.
    #[error("deadlock in {kernel}: {detail}")]
    Deadlock {
        /// Kernel name.
        kernel: String,
        /// Which threads wait where.
        detail: String,
    },
    /// A bad launch (unknown kernel, wrong parameter count or sizes, bad dimensions).
    #[error("invalid launch: {0}")]
    InvalidLaunch(String),
    /// An instruction the interpreter does not implement.
    #[error("unsupported instruction `{0}`")]
    Unsupported(String),
}

/// One kernel parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Its name in the PTX.
    pub name: String,
    /// Its size in bytes.
    pub size: usize,
}

/// Launch geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Blocks per grid (x, y, z).
    pub grid: [u32; 3],
    /// Threads per block (x, y, z).
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes.
    pub shared_bytes: u32,
}

/// Counters of one launch ([`Module::launch_with_stats`](crate::ptx::Module::launch_with_stats)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LaunchStats {
    /// Instructions executed, summed over all threads (guarded-off ones included).
    pub instructions: u64,
    /// Blocks run.
    pub blocks: u64,
    /// Threads run.
    pub threads: u64,
}

/// Most threads per block.
pub const MAX_BLOCK_THREADS: u32 = 1024;

/// Most shared memory (static + dynamic) per block, in bytes.
pub const MAX_SHARED_BYTES: u64 = 227 * 1024;
