//! The descriptors of the batched copy kernel (`dvx_batched_copy`) and how a copy is cut
//! into the pieces that one warp copies each.
//!
//! The kernel gives each descriptor to one warp, warps striding over the descriptors,
//! and the grid is at most one wave of resident warps (`Kernel::config`). A copy is
//! fastest when every warp that streams has about the same number of bytes, so that
//! they all end together, and when there are enough of them to keep the memory busy:
//! [`plan_pieces`] cuts the segments into pieces of one size, chosen from the total
//! and the resident warps so that there are at most as many pieces as warps (one
//! wave, no tail) whenever the segments leave room for it.

/// One copy of the batched copy kernel: `len` bytes from `src` to `dst` (device or
/// UVA addresses). `#[repr(C)]`, 24 bytes: the descriptor layout `dvx_batched_copy`
/// reads.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CopySegment {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Length in bytes.
    pub len: u64,
}

const _: () = assert!(std::mem::size_of::<CopySegment>() == 24);

/// The bytes one round of a warp moves (32 lanes, four 16-byte chunks each, for a
/// 16-aligned source): piece sizes are multiples of it, so each piece of a segment has
/// the segment's source and destination alignments modulo 16.
pub const COPY_ROUND: u64 = 2048;

/// The smallest piece [`plan_pieces`] cuts (one round).
pub const MIN_COPY_PIECE: u64 = COPY_ROUND;

/// The longest descriptor `dvx_batched_copy` may be given (1 GiB; the kernel counts a
/// descriptor's 16-byte chunks in 32 bits, which allows up to 32 GiB), and so the
/// largest piece [`plan_pieces`] cuts.
pub const MAX_COPY_PIECE: u64 = 1 << 30;

/// Splits segments into pieces of at most `max_piece` bytes (empty segments are
/// dropped), so that one long segment spreads over many warps. Piece boundaries are
/// multiples of `max_piece` from the segment start.
///
/// ```
/// use devarrow_cuda::kernels::{split_segments, CopySegment};
///
/// let copy = CopySegment { src: 0x1000, dst: 0x8000, len: 5000 };
/// let empty = CopySegment { src: 0x9000, dst: 0xA000, len: 0 };
/// let pieces = split_segments(&[copy, empty], 2048);
/// let lens: Vec<u64> = pieces.iter().map(|p| p.len).collect();
/// assert_eq!(lens, [2048, 2048, 904]); // the empty segment is dropped
/// assert_eq!((pieces[1].src, pieces[1].dst), (0x1000 + 2048, 0x8000 + 2048));
/// ```
pub fn split_segments(segments: &[CopySegment], max_piece: u64) -> Vec<CopySegment> {
    assert!(max_piece > 0);
    let mut out = Vec::with_capacity(segments.len());
    for s in segments {
        let mut done = 0;
        while done < s.len {
            let len = (s.len - done).min(max_piece);
            out.push(CopySegment {
                src: s.src + done,
                dst: s.dst + done,
                len,
            });
            done += len;
        }
    }
    out
}

/// The piece size [`plan_pieces`] uses for `segments` on a device with `warps` resident
/// warps of `dvx_batched_copy`: a multiple of [`COPY_ROUND`] in
/// [`MIN_COPY_PIECE`]`..=`[`MAX_COPY_PIECE`].
///
/// Each non-empty segment adds at most one piece that is not full, so with `n`
/// segments, pieces of `total / (warps - n)` bytes make at most `warps` pieces: one
/// wave, each warp one piece, the full pieces all the same size, and at least a
/// quarter of the warps streaming while `n <= 3/4 warps`. With more segments than that
/// (many small ones), pieces of `total / warps` bytes, several per warp.
pub fn piece_size(segments: &[CopySegment], warps: u64) -> u64 {
    let (total, n) = segments
        .iter()
        .filter(|s| s.len > 0)
        .fold((0u64, 0u64), |(t, n), s| (t.saturating_add(s.len), n + 1));
    let warps = warps.max(1);
    let share = if n.saturating_mul(4) <= warps.saturating_mul(3) {
        warps - n
    } else {
        warps
    };
    total
        .div_ceil(share.max(1))
        .min(MAX_COPY_PIECE)
        .next_multiple_of(COPY_ROUND)
        .clamp(MIN_COPY_PIECE, MAX_COPY_PIECE)
}

/// The descriptors of one `dvx_batched_copy` launch copying `segments` on a device
/// with `warps` resident warps of the kernel: the segments cut into pieces of
/// [`piece_size`] bytes (empty segments dropped).
///
/// ```
/// use devarrow_cuda::kernels::{plan_pieces, CopySegment, COPY_ROUND};
///
/// // 10 MiB and 3 KiB on a device with 64 resident warps of the kernel.
/// let segments = [
///     CopySegment { src: 0x10_0000, dst: 0x9000_0000, len: 10 << 20 },
///     CopySegment { src: 0x20_0000, dst: 0xA000_0000, len: 3 << 10 },
/// ];
/// let pieces = plan_pieces(&segments, 64);
/// assert!(pieces.len() <= 64); // one wave: at most a piece per warp
/// assert_eq!(pieces.iter().map(|p| p.len).sum::<u64>(), (10 << 20) + (3 << 10));
/// assert_eq!(pieces[0].len % COPY_ROUND, 0); // full pieces are whole rounds
/// ```
pub fn plan_pieces(segments: &[CopySegment], warps: u64) -> Vec<CopySegment> {
    split_segments(segments, piece_size(segments, warps))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(len: u64) -> CopySegment {
        CopySegment {
            src: 0x1000,
            dst: 0x9000,
            len,
        }
    }

    #[test]
    fn one_wave_when_the_segments_leave_room() {
        let warps = 132 * 64;
        // 64 MiB in one segment: one piece per warp, all full but the last
        let pieces = plan_pieces(&[seg(64 << 20)], warps);
        assert!(pieces.len() as u64 <= warps);
        assert!(pieces.len() as u64 > warps * 9 / 10, "{}", pieces.len());
        // 4096 segments of mixed sizes, as the kernel bench
        let segs: Vec<CopySegment> = (0..4096u64).map(|i| seg(1 + (i * 7919) % 40_000)).collect();
        let pieces = plan_pieces(&segs, warps);
        assert!(pieces.len() as u64 <= warps, "{}", pieces.len());
        let p = piece_size(&segs, warps);
        assert_eq!(p % COPY_ROUND, 0);
        assert!(pieces.iter().all(|s| s.len <= p));
    }

    #[test]
    fn sizes_stay_in_bounds() {
        assert_eq!(piece_size(&[], 100), MIN_COPY_PIECE);
        assert_eq!(piece_size(&[seg(10)], 1000), MIN_COPY_PIECE);
        assert_eq!(piece_size(&[seg(u64::MAX / 2)], 1), MAX_COPY_PIECE);
        assert_eq!(piece_size(&[seg(1 << 40), seg(1 << 40)], 0), MAX_COPY_PIECE);
        // many small segments: total / warps
        let segs = vec![seg(100_000); 1000];
        assert_eq!(
            piece_size(&segs, 1000),
            100_000u64.next_multiple_of(COPY_ROUND)
        );
        // room left: total / (warps - n)
        let segs = vec![seg(100_000); 10];
        assert_eq!(
            piece_size(&segs, 110),
            10_000u64.next_multiple_of(COPY_ROUND)
        );
    }
}
