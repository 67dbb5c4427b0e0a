//! The descriptors of the batched copy kernel (`dvx_batched_copy`) and how a copy is cut
//! into the pieces that one warp copies each.

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

/// Splits segments into pieces of at most `max_piece` bytes (empty segments are
/// dropped), so that one long segment spreads over many warps. Piece boundaries are
/// multiples of `max_piece` from the segment start.
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

/// The largest piece one warp of the batched copy gets (16 KiB).
pub const MAX_COPY_PIECE: u64 = 16 * 1024;
