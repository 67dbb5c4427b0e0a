//! The allocation table: device memory at fake addresses, pinned and managed host
//! memory, the default memory pool's accounting, and the checked [`Memory`] kernels
//! access global memory through.

use std::alloc::Layout;
use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use crate::ptx::{Fault, Memory};

use super::common::{lock, R};
use cudarc::driver::sys::CUresult::*;

mod pool;

/// The first fake device address. Addresses from here to [`DEVICE_ADDRESS_END`] are
/// non-canonical on x86-64 with 4-level paging (and never mapped by Linux otherwise):
/// a host dereference of a device pointer crashes.
pub const DEVICE_ADDRESS_BASE: u64 = 0x000d_0000_0000_0000;

/// The end of the fake device address range.
pub const DEVICE_ADDRESS_END: u64 = 0x000e_0000_0000_0000;

/// The byte fresh allocations are filled with (device memory is not zeroed by CUDA).
pub const POISON: u8 = 0xCD;

/// The byte a stream-ordered free fills its block with when it runs in stream order:
/// a reader that was not ordered before the free (a missing cross-stream wait) reads
/// this, or the data of the allocation that reused the block, never the old data.
pub const FREED_POISON: u8 = 0xDF;

/// The most devices the emulator offers (`DEVARROW_EMU_DEVICES`).
pub const MAX_DEVICES: usize = 8;

/// Each device's share of the fake address range: device `d` allocates from
/// `DEVICE_ADDRESS_BASE + d * DEVICE_ADDRESS_SPAN`, so an address tells its device (as
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` does).
pub const DEVICE_ADDRESS_SPAN: u64 =
    (DEVICE_ADDRESS_END - DEVICE_ADDRESS_BASE) / MAX_DEVICES as u64;

/// The device whose address range holds `addr` (`None` outside the device ranges).
pub fn device_of_address(addr: u64) -> Option<usize> {
    (DEVICE_ADDRESS_BASE..DEVICE_ADDRESS_END)
        .contains(&addr)
        .then(|| ((addr - DEVICE_ADDRESS_BASE) / DEVICE_ADDRESS_SPAN) as usize)
}

/// Unmapped space left after each device allocation, so that an access past the end
/// never lands in the next one.
const GAP: u64 = 64 << 10;

/// Device allocations are aligned (and accounted) to this.
const DEVICE_ALIGN: usize = 256;

/// Host (pinned, managed) allocations are page-aligned.
const HOST_ALIGN: usize = 4096;

/// What kind of memory an allocation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `cuMemAlloc` (`pooled: false`) or `cuMemAllocAsync` (`pooled: true`).
    Device { pooled: bool },
    /// `cuMemAllocHost` / `cuMemHostAlloc`, with its flags.
    Pinned { flags: u32 },
    /// `cuMemAllocManaged`.
    Managed,
    /// Pageable host memory page-locked by `cuMemHostRegister`, with its flags: the
    /// caller's memory (not owned by the table), usable by copies at its own address.
    Registered { flags: u32 },
}

impl Kind {
    pub fn describe(self) -> &'static str {
        match self {
            Kind::Device { pooled: false } => "device allocation",
            Kind::Device { pooled: true } => "stream-ordered device allocation",
            Kind::Pinned { .. } => "pinned host allocation",
            Kind::Managed => "managed allocation",
            Kind::Registered { .. } => "registered host range",
        }
    }

    pub fn is_device(self) -> bool {
        matches!(self, Kind::Device { .. })
    }

    /// Page-locked host memory: `cuMemHostAlloc`ed or `cuMemHostRegister`ed.
    pub fn is_page_locked(self) -> bool {
        matches!(self, Kind::Pinned { .. } | Kind::Registered { .. })
    }
}

/// Allocation states.
const PENDING: u8 = 0;
const LIVE: u8 = 1;
const FREEING: u8 = 2;
const FREED: u8 = 3;

/// The host memory behind an allocation: freed when the last allocation using it (a
/// stream-ordered allocation may reuse the block of one freed before) and the last stream
/// operation holding one drops.
struct Backing {
    ptr: NonNull<u8>,
    /// The layout the memory was allocated with; `None` for a registered range, whose
    /// memory is the caller's.
    layout: Option<Layout>,
}

// SAFETY: the backing memory is a plain heap block owned by this value; concurrent
// accesses go through raw pointers (a data race there is a race of the emulated program,
// as on a GPU).
unsafe impl Send for Backing {}
// SAFETY: as above; shared references only hand out raw pointers.
unsafe impl Sync for Backing {}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: `ptr` was allocated with `layout` by `std::alloc::alloc` and is
            // freed exactly once, here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// One allocation. Its backing memory lives as long as the last `Arc` (a stream
/// operation may still hold it after the free), but accesses are checked against
/// [`Alloc::state`].
pub(crate) struct Alloc {
    /// A process-wide unique id (`CU_POINTER_ATTRIBUTE_BUFFER_ID`).
    pub id: u64,
    /// The address kernels and copies use (== the host address for host kinds).
    pub addr: u64,
    /// The size asked for.
    pub size: usize,
    pub kind: Kind,
    /// The owning context.
    pub ctx: u64,
    /// The device of the owning context (for device memory, also the one its address
    /// range names).
    pub device: usize,
    /// The memory pool of a stream-ordered allocation (0 for other kinds).
    pub pool: u64,
    backing: Arc<Backing>,
    state: AtomicU8,
    /// Set when a later stream-ordered allocation reuses the block after this one's free
    /// (see [`MemTable::reuse`]): accesses after the free then reach that allocation's
    /// bytes, as on a GPU, instead of faulting.
    reused: AtomicBool,
}

impl Alloc {
    /// The end address (exclusive).
    pub fn end(&self) -> u64 {
        self.addr + self.size as u64
    }

    /// A pointer to byte `offset` of the backing memory.
    pub fn ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.size);
        self.backing.ptr.as_ptr().wrapping_add(offset)
    }

    /// Whether new work may still be enqueued on it (no free requested).
    pub fn usable(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), PENDING | LIVE)
    }

    /// Marks a stream-ordered allocation allocated (its allocation ran on its stream).
    pub fn make_live(&self) {
        let _ = self
            .state
            .compare_exchange(PENDING, LIVE, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Why an access cannot happen now, if it cannot. An access after the free of a block
    /// that a later allocation reuses is no fault: it reads or writes that allocation's
    /// bytes (or [`FREED_POISON`]), as a use after free does on a GPU.
    pub fn state_problem(&self) -> Option<&'static str> {
        match self.state.load(Ordering::Acquire) {
            PENDING => Some("before its stream-ordered allocation ran (cuMemAllocAsync on another stream without ordering?)"),
            FREED if self.reused.load(Ordering::Acquire) => None,
            FREED => Some("after it was freed"),
            _ => None,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} {:#x} of {} bytes",
            self.kind.describe(),
            self.addr,
            self.size
        )
    }
}

/// The default memory pool's and the device's accounting, in bytes.
#[derive(Debug, Default)]
pub(crate) struct Accounting {
    /// Live `cuMemAlloc` memory.
    pub sync_used: u64,
    /// Live stream-ordered memory.
    pub pool_used: u64,
    /// Memory the pool keeps reserved after stream-ordered frees.
    pub pool_free: u64,
    /// `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`.
    pub pool_threshold: u64,
    pub reserved_high: u64,
    pub used_high: u64,
}

impl Accounting {
    fn update_highs(&mut self) {
        self.used_high = self.used_high.max(self.pool_used);
        self.reserved_high = self.reserved_high.max(self.pool_used + self.pool_free);
    }
}

fn accounted(size: usize) -> u64 {
    size.div_ceil(DEVICE_ALIGN) as u64 * DEVICE_ALIGN as u64
}

/// The three `CU_MEMPOOL_ATTR_REUSE_*` flags of a pool, in the attributes' order:
/// follow event dependencies, allow opportunistic, allow internal dependencies. All on by
/// default (CUDA driver API, `CUmemPool_attribute`).
pub(crate) type ReuseFlags = [i32; 3];

/// A block whose stream-ordered free was enqueued, kept by its pool for reuse until a
/// synchronization or trim releases the pool's memory.
pub(crate) struct FreeBlock {
    /// The freed allocation (its block is what is reused).
    pub alloc: Arc<Alloc>,
    /// The freeing stream (a `queue::Stream`: this module does not know streams) and the
    /// sequence number of the free on it.
    pub stream: Arc<dyn Any + Send + Sync>,
    pub seq: u64,
}

/// One device's memory: its total, its accounting and its address range's cursor.
struct DeviceMemory {
    total: u64,
    acct: Mutex<Accounting>,
    next_addr: Mutex<u64>,
}

/// Every live allocation of the process (of every device: an address finds its
/// allocation whatever the device), with each device's accounting.
pub(crate) struct MemTable {
    devices: Vec<DeviceMemory>,
    live: RwLock<BTreeMap<u64, Arc<Alloc>>>,
    /// Freed device ranges (addresses are never reused), for error messages.
    freed: Mutex<BTreeMap<u64, (usize, &'static str)>>,
    next_id: AtomicU64,
    /// Pools made with `cuMemPoolCreate` and not destroyed: `(handle, context, device)`. They go
    /// with the context they were created in (see [`MemTable::free_all_of`]).
    pub pools: Mutex<Vec<(u64, u64, usize)>>,
    /// The reuse flags of pools whose flags were set (others have the defaults).
    reuse_flags: Mutex<HashMap<u64, ReuseFlags>>,
    /// Blocks freed in stream order, by pool, oldest first.
    free_blocks: Mutex<Vec<FreeBlock>>,
}

impl MemTable {
    /// The table of `devices` devices of `total` bytes each.
    pub fn new(devices: usize, total: u64) -> Self {
        Self {
            devices: (0..devices)
                .map(|d| DeviceMemory {
                    total,
                    acct: Mutex::new(Accounting::default()),
                    next_addr: Mutex::new(DEVICE_ADDRESS_BASE + d as u64 * DEVICE_ADDRESS_SPAN),
                })
                .collect(),
            live: RwLock::new(BTreeMap::new()),
            freed: Mutex::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
            pools: Mutex::new(Vec::new()),
            reuse_flags: Mutex::new(HashMap::new()),
            free_blocks: Mutex::new(Vec::new()),
        }
    }

    /// Device `dev`'s total memory.
    pub fn total(&self, dev: usize) -> u64 {
        self.devices[dev].total
    }

    /// Device `dev`'s accounting (its default pool's and its own).
    pub fn acct(&self, dev: usize) -> std::sync::MutexGuard<'_, Accounting> {
        lock(&self.devices[dev].acct)
    }

    /// `(free, total)` memory of device `dev`.
    pub fn info(&self, dev: usize) -> (u64, u64) {
        let total = self.total(dev);
        let a = self.acct(dev);
        let used = a.sync_used + a.pool_used + a.pool_free;
        (total.saturating_sub(used), total)
    }

    fn backing(size: usize, align: usize) -> R<(NonNull<u8>, Layout)> {
        let layout =
            Layout::from_size_align(size.max(1), align).map_err(|_| CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: `layout` has a nonzero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(ptr).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        // SAFETY: `ptr` is valid for `layout.size()` writable bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), POISON, layout.size()) };
        Ok((ptr, layout))
    }

    fn insert(&self, alloc: Arc<Alloc>) {
        self.live
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(alloc.addr, alloc);
    }

    /// Allocates device memory; stream-ordered allocations (from `pool`, `Some`) start
    /// pending.
    pub fn alloc_device(
        &self,
        dev: usize,
        size: usize,
        ctx: u64,
        pool: Option<u64>,
    ) -> R<Arc<Alloc>> {
        let pooled = pool.is_some();
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let need = accounted(size);
        let total = self.total(dev);
        {
            let mut a = self.acct(dev);
            let in_use = a.sync_used + a.pool_used + a.pool_free;
            if pooled {
                let reuse = a.pool_free.min(need);
                if in_use - reuse + need > total {
                    return Err(CUDA_ERROR_OUT_OF_MEMORY);
                }
                a.pool_free -= reuse;
                a.pool_used += need;
                a.update_highs();
                if reuse > 0 {
                    // That reserve is gone: so are as many kept blocks.
                    self.forget_free_blocks(dev, &a);
                }
            } else {
                if in_use + need > total {
                    // Under pressure the pool gives its unused memory back.
                    if in_use - a.pool_free + need > total {
                        return Err(CUDA_ERROR_OUT_OF_MEMORY);
                    }
                    a.pool_free = 0;
                    self.forget_free_blocks(dev, &a);
                }
                a.sync_used += need;
            }
        }
        let undo = |this: &Self| {
            let mut a = this.acct(dev);
            if pooled {
                a.pool_used -= need;
            } else {
                a.sync_used -= need;
            }
        };
        // The whole accounted block: an allocation reusing it may be larger than this one
        // (up to the same accounted size).
        let (backing, layout) = match Self::backing(need as usize, DEVICE_ALIGN) {
            Ok(b) => b,
            Err(e) => {
                undo(self);
                return Err(e);
            }
        };
        let addr = {
            let mut next = lock(&self.devices[dev].next_addr);
            let addr = *next;
            let span = accounted(size) + GAP;
            if addr + span > DEVICE_ADDRESS_BASE + (dev as u64 + 1) * DEVICE_ADDRESS_SPAN {
                drop(next);
                undo(self);
                return Err(CUDA_ERROR_OUT_OF_MEMORY);
            }
            *next += span;
            addr
        };
        let alloc = Arc::new(Alloc {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            addr,
            size,
            kind: Kind::Device { pooled },
            ctx,
            device: dev,
            pool: pool.unwrap_or(0),
            backing: Arc::new(Backing {
                ptr: backing,
                layout: Some(layout),
            }),
            state: AtomicU8::new(if pooled { PENDING } else { LIVE }),
            reused: AtomicBool::new(false),
        });
        self.insert(alloc.clone());
        Ok(alloc)
    }

    /// Allocates pinned or managed (host) memory.
    pub fn alloc_host(&self, dev: usize, size: usize, ctx: u64, kind: Kind) -> R<Arc<Alloc>> {
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (backing, layout) = Self::backing(size, HOST_ALIGN)?;
        let alloc = Arc::new(Alloc {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            addr: backing.as_ptr() as u64,
            size,
            kind,
            ctx,
            device: dev,
            pool: 0,
            backing: Arc::new(Backing {
                ptr: backing,
                layout: Some(layout),
            }),
            state: AtomicU8::new(LIVE),
            reused: AtomicBool::new(false),
        });
        self.insert(alloc.clone());
        Ok(alloc)
    }

    /// Registers the caller's host range `addr..addr + size` (`cuMemHostRegister`).
    ///
    /// The driver locks whole pages, so two ranges conflict when they share a page
    /// ([`HOST_ALIGN`] bytes), not only a byte: `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`
    /// when a page of the range is in a live page-locked range (pinned or registered),
    /// `CUDA_ERROR_INVALID_VALUE` when it is in any other allocation (managed memory).
    /// The entry itself covers exactly `addr..addr + size`, as copies are checked
    /// against it.
    pub fn register_host(
        &self,
        dev: usize,
        addr: u64,
        size: usize,
        ctx: u64,
        flags: u32,
    ) -> R<Arc<Alloc>> {
        let backing = NonNull::new(addr as *mut u8).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let end = addr
            .checked_add(size as u64)
            .filter(|_| size > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let page = HOST_ALIGN as u64;
        let (first_page, end_page) = (addr / page * page, end.div_ceil(page) * page);
        let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
        // Entries do not overlap, so their ends are sorted like their starts: only the last
        // entry starting before the range's end page can reach its first page.
        if let Some((_, a)) = live
            .range(..end_page)
            .next_back()
            .filter(|(_, a)| a.end().div_ceil(page) * page > first_page)
        {
            return Err(if a.kind.is_page_locked() {
                CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
            } else {
                CUDA_ERROR_INVALID_VALUE
            });
        }
        let alloc = Arc::new(Alloc {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            addr,
            size,
            kind: Kind::Registered { flags },
            ctx,
            device: dev,
            pool: 0,
            backing: Arc::new(Backing {
                ptr: backing,
                layout: None,
            }),
            state: AtomicU8::new(LIVE),
            reused: AtomicBool::new(false),
        });
        live.insert(addr, alloc.clone());
        Ok(alloc)
    }

    /// The live allocation containing `addr`.
    pub fn find(&self, addr: u64) -> Option<Arc<Alloc>> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner());
        let (_, a) = live.range(..=addr).next_back()?;
        (addr < a.end()).then(|| a.clone())
    }

    /// The live allocation holding all of `addr..addr+len` (`len` > 0), and the offset
    /// of `addr` in it; `Err` says why not.
    pub fn find_range(&self, addr: u64, len: usize) -> Result<(Arc<Alloc>, usize), String> {
        match self.find(addr) {
            Some(a)
                if addr
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= a.end()) =>
            {
                let offset = (addr - a.addr) as usize;
                Ok((a, offset))
            }
            _ => Err(self.describe(addr, len)),
        }
    }

    /// Says where `addr..addr+len` lies, for an error message.
    pub fn describe(&self, addr: u64, len: usize) -> String {
        let range = format!("{addr:#x}..{:#x}", addr.wrapping_add(len as u64));
        if let Some(a) = self.find(addr) {
            return format!(
                "{range} runs {} bytes past the end of {}",
                addr + len as u64 - a.end(),
                a.describe()
            );
        }
        if (DEVICE_ADDRESS_BASE..DEVICE_ADDRESS_END).contains(&addr) {
            let freed = lock(&self.freed);
            if let Some((&base, &(size, what))) = freed.range(..=addr).next_back() {
                if addr < base + size as u64 {
                    return format!(
                        "{range} is in {what} {base:#x} of {size} bytes, already freed"
                    );
                }
            }
            let live = self.live.read().unwrap_or_else(|e| e.into_inner());
            if let Some((_, a)) = live.range(..=addr).next_back() {
                return format!(
                    "{range} is not in any live allocation ({} bytes past the end of {})",
                    addr - a.end(),
                    a.describe()
                );
            }
            return format!("{range} is not in any live device allocation");
        }
        format!("{range} is not device-accessible memory (not in any live allocation)")
    }

    /// Starts freeing the allocation based exactly at `addr` when `accept(kind)`:
    /// marks it so that no new work may use it, and returns it.
    pub fn begin_free(&self, addr: u64, accept: impl Fn(Kind) -> bool) -> R<Arc<Alloc>> {
        let live = self.live.read().unwrap_or_else(|e| e.into_inner());
        let a = live.get(&addr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !accept(a.kind) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // One atomic update from either state: the stream's worker may make a pending
        // allocation live (`Op::AllocReady`) at any moment, and a free is valid before
        // and after that (a load, then a compare-exchange from the state loaded, failed
        // when the worker came in between: a spurious "invalid free" that leaked the
        // block).
        a.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |state| {
                after_state_read();
                matches!(state, PENDING | LIVE).then_some(FREEING)
            })
            .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        Ok(a.clone())
    }

    /// Finishes freeing `a` (its memory is released when the last `Arc` drops). A
    /// stream-ordered allocation's block is filled with [`FREED_POISON`]; when a later
    /// allocation already reuses it (same stream, see [`MemTable::reuse`]) the block and
    /// its accounting are that allocation's.
    pub fn finish_free(&self, a: &Alloc) {
        // The accounting lock first, then the table: `reuse` takes them in that order.
        let mut acct = self.acct(a.device);
        if a.state.swap(FREED, Ordering::AcqRel) == FREED {
            return;
        }
        let reused = a.reused.load(Ordering::Acquire);
        {
            let mut live = self.live.write().unwrap_or_else(|e| e.into_inner());
            if live.get(&a.addr).is_some_and(|l| std::ptr::eq(&**l, a)) {
                live.remove(&a.addr);
            }
        }
        if let Kind::Device { pooled } = a.kind {
            let n = accounted(a.size);
            if pooled {
                // SAFETY: the block holds at least `a.size` bytes (it was allocated for
                // this size or a larger one of the same accounted size); racing accesses
                // are the emulated program's race, as on a GPU.
                unsafe { std::ptr::write_bytes(a.ptr(0), FREED_POISON, a.size) };
            }
            if reused {
                return;
            }
            lock(&self.freed).insert(a.addr, (a.size, a.kind.describe()));
            if pooled {
                acct.pool_used -= n;
                acct.pool_free += n;
            } else {
                acct.sync_used -= n;
            }
        }
    }

    /// Every live allocation, by address.
    pub fn snapshot(&self) -> Vec<Arc<Alloc>> {
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

/// The monotonic clock behind `%globaltimer` (nanoseconds, starting near one second).
pub(crate) fn global_timer_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    1_000_000_000 + epoch.elapsed().as_nanos() as u64
}

/// Global memory as a kernel sees it: every live allocation at launch (and any made
/// since), each access checked for bounds and for the allocation's state when it runs.
pub(crate) struct KernelMemory<'a> {
    table: &'a MemTable,
    snapshot: Vec<Arc<Alloc>>,
    /// The devices whose memory the kernel may access (bit `d` for device `d`): its own,
    /// and those its context enabled peer access to at launch.
    devices: u64,
    /// Allocations found after the launch, kept alive while the kernel runs.
    extra: Mutex<Vec<Arc<Alloc>>>,
}

impl<'a> KernelMemory<'a> {
    /// Global memory of a kernel launched when `snapshot` (of [`MemTable::snapshot`]) was
    /// taken: an address resolves to the allocation it named at launch (in stream order,
    /// a block freed after the launch and already reused by a later allocation is still
    /// the launch's), else to one made since.
    ///
    /// Device memory of a device outside `devices` (a bit mask) faults, as on hardware
    /// where that peer's memory is not mapped into the launching device's address space.
    pub fn new(table: &'a MemTable, snapshot: Vec<Arc<Alloc>>, devices: u64) -> Self {
        Self {
            table,
            snapshot,
            devices,
            extra: Mutex::new(Vec::new()),
        }
    }

    fn fault(addr: u64, size: usize, what: &str, detail: String) -> Fault {
        Fault {
            addr,
            size,
            kind: format!("{what} [{detail}]"),
        }
    }

    /// The host pointer for `addr..addr+size`, or the fault.
    fn resolve(&self, addr: u64, size: usize, what: &str) -> Result<*mut u8, Fault> {
        let i = self.snapshot.partition_point(|a| a.addr <= addr);
        let hit = i
            .checked_sub(1)
            .map(|i| &self.snapshot[i])
            .filter(|a| addr < a.end());
        let ptr_of = |a: &Alloc| -> Result<*mut u8, Fault> {
            if a.kind.is_device() && (self.devices >> a.device) & 1 == 0 {
                return Err(Self::fault(
                    addr,
                    size,
                    &format!("invalid {what}"),
                    format!(
                        "{} is memory of device {}, whose peer access is not enabled",
                        a.describe(),
                        a.device
                    ),
                ));
            }
            if addr + size as u64 > a.end() {
                return Err(Self::fault(
                    addr,
                    size,
                    &format!("out-of-bounds {what}"),
                    format!(
                        "{} bytes past the end of {}",
                        addr + size as u64 - a.end(),
                        a.describe()
                    ),
                ));
            }
            if let Some(problem) = a.state_problem() {
                return Err(Self::fault(
                    addr,
                    size,
                    &format!("invalid {what}"),
                    format!("access to {} {problem}", a.describe()),
                ));
            }
            Ok(a.ptr((addr - a.addr) as usize))
        };
        if let Some(a) = hit {
            return ptr_of(a);
        }
        // Not live at launch: maybe allocated since.
        match self.table.find(addr) {
            Some(a) => {
                let p = ptr_of(&a);
                lock(&self.extra).push(a);
                p
            }
            None => Err(Self::fault(
                addr,
                size,
                &format!("invalid {what}"),
                self.table.describe(addr, size),
            )),
        }
    }
}

/// Reads `buf.len()` bytes at `p` into `buf`, afresh from memory each time: a naturally
/// aligned access of 1, 2, 4 or 8 bytes (every scalar load of a kernel) is one relaxed
/// atomic load, so that a kernel spinning on a flag that the host or another stream
/// writes meanwhile (mapped pinned memory, `ld.volatile` / `ld.relaxed.sys`) reads each
/// new value, and the concurrent accesses are no data race; wider or misaligned ones
/// (vector loads) are plain copies.
///
/// # Safety
/// `p` must be valid for reads of `buf.len()` bytes, and not overlap `buf`.
unsafe fn load_scalar(p: *const u8, buf: &mut [u8]) {
    let aligned = (p as usize).is_multiple_of(buf.len());
    // A host thread that writes a flag a kernel spins on writes it atomically
    // (devarrow_testing's `Gate`); any other access racing a kernel's is the program's
    // race, as it would be on a GPU.
    // SAFETY: in every arm `p` is valid for `buf.len()` bytes (the caller's guarantee)
    // and aligned for the atomic type of that size (checked).
    unsafe {
        match buf.len() {
            1 => buf[0] = AtomicU8::from_ptr(p.cast_mut()).load(Ordering::Relaxed),
            2 if aligned => buf.copy_from_slice(
                &AtomicU16::from_ptr(p.cast_mut().cast::<u16>())
                    .load(Ordering::Relaxed)
                    .to_le_bytes(),
            ),
            4 if aligned => buf.copy_from_slice(
                &AtomicU32::from_ptr(p.cast_mut().cast::<u32>())
                    .load(Ordering::Relaxed)
                    .to_le_bytes(),
            ),
            8 if aligned => buf.copy_from_slice(
                &AtomicU64::from_ptr(p.cast_mut().cast::<u64>())
                    .load(Ordering::Relaxed)
                    .to_le_bytes(),
            ),
            n => std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n),
        }
    }
}

/// Writes `data` at `p`: one relaxed atomic store for a naturally aligned scalar (see
/// [`load_scalar`]), a plain copy otherwise.
///
/// # Safety
/// `p` must be valid for writes of `data.len()` bytes, and not overlap `data`.
unsafe fn store_scalar(p: *mut u8, data: &[u8]) {
    let aligned = (p as usize).is_multiple_of(data.len());
    // SAFETY: in every arm, as in `load_scalar`, for writes.
    unsafe {
        match *data {
            [a] => AtomicU8::from_ptr(p).store(a, Ordering::Relaxed),
            [a, b] if aligned => AtomicU16::from_ptr(p.cast::<u16>())
                .store(u16::from_le_bytes([a, b]), Ordering::Relaxed),
            [a, b, c, d] if aligned => AtomicU32::from_ptr(p.cast::<u32>())
                .store(u32::from_le_bytes([a, b, c, d]), Ordering::Relaxed),
            [a, b, c, d, e, f, g, h] if aligned => AtomicU64::from_ptr(p.cast::<u64>()).store(
                u64::from_le_bytes([a, b, c, d, e, f, g, h]),
                Ordering::Relaxed,
            ),
            _ => std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()),
        }
    }
}

impl Memory for KernelMemory<'_> {
    fn load(&self, addr: u64, buf: &mut [u8]) -> Result<(), Fault> {
        if buf.is_empty() {
            return Ok(());
        }
        let p = self.resolve(addr, buf.len(), "load")?;
        // SAFETY: `p` points to `buf.len()` bytes inside a live allocation, kept alive by
        // the snapshot; `buf` is a distinct Rust buffer.
        unsafe { load_scalar(p, buf) };
        Ok(())
    }

    fn store(&self, addr: u64, data: &[u8]) -> Result<(), Fault> {
        if data.is_empty() {
            return Ok(());
        }
        let p = self.resolve(addr, data.len(), "store")?;
        // SAFETY: as in `load`, for writes.
        unsafe { store_scalar(p, data) };
        Ok(())
    }

    fn atomic_add_u64(&self, addr: u64, value: u64) -> Result<u64, Fault> {
        if !addr.is_multiple_of(8) {
            return Err(Self::fault(
                addr,
                8,
                "misaligned atomic",
                "atomics must be naturally aligned".into(),
            ));
        }
        let p = self.resolve(addr, 8, "atomic")?;
        // SAFETY: `p` is 8-byte aligned (checked above; allocations are at least
        // 256-byte aligned) and valid for 8 bytes while the snapshot lives; every
        // concurrent atomic access to it goes through an atomic type too.
        let atomic = unsafe { AtomicU64::from_ptr(p.cast::<u64>()) };
        Ok(atomic.fetch_add(value, Ordering::SeqCst))
    }

    fn atomic_add_u32(&self, addr: u64, value: u32) -> Result<u32, Fault> {
        if !addr.is_multiple_of(4) {
            return Err(Self::fault(
                addr,
                4,
                "misaligned atomic",
                "atomics must be naturally aligned".into(),
            ));
        }
        let p = self.resolve(addr, 4, "atomic")?;
        // SAFETY: as in `atomic_add_u64`, with 4 bytes.
        let atomic = unsafe { AtomicU32::from_ptr(p.cast::<u32>()) };
        Ok(atomic.fetch_add(value, Ordering::SeqCst))
    }

    fn atomic_cas_u64(&self, addr: u64, expected: u64, new: u64) -> Result<u64, Fault> {
        if !addr.is_multiple_of(8) {
            return Err(Self::fault(
                addr,
                8,
                "misaligned atomic",
                "atomics must be naturally aligned".into(),
            ));
        }
        let p = self.resolve(addr, 8, "atomic")?;
        // SAFETY: as in `atomic_add_u64`.
        let atomic = unsafe { AtomicU64::from_ptr(p.cast::<u64>()) };
        Ok(atomic
            .compare_exchange(expected, new, Ordering::SeqCst, Ordering::SeqCst)
            .unwrap_or_else(|old| old))
    }

    fn atomic_cas_u32(&self, addr: u64, expected: u32, new: u32) -> Result<u32, Fault> {
        if !addr.is_multiple_of(4) {
            return Err(Self::fault(
                addr,
                4,
                "misaligned atomic",
                "atomics must be naturally aligned".into(),
            ));
        }
        let p = self.resolve(addr, 4, "atomic")?;
        // SAFETY: as in `atomic_add_u64`, with 4 bytes.
        let atomic = unsafe { AtomicU32::from_ptr(p.cast::<u32>()) };
        Ok(atomic
            .compare_exchange(expected, new, Ordering::SeqCst, Ordering::SeqCst)
            .unwrap_or_else(|old| old))
    }

    fn global_timer_ns(&self) -> u64 {
        global_timer_ns()
    }
}

#[cfg(test)]
thread_local! {
    /// What a test runs right after [`MemTable::begin_free`] has read the allocation's
    /// state: another thread's change of that state, deterministically there.
    static AFTER_STATE_READ: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
        const { std::cell::RefCell::new(None) };
}

/// The test hook of [`MemTable::begin_free`] (nothing outside tests).
fn after_state_read() {
    #[cfg(test)]
    AFTER_STATE_READ.with(|hook| {
        if let Some(hook) = hook.borrow_mut().as_mut() {
            hook();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream-ordered allocation may be freed whether or not its allocation has run on
    /// its stream: here the stream's worker makes it live (`Op::AllocReady`) right after
    /// the free read its state as pending. The free must still succeed. (It failed with
    /// `CUDA_ERROR_INVALID_VALUE`, "invalid free", leaking the block: the flaky double
    /// free of the `stress` test, seen when a descriptor table was freed right after its
    /// launch while the worker ran its allocation.)
    #[test]
    fn a_free_racing_the_allocation_becoming_live_succeeds() {
        let table = MemTable::new(1, 1 << 30);
        let a = table.alloc_device(0, 48, 1, Some(7)).unwrap();
        assert!(
            a.state_problem().is_some(),
            "pending until its allocation runs"
        );
        let worker = a.clone();
        AFTER_STATE_READ.with(|hook| {
            *hook.borrow_mut() = Some(Box::new(move || {
                // What the stream's worker does, here between the read and the update.
                worker.make_live();
            }))
        });
        let freed = table.begin_free(a.addr, Kind::is_device);
        AFTER_STATE_READ.with(|hook| hook.borrow_mut().take());
        let freeing = freed.expect("the free of an allocation made live meanwhile");
        assert!(std::ptr::eq(&*freeing, &*a));
        assert!(!a.usable(), "no new work may use it");
        table.finish_free(&a);
        assert_eq!(a.state_problem(), Some("after it was freed"));
        let acct = table.acct(0);
        assert_eq!(
            (acct.pool_used, acct.pool_free),
            (0, 256),
            "back in the pool"
        );
    }
}
