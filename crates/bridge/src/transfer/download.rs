//! The copies of a download from device memory the host does not read directly
//! ([`Transfer::download`]): one path, parameterised by where the bytes land
//! ([`Destination`]): blocks of the pinned pool or registered whole pages, copied into
//! directly (one batched copy for all), and pageable memory through the staging pipeline
//! ([`Transfer::staged_download`]) for the rest. The outputs of the direct copies are owned
//! by an [`InFlight`] guard until those copies have completed.

use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::Instant;

use arrow_buffer::Buffer;
use devarrow_abi::device::{DeviceToHost, HostPool, HostRegistration};
use devarrow_abi::Result;

use super::host_out::HostOut;
use super::in_flight::InFlight;
use super::Transfer;
use crate::transfer::pack::{copy_to_uninit, ramped_windows};
use crate::transfer::stages::StageTimes;

/// A range of device memory to download: its address and length.
pub(super) type Source = (*const std::ffi::c_void, usize);

/// Where the bytes of a download land.
#[derive(Debug)]
enum Destination {
    /// Blocks of this pool of pinned memory, copied into directly. Sources the pool has
    /// no room for (or all of them, once the device refuses to pin memory) are staged
    /// into pageable memory instead, and [`Transfer::host_memory_note`] says why.
    Pinned(Arc<HostPool>),
    /// Pageable memory; outputs of at least `from` bytes are whole pages of their own,
    /// registered for direct DMA
    /// ([`Device::register_host`](devarrow_abi::device::Device::register_host)) and
    /// copied into directly. The others, and those the device does not register, are
    /// staged.
    Registered { from: usize },
    /// Pageable memory, every source staged.
    Staged,
}

/// Where one source lands.
enum Placed {
    /// Copied straight into `host`, which `registration` (if any) lets the device reach
    /// (declared first: dropped before the memory it registers).
    Direct {
        registration: Option<Box<dyn HostRegistration>>,
        host: HostOut,
    },
    /// Staged into this output, or, with `None`, into one of the transfer's host pool
    /// allocated once the first staging copies are enqueued.
    Staged(Option<HostOut>),
}

/// What the direct copies of a download use: the registrations that let the device reach
/// pageable outputs (declared first: dropped before the memory they register), and the
/// outputs, with the index of their source.
#[derive(Default)]
struct Direct {
    registrations: Vec<Box<dyn HostRegistration>>,
    outputs: Vec<(usize, HostOut)>,
}

impl Transfer {
    /// Copies each `(src, len)` range of device memory into new host memory, in order:
    /// straight into its output where the [`Destination`] lets the device copy there
    /// directly (all such copies in one
    /// [`Device::copy_batch_to_host`](devarrow_abi::device::Device::copy_batch_to_host)),
    /// through the staging pipeline ([`Transfer::staged_download`]) meanwhile for the
    /// others. Registrations are dropped, and the outputs handed out, once the direct
    /// copies have completed; where they cannot be waited for, both are leaked (see
    /// [`InFlight`]).
    pub(super) fn download(
        &mut self,
        sources: &[Source],
        times: &mut StageTimes,
    ) -> Result<Vec<Buffer>> {
        let destination = self.destination(sources)?;
        let start = Instant::now();
        let device = self.device.clone();
        let mut direct = InFlight::new(device.as_ref(), Direct::default());
        let mut copies = Vec::new();
        let mut staged = Vec::new();
        let mut staged_outputs = Vec::new();
        for (i, &(src, len)) in sources.iter().enumerate() {
            match self.place(&destination, len)? {
                Placed::Direct {
                    registration,
                    mut host,
                } => {
                    if len > 0 {
                        let dst = host.as_uninit().as_mut_ptr().cast::<u8>();
                        copies.push(DeviceToHost { src, dst, len });
                    }
                    let direct = direct.held_mut();
                    direct.registrations.extend(registration);
                    direct.outputs.push((i, host));
                }
                Placed::Staged(host) => {
                    staged.push(i);
                    staged_outputs.push(host);
                }
            }
        }
        let enqueued = Instant::now();
        times.allocate += enqueued - start;
        let direct_done = if copies.is_empty() {
            None
        } else {
            direct.enqueued();
            // Every destination is an output of its copy's length (a block of the pinned
            // pool, or registered pages), owned by `direct` until the copies have
            // completed, and not read (nor otherwise written) until the event recorded
            // next has; the sources lie in the downloads' device memory.
            // SAFETY: so every range stays valid for its copy until that copy is done.
            let copied = unsafe { device.copy_batch_to_host(&copies) };
            match copied.and_then(|()| device.record_event()) {
                Ok(event) => Some(event),
                Err(e) => {
                    // Whatever was enqueued completes before the outputs are freed (or
                    // they are leaked); the error is the copy's.
                    let _ = direct.settle(None);
                    return Err(e);
                }
            }
        };
        times.copy += enqueued.elapsed();
        let downloaded = if staged.is_empty() {
            Ok(Vec::new())
        } else {
            let staged_sources: Vec<_> = staged.iter().map(|&i| sources[i]).collect();
            let host_pool = self.host_pool.clone();
            self.staged_download(&staged_sources, times, move |sources| {
                sources
                    .iter()
                    .zip(staged_outputs)
                    .map(|(&(_, len), host)| match host {
                        Some(host) => Ok(host),
                        None => HostOut::new(len, host_pool.as_ref()),
                    })
                    .collect()
            })
        };
        let waiting = Instant::now();
        let landed = direct.settle(direct_done.as_ref());
        times.copy += waiting.elapsed();
        let staged_hosts = downloaded?;
        let Direct {
            registrations,
            outputs,
        } = landed?;
        drop(registrations);
        let mut hosts: Vec<Option<HostOut>> = sources.iter().map(|_| None).collect();
        for (i, host) in outputs
            .into_iter()
            .chain(staged.into_iter().zip(staged_hosts))
        {
            hosts[i] = Some(host);
        }
        Ok(hosts
            .into_iter()
            .map(|host| {
                let host = host.expect("every output is back");
                // SAFETY: a direct output was written in full by its copy, which has
                // completed (settled above); a staged one by `staged_download`.
                unsafe { host.into_buffer() }
            })
            .collect())
    }

    /// Where the bytes of a download of `sources` land: the pinned pool, where there is
    /// one ([`Transfer::pinned_pool`]); registered pages, where the device registers host
    /// memory and a source is large enough; pageable memory through staging otherwise
    /// (counted as fallen back where pinning was refused).
    fn destination(&mut self, sources: &[Source]) -> Result<Destination> {
        if let Some(pool) = self.pinned_pool()? {
            return Ok(Destination::Pinned(pool));
        }
        if self.landing.refused() {
            // Pinning was refused earlier: these fall back too (the note says why).
            self.stats.pageable_downloads += sources.len() as u64;
        }
        if let Some(from) = self.register_from() {
            if sources.iter().any(|&(_, len)| len >= from) {
                return Ok(Destination::Registered { from });
            }
        }
        Ok(Destination::Staged)
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

    /// Where a source of `len` bytes lands in `destination`: a block of the pinned pool
    /// (counted as a pinned download), or staged where the pool has none (counted as
    /// fallen back); whole pages of its own, registered whole (a registration never
    /// reaches into a neighbouring allocation's pages), or staged into them where the
    /// device does not register them; staged into memory allocated later otherwise.
    fn place(&mut self, destination: &Destination, len: usize) -> Result<Placed> {
        Ok(match *destination {
            Destination::Pinned(ref pool) => match self.landing.block(pool, len) {
                Some(block) => {
                    self.stats.pinned_downloads += 1;
                    Placed::Direct {
                        registration: None,
                        host: HostOut::Pooled(block),
                    }
                }
                None => {
                    self.stats.pageable_downloads += 1;
                    Placed::Staged(None)
                }
            },
            Destination::Registered { from } if len >= from => {
                let mut host = HostOut::pages(len)?;
                let pages = host.capacity();
                let dst = host.as_uninit().as_mut_ptr().cast::<u8>();
                // Both the output (`pages` bytes) and its registration go to the
                // download's `InFlight` guard, which drops the registration first, and
                // only once the copies enqueued on the output have completed (or never).
                // SAFETY: so the memory outlives the registration, dropped after the copies.
                match unsafe { self.device.register_host(dst, pages) }? {
                    Some(registration) => Placed::Direct {
                        registration: Some(registration),
                        host,
                    },
                    None => Placed::Staged(Some(host)),
                }
            }
            Destination::Registered { .. } | Destination::Staged => Placed::Staged(None),
        })
    }

    /// The staging pipeline of [`Transfer::download`]: copies each source into the
    /// output `outputs` gives for it (one per source, of its length), which is asked for
    /// once the first copies are enqueued (so that allocating the outputs overlaps them),
    /// and returns the outputs, every byte written.
    ///
    /// All sources go in one pipeline: up to one copy per staging buffer in flight, each
    /// chunk unpacked (in parallel) as soon as its copy completes and its slot refilled at
    /// once, so the copies of source k + 1 run while source k is unpacked. Only the first
    /// and the last chunk of the whole call are ramped (see
    /// [`windows`](crate::transfer::pack::windows)). The outputs are not zero-filled
    /// first: every byte is written by the unpacking.
    fn staged_download(
        &mut self,
        sources: &[Source],
        times: &mut StageTimes,
        outputs: impl FnOnce(&[Source]) -> Result<Vec<HostOut>>,
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
}
