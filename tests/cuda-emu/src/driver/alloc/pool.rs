//! The allocation table's stream-ordered pool: the reuse of freed blocks by later
//! allocations of the same pool, and what the pool keeps of freed memory (released at a
//! synchronization above its threshold, trimmed, or all of it when its context goes).

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use super::super::common::lock;
use super::{accounted, Accounting, Alloc, FreeBlock, Kind, MemTable, ReuseFlags, FREED, PENDING};

impl MemTable {
    /// The reuse flags of `pool`.
    pub fn reuse_flags(&self, pool: u64) -> ReuseFlags {
        lock(&self.reuse_flags)
            .get(&pool)
            .copied()
            .unwrap_or([1, 1, 1])
    }

    /// Sets reuse flag `i` (0..3) of `pool`.
    pub fn set_reuse_flag(&self, pool: u64, i: usize, value: i32) {
        lock(&self.reuse_flags).entry(pool).or_insert([1, 1, 1])[i] = value;
    }

    /// Keeps the block of `block.alloc` (whose stream-ordered free was just enqueued) for
    /// reuse by its pool.
    pub fn keep_free_block(&self, block: FreeBlock) {
        lock(&self.free_blocks).push(block);
    }

    /// A stream-ordered allocation of `size` bytes from `pool` in context `ctx` that
    /// reuses a freed block, when `may_reuse` accepts one of the blocks of that pool and
    /// size (the most recently freed first); `None` when none is accepted.
    ///
    /// The new allocation (pending, like a fresh one) takes the address and the memory of
    /// the block; the freed one is marked reused. Its accounting moves from the pool's
    /// reserve to its use if its free already ran, else it stays in use (the free, when it
    /// runs, leaves it to the new allocation).
    pub fn reuse(
        &self,
        size: usize,
        ctx: u64,
        pool: u64,
        mut may_reuse: impl FnMut(&FreeBlock) -> bool,
    ) -> Option<Arc<Alloc>> {
        if size == 0 {
            return None;
        }
        let need = accounted(size);
        let block = {
            let mut blocks = lock(&self.free_blocks);
            let at = blocks.iter().rposition(|b| {
                b.alloc.pool == pool
                    && b.alloc.ctx == ctx
                    && accounted(b.alloc.size) == need
                    && may_reuse(b)
            })?;
            blocks.remove(at)
        };
        let old = block.alloc;
        let mut acct = self.acct(old.device);
        if old.state.load(Ordering::Acquire) == FREED {
            acct.pool_free = acct.pool_free.saturating_sub(need);
            acct.pool_used += need;
            acct.update_highs();
            lock(&self.freed).remove(&old.addr);
        }
        old.reused.store(true, Ordering::Release);
        let alloc = Arc::new(Alloc {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            addr: old.addr,
            size,
            kind: Kind::Device { pooled: true },
            ctx,
            device: old.device,
            pool,
            backing: old.backing.clone(),
            state: AtomicU8::new(PENDING),
            reused: AtomicBool::new(false),
        });
        self.insert(alloc.clone());
        Some(alloc)
    }

    /// Drops the kept blocks whose free ran beyond what the pool still reserves
    /// (`acct.pool_free`, of device `dev`), oldest first: their memory went back to the
    /// system.
    pub(super) fn forget_free_blocks(&self, dev: usize, acct: &Accounting) {
        let mut blocks = lock(&self.free_blocks);
        let mut kept: u64 = blocks
            .iter()
            .filter(|b| b.alloc.device == dev && b.alloc.state.load(Ordering::Acquire) == FREED)
            .map(|b| accounted(b.alloc.size))
            .sum();
        blocks.retain(|b| {
            if b.alloc.device != dev
                || kept <= acct.pool_free
                || b.alloc.state.load(Ordering::Acquire) != FREED
            {
                return true;
            }
            kept -= accounted(b.alloc.size);
            false
        });
    }

    /// Frees every allocation of context `ctx` (the context is being destroyed), forgets
    /// the pools created in it, and releases the pool's reserve.
    ///
    /// Pools made with `cuMemPoolCreate` in a primary context do not survive its reset:
    /// CUDA.jl keys its pools by context for that reason (JuliaGPU/CUDA.jl#16, "Bad
    /// allocations in memory pool after device_reset!"; #253 "Make the memory allocator
    /// context-aware"); a handle of such a pool is `CUDA_ERROR_INVALID_VALUE` afterwards.
    pub fn free_all_of(&self, dev: usize, ctx: u64) {
        let mine: Vec<Arc<Alloc>> = self
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|a| a.ctx == ctx)
            .cloned()
            .collect();
        for a in mine {
            self.finish_free(&a);
        }
        lock(&self.pools).retain(|&(_, c, _)| c != ctx);
        lock(&self.free_blocks).retain(|b| b.alloc.ctx != ctx);
        let mut acct = self.acct(dev);
        acct.pool_free = 0;
        self.forget_free_blocks(dev, &acct);
    }

    /// At a synchronization on device `dev`, its pool releases what it holds above its
    /// threshold.
    pub fn release_pool_at_sync(&self, dev: usize) {
        let mut a = self.acct(dev);
        if a.pool_free > a.pool_threshold {
            a.pool_free = a.pool_threshold;
            self.forget_free_blocks(dev, &a);
        }
    }

    /// `cuMemPoolTrimTo` on a pool of device `dev`.
    pub fn trim_pool(&self, dev: usize, min_keep: u64) {
        let mut a = self.acct(dev);
        let keep_free = min_keep.saturating_sub(a.pool_used);
        a.pool_free = a.pool_free.min(keep_free);
        self.forget_free_blocks(dev, &a);
    }
}
