//! A parser and interpreter for the PTX subset used by `crates/cuda/kernels/*.ptx`.
//!
//! INTERFACE CONTRACT (used by [`crate::driver`]):
//! - [`Module::parse`] parses a whole `.ptx` text (directives, `.entry` and `.func`).
//! - [`Module::kernel`] describes one `.entry`: its parameters' sizes in order.
//! - [`Module::launch`] runs a grid to completion on the calling thread, reading and
//!   writing global memory only through a [`Memory`].
//!
//! # How it works
//!
//! Parsing resolves every name: registers become slots of a flat per-frame `u64` array
//! (immediates and the special registers `%tid`, `%ntid`, `%ctaid`, `%nctaid`,
//! `%laneid`, `%warpid`, `%nwarpid` are slots too), labels become instruction indices,
//! `.param` names become byte offsets and calls become argument layouts. Anything it does
//! not implement is a [`ParseError`] naming the line — never ignored.
//!
//! Blocks run in parallel on host threads (one per available core, or
//! [`Module::launch_with_stats`]'s limit). Within a block each thread runs alone until it
//! exits or reaches a collective, then the collectives whose participants have all
//! arrived complete:
//! - `shfl.sync` exchanges within a warp (32 consecutive linear thread ids) once every
//!   lane of its membermask waits at a `shfl.sync` with the same mask; a lane of the mask
//!   that exited or does not exist (a partial warp) makes it a [`ExecError::Deadlock`],
//!   as does a mask without the executing lane. Results follow the ISA's pseudocode
//!   (`c` packs the clamp value and the segment mask).
//! - `vote.sync` (`all`, `any`, `uni`, `ballot`) likewise combines the (possibly negated)
//!   predicates of the lanes of its membermask; lanes of one mask meeting at a `vote.sync`
//!   and a `shfl.sync` are a [`ExecError::Deadlock`] too (undefined on the hardware).
//! - `bar.sync` completes once every non-exited thread of the block waits at the same
//!   barrier.
//!
//! If no thread can continue, the launch fails with [`ExecError::Deadlock`].
//!
//! Memory: every global access goes through [`Memory`] with its full size (a `.v4.u32`
//! is one 16-byte access) after the interpreter checked natural alignment (address a
//! multiple of the access size, as the hardware requires). Shared memory is per block:
//! the module's static `.shared` variables from address 0, then `dims.shared_bytes` of
//! dynamic (`.extern .shared`) memory, every access bounds- and alignment-checked.
//! Generic addresses (`ld` without a state space) are global addresses and
//! `cvta.to.global` is the identity. Registers start as junk (`0xDEADBEEF...`,
//! predicates false) and shared memory as `0xCD` bytes, as nothing may rely on their
//! initial values.

// Layers (no module uses one that uses it back): `types` is the leaf; `inst` (the
// decoded program) uses it; `lex` uses it; `parse` (text to `inst::Program`) uses those;
// `exec` (the interpreter) uses `types` and `inst`; this module (the `Module` facade)
// sits on top.
mod exec;
mod inst;
mod lex;
mod parse;
mod types;

pub use types::{
    Dims, ExecError, Fault, LaunchStats, Memory, Param, ParseError, MAX_BLOCK_THREADS,
    MAX_SHARED_BYTES,
};

/// A parsed PTX module.
#[derive(Debug)]
pub struct Module {
    prog: inst::Program,
}

impl Module {
    /// Parses PTX source text.
    pub fn parse(src: &str) -> Result<Module, ParseError> {
        Ok(Module {
            prog: parse::parse(src)?,
        })
    }

    /// The parameters of `.entry` `name`, or `None` if there is no such kernel.
    pub fn kernel(&self, name: &str) -> Option<&[Param]> {
        self.prog
            .kernels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, k)| &k.params[..])
    }

    /// Names of every `.entry`.
    pub fn kernel_names(&self) -> Vec<String> {
        self.prog.kernels.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Bytes of static `.shared` memory a block of any kernel of this module uses
    /// (dynamic shared memory comes on top).
    pub fn static_shared_bytes(&self) -> u32 {
        self.prog.dyn_shared_base as u32
    }

    /// Runs kernel `name` over the whole grid to completion. `params[i]` holds the bytes
    /// of parameter `i` (exactly its size).
    pub fn launch(
        &self,
        name: &str,
        dims: Dims,
        params: &[Vec<u8>],
        mem: &dyn Memory,
    ) -> Result<(), ExecError> {
        self.launch_with_stats(name, dims, params, mem, 0)
            .map(|_| ())
    }

    /// [`Module::launch`] with at most `max_workers` host threads running blocks in
    /// parallel (0: one per available core), returning counters.
    pub fn launch_with_stats(
        &self,
        name: &str,
        dims: Dims,
        params: &[Vec<u8>],
        mem: &dyn Memory,
        max_workers: usize,
    ) -> Result<LaunchStats, ExecError> {
        let invalid = |m: String| Err(ExecError::InvalidLaunch(m));
        let Some((kname, k)) = self.prog.kernels.iter().find(|(n, _)| n == name) else {
            return invalid(format!("no kernel `{name}` in the module"));
        };
        if params.len() != k.params.len() {
            return invalid(format!(
                "`{name}` takes {} parameters, {} given",
                k.params.len(),
                params.len()
            ));
        }
        let mut kparams = vec![0u8; k.param_bytes as usize];
        for ((p, decl), &off) in params.iter().zip(&k.params).zip(&k.offsets) {
            if p.len() != decl.size {
                return invalid(format!(
                    "parameter `{}` of `{name}` is {} bytes, {} given",
                    decl.name,
                    decl.size,
                    p.len()
                ));
            }
            kparams[off as usize..off as usize + p.len()].copy_from_slice(p);
        }
        let [bx, by, bz] = dims.block;
        let [gx, gy, gz] = dims.grid;
        if bx == 0 || by == 0 || bz == 0 || bx > 1024 || by > 1024 || bz > 64 {
            return invalid(format!("bad block dimensions {:?}", dims.block));
        }
        let threads = bx as u64 * by as u64 * bz as u64;
        if threads > MAX_BLOCK_THREADS as u64 {
            return invalid(format!(
                "{threads} threads per block (at most {MAX_BLOCK_THREADS})"
            ));
        }
        if gx == 0 || gy == 0 || gz == 0 || gx > i32::MAX as u32 || gy > 65535 || gz > 65535 {
            return invalid(format!("bad grid dimensions {:?}", dims.grid));
        }
        let shared = self.prog.dyn_shared_base + dims.shared_bytes as u64;
        if shared > MAX_SHARED_BYTES {
            return invalid(format!(
                "{shared} bytes of shared memory per block (at most {MAX_SHARED_BYTES})"
            ));
        }
        let workers = if max_workers == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            max_workers
        };
        let blocks = gx as u64 * gy as u64 * gz as u64;
        let instructions = exec::launch(
            &self.prog,
            kname,
            k.func,
            dims,
            &kparams,
            mem,
            shared as usize,
            workers,
        )?;
        Ok(LaunchStats {
            instructions,
            blocks,
            threads: blocks * threads,
        })
    }
}
