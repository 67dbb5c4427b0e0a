//! A pool of host memory that keeps freed blocks for reuse ([`HostPool`]), as devarrow's
//! CUDA pool keeps freed device memory: the [`CpuDevice`](super::CpuDevice) allocates its
//! "device" memory from one, and the bridge can take the host memory of downloads from
//! another.
//!
//! Memory fresh from the system costs a page fault (and the kernel zeroing a page) on the
//! first write of every 4 KiB page: about a third of all cycles of a transfer of 65 MB
//! batches on the CPU device went there (`docs/benchmarks.md`), as the allocator maps
//! blocks that large afresh every time. A block taken back from the pool was faulted in
//! by its last user and costs nothing but a lookup. Blocks are never zero-filled by the
//! pool: they come zeroed from the system the first time (`calloc`, which maps fresh,
//! already zeroed pages for large sizes without writing them) and hold whatever their
//! last user wrote afterwards, so their bytes are always initialized.
//!
//! Sizes are rounded up to a size class (multiples of 64 bytes up to 4 KiB, then four
//! classes per power of two: at most 25% more than asked for, of which only the pages
//! that are written ever take memory). Freed blocks are cached per class up to a byte
//! limit ([`HostPool::limit`]); beyond it a freed block goes back to the system.

use std::alloc::Layout;
use std::collections::HashMap;
use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Device, DeviceMemory, StagingMemory, BUFFER_ALIGNMENT};
use crate::error::{Error, Result};

/// Default bound on the bytes of freed blocks a [`HostPool`] keeps for reuse: 1 GiB.
pub const DEFAULT_POOL_LIMIT: usize = 1 << 30;

/// The size of a transparent huge page on the hosts devarrow targets (x86-64, and aarch64
/// with 4 KiB base pages).
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Host memory at least this large that is about to be written in full is advised to use
/// transparent huge pages ([`advise_huge_pages`]).
pub const HUGE_PAGE_MIN_BYTES: usize = 2 * HUGE_PAGE_BYTES;

/// The size of a page of host memory (`sysconf(_SC_PAGESIZE)`, asked once): the unit in
/// which host memory is page-locked for DMA (a device that registers pageable memory
/// registers whole pages). 4096 where the system does not say.
pub fn host_page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        #[cfg(unix)]
        {
            // SAFETY: `sysconf` only reads a system constant.
            let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
            if page > 0 && (page as usize).is_power_of_two() {
                return page as usize;
            }
        }
        4096
    })
}

/// The host pages lying wholly inside `ptr..ptr + len`, as an address range (empty when
/// the range holds no whole page): what a device that registers pageable memory
/// ([`Device::register_host`]) page-locks of it. The
/// partial pages at either end are left alone: they may hold other allocations, whose
/// copies must not start to depend on a registration that is undone under them.
pub fn whole_pages(ptr: *const u8, len: usize) -> std::ops::Range<usize> {
    let page = host_page_size();
    let start = (ptr as usize).checked_next_multiple_of(page);
    let end = (ptr as usize).checked_add(len).map(|end| end / page * page);
    match (start, end) {
        (Some(start), Some(end)) if start < end => start..end,
        _ => 0..0,
    }
}

/// Asks the kernel to back the whole 2 MiB pages inside `range` with transparent huge
/// pages, before it is written for the first time: one page fault per 2 MiB instead of
/// 512. Ranges below [`HUGE_PAGE_MIN_BYTES`] are left alone.
///
/// The advice changes no byte and no permission; it is ignored where huge pages are
/// disabled, and on systems other than Linux (and under Miri, which runs no system
/// call) this does nothing.
pub fn advise_huge_pages(range: &mut [MaybeUninit<u8>]) {
    if range.len() < HUGE_PAGE_MIN_BYTES {
        return;
    }
    let begin = (range.as_mut_ptr() as usize).next_multiple_of(HUGE_PAGE_BYTES);
    let end = (range.as_mut_ptr() as usize + range.len()) & !(HUGE_PAGE_BYTES - 1);
    if end <= begin {
        return;
    }
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        // `MADV_HUGEPAGE` only changes how the kernel backs the pages: contents,
        // permissions and mapping are unchanged, so no Rust reference is invalidated. Its
        // result is advisory: an error (no THP support, memory not anonymous) leaves
        // everything as it was.
        // SAFETY: `begin..end` lies inside `range`, memory this process owns and holds
        // exclusively, and is page-aligned as `madvise` requires; see above.
        unsafe {
            libc::madvise(begin as *mut libc::c_void, end - begin, libc::MADV_HUGEPAGE);
        }
    }
}

/// The size class of an allocation of `len` bytes: what a block for it holds.
pub fn size_class(len: usize) -> usize {
    const SMALL: usize = 4096;
    if len <= SMALL {
        return len.next_multiple_of(BUFFER_ALIGNMENT).max(BUFFER_ALIGNMENT);
    }
    let log2 = usize::BITS - 1 - len.leading_zeros();
    let step = 1usize << (log2 - 2);
    len.checked_next_multiple_of(step).unwrap_or(len)
}

/// What a pool has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Allocations served from a cached block.
    pub hits: u64,
    /// Allocations that asked the system for a new block.
    pub misses: u64,
    /// Bytes of freed blocks kept for reuse now.
    pub cached_bytes: usize,
    /// Bytes of blocks handed out and not freed yet (by size class).
    pub in_use_bytes: usize,
    /// Cached blocks given back to the system to make room, under the limit, for a freed
    /// block of a size used more recently (or, in a pool of pinned memory, for a new
    /// block).
    pub evictions: u64,
    /// Allocations a pool of pinned memory refused: its capacity was taken by blocks in
    /// use ([`HostPool::try_allocate`] answered `None`).
    pub exhausted: u64,
}

/// One block: `capacity` bytes from `ptr` (aligned to [`BUFFER_ALIGNMENT`]), from the
/// system allocator or from a device's pinned (staging) memory.
struct Block {
    ptr: NonNull<u8>,
    capacity: usize,
    backing: Backing,
}

/// Where a block's memory comes from.
enum Backing {
    /// The system allocator: the allocation of `layout` at `base`, which holds the block.
    System { base: NonNull<u8>, layout: Layout },
    /// Page-locked host memory of a device ([`Device::allocate_staging`]), freed when
    /// dropped.
    Pinned(#[allow(dead_code)] Box<dyn StagingMemory>),
}

// SAFETY: a block exclusively owns its allocation (it is in the pool or in one
// `PooledMemory`, never both); the pointers are not tied to any thread, and staging
// memory is `Send`.
unsafe impl Send for Block {}

impl Block {
    /// A zeroed block of `capacity` bytes.
    fn new(capacity: usize) -> Result<Self> {
        let oom = || {
            Error::Arrow(arrow_schema::ArrowError::MemoryError(format!(
                "cannot allocate {capacity} bytes of host memory"
            )))
        };
        // `alloc_zeroed` with the allocator's natural alignment is `calloc`, which hands
        // out fresh mappings (already zero) without writing them; a larger alignment would
        // `memset` every byte. So: natural alignment, 64 bytes more, aligned by hand.
        let size = capacity.checked_add(BUFFER_ALIGNMENT).ok_or_else(oom)?;
        let layout = Layout::from_size_align(size, 16).map_err(|_| oom())?;
        // SAFETY: `layout` has a non-zero size.
        let base = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or_else(oom)?;
        let offset = base.as_ptr().align_offset(BUFFER_ALIGNMENT);
        // SAFETY: `offset < BUFFER_ALIGNMENT`, so `ptr..ptr + capacity` lies inside the
        // `capacity + BUFFER_ALIGNMENT` bytes allocated.
        let ptr = unsafe { base.add(offset) };
        let mut block = Self {
            ptr,
            capacity,
            backing: Backing::System { base, layout },
        };
        advise_huge_pages(block.as_uninit_mut());
        Ok(block)
    }

    /// A block of `capacity` bytes of `device`'s pinned memory (initialized: staging
    /// memory is handed out as an initialized slice), or `None` where the device has none
    /// to hand out without allocating ([`Device::try_allocate_staging`]).
    fn pinned(device: &dyn Device, capacity: usize) -> Result<Option<Self>> {
        let Some(mut memory) = device.try_allocate_staging(capacity.max(1))? else {
            return Ok(None);
        };
        let bytes = memory.as_mut_slice();
        if bytes.len() < capacity || bytes.as_ptr().align_offset(BUFFER_ALIGNMENT) != 0 {
            return Err(Error::InvalidArgument(format!(
                "staging memory of {} bytes at {:p} for a block of {capacity} bytes aligned to \
                 {BUFFER_ALIGNMENT}",
                bytes.len(),
                bytes.as_ptr()
            )));
        }
        let ptr = NonNull::new(bytes.as_mut_ptr())
            .ok_or_else(|| Error::InvalidArgument("staging memory at address 0".into()))?;
        Ok(Some(Self {
            ptr,
            capacity,
            backing: Backing::Pinned(memory),
        }))
    }

    fn as_uninit_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: the block owns `capacity` bytes at `ptr`, borrowed exclusively here.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().cast::<MaybeUninit<u8>>(),
                self.capacity,
            )
        }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Backing::System { base, layout } = self.backing {
            // SAFETY: allocated in `Block::new` with this very layout, freed once.
            unsafe { std::alloc::dealloc(base.as_ptr(), layout) };
        }
        // Pinned memory is freed by its own drop.
    }
}

#[derive(Default)]
struct PoolState {
    free: HashMap<usize, Vec<Block>>,
    /// When each size class was last allocated or freed (`clock` ticks).
    last_use: HashMap<usize, u64>,
    clock: u64,
    stats: PoolStats,
}

impl PoolState {
    fn touch(&mut self, class: usize) {
        self.clock += 1;
        self.last_use.insert(class, self.clock);
    }

    /// Takes cached blocks of the size classes used least recently (never `class`'s)
    /// until `class` more bytes fit under `limit`; `None` (nothing taken) where even
    /// evicting every other class would not make room.
    fn make_room(&mut self, class: usize, limit: usize) -> Option<Vec<Block>> {
        let own = self.free.get(&class).map_or(0, |v| v.len() * class);
        if own + class > limit {
            return None;
        }
        let mut evicted = Vec::new();
        while self.stats.cached_bytes + class > limit {
            let victim = self
                .free
                .iter()
                .filter(|(&c, blocks)| c != class && !blocks.is_empty())
                .map(|(&c, _)| (self.last_use.get(&c).copied().unwrap_or(0), c))
                .min()
                .map(|(_, c)| c)?;
            let block = self.free.get_mut(&victim).and_then(Vec::pop)?;
            self.stats.cached_bytes -= victim;
            self.stats.evictions += 1;
            evicted.push(block);
        }
        Some(evicted)
    }
}

/// Runs before a pool gives memory back to the system: waits until nothing that was
/// enqueued before still uses it (the copy engine of a CPU device with a link model).
pub type Fence = Box<dyn Fn() + Send + Sync>;

/// Host memory blocks for reuse: [`HostPool::allocate`] takes a cached block of the size
/// class when there is one, else a new one from the system; dropping the
/// [`PooledMemory`] gives the block back. Cheap to share (`Arc`).
///
/// ```
/// use std::sync::Arc;
///
/// use devarrow_abi::device::HostPool;
///
/// # fn main() -> devarrow_abi::Result<()> {
/// let pool = Arc::new(HostPool::new(64 << 20)); // keeps up to 64 MiB of freed blocks
/// let block = pool.allocate(1 << 20)?;
/// assert_eq!(block.len(), 1 << 20);
/// drop(block); // back to the pool
/// let again = pool.allocate(1 << 20)?; // the same block: written again without page faults
/// assert_eq!((pool.stats().misses, pool.stats().hits), (1, 1));
/// # drop(again);
/// # Ok(())
/// # }
/// ```
pub struct HostPool {
    state: Mutex<PoolState>,
    /// Bytes of freed blocks kept (system memory), or held in all (pinned).
    limit: AtomicUsize,
    fence: Option<Fence>,
    /// The device whose pinned memory the blocks are ([`HostPool::pinned`]); `None`:
    /// the system allocator.
    pinned: Option<Arc<dyn Device>>,
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool")
            .field("limit", &self.limit())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Default for HostPool {
    fn default() -> Self {
        Self::new(DEFAULT_POOL_LIMIT)
    }
}

impl HostPool {
    /// A pool that keeps up to `limit` bytes of freed blocks.
    pub fn new(limit: usize) -> Self {
        Self {
            state: Mutex::new(PoolState::default()),
            limit: AtomicUsize::new(limit),
            fence: None,
            pinned: None,
        }
    }

    /// A pool of `device`'s pinned (page-locked) host memory, of at most `capacity` bytes
    /// in all (blocks in use and cached): [`HostPool::try_allocate`] answers `None` rather
    /// than go beyond it. Memory a device copies to and from directly, so that a download
    /// lands in it with no staging copy, and an upload of what it holds is a direct copy.
    ///
    /// Blocks come from [`Device::try_allocate_staging`] (on CUDA, blocks of the pinned
    /// memory the device reserved, with no driver call: allocating pinned memory would
    /// synchronize the device; where the device has none left, the pool is full) and go
    /// back to the device only when the pool is trimmed or dropped, or to make room for
    /// another size.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use devarrow_abi::device::{CpuDevice, Device, HostPool};
    ///
    /// # fn main() -> devarrow_abi::Result<()> {
    /// let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    /// let pool = Arc::new(HostPool::pinned(device.clone(), 1 << 20));
    /// let block = pool.try_allocate(100_000)?.expect("room for it");
    /// assert!(device.is_pinned(block.as_ptr(), block.len()));
    /// assert!(pool.try_allocate(1 << 20)?.is_none(), "beyond the capacity");
    /// let address = block.as_ptr();
    /// drop(block); // back to the pool, not to the device
    /// // a block of the same size class (sizes round up by at most a quarter)
    /// assert_eq!(pool.try_allocate(99_000)?.expect("cached").as_ptr(), address);
    /// # Ok(())
    /// # }
    /// ```
    pub fn pinned(device: Arc<dyn Device>, capacity: usize) -> Self {
        Self {
            pinned: Some(device),
            ..Self::new(capacity)
        }
    }

    /// Whether the blocks are a device's pinned memory ([`HostPool::pinned`]).
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// A pool that calls `fence` before it gives memory back to the system (and lets
    /// every block go only after it returned).
    pub fn with_fence(limit: usize, fence: Fence) -> Self {
        Self {
            fence: Some(fence),
            ..Self::new(limit)
        }
    }

    /// The most bytes of freed blocks kept for reuse (a pool of pinned memory: the most
    /// bytes it holds, in use and cached).
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Changes [`HostPool::limit`]. Lowered, it takes effect as blocks are freed or
    /// allocated (cached blocks beyond it go back to the system then, or on
    /// [`HostPool::trim`]); blocks in use are never taken back.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        // Every update is complete before the guard drops: a panic elsewhere leaves the
        // state consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the pool has done.
    pub fn stats(&self) -> PoolStats {
        self.state().stats
    }

    /// `len` bytes aligned to [`BUFFER_ALIGNMENT`], initialized (zero when new, else
    /// what the block's last user wrote), freed into the pool when dropped.
    ///
    /// A pool of pinned memory ([`HostPool::pinned`]) that is full fails with
    /// [`Error::InvalidArgument`]; [`HostPool::try_allocate`] says so with `None`.
    pub fn allocate(self: &Arc<Self>, len: usize) -> Result<PooledMemory> {
        self.try_allocate(len)?.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a pinned host memory pool of {} bytes is full: {} bytes in use",
                self.limit(),
                self.stats().in_use_bytes
            ))
        })
    }

    /// [`HostPool::allocate`], or `None` where a pool of pinned memory would go beyond
    /// its capacity (blocks of other sizes that are cached are freed first to make
    /// room). A pool of system memory always allocates.
    pub fn try_allocate(self: &Arc<Self>, len: usize) -> Result<Option<PooledMemory>> {
        if len == 0 {
            return Ok(Some(PooledMemory {
                ptr: NonNull::<u8>::dangling()
                    .as_ptr()
                    .wrapping_add(BUFFER_ALIGNMENT - 1)
                    .cast(),
                len: 0,
                block: None,
                pool: self.clone(),
            }));
        }
        let class = size_class(len);
        let mut evicted = Vec::new();
        let cached = {
            let mut state = self.state();
            state.touch(class);
            let block = state.free.get_mut(&class).and_then(Vec::pop);
            match &block {
                Some(_) => {
                    state.stats.hits += 1;
                    state.stats.cached_bytes -= class;
                }
                None if self.pinned.is_some() => {
                    // Everything pinned counts against the capacity: make room among the
                    // cached blocks of other sizes, or give up.
                    let held = state.stats.in_use_bytes + state.stats.cached_bytes;
                    let limit = self.limit();
                    if held + class > limit {
                        let in_use = state.stats.in_use_bytes;
                        if in_use + class > limit {
                            state.stats.exhausted += 1;
                            return Ok(None);
                        }
                        let need = held + class - limit;
                        let mut freed = 0;
                        while freed < need {
                            let Some(victim) = state
                                .free
                                .iter()
                                .filter(|(_, blocks)| !blocks.is_empty())
                                .map(|(&c, _)| (state.last_use.get(&c).copied().unwrap_or(0), c))
                                .min()
                                .map(|(_, c)| c)
                            else {
                                break;
                            };
                            if let Some(block) = state.free.get_mut(&victim).and_then(Vec::pop) {
                                state.stats.cached_bytes -= victim;
                                state.stats.evictions += 1;
                                freed += victim;
                                evicted.push(block);
                            }
                        }
                    }
                    state.stats.misses += 1;
                }
                None => state.stats.misses += 1,
            }
            state.stats.in_use_bytes += class;
            block
        };
        if !evicted.is_empty() {
            if let Some(fence) = &self.fence {
                fence();
            }
            drop(evicted);
        }
        let block = match cached {
            Some(block) => block,
            None => match self.new_block(class) {
                Ok(Some(block)) => block,
                Ok(None) => {
                    // The device has no pinned memory to hand out without allocating: the
                    // cache's blocks go back to it, and it is asked once more.
                    self.state().stats.in_use_bytes -= class;
                    let again = if self.trim() > 0 {
                        self.new_block(class)?
                    } else {
                        None
                    };
                    match again {
                        Some(block) => {
                            self.state().stats.in_use_bytes += class;
                            block
                        }
                        None => {
                            self.state().stats.exhausted += 1;
                            return Ok(None);
                        }
                    }
                }
                Err(e) => {
                    // Out of memory: give the cache back and try once more.
                    self.state().stats.in_use_bytes -= class;
                    if self.trim() == 0 {
                        return Err(e);
                    }
                    self.state().stats.in_use_bytes += class;
                    self.new_block(class)
                        .and_then(|block| {
                            block.ok_or_else(|| {
                                Error::InvalidArgument(format!(
                                    "no pinned memory for a block of {class} bytes"
                                ))
                            })
                        })
                        .inspect_err(|_| {
                            self.state().stats.in_use_bytes -= class;
                        })?
                }
            },
        };
        Ok(Some(PooledMemory {
            ptr: block.ptr.as_ptr(),
            len,
            block: Some(block),
            pool: self.clone(),
        }))
    }

    /// A new block of `class` bytes; `None` where a pool of pinned memory's device has
    /// none to hand out without allocating.
    fn new_block(&self, class: usize) -> Result<Option<Block>> {
        match &self.pinned {
            Some(device) => Block::pinned(device.as_ref(), class),
            None => Block::new(class).map(Some),
        }
    }

    /// Gives every cached block back to the system; returns the bytes freed.
    pub fn trim(&self) -> usize {
        let blocks: Vec<Block> = {
            let mut state = self.state();
            state.stats.cached_bytes = 0;
            state.free.drain().flat_map(|(_, v)| v).collect()
        };
        let freed = blocks.iter().map(|b| b.capacity).sum();
        if !blocks.is_empty() {
            if let Some(fence) = &self.fence {
                fence();
            }
        }
        drop(blocks);
        freed
    }

    /// Caches a freed block. Where the cache is full, the blocks of the size classes used
    /// least recently make room for it: a workload whose sizes change (a sweep of batch
    /// sizes, a new table) would otherwise keep the old sizes cached forever and fault
    /// fresh memory for every block of the new ones.
    fn give_back(&self, block: Block) {
        let class = block.capacity;
        let mut state = self.state();
        state.stats.in_use_bytes -= class;
        state.touch(class);
        let (evicted, dropped) = match state.make_room(class, self.limit()) {
            Some(evicted) => {
                state.stats.cached_bytes += class;
                state.free.entry(class).or_default().push(block);
                (evicted, None)
            }
            None => (Vec::new(), Some(block)),
        };
        drop(state);
        if evicted.is_empty() && dropped.is_none() {
            return;
        }
        if let Some(fence) = &self.fence {
            fence();
        }
        drop((evicted, dropped));
    }
}

/// A block of a [`HostPool`]: `len` bytes at [`PooledMemory::as_ptr`], given back to the
/// pool when dropped. The CPU device's device memory, and, wrapped in an arrow-rs
/// `Buffer`, host memory of downloads.
pub struct PooledMemory {
    ptr: *mut u8,
    len: usize,
    block: Option<Block>,
    pool: Arc<HostPool>,
}

impl fmt::Debug for PooledMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

// SAFETY: the value exclusively owns its block (shared references only expose the
// address); the pool is `Sync`.
unsafe impl Send for PooledMemory {}
// SAFETY: as above: `&self` gives out the address and length only.
unsafe impl Sync for PooledMemory {}
impl std::panic::RefUnwindSafe for PooledMemory {}

impl PooledMemory {
    /// The first byte (aligned to [`BUFFER_ALIGNMENT`]; dangling when `len` is 0).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The size in bytes, as asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the block is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, for writing (they are initialized, but callers that overwrite them need
    /// not read them first).
    pub fn as_uninit_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: `ptr` is valid for `len` bytes (or dangling and aligned for 0), owned by
        // the value and borrowed exclusively here.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<MaybeUninit<u8>>(), self.len) }
    }
}

impl Drop for PooledMemory {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            self.pool.give_back(block);
        }
    }
}

// SAFETY: the address is fixed at allocation, valid for `len` bytes and owned by the
// value until it drops (the block goes back to the pool only then).
unsafe impl DeviceMemory for PooledMemory {
    fn address(&self) -> *mut std::ffi::c_void {
        self.ptr.cast()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pages_leave_the_partial_ends_out() {
        let page = host_page_size();
        let at = |n: usize| std::ptr::without_provenance::<u8>(n * page);
        assert_eq!(whole_pages(at(2), 3 * page), 2 * page..5 * page);
        assert_eq!(
            whole_pages(at(2).wrapping_add(1), 3 * page),
            3 * page..5 * page
        );
        assert_eq!(
            whole_pages(at(2).wrapping_sub(1), 3 * page),
            2 * page..4 * page
        );
        assert_eq!(whole_pages(at(2).wrapping_add(1), 2 * page - 2), 0..0);
        assert_eq!(whole_pages(at(2), page - 1), 0..0);
        assert_eq!(whole_pages(at(2), 0), 0..0);
        assert_eq!(
            whole_pages(std::ptr::without_provenance(usize::MAX), 8),
            0..0
        );
    }

    #[test]
    fn size_classes_round_up_by_at_most_a_quarter() {
        assert_eq!(size_class(0), 64);
        assert_eq!(size_class(1), 64);
        assert_eq!(size_class(65), 128);
        assert_eq!(size_class(4096), 4096);
        assert_eq!(size_class(4097), 5120);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), 1280 << 10);
        for len in [4097usize, 10_000, 65_000_000, 123_456_789, (1 << 40) + 3] {
            let class = size_class(len);
            assert!(class >= len && class - len <= len / 4, "{len} -> {class}");
            assert_eq!(size_class(class), class, "classes are fixed points");
        }
    }

    #[test]
    fn freed_blocks_are_reused_and_keep_their_bytes() {
        let pool = Arc::new(HostPool::new(1 << 30));
        let mut a = pool.allocate(100_000).unwrap();
        assert_eq!(a.as_ptr() as usize % BUFFER_ALIGNMENT, 0);
        assert_eq!(a.len(), 100_000);
        a.as_uninit_mut().fill(MaybeUninit::new(7));
        let address = a.as_ptr();
        drop(a);
        assert_eq!(pool.stats().cached_bytes, size_class(100_000));
        // Another size of the same class takes the same block, unzeroed.
        let b = pool.allocate(99_000).unwrap();
        assert_eq!(b.as_ptr(), address);
        // SAFETY: `b` holds 99,000 initialized bytes (written through `a` above).
        let bytes = unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) };
        assert!(bytes.iter().all(|&x| x == 7));
        let stats = pool.stats();
        assert_eq!((stats.hits, stats.misses), (1, 1));
        assert_eq!(stats.in_use_bytes, size_class(100_000));
        // New blocks are zeroed.
        let c = pool.allocate(5000).unwrap();
        // SAFETY: new blocks are zeroed, so initialized.
        let bytes = unsafe { std::slice::from_raw_parts(c.as_ptr(), c.len()) };
        assert!(bytes.iter().all(|&x| x == 0));
        assert!(pool.allocate(0).unwrap().is_empty());
        drop((b, c));
        assert_eq!(pool.stats().in_use_bytes, 0);
        assert_eq!(pool.trim(), size_class(100_000) + size_class(5000));
        assert_eq!(pool.stats().cached_bytes, 0);
    }

    #[test]
    fn beyond_the_limit_blocks_go_back_to_the_system_after_the_fence() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let fenced = Arc::new(AtomicUsize::new(0));
        let counter = fenced.clone();
        let pool = Arc::new(HostPool::with_fence(
            10_000,
            Box::new(move || {
                counter.fetch_add(1, Ordering::SeqCst);
            }),
        ));
        let a = pool.allocate(8000).unwrap();
        let b = pool.allocate(8000).unwrap();
        drop(a);
        assert_eq!(fenced.load(Ordering::SeqCst), 0);
        drop(b); // over the limit: freed, after the fence
        assert_eq!(fenced.load(Ordering::SeqCst), 1);
        assert_eq!(pool.stats().cached_bytes, size_class(8000));
        pool.trim();
        assert_eq!(fenced.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_raised_limit_keeps_a_whole_cycle_and_the_cpu_device_raises_it() {
        let pool = Arc::new(HostPool::new(10_000));
        let cycle = |pool: &Arc<HostPool>| {
            let blocks: Vec<_> = (0..4).map(|_| pool.allocate(8000).unwrap()).collect();
            drop(blocks);
        };
        cycle(&pool);
        assert_eq!(
            pool.stats().cached_bytes,
            size_class(8000),
            "one kept under 10,000"
        );
        pool.set_limit(4 * size_class(8000));
        assert_eq!(pool.limit(), 4 * size_class(8000));
        cycle(&pool);
        cycle(&pool);
        let stats = pool.stats();
        assert_eq!(stats.cached_bytes, 4 * size_class(8000), "{stats:?}");
        assert_eq!(stats.hits, 1 + 4, "{stats:?}");
        // Lowered, blocks go back as they are freed.
        pool.set_limit(0);
        let block = pool.allocate(8000).unwrap();
        drop(block);
        assert_eq!(pool.stats().cached_bytes, 3 * size_class(8000));
        assert_eq!(pool.trim(), 3 * size_class(8000));

        use crate::device::{CpuDevice, MemoryPoolPolicy};
        let device = CpuDevice::direct();
        device.retain_freed_memory(Some(3 << 30)).unwrap();
        assert_eq!(device.memory_pool().limit(), 3 << 30);
        device.retain_freed_memory(None).unwrap();
        assert_eq!(device.memory_pool().limit(), DEFAULT_POOL_LIMIT);
    }

    #[test]
    fn a_full_cache_makes_room_for_the_size_used_last() {
        let (small, large) = (size_class(1000), size_class(2000));
        let pool = Arc::new(HostPool::new(3 * small + large));
        // The cache fills with three small blocks...
        let smalls: Vec<_> = (0..3).map(|_| pool.allocate(1000).unwrap()).collect();
        drop(smalls);
        let a = pool.allocate(2000).unwrap();
        let b = pool.allocate(2000).unwrap();
        drop(a); // fits beside them
        assert_eq!(pool.stats().cached_bytes, 3 * small + large);
        // ...and a second large block evicts small ones, used less recently, to be kept.
        drop(b);
        let stats = pool.stats();
        assert_eq!(stats.cached_bytes, small + 2 * large, "{stats:?}");
        assert_eq!(stats.evictions, 2);
        let (a, b) = (pool.allocate(2000).unwrap(), pool.allocate(2000).unwrap());
        assert_eq!(pool.stats().hits, 2);
        drop((a, b));
        // A block larger than the limit is never cached, and evicts nothing.
        drop(pool.allocate(10 * large).unwrap());
        assert_eq!(pool.stats().evictions, 2);
        assert_eq!(pool.stats().cached_bytes, small + 2 * large);
    }

    #[test]
    fn a_pinned_pool_stays_within_its_capacity_and_reuses_its_blocks() {
        use crate::device::CpuDevice;
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
        let class = size_class(100_000);
        let pool = Arc::new(HostPool::pinned(device.clone(), 2 * class + 1000));
        assert!(pool.is_pinned());
        let a = pool.try_allocate(100_000).unwrap().expect("room");
        assert!(
            device.is_pinned(a.as_ptr(), a.len()),
            "the device's pinned memory"
        );
        assert_eq!(a.as_ptr() as usize % BUFFER_ALIGNMENT, 0);
        let b = pool.try_allocate(100_000).unwrap().expect("room");
        assert!(pool.try_allocate(100_000).unwrap().is_none(), "full");
        assert!(pool.allocate(100_000).is_err());
        assert_eq!(pool.stats().exhausted, 2);
        let address = a.as_ptr();
        drop(a);
        let c = pool.try_allocate(99_000).unwrap().expect("the freed block");
        assert_eq!(c.as_ptr(), address);
        drop((b, c));
        // Another size: cached blocks of the first make room for it.
        let d = pool.try_allocate(150_000).unwrap().expect("room made");
        let stats = pool.stats();
        assert!(stats.evictions >= 1, "{stats:?}");
        assert!(stats.in_use_bytes + stats.cached_bytes <= 2 * class + 1000);
        drop(d);
        assert!(pool.trim() > 0);
    }
}
