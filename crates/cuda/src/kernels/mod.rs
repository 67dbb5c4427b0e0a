//! The PTX kernels of `kernels/` and how to launch them.
//!
//! The PTX text is embedded at build time ([`VALIDITY_PTX`], [`COPY_PTX`]) and JIT-loaded through cudarc the first time a kernel is launched
//! in a context, once per context ([`Kernels::for_context`]).
//!
//! Two levels of API:
//! - `launch_*` (`unsafe`): enqueue one kernel on a stream with raw device addresses and
//!   return at once — what pipelines and benchmarks use.
//! - the safe wrappers ([`count_set_bits`], [`copy_bitmap`], ...): check lengths, device
//!   and alignment, launch, and return after the work completed (so host-visible memory
//!   is never raced).
//!
//! Every kernel has a CPU reference implementation in the test-support crate
//! (`tests/support`, `devarrow_testing::kernel_oracles`), the oracle of the GPU tests
//! and of the emulated-driver tests. Grids: blocks of [`BLOCK_SIZE`] threads, `min(ceil(items / BLOCK_SIZE),
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
    /// The context they were loaded in.
    context: usize,
    _modules: [Arc<CudaModule>; 2],
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
            context: handle,
            _modules: [validity, copy],
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
