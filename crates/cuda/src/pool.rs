//! devarrow's stream-ordered memory pool, one per device.
//!
//! [`DeviceBuffer`](crate::DeviceBuffer)s come from a pool that devarrow creates
//! (`cuMemPoolCreate`) rather than the device's default pool, for one setting: the
//! release threshold. The default pool's is 0, so every stream, event or context
//! synchronization hands its unused memory back to the system, and the next batch's
//! `cuMemAllocAsync` maps physical memory again; a transfer pipeline synchronizes on every
//! staging chunk, so that would happen on every batch. devarrow's pool keeps what it
//! freed for reuse (threshold `u64::MAX`) until
//! [`PrimaryContext::trim_memory_pool`](crate::PrimaryContext::trim_memory_pool) returns it.
//! Changing the default pool instead would change it for every library in the process.
//!
//! Pools live as long as the process, like the default pool. A device where creating
//! one fails uses its default pool.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::driver;
use crate::error::Result;

/// A pool handle; pools are never destroyed.
#[derive(Clone, Copy)]
struct Pool(sys::CUmemoryPool);

// SAFETY: a CUmemoryPool is a process-wide driver handle, usable from any thread.
unsafe impl Send for Pool {}

fn pools() -> &'static Mutex<HashMap<usize, Pool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Pool>>> = OnceLock::new();
    POOLS.get_or_init(Default::default)
}

/// devarrow's pool of the device of `ctx` (created on first use), or the device's
/// default pool where a pool cannot be created. `ctx` must be current.
pub(crate) fn pool_of(ctx: &CudaContext) -> Result<sys::CUmemoryPool> {
    let ordinal = ctx.ordinal();
    let mut pools = pools().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.get(&ordinal) {
        return Ok(pool.0);
    }
    let pool = match create(ordinal) {
        Ok(pool) => pool,
        Err(_) => driver::device_get_default_mem_pool(ctx.cu_device())?,
    };
    pools.insert(ordinal, Pool(pool));
    Ok(pool)
}

/// A pool of device memory on `ordinal` that keeps what is freed into it.
fn create(ordinal: usize) -> Result<sys::CUmemoryPool> {
    let pool = driver::mem_pool_create(ordinal)?;
    // SAFETY: `pool` is the pool just created.
    let set = unsafe { driver::mem_pool_set_release_threshold(pool, u64::MAX) };
    if let Err(e) = set {
        // SAFETY: the pool was just created, nothing was allocated from it, and it is
        // not used again.
        let _ = unsafe { driver::mem_pool_destroy(pool) };
        return Err(e);
    }
    Ok(pool)
}

/// Returns the unused memory of devarrow's pool of `ctx`'s device (if created) to the
/// system, keeping at most `keep` bytes reserved. `ctx` must be current.
pub(crate) fn trim(ctx: &CudaContext, keep: usize) -> Result<()> {
    let pool = pools()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&ctx.ordinal())
        .copied();
    match pool {
        // SAFETY: pools are never destroyed.
        Some(pool) => unsafe { driver::mem_pool_trim_to(pool.0, keep) },
        None => Ok(()),
    }
}
