//! The host's own ceilings for the bytes of a measurement ([`HostCeilings`]): parallel
//! copies into pinned and faulted-in memory and a gather of the batches' buffers, each
//! with a plain `memcpy` and with streaming stores.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use devarrow::abi::device::copy::{copy_bytes, Stores};
use devarrow::abi::device::Device;

use super::{best, gbps};

/// What the host itself does with the same bytes, in the same run: the ceilings of the
/// host side of a transfer, so that a host-side stall shows as a ratio beside them
/// (a link model hides it).
///
/// - `pinned`: a parallel copy (on every core: the machine's best, whatever devarrow
///   packs with) from ordinary memory into pinned staging memory: what packing an upload
///   can reach;
/// - `faulted`: the same into ordinary memory already faulted in: what the host side of a
///   download into pageable memory can reach;
/// - `gather`: a parallel copy of the batches' own arrow-rs buffers, in order, split by
///   bytes over the same threads, into pinned memory: what packing can reach from the
///   memory the batches lie in (their buffers are many and scattered, where `pinned`
///   reads one contiguous range), so that the two ratios tell devarrow's own cost from
///   its source's.
///
/// Each is measured two ways: a plain `memcpy` (cached stores) and streaming
/// (non-temporal) stores (`devarrow::abi::device::copy`, what devarrow packs and unpacks
/// with), and is the better of the two ([`Ceiling::best`]). A ceiling is the best the host
/// can do: devarrow at more than 1.0x of one points to a wrong ceiling, not a fast
/// devarrow (a memcpy alone was such a ceiling: devarrow's streaming stores reached
/// 1.6-1.7x of it on a 2-core machine).
///
/// At most [`CEILING_BYTES`] are copied (the rate does not depend on more). The copies
/// take turns within each repetition (memcpy and streaming in alternating order), so that
/// a machine whose speed drifts (a shared VM) drifts for all of them alike.
#[derive(Debug, Clone, PartialEq)]
pub struct HostCeilings {
    /// Threads of each copy.
    pub threads: usize,
    /// Bytes of each copy into pinned and into faulted memory.
    pub bytes: usize,
    /// Into pinned memory.
    pub pinned: Ceiling,
    /// Into pre-faulted memory.
    pub faulted: Ceiling,
    /// The batches' buffers gathered into pinned memory (`bytes` 0: not measured).
    pub gather: Ceiling,
}

/// How a ceiling's copy writes its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyStores {
    /// A plain `memcpy` (`copy_from_slice`): cached stores, or whatever glibc chooses.
    Memcpy,
    /// Streaming (non-temporal) stores, as devarrow packs and unpacks.
    Streaming,
}

impl CopyStores {
    /// The name in JSON and in the report.
    pub fn key(self) -> &'static str {
        match self {
            Self::Memcpy => "memcpy",
            Self::Streaming => "streaming",
        }
    }
}

/// One host ceiling, measured with a plain memcpy and with streaming stores in the same
/// repetitions.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Ceiling {
    /// Bytes of each copy (0: not measured).
    pub bytes: usize,
    /// Every timed repetition with a plain memcpy.
    pub memcpy: Vec<Duration>,
    /// Every timed repetition with streaming stores.
    pub streaming: Vec<Duration>,
}

impl Ceiling {
    /// The plain memcpy's GB/s (best repetition); `None` when not measured.
    pub fn memcpy_gbps(&self) -> Option<f64> {
        rate(self.bytes, &self.memcpy)
    }

    /// The streaming stores' GB/s (best repetition); `None` when not measured.
    pub fn streaming_gbps(&self) -> Option<f64> {
        rate(self.bytes, &self.streaming)
    }

    /// The ceiling: the better of the two ways, and which it was; `None` when neither was
    /// measured.
    pub fn best(&self) -> Option<(f64, CopyStores)> {
        better(self.memcpy_gbps(), self.streaming_gbps())
    }

    /// The ceiling in GB/s (0 when not measured).
    pub fn gbps(&self) -> f64 {
        self.best().map_or(0.0, |(g, _)| g)
    }
}

/// `bytes` over the best of `times` in GB/s; `None` for no bytes, no times or a zero time.
fn rate(bytes: usize, times: &[Duration]) -> Option<f64> {
    (bytes > 0 && !times.is_empty())
        .then(|| gbps(bytes, best(times)))
        .filter(|g| *g > 0.0)
}

/// The better of a memcpy's and streaming stores' GB/s (a tie goes to the memcpy), and
/// which it was; `None` when neither was measured.
pub fn better(memcpy: Option<f64>, streaming: Option<f64>) -> Option<(f64, CopyStores)> {
    match (memcpy, streaming) {
        (Some(m), Some(s)) if s > m => Some((s, CopyStores::Streaming)),
        (Some(m), _) => Some((m, CopyStores::Memcpy)),
        (None, Some(s)) => Some((s, CopyStores::Streaming)),
        (None, None) => None,
    }
}

/// The most bytes a ceiling copies: 1 GiB.
pub const CEILING_BYTES: usize = 1 << 30;

impl HostCeilings {
    /// The ceiling into pinned memory, GB/s (the better way, best repetition).
    pub fn pinned_gbps(&self) -> f64 {
        self.pinned.gbps()
    }

    /// The ceiling into pre-faulted memory, GB/s (the better way, best repetition).
    pub fn faulted_gbps(&self) -> f64 {
        self.faulted.gbps()
    }

    /// The gather of the batches' buffers into pinned memory, GB/s (the better way, best
    /// repetition); `None` when not measured.
    pub fn gather_gbps(&self) -> Option<f64> {
        self.gather.best().map(|(g, _)| g)
    }

    /// Measures all three, each with a memcpy and with streaming stores, on `device` (its
    /// staging memory) for `bytes` bytes (at most [`CEILING_BYTES`]), the gather from the
    /// buffers of `batches` (none: not measured), `reps` timed repetitions after one
    /// warm-up each.
    pub fn measure(
        device: &Arc<dyn Device>,
        bytes: usize,
        batches: &[RecordBatch],
        reps: usize,
    ) -> devarrow::abi::Result<Self> {
        // Every core: a ceiling is the best the host can do, not what devarrow's defaults
        // do (8 threads were 0.73x of 16 into pinned memory on a 16-core H200 machine).
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let bytes = bytes.clamp(1, CEILING_BYTES);
        // The source: ordinary memory, written (faulted in) before anything is timed.
        let source = vec![0x5au8; bytes];
        device.reserve_staging(bytes)?; // else, beyond CUDA's reserve, pageable memory
        let mut pinned = device.allocate_staging(bytes)?;
        let mut faulted = vec![0u8; bytes];
        faulted.fill(1);
        // The batches' buffers, as many as fit in `bytes`.
        let mut buffers = Vec::new();
        for batch in batches {
            for column in batch.columns() {
                crate::footprint::for_each_buffer(&column.to_data(), &mut |b| {
                    buffers.push(b.clone())
                });
            }
        }
        let mut gather_bytes = 0;
        let sources: Vec<&[u8]> = buffers
            .iter()
            .map(arrow_buffer::Buffer::as_slice)
            .take_while(|b| {
                gather_bytes += b.len();
                gather_bytes <= bytes
            })
            .collect();
        let gather_bytes: usize = sources.iter().map(|b| b.len()).sum();
        let mut ceilings = Self {
            threads,
            bytes,
            pinned: Ceiling {
                bytes,
                ..Ceiling::default()
            },
            faulted: Ceiling {
                bytes,
                ..Ceiling::default()
            },
            gather: Ceiling {
                bytes: gather_bytes,
                ..Ceiling::default()
            },
        };
        let timed = |f: &mut dyn FnMut()| {
            let start = Instant::now();
            f();
            start.elapsed()
        };
        for rep in 0..=reps {
            // Alternate which way goes first, so that neither always finds the caches as
            // the other left them.
            let order = if rep % 2 == 0 {
                [CopyStores::Memcpy, CopyStores::Streaming]
            } else {
                [CopyStores::Streaming, CopyStores::Memcpy]
            };
            for stores in order {
                let p = timed(&mut || {
                    parallel_copy(
                        &mut pinned.as_mut_slice()[..bytes],
                        &source,
                        threads,
                        stores,
                    )
                });
                let f = timed(&mut || parallel_copy(&mut faulted, &source, threads, stores));
                let g = timed(&mut || {
                    parallel_gather(
                        &mut pinned.as_mut_slice()[..gather_bytes],
                        &sources,
                        threads,
                        stores,
                    )
                });
                if rep == 0 {
                    continue;
                }
                for (ceiling, time) in [
                    (&mut ceilings.pinned, p),
                    (&mut ceilings.faulted, f),
                    (&mut ceilings.gather, g),
                ] {
                    if ceiling.bytes == 0 {
                        continue;
                    }
                    match stores {
                        CopyStores::Memcpy => ceiling.memcpy.push(time),
                        CopyStores::Streaming => ceiling.streaming.push(time),
                    }
                }
            }
        }
        Ok(ceilings)
    }
}

/// Copies `src` into `dst` (same length) with `stores`.
fn copy_with(dst: &mut [u8], src: &[u8], stores: CopyStores) {
    match stores {
        CopyStores::Memcpy => dst.copy_from_slice(src),
        CopyStores::Streaming => {
            assert_eq!(
                dst.len(),
                src.len(),
                "copy between ranges of different lengths"
            );
            // SAFETY: `dst` is valid for `src.len()` writes (same length, exclusively
            // borrowed), `src` for as many reads; a `&mut` and a `&` cannot overlap.
            unsafe { copy_bytes(dst.as_mut_ptr(), src.as_ptr(), src.len(), Stores::Streaming) }
        }
    }
}

/// Copies `sources`, one after the other, into `dst` (their total length) on `threads`
/// scoped threads, each an equal byte range of `dst` (a source may be split between two),
/// with `stores`.
fn parallel_gather(dst: &mut [u8], sources: &[&[u8]], threads: usize, stores: CopyStores) {
    let part = dst.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let mut sources = sources.iter().copied();
        let mut pending: &[u8] = &[];
        for chunk in dst.chunks_mut(part) {
            // The sources (and parts of them) that fill `chunk`.
            let mut pieces = Vec::new();
            let mut room = chunk.len();
            while room > 0 {
                if pending.is_empty() {
                    match sources.next() {
                        Some(next) => pending = next,
                        None => break,
                    }
                }
                let (piece, rest) = pending.split_at(pending.len().min(room));
                pieces.push(piece);
                room -= piece.len();
                pending = rest;
            }
            scope.spawn(move || {
                let mut at = 0;
                for piece in pieces {
                    copy_with(&mut chunk[at..at + piece.len()], piece, stores);
                    at += piece.len();
                }
            });
        }
    });
}

/// This machine's parallel copy rate into (the CPU device's) pinned memory, bytes per
/// second: 256 MiB on every core, the better of a memcpy and
/// streaming stores, best of 3 after a warm-up.
pub fn host_memcpy_rate() -> f64 {
    let device: Arc<dyn Device> = Arc::new(devarrow::abi::device::CpuDevice::new());
    match HostCeilings::measure(&device, 256 << 20, &[], 3) {
        Ok(c) => c.pinned_gbps() * 1e9,
        // The CPU device's staging is plain host memory: it fails only out of memory.
        Err(_) => 4e9,
    }
}

/// `src` copied into `dst` (same length) with `stores` on `threads` scoped threads, each
/// an equal part.
fn parallel_copy(dst: &mut [u8], src: &[u8], threads: usize, stores: CopyStores) {
    let part = src.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || copy_with(d, s, stores));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use devarrow::abi::device::CpuDevice;

    #[test]
    fn a_ceiling_is_the_better_of_memcpy_and_streaming_stores() {
        use CopyStores::{Memcpy, Streaming};
        assert_eq!(better(Some(10.0), Some(16.5)), Some((16.5, Streaming)));
        assert_eq!(better(Some(16.5), Some(10.0)), Some((16.5, Memcpy)));
        // a tie goes to the plain memcpy
        assert_eq!(better(Some(12.0), Some(12.0)), Some((12.0, Memcpy)));
        assert_eq!(better(None, Some(3.0)), Some((3.0, Streaming)));
        assert_eq!(better(Some(3.0), None), Some((3.0, Memcpy)));
        assert_eq!(better(None, None), None);

        // best repetition of each way, then the better way: 1 GB in 100 ms (memcpy) against
        // 1 GB in 60 ms (streaming, its best of two)
        let ms = Duration::from_millis;
        let c = Ceiling {
            bytes: 1_000_000_000,
            memcpy: vec![ms(120), ms(100)],
            streaming: vec![ms(90), ms(60)],
        };
        assert_eq!(c.memcpy_gbps(), Some(10.0));
        assert!((c.streaming_gbps().unwrap() - 16.666).abs() < 0.01);
        assert_eq!(c.best().map(|(_, s)| s), Some(Streaming));
        assert_eq!(c.gbps(), c.streaming_gbps().unwrap());
        // not measured: no ceiling, and 0 GB/s where a figure is needed
        let none = Ceiling::default();
        assert_eq!((none.best(), none.gbps()), (None, 0.0));
        let untimed = Ceiling {
            bytes: 1000,
            memcpy: vec![Duration::ZERO],
            streaming: vec![],
        };
        assert_eq!(untimed.best(), None);
    }

    #[test]
    fn the_host_ceilings_measure_both_ways_and_keep_the_better() {
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
        let batches = crate::tpch::lineitem(0.001, 2000);
        let c = HostCeilings::measure(&device, 4 << 20, &batches, 2).unwrap();
        assert_eq!(c.bytes, 4 << 20);
        for ceiling in [&c.pinned, &c.faulted, &c.gather] {
            assert!(ceiling.bytes > 0);
            assert_eq!((ceiling.memcpy.len(), ceiling.streaming.len()), (2, 2));
            let (m, s) = (
                ceiling.memcpy_gbps().unwrap(),
                ceiling.streaming_gbps().unwrap(),
            );
            assert_eq!(ceiling.gbps(), m.max(s), "{ceiling:?}");
        }
        assert_eq!(c.pinned_gbps(), c.pinned.gbps());
        assert_eq!(c.gather_gbps(), Some(c.gather.gbps()));
        // no batches: no gather, and nothing timed for it
        let c = HostCeilings::measure(&device, 1 << 20, &[], 1).unwrap();
        assert_eq!((c.gather.bytes, c.gather_gbps()), (0, None));
        assert!(c.gather.memcpy.is_empty() && c.gather.streaming.is_empty());
    }
}
