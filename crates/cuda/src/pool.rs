//! devarrow's stream-ordered memory pool, one per device.
//!
//! [`DeviceBuffer`](crate::DeviceBuffer)s come from a pool that devarrow creates
//! (`cuMemPoolCreate`) rather than the device's default pool, for one setting: the
//! release threshold. The default pool's is 0, so every stream, event or context
//! synchronization hands its unused memory back to the system, and the next batch's
//! `cuMemAllocAsync` maps physical memory again; a transfer pipeline synchronizes on every
//! staging chunk, so that would happen on every batch. devarrow's pool keeps up to
//! [`PoolPolicy::release_threshold`] bytes of what it freed for reuse, until
//! [`PrimaryContext::trim_memory_pool`](crate::PrimaryContext::trim_memory_pool) returns it.
//! Changing the default pool instead would change it for every library in the process.
//!
//! Sharing the device with other libraries (PyTorch's caching allocator, RMM): the
//! default policy ([`PoolPolicy::default`]) keeps at most 1 GiB idle (an eighth of a
//! smaller device), so devarrow never sits on more than that of memory another library
//! could use; it forbids the driver's *internal dependencies* (an allocation made to wait
//! on the stream that freed the memory it reuses, which may be a caller's stream busy
//! with another library's work); and an allocation that does not fit in the device's free
//! memory first gives back what the pool holds idle. [`set_policy`] changes it.
//!
//! Pools are made per context and found by the context's id (`cuCtxGetId`), as the
//! kernels are ([`crate::kernels`]): a pool made with `cuMemPoolCreate` does not survive
//! a `cuDevicePrimaryCtxReset` (JuliaGPU/CUDA.jl#16), while the primary context keeps its
//! `CUcontext` value and ordinal, and its new id makes a new pool. devarrow never destroys
//! a pool (one of a destroyed context went with it). A device where creating one fails
//! uses its default pool.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::driver;
use crate::error::Result;

/// How devarrow's pool of a device keeps and reuses freed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PoolPolicy {
    /// Bytes of freed memory the pool keeps for reuse across synchronizations
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`); `None`: 1 GiB, or an eighth of the device's
    /// memory where that is less.
    pub release_threshold: Option<u64>,
    /// Whether the driver may make an allocation wait on the stream that freed the memory
    /// it reuses (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES`). Off by default:
    /// such a wait is invisible to the caller and may be on another library's work.
    pub allow_internal_dependencies: bool,
}

impl PoolPolicy {
    /// The policy with `bytes` as [`PoolPolicy::release_threshold`] (`u64::MAX` keeps
    /// everything freed until [`PrimaryContext::trim_memory_pool`](crate::PrimaryContext::trim_memory_pool)).
    pub fn release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = Some(bytes);
        self
    }

    /// The policy with [`PoolPolicy::allow_internal_dependencies`] set to `allow`.
    pub fn allow_internal_dependencies(mut self, allow: bool) -> Self {
        self.allow_internal_dependencies = allow;
        self
    }

    /// The release threshold on a device of `total_memory` bytes.
    fn threshold(&self, total_memory: usize) -> u64 {
        self.release_threshold
            .unwrap_or_else(|| (1u64 << 30).min(total_memory as u64 / 8))
    }
}

fn policies() -> &'static Mutex<HashMap<usize, PoolPolicy>> {
    static POLICIES: OnceLock<Mutex<HashMap<usize, PoolPolicy>>> = OnceLock::new();
    POLICIES.get_or_init(Default::default)
}

/// Sets the policy of devarrow's pool on device `ordinal`: applied at once if the pool
/// exists, else when it is created (on the first allocation). `ctx` must be current when
/// the pool exists.
pub fn set_policy(ctx: &CudaContext, policy: PoolPolicy) -> Result<()> {
    let ordinal = ctx.ordinal();
    policies()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(ordinal, policy);
    let pool = existing(ctx)?;
    match pool {
        Some(pool) if pool.owned => apply(pool.handle, ctx, &policy),
        _ => Ok(()),
    }
}

/// The policy of device `ordinal`.
pub fn policy(ordinal: usize) -> PoolPolicy {
    policies()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&ordinal)
        .copied()
        .unwrap_or_default()
}

fn apply(pool: sys::CUmemoryPool, ctx: &CudaContext, policy: &PoolPolicy) -> Result<()> {
    let total = driver::device_total_mem(ctx.cu_device())?;
    // SAFETY: `pool` is one of devarrow's pools of the current context, never destroyed
    // by devarrow once handed out.
    unsafe {
        driver::mem_pool_set_release_threshold(pool, policy.threshold(total))?;
        driver::mem_pool_set_internal_dependencies(pool, policy.allow_internal_dependencies)
    }
}

/// A pool handle, and whether devarrow created it (else it is the device's default pool,
/// whose settings are left alone); devarrow never destroys pools.
#[derive(Clone, Copy)]
struct Pool {
    handle: sys::CUmemoryPool,
    owned: bool,
}

// SAFETY: a CUmemoryPool is a process-wide driver handle, usable from any thread.
unsafe impl Send for Pool {}

/// devarrow's pools by context id (`cuCtxGetId`).
fn pools() -> &'static Mutex<HashMap<u64, Pool>> {
    static POOLS: OnceLock<Mutex<HashMap<u64, Pool>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

/// devarrow's pool of `ctx`, if made.
fn existing(ctx: &CudaContext) -> Result<Option<Pool>> {
    let id = driver::ctx_get_id(ctx.cu_ctx())?;
    Ok(pools()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .copied())
}

/// devarrow's pool of `ctx` (created on first use in the context, see the module docs),
/// or the device's default pool where a pool cannot be created. `ctx` must be current.
pub(crate) fn pool_of(ctx: &CudaContext) -> Result<sys::CUmemoryPool> {
    let id = driver::ctx_get_id(ctx.cu_ctx())?;
    let mut pools = pools().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.get(&id) {
        return Ok(pool.handle);
    }
    let pool = match create(ctx) {
        Ok(handle) => Pool {
            handle,
            owned: true,
        },
        Err(_) => Pool {
            handle: driver::device_get_default_mem_pool(ctx.cu_device())?,
            owned: false,
        },
    };
    pools.insert(id, pool);
    Ok(pool.handle)
}

/// A pool of device memory on `ctx`'s device, with the device's [`policy`].
fn create(ctx: &CudaContext) -> Result<sys::CUmemoryPool> {
    let ordinal = ctx.ordinal();
    let pool = driver::mem_pool_create(ordinal)?;
    if let Err(e) = apply(pool, ctx, &policy(ordinal)) {
        // SAFETY: the pool was just created, nothing was allocated from it, and it is
        // not used again.
        let _ = unsafe { driver::mem_pool_destroy(pool) };
        return Err(e);
    }
    Ok(pool)
}

/// Returns the unused memory of devarrow's pool of `ctx` (if created) to the system,
/// keeping at most `keep` bytes reserved. `ctx` must be current.
pub(crate) fn trim(ctx: &CudaContext, keep: usize) -> Result<()> {
    match existing(ctx)? {
        // SAFETY: the pool of the current context, which devarrow never destroys.
        Some(pool) => unsafe { driver::mem_pool_trim_to(pool.handle, keep) },
        None => Ok(()),
    }
}
