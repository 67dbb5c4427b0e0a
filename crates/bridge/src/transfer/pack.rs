//! Packing buffers into a staging window, and unpacking a window, on several threads.
//!
//! One thread copies about 5-10 GiB/s; a PCIe 5 x16 link moves about 50 GB/s each way.
//! So a window is split into equal byte ranges that threads of the rayon pool copy in
//! parallel, each range packing the parts of the segments it overlaps (found by binary
//! search: segments are in image order). A window below [`Parallelism::min_bytes`] (or a
//! part below [`MIN_PART_BYTES`]) is copied by the calling thread alone, as handing work
//! to other threads costs a few microseconds.

use std::mem::MaybeUninit;

use arrow_buffer::Buffer;
use rayon::prelude::*;

use crate::copy::{copy_bytes, Stores};

/// The smallest byte range one thread is given when a copy is split.
pub const MIN_PART_BYTES: usize = 256 << 10;

/// The most threads a copy is split over by default (never more than the rayon pool's
/// threads). Host memory bandwidth is shared, but 8 threads do not reach a PCIe 5 link:
/// on the H200 machine of 2026-11-29 (16 cores, `eb27dd8`'s transfer bench,
/// `threads/*`), streaming stores into pinned memory moved 38.1 GiB/s on 8 threads and
/// 51.9 GiB/s on 16, beside a link of 55 GB/s each way; devarrow's uploads, packed on 8,
/// stopped at 0.78x of PyTorch's pinned copy.
pub const DEFAULT_MAX_THREADS: usize = 16;

/// Default size from which a pack or unpack is split over several threads: 1 MiB (see
/// [`TransferOptions::parallel_min_bytes`](crate::TransferOptions::parallel_min_bytes)).
/// A download rebuilds the columns of an image at least this large on several threads.
pub const DEFAULT_PARALLEL_MIN_BYTES: usize = 1 << 20;

/// How many threads a copy may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    /// The most threads one copy is split over (1: single-threaded).
    pub threads: usize,
    /// Copies smaller than this stay on the calling thread.
    pub min_bytes: usize,
}

impl Parallelism {
    /// `threads` threads (0: the rayon pool's size, at most [`DEFAULT_MAX_THREADS`]) for
    /// copies of at least `min_bytes`.
    pub fn new(threads: usize, min_bytes: usize) -> Self {
        let threads = if threads == 0 {
            rayon::current_num_threads().clamp(1, DEFAULT_MAX_THREADS)
        } else {
            threads
        };
        Self { threads, min_bytes }
    }

    /// Single-threaded copies.
    pub fn serial() -> Self {
        Self {
            threads: 1,
            min_bytes: usize::MAX,
        }
    }

    /// Into how many parts a copy of `bytes` bytes is split.
    pub fn parts(&self, bytes: usize) -> usize {
        if self.threads <= 1 || bytes < self.min_bytes {
            1
        } else {
            (bytes / MIN_PART_BYTES).clamp(1, self.threads)
        }
    }
}

/// Copies the bytes of image range `start..start + out.len()` that `segments`
/// (`(bytes, image offset)`, in image order, not overlapping) cover into `out`; bytes no
/// segment covers (alignment padding) are left as they are.
pub fn pack_range(segments: &[(Buffer, usize)], start: usize, out: &mut [u8]) {
    pack_range_uninit(segments, start, as_uninit(out))
}

/// [`pack_range`] into memory that may be uninitialized (device memory the host writes
/// directly): bytes no segment covers are left as they are, so only the segments' bytes
/// are initialized afterwards. Streaming stores from
/// [`STREAMING_MIN_BYTES`](crate::copy::STREAMING_MIN_BYTES) bytes ([`Stores::for_bytes`]).
pub fn pack_range_uninit(segments: &[(Buffer, usize)], start: usize, out: &mut [MaybeUninit<u8>]) {
    pack_range_with(segments, start, out, Stores::for_bytes(out.len()))
}

/// [`pack_range_uninit`] with the stores given: a part of a larger pack passes the
/// stores chosen for the whole.
pub fn pack_range_with(
    segments: &[(Buffer, usize)],
    start: usize,
    out: &mut [MaybeUninit<u8>],
    stores: Stores,
) {
    let end = start + out.len();
    let first = segments.partition_point(|(bytes, at)| at + bytes.len() <= start);
    for (bytes, at) in &segments[first..] {
        if *at >= end {
            break;
        }
        let from = (*at).max(start);
        let to = (at + bytes.len()).min(end);
        let src = &bytes.as_slice()[from - at..to - at];
        copy_into_uninit(&mut out[from - start..to - start], src, stores);
    }
}

/// `bytes` viewed as possibly uninitialized bytes, for functions that only write to them.
fn as_uninit(bytes: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`; the callers of this private helper
    // only ever write initialized bytes through the view, so `bytes` stays initialized.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast(), bytes.len()) }
}

/// [`pack_range`], split over up to `parallelism.threads` threads.
pub fn pack_window(
    segments: &[(Buffer, usize)],
    start: usize,
    out: &mut [u8],
    parallelism: Parallelism,
) {
    pack_window_uninit(segments, start, as_uninit(out), parallelism)
}

/// [`pack_range_uninit`], split over up to `parallelism.threads` threads.
pub fn pack_window_uninit(
    segments: &[(Buffer, usize)],
    start: usize,
    out: &mut [MaybeUninit<u8>],
    parallelism: Parallelism,
) {
    let stores = Stores::for_bytes(out.len());
    let parts = parallelism.parts(out.len());
    if parts <= 1 {
        return pack_range_with(segments, start, out, stores);
    }
    let part = out.len().div_ceil(parts);
    out.par_chunks_mut(part)
        .enumerate()
        .for_each(|(i, chunk)| pack_range_with(segments, start + i * part, chunk, stores));
}

/// Fills several outputs in one parallel pass: their bytes, taken in order as one range,
/// are split into `parallelism.parts(total)` equal parts, one per thread, and `fill(source,
/// offset, piece, stores)` writes each piece (`piece` is `out[offset..offset +
/// piece.len()]` of the output of `source`) with the stores chosen for the whole
/// ([`Stores::for_bytes`] of the total). Many outputs thus cost one hand-off to the
/// thread pool, balanced by bytes, as one large copy does, instead of one hand-off (and
/// one wait for the slowest thread) each.
pub fn fill_outputs<S: Sync>(
    outputs: Vec<(S, &mut [MaybeUninit<u8>])>,
    parallelism: Parallelism,
    fill: impl Fn(&S, usize, &mut [MaybeUninit<u8>], Stores) + Sync,
) {
    let total: usize = outputs.iter().map(|(_, out)| out.len()).sum();
    let stores = Stores::for_bytes(total);
    let parts = parallelism.parts(total);
    if parts <= 1 {
        for (source, out) in outputs {
            fill(&source, 0, out, stores);
        }
        return;
    }
    let part = total.div_ceil(parts);
    // The pieces of each part: (output, offset in it, bytes).
    type Piece<'a> = (usize, usize, &'a mut [MaybeUninit<u8>]);
    let mut pieces: Vec<Vec<Piece<'_>>> = (0..parts).map(|_| Vec::new()).collect();
    let mut sources = Vec::with_capacity(outputs.len());
    let mut at = 0;
    for (i, (source, mut out)) in outputs.into_iter().enumerate() {
        sources.push(source);
        let mut offset = 0;
        while !out.is_empty() {
            let p = at / part;
            let take = ((p + 1) * part - at).min(out.len());
            let (piece, rest) = std::mem::take(&mut out).split_at_mut(take);
            pieces[p].push((i, offset, piece));
            out = rest;
            offset += take;
            at += take;
        }
    }
    pieces.into_par_iter().for_each(|list| {
        for (i, offset, piece) in list {
            fill(&sources[i], offset, piece, stores);
        }
    });
}

/// Copies `src` into the (possibly uninitialized) `dst` of the same length with `stores`,
/// on the calling thread.
///
/// # Panics
/// Panics if the lengths differ.
pub fn copy_into_uninit(dst: &mut [MaybeUninit<u8>], src: &[u8], stores: Stores) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between ranges of different lengths"
    );
    // SAFETY: `dst` is valid for `src.len()` writes (same length, exclusively borrowed),
    // `src` for as many reads; a `&mut` and a `&` cannot overlap, and `MaybeUninit<u8>`
    // has the layout of `u8`.
    unsafe {
        copy_bytes(
            dst.as_mut_ptr().cast::<u8>(),
            src.as_ptr(),
            src.len(),
            stores,
        )
    };
}

/// Copies `src` into the (possibly uninitialized) `dst` of the same length, split over up
/// to `parallelism.threads` threads. Every byte of `dst` is initialized afterwards.
///
/// # Panics
/// Panics if the lengths differ.
pub fn copy_to_uninit(dst: &mut [MaybeUninit<u8>], src: &[u8], parallelism: Parallelism) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between ranges of different lengths"
    );
    let stores = Stores::for_bytes(src.len());
    let parts = parallelism.parts(src.len());
    if parts <= 1 {
        return copy_into_uninit(dst, src, stores);
    }
    let part = src.len().div_ceil(parts);
    dst.par_chunks_mut(part)
        .zip(src.par_chunks(part))
        .for_each(|(d, s)| copy_into_uninit(d, s, stores));
}

/// The size of the windows an upload of `staged` bytes (all the batches of one call that
/// go through staging) is cut into: about a sixteenth of it, two windows for each of
/// [`DEFAULT_MAX_THREADS`] workers, so that a batch of a few MB still spreads over the
/// workers and the first copy starts after a small pack; at least `min` bytes (the
/// fixed cost of a copy, a few µs, stays small beside it) and at most `max` (a staging
/// buffer). `min` = 0 means windows of `max` bytes.
pub fn upload_window_bytes(staged: usize, min: usize, max: usize) -> usize {
    let max = max.max(1);
    if min == 0 {
        return max;
    }
    (staged / (2 * DEFAULT_MAX_THREADS)).clamp(min.min(max), max)
}

/// Cuts `start..end` into the fewest windows of at most `size` bytes, of equal sizes (the
/// first ones a byte larger where the length does not divide evenly).
pub fn equal_windows(start: usize, end: usize, size: usize) -> Vec<(usize, usize)> {
    let len = end.saturating_sub(start);
    if len == 0 {
        return Vec::new();
    }
    let count = len.div_ceil(size.max(1));
    let mut at = start;
    (0..count)
        .map(|i| {
            let take = len / count + usize::from(i < len % count);
            let window = (at, at + take);
            at += take;
            window
        })
        .collect()
}

/// Cuts the byte range `start..end` into the windows of one copy each: at most `max`
/// bytes, and, when the range is more than 4 × `first` and `first < max`, ramped: the
/// first windows are `first`, `2 × first`, `4 × first`, ... bytes up to `max`, and the
/// last ones the same sizes in reverse order.
///
/// A chunked copy through staging is a pipeline: the copy engine waits for the first
/// chunk to be packed (to the device), or the host for the first chunk to arrive (to the
/// host), and the last chunk's copy (or unpack) overlaps nothing. With 8 MiB chunks those
/// two exposed steps take about 360 µs at 50 GB/s, a third of the time of
/// a whole 13 MB batch; ramped windows of 1 MiB at both ends expose about 45 µs, for a
/// few more copies of a few µs each.
pub fn windows(start: usize, end: usize, first: usize, max: usize) -> Vec<(usize, usize)> {
    ramped_windows(start, end, first, max, true, true)
}

/// [`windows`], ramped only at the start (`head`) and/or only at the end (`tail`): the
/// windows of a range copied in the middle of a longer pipeline need no ramp.
pub fn ramped_windows(
    start: usize,
    end: usize,
    first: usize,
    max: usize,
    head: bool,
    tail: bool,
) -> Vec<(usize, usize)> {
    let max = max.max(1);
    let len = end.saturating_sub(start);
    let mut front = Vec::new();
    let mut back = Vec::new();
    let mut rest = len;
    if (head || tail) && first > 0 && first < max && len > first.saturating_mul(4) {
        let mut size = first;
        while size < max && rest > 0 {
            for (side, ramp) in [(&mut front, head), (&mut back, tail)] {
                let take = size.min(rest);
                if ramp && take > 0 {
                    side.push(take);
                    rest -= take;
                }
            }
            size = size.saturating_mul(2);
        }
    }
    let middle = rest.div_ceil(max);
    let mut sizes = front;
    // The middle in equal windows of at most `max` bytes (the first ones one byte larger
    // where `rest` does not divide evenly).
    sizes.extend((0..middle).map(|i| rest / middle + usize::from(i < rest % middle)));
    sizes.extend(back.into_iter().rev());
    let mut at = start;
    sizes
        .into_iter()
        .map(|size| {
            let window = (at, at + size);
            at += size;
            window
        })
        .collect()
}

/// Transparent huge pages for large host buffers about to be written in full (one page
/// fault per 2 MiB instead of 512): the advice lives beside the host memory pool in
/// `devarrow-abi`, re-exported here.
///
/// A large host buffer that `to_host` fills without a pool usually comes straight from
/// `mmap` (the allocator maps sizes above its threshold, at most 32 MiB with glibc):
/// every 4 KiB page then faults on its first write, and the faults, not the copy, bound
/// the copy. One fault per 2 MiB instead of 512 made unpacking into such a buffer 1.5x
/// faster on the CPU device (`docs/benchmarks.md`).
pub use devarrow_abi::device::pool::{advise_huge_pages, HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES};

#[cfg(test)]
mod tests {
    use super::*;

    /// The large lengths' divisor under Miri (interpreted: 10 minutes on 2 cores at full
    /// size), the shapes kept: parts still cut segments longer than a part.
    const MIRI_SCALE: usize = if cfg!(miri) { 64 } else { 1 };

    fn segments() -> (Vec<(Buffer, usize)>, usize) {
        // Segments of odd sizes at 64-byte aligned offsets, with gaps.
        let mut segs = Vec::new();
        let mut at = 0usize;
        let big = [700_000 / MIRI_SCALE, (1 << 20) / MIRI_SCALE];
        for (i, len) in [1usize, 63, 64, 65, 1000, 3, big[0], 5, big[1]]
            .iter()
            .enumerate()
        {
            let bytes: Vec<u8> = (0..*len).map(|j| (j * 7 + i) as u8).collect();
            segs.push((Buffer::from_vec(bytes), at));
            at = (at + len).next_multiple_of(64);
        }
        let total = segs.last().map(|(b, a)| a + b.len()).unwrap();
        (segs, total)
    }

    fn expected(segs: &[(Buffer, usize)], total: usize, fill: u8) -> Vec<u8> {
        let mut out = vec![fill; total];
        for (b, at) in segs {
            out[*at..at + b.len()].copy_from_slice(b.as_slice());
        }
        out
    }

    #[test]
    fn many_outputs_are_filled_in_one_pass_whatever_the_parts() {
        let (segs, total) = segments();
        let want = expected(&segs, total, 0xab);
        // Images of the same segments, one empty, filled together: parts cut them anywhere.
        for (threads, min) in [(1, usize::MAX), (2, 0), (3, 0), (8, 0)] {
            let mut outs = [vec![0xabu8; total], Vec::new(), vec![0xabu8; total]];
            let outputs = outs
                .iter_mut()
                .map(|out| (&segs[..], as_uninit(out)))
                .collect();
            let parallelism = Parallelism {
                threads,
                min_bytes: min,
            };
            fill_outputs(outputs, parallelism, |segs, offset, out, stores| {
                pack_range_with(segs, offset, out, stores)
            });
            assert_eq!(outs[0], want, "{threads} threads");
            assert!(outs[1].is_empty());
            assert_eq!(outs[2], want, "{threads} threads");
        }
        // Copies of sources of different lengths, the pieces' offsets checked.
        let sources: Vec<Vec<u8>> = [0usize, 5, 300_000 / MIRI_SCALE, (1 << 20) / MIRI_SCALE, 17]
            .iter()
            .enumerate()
            .map(|(i, &len)| (0..len).map(|j| (j * 13 + i) as u8).collect())
            .collect();
        let mut outs: Vec<Vec<u8>> = sources.iter().map(|s| vec![0; s.len()]).collect();
        let outputs = sources
            .iter()
            .zip(&mut outs)
            .map(|(src, out)| (&src[..], as_uninit(out)))
            .collect();
        fill_outputs(
            outputs,
            Parallelism::new(4, 0),
            |src, offset, out, stores| {
                copy_into_uninit(out, &src[offset..offset + out.len()], stores)
            },
        );
        assert_eq!(outs, sources);
    }

    #[test]
    fn windows_tile_the_range_and_ramp_at_both_ends() {
        const M: usize = 1 << 20;
        for (start, len, first, max) in [
            (0, 0, M, 8 * M),
            (5, 1, M, 8 * M),
            (0, 4 * M, M, 8 * M),
            (0, 4 * M + 1, M, 8 * M),
            (64, 5 * M, M, 8 * M),
            (0, 13 * M + 77, M, 8 * M),
            (0, 200 * M + 3, M, 8 * M),
            (3, 100 * M, 0, 8 * M),
            (0, 100 * M, 8 * M, 8 * M),
            (0, 1000, 1, 1),
            (7, 100_000, 64, 4096),
        ] {
            let w = windows(start, start + len, first, max);
            // Contiguous, non-empty, within `max`, covering exactly `start..start + len`.
            let mut at = start;
            for &(s, e) in &w {
                assert_eq!(s, at);
                assert!(e > s && e - s <= max.max(1), "{w:?}");
                at = e;
            }
            assert_eq!(at, start + len);
            let sizes: Vec<usize> = w.iter().map(|(s, e)| e - s).collect();
            if first > 0 && first < max && len > 4 * first {
                assert_eq!(sizes[0], first, "{sizes:?}");
                assert!(*sizes.last().unwrap() <= first, "{sizes:?}");
                // Doubling towards the middle from both ends.
                for pair in sizes.windows(2).take(3) {
                    assert!(pair[1] <= 2 * pair[0].max(first), "{sizes:?}");
                }
            } else if len > 0 {
                assert_eq!(sizes.len(), len.div_ceil(max.max(1)), "{sizes:?}");
            }
        }
        let sizes: Vec<usize> = windows(0, 200 * M, M, 8 * M)
            .iter()
            .map(|(s, e)| e - s)
            .collect();
        assert_eq!(&sizes[..3], &[M, 2 * M, 4 * M]);
        assert!(sizes[3..sizes.len() - 3]
            .iter()
            .all(|&s| s > 7 * M && s <= 8 * M));
        assert_eq!(&sizes[sizes.len() - 3..], &[4 * M, 2 * M, M]);
    }

    #[test]
    fn windows_ramp_only_at_the_ends_asked_for() {
        const M: usize = 1 << 20;
        let sizes = |head, tail| -> Vec<usize> {
            ramped_windows(0, 40 * M, M, 8 * M, head, tail)
                .iter()
                .map(|(s, e)| e - s)
                .collect()
        };
        let both = sizes(true, true);
        assert_eq!((both[0], both[both.len() - 1]), (M, M));
        let head = sizes(true, false);
        assert_eq!(&head[..3], &[M, 2 * M, 4 * M]);
        assert!(
            head[3..].iter().all(|&s| s > 6 * M && s <= 8 * M),
            "{head:?}"
        );
        let tail = sizes(false, true);
        assert_eq!(&tail[tail.len() - 3..], &[4 * M, 2 * M, M]);
        assert!(
            tail[..tail.len() - 3].iter().all(|&s| s > 6 * M),
            "{tail:?}"
        );
        assert_eq!(sizes(false, false), vec![8 * M; 5]);
        for v in [both, head, tail] {
            assert_eq!(v.iter().sum::<usize>(), 40 * M);
        }
    }

    #[test]
    // 18 MiB filled and compared byte by byte: hours under Miri's interpreter.
    #[cfg_attr(miri, ignore)]
    fn advising_huge_pages_changes_no_byte() {
        let len = 9 * HUGE_PAGE_BYTES + 12_345;
        let mut bytes: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
        let expected = bytes.clone();
        // SAFETY: `u8` and `MaybeUninit<u8>` have the same layout, and every byte is
        // initialized; nothing is de-initialized through the view.
        let view = unsafe {
            std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<MaybeUninit<u8>>(), len)
        };
        advise_huge_pages(view);
        advise_huge_pages(&mut view[1..HUGE_PAGE_BYTES]);
        advise_huge_pages(&mut []);
        assert_eq!(bytes, expected);
    }

    #[test]
    // 1.7 MiB packed 12 times byte by byte: far too slow under Miri's interpreter.
    #[cfg_attr(miri, ignore)]
    fn windows_pack_the_same_bytes_serial_and_parallel() {
        let (segs, total) = segments();
        let want = expected(&segs, total, 0xee);
        for par in [
            Parallelism::serial(),
            Parallelism::new(4, 0),
            Parallelism::new(3, 1),
        ] {
            for window in [17usize, 4096, 300_000, total] {
                let mut got = vec![0xee; total];
                let mut start = 0;
                while start < total {
                    let end = (start + window).min(total);
                    pack_window(&segs, start, &mut got[start..end], par);
                    start = end;
                }
                assert!(got == want, "{par:?}, window {window}");
            }
        }
    }

    #[test]
    fn parts_respect_thresholds() {
        assert_eq!(Parallelism::serial().parts(1 << 30), 1);
        let p = Parallelism::new(8, 1 << 20);
        assert_eq!(p.parts((1 << 20) - 1), 1);
        assert_eq!(p.parts(1 << 20), 4);
        assert_eq!(p.parts(1 << 30), 8);
        assert!(Parallelism::new(0, 0).threads >= 1);
    }

    #[test]
    // A pool of 32 threads: far too slow under Miri.
    #[cfg_attr(miri, ignore)]
    fn the_default_takes_the_pools_threads_up_to_16() {
        // 16 threads fill a PCIe 5 link where 8 do not (see DEFAULT_MAX_THREADS).
        for (pool, want) in [(1, 1), (12, 12), (32, 16)] {
            let threads = rayon::ThreadPoolBuilder::new()
                .num_threads(pool)
                .build()
                .unwrap()
                .install(|| Parallelism::new(0, 0).threads);
            assert_eq!(threads, want, "a pool of {pool}");
        }
    }

    #[test]
    // 3 MB copied and compared twice byte by byte: far too slow under Miri.
    #[cfg_attr(miri, ignore)]
    fn uninit_copies_copy_every_byte() {
        let src: Vec<u8> = (0..3_000_001u32).map(|i| (i % 251) as u8).collect();
        for par in [Parallelism::serial(), Parallelism::new(5, 0)] {
            let mut dst = vec![MaybeUninit::<u8>::uninit(); src.len()];
            copy_to_uninit(&mut dst, &src, par);
            // SAFETY: every byte was written by the copy.
            let dst: Vec<u8> = dst.iter().map(|b| unsafe { b.assume_init() }).collect();
            assert!(dst == src);
        }
    }
}
