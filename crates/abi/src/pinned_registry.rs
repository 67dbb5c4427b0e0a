//! Which host memory a device can DMA from and to directly: a registry of live pinned
//! (page-locked) allocations, keyed by address.
//!
//! Devices register the staging memory they hand out ([`Device::allocate_staging`]) and
//! answer [`Device::is_pinned`] from it, so the bridge can copy buffers that already lie in
//! such memory straight to the device, without packing them into its own staging buffers
//! first (see `devarrow_bridge::pinned`). A lookup is one `BTreeMap` range query under a
//! mutex: cheap enough to ask once per large buffer of a batch.
//!
//! [`Device::allocate_staging`]: crate::device::Device::allocate_staging
//! [`Device::is_pinned`]: crate::device::Device::is_pinned

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Live pinned host allocations: `start address -> length`, non-overlapping.
#[derive(Debug, Default)]
pub struct PinnedRegistry {
    ranges: Mutex<BTreeMap<usize, usize>>,
}

impl PinnedRegistry {
    /// An empty registry (usable in a `static`).
    pub const fn new() -> Self {
        Self {
            ranges: Mutex::new(BTreeMap::new()),
        }
    }

    fn ranges(&self) -> std::sync::MutexGuard<'_, BTreeMap<usize, usize>> {
        // The map stays consistent even if a holder panicked (every update is one call).
        self.ranges.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the allocation `ptr..ptr + len` (empty allocations are not recorded).
    pub fn register(&self, ptr: *const u8, len: usize) {
        if len > 0 {
            self.ranges().insert(ptr as usize, len);
        }
    }

    /// Forgets the allocation starting at `ptr` (call before freeing it).
    pub fn unregister(&self, ptr: *const u8) {
        self.ranges().remove(&(ptr as usize));
    }

    /// Whether `ptr..ptr + len` lies entirely inside one registered allocation (an empty
    /// range counts when it lies inside one or at its end).
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let start = ptr as usize;
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        self.ranges()
            .range(..=start)
            .next_back()
            .is_some_and(|(&base, &size)| start >= base && end <= base + size)
    }

    /// The number of live registered allocations.
    pub fn len(&self) -> usize {
        self.ranges().len()
    }

    /// Whether no allocation is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_found_only_inside_one_allocation() {
        let r = PinnedRegistry::new();
        let a = 0x1000 as *const u8;
        let b = 0x2000 as *const u8;
        r.register(a, 0x1000);
        r.register(b, 0x100);
        r.register(0x9000 as *const u8, 0); // ignored
        assert_eq!(r.len(), 2);
        assert!(r.contains(a, 0x1000));
        assert!(r.contains(a.wrapping_add(0x10), 0x20));
        assert!(
            !r.contains(a.wrapping_add(0xff0), 0x20),
            "spans two allocations"
        );
        assert!(r.contains(b.wrapping_add(0xff), 1));
        assert!(!r.contains(b.wrapping_add(0xff), 2));
        assert!(!r.contains(0x800 as *const u8, 0x10));
        assert!(!r.contains(usize::MAX as *const u8, 2));
        r.unregister(a);
        assert!(!r.contains(a, 1));
        assert!(!r.is_empty());
    }
}
