//! The PTX kernels of `kernels/` and how to launch them.
//!
//! The PTX text is embedded at build time ([`VALIDITY_PTX`], [`COPY_PTX`], [`CONVERT_PTX`])
//! and JIT-loaded through cudarc the first time a kernel is launched in a context, once
//! per context ([`Kernels::for_context`]).
//!
//! `convert.ptx` holds the kernels of [`devarrow_abi::device::DeviceKernels`], which
//! [`crate::CudaDevice`] implements on its stream (all asynchronous; checked on the
//! emulated driver and through ptxas; on hardware in the two GPU runs, an H200 on
//! 2026-11-28 at `9615f3d` and on 2026-11-29 at `eb27dd8`, where `gpu`'s `device_kernels`
//! passed, see `docs/gpu-results.md`; the second ran [`launch_gather_views`]'s kernel,
//! `dvx_gather_views` (f17fc94), but not its narrowed offsets, which came later):
//! - [`launch_row_sizes`]: per-row sizes (string view lengths, list view sizes) as `i64`s,
//!   0 for null rows;
//! - [`inclusive_scan_i64`]: [`launch_scan_tiles_i64`] (a tile of [`SCAN_TILE`] items per
//!   block: warp scans with `shfl.sync.up`, warp totals in shared memory), the tile
//!   totals scanned recursively in a stream-ordered temporary buffer, then
//!   [`launch_add_tile_prefix_i64`];
//! - [`launch_gather_views`]: the gather of `DeviceKernels::gather_view_bytes`, a warp per
//!   32 rows whose lanes write the rows' contiguous output bytes (inline bytes from the
//!   views themselves, others from the variadic buffers), with no descriptor table; with
//!   `gather_view_bytes_narrowed`, each lane also writes its row's offset as an `int32`
//!   (the libcudf conversion's offsets, without a pass of their own);
//! - [`launch_narrow_i64_i32`], [`launch_widen_decimals`], [`launch_fill_offsets_i32`],
//!   [`launch_compare_list_offsets`]: one thread per item;
//! - [`launch_gather_list_values`] (a thread per output value) and
//!   [`launch_gather_list_bits`] (a warp per output word, `vote.sync.ballot`): the row of
//!   each output found by binary search in the new offsets; one wave of blocks, as the
//!   total is only known on the device;
//! - [`launch_offsets_to_views`]: one thread per value, the `Utf8View` view of a value of
//!   an array with offsets (a list view's string child, put in list order by a gather of
//!   its views).
//!
//! `DeviceKernels::count_set_bits` reuses `validity.ptx`'s [`launch_count_set_bits`] after
//! a stream-ordered memset of the counter.
//!
//! The files: `cache.rs` loads the PTX once per context ([`Kernels`]), `launch.rs` holds
//! the `unsafe` launches, this file the constants and the safe API; `segments.rs` cuts
//! batched copies into descriptors.
//!
//! Two levels of API:
//! - `launch_*` (`unsafe`): enqueue one kernel on a stream with raw device addresses and
//!   return at once — what pipelines and benchmarks use.
//! - the safe wrappers ([`count_set_bits`], [`copy_bitmap`], ...): check lengths, device
//!   and alignment, launch, and return after the work completed (so host-visible memory
//!   is never raced).
//!
//! Every kernel has a CPU reference implementation, the oracle of the GPU tests and of
//! the emulated-driver tests:
//! - `copy.ptx` and `validity.ptx`: in the test-support crate (`tests/support`,
//!   `devarrow_testing::kernel_oracles`), which also replays their algorithms step by step;
//! - `convert.ptx`: the CPU implementation of the same trait,
//!   [`devarrow_abi::device::CpuKernels`]: the kernels are checked against it one by one
//!   in `tests/ptx_kernels.rs` (PTX interpreter) and method by method through
//!   [`CudaDevice::kernels`](crate::CudaDevice) in `tests/gpu.rs` (`device_kernels`).
//!
//! Grids: blocks of [`BLOCK_SIZE`] threads, `min(ceil(items / BLOCK_SIZE),
//! resident blocks per multiprocessor * multiprocessors)` blocks with grid-stride loops
//! (see the header of each `.ptx`). The resident blocks are the driver's occupancy of
//! each kernel, so a grid fills the device in one wave whatever registers the JIT gave
//! the kernel.

mod cache;
mod launch;
mod segments;

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::error::{CudaError, Result};
use crate::memory::{CudaMemory, CudaMemoryMut, DeviceBuffer};
pub use cache::{load_module, Kernels};
pub use launch::{
    inclusive_scan_i64, launch_add_tile_prefix_i64, launch_batched_copy,
    launch_compare_list_offsets, launch_copy_bitmap, launch_count_set_bits,
    launch_fill_offsets_i32, launch_gather_list_bits, launch_gather_list_values,
    launch_gather_views, launch_narrow_i64_i32, launch_offsets_to_views, launch_pack_bools,
    launch_rebase_offsets_i32, launch_rebase_offsets_i64, launch_row_sizes, launch_scan_tiles_i64,
    launch_unpack_bits, launch_widen_decimals,
};
pub use segments::{
    piece_size, plan_pieces, split_segments, CopySegment, COPY_ROUND, MAX_COPY_PIECE,
    MIN_COPY_PIECE,
};

/// `kernels/validity.ptx`: bit counting, bitmap realignment, pack and unpack.
pub const VALIDITY_PTX: &str = include_str!("../../kernels/validity.ptx");
/// `kernels/copy.ptx`: batched copy and offset rebasing.
pub const COPY_PTX: &str = include_str!("../../kernels/copy.ptx");
/// `kernels/convert.ptx`: the kernels of [`devarrow_abi::device::DeviceKernels`] (row
/// sizes, tiled scan, the gather of views' bytes, narrowing, decimal widening, list offsets
/// and gathers).
pub const CONVERT_PTX: &str = include_str!("../../kernels/convert.ptx");

/// Items per tile of `dvx_scan_tiles_i64` launched with [`BLOCK_SIZE`] threads (four per
/// thread).
pub const SCAN_TILE: u64 = 4 * BLOCK_SIZE as u64;

/// Threads per block of every launch.
pub const BLOCK_SIZE: u32 = 256;

/// The descriptors of one `dvx_batched_copy` launch on `stream` copying `segments`:
/// [`plan_pieces`] for the device's resident warps of the kernel (loading the kernels
/// in `stream`'s context if needed).
pub fn plan_batched_copy(
    stream: &CudaStream,
    segments: &[CopySegment],
) -> Result<Vec<CopySegment>> {
    let warps = Kernels::for_stream(stream)?.batched_copy_warps();
    Ok(plan_pieces(segments, warps))
}

fn check_len(what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(CudaError::InvalidArgument(format!(
            "{what} holds {have} bytes, {need} are needed"
        )));
    }
    Ok(())
}

/// Checks that a kernel on `stream`'s device can address `mem` (CUDA memory must be on
/// the same device; pinned and managed memory is visible to every device).
/// Checks that `mem` can be used on `stream`'s device, and orders `stream` after the work
/// that makes it ready ([`CudaMemory::order_on`]).
fn check_device(stream: &CudaStream, mem: &impl CudaMemory) -> Result<()> {
    let expected = stream.context().ordinal() as i64;
    let t = mem.device_type();
    if !t.is_cuda() {
        return Err(CudaError::UnsupportedDeviceType {
            found: t,
            expected: "ARROW_DEVICE_CUDA, ARROW_DEVICE_CUDA_HOST or ARROW_DEVICE_CUDA_MANAGED",
        });
    }
    if t == devarrow_abi::ArrowDeviceType::CUDA && mem.device_id() != expected {
        return Err(CudaError::DeviceMismatch {
            expected,
            found: mem.device_id(),
        });
    }
    // e.g. an imported buffer used on another stream than the import's
    mem.order_on(stream)
}

fn checked_bits(offset: usize, len: usize) -> Result<usize> {
    offset
        .checked_add(len)
        .map(|b| b.div_ceil(8))
        .ok_or_else(|| CudaError::InvalidArgument("bit range overflows".into()))
}

fn synchronize(stream: &CudaStream) -> Result<()> {
    crate::context::sync_stream(stream)
}

/// Counts the set bits of bits `[offset, offset + len)` of `bitmap` on the GPU (a null
/// count is `len` minus this). Blocks until done.
pub fn count_set_bits(
    stream: &Arc<CudaStream>,
    bitmap: &impl CudaMemory,
    offset: usize,
    len: usize,
) -> Result<u64> {
    check_device(stream, bitmap)?;
    check_len("bitmap", bitmap.len(), checked_bits(offset, len)?)?;
    if len == 0 {
        return Ok(0);
    }
    let counter = DeviceBuffer::zeroed(stream, 8)?;
    // SAFETY: the bitmap holds the bytes checked above and is borrowed until we
    // synchronize; the counter is ours, zeroed, 8 bytes.
    unsafe {
        launch_count_set_bits(
            stream,
            bitmap.device_ptr(),
            offset as u64,
            len as u64,
            counter.device_ptr(),
        )?
    };
    let mut out = [0u64; 1];
    if let Err(e) = counter.copy_to_host(stream, &mut out) {
        // The kernel may still read the caller's bitmap: it must be done before we return.
        let _ = synchronize(stream);
        return Err(e);
    }
    Ok(out[0])
}

/// Copies bits `[src_offset, src_offset + len)` of `src` to bits `[0, len)` of `dst`
/// (realigning a sliced validity bitmap); writes `ceil(len/8)` bytes, trailing bits
/// zero. Blocks until done.
pub fn copy_bitmap(
    stream: &Arc<CudaStream>,
    src: &impl CudaMemory,
    src_offset: usize,
    len: usize,
    dst: &mut impl CudaMemoryMut,
) -> Result<()> {
    check_device(stream, src)?;
    check_device(stream, dst)?;
    check_len("source bitmap", src.len(), checked_bits(src_offset, len)?)?;
    check_len("destination bitmap", dst.len(), len.div_ceil(8))?;
    // SAFETY: lengths checked above; `dst` is exclusively borrowed and `src` borrowed
    // until we synchronize; `&mut dst` and `&src` cannot alias.
    unsafe {
        launch_copy_bitmap(
            stream,
            src.device_ptr(),
            src_offset as u64,
            len as u64,
            dst.device_ptr(),
        )?
    };
    synchronize(stream)
}

/// Unpacks bits `[src_offset, src_offset + len)` of `src` into `len` bytes (0 or 1) at the
/// start of `dst`. Blocks until done.
pub fn unpack_bits(
    stream: &Arc<CudaStream>,
    src: &impl CudaMemory,
    src_offset: usize,
    len: usize,
    dst: &mut impl CudaMemoryMut,
) -> Result<()> {
    check_device(stream, src)?;
    check_device(stream, dst)?;
    check_len("source bitmap", src.len(), checked_bits(src_offset, len)?)?;
    check_len("destination", dst.len(), len)?;
    // SAFETY: lengths checked; borrows last until we synchronize.
    unsafe {
        launch_unpack_bits(
            stream,
            src.device_ptr(),
            src_offset as u64,
            len as u64,
            dst.device_ptr(),
        )?
    };
    synchronize(stream)
}

/// Packs the first `len` one-byte booleans of `src` (nonzero = true) into a bitmap at the
/// start of `dst`; writes `ceil(len/8)` bytes, trailing bits zero. Blocks until done.
pub fn pack_bools(
    stream: &Arc<CudaStream>,
    src: &impl CudaMemory,
    len: usize,
    dst: &mut impl CudaMemoryMut,
) -> Result<()> {
    check_device(stream, src)?;
    check_device(stream, dst)?;
    check_len("source", src.len(), len)?;
    check_len("destination bitmap", dst.len(), len.div_ceil(8))?;
    // SAFETY: lengths checked; borrows last until we synchronize.
    unsafe { launch_pack_bools(stream, src.device_ptr(), len as u64, dst.device_ptr())? };
    synchronize(stream)
}

fn check_offsets(
    stream: &CudaStream,
    src: &impl CudaMemory,
    dst: &impl CudaMemory,
    n: usize,
    size: usize,
) -> Result<()> {
    check_device(stream, src)?;
    check_device(stream, dst)?;
    let bytes = n
        .checked_mul(size)
        .ok_or_else(|| CudaError::InvalidArgument("offset count overflows".into()))?;
    check_len("source offsets", src.len(), bytes)?;
    check_len("destination offsets", dst.len(), bytes)?;
    if n > 0
        && (!src.device_ptr().is_multiple_of(size as u64)
            || !dst.device_ptr().is_multiple_of(size as u64))
    {
        return Err(CudaError::InvalidArgument(format!(
            "offsets must be {size}-byte aligned"
        )));
    }
    Ok(())
}

/// `dst[i] = src[i] - base` for the first `n` `i32` offsets (rebasing the offsets of a
/// sliced variable-length array to start at 0). Blocks until done.
pub fn rebase_offsets_i32(
    stream: &Arc<CudaStream>,
    src: &impl CudaMemory,
    n: usize,
    base: i32,
    dst: &mut impl CudaMemoryMut,
) -> Result<()> {
    check_offsets(stream, src, dst, n, 4)?;
    // SAFETY: lengths and alignment checked; borrows last until we synchronize.
    unsafe {
        launch_rebase_offsets_i32(stream, src.device_ptr(), n as u64, base, dst.device_ptr())?
    };
    synchronize(stream)
}

/// `dst[i] = src[i] - base` for the first `n` `i64` offsets. Blocks until done.
pub fn rebase_offsets_i64(
    stream: &Arc<CudaStream>,
    src: &impl CudaMemory,
    n: usize,
    base: i64,
    dst: &mut impl CudaMemoryMut,
) -> Result<()> {
    check_offsets(stream, src, dst, n, 8)?;
    // SAFETY: lengths and alignment checked; borrows last until we synchronize.
    unsafe {
        launch_rebase_offsets_i64(stream, src.device_ptr(), n as u64, base, dst.device_ptr())?
    };
    synchronize(stream)
}

/// Copies every segment in one kernel launch: cuts them into pieces
/// ([`plan_batched_copy`]), uploads the descriptors (stream-ordered) and enqueues
/// `dvx_batched_copy`. The descriptor upload is synchronous (from pageable memory); the
/// copy itself is enqueued, and this returns without waiting for it (the descriptor table
/// is freed in stream order after the kernel). [`crate::CudaDevice`]'s
/// `copy_on_device` uploads from reused pinned memory instead, without blocking.
///
/// # Safety
/// Every segment's source must be readable and destination writable by `stream`'s device
/// for `len` bytes until the copy completes, and no destination may overlap another
/// destination or a source.
pub unsafe fn batched_copy(stream: &Arc<CudaStream>, segments: &[CopySegment]) -> Result<()> {
    let pieces = plan_batched_copy(stream, segments)?;
    if pieces.is_empty() {
        return Ok(());
    }
    let mut table = DeviceBuffer::alloc(stream, std::mem::size_of_val(&pieces[..]))?;
    let flat: Vec<u64> = pieces.iter().flat_map(|p| [p.src, p.dst, p.len]).collect();
    table.copy_from_host(stream, &flat)?;
    // SAFETY: the table holds `pieces.len()` descriptors and is freed in stream order
    // after this launch (dropped below, freed on `stream`); the ranges are the caller's
    // guarantee.
    unsafe { launch_batched_copy(stream, table.device_ptr(), pieces.len() as u64) }
}
