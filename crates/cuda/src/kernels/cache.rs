//! The kernels' cache: the embedded PTX JIT-loaded once per context ([`Kernels::for_context`]),
//! each kernel with its largest resident grid (`Kernel::config`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::{BLOCK_SIZE, CONVERT_PTX, COPY_PTX, VALIDITY_PTX};
use crate::error::{CudaError, DriverResultExt, Result};

/// One loaded kernel and the largest grid that is resident at once on the device.
#[derive(Debug)]
pub(super) struct Kernel {
    pub(super) function: CudaFunction,
    /// Resident blocks of [`BLOCK_SIZE`] threads per multiprocessor (the driver's
    /// occupancy for this kernel's registers) times the multiprocessors.
    pub(super) max_blocks: u32,
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
    pub(super) fn config(&self, items: u64) -> LaunchConfig {
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
    pub(super) count_set_bits: Kernel,
    pub(super) copy_bitmap: Kernel,
    pub(super) unpack_bits: Kernel,
    pub(super) pack_bools: Kernel,
    pub(super) batched_copy: Kernel,
    pub(super) rebase_i32: Kernel,
    pub(super) rebase_i64: Kernel,
    pub(super) row_sizes: Kernel,
    pub(super) scan_tiles: Kernel,
    pub(super) add_tile_prefix: Kernel,
    pub(super) gather_views: Kernel,
    pub(super) narrow: Kernel,
    pub(super) widen_decimals: Kernel,
    pub(super) fill_offsets: Kernel,
    pub(super) compare_offsets: Kernel,
    pub(super) gather_values: Kernel,
    pub(super) gather_bits: Kernel,
    pub(super) offsets_to_views: Kernel,
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
    /// times the multiprocessors): what [`plan_pieces`](super::plan_pieces) sizes a batched copy for.
    pub fn batched_copy_warps(&self) -> u64 {
        self.batched_copy.max_blocks as u64 * (BLOCK_SIZE / 32) as u64
    }
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
