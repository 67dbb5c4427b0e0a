//! Pageable host memory page-locked for direct DMA (`cuMemHostRegister`), for as long as
//! the copies that use it run: [`HostRegistration`], what
//! [`CudaDevice::register_host`](devarrow_abi::device::Device::register_host) returns
//! when [`CudaDeviceOptions::register_pageable`](crate::CudaDeviceOptions) asks for it.
//!
//! The driver locks whole pages. devarrow registers only the pages lying wholly inside
//! the range it is asked for ([`whole_pages`]): a partial page at either end may hold
//! another allocation (a neighbouring buffer of the heap), and locking it would make that
//! allocation's copies direct DMAs which this registration's end would then unlock under
//! them. So two registrations of devarrow share pages only when they lie in one
//! allocation (two transfers of one buffer, or of two slices of it).
//!
//! The driver refuses a range that shares a page with locked memory
//! (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`), so devarrow keeps one process-wide
//! table of the page ranges it registered, each with a count of the registrations that
//! use it:
//! - a range inside one of them takes one more use of it (two transfers of one batch,
//!   on any thread or device, share the pages);
//! - a range that shares pages with one of them, but is not inside it, is not registered
//!   (it is staged as before): a copy must lie inside **one** page-locked range to be a
//!   direct DMA, and devarrow never widens a registration other copies use;
//! - otherwise the whole pages are registered (`CU_MEMHOSTREGISTER_PORTABLE`: every
//!   context may DMA them), and unregistered when the last use drops.
//!
//! Registering and unregistering happen under the table's lock, one at a time in the
//! process (the driver's calls are slow, but a registration is made once per range and
//! transfer).
//!
//! Memory someone else locked is never unregistered here: it is either pinned already
//! ([`CudaDevice::is_pinned`](devarrow_abi::device::Device::is_pinned) answers `true`, and
//! the transfer copies it directly without asking to register it), or the driver answers
//! `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`, and the range is used as it is (staged).
//! `CudaDevice::is_pinned` answers `false` for ranges devarrow registered, so that
//! another transfer takes a use of the registration (and keeps it alive) instead of
//! copying from it unregistered.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{sys, CudaContext};
use devarrow_abi::device::whole_pages;

use crate::context::ContextGuard;
use crate::driver;
use crate::error::Result;

/// One page range devarrow registered.
struct Entry {
    /// The end of the range (exclusive; page-aligned).
    end: usize,
    /// How many live [`HostRegistration`]s use it.
    uses: usize,
    /// The context it was registered in, bound to unregister it.
    context: Arc<CudaContext>,
}

/// The page ranges devarrow registered, by start address. Held while a range is
/// registered or unregistered, so that no range is registered twice.
static REGISTERED: Mutex<BTreeMap<usize, Entry>> = Mutex::new(BTreeMap::new());

fn table() -> MutexGuard<'static, BTreeMap<usize, Entry>> {
    REGISTERED.lock().unwrap_or_else(|e| e.into_inner())
}

/// The whole pages inside `ptr..ptr + len`, if any ([`whole_pages`]).
fn inner_pages(ptr: usize, len: usize) -> Option<(usize, usize)> {
    let pages = whole_pages(ptr as *const u8, len);
    (!pages.is_empty()).then_some((pages.start, pages.end))
}

/// The entry of `table` overlapping `start..end`, if any, and whether it holds the range
/// (`end_of` gives an entry's end).
fn overlapping<V>(
    table: &BTreeMap<usize, V>,
    end_of: impl Fn(&V) -> usize,
    start: usize,
    end: usize,
) -> Option<(usize, bool)> {
    // Entries do not overlap: only the last one starting before `end` can reach `start`.
    let (&at, entry) = table.range(..end).next_back()?;
    let entry_end = end_of(entry);
    (entry_end > start).then_some((at, at <= start && end <= entry_end))
}

fn entry_end(entry: &Entry) -> usize {
    entry.end
}

/// Whether any byte of `ptr..ptr + len` lies in a page range devarrow registered.
pub(crate) fn overlaps_registered(ptr: *const u8, len: usize) -> bool {
    let (start, end) = (ptr as usize, (ptr as usize).saturating_add(len));
    len > 0 && overlapping(&table(), entry_end, start, end).is_some()
}

/// How many page ranges devarrow has registered with `cuMemHostRegister` and not yet
/// unregistered, in the whole process: 0 once every [`HostRegistration`] has dropped.
pub fn live_host_registrations() -> usize {
    table().len()
}

/// What [`register`] did.
pub(crate) enum Registered {
    /// Registered now (`new`: a new page range; else one more use of one).
    Yes(HostRegistration, bool),
    /// Not registered: the range shares pages with a registration of devarrow that does
    /// not hold it, or with page-locked memory of someone else.
    Skipped,
}

/// Registers the whole pages inside `ptr..ptr + len` ([`whole_pages`]) in `context`
/// (which must be current on the calling thread), or takes one more use of devarrow's
/// registration holding them; nothing when the range holds no whole page.
/// Before asking the driver, `locked_elsewhere(first, last)` (the first and the last
/// byte of the pages) says whether someone else has locked memory there: then nothing
/// is registered (the driver would refuse, with an error that compute-sanitizer
/// reports). A driver error (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED` for pages
/// locked elsewhere in between included) is returned as it is, with nothing registered.
///
/// # Safety
/// `ptr..ptr + len` must be host memory of the process that stays allocated until the
/// returned registration drops, and it must drop only after every copy that uses the
/// range has completed.
pub(crate) unsafe fn register(
    context: &Arc<CudaContext>,
    ptr: *const u8,
    len: usize,
    locked_elsewhere: impl FnOnce(usize, usize) -> bool,
) -> Result<Registered> {
    let Some((start, end)) = inner_pages(ptr as usize, len) else {
        return Ok(Registered::Skipped);
    };
    let mut table = table();
    match overlapping(&table, entry_end, start, end) {
        Some((at, true)) => {
            table.get_mut(&at).expect("found above").uses += 1;
            return Ok(Registered::Yes(HostRegistration { start: at }, false));
        }
        Some((_, false)) => return Ok(Registered::Skipped),
        None => {}
    }
    if locked_elsewhere(start, end - 1) {
        return Ok(Registered::Skipped);
    }
    // SAFETY: the pages are the caller's live host memory until the registration drops;
    // the context is current (the caller's guarantee). Held under the table's lock, so
    // no other registration of devarrow races this one.
    unsafe {
        driver::mem_host_register(
            start as *mut c_void,
            end - start,
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    }?;
    table.insert(
        start,
        Entry {
            end,
            uses: 1,
            context: context.clone(),
        },
    );
    Ok(Registered::Yes(HostRegistration { start }, true))
}

/// One use of a page range devarrow registered with `cuMemHostRegister`
/// ([`CudaDeviceOptions::register_pageable`](crate::CudaDeviceOptions::register_pageable)):
/// the range is unregistered when the last use drops. devarrow keeps one process-wide
/// table of the page ranges it registered, each with its count of uses: a range inside
/// one of them takes one more use of it, a range sharing pages with one without lying
/// inside it is not registered (it is staged), and memory someone else locked is never
/// registered nor unregistered ([`live_host_registrations`] counts the ranges).
///
/// Dropping it is only sound once the copies that use the range have completed: that is
/// the contract of [`Device::register_host`](devarrow_abi::device::Device::register_host),
/// which made it.
#[derive(Debug)]
pub struct HostRegistration {
    /// The start of the entry in the table.
    start: usize,
}

impl devarrow_abi::device::HostRegistration for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let mut table = table();
        let Some(entry) = table.get_mut(&self.start) else {
            return;
        };
        entry.uses -= 1;
        if entry.uses > 0 {
            return;
        }
        let entry = table.remove(&self.start).expect("present above");
        // An error (the context is gone, destroyed by a reset, which dropped the
        // registration with it) leaves nothing to undo.
        if let Ok(_bound) = ContextGuard::enter(&entry.context) {
            // Under the table's lock, so the pages are not registered anew meanwhile.
            // SAFETY: devarrow registered the range at `start` (the table says so), this
            // was its last use (every use's copies completed: `register`'s contract),
            // and the context it was registered in is bound.
            let _ = unsafe { driver::mem_host_unregister(self.start as *mut c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_cut_to_their_whole_pages() {
        let page = devarrow_abi::device::host_page_size();
        assert_eq!(inner_pages(page + 1, 1), None);
        assert_eq!(inner_pages(page, page), Some((page, 2 * page)));
        assert_eq!(inner_pages(page - 1, 2 * page + 2), Some((page, 3 * page)));
        assert_eq!(inner_pages(page + 1, 3 * page), Some((2 * page, 4 * page)));
        assert_eq!(inner_pages(usize::MAX - 3, 8), None);
    }

    #[test]
    fn overlaps_are_found_by_page() {
        // Page ranges 2..4 and 10..11.
        let page = devarrow_abi::device::host_page_size();
        let table = BTreeMap::from([(2 * page, 4 * page), (10 * page, 11 * page)]);
        let find = |start: usize, end: usize| overlapping(&table, |&e| e, start, end);
        assert_eq!(find(2 * page, 3 * page), Some((2 * page, true)));
        assert_eq!(find(2 * page, 4 * page), Some((2 * page, true)));
        assert_eq!(find(3 * page, 5 * page), Some((2 * page, false)));
        assert_eq!(find(page, 3 * page), Some((2 * page, false)));
        assert_eq!(find(4 * page, 10 * page), None);
        assert_eq!(find(0, 2 * page), None);
        assert_eq!(find(0, 11 * page), Some((10 * page, false)));
    }
}
