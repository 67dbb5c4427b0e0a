//! The host memory a download lands in ([`HostOut`]): a block of a pool (the transfer's
//! host pool, or its pinned pool), a fresh allocation, or whole pages of their own that a
//! device may register for direct DMA ([`PageAllocation`]); each becomes an arrow-rs
//! [`Buffer`] once written.

use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use arrow_buffer::{Buffer, MutableBuffer};
use devarrow_abi::device::{HostPool, PooledMemory};
use devarrow_abi::Result;

use crate::transfer::pack::advise_huge_pages;

/// Host memory a download is unpacked into: from the transfer's pool, or fresh.
pub(super) enum HostOut {
    /// A block of the pool, wrapped in a `Buffer` that gives it back when it drops.
    Pooled(PooledMemory),
    /// A fresh allocation of `len` bytes (advised to use huge pages when large).
    Fresh(MutableBuffer, usize),
    /// Fresh whole pages of which the first `len` bytes are used: an output registered
    /// for direct DMA.
    Pages(PageAllocation, usize),
}

/// Page-aligned host memory of a whole number of pages, freed when dropped: memory a device
/// may register whole
/// ([`Device::register_host`](devarrow_abi::device::Device::register_host)) without
/// reaching into another allocation's pages.
pub(super) struct PageAllocation {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is plain memory owned by this value alone; it never accesses
// the bytes itself (its users do, through the `Buffer` or the download that owns it).
unsafe impl Send for PageAllocation {}
// SAFETY: as above: `&PageAllocation` gives no access to the bytes.
unsafe impl Sync for PageAllocation {}

impl std::panic::RefUnwindSafe for PageAllocation {}

impl PageAllocation {
    /// At least `len` (> 0) bytes, rounded up to whole pages.
    fn new(len: usize) -> Result<Self> {
        let page = devarrow_abi::device::host_page_size();
        let layout = len
            .max(1)
            .checked_next_multiple_of(page)
            .and_then(|size| std::alloc::Layout::from_size_align(size, page).ok())
            .ok_or_else(|| {
                devarrow_abi::Error::InvalidArgument(format!("{len} bytes of host memory"))
            })?;
        // SAFETY: the layout's size is at least one page, not zero.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Ok(Self { ptr, layout })
    }
}

impl Drop for PageAllocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `PageAllocation::new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

impl HostOut {
    /// `len` bytes at the start of fresh whole pages of their own.
    pub(super) fn pages(len: usize) -> Result<Self> {
        let pages = PageAllocation::new(len)?;
        // SAFETY: the allocation holds `layout.size()` bytes, exclusively owned here,
        // viewed as uninitialized bytes for the advice, which reads and writes none.
        advise_huge_pages(unsafe {
            std::slice::from_raw_parts_mut(pages.ptr.as_ptr().cast(), pages.layout.size())
        });
        Ok(Self::Pages(pages, len))
    }

    /// The bytes the output owns: its length, or more (the whole pages of
    /// [`HostOut::Pages`]).
    pub(super) fn capacity(&self) -> usize {
        match self {
            Self::Pages(pages, _) => pages.layout.size(),
            _ => self.len(),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::Pooled(memory) => memory.len(),
            Self::Fresh(_, len) | Self::Pages(_, len) => *len,
        }
    }

    /// `len` bytes to unpack into.
    pub(super) fn new(len: usize, pool: Option<&Arc<HostPool>>) -> Result<Self> {
        Ok(match pool {
            Some(pool) => Self::Pooled(pool.allocate(len)?),
            None => {
                let mut host = MutableBuffer::with_capacity(len);
                // SAFETY: the buffer has capacity for `len` bytes, viewed as uninitialized
                // bytes for the advice, which reads and writes none of them.
                advise_huge_pages(unsafe {
                    std::slice::from_raw_parts_mut(host.as_mut_ptr().cast(), len)
                });
                Self::Fresh(host, len)
            }
        })
    }

    /// The bytes, to be written (never read) by the unpacking.
    pub(super) fn as_uninit(&mut self) -> &mut [MaybeUninit<u8>] {
        match self {
            Self::Pooled(memory) => memory.as_uninit_mut(),
            // SAFETY: the buffer has capacity for `len` bytes, exclusively borrowed; they
            // are viewed as uninitialized bytes and only written through the view.
            Self::Fresh(host, len) => unsafe {
                std::slice::from_raw_parts_mut(host.as_mut_ptr().cast(), *len)
            },
            // SAFETY: the allocation holds at least `len` bytes, owned by `self`,
            // exclusively borrowed.
            Self::Pages(pages, len) => unsafe {
                std::slice::from_raw_parts_mut(pages.ptr.as_ptr().cast(), *len)
            },
        }
    }

    /// The bytes as an arrow-rs `Buffer`.
    ///
    /// # Safety
    /// Every byte must have been written.
    pub(super) unsafe fn into_buffer(self) -> Buffer {
        match self {
            Self::Pooled(memory) => {
                let (ptr, len) = (memory.as_ptr(), memory.len());
                let ptr = NonNull::new(ptr).unwrap_or(NonNull::dangling());
                // `memory` owns the block, kept alive by the `Buffer` (and its slices and
                // clones) until the last one drops, which gives it back to the pool.
                // SAFETY: `ptr` is valid for `len` bytes, initialized (the caller's
                // guarantee), for as long as the owner lives.
                unsafe { Buffer::from_custom_allocation(ptr, len, Arc::new(memory)) }
            }
            Self::Fresh(mut host, len) => {
                // SAFETY: the caller guarantees the first `len` bytes are written.
                unsafe { host.set_len(len) };
                host.into()
            }
            Self::Pages(pages, len) => {
                // `pages` owns the memory, kept alive by the `Buffer` (and its slices and
                // clones) until the last one drops.
                // SAFETY: `ptr` is valid for `len` bytes, initialized (the caller's
                // guarantee), for as long as the owner lives.
                unsafe { Buffer::from_custom_allocation(pages.ptr, len, Arc::new(pages)) }
            }
        }
    }
}
