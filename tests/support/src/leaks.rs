//! Leak checks of device memory that hold on a real GPU as on the emulated driver:
//! [`DeviceMemoryCheck`] compares devarrow's own counts of its device buffers
//! ([`devarrow_cuda::memory_stats`], exact) and, with a margin sized for a real device
//! ([`DEVICE_MEMORY_MARGIN`]), the device's free memory (`cuMemGetInfo`).
//!
//! Also the emulator's count of `cuMemGetInfo` calls ([`emulated_mem_get_info_calls`])
//! and its record of an event's flags ([`emulated_event_flags`]).

use devarrow_cuda::{memory_stats, MemoryStats, PrimaryContext};

/// How much less free device memory a check tolerates at its end than at its start.
///
/// devarrow's own device buffers are counted exactly ([`MemoryStats`]); the free memory
/// catches what those counts cannot see (memory of cudarc, of the pool kept by a missed
/// trim, of streams, events or modules created per operation and never destroyed). On a
/// real GPU it moves for reasons that are no leak: the driver maps device memory in
/// 2 MiB pages, and `cuMemGetInfo` includes the driver's own allocations, which grow on
/// first use (lazily loaded kernels under `CUDA_MODULE_LOADING=LAZY`, the local memory
/// reserved for a kernel's first launch, the pools behind streams and events), a few to
/// a few tens of MiB on an H100, and other processes' memory. 64 MiB is above that and
/// below what a leak in the tests' loops (hundreds to thousands of operations, each
/// moving tens of KiB to MiB) would lose.
pub const DEVICE_MEMORY_MARGIN: usize = 64 << 20;

/// Free device memory after synchronizing the device and trimming the pools.
pub fn free_memory(dev: &PrimaryContext) -> usize {
    dev.synchronize().unwrap();
    dev.trim_memory_pool().unwrap();
    dev.memory_info().unwrap().0
}

/// The device memory state at the start of a check: devarrow's counts of device
/// `dev`, and its free memory.
#[derive(Debug)]
pub struct DeviceMemoryCheck {
    dev: PrimaryContext,
    stats: MemoryStats,
    free: usize,
}

impl DeviceMemoryCheck {
    /// Starts a check on `dev` (synchronizes it and trims its pools first).
    pub fn start(dev: &PrimaryContext) -> Self {
        let free = free_memory(dev);
        Self {
            dev: dev.clone(),
            stats: memory_stats(dev.id()),
            free,
        }
    }

    /// The free memory at the start.
    pub fn free_at_start(&self) -> usize {
        self.free
    }

    /// What leaked since the start, if anything: devarrow's device buffers (any
    /// difference in their number or bytes), or more device memory than
    /// [`DEVICE_MEMORY_MARGIN`].
    pub fn leak(&self) -> Option<String> {
        let free = free_memory(&self.dev);
        let now = memory_stats(self.dev.id());
        if (now.live_buffers, now.live_bytes) != (self.stats.live_buffers, self.stats.live_bytes) {
            return Some(format!(
                "devarrow's live device buffers: {} ({} bytes) at the start, {} ({} bytes) now",
                self.stats.live_buffers, self.stats.live_bytes, now.live_buffers, now.live_bytes
            ));
        }
        (free + DEVICE_MEMORY_MARGIN < self.free).then(|| {
            format!(
                "free device memory {} at the start, {free} now (more than the {} MiB margin lost)",
                self.free,
                DEVICE_MEMORY_MARGIN >> 20
            )
        })
    }

    /// Panics with `what` if [`DeviceMemoryCheck::leak`] finds a leak.
    pub fn assert_no_leak(&self, what: impl std::fmt::Display) {
        if let Some(leak) = self.leak() {
            panic!("{what}: leaked: {leak}");
        }
    }
}

/// How many `cuMemGetInfo` calls the emulated driver has answered
/// (`devarrow_emu_mem_get_info_calls`); `None` on a real driver.
pub fn emulated_mem_get_info_calls() -> Option<u64> {
    let symbol = crate::gpu::driver_symbol(c"devarrow_emu_mem_get_info_calls");
    if symbol.is_null() {
        return None;
    }
    // SAFETY: the emulator defines the symbol with exactly this signature; it only reads
    // a counter.
    Some(unsafe { std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> u64>(symbol)() })
}

/// The `CU_EVENT_*` flags the emulated driver recorded for `event`
/// (`devarrow_emu_event_flags`): `None` on a real driver, which cannot tell, or for an
/// event it does not know.
pub fn emulated_event_flags(event: cudarc::driver::sys::CUevent) -> Option<u32> {
    let symbol = crate::gpu::driver_symbol(c"devarrow_emu_event_flags");
    if symbol.is_null() {
        return None;
    }
    // SAFETY: the emulator defines the symbol with exactly this signature; it only looks
    // the handle up.
    let flags = unsafe {
        std::mem::transmute::<*mut libc::c_void, extern "C" fn(cudarc::driver::sys::CUevent) -> i64>(
            symbol,
        )(event)
    };
    u32::try_from(flags).ok()
}
