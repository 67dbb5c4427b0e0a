//! The ways a download's bytes come to the host ([`Transfer::download`]): copied
//! straight into registered pageable memory or into blocks of a pool of pinned memory,
//! through the staging pipeline into pageable memory, or read directly from device memory
//! the host can reach.

use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use arrow_buffer::{Buffer, MutableBuffer};
use devarrow_abi::device::{DeviceToHost, HostPool, PooledMemory};
use devarrow_abi::Result;

use super::{release_registrations, Transfer};
use crate::transfer::pack::{
    advise_huge_pages, copy_into_uninit, copy_to_uninit, fill_outputs, ramped_windows,
};
use crate::transfer::stages::StageTimes;

impl Transfer {
    /// [`Transfer::download`] where the device registers host memory for direct DMA
    /// ([`Device::register_host`](devarrow_abi::device::Device::register_host)) from `from`
    /// bytes on: the outputs are allocated first, those of at least `from` bytes registered
    /// and copied into directly, all in one
    /// [`Device::copy_batch_to_host`](devarrow_abi::device::Device::copy_batch_to_host),
    /// and the other sources downloaded through staging meanwhile; the registrations are
    /// dropped once the direct copies have completed.
    pub(super) fn download_registering(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        from: usize,
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        let start = Instant::now();
        // The outputs to register are whole pages of their own, registered whole (a
        // registration never reaches into a neighbouring allocation's pages).
        let mut hosts = sources
            .iter()
            .map(|&(_, len)| match len >= from {
                true => HostOut::pages(len).map(Some),
                false => HostOut::new(len, self.host_pool.as_ref()).map(Some),
            })
            .collect::<Result<Vec<_>>>()?;
        let device = self.device.clone();
        let mut registrations = Vec::new();
        let mut direct = Vec::new();
        let mut staged = Vec::new();
        for (i, &(src, len)) in sources.iter().enumerate() {
            if len >= from {
                let host = hosts[i].as_mut().expect("allocated");
                let pages = host.capacity();
                let dst = host.as_uninit().as_mut_ptr().cast::<u8>();
                // SAFETY: the output (`pages` bytes) stays allocated in `hosts` until the
                // direct copies have completed: the registration is dropped after they have
                // (`release_registrations`, below), and `hosts` only after that.
                if let Some(registration) = unsafe { device.register_host(dst, pages) }? {
                    registrations.push(registration);
                    direct.push(DeviceToHost { src, dst, len });
                    continue;
                }
            }
            staged.push(i);
        }
        let enqueued = Instant::now();
        times.allocate += enqueued - start;
        let direct_done = if direct.is_empty() {
            None
        } else {
            // SAFETY: every destination is a registered output of its copy's length, not
            // read (nor otherwise written) until the event recorded next has completed;
            // the sources lie in the downloads' device memory.
            let copied = unsafe { device.copy_batch_to_host(&direct) };
            let event = copied.and_then(|()| device.record_event());
            match event {
                Ok(event) => Some(event),
                Err(e) => {
                    if release_registrations(device.as_ref(), None, registrations).is_err() {
                        // Copies may still write the outputs: leak them, as the
                        // registrations.
                        std::mem::forget(hosts);
                    }
                    return Err(e);
                }
            }
        };
        times.copy += enqueued.elapsed();
        let staged_sources: Vec<_> = staged.iter().map(|&i| sources[i]).collect();
        let staged_hosts: Vec<HostOut> = staged
            .iter()
            .map(|&i| hosts[i].take().expect("allocated"))
            .collect();
        let downloaded = if staged_sources.is_empty() {
            Ok(staged_hosts)
        } else {
            self.staged_download(&staged_sources, times, move |_| Ok(staged_hosts))
        };
        let waiting = Instant::now();
        let released = release_registrations(device.as_ref(), direct_done.as_ref(), registrations);
        times.copy += waiting.elapsed();
        if released.is_err() && direct_done.is_some() {
            if let Err(e) = device.synchronize() {
                // The direct copies may still write the outputs: leak them.
                std::mem::forget(hosts);
                return Err(e);
            }
        }
        let staged_hosts = downloaded?;
        released?;
        // SAFETY: a direct output was written in full by its copy, which has completed
        // (the event above); a staged one by `staged_download`.
        Ok(unsafe { into_buffers(hosts, &staged, staged_hosts) })
    }

    /// The pool of pinned memory downloads land in, made on first use
    /// ([`TransferOptions::pinned_host_bytes`](super::TransferOptions::pinned_host_bytes));
    /// `None` where there is none: the option is 0, the device's memory is host memory
    /// ([`Device::host_accessible`](devarrow_abi::device::Device::host_accessible)), or it
    /// was given up ([`Transfer::host_memory_note`] says why).
    pub(super) fn pinned_pool(&mut self) -> Result<Option<Arc<HostPool>>> {
        Ok(self
            .landing
            .pool_or_make(&self.device, self.options.pinned_host_bytes))
    }

    /// [`Transfer::download`] into pinned memory of `pool`: each source is copied straight
    /// into a block of its own (one batched call for all), which becomes the batch's
    /// memory, with no staging copy and no page faults. Sources the pool has no room for
    /// (or all of them, when the device refuses to pin memory) go through the staging
    /// pipeline into pageable memory instead, and [`Transfer::host_memory_note`] says why.
    pub(super) fn download_pinned(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        pool: &Arc<HostPool>,
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        let start = Instant::now();
        let mut hosts: Vec<Option<HostOut>> = Vec::with_capacity(sources.len());
        let mut direct = Vec::new();
        let mut staged = Vec::new();
        for (i, &(src, len)) in sources.iter().enumerate() {
            match self.landing.block(pool, len) {
                Some(mut block) => {
                    let dst = block.as_uninit_mut().as_mut_ptr().cast::<u8>();
                    if len > 0 {
                        direct.push(DeviceToHost { src, dst, len });
                    }
                    hosts.push(Some(HostOut::Pooled(block)));
                    self.stats.pinned_downloads += 1;
                }
                None => {
                    staged.push(i);
                    hosts.push(None);
                    self.stats.pageable_downloads += 1;
                }
            }
        }
        let enqueued = Instant::now();
        times.allocate += enqueued - start;
        let device = self.device.clone();
        let direct_done = if direct.is_empty() {
            None
        } else {
            // SAFETY: every destination is a block of the pool of its copy's length, owned
            // by `hosts` and not read (nor otherwise written) until the event recorded next
            // has completed; the sources lie in the downloads' device memory.
            let copied = unsafe { device.copy_batch_to_host(&direct) };
            match copied.and_then(|()| device.record_event()) {
                Ok(event) => Some(event),
                Err(e) => {
                    if device.synchronize().is_err() {
                        // Copies may still write the blocks: leak them.
                        std::mem::forget(hosts);
                    }
                    return Err(e);
                }
            }
        };
        times.copy += enqueued.elapsed();
        let staged_sources: Vec<_> = staged.iter().map(|&i| sources[i]).collect();
        let host_pool = self.host_pool.clone();
        let downloaded = if staged_sources.is_empty() {
            Ok(Vec::new())
        } else {
            self.staged_download(&staged_sources, times, |sources| {
                sources
                    .iter()
                    .map(|&(_, len)| HostOut::new(len, host_pool.as_ref()))
                    .collect()
            })
        };
        let waiting = Instant::now();
        let waited = direct_done
            .as_ref()
            .map_or(Ok(()), |event| event.wait_host());
        times.copy += waiting.elapsed();
        if waited.is_err() && device.synchronize().is_err() {
            // The direct copies may still write the blocks: leak them.
            std::mem::forget(hosts);
            return Err(waited.expect_err("checked above"));
        }
        let staged_hosts = downloaded?;
        waited?;
        // SAFETY: a pinned output was written in full by its copy, which has completed
        // (the event above); a staged one by `staged_download`.
        Ok(unsafe { into_buffers(hosts, &staged, staged_hosts) })
    }

    /// The staging pipeline of [`Transfer::download`]: copies each source into the
    /// output `outputs` gives for it (one per source, of its length), which is asked for
    /// once the first copies are enqueued (so that allocating the outputs overlaps them),
    /// and returns the outputs, every byte written.
    pub(super) fn staged_download(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        times: &mut StageTimes,
        outputs: impl FnOnce(&[(*const std::ffi::c_void, usize)]) -> Result<Vec<HostOut>>,
    ) -> Result<Vec<HostOut>> {
        let largest = sources.iter().map(|&(_, len)| len).max().unwrap_or(0);
        let (chunk, stages) = self.geometry(largest);
        let last = sources.len().saturating_sub(1);
        // (source, start, end) of every copy, in order.
        let windows: Vec<(usize, usize, usize)> = sources
            .iter()
            .enumerate()
            .flat_map(|(i, &(_, len))| {
                let (head, tail) = (i == 0, i == last);
                ramped_windows(0, len, self.options.first_chunk_bytes, chunk, head, tail)
                    .into_iter()
                    .map(move |(s, e)| (i, s, e))
            })
            .collect();
        let enqueue = |this: &mut Self, k: usize| -> Result<()> {
            let (i, s, e) = windows[k];
            let device = this.device.clone();
            let staging = this.stage(k % stages, chunk)?;
            let from = (sources[i].0 as usize + s) as *const std::ffi::c_void;
            // SAFETY: the staging buffer is not read until the event recorded next has
            // completed; the source range lies inside the caller's device memory.
            unsafe { device.copy_to_host(from, staging.as_mut_slice().as_mut_ptr(), e - s)? };
            this.stages[k % stages].pending = Some(device.record_event()?);
            Ok(())
        };
        let start = Instant::now();
        for k in 0..windows.len().min(stages) {
            enqueue(self, k)?;
        }
        let allocating = Instant::now();
        times.copy += allocating - start;
        let mut hosts = outputs(sources)?;
        let mut outs: Vec<&mut [MaybeUninit<u8>]> =
            hosts.iter_mut().map(HostOut::as_uninit).collect();
        times.allocate += allocating.elapsed();
        let parallelism = self.parallelism();
        for (k, &(i, s, e)) in windows.iter().enumerate() {
            let start = Instant::now();
            let stage = &mut self.stages[k % stages];
            if let Some(event) = stage.pending.take() {
                event.wait_host()?;
            }
            let staging = stage.memory.as_ref().expect("enqueued");
            let unpacking = Instant::now();
            times.copy += unpacking - start;
            copy_to_uninit(
                &mut outs[i][s..e],
                &staging.as_slice()[..e - s],
                parallelism,
            );
            let unpacked = Instant::now();
            times.unpack += unpacked - unpacking;
            if k + stages < windows.len() {
                enqueue(self, k + stages)?;
                times.copy += unpacked.elapsed();
            }
        }
        drop(outs);
        // The windows of each source cover `0..len` and each was copied in full above,
        // from staging memory (initialized at allocation, then written by the copy).
        Ok(hosts)
    }

    /// [`Transfer::download`] from memory the host reads directly
    /// ([`Device::host_accessible`](devarrow_abi::device::Device::host_accessible)): each
    /// source copied (in parallel) into host memory.
    pub(super) fn download_direct(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        let start = Instant::now();
        let mut hosts = sources
            .iter()
            .map(|&(_, len)| HostOut::new(len, self.host_pool.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let unpacking = Instant::now();
        times.allocate += unpacking - start;
        let outputs = sources
            .iter()
            .zip(&mut hosts)
            .map(|(&(src, len), host)| {
                // `host_accessible`: `src` is a host address of `len` initialized bytes of
                // device memory, which no device work is writing (the batches' events have
                // completed: the device never has work pending). An empty range is not
                // read at all (`src` may be null).
                let from: &[u8] = match len {
                    0 => &[],
                    // SAFETY: so the range is valid for reads while the download lives.
                    _ => unsafe { std::slice::from_raw_parts(src.cast::<u8>(), len) },
                };
                (from, host.as_uninit())
            })
            .collect();
        fill_outputs(outputs, self.parallelism(), |from, offset, out, stores| {
            copy_into_uninit(out, &from[offset..offset + out.len()], stores)
        });
        times.unpack += unpacking.elapsed();
        Ok(hosts
            .into_iter()
            // SAFETY: every byte of every output was copied above.
            .map(|host| unsafe { host.into_buffer() })
            .collect())
    }
}

/// The outputs of a download as buffers, in order: `hosts`, where the direct copies
/// landed, with `staged_hosts[j]` (the staging pipeline's outputs) put in at index
/// `staged[j]`, the places left empty for them.
///
/// # Safety
/// Every output of `hosts` and of `staged_hosts` must have been written in full, and the
/// copies that wrote them completed.
unsafe fn into_buffers(
    mut hosts: Vec<Option<HostOut>>,
    staged: &[usize],
    staged_hosts: Vec<HostOut>,
) -> Vec<Buffer> {
    for (&i, host) in staged.iter().zip(staged_hosts) {
        hosts[i] = Some(host);
    }
    hosts
        .into_iter()
        .map(|host| {
            let host = host.expect("every output is back");
            // SAFETY: the caller's guarantee.
            unsafe { host.into_buffer() }
        })
        .collect()
}

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
    fn pages(len: usize) -> Result<Self> {
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
    fn capacity(&self) -> usize {
        match self {
            Self::Pages(pages, _) => pages.layout.size(),
            _ => self.len(),
        }
    }

    fn len(&self) -> usize {
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
    fn as_uninit(&mut self) -> &mut [MaybeUninit<u8>] {
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
