//! Bulk host copies with cached or streaming (non-temporal) stores.
//!
//! A pack into staging memory (read next by a DMA engine) or an unpack of many MB (read
//! by the application later, if at all soon) writes far more than a core's caches hold.
//! Ordinary stores first read every destination line into the cache (a read for
//! ownership) and later write it back: three memory transfers a byte. Streaming stores
//! write whole lines straight to memory: two. glibc's `memcpy` switches to them only for
//! single copies above about three quarters of the last-level cache (24 MB on the 2-core
//! EPYC VM this was measured on), never for the many buffers of a batch copied one by one.
//! There, 2 threads copying 644 MB in pieces of 4 KiB to 14 MiB moved 20-23 GB/s with
//! `memcpy` and 26.8-27.8 GB/s with AVX2 streaming stores, in every piece size, in runs
//! that alternated the two (`docs/benchmarks.md`).
//!
//! [`Stores::for_bytes`] chooses per call: streaming from [`STREAMING_MIN_BYTES`] written
//! in all, cached below (a small copy is likely read again from the cache soon).
//!
//! The CPU device's own copies (its stand-in for a DMA engine, which writes no CPU cache)
//! use them too, so that its raw copies and devarrow's packing are measured alike.

/// Bytes written by one copy call (a pack or unpack of the bridge, a copy of the CPU
/// device) from which it uses streaming stores: 1 MiB, the size from which the bridge
/// splits a copy over threads, and about a core's L2 cache.
pub const STREAMING_MIN_BYTES: usize = 1 << 20;

/// How a copy writes its destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stores {
    /// Ordinary stores, through the cache.
    Cached,
    /// Non-temporal stores straight to memory (x86-64: `movntdq`, AVX2 where the CPU has
    /// it; elsewhere, and under Miri, ordinary stores), fenced at the end of each copy so
    /// that another thread or a DMA engine that synchronizes with this one sees them.
    Streaming,
}

impl Stores {
    /// [`Stores::Streaming`] for a call writing at least [`STREAMING_MIN_BYTES`] in all,
    /// [`Stores::Cached`] below.
    pub fn for_bytes(total: usize) -> Self {
        if total >= STREAMING_MIN_BYTES {
            Self::Streaming
        } else {
            Self::Cached
        }
    }
}

/// Copies `len` bytes from `src` to `dst` with `stores`.
///
/// ```
/// use devarrow_abi::device::copy::{copy_bytes, Stores};
///
/// let src: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
/// let mut dst = vec![0u8; src.len() + 1];
/// // A large copy would choose by its size (`Stores::for_bytes`); any copy may stream.
/// // SAFETY: two distinct vectors, each at least `src.len()` bytes long.
/// unsafe { copy_bytes(dst[1..].as_mut_ptr(), src.as_ptr(), src.len(), Stores::Streaming) };
/// assert_eq!(&dst[1..], &src[..]);
/// ```
///
/// # Safety
/// `src` must be valid for `len` reads and `dst` for `len` writes, and the two ranges must
/// not overlap (as for [`std::ptr::copy_nonoverlapping`]).
pub unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize, stores: Stores) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if stores == Stores::Streaming && len >= STREAMING_PIECE_MIN_BYTES {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { x86::copy_streaming(dst, src, len) };
        return;
    }
    let _ = stores;
    // SAFETY: the caller's guarantee.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Pieces shorter than this are copied with ordinary stores even in a streaming call: the
/// alignment head and tail and the fence would cost more than they save.
#[cfg(all(target_arch = "x86_64", not(miri)))]
const STREAMING_PIECE_MIN_BYTES: usize = 256;

#[cfg(all(target_arch = "x86_64", not(miri)))]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_loadu_si128, _mm_sfence,
        _mm_stream_si128,
    };

    /// Copies with non-temporal stores (AVX2 where available, else SSE2, which every
    /// x86-64 CPU has), then fences them.
    ///
    /// # Safety
    /// As [`super::copy_bytes`].
    pub(super) unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked above); the ranges as the caller
            // guarantees.
            unsafe { copy_avx2(dst, src, len) };
        } else {
            // SAFETY: SSE2 is part of x86-64; the ranges as the caller guarantees.
            unsafe { copy_sse2(dst, src, len) };
        }
        // Non-temporal stores are weakly ordered: the fence orders them before every
        // later store of this thread (the release by which another thread, or the call
        // that enqueues a DMA, learns that the copy is done).
        // SAFETY: `sfence` has no preconditions (SSE, part of x86-64).
        unsafe { _mm_sfence() };
    }

    /// `$name(dst, src, len)`: a copy whose body stores `$lane`-byte vectors (`$vector`,
    /// loaded with `$load`, stored with `$stream`) at `$lane`-aligned destinations, four
    /// at a time, and copies the unaligned head and the tail with ordinary stores.
    macro_rules! streaming_copy {
        ($(#[$attr:meta])* $name:ident, $lane:literal, $vector:ty, $load:ident, $stream:ident) => {
            $(#[$attr])*
            unsafe fn $name(dst: *mut u8, src: *const u8, len: usize) {
                const LANE: usize = $lane;
                let head = dst.align_offset(LANE).min(len);
                // SAFETY: `head <= len`: inside both ranges.
                unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
                let mut at = head;
                while at + 4 * LANE <= len {
                    // SAFETY: `at + 4 * LANE <= len`: unaligned loads inside `src`, stores
                    // inside `dst` at `dst + at`, `LANE`-aligned (by `head`, and `at` grows
                    // by multiples of `LANE`).
                    unsafe {
                        let s = src.add(at);
                        let d = dst.add(at);
                        let a = $load(s.cast::<$vector>());
                        let b = $load(s.add(LANE).cast::<$vector>());
                        let c = $load(s.add(2 * LANE).cast::<$vector>());
                        let e = $load(s.add(3 * LANE).cast::<$vector>());
                        $stream(d.cast::<$vector>(), a);
                        $stream(d.add(LANE).cast::<$vector>(), b);
                        $stream(d.add(2 * LANE).cast::<$vector>(), c);
                        $stream(d.add(3 * LANE).cast::<$vector>(), e);
                    }
                    at += 4 * LANE;
                }
                // SAFETY: `at <= len`: the tail lies inside both ranges.
                unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) };
            }
        };
    }

    streaming_copy!(
        /// # Safety
        /// As [`super::copy_bytes`], and the CPU must have AVX2.
        #[target_feature(enable = "avx2")]
        copy_avx2,
        32,
        __m256i,
        _mm256_loadu_si256,
        _mm256_stream_si256
    );

    streaming_copy!(
        /// # Safety
        /// As [`super::copy_bytes`] (SSE2 is part of x86-64).
        copy_sse2,
        16,
        __m128i,
        _mm_loadu_si128,
        _mm_stream_si128
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_length_and_alignment_copies_exactly_its_bytes() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for stores in [Stores::Cached, Stores::Streaming] {
            for len in [0, 1, 31, 255, 256, 257, 300, 1000, 2048, 4000] {
                for dst_off in [0, 1, 7, 16, 31] {
                    for src_off in [0, 3, 32] {
                        let mut dst = vec![0xeeu8; len + 64];
                        // SAFETY: both ranges lie inside their vectors and do not overlap.
                        unsafe {
                            copy_bytes(
                                dst.as_mut_ptr().add(dst_off),
                                src.as_ptr().add(src_off),
                                len,
                                stores,
                            )
                        };
                        assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
                        assert!(dst[..dst_off].iter().all(|&b| b == 0xee));
                        assert!(dst[dst_off + len..].iter().all(|&b| b == 0xee));
                    }
                }
            }
        }
    }

    #[test]
    fn a_call_streams_from_one_mib() {
        assert_eq!(Stores::for_bytes(STREAMING_MIN_BYTES - 1), Stores::Cached);
        assert_eq!(Stores::for_bytes(STREAMING_MIN_BYTES), Stores::Streaming);
    }
}
