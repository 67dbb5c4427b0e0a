//! devarrow's own accounting of the device memory it allocates ([`memory_stats`]), per
//! device: exact counts that do not depend on the driver's granularity or on other
//! users of the device (what `cuMemGetInfo` reports mixes in both), and the estimate
//! of free memory that spares [`DeviceBuffer::alloc`](crate::DeviceBuffer::alloc) a
//! `cuMemGetInfo` round trip on most allocations ([`DeviceCounters::needs_free_memory`]).
//!
//! A leaf module: it uses no other module of the crate.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// What devarrow has allocated on one device, as [`memory_stats`] reports it: the
/// [`DeviceBuffer`](crate::DeviceBuffer)s (and everything made of them: transfers,
/// exports, kernels' scratch memory) of every stream of the device, counted at their
/// requested sizes. Memory of others (foreign arrays, cudarc slices of the caller) is
/// not counted, nor is pinned or managed memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MemoryStats {
    /// Device buffers alive now (allocated and not yet dropped).
    pub live_buffers: u64,
    /// Their bytes.
    pub live_bytes: u64,
    /// Device buffers allocated since the process started.
    pub allocations: u64,
    /// Bytes allocated since the process started.
    pub allocated_bytes: u64,
    /// The most [`MemoryStats::live_bytes`] has been.
    pub peak_bytes: u64,
}

/// devarrow's accounting of device `ordinal` (all zeros before its first allocation).
///
/// A leak check that holds on a real GPU compares these counts, which are exact, before
/// and after the work: free device memory (`cuMemGetInfo`) moves in the driver's pages
/// (2 MiB) and includes the driver's own allocations and other processes'.
pub fn memory_stats(ordinal: usize) -> MemoryStats {
    let Some(c) = table()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&ordinal)
        .cloned()
    else {
        return MemoryStats::default();
    };
    MemoryStats {
        live_buffers: c.live_buffers.load(Ordering::Relaxed),
        live_bytes: c.live_bytes.load(Ordering::Relaxed),
        allocations: c.allocations.load(Ordering::Relaxed),
        allocated_bytes: c.allocated_bytes.load(Ordering::Relaxed),
        peak_bytes: c.peak_bytes.load(Ordering::Relaxed),
    }
}

/// The counters of one device.
#[derive(Debug, Default)]
pub(crate) struct DeviceCounters {
    live_buffers: AtomicU64,
    live_bytes: AtomicU64,
    allocations: AtomicU64,
    allocated_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    /// Bytes of live buffers from devarrow's pool (stream-ordered allocations).
    pool_live: AtomicU64,
    /// The most `pool_live` has been since devarrow last trimmed the pool to nothing:
    /// the pool holds at most `pool_peak - pool_live` bytes idle (give or take the
    /// driver's rounding), since it reserves only what allocations asked of it.
    pool_peak: AtomicU64,
    /// The last free memory `cuMemGetInfo` reported, and `allocated_bytes` then.
    last_free: Mutex<Option<(u64, u64)>>,
}

fn table() -> &'static Mutex<HashMap<usize, Arc<DeviceCounters>>> {
    static TABLE: OnceLock<Mutex<HashMap<usize, Arc<DeviceCounters>>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// The counters of device `ordinal` (made on first use).
pub(crate) fn counters(ordinal: usize) -> Arc<DeviceCounters> {
    table()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(ordinal)
        .or_default()
        .clone()
}

impl DeviceCounters {
    /// Counts a buffer of `len` bytes allocated (`pooled`: from devarrow's pool).
    pub(crate) fn allocated(&self, len: usize, pooled: bool) {
        let len = len as u64;
        self.live_buffers.fetch_add(1, Ordering::Relaxed);
        let live = self.live_bytes.fetch_add(len, Ordering::Relaxed) + len;
        self.peak_bytes.fetch_max(live, Ordering::Relaxed);
        self.allocations.fetch_add(1, Ordering::Relaxed);
        self.allocated_bytes.fetch_add(len, Ordering::Relaxed);
        if pooled {
            let live = self.pool_live.fetch_add(len, Ordering::Relaxed) + len;
            self.pool_peak.fetch_max(live, Ordering::Relaxed);
        }
    }

    /// Counts a buffer of `len` bytes dropped (its memory freed, or gone with its
    /// context).
    pub(crate) fn freed(&self, len: usize, pooled: bool) {
        let len = len as u64;
        self.live_buffers.fetch_sub(1, Ordering::Relaxed);
        self.live_bytes.fetch_sub(len, Ordering::Relaxed);
        if pooled {
            self.pool_live.fetch_sub(len, Ordering::Relaxed);
        }
    }

    /// An upper bound of what devarrow's pool holds idle (freed, not given back).
    pub(crate) fn pool_idle_bound(&self) -> u64 {
        let live = self.pool_live.load(Ordering::Relaxed);
        self.pool_peak.load(Ordering::Relaxed).saturating_sub(live)
    }

    /// Whether an allocation of `len` bytes from the pool must first ask the driver for
    /// the free memory (`cuMemGetInfo`), to trim the pool if it does not fit: only when
    /// the pool may hold idle memory (else trimming gives nothing back), and the
    /// request is more than half of the free memory devarrow estimates: the last
    /// reported, less every byte devarrow allocated since (frees go to the pool, not
    /// back to the device; the half leaves room for other users of the device since).
    /// A steady loop of allocations that fit then asks about once each time it has
    /// allocated half of the free memory.
    pub(crate) fn needs_free_memory(&self, len: usize) -> bool {
        if self.pool_idle_bound() == 0 {
            return false;
        }
        let allocated = self.allocated_bytes.load(Ordering::Relaxed);
        match *self.last_free.lock().unwrap_or_else(|e| e.into_inner()) {
            None => true,
            Some((free, at)) => {
                let estimate = free.saturating_sub(allocated.saturating_sub(at));
                len as u64 > estimate / 2
            }
        }
    }

    /// Records the free memory `cuMemGetInfo` reported.
    pub(crate) fn observed_free(&self, free: usize) {
        let allocated = self.allocated_bytes.load(Ordering::Relaxed);
        *self.last_free.lock().unwrap_or_else(|e| e.into_inner()) = Some((free as u64, allocated));
    }

    /// Records that devarrow trimmed the pool to nothing: it holds nothing idle, and the
    /// free memory grew by what it gave back (asked again when it matters).
    pub(crate) fn trimmed(&self) {
        let live = self.pool_live.load(Ordering::Relaxed);
        self.pool_peak.store(live, Ordering::Relaxed);
        *self.last_free.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_exact_and_the_free_memory_is_asked_only_when_it_matters() {
        let c = DeviceCounters::default();
        // Nothing idle in the pool: never asked.
        assert!(!c.needs_free_memory(1 << 40));
        c.allocated(100, true);
        c.allocated(50, false);
        assert_eq!(c.live_buffers.load(Ordering::Relaxed), 2);
        assert_eq!(c.live_bytes.load(Ordering::Relaxed), 150);
        c.freed(100, true);
        assert_eq!(c.pool_idle_bound(), 100);
        // Idle memory and nothing known: asked.
        assert!(c.needs_free_memory(10));
        c.observed_free(1000);
        assert!(!c.needs_free_memory(10));
        assert!(c.needs_free_memory(501));
        // 300 bytes allocated since: the estimate is 700.
        c.allocated(300, true);
        c.freed(300, true);
        assert!(!c.needs_free_memory(350));
        assert!(c.needs_free_memory(351));
        c.trimmed();
        assert_eq!(c.pool_idle_bound(), 0);
        assert!(!c.needs_free_memory(1 << 40));
        c.freed(50, false);
        assert_eq!(c.live_buffers.load(Ordering::Relaxed), 0);
        assert_eq!(c.peak_bytes.load(Ordering::Relaxed), 350);
        assert_eq!(c.allocated_bytes.load(Ordering::Relaxed), 450);
    }
}
