//! Where a [`Transfer`](super::Transfer)'s downloads land: blocks of a pool of pinned
//! host memory (made on first use), or pageable memory once the device refused to pin
//! any, with the reason the last downloads fell back ([`PinnedLanding`]).

use std::sync::Arc;

use devarrow_abi::device::{Device, HostPool, PooledMemory};

/// The pinned landing of a transfer's downloads: the pool, whether the device refused to
/// pin memory (downloads then stay pageable until [`PinnedLanding::set_pool`]), and why
/// the last downloads fell back to pageable memory.
#[derive(Debug, Default)]
pub(super) struct PinnedLanding {
    /// The pinned memory downloads land in (made on first use).
    pool: Option<Arc<HostPool>>,
    /// Set once the device refused to pin memory: downloads stay pageable.
    refused: bool,
    /// Why downloads last fell back to pageable memory.
    note: Option<String>,
}

impl PinnedLanding {
    /// Why the last downloads that fell back from pinned to pageable memory did so.
    pub(super) fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// The pool, once made or set.
    pub(super) fn pool(&self) -> Option<&Arc<HostPool>> {
        self.pool.as_ref()
    }

    /// Lands downloads in `pool`, or, with `None`, in a pool made on first use; tries
    /// pinning again if the device refused it before.
    pub(super) fn set_pool(&mut self, pool: Option<Arc<HostPool>>) {
        self.pool = pool;
        self.refused = false;
    }

    /// Records that `bytes` of pinned memory could not be reserved for the pool
    /// ([`Transfer::prepare`](super::Transfer::prepare)): downloads that find no room in
    /// what the device holds land in pageable memory.
    pub(super) fn unreserved(&mut self, bytes: usize, error: &devarrow_abi::Error) {
        self.note = Some(format!(
            "{bytes} bytes of pinned memory for the download pool could not be reserved \
             ({error}): downloads beyond the device's reserve land in pageable memory"
        ));
    }

    /// Whether the device refused to pin memory (downloads stay pageable).
    pub(super) fn refused(&self) -> bool {
        self.refused
    }

    /// The pool, made on first use as a pinned pool of `bytes` on `device`; `None` where
    /// there is none: `bytes` is 0, the device's memory is host memory
    /// ([`Device::host_accessible`]), or pinning was refused.
    pub(super) fn pool_or_make(
        &mut self,
        device: &Arc<dyn Device>,
        bytes: usize,
    ) -> Option<Arc<HostPool>> {
        if self.pool.is_none() && !self.refused && bytes > 0 && !device.host_accessible() {
            self.pool = Some(Arc::new(HostPool::pinned(device.clone(), bytes)));
        }
        self.pool.clone()
    }

    /// A block of `len` bytes of `pool` for one download, or `None` where it lands in
    /// pageable memory: the pool is full (the note says so) or the device refuses to pin
    /// memory (now or before: from a refusal on, the pool is dropped and every download
    /// is pageable, and the note says why).
    pub(super) fn block(&mut self, pool: &Arc<HostPool>, len: usize) -> Option<PooledMemory> {
        if self.refused {
            return None;
        }
        match pool.try_allocate(len) {
            Ok(Some(block)) => Some(block),
            Ok(None) => {
                let stats = pool.stats();
                self.note = Some(
                    if stats.in_use_bytes + devarrow_abi::device::pool::size_class(len)
                        > pool.limit()
                    {
                        format!(
                            "the pinned host memory pool ({} bytes, TransferOptions::\
                             pinned_host_bytes) was full ({} bytes held by batches not yet \
                             dropped): downloads beyond it land in pageable memory",
                            pool.limit(),
                            stats.in_use_bytes
                        )
                    } else {
                        format!(
                            "the device's pinned memory had no room for a block of {len} \
                             bytes of the pool ({} bytes, {} held by batches not yet \
                             dropped; Transfer::prepare reserves room for it): downloads \
                             beyond it land in pageable memory",
                            pool.limit(),
                            stats.in_use_bytes
                        )
                    },
                );
                None
            }
            Err(e) => {
                // Pinning refused (a sandbox, a lock limit): pageable from now on.
                self.refused = true;
                self.pool = None;
                self.note = Some(format!(
                    "pinned host memory refused ({e}): downloads land in pageable memory"
                ));
                None
            }
        }
    }
}
