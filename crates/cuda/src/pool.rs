//! devarrow's stream-ordered memory pool, one per device.
//!
//! [`DeviceBuffer`](crate::DeviceBuffer)s come from a pool that devarrow creates
//! (`cuMemPoolCreate`) rather than the device's default pool, for one setting: the
//! release threshold. The default pool's is 0, so every stream, event or context
//! synchronization hands its unused memory back to the system, and the next batch's
//! `cuMemAllocAsync` maps physical memory again; a transfer pipeline synchronizes on every
//! staging chunk, so that would happen on every batch. devarrow's pool keeps what it
//! freed for reuse (threshold `u64::MAX`) until
//! [`CudaDevice::trim_memory_pool`](crate::CudaDevice::trim_memory_pool) returns it.
//! Changing the default pool instead would change it for every library in the process.
//!
//! Pools live as long as the process, like the default pool. A device where creating
//! one fails uses its default pool.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result, sys, CudaContext, DriverError};

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
pub(crate) fn pool_of(ctx: &CudaContext) -> Result<sys::CUmemoryPool, DriverError> {
    let ordinal = ctx.ordinal();
    let mut pools = pools().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.get(&ordinal) {
        return Ok(pool.0);
    }
    let pool = match create(ordinal) {
        Ok(pool) => pool,
        // SAFETY: the device handle belongs to the live context.
        Err(_) => unsafe { result::device::get_default_mem_pool(ctx.cu_device()) }?,
    };
    pools.insert(ordinal, Pool(pool));
    Ok(pool)
}

/// A pool of device memory on `ordinal` that keeps what is freed into it.
fn create(ordinal: usize) -> Result<sys::CUmemoryPool, DriverError> {
    // SAFETY: CUmemPoolProps is plain data (enums whose zero value is valid, a NULL
    // pointer, sizes and reserved bytes); zero is the documented default of every field.
    let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = ordinal as i32;
    // SAFETY: `props` is a valid, fully initialized CUmemPoolProps.
    let pool = unsafe { result::mem_pool::create(&props) }?;
    let mut threshold = u64::MAX;
    // SAFETY: `pool` is the pool just created; RELEASE_THRESHOLD takes a u64.
    let set = unsafe {
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
    if let Err(e) = set {
        // SAFETY: nothing was allocated from the pool.
        let _ = unsafe { result::mem_pool::destroy(pool) };
        return Err(e);
    }
    Ok(pool)
}

/// Returns the unused memory of devarrow's pool of `ctx`'s device (if created) to the
/// system, keeping at most `keep` bytes reserved. `ctx` must be current.
pub(crate) fn trim(ctx: &CudaContext, keep: usize) -> Result<(), DriverError> {
    let pool = pools()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&ctx.ordinal())
        .copied();
    match pool {
        // SAFETY: pools are never destroyed.
        Some(pool) => unsafe { result::mem_pool::trim_to(pool.0, keep) },
        None => Ok(()),
    }
}
