//! The download side of a [`Transfer`]: device batches packed on the device, copied
//! into host memory (pinned blocks of a pool, registered pages, or pageable memory
//! through the staging buffers) and rebuilt as arrow-rs batches ([`crate::transfer::host`]); the
//! host memory they come back into ([`Transfer::host_pool`],
//! [`Transfer::pinned_host_pool`]).

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use devarrow_abi::device::{check_same_device, DeviceToHost, HostPool};
use devarrow_abi::Result;

use super::host_out::HostOut;
use super::{per_batch, release_registrations, DeviceBatch, Transfer};
use crate::transfer::host::host_batch;
use crate::transfer::pack::{copy_into_uninit, copy_to_uninit, fill_outputs, ramped_windows};
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

    /// [`Transfer::download`] where the device registers host memory for direct DMA
    /// ([`Device::register_host`](devarrow_abi::device::Device::register_host)) from `from`
    /// bytes on: the outputs are allocated first, those of at least `from` bytes registered
    /// and copied into directly, all in one
    /// [`Device::copy_batch_to_host`](devarrow_abi::device::Device::copy_batch_to_host),
    /// and the other sources downloaded through staging meanwhile; the registrations are
    /// dropped once the direct copies have completed.
    fn download_registering(
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
    fn pinned_pool(&mut self) -> Result<Option<Arc<HostPool>>> {
        Ok(self
            .landing
            .pool_or_make(&self.device, self.options.pinned_host_bytes))
    }

    /// [`Transfer::download`] into pinned memory of `pool`: each source is copied straight
    /// into a block of its own (one batched call for all), which becomes the batch's
    /// memory, with no staging copy and no page faults. Sources the pool has no room for
    /// (or all of them, when the device refuses to pin memory) go through the staging
    /// pipeline into pageable memory instead, and [`Transfer::host_memory_note`] says why.
    fn download_pinned(
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
    fn staged_download(
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
    fn download_direct(
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
