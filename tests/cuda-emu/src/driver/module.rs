//! Modules (PTX, parsed by [`crate::ptx`]), functions and kernel launches.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{
    CUfunc_cache, CUfunction, CUfunction_attribute, CUjit_option, CUmodule, CUresult, CUstream,
};

use crate::ptx::{self, Dims};

use super::common::*;
use super::kernel::{Function, LoadedModule};
use super::queue::Op;
use super::state::*;

/// Shared memory a block may use (static and dynamic) without opting in: 48 KiB.
const DEFAULT_SHARED: i32 = 48 << 10;

/// Shared memory a block may use after opting in (`cuFuncSetAttribute`).
const OPTIN_SHARED: i32 = 227 << 10;

/// Whether kernels load lazily, at `cuModuleGetFunction`, as the driver does by default
/// since CUDA 12.2 on Linux, or eagerly with their module (`CUDA_MODULE_LOADING=EAGER`).
fn lazy_loading() -> bool {
    !std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v.eq_ignore_ascii_case("EAGER"))
}

/// Loading kernels "might require context synchronization" (CUDA C++ Programming Guide,
/// "Lazy Loading", "Potential Hazards", "Concurrent Execution": a kernel that spins until
/// another is launched deadlocks when the launch loads the other kernel). The emulator
/// takes the documented worst case: the call that loads a module's kernels (the first
/// `cuModuleGetFunction` of each kernel when lazy, `cuModuleLoadData*` when eager) waits
/// for all the context's work, counted as `name` with the implicit synchronizations.
fn kernel_load_waits(ctx: &Context, name: &'static str) {
    ctx.drain();
    super::sync::count(name);
}

fn load(pmod: *mut CUmodule, image: *const c_void) -> R {
    load_logged(pmod, image, &mut |_| {})
}

/// [`load`], handing the JIT's error message (the PTX parser's) to `log` on failure.
fn load_logged(pmod: *mut CUmodule, image: *const c_void, log: &mut dyn FnMut(&str)) -> R {
    let ctx = current_context()?;
    if pmod.is_null() || image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if !lazy_loading() {
        kernel_load_waits(&ctx, "cuModuleLoadData (eager kernel loading)");
    }
    // SAFETY: the caller passes a NUL-terminated image (PTX text is NUL-terminated).
    let bytes = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_bytes();
    if bytes.starts_with(b"\x7fELF") || bytes.starts_with(&[0x50, 0xed, 0x55, 0xba]) {
        eprintln!("devarrow-emu: cuModuleLoadData: cubin and fatbin images are not emulated, only PTX text");
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| {
        eprintln!("devarrow-emu: cuModuleLoadData: the PTX is not UTF-8");
        CUDA_ERROR_INVALID_PTX
    })?;
    let module = match catch(|| ptx::Module::parse(text)) {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            eprintln!("devarrow-emu: cuModuleLoadData: invalid PTX: {e}");
            log(&format!("ptxas fatal   : {e}"));
            return Err(CUDA_ERROR_INVALID_PTX);
        }
        Err(p) => {
            eprintln!(
                "devarrow-emu: cuModuleLoadData: internal error: the PTX parser panicked: {p}"
            );
            return Err(CUDA_ERROR_INVALID_PTX);
        }
    };
    let d = driver();
    let handle = d.new_handle();
    d.insert(
        handle,
        Object::Module(Arc::new(LoadedModule {
            handle,
            ctx: ctx.handle(),
            ptx: module,
            functions: Mutex::new(HashMap::new()),
        })),
    );
    // SAFETY: the caller's out-pointer (non-NULL).
    unsafe { out(pmod, handle as CUmodule) }
}

/// Loads a module from NUL-terminated PTX text (`CUDA_ERROR_INVALID_PTX`, with the
/// parser's message on stderr, when it does not parse).
///
/// # Safety
/// `image` must point to a NUL-terminated string; `module` must be NULL or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    api("cuModuleLoadData", || load(module, image))
}

/// [`cuModuleLoadData`]; the JIT options are ignored.
///
/// # Safety
/// As [`cuModuleLoadData`].
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut CUmodule,
    image: *const c_void,
    num_options: c_uint,
    options: *mut CUjit_option,
    option_values: *mut *mut c_void,
) -> CUresult {
    api("cuModuleLoadDataEx", || {
        // The error log buffer and its size, the only options the emulator honours (the
        // others, optimization levels and the like, are accepted and ignored).
        let (mut buffer, mut size) = (std::ptr::null_mut::<u8>(), 0usize);
        for i in 0..num_options as usize {
            // SAFETY: the caller passes `num_options` options and as many values.
            let (option, value) = unsafe { (*options.add(i), *option_values.add(i)) };
            match option {
                CUjit_option::CU_JIT_ERROR_LOG_BUFFER => buffer = value.cast(),
                // The size is passed as the pointer value itself, as the driver reads it.
                CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES => size = value as usize,
                _ => {}
            }
        }
        load_logged(module, image, &mut |message| {
            if !buffer.is_null() && size > 0 {
                let n = message.len().min(size - 1);
                // SAFETY: the caller's buffer holds `size` bytes; `n + 1 <= size`.
                unsafe {
                    std::ptr::copy_nonoverlapping(message.as_ptr(), buffer, n);
                    *buffer.add(n) = 0;
                }
            }
        })
    })
}

fn module(handle: CUmodule) -> R<Arc<LoadedModule>> {
    match driver().get(handle as u64) {
        Some(Object::Module(m)) => Ok(m),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    }
}

/// Unloads a module; its functions become invalid (launches already enqueued still run).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(hmod: CUmodule) -> CUresult {
    api("cuModuleUnload", || {
        let ctx = current_context_any()?;
        let m = module(hmod)?;
        let d = driver();
        d.remove(m.handle);
        for (_, f) in lock(&m.functions).drain() {
            d.remove(f);
        }
        ctx.shared.sticky()
    })
}

/// The `.entry` named `name` (`CUDA_ERROR_NOT_FOUND` if there is none).
///
/// # Safety
/// `name` must be a NUL-terminated string; `hfunc` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    hfunc: *mut CUfunction,
    hmod: CUmodule,
    name: *const c_char,
) -> CUresult {
    api("cuModuleGetFunction", || {
        let ctx = current_context()?;
        let m = module(hmod)?;
        if hfunc.is_null() || name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller passes a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(name) }
            .to_str()
            .map_err(|_| CUDA_ERROR_NOT_FOUND)?;
        let mut functions = lock(&m.functions);
        let handle = match functions.get(name) {
            Some(&h) => h,
            None => {
                if lazy_loading() {
                    kernel_load_waits(&ctx, "cuModuleGetFunction (lazy kernel loading)");
                }
                let found = catch(|| {
                    m.ptx
                        .kernel(name)
                        .map(|p| (p.to_vec(), m.ptx.static_shared_bytes()))
                });
                let (params, static_shared) = match found {
                    Ok(Some(found)) => found,
                    Ok(None) => return Err(CUDA_ERROR_NOT_FOUND),
                    Err(p) => {
                        eprintln!("devarrow-emu: cuModuleGetFunction: internal error: {p}");
                        return Err(CUDA_ERROR_UNKNOWN);
                    }
                };
                let d = driver();
                let handle = d.new_handle();
                d.insert(
                    handle,
                    Object::Function(Arc::new(Function {
                        ctx: ctx.handle(),
                        module: m.clone(),
                        name: name.to_string(),
                        params: params.iter().map(|p| p.size).collect(),
                        static_shared: static_shared as i32,
                        max_dynamic_shared: AtomicI32::new(
                            (DEFAULT_SHARED - static_shared as i32).max(0),
                        ),
                    })),
                );
                functions.insert(name.to_string(), handle);
                handle
            }
        };
        // SAFETY: the caller's out-pointer (non-NULL).
        unsafe { out(hfunc, handle as CUfunction) }
    })
}

fn function(handle: CUfunction) -> R<Arc<Function>> {
    match driver().get(handle as u64) {
        Some(Object::Function(f)) => Ok(f),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    }
}

/// A function attribute (plausible values for an interpreted kernel).
///
/// # Safety
/// `pi` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(
    pi: *mut c_int,
    attrib: CUfunction_attribute,
    hfunc: CUfunction,
) -> CUresult {
    api("cuFuncGetAttribute", || {
        require_init()?;
        let f = function(hfunc)?;
        let v = match attrib as u32 {
            0 => 1024,
            1 => f.static_shared,
            2 | 3 => 0,
            4 => 32,
            5 => 70,
            6 => 90,
            8 => f.max_dynamic_shared.load(Ordering::Relaxed),
            9 => -1,
            _ => 0,
        };
        // SAFETY: the caller's out-pointer.
        unsafe { out(pi, v) }
    })
}

/// Sets a function attribute (only the dynamic shared memory limit matters).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuFuncSetAttribute(
    hfunc: CUfunction,
    attrib: CUfunction_attribute,
    value: c_int,
) -> CUresult {
    api("cuFuncSetAttribute", || {
        current_context()?;
        let f = function(hfunc)?;
        if attrib as u32 == 8 {
            if !(0..=OPTIN_SHARED - f.static_shared).contains(&value) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            f.max_dynamic_shared.store(value, Ordering::Relaxed);
        }
        Ok(())
    })
}

/// Sets a function's cache preference (ignored).
///
/// # Safety
/// None beyond the driver API's.
#[no_mangle]
pub unsafe extern "C" fn cuFuncSetCacheConfig(
    hfunc: CUfunction,
    _config: CUfunc_cache,
) -> CUresult {
    api("cuFuncSetCacheConfig", || {
        current_context()?;
        function(hfunc).map(|_| ())
    })
}

/// Blocks of `blockSize` threads resident per multiprocessor (2048 threads, 32 blocks).
///
/// # Safety
/// `numBlocks` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    numBlocks: *mut c_int,
    func: CUfunction,
    blockSize: c_int,
    _dynamicSMemSize: usize,
) -> CUresult {
    api("cuOccupancyMaxActiveBlocksPerMultiprocessor", || {
        current_context()?;
        function(func)?;
        if blockSize <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's out-pointer.
        unsafe { out(numBlocks, (2048 / blockSize).min(32)) }
    })
}

/// As [`cuOccupancyMaxActiveBlocksPerMultiprocessor`]; the flags (caching mode) change
/// nothing on the emulated device.
///
/// # Safety
/// As [`cuOccupancyMaxActiveBlocksPerMultiprocessor`].
#[no_mangle]
pub unsafe extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    numBlocks: *mut c_int,
    func: CUfunction,
    blockSize: c_int,
    dynamicSMemSize: usize,
    _flags: std::ffi::c_uint,
) -> CUresult {
    // SAFETY: the caller's contract is the one of the call without flags.
    unsafe {
        cuOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks, func, blockSize, dynamicSMemSize)
    }
}

fn check_dims(f: &Function, grid: [u32; 3], block: [u32; 3], shared: u32) -> R {
    let block_ok = block.iter().all(|&d| d > 0)
        && block[0] <= 1024
        && block[1] <= 1024
        && block[2] <= 64
        && block.iter().map(|&d| d as u64).product::<u64>() <= 1024;
    let grid_ok = grid.iter().all(|&d| d > 0)
        && grid[0] <= i32::MAX as u32
        && grid[1] <= 65535
        && grid[2] <= 65535;
    let shared_ok = shared as i64 <= f.max_dynamic_shared.load(Ordering::Relaxed) as i64;
    if block_ok && grid_ok && shared_ok {
        Ok(())
    } else {
        eprintln!(
            "devarrow-emu: cuLaunchKernel: invalid configuration for {}: grid {grid:?}, block \
             {block:?}, {shared} bytes of dynamic shared memory",
            f.name
        );
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

/// Launches a kernel on `hStream`: the parameters (sizes from the PTX) are copied now,
/// the grid runs later on the stream's worker, every global access checked.
///
/// # Safety
/// `kernelParams` must hold one pointer per parameter, each to a value of the
/// parameter's size. `extra` is not supported (must be NULL).
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: CUfunction,
    gridDimX: c_uint,
    gridDimY: c_uint,
    gridDimZ: c_uint,
    blockDimX: c_uint,
    blockDimY: c_uint,
    blockDimZ: c_uint,
    sharedMemBytes: c_uint,
    hStream: CUstream,
    kernelParams: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    api("cuLaunchKernel", || {
        let ctx = current_context()?;
        let stream = ctx.stream(hStream as u64)?;
        let func = function(f)?;
        if func.ctx != ctx.handle() {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        if !extra.is_null() {
            eprintln!("devarrow-emu: cuLaunchKernel: `extra` parameters are not emulated");
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        inject("cuLaunchKernel", CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)?;
        let grid = [gridDimX, gridDimY, gridDimZ];
        let block = [blockDimX, blockDimY, blockDimZ];
        check_dims(&func, grid, block, sharedMemBytes)?;
        if kernelParams.is_null() && !func.params.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut params = Vec::with_capacity(func.params.len());
        for (i, &size) in func.params.iter().enumerate() {
            // SAFETY: `kernelParams` holds one pointer per parameter (caller's contract).
            let p = unsafe { *kernelParams.add(i) };
            if p.is_null() {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let mut bytes = vec![0u8; size];
            // SAFETY: each pointer points to a value of the parameter's size.
            unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), bytes.as_mut_ptr(), size) };
            params.push(bytes);
        }
        ctx.enqueue(
            &stream,
            Op::Kernel {
                func,
                dims: Dims {
                    grid,
                    block,
                    shared_bytes: sharedMemBytes,
                },
                params,
                // What the addresses name now, in stream order: a block freed after this
                // launch and reused by a later allocation is still this launch's.
                memory: driver().mem.snapshot(),
                // Its device's memory, and its peers' where access is enabled now.
                devices: ctx.accessible_devices(),
            },
        );
        Ok(())
    })
}
