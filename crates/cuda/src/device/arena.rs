//! [`PinnedArena`]: the pinned host memory of one context, taken from the driver in
//! slabs at set-up only and handed out in blocks with no driver call.
//!
//! `cuMemHostAlloc` is an implicit synchronization (CUDA C++ Programming Guide,
//! "Implicit Synchronization": work of any stream enqueued after it waits for all work
//! enqueued before it, other libraries' included), and `cuMemFreeHost` may wait for the
//! whole device (AMD documents it for `hipHostFree`; the emulated driver does it). So
//! the staging of uploads and downloads and the pinned blocks downloads land in are
//! sub-allocated from slabs taken when the first `CudaDevice` of the context is made
//! ([`DEFAULT_PINNED_RESERVE_BYTES`]) or by an explicit warm-up
//! (`CudaDevice::reserve_pinned`, `Transfer::prepare`); a block given back returns its
//! range to its slab (no driver call), and slabs go back to the driver only on an
//! explicit `CudaDevice::trim_pinned` or when the arena drops: the last `CudaDevice` of
//! the context and the last block taken from it gone. An allocation the slabs have no
//! room for is refused (`None`), never served by a new slab: the caller falls back to
//! pageable memory.
//!
//! Slab memory is zeroed once, when the slab is allocated (on several threads: see
//! `memory::zero_in_parallel`); a block handed out again holds what its last user wrote:
//! initialized bytes, so handing them out as `&mut [u8]` is sound, and nothing is written
//! twice before the copy that overwrites it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use crate::error::Result;
use crate::memory::PinnedHostBuffer;
use crate::primary_context::PrimaryContext;

/// The pinned memory a context's arena takes when its first `CudaDevice` is made: a
/// default `Transfer`'s staging (64 MiB) and as much again for the blocks downloads land
/// in.
pub const DEFAULT_PINNED_RESERVE_BYTES: usize = 128 << 20;

/// Blocks start at multiples of this many bytes of their slab (slabs are page-aligned),
/// and take a multiple of it.
const BLOCK_ALIGN: usize = 256;

/// Slabs are multiples of this many bytes (a transparent huge page).
const SLAB_ROUND: usize = 2 << 20;

/// How much of an arena is taken and free.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PinnedStats {
    /// Bytes of pinned memory the arena holds (all its slabs).
    pub reserved: usize,
    /// Bytes of it handed out in blocks now.
    pub in_use: usize,
    /// Slabs (`cuMemHostAlloc` allocations) it holds.
    pub slabs: usize,
    /// The largest block it could hand out now.
    pub largest_free: usize,
}

/// One `cuMemHostAlloc` allocation and its free ranges.
struct Slab {
    id: u64,
    memory: PinnedHostBuffer,
    /// The address of its first byte (`memory`'s, kept as an integer).
    base: usize,
    /// Free ranges: offset -> length, never two adjacent.
    free: BTreeMap<usize, usize>,
    in_use: usize,
}

#[derive(Default)]
struct State {
    slabs: Vec<Slab>,
    next_id: u64,
}

/// The pinned memory of one context (see the module docs).
pub(crate) struct PinnedArena {
    // (Dropped in this order: the slabs, then the context they were allocated in.)
    state: Mutex<State>,
    device: PrimaryContext,
}

/// The arena of each context (by `cuCtxGetId`), while any `CudaDevice` or block holds it.
fn arenas() -> MutexGuard<'static, HashMap<u64, Weak<PinnedArena>>> {
    static ARENAS: OnceLock<Mutex<HashMap<u64, Weak<PinnedArena>>>> = OnceLock::new();
    // Every update is complete before the guard drops.
    ARENAS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

impl PinnedArena {
    /// The arena of `device`'s context, made (and [`DEFAULT_PINNED_RESERVE_BYTES`]
    /// reserved in it) if no `CudaDevice` or block holds one now. Where the reservation
    /// fails the arena starts empty: allocations fall back to pageable memory.
    pub(crate) fn for_context(device: &PrimaryContext) -> Arc<Self> {
        let key = crate::driver::ctx_get_id(device.cu_context()).ok();
        let mut map = arenas();
        if let Some(arena) = key.and_then(|k| map.get(&k)).and_then(Weak::upgrade) {
            return arena;
        }
        map.retain(|_, arena| arena.strong_count() > 0);
        let arena = Arc::new(Self {
            device: device.clone(),
            state: Mutex::new(State::default()),
        });
        let _ = arena.reserve(DEFAULT_PINNED_RESERVE_BYTES);
        if let Some(key) = key {
            map.insert(key, Arc::downgrade(&arena));
        }
        arena
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update is complete before the guard drops.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes sure a block of `bytes` fits: where no free range is that large, allocates
    /// one slab of at least `bytes` (`cuMemHostAlloc`: an implicit synchronization, the
    /// caller's explicit warm-up). Returns the bytes allocated (0: it fitted).
    pub(crate) fn reserve(&self, bytes: usize) -> Result<usize> {
        if bytes == 0 {
            return Ok(0);
        }
        let need = bytes.max(1).next_multiple_of(BLOCK_ALIGN);
        if self.stats().largest_free >= need {
            return Ok(0);
        }
        let size = need.next_multiple_of(SLAB_ROUND);
        // Allocated (and zeroed) outside the lock: other blocks come and go meanwhile.
        let memory = PinnedHostBuffer::alloc(&self.device, size)?;
        let base = memory.as_slice().as_ptr() as usize;
        let mut state = self.state();
        let id = state.next_id;
        state.next_id += 1;
        state.slabs.push(Slab {
            id,
            memory,
            base,
            free: BTreeMap::from([(0, size)]),
            in_use: 0,
        });
        Ok(size)
    }

    /// A block of `len` bytes (at least one) from the smallest free range that holds it,
    /// or `None` where none does. No driver call.
    pub(crate) fn allocate(self: &Arc<Self>, len: usize) -> Option<ArenaBlock> {
        let size = len.max(1).checked_next_multiple_of(BLOCK_ALIGN)?;
        let mut state = self.state();
        let (slab_at, offset, free_len) = state
            .slabs
            .iter()
            .enumerate()
            .flat_map(|(i, slab)| {
                slab.free
                    .iter()
                    .filter(|&(_, &l)| l >= size)
                    .map(move |(&o, &l)| (i, o, l))
            })
            .min_by_key(|&(_, _, l)| l)?;
        let slab = &mut state.slabs[slab_at];
        take(&mut slab.free, offset, free_len, size);
        slab.in_use += size;
        Some(ArenaBlock {
            arena: self.clone(),
            slab: slab.id,
            offset,
            size,
            addr: slab.base + offset,
            len,
        })
    }

    /// Gives a block's range back to its slab, merged with the free ranges beside it.
    fn release(&self, slab: u64, offset: usize, size: usize) {
        let mut state = self.state();
        let Some(slab) = state.slabs.iter_mut().find(|s| s.id == slab) else {
            return;
        };
        slab.in_use -= size;
        give_back(&mut slab.free, offset, size);
    }

    /// Frees (`cuMemFreeHost`, which may wait for the whole device: the caller's explicit
    /// trim) every slab no block is taken from; returns the bytes freed.
    pub(crate) fn trim(&self) -> usize {
        let idle: Vec<Slab> = {
            let mut state = self.state();
            let (idle, kept) = std::mem::take(&mut state.slabs)
                .into_iter()
                .partition(|s| s.in_use == 0);
            state.slabs = kept;
            idle
        };
        let freed = idle.iter().map(|s| s.memory.as_slice().len()).sum();
        drop(idle);
        freed
    }

    pub(crate) fn stats(&self) -> PinnedStats {
        let state = self.state();
        PinnedStats {
            reserved: state.slabs.iter().map(|s| s.memory.as_slice().len()).sum(),
            in_use: state.slabs.iter().map(|s| s.in_use).sum(),
            slabs: state.slabs.len(),
            largest_free: state
                .slabs
                .iter()
                .flat_map(|s| s.free.values().copied())
                .max()
                .unwrap_or(0),
        }
    }
}

/// Takes `size` bytes from the start of the free range at `offset` (`len` bytes long).
fn take(free: &mut BTreeMap<usize, usize>, offset: usize, len: usize, size: usize) {
    free.remove(&offset);
    if len > size {
        free.insert(offset + size, len - size);
    }
}

/// Frees `offset..offset + size`, merged with the free ranges that touch it.
fn give_back(free: &mut BTreeMap<usize, usize>, offset: usize, size: usize) {
    let (mut start, mut end) = (offset, offset + size);
    if let Some((&before, &before_len)) = free.range(..offset).next_back() {
        if before + before_len == offset {
            free.remove(&before);
            start = before;
        }
    }
    if let Some(after_len) = free.remove(&end) {
        end += after_len;
    }
    free.insert(start, end - start);
}

/// A block of a [`PinnedArena`]: `len` bytes at `addr`, its range of the slab taken
/// until it drops. Holds the arena, so the slab outlives it.
pub(crate) struct ArenaBlock {
    arena: Arc<PinnedArena>,
    slab: u64,
    offset: usize,
    size: usize,
    addr: usize,
    len: usize,
}

impl std::fmt::Debug for ArenaBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaBlock")
            .field("addr", &(self.addr as *const u8))
            .field("len", &self.len)
            .finish()
    }
}

impl ArenaBlock {
    pub(crate) fn as_slice(&self) -> &[u8] {
        // `addr..addr + len` lies in a slab that lives while `self.arena` does (a slab
        // with a block taken is never trimmed, and the arena frees its slabs only when it
        // drops); the arena hands a range to one block at a time; the slab was zeroed and
        // is written only as `u8`s since.
        // SAFETY: so the range is live, this block's alone, and initialized.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for ArenaBlock {
    fn drop(&mut self) {
        self.arena.release(self.slab, self.offset, self.size);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{give_back, take, BLOCK_ALIGN};

    /// Best fit over one slab's free list, as `PinnedArena::allocate` does over all.
    fn allocate(free: &mut BTreeMap<usize, usize>, size: usize) -> Option<usize> {
        let (&offset, &len) = free
            .iter()
            .filter(|&(_, &l)| l >= size)
            .min_by_key(|e| e.1)?;
        take(free, offset, len, size);
        Some(offset)
    }

    #[test]
    fn blocks_never_overlap_and_free_ranges_merge_back_into_the_slab() {
        const SLAB: usize = 1 << 20;
        let mut free = BTreeMap::from([(0, SLAB)]);
        let mut taken: Vec<(usize, usize)> = Vec::new();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..20_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            if !rng.is_multiple_of(3) || taken.is_empty() {
                let size = ((rng >> 8) as usize % (SLAB / 16)).next_multiple_of(BLOCK_ALIGN);
                if let Some(offset) = allocate(&mut free, size.max(BLOCK_ALIGN)) {
                    taken.push((offset, size.max(BLOCK_ALIGN)));
                }
            } else {
                let (offset, size) = taken.swap_remove((rng >> 16) as usize % taken.len());
                give_back(&mut free, offset, size);
            }
            // Free ranges and blocks tile the slab exactly; no two free ranges touch.
            let mut all: Vec<(usize, usize, bool)> = free
                .iter()
                .map(|(&o, &l)| (o, l, true))
                .chain(taken.iter().map(|&(o, l)| (o, l, false)))
                .collect();
            all.sort();
            let mut at = 0;
            for pair in all.windows(2) {
                assert!(!(pair[0].2 && pair[1].2), "step {step}: free ranges touch");
            }
            for (offset, len, _) in all {
                assert_eq!(offset, at, "step {step}: a gap or an overlap");
                at += len;
            }
            assert_eq!(at, SLAB, "step {step}");
        }
        for (offset, size) in taken.drain(..) {
            give_back(&mut free, offset, size);
        }
        assert_eq!(free, BTreeMap::from([(0, SLAB)]));
    }
}
