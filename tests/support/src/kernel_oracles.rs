//! CPU reference implementations of the kernels in `crates/cuda/kernels/copy.ptx` and
//! `validity.ptx`: the oracle of the GPU tests. (Those of `convert.ptx` are
//! `devarrow_abi::device::CpuKernels`, the CPU implementation of the same trait.)
//!
//! Two layers:
//! - [`naive`]: the definitions, bit by bit and element by element.
//! - the `*_chunked` functions: the kernels' algorithms replayed step by step on the
//!   CPU — same address arithmetic (the buffers are placed at a chosen *virtual
//!   address*, so the alignment cases of the GPU are reproduced), same chunking, same
//!   masks and funnel shifts, same fast/edge paths. Each loop iteration is what one GPU
//!   thread (or warp, for the batched copy) does in one grid-stride step. They also
//!   assert that the algorithm never reads or writes outside the ranges it is given.
//!
//! The plain functions ([`count_set_bits`], [`copy_bitmap`], ...) run the chunked
//! algorithm at the slices' own host addresses. Unit tests check every chunked function
//! against [`naive`] over random inputs, lengths, bit offsets and alignments.

use devarrow_cuda::kernels::{piece_size, split_segments, CopySegment, MAX_COPY_PIECE};

/// Bit `i` of an Arrow (LSB-first) bitmap.
pub fn get_bit(bitmap: &[u8], i: usize) -> bool {
    bitmap[i / 8] & (1 << (i % 8)) != 0
}

/// The number of bytes of a bitmap of `bits` bits.
pub fn bitmap_bytes(bits: usize) -> usize {
    bits.div_ceil(8)
}

/// The definitions the kernels must meet, bit by bit.
pub mod naive {
    use super::get_bit;

    /// The number of set bits in bits `[offset, offset + len)`.
    pub fn count_set_bits(bitmap: &[u8], offset: usize, len: usize) -> u64 {
        (offset..offset + len)
            .filter(|&i| get_bit(bitmap, i))
            .count() as u64
    }

    /// Bits `[offset, offset + len)` as a new bitmap starting at bit 0, the bits of the
    /// last byte past `len` zero.
    pub fn copy_bitmap(src: &[u8], offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len.div_ceil(8)];
        for i in 0..len {
            if get_bit(src, offset + i) {
                out[i / 8] |= 1 << (i % 8);
            }
        }
        out
    }

    /// Bits `[offset, offset + len)` as one byte (0 or 1) each.
    pub fn unpack_bits(src: &[u8], offset: usize, len: usize) -> Vec<u8> {
        (0..len).map(|i| get_bit(src, offset + i) as u8).collect()
    }

    /// One-byte booleans (any nonzero byte is true) as a bitmap, the bits of the last
    /// byte past the length zero.
    pub fn pack_bools(bools: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; bools.len().div_ceil(8)];
        for (i, &b) in bools.iter().enumerate() {
            if b != 0 {
                out[i / 8] |= 1 << (i % 8);
            }
        }
        out
    }

    /// `offsets[i] - base` for every `i` (wrapping).
    pub fn rebase_offsets_i32(offsets: &[i32], base: i32) -> Vec<i32> {
        offsets.iter().map(|&o| o.wrapping_sub(base)).collect()
    }

    /// `offsets[i] - base` for every `i` (wrapping).
    pub fn rebase_offsets_i64(offsets: &[i64], base: i64) -> Vec<i64> {
        offsets.iter().map(|&o| o.wrapping_sub(base)).collect()
    }
}

/// Host bytes seen at a virtual base address, read the way the kernels read.
struct Mem<'a> {
    bytes: &'a [u8],
    base: u64,
}

impl Mem<'_> {
    fn byte(&self, addr: u64) -> u8 {
        let i = addr
            .checked_sub(self.base)
            .expect("kernel would read below the buffer");
        self.bytes[usize::try_from(i).expect("address")]
    }

    /// A direct (vector or word) load: all four bytes must lie in `[lo, hi)`.
    fn word(&self, addr: u64, lo: u64, hi: u64) -> u32 {
        assert!(
            addr >= lo && addr + 4 <= hi,
            "kernel would load the word at {addr:#x} outside [{lo:#x}, {hi:#x})"
        );
        u32::from_le_bytes([
            self.byte(addr),
            self.byte(addr + 1),
            self.byte(addr + 2),
            self.byte(addr + 3),
        ])
    }

    /// `dvx_ld_guard_u32`: the bytes in `[lo, hi)`, zero elsewhere.
    fn guarded_word(&self, addr: u64, lo: u64, hi: u64) -> u32 {
        let mut w = 0u32;
        for j in 0..4 {
            let a = addr + j;
            if a >= lo && a < hi {
                w |= (self.byte(a) as u32) << (8 * j);
            }
        }
        w
    }

    /// `dvx_ld_word`: direct when inside `[lo, hi)`, guarded otherwise.
    fn word_or_guarded(&self, addr: u64, lo: u64, hi: u64) -> u32 {
        if addr >= lo && addr + 4 <= hi {
            self.word(addr, lo, hi)
        } else {
            self.guarded_word(addr, lo, hi)
        }
    }

    /// A 16-byte chunk: one v4 load when inside `[lo, hi)`, four guarded words otherwise.
    fn chunk(&self, addr: u64, lo: u64, hi: u64) -> [u32; 4] {
        if addr >= lo && addr + 16 <= hi {
            [0, 4, 8, 12].map(|o| self.word(addr + o, lo, hi))
        } else {
            [0, 4, 8, 12].map(|o| self.guarded_word(addr + o, lo, hi))
        }
    }
}

/// Host bytes seen at a virtual base address, written the way the kernels write.
struct MemMut<'a> {
    bytes: &'a mut [u8],
    base: u64,
}

impl MemMut<'_> {
    fn store_byte(&mut self, addr: u64, value: u8) {
        let i = addr
            .checked_sub(self.base)
            .expect("kernel would write below the buffer");
        self.bytes[usize::try_from(i).expect("address")] = value;
    }

    /// A direct (vector or word) store: all four bytes must lie in `[lo, hi)`.
    fn store_word(&mut self, addr: u64, value: u32, lo: u64, hi: u64) {
        assert!(
            addr >= lo && addr + 4 <= hi,
            "kernel would store the word at {addr:#x} outside [{lo:#x}, {hi:#x})"
        );
        for (j, b) in value.to_le_bytes().into_iter().enumerate() {
            self.store_byte(addr + j as u64, b);
        }
    }

    /// `dvx_st_guard_u32`: the bytes below `limit`.
    fn store_guarded(&mut self, addr: u64, value: u32, limit: u64) {
        for (j, b) in value.to_le_bytes().into_iter().enumerate() {
            let a = addr + j as u64;
            if a >= limit {
                break;
            }
            self.store_byte(a, b);
        }
    }
}

/// `(1 << n) - 1` as PTX computes it (`shl.b32` clamps shifts of 32 and more to 0, so
/// `n >= 32` gives all ones).
fn mask_below(n: u64) -> u32 {
    if n >= 32 {
        u32::MAX
    } else {
        (1u32 << n) - 1
    }
}

/// `shf.r.clamp.b32 d, lo, hi, s`: the low 32 bits of `(hi:lo) >> min(s, 32)`.
fn funnel_right(lo: u32, hi: u32, s: u32) -> u32 {
    let s = s.min(32);
    ((((hi as u64) << 32) | lo as u64) >> s) as u32
}

/// `dvx_count_set_bits` on a bitmap placed at virtual address `bitmap_addr`.
pub fn count_set_bits_chunked(bitmap: &[u8], bitmap_addr: u64, offset: u64, len: u64) -> u64 {
    if len == 0 {
        return 0;
    }
    let mem = Mem {
        bytes: bitmap,
        base: bitmap_addr,
    };
    let first = bitmap_addr + offset / 8;
    let end = bitmap_addr + (offset + len).div_ceil(8);
    let a = first & !15;
    let lead = (first - a) * 8 + offset % 8;
    let total = lead + len;
    let nchunks = total.div_ceil(128);
    let mut count = 0u64;
    for c in 0..nchunks {
        let addr = a + 16 * c;
        if c != 0 && c != nchunks - 1 {
            // interior chunk: one v4 load, no mask
            let x = [0, 4, 8, 12].map(|o| mem.word(addr + o, first, end));
            count += x.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        } else {
            for w in 0..4u64 {
                let x = mem.guarded_word(addr + 4 * w, first, end);
                let g0 = (128 * c + 32 * w) as i64;
                let lo = (lead as i64 - g0).clamp(0, 32) as u64;
                let hi = (total as i64 - g0).clamp(0, 32) as u64;
                let mask = mask_below(hi) & !mask_below(lo);
                count += (x & mask).count_ones() as u64;
            }
        }
    }
    count
}

/// `dvx_copy_bitmap`: bits `[src_offset, src_offset + len)` of `src` (at virtual address
/// `src_addr`) to bits `[0, len)` of `dst` (at `dst_addr`); writes exactly
/// `ceil(len/8)` bytes of `dst`, the bits of the last one past `len` zero.
pub fn copy_bitmap_chunked(
    src: &[u8],
    src_addr: u64,
    src_offset: u64,
    len: u64,
    dst: &mut [u8],
    dst_addr: u64,
) {
    if len == 0 {
        return;
    }
    let mem = Mem {
        bytes: src,
        base: src_addr,
    };
    let mut out = MemMut {
        bytes: dst,
        base: dst_addr,
    };
    let first = src_addr + src_offset / 8;
    let end = src_addr + (src_offset + len).div_ceil(8);
    let a = first & !15;
    let lead = (first - a) * 8 + src_offset % 8;
    let q = (lead >> 5) as usize;
    let s = (lead & 31) as u32;
    let out_bytes = len.div_ceil(8);
    let out_chunks = out_bytes.div_ceil(16);
    let limit = dst_addr + out_bytes;
    let dst_aligned = dst_addr.is_multiple_of(16);
    for k in 0..out_chunks {
        let c0 = a + 16 * k;
        let mut x = [0u32; 8];
        x[..4].copy_from_slice(&mem.chunk(c0, first, end));
        x[4..].copy_from_slice(&mem.chunk(c0 + 16, first, end));
        let sel2: [u32; 6] = std::array::from_fn(|i| if q & 2 != 0 { x[i + 2] } else { x[i] });
        let y: [u32; 5] = std::array::from_fn(|i| if q & 1 != 0 { sel2[i + 1] } else { sel2[i] });
        let mut o: [u32; 4] = std::array::from_fn(|j| funnel_right(y[j], y[j + 1], s));
        let d = dst_addr + 16 * k;
        if k == out_chunks - 1 {
            for (j, word) in o.iter_mut().enumerate() {
                let valid = (len as i64 - (128 * k + 32 * j as u64) as i64).clamp(0, 32) as u64;
                *word &= mask_below(valid);
            }
            for (j, &word) in o.iter().enumerate() {
                out.store_guarded(d + 4 * j as u64, word, limit);
            }
        } else if dst_aligned {
            for (j, &word) in o.iter().enumerate() {
                out.store_word(d + 4 * j as u64, word, dst_addr, limit);
            }
        } else {
            for (j, &word) in o.iter().enumerate() {
                out.store_guarded(d + 4 * j as u64, word, limit);
            }
        }
    }
}

/// `dvx_unpack_bits`: `dst[i] = bit (src_offset + i)` for `i < len`.
pub fn unpack_bits_chunked(
    src: &[u8],
    src_addr: u64,
    src_offset: u64,
    len: u64,
    dst: &mut [u8],
    dst_addr: u64,
) {
    if len == 0 {
        return;
    }
    let mem = Mem {
        bytes: src,
        base: src_addr,
    };
    let mut out = MemMut {
        bytes: dst,
        base: dst_addr,
    };
    let first = src_addr + src_offset / 8;
    let end = src_addr + (src_offset + len).div_ceil(8);
    let a4 = first & !3;
    let lead = ((first - a4) * 8 + src_offset % 8) as u32;
    let groups = len.div_ceil(32);
    let limit = dst_addr + len;
    let dst_aligned = dst_addr.is_multiple_of(16);
    for g in 0..groups {
        let w0 = a4 + 4 * g;
        let x0 = mem.word_or_guarded(w0, first, end);
        let x1 = mem.word_or_guarded(w0 + 4, first, end);
        let bits = funnel_right(x0, x1, lead);
        let o: [u32; 8] = std::array::from_fn(|n| {
            (((bits >> (4 * n)) & 15).wrapping_mul(0x0020_4081)) & 0x0101_0101
        });
        let d = dst_addr + 32 * g;
        if 32 * g + 32 <= len && dst_aligned {
            for (n, &word) in o.iter().enumerate() {
                out.store_word(d + 4 * n as u64, word, dst_addr, limit);
            }
        } else {
            for (n, &word) in o.iter().enumerate() {
                out.store_guarded(d + 4 * n as u64, word, limit);
            }
        }
    }
}

/// `dvx_pack_bools`: bit `i` of `dst` = `src[i] != 0` for `i < src.len()`; writes exactly
/// `ceil(len/8)` bytes, the bits of the last one past the length zero.
pub fn pack_bools_chunked(src: &[u8], src_addr: u64, dst: &mut [u8], dst_addr: u64) {
    let len = src.len() as u64;
    if len == 0 {
        return;
    }
    let mem = Mem {
        bytes: src,
        base: src_addr,
    };
    let mut out = MemMut {
        bytes: dst,
        base: dst_addr,
    };
    let groups = len.div_ceil(32);
    let limit = dst_addr + len.div_ceil(8);
    let src_end = src_addr + len;
    let src_aligned = src_addr.is_multiple_of(16);
    let dst_aligned4 = dst_addr.is_multiple_of(4);
    for g in 0..groups {
        let base = src_addr + 32 * g;
        let full = 32 * g + 32 <= len;
        let mut word = 0u32;
        if full && src_aligned {
            for i in 0..8u64 {
                let w = mem.word(base + 4 * i, src_addr, src_end);
                let mut x = w | (w >> 4);
                x |= x >> 2;
                x |= x >> 1;
                x &= 0x0101_0101;
                let nib = x.wrapping_mul(0x1020_4080) >> 28;
                word |= nib << (4 * i);
            }
        } else {
            for i in 0..32u64 {
                if 32 * g + i >= len {
                    break;
                }
                if mem.byte(base + i) != 0 {
                    word |= 1 << i;
                }
            }
        }
        let d = dst_addr + 4 * g;
        if full && dst_aligned4 {
            out.store_word(d, word, dst_addr, limit);
        } else {
            out.store_guarded(d, word, limit);
        }
    }
}

/// The number of set bits in bits `[offset, offset + len)` of `bitmap`.
pub fn count_set_bits(bitmap: &[u8], offset: usize, len: usize) -> u64 {
    count_set_bits_chunked(bitmap, bitmap.as_ptr() as u64, offset as u64, len as u64)
}

/// Bits `[offset, offset + len)` of `src` as a new bitmap starting at bit 0.
pub fn copy_bitmap(src: &[u8], offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; bitmap_bytes(len)];
    let dst_addr = out.as_ptr() as u64;
    copy_bitmap_chunked(
        src,
        src.as_ptr() as u64,
        offset as u64,
        len as u64,
        &mut out,
        dst_addr,
    );
    out
}

/// Bits `[offset, offset + len)` of `src` as one byte (0 or 1) each.
pub fn unpack_bits(src: &[u8], offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let dst_addr = out.as_ptr() as u64;
    unpack_bits_chunked(
        src,
        src.as_ptr() as u64,
        offset as u64,
        len as u64,
        &mut out,
        dst_addr,
    );
    out
}

/// One-byte booleans as a bitmap.
pub fn pack_bools(bools: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; bitmap_bytes(bools.len())];
    let dst_addr = out.as_ptr() as u64;
    pack_bools_chunked(bools, bools.as_ptr() as u64, &mut out, dst_addr);
    out
}

/// What one warp of `dvx_batched_copy` does for one descriptor, lane by lane: copies
/// `src` (at virtual address `src_addr`) to the start of `dst` (at `dst_addr`): head and
/// tail bytes (the first and last output chunks too when the source is shifted), then
/// rounds of four 16-byte chunks per lane, stored as loaded (source 16-aligned after
/// the head) or funnel-shifted from aligned source chunks with one or two words of a
/// neighbour lane (`shfl.sync`). Every load and store is checked to lie inside the
/// descriptor's ranges, and every stored chunk to be made of chunks loaded in the same
/// round.
pub fn copy_segment_chunked(src: &[u8], src_addr: u64, dst: &mut [u8], dst_addr: u64) {
    let len = src.len() as u64;
    assert!(dst.len() as u64 >= len);
    assert!(
        len <= MAX_COPY_PIECE,
        "descriptor longer than MAX_COPY_PIECE"
    );
    let mem = Mem {
        bytes: src,
        base: src_addr,
    };
    let mut out = MemMut {
        bytes: dst,
        base: dst_addr,
    };
    let src_end = src_addr + len;
    let dst_end = dst_addr + len;
    let mut h = (dst_addr.wrapping_neg() & 15).min(len);
    let rem = len - h;
    let mut nb = rem >> 4;
    let mut t = rem & 15;
    let off = (src_addr + h) & 15;
    if off != 0 {
        // output chunks 0 and nb - 1 would need aligned source chunks reaching outside
        if nb >= 2 {
            h += 16;
            nb -= 2;
            t += 16;
        } else {
            nb = 0;
            t = rem;
        }
    }
    assert!(h < 32 && t < 32);
    for lane in 0..32 {
        if lane < h {
            out.store_byte(dst_addr + lane, mem.byte(src_addr + lane));
        }
        if lane < t {
            let i = len - t + lane;
            out.store_byte(dst_addr + i, mem.byte(src_addr + i));
        }
    }
    if nb == 0 {
        return;
    }
    let d = dst_addr + h;
    assert!(d.is_multiple_of(16));
    let a = src_addr + h - off;
    let chunk = |i: u64| -> [u32; 4] {
        let at = a + 16 * i;
        [0, 4, 8, 12].map(|o| mem.word(at + o, src_addr, src_end))
    };
    let mut store = |i: u64, words: [u32; 4]| {
        for (j, w) in words.into_iter().enumerate() {
            out.store_word(d + 16 * i + 4 * j as u64, w, dst_addr, dst_end);
        }
    };
    // rl = chunks left - lane (lane 0's: whether the warp goes on)
    let rl = |c0: u64, lane: u64| nb as i64 - c0 as i64 - lane as i64;
    if off == 0 {
        // step k of a round: chunk 32k + lane, iff rl > 32k
        let mut c0 = 0;
        while rl(c0, 0) > 0 {
            for lane in 0..32 {
                for k in 0..4 {
                    if rl(c0, lane) > 32 * k as i64 {
                        let i = c0 + 32 * k + lane;
                        store(i, chunk(i));
                    }
                }
            }
            c0 += 128;
        }
        return;
    }
    // shifted: lane L of step k holds source chunk c0 + 31k + L (loaded iff rl >= 31k)
    let q = (off / 4) as usize;
    let sh = (8 * (off % 4)) as u32;
    let mut c0 = 0;
    while rl(c0, 0) > 0 {
        let held: Vec<[Option<[u32; 4]>; 4]> = (0..32)
            .map(|lane| {
                std::array::from_fn(|k| {
                    (rl(c0, lane) >= 31 * k as i64).then(|| chunk(c0 + 31 * k as u64 + lane))
                })
            })
            .collect();
        for k in 0..4 {
            for lane in 0..32usize {
                let r = rl(c0, lane as u64);
                let own = held[lane][k];
                // q < 2: output = own chunk, with words of the next lane's (lane 31
                // stores nothing); q >= 2: output = own chunk - 1, with words of the
                // previous lane's (lane 0 stores nothing)
                let (stored, neighbour, out_i) = if q < 2 {
                    (
                        r > 31 * k as i64 && lane != 31,
                        held.get(lane + 1).and_then(|h| h[k]),
                        c0 + 31 * k as u64 + lane as u64,
                    )
                } else {
                    (
                        r >= 31 * k as i64 && lane != 0,
                        lane.checked_sub(1).and_then(|l| held[l][k]),
                        (c0 + 31 * k as u64 + lane as u64).wrapping_sub(1),
                    )
                };
                if !stored {
                    continue;
                }
                let own = own.expect("stores a chunk its lane did not load");
                let nbr = neighbour.expect("stores a chunk with words its neighbour did not load");
                let y: [u32; 5] = match q {
                    0 => [own[0], own[1], own[2], own[3], nbr[0]],
                    1 => [own[1], own[2], own[3], nbr[0], nbr[1]],
                    2 => [nbr[2], nbr[3], own[0], own[1], own[2]],
                    _ => [nbr[3], own[0], own[1], own[2], own[3]],
                };
                store(
                    out_i,
                    std::array::from_fn(|j| funnel_right(y[j], y[j + 1], sh)),
                );
            }
        }
        c0 += 124;
    }
}

/// Resident warps the plain [`batched_copy`] plans its pieces for: an H100 (132
/// multiprocessors) with `dvx_batched_copy` at full occupancy (64 warps each).
pub const ORACLE_WARPS: u64 = 132 * 64;

/// Copies every `srcs[i]` into the start of `dsts[i]` the way `dvx_batched_copy` does
/// (cut into pieces by [`plan_pieces`](devarrow_cuda::kernels::plan_pieces) for
/// [`ORACLE_WARPS`] warps, then one
/// [`copy_segment_chunked`] per piece), at the slices' host addresses.
pub fn batched_copy(srcs: &[&[u8]], dsts: &mut [&mut [u8]]) {
    assert_eq!(srcs.len(), dsts.len());
    let segs: Vec<CopySegment> = srcs
        .iter()
        .zip(dsts.iter())
        .map(|(src, dst)| CopySegment {
            src: src.as_ptr() as u64,
            dst: dst.as_ptr() as u64,
            len: src.len() as u64,
        })
        .collect();
    let piece = piece_size(&segs, ORACLE_WARPS);
    for ((src, dst), seg) in srcs.iter().zip(dsts.iter_mut()).zip(&segs) {
        for p in split_segments(&[*seg], piece) {
            let so = (p.src - seg.src) as usize;
            let n = p.len as usize;
            copy_segment_chunked(&src[so..so + n], p.src, &mut dst[so..so + n], p.dst);
        }
    }
}

/// An offset type of Arrow variable-length layouts (`i32` or `i64`).
pub trait OffsetValue: Copy + Eq + std::fmt::Debug {
    /// Size in bytes.
    const SIZE: u64;
    /// `self - base`, wrapping.
    fn rebase(self, base: Self) -> Self;
}

impl OffsetValue for i32 {
    const SIZE: u64 = 4;
    fn rebase(self, base: Self) -> Self {
        self.wrapping_sub(base)
    }
}

impl OffsetValue for i64 {
    const SIZE: u64 = 8;
    fn rebase(self, base: Self) -> Self {
        self.wrapping_sub(base)
    }
}

/// `dvx_rebase_offsets_i32` / `_i64`: `dst[i] = src[i] - base`, with `src` at virtual
/// address `src_addr` and `dst` at `dst_addr` (both naturally aligned): vector path
/// (head, 16-byte body, tail) when both have the same alignment modulo 16, element by
/// element otherwise.
pub fn rebase_offsets_chunked<T: OffsetValue>(
    src: &[T],
    src_addr: u64,
    base: T,
    dst: &mut [T],
    dst_addr: u64,
) {
    let n = src.len();
    assert!(dst.len() >= n);
    assert!(src_addr.is_multiple_of(T::SIZE) && dst_addr.is_multiple_of(T::SIZE));
    if (src_addr ^ dst_addr) & 15 == 0 {
        let per_vector = (16 / T::SIZE) as usize;
        let head = (((dst_addr.wrapping_neg() & 15) / T::SIZE) as usize).min(n);
        for i in 0..head {
            dst[i] = src[i].rebase(base);
        }
        let nv = (n - head) / per_vector;
        let tail = (n - head) % per_vector;
        for v in 0..nv {
            let at = head + per_vector * v;
            assert_eq!(
                (dst_addr + at as u64 * T::SIZE) % 16,
                0,
                "unaligned vector store"
            );
            for e in 0..per_vector {
                dst[at + e] = src[at + e].rebase(base);
            }
        }
        for t in 0..tail {
            let i = head + per_vector * nv + t;
            dst[i] = src[i].rebase(base);
        }
    } else {
        for i in 0..n {
            dst[i] = src[i].rebase(base);
        }
    }
}

/// `offsets[i] - base` for every `i`, the way `dvx_rebase_offsets_i32` computes it.
pub fn rebase_offsets_i32(offsets: &[i32], base: i32) -> Vec<i32> {
    let mut out = vec![0i32; offsets.len()];
    let dst_addr = out.as_ptr() as u64;
    rebase_offsets_chunked(offsets, offsets.as_ptr() as u64, base, &mut out, dst_addr);
    out
}

/// `offsets[i] - base` for every `i`, the way `dvx_rebase_offsets_i64` computes it.
pub fn rebase_offsets_i64(offsets: &[i64], base: i64) -> Vec<i64> {
    let mut out = vec![0i64; offsets.len()];
    let dst_addr = out.as_ptr() as u64;
    rebase_offsets_chunked(offsets, offsets.as_ptr() as u64, base, &mut out, dst_addr);
    out
}

/// SplitMix64: a tiny deterministic generator of the random inputs the kernels are
/// tested with, here against the naive definitions and on a GPU against these oracles
/// (`tests/gpu.rs`): the same seed gives the same inputs everywhere.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }

    /// `n` bitmap bytes biased towards runs of zeros and ones, with sparse and dense
    /// regions (one of four modes per call).
    pub fn bitmap(&mut self, n: usize) -> Vec<u8> {
        let mode = self.below(4);
        (0..n)
            .map(|_| match mode {
                0 => self.next_u64() as u8,
                1 => 0xFF ^ (1 << self.below(8)) as u8,
                2 => (self.below(16) == 0) as u8,
                _ => [0u8, 0xFF][self.below(2) as usize],
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::SplitMix64 as Rng;

    /// Lengths that cover 0, 1, every length up to 300, and sizes around multiples of
    /// 8, 32, 128, 256 (the block size) and larger.
    fn lengths() -> Vec<usize> {
        let mut v: Vec<usize> = (0..=300).collect();
        for m in [512usize, 1024, 2048, 4096, 8192, 32768] {
            v.extend([m - 1, m, m + 1, m + 7, m + 33]);
        }
        v.push(100_003);
        v
    }

    #[test]
    fn count_set_bits_matches_naive() {
        let mut rng = Rng(1);
        for len in lengths() {
            for _ in 0..3 {
                let offset = rng.below(200) as usize;
                let slack = rng.below(3) as usize;
                let bitmap = rng.bitmap(bitmap_bytes(offset + len) + slack);
                let expected = naive::count_set_bits(&bitmap, offset, len);
                let addr = 0x1000 + rng.below(16) + 16 * rng.below(4);
                assert_eq!(
                    count_set_bits_chunked(&bitmap, addr, offset as u64, len as u64),
                    expected,
                    "len {len} offset {offset} addr {addr:#x}"
                );
            }
        }
        // every alignment x every bit offset, a few lengths
        for align in 0..16u64 {
            for offset in 0..140usize {
                for len in [
                    1usize, 7, 8, 9, 31, 32, 33, 127, 128, 129, 255, 256, 257, 1000,
                ] {
                    let bitmap = rng.bitmap(bitmap_bytes(offset + len));
                    assert_eq!(
                        count_set_bits_chunked(&bitmap, 0x4000 + align, offset as u64, len as u64),
                        naive::count_set_bits(&bitmap, offset, len),
                        "len {len} offset {offset} align {align}"
                    );
                }
            }
        }
        assert_eq!(count_set_bits(&[0xFF, 0x0F], 4, 8), 8);
        assert_eq!(count_set_bits(&[], 0, 0), 0);
    }

    #[test]
    fn copy_bitmap_matches_naive_and_stays_in_bounds() {
        let mut rng = Rng(2);
        let check = |rng: &mut Rng, len: usize, offset: usize, src_align: u64, dst_align: u64| {
            let src = rng.bitmap(bitmap_bytes(offset + len));
            let expected = naive::copy_bitmap(&src, offset, len);
            let mut dst = vec![0xA5u8; expected.len() + 20];
            copy_bitmap_chunked(
                &src,
                0x8000 + src_align,
                offset as u64,
                len as u64,
                &mut dst,
                0x10_0000 + dst_align,
            );
            assert_eq!(
                &dst[..expected.len()],
                &expected[..],
                "len {len} offset {offset} src_align {src_align} dst_align {dst_align}"
            );
            assert!(
                dst[expected.len()..].iter().all(|&b| b == 0xA5),
                "wrote past the end"
            );
        };
        for len in lengths() {
            let offset = rng.below(300) as usize;
            let sa = rng.below(16);
            let da = [0, 0, 4, 1][rng.below(4) as usize];
            check(&mut rng, len, offset, sa, da);
        }
        for sa in 0..16u64 {
            for offset in 0..140usize {
                for len in [1usize, 5, 8, 31, 32, 33, 127, 128, 129, 300, 1025] {
                    check(&mut rng, len, offset, sa, 0);
                }
            }
        }
        assert_eq!(
            copy_bitmap(&[0b1010_1100, 0xFF], 2, 9),
            vec![0b1110_1011, 0b1]
        );
    }

    #[test]
    fn unpack_bits_matches_naive_and_stays_in_bounds() {
        let mut rng = Rng(3);
        let check = |rng: &mut Rng, len: usize, offset: usize, src_align: u64, dst_align: u64| {
            let src = rng.bitmap(bitmap_bytes(offset + len));
            let expected = naive::unpack_bits(&src, offset, len);
            let mut dst = vec![0xA5u8; len + 40];
            unpack_bits_chunked(
                &src,
                0x8000 + src_align,
                offset as u64,
                len as u64,
                &mut dst,
                0x20_0000 + dst_align,
            );
            assert_eq!(
                &dst[..len],
                &expected[..],
                "len {len} offset {offset} sa {src_align}"
            );
            assert!(dst[len..].iter().all(|&b| b == 0xA5), "wrote past the end");
        };
        for len in lengths() {
            let offset = rng.below(300) as usize;
            let sa = rng.below(16);
            let da = [0, 0, 8, 3][rng.below(4) as usize];
            check(&mut rng, len, offset, sa, da);
        }
        for sa in 0..8u64 {
            for offset in 0..70usize {
                for len in [1usize, 4, 31, 32, 33, 64, 65, 300] {
                    check(&mut rng, len, offset, sa, 0);
                }
            }
        }
        assert_eq!(unpack_bits(&[0b0000_0110], 1, 3), vec![1, 1, 0]);
    }

    #[test]
    fn pack_bools_matches_naive_and_stays_in_bounds() {
        let mut rng = Rng(4);
        for len in lengths() {
            for (sa, da) in [(0u64, 0u64), (0, 2), (5, 0), (16, 4)] {
                let bools: Vec<u8> = match rng.below(3) {
                    0 => rng.bytes(len),
                    1 => (0..len).map(|_| rng.below(2) as u8).collect(),
                    _ => (0..len)
                        .map(|_| [0u8, 1, 0x80, 0x10][rng.below(4) as usize])
                        .collect(),
                };
                let expected = naive::pack_bools(&bools);
                let mut dst = vec![0xA5u8; expected.len() + 9];
                pack_bools_chunked(&bools, 0x4_0000 + sa, &mut dst, 0x9_0000 + da);
                assert_eq!(
                    &dst[..expected.len()],
                    &expected[..],
                    "len {len} sa {sa} da {da}"
                );
                assert!(dst[expected.len()..].iter().all(|&b| b == 0xA5));
            }
        }
        assert_eq!(pack_bools(&[1, 0, 2, 0, 0, 0, 0, 0, 0xFF]), vec![0b101, 1]);
    }

    #[test]
    fn pack_then_unpack_round_trips() {
        let mut rng = Rng(5);
        for len in [0usize, 1, 8, 33, 1000] {
            let bools: Vec<u8> = (0..len).map(|_| rng.below(2) as u8).collect();
            assert_eq!(unpack_bits(&pack_bools(&bools), 0, len), bools);
        }
    }

    #[test]
    fn batched_copy_matches_memcpy_for_every_alignment() {
        let mut rng = Rng(6);
        for len in lengths().into_iter().filter(|&l| l < 40_000) {
            let src = rng.bytes(len);
            let sa = rng.below(32);
            let da = rng.below(32);
            let mut dst = vec![0x5Au8; len + 8];
            copy_segment_chunked(&src, 0x7_0000 + sa, &mut dst[..len], 0x3_0000 + da);
            assert_eq!(&dst[..len], &src[..], "len {len} sa {sa} da {da}");
            assert!(dst[len..].iter().all(|&b| b == 0x5A));
        }
        // every alignment pair (every word offset q and shift of the shifted loops), with
        // lengths of no body, partial rounds, one full round and more
        for sa in 0..16u64 {
            for da in 0..16u64 {
                for len in [
                    0usize, 1, 3, 15, 16, 17, 31, 47, 48, 100, 1990, 2047, 2048, 2049, 4133,
                ] {
                    let src = rng.bytes(len);
                    let mut dst = vec![0u8; len];
                    copy_segment_chunked(&src, 0x100 + sa, &mut dst, 0x900 + da);
                    assert_eq!(dst, src, "len {len} sa {sa} da {da}");
                }
            }
        }
        // many segments at their real addresses, one longer than a piece
        let srcs: Vec<Vec<u8>> = [0usize, 1, 100, 5000, 70_000]
            .iter()
            .map(|&n| rng.bytes(n))
            .collect();
        let mut dsts: Vec<Vec<u8>> = srcs.iter().map(|s| vec![0u8; s.len()]).collect();
        let src_refs: Vec<&[u8]> = srcs.iter().map(|s| &s[..]).collect();
        let mut dst_refs: Vec<&mut [u8]> = dsts.iter_mut().map(|d| &mut d[..]).collect();
        batched_copy(&src_refs, &mut dst_refs);
        assert_eq!(dsts, srcs);
    }

    #[test]
    fn split_segments_covers_each_segment_exactly() {
        let segs = [
            CopySegment {
                src: 0,
                dst: 1000,
                len: 0,
            },
            CopySegment {
                src: 10,
                dst: 2000,
                len: 5,
            },
            CopySegment {
                src: 100,
                dst: 9000,
                len: 33,
            },
        ];
        let pieces = split_segments(&segs, 16);
        assert_eq!(
            pieces,
            vec![
                CopySegment {
                    src: 10,
                    dst: 2000,
                    len: 5
                },
                CopySegment {
                    src: 100,
                    dst: 9000,
                    len: 16
                },
                CopySegment {
                    src: 116,
                    dst: 9016,
                    len: 16
                },
                CopySegment {
                    src: 132,
                    dst: 9032,
                    len: 1
                },
            ]
        );
    }

    #[test]
    fn rebase_offsets_match_naive_for_every_alignment() {
        let mut rng = Rng(7);
        for n in lengths().into_iter().filter(|&l| l < 10_000) {
            let src32: Vec<i32> = (0..n).map(|_| rng.next_u64() as i32).collect();
            let src64: Vec<i64> = (0..n).map(|_| rng.next_u64() as i64).collect();
            let b32 = rng.next_u64() as i32;
            let b64 = rng.next_u64() as i64;
            for (sa, da) in [(0u64, 0u64), (4, 4), (8, 8), (12, 0), (4, 8), (0, 12)] {
                let mut out = vec![0i32; n];
                rebase_offsets_chunked(&src32, 0x1000 + sa, b32, &mut out, 0x9000 + da);
                assert_eq!(out, naive::rebase_offsets_i32(&src32, b32));
            }
            for (sa, da) in [(0u64, 0u64), (8, 8), (8, 0), (0, 8)] {
                let mut out = vec![0i64; n];
                rebase_offsets_chunked(&src64, 0x1000 + sa, b64, &mut out, 0x9000 + da);
                assert_eq!(out, naive::rebase_offsets_i64(&src64, b64));
            }
        }
        assert_eq!(rebase_offsets_i32(&[5, 7, 12], 5), vec![0, 2, 7]);
        assert_eq!(rebase_offsets_i64(&[i64::MIN, 0], 1), vec![i64::MAX, -1]);
    }

    #[test]
    fn edge_helpers_follow_ptx_semantics() {
        assert_eq!(mask_below(0), 0);
        assert_eq!(mask_below(5), 0b11111);
        assert_eq!(mask_below(32), u32::MAX);
        assert_eq!(funnel_right(0x8000_0001, 0x0000_0003, 1), 0xC000_0000);
        assert_eq!(funnel_right(7, 9, 0), 7);
        assert_eq!(funnel_right(7, 9, 32), 9);
    }
}
