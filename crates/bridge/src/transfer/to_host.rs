//! The download side of a [`Transfer`]: device batches packed on the device, copied
//! into host memory (pinned blocks of a pool, registered pages, or pageable memory
//! through the staging buffers) and rebuilt as arrow-rs batches ([`crate::transfer::host`]); the
//! host memory they come back into ([`Transfer::host_pool`],
//! [`Transfer::pinned_host_pool`]).

use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use devarrow_abi::device::{check_same_device, HostPool};
use devarrow_abi::Result;

use super::downloads::HostOut;
use super::{per_batch, DeviceBatch, Transfer};
use crate::transfer::host::host_batch;
use crate::transfer::stages::StageTimes;

impl Transfer {
    /// Why the last downloads that fell back from pinned to pageable memory did so (the
    /// pool was full, or the device refused to pin memory); `None` if none did.
    pub fn host_memory_note(&self) -> Option<&str> {
        self.landing.note()
    }

    /// The pool of pinned host memory downloads land in, once made (see
    /// [`TransferOptions::pinned_host_bytes`](super::TransferOptions::pinned_host_bytes)).
    pub fn pinned_host_pool(&self) -> Option<&Arc<HostPool>> {
        self.landing.pool()
    }

    /// Lands downloads in `pool` (e.g. one shared by several transfers; a pool made by
    /// [`HostPool::pinned`] for this transfer's device), or, with `None`, in the pool
    /// this transfer makes on first use. Batches already downloaded keep their memory.
    pub fn set_pinned_host_pool(&mut self, pool: Option<Arc<HostPool>>) {
        self.landing.set_pool(pool);
    }

    /// The pool the host memory of downloads comes from (`None`: fresh allocations).
    pub fn host_pool(&self) -> Option<&Arc<HostPool>> {
        self.host_pool.as_ref()
    }

    /// Takes the host memory of downloads from `pool` (e.g. one shared by several
    /// transfers), or, with `None`, from fresh allocations. Batches already downloaded
    /// keep their memory, which goes back to the pool it came from when they drop.
    ///
    /// ```
    /// use std::sync::Arc;
    ///
    /// use devarrow_abi::device::{CpuDevice, HostPool};
    /// use devarrow_bridge::{Transfer, TransferOptions};
    ///
    /// let device = Arc::new(CpuDevice::new());
    /// let shared = Arc::new(HostPool::new(256 << 20));
    /// let mut a = Transfer::new(device.clone(), TransferOptions::default());
    /// let mut b = Transfer::new(device, TransferOptions::default());
    /// a.set_host_pool(Some(shared.clone()));
    /// b.set_host_pool(Some(shared.clone()));
    /// assert!(Arc::ptr_eq(a.host_pool().unwrap(), b.host_pool().unwrap()));
    /// a.set_host_pool(None); // fresh allocations from now on
    /// assert!(a.host_pool().is_none());
    /// ```
    pub fn set_host_pool(&mut self, pool: Option<Arc<HostPool>>) {
        self.host_pool = pool;
    }

    /// Moves a device-resident batch back to host memory (ordinary arrow-rs buffers).
    ///
    /// An imported batch is first packed on the device (one batched copy of the bytes its
    /// arrays address into one allocation), then moved like a packed one.
    ///
    /// The batch must live on this transfer's device (same device type and id):
    /// otherwise [`Error::UnsupportedDevice`](devarrow_abi::Error::UnsupportedDevice)
    /// (another type) or [`Error::DeviceMismatch`](devarrow_abi::Error::DeviceMismatch)
    /// (another id), as this device cannot copy another one's memory.
    pub fn to_host(&mut self, batch: &DeviceBatch) -> Result<RecordBatch> {
        let mut batches = self.to_host_batches(std::slice::from_ref(batch))?;
        Ok(batches.pop().expect("one batch in, one out"))
    }

    /// Moves several device-resident batches back to host memory, in one pipeline: the
    /// copies of batch k + 1 run while batch k is unpacked, so the copy engine does not
    /// idle between batches as it does between calls of [`Transfer::to_host`] (which has
    /// to wait for a batch's first chunk, and leaves its last unpack overlapping
    /// nothing). Prefer it for many batches of a few MB.
    ///
    /// The result is in the order of `batches`. Every batch must live on this transfer's
    /// device, as for [`Transfer::to_host`]. On an error, no batch is returned: the error
    /// is that of a failing batch (many are rebuilt in parallel, so not always the
    /// first).
    pub fn to_host_batches(&mut self, batches: &[DeviceBatch]) -> Result<Vec<RecordBatch>> {
        let mut times = StageTimes {
            batches: batches.len() as u64,
            ..Default::default()
        };
        let result = self.download_batches(batches, &mut times);
        self.stats.to_host += times;
        result
    }

    fn download_batches(
        &mut self,
        batches: &[DeviceBatch],
        times: &mut StageTimes,
    ) -> Result<Vec<RecordBatch>> {
        let start = Instant::now();
        for batch in batches {
            check_same_device(batch.device.as_ref(), self.device.as_ref())?;
        }
        let downloads = batches
            .iter()
            .map(|batch| batch.download(&self.device))
            .collect::<Result<Vec<_>>>()?;
        for download in &downloads {
            // SAFETY: the pointer comes from the download's own live event.
            unsafe {
                self.device
                    .wait_sync_event(download.event.as_sync_event_ptr())?
            };
        }
        let sources: Vec<_> = downloads
            .iter()
            .map(|d| (d.memory.address().cast_const(), d.memory.len()))
            .collect();
        times.bytes = sources.iter().map(|&(_, len)| len as u64).sum();
        times.plan += start.elapsed();
        let downloaded = if self.device.host_accessible() {
            self.download_direct(&sources, times)
        } else {
            self.download(&sources, times)
        };
        let hosts = self.settle(downloaded)?;
        let start = Instant::now();
        // Many small batches are rebuilt on the pool's threads (one takes a few µs: 587
        // batches of 1,024 `lineitem` rows took 2.6 ms alone).
        let batches = per_batch(downloads.len(), |i| {
            let download = &downloads[i];
            host_batch(
                download.schema.clone(),
                download.num_rows,
                &download.root,
                &hosts[i],
                download.trusted,
            )
        });
        times.validate += start.elapsed();
        batches
    }

    /// Copies each `(src, len)` range of device memory to a new host buffer through the
    /// staging chunks, all ranges in one pipeline: up to one copy per staging buffer in
    /// flight, each chunk unpacked (in parallel) as soon as its copy completes and its slot
    /// refilled at once, so the copies of range k + 1 run while range k is unpacked. Only
    /// the first and the last chunk of the whole call are ramped (see
    /// [`windows`](crate::transfer::pack::windows)). The host buffers are not zero-filled first:
    /// every byte is written by the unpacking.
    fn download(
        &mut self,
        sources: &[(*const std::ffi::c_void, usize)],
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        if let Some(pool) = self.pinned_pool()? {
            return self.download_pinned(sources, &pool, times);
        }
        if self.landing.refused() {
            // Pinning was refused earlier: these fall back too (the note says why).
            self.stats.pageable_downloads += sources.len() as u64;
        }
        if let Some(from) = self.register_from() {
            if sources.iter().any(|&(_, len)| len >= from) {
                return self.download_registering(sources, from, times);
            }
        }
        let pool = self.host_pool.clone();
        let hosts = self.staged_download(sources, times, |sources| {
            sources
                .iter()
                .map(|&(_, len)| HostOut::new(len, pool.as_ref()))
                .collect()
        })?;
        Ok(hosts
            .into_iter()
            // SAFETY: `staged_download` wrote every byte of every output.
            .map(|host| unsafe { host.into_buffer() })
            .collect())
    }
}
