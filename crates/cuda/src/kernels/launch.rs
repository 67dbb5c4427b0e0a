//! The `unsafe` launches: each enqueues one kernel on a stream with raw device addresses
//! and returns at once (what pipelines and benchmarks use); the safe wrappers of
//! `kernels/mod.rs` check their arguments and call these.

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{Kernels, BLOCK_SIZE, SCAN_TILE};
use crate::error::{CudaError, DriverResultExt, Result};
use crate::memory::{CudaMemory, DeviceBuffer};

/// Enqueues `dvx_count_set_bits`: adds the number of set bits of bits
/// `[offset, offset + len)` of the bitmap at `bitmap` to the `u64` at `out`.
/// Nothing is launched when `len == 0`.
///
/// # Safety
/// `bitmap` must be device-accessible for `ceil((offset + len) / 8)` bytes and `out`
/// for 8 writable, 8-byte-aligned bytes (the kernel adds to it atomically; zeroed by the
/// caller for a plain count) until the kernel completes.
pub unsafe fn launch_count_set_bits(
    stream: &CudaStream,
    bitmap: u64,
    offset: u64,
    len: u64,
    out: u64,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    if !out.is_multiple_of(8) {
        return Err(CudaError::InvalidArgument(format!(
            "the bit counter at {out:#x} is not 8-byte aligned"
        )));
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.count_set_bits.config(len.div_ceil(128) + 1);
    let mut b = stream.launch_builder(&k.count_set_bits.function);
    b.arg(&bitmap).arg(&offset).arg(&len).arg(&out);
    // SAFETY: the argument list matches the kernel's (u64, u64, u64, u64); the ranges are
    // the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_copy_bitmap`: bits `[src_offset, src_offset + len)` at `src` to bits
/// `[0, len)` at `dst` (exactly `ceil(len/8)` bytes written, trailing bits zero).
///
/// # Safety
/// `src` must be readable for `ceil((src_offset + len) / 8)` bytes and `dst` writable for
/// `ceil(len / 8)` bytes, not overlapping, until the kernel completes.
pub unsafe fn launch_copy_bitmap(
    stream: &CudaStream,
    src: u64,
    src_offset: u64,
    len: u64,
    dst: u64,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.copy_bitmap.config(len.div_ceil(8).div_ceil(16));
    let mut b = stream.launch_builder(&k.copy_bitmap.function);
    b.arg(&src).arg(&src_offset).arg(&len).arg(&dst);
    // SAFETY: arguments match (u64, u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_unpack_bits`: one byte (0 or 1) per bit of bits
/// `[src_offset, src_offset + len)` at `src`, written to `dst[0..len]`.
///
/// # Safety
/// `src` readable for `ceil((src_offset + len) / 8)` bytes, `dst` writable for `len`
/// bytes, not overlapping, until the kernel completes.
pub unsafe fn launch_unpack_bits(
    stream: &CudaStream,
    src: u64,
    src_offset: u64,
    len: u64,
    dst: u64,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.unpack_bits.config(len.div_ceil(32));
    let mut b = stream.launch_builder(&k.unpack_bits.function);
    b.arg(&src).arg(&src_offset).arg(&len).arg(&dst);
    // SAFETY: arguments match (u64, u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_pack_bools`: the `len` one-byte booleans at `src` (nonzero = true) to a
/// bitmap at `dst` (exactly `ceil(len/8)` bytes written, trailing bits zero).
///
/// # Safety
/// `src` readable for `len` bytes, `dst` writable for `ceil(len / 8)` bytes, not
/// overlapping, until the kernel completes.
pub unsafe fn launch_pack_bools(stream: &CudaStream, src: u64, len: u64, dst: u64) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.pack_bools.config(len.div_ceil(32));
    let mut b = stream.launch_builder(&k.pack_bools.function);
    b.arg(&src).arg(&len).arg(&dst);
    // SAFETY: arguments match (u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_batched_copy` over `n` [`CopySegment`](super::CopySegment) descriptors already in device
/// memory at `segments` (one warp per descriptor at a time; cut copies with
/// [`plan_batched_copy`](super::plan_batched_copy) first, as [`batched_copy`](super::batched_copy) does). `n` must be below 2^31.
///
/// # Safety
/// `segments` must hold `n` descriptors readable by the device, each at most
/// [`MAX_COPY_PIECE`](super::MAX_COPY_PIECE) bytes long, and each descriptor's ranges must be valid (source
/// readable, destination writable, destinations not overlapping each other or any
/// source) until the kernel completes.
pub unsafe fn launch_batched_copy(stream: &CudaStream, segments: u64, n: u64) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if n >= 1 << 31 {
        return Err(CudaError::InvalidArgument(format!(
            "{n} copy descriptors in one launch; at most 2^31 - 1"
        )));
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.batched_copy.config(n * 32);
    let mut b = stream.launch_builder(&k.batched_copy.function);
    b.arg(&segments).arg(&n);
    // SAFETY: arguments match (u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_rebase_offsets_i32`: `dst[i] = src[i] - base` for `i < n`.
///
/// # Safety
/// `src` readable and `dst` writable for `n` 4-byte-aligned `i32`s until the kernel
/// completes; they may be the same address (in place) but must not otherwise overlap.
pub unsafe fn launch_rebase_offsets_i32(
    stream: &CudaStream,
    src: u64,
    n: u64,
    base: i32,
    dst: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.rebase_i32.config(n.div_ceil(4));
    let mut b = stream.launch_builder(&k.rebase_i32.function);
    b.arg(&src).arg(&n).arg(&base).arg(&dst);
    // SAFETY: arguments match (u64, u64, u32, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_rebase_offsets_i64`: `dst[i] = src[i] - base` for `i < n`.
///
/// # Safety
/// As [`launch_rebase_offsets_i32`], with 8-byte-aligned `i64`s.
pub unsafe fn launch_rebase_offsets_i64(
    stream: &CudaStream,
    src: u64,
    n: u64,
    base: i64,
    dst: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.rebase_i64.config(n.div_ceil(2));
    let mut b = stream.launch_builder(&k.rebase_i64.function);
    b.arg(&src).arg(&n).arg(&base).arg(&dst);
    // SAFETY: arguments match (u64, u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_row_sizes`: `out[0] = 0`, `out[i + 1]` = the size of row `i` (the `u32`,
/// or `u64` when `wide`, at `src + i * stride`; 0 for a row whose bit `bit_offset + i`
/// of the bitmap at `validity` is clear, `validity` 0: every row valid), `i < n`.
///
/// # Safety
/// `src` readable for `n` rows and naturally aligned (as `stride`), `validity` (if not 0)
/// for `bit_offset + n` bits, `out` writable for `n + 1` 8-byte-aligned `i64`s, not
/// overlapping the others, until the kernel completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_row_sizes(
    stream: &CudaStream,
    src: u64,
    stride: u64,
    wide: bool,
    validity: u64,
    bit_offset: u64,
    n: u64,
    out: u64,
) -> Result<()> {
    let k = Kernels::for_stream(stream)?;
    let cfg = k.row_sizes.config(n + 1);
    let wide = wide as u32;
    let mut b = stream.launch_builder(&k.row_sizes.function);
    b.arg(&src)
        .arg(&stride)
        .arg(&wide)
        .arg(&validity)
        .arg(&bit_offset)
        .arg(&n)
        .arg(&out);
    // SAFETY: arguments match (u64, u64, u32, u64, u64, u64, u64); ranges are the
    // caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_scan_tiles_i64`: an inclusive scan in place of each [`SCAN_TILE`] items
/// of the `n` `i64`s at `data`, the total of tile `t` written to `tile_sums[t]` when
/// `tile_sums` is not 0. One block per tile. Nothing is launched when `n == 0`.
///
/// # Safety
/// `data` readable and writable for `n` 8-byte-aligned `i64`s, `tile_sums` (if not 0)
/// writable for `ceil(n / SCAN_TILE)` of them, until the kernel completes.
pub unsafe fn launch_scan_tiles_i64(
    stream: &CudaStream,
    data: u64,
    n: u64,
    tile_sums: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let tiles = n.div_ceil(SCAN_TILE);
    if tiles >= 1 << 31 {
        return Err(CudaError::InvalidArgument(format!(
            "a scan of {n} items needs {tiles} blocks; at most 2^31 - 1"
        )));
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = LaunchConfig {
        grid_dim: (tiles as u32, 1, 1),
        block_dim: (BLOCK_SIZE, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&k.scan_tiles.function);
    b.arg(&data).arg(&n).arg(&tile_sums);
    // SAFETY: arguments match (u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_add_tile_prefix_i64`: `data[i] += tile_sums[i / SCAN_TILE - 1]` for
/// `SCAN_TILE <= i < n`. Nothing is launched when `n <= SCAN_TILE`.
///
/// # Safety
/// `data` readable and writable for `n` 8-byte-aligned `i64`s, `tile_sums` readable for
/// `ceil(n / SCAN_TILE) - 1` of them, not overlapping, until the kernel completes.
pub unsafe fn launch_add_tile_prefix_i64(
    stream: &CudaStream,
    data: u64,
    n: u64,
    tile_sums: u64,
) -> Result<()> {
    if n <= SCAN_TILE {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.add_tile_prefix.config(n - SCAN_TILE);
    let mut b = stream.launch_builder(&k.add_tile_prefix.function);
    b.arg(&data).arg(&n).arg(&tile_sums).arg(&SCAN_TILE);
    // SAFETY: arguments match (u64, u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Inclusive prefix sum in place (wrapping) of the `n` `i64`s at `data`, enqueued on
/// `stream`: [`launch_scan_tiles_i64`], the tile totals scanned the same way (in a
/// stream-ordered temporary buffer, freed in stream order after the work), then
/// [`launch_add_tile_prefix_i64`]. Returns once enqueued (a device without stream-ordered
/// allocation synchronizes `stream` when a temporary buffer is freed).
///
/// # Safety
/// `data` readable and writable for `n` 8-byte-aligned `i64`s until the work completes.
pub unsafe fn inclusive_scan_i64(stream: &Arc<CudaStream>, data: u64, n: u64) -> Result<()> {
    if n <= SCAN_TILE {
        // SAFETY: the caller's guarantee.
        return unsafe { launch_scan_tiles_i64(stream, data, n, 0) };
    }
    let tiles = n.div_ceil(SCAN_TILE);
    let sums = DeviceBuffer::alloc(stream, (tiles * 8) as usize)?;
    // SAFETY: `sums` holds `tiles` i64s (256-byte aligned) and lives until the work is
    // enqueued (freed in stream order after it); `data` is the caller's guarantee.
    unsafe {
        launch_scan_tiles_i64(stream, data, n, sums.device_ptr())?;
        inclusive_scan_i64(stream, sums.device_ptr(), tiles)?;
        launch_add_tile_prefix_i64(stream, data, n, sums.device_ptr())
    }
}

/// Enqueues `dvx_gather_views`: the bytes of view `i < n` (16 bytes at `views + 16 i`;
/// inline when at most 12, else at `buffers[index] + offset`) to `out + offsets[i]`,
/// none for a null row; with `narrow` (not 0), also `narrow[i] = offsets[i] as i32` for
/// `i <= n`. A warp per 32 consecutive rows, whose output is contiguous.
///
/// # Safety
/// `views` readable for `n` 4-byte-aligned views, `validity` (if not 0) for
/// `bit_offset + n` bits, `buffers` for the `u64` of every valid out-of-line view's
/// buffer index and each such view's bytes in its buffer, `offsets` for `n + 1`
/// 8-byte-aligned `i64`s, the scan of the rows' sizes (0 for a null row), `out` writable
/// for `offsets[0]..offsets[n]` and overlapping nothing read, `narrow` (if not 0)
/// writable for `n + 1` 4-byte-aligned `i32`s, overlapping nothing else, until the kernel
/// completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_gather_views(
    stream: &CudaStream,
    views: u64,
    validity: u64,
    bit_offset: u64,
    n: u64,
    buffers: u64,
    offsets: u64,
    out: u64,
    narrow: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    // the largest group the lanes write byte by byte in 32-bit arithmetic (larger ones,
    // rows of gigabytes, go row by row)
    let lane_bytes: u64 = 1 << 31;
    let k = Kernels::for_stream(stream)?;
    // a warp per group of 32 rows (BLOCK_SIZE is a multiple of 32, as the kernel needs)
    let cfg = k.gather_views.config(32 * n.div_ceil(32));
    let mut b = stream.launch_builder(&k.gather_views.function);
    b.arg(&views)
        .arg(&validity)
        .arg(&bit_offset)
        .arg(&n)
        .arg(&buffers)
        .arg(&offsets)
        .arg(&out)
        .arg(&lane_bytes)
        .arg(&narrow);
    // SAFETY: arguments match (9 u64s); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_narrow_i64_i32`: `dst[i] = src[i] as i32`, `i < n`.
///
/// # Safety
/// `src` readable for `n` 8-byte-aligned `i64`s, `dst` writable for `n` 4-byte-aligned
/// `i32`s, not overlapping, until the kernel completes.
pub unsafe fn launch_narrow_i64_i32(stream: &CudaStream, src: u64, n: u64, dst: u64) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.narrow.config(n);
    let mut b = stream.launch_builder(&k.narrow.function);
    b.arg(&src).arg(&n).arg(&dst);
    // SAFETY: arguments match (u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_widen_decimals`: the `n` `width`-byte (4 or 8) integers at `src`
/// sign-extended to 16 bytes each at `dst`.
///
/// # Safety
/// `width` 4 or 8; `src` readable for `n` naturally aligned integers, `dst` writable for
/// `16 n` bytes, 8-byte aligned, not overlapping, until the kernel completes.
pub unsafe fn launch_widen_decimals(
    stream: &CudaStream,
    src: u64,
    width: u64,
    n: u64,
    dst: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    if width != 4 && width != 8 {
        return Err(CudaError::InvalidArgument(format!(
            "decimals of {width} bytes; 4 or 8 are widened"
        )));
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.widen_decimals.config(n);
    let mut b = stream.launch_builder(&k.widen_decimals.function);
    b.arg(&src).arg(&width).arg(&n).arg(&dst);
    // SAFETY: arguments match (u64, u64, u64, u64); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_fill_offsets_i32`: `dst[i] = i * step` (wrapping), `i < n`.
///
/// # Safety
/// `dst` writable for `n` 4-byte-aligned `i32`s until the kernel completes.
pub unsafe fn launch_fill_offsets_i32(
    stream: &CudaStream,
    dst: u64,
    n: u64,
    step: u32,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.fill_offsets.config(n);
    let mut b = stream.launch_builder(&k.fill_offsets.function);
    b.arg(&dst).arg(&n).arg(&step);
    // SAFETY: arguments match (u64, u64, u32); ranges are the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_compare_list_offsets`: the `u32` 1 to `mismatch` when a row `i < n` with
/// `expected[i + 1] > expected[i]` has an offset (at `offsets + i * stride`, `i32`
/// sign-extended or `i64` when `wide`) other than `expected[i]`.
///
/// # Safety
/// `offsets` readable for `n` naturally aligned rows, `expected` for `n + 1`
/// 8-byte-aligned `i64`s, `mismatch` writable for a 4-byte-aligned `u32`, until the
/// kernel completes.
pub unsafe fn launch_compare_list_offsets(
    stream: &CudaStream,
    offsets: u64,
    stride: u64,
    wide: bool,
    n: u64,
    expected: u64,
    mismatch: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.compare_offsets.config(n);
    let wide = wide as u32;
    let mut b = stream.launch_builder(&k.compare_offsets.function);
    b.arg(&offsets)
        .arg(&stride)
        .arg(&wide)
        .arg(&n)
        .arg(&expected)
        .arg(&mismatch);
    // SAFETY: arguments match (u64, u64, u32, u64, u64, u64); ranges are the caller's
    // guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_gather_list_values` (one wave: the number of values is read on the
/// device): value `e < new_offsets[n]` of `dst` (`width` bytes) from child value
/// `child_offset + offsets[i] + e - new_offsets[i]`, `i` the row of `e`.
///
/// # Safety
/// `new_offsets` readable for `n + 1` non-decreasing 8-byte-aligned `i64`s, `offsets`
/// for `n` naturally aligned rows, `child` at every value reached, `dst` writable for
/// `new_offsets[n]` values, overlapping nothing read, until the kernel completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_gather_list_values(
    stream: &CudaStream,
    child: u64,
    width: u64,
    child_offset: u64,
    offsets: u64,
    stride: u64,
    wide: bool,
    n: u64,
    new_offsets: u64,
    dst: u64,
) -> Result<()> {
    let k = Kernels::for_stream(stream)?;
    let cfg = k.gather_values.config(u64::MAX);
    let wide = wide as u32;
    let mut b = stream.launch_builder(&k.gather_values.function);
    b.arg(&child)
        .arg(&width)
        .arg(&child_offset)
        .arg(&offsets)
        .arg(&stride)
        .arg(&wide)
        .arg(&n)
        .arg(&new_offsets)
        .arg(&dst);
    // SAFETY: arguments match (u64, u64, u64, u64, u64, u32, u64, u64, u64); ranges are
    // the caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_gather_list_bits` (one wave): the bits of
/// [`launch_gather_list_values`]'s gather, `ceil(new_offsets[n] / 32)` whole `u32` words
/// written at `dst`, bits past `new_offsets[n]` zero.
///
/// # Safety
/// As [`launch_gather_list_values`], `bits` readable at every bit reached; `dst` 4-byte
/// aligned and writable for those words.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_gather_list_bits(
    stream: &CudaStream,
    bits: u64,
    bit_offset: u64,
    offsets: u64,
    stride: u64,
    wide: bool,
    n: u64,
    new_offsets: u64,
    dst: u64,
) -> Result<()> {
    let k = Kernels::for_stream(stream)?;
    let cfg = k.gather_bits.config(u64::MAX);
    let wide = wide as u32;
    let mut b = stream.launch_builder(&k.gather_bits.function);
    b.arg(&bits)
        .arg(&bit_offset)
        .arg(&offsets)
        .arg(&stride)
        .arg(&wide)
        .arg(&n)
        .arg(&new_offsets)
        .arg(&dst);
    // SAFETY: arguments match (u64, u64, u64, u64, u32, u64, u64, u64); ranges are the
    // caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}

/// Enqueues `dvx_offsets_to_views`: view `j < n` (16 bytes at `views + 16 j`) of value
/// `indices[j]` (an `int32`) of an array with offsets at `offsets` (`int32`, or `int64`
/// when `wide`; `stride` bytes apart) and bytes at `data`, in the layout of `Utf8View`
/// (inline up to 12 bytes, else prefix, buffer index 0 and the start as a `u32`).
///
/// # Safety
/// `indices` readable for `n` 4-byte-aligned `int32`s, the offsets they reach and the
/// bytes between them readable, every start below 2^32; `views` writable for `16 n`
/// bytes, 16-byte aligned; until the kernel completes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch_offsets_to_views(
    stream: &CudaStream,
    offsets: u64,
    stride: u64,
    wide: bool,
    data: u64,
    indices: u64,
    n: u64,
    views: u64,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let k = Kernels::for_stream(stream)?;
    let cfg = k.offsets_to_views.config(n);
    let wide = wide as u32;
    let mut b = stream.launch_builder(&k.offsets_to_views.function);
    b.arg(&offsets)
        .arg(&stride)
        .arg(&wide)
        .arg(&data)
        .arg(&indices)
        .arg(&n)
        .arg(&views);
    // SAFETY: arguments match (u64, u64, u32, u64, u64, u64, u64); ranges are the
    // caller's guarantee.
    unsafe { b.launch(cfg) }.call("cuLaunchKernel")?;
    Ok(())
}
