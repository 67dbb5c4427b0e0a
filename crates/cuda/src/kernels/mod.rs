//! The PTX kernels of `kernels/` and how to launch them.
//!
//! The PTX text is embedded at build time ([`VALIDITY_PTX`], [`COPY_PTX`], [`CONVERT_PTX`])
//! and JIT-loaded through cudarc the first time a kernel is launched in a context, once
//! per context ([`Kernels::for_context`]).
//!
//! `convert.ptx` holds the kernels of [`devarrow_abi::device::DeviceKernels`], which
//! [`crate::CudaDevice`] implements on its stream (all asynchronous; checked on the
//! emulated driver and through ptxas; on hardware only in the one GPU run, an H200 on
//! 2026-11-28 at `9615f3d`, where `gpu`'s `device_kernels` passed, see
//! `docs/gpu-results.md`: that run predates [`launch_gather_views`]'s kernel,
//! `dvx_gather_views` (f17fc94), which has never run on a GPU, nor has anything since):
//! - [`launch_row_sizes`]: per-row sizes (string view lengths, list view sizes) as `i64`s,
//!   0 for null rows;
//! - [`inclusive_scan_i64`]: [`launch_scan_tiles_i64`] (a tile of [`SCAN_TILE`] items per
//!   block: warp scans with `shfl.sync.up`, warp totals in shared memory), the tile
//!   totals scanned recursively in a stream-ordered temporary buffer, then
//!   [`launch_add_tile_prefix_i64`];
//! - [`launch_gather_views`]: the gather of `DeviceKernels::gather_view_bytes`, a warp per
//!   32 rows whose lanes write the rows' contiguous output bytes (inline bytes from the
//!   views themselves, others from the variadic buffers), with no descriptor table;
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

mod segments;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::error::{CudaError, DriverResultExt, Result};
use crate::memory::{CudaMemory, CudaMemoryMut, DeviceBuffer};
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

/// One loaded kernel and the largest grid that is resident at once on the device.
#[derive(Debug)]
struct Kernel {
    function: CudaFunction,
    /// Resident blocks of [`BLOCK_SIZE`] threads per multiprocessor (the driver's
    /// occupancy for this kernel's registers) times the multiprocessors.
    max_blocks: u32,
}

impl Kernel {
    fn load(module: &Arc<CudaModule>, name: &str, multiprocessors: u32) -> Result<Self> {
        let function = module.load_function(name).call("cuModuleGetFunction")?;
        let per_multiprocessor = function
            .occupancy_max_active_blocks_per_multiprocessor(BLOCK_SIZE, 0, None)
            .call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
        Ok(Kernel {
            function,
            max_blocks: per_multiprocessor.max(1).saturating_mul(multiprocessors),
        })
    }

    /// The launch configuration for `items` work items (grid-stride kernels): one block
    /// per [`BLOCK_SIZE`] items, at most one resident wave.
    fn config(&self, items: u64) -> LaunchConfig {
        let blocks = items
            .div_ceil(BLOCK_SIZE as u64)
            .clamp(1, self.max_blocks as u64);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (BLOCK_SIZE, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The kernels, loaded into one context.
#[derive(Debug)]
pub struct Kernels {
    count_set_bits: Kernel,
    copy_bitmap: Kernel,
    unpack_bits: Kernel,
    pack_bools: Kernel,
    batched_copy: Kernel,
    rebase_i32: Kernel,
    rebase_i64: Kernel,
    row_sizes: Kernel,
    scan_tiles: Kernel,
    add_tile_prefix: Kernel,
    gather_views: Kernel,
    narrow: Kernel,
    widen_decimals: Kernel,
    fill_offsets: Kernel,
    compare_offsets: Kernel,
    gather_values: Kernel,
    gather_bits: Kernel,
    offsets_to_views: Kernel,
    /// The context they were loaded in.
    context: usize,
    _modules: [Arc<CudaModule>; 3],
}

/// The loaded kernels by context id (`cuCtxGetId`).
fn loaded() -> &'static Mutex<HashMap<u64, Arc<Kernels>>> {
    static LOADED: OnceLock<Mutex<HashMap<u64, Arc<Kernels>>>> = OnceLock::new();
    LOADED.get_or_init(Default::default)
}

impl Kernels {
    /// The kernels of `ctx`, JIT-loading the embedded PTX on first use in that context.
    ///
    /// Loaded modules are cached for the life of the context (keeping it retained, as
    /// the CUDA runtime keeps a primary context), by its id (`cuCtxGetId`): after
    /// `cuDevicePrimaryCtxReset`, the usual recovery from a sticky fault, the primary
    /// context keeps its `CUcontext` value but not its modules, and its new id loads
    /// them again. The kernels of the destroyed context are dropped from the cache
    /// without unloading (their modules went with it).
    pub fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        let handle = ctx.cu_ctx() as usize;
        let key = crate::driver::ctx_get_id(ctx.cu_ctx())?;
        let mut map = loaded().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = map.get(&key) {
            return Ok(k.clone());
        }
        let stale: Vec<u64> = map
            .iter()
            .filter(|(_, k)| k.context == handle)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            // Leaked, not dropped: unloading a module of a destroyed context fails, and
            // cudarc would record that error in the (live) context.
            std::mem::forget(map.remove(&id));
        }
        let validity = load_module(ctx, "kernels/validity.ptx", VALIDITY_PTX)?;
        let copy = load_module(ctx, "kernels/copy.ptx", COPY_PTX)?;
        let convert = load_module(ctx, "kernels/convert.ptx", CONVERT_PTX)?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .call("cuDeviceGetAttribute")?
            .max(1) as u32;
        let f = |m: &Arc<CudaModule>, name: &str| Kernel::load(m, name, multiprocessors);
        let k = Arc::new(Kernels {
            count_set_bits: f(&validity, "dvx_count_set_bits")?,
            copy_bitmap: f(&validity, "dvx_copy_bitmap")?,
            unpack_bits: f(&validity, "dvx_unpack_bits")?,
            pack_bools: f(&validity, "dvx_pack_bools")?,
            batched_copy: f(&copy, "dvx_batched_copy")?,
            rebase_i32: f(&copy, "dvx_rebase_offsets_i32")?,
            rebase_i64: f(&copy, "dvx_rebase_offsets_i64")?,
            row_sizes: f(&convert, "dvx_row_sizes")?,
            scan_tiles: f(&convert, "dvx_scan_tiles_i64")?,
            add_tile_prefix: f(&convert, "dvx_add_tile_prefix_i64")?,
            gather_views: f(&convert, "dvx_gather_views")?,
            narrow: f(&convert, "dvx_narrow_i64_i32")?,
            widen_decimals: f(&convert, "dvx_widen_decimals")?,
            fill_offsets: f(&convert, "dvx_fill_offsets_i32")?,
            compare_offsets: f(&convert, "dvx_compare_list_offsets")?,
            gather_values: f(&convert, "dvx_gather_list_values")?,
            gather_bits: f(&convert, "dvx_gather_list_bits")?,
            offsets_to_views: f(&convert, "dvx_offsets_to_views")?,
            context: handle,
            _modules: [validity, copy, convert],
        });
        map.insert(key, k.clone());
        Ok(k)
    }

    /// The kernels of `stream`'s context.
    pub fn for_stream(stream: &CudaStream) -> Result<Arc<Self>> {
        Self::for_context(stream.context())
    }

    /// The warps of `dvx_batched_copy` resident at once on the device (its occupancy
    /// times the multiprocessors): what [`plan_pieces`] sizes a batched copy for.
    pub fn batched_copy_warps(&self) -> u64 {
        self.batched_copy.max_blocks as u64 * (BLOCK_SIZE / 32) as u64
    }
}

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

/// JIT-loads the PTX `src` (named `name` in errors) into `ctx`, as devarrow loads its
/// own kernels: a failure is [`CudaError::ModuleLoad`] with the JIT's error log.
pub fn load_module(
    ctx: &Arc<CudaContext>,
    name: &'static str,
    src: &str,
) -> Result<Arc<CudaModule>> {
    ctx.load_module(Ptx::from_src(src))
        .map_err(|source| CudaError::ModuleLoad {
            module: name,
            log: crate::driver::jit_error_log(src).unwrap_or_default(),
            source,
        })
}

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

/// Enqueues `dvx_batched_copy` over `n` [`CopySegment`] descriptors already in device
/// memory at `segments` (one warp per descriptor at a time; cut copies with
/// [`plan_batched_copy`] first, as [`batched_copy`] does). `n` must be below 2^31.
///
/// # Safety
/// `segments` must hold `n` descriptors readable by the device, each at most
/// [`MAX_COPY_PIECE`] bytes long, and each descriptor's ranges must be valid (source
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
/// none for a null row. A warp per 32 consecutive rows, whose output is contiguous.
///
/// # Safety
/// `views` readable for `n` 4-byte-aligned views, `validity` (if not 0) for
/// `bit_offset + n` bits, `buffers` for the `u64` of every valid out-of-line view's
/// buffer index and each such view's bytes in its buffer, `offsets` for `n + 1`
/// 8-byte-aligned `i64`s, the scan of the rows' sizes (0 for a null row), `out` writable
/// for `offsets[0]..offsets[n]` and overlapping nothing read, until the kernel completes.
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
        .arg(&lane_bytes);
    // SAFETY: arguments match (8 u64s); ranges are the caller's guarantee.
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
