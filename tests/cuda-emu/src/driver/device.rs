//! Initialization, versions, error strings and the one emulated device.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, CStr, CString};
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice, CUdevice_attribute, CUmemoryPool, CUresult, CUuuid};

use super::common::*;
use super::config::{config_devices, config_no_peer};
use super::state::*;

/// The emulated device's name.
pub const DEVICE_NAME: &str = "devarrow-emu (emulated, not a GPU)";

/// Initializes the emulated driver. `Flags` must be 0.
///
/// # Safety
/// None beyond the driver API's (it takes no pointer).
#[no_mangle]
pub unsafe extern "C" fn cuInit(Flags: c_uint) -> CUresult {
    api("cuInit", || {
        if Flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        driver().initialized.store(true, Ordering::Release);
        Ok(())
    })
}

/// Reports the emulated driver's CUDA version (12.8).
///
/// # Safety
/// `driverVersion` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(driverVersion: *mut c_int) -> CUresult {
    api("cuDriverGetVersion", || {
        // SAFETY: the caller's out-pointer.
        unsafe { out(driverVersion, DRIVER_VERSION) }
    })
}

fn leaked(text: &str) -> &'static CStr {
    static STRINGS: OnceLock<Mutex<HashMap<String, &'static CStr>>> = OnceLock::new();
    let mut map = lock(STRINGS.get_or_init(Default::default));
    if let Some(s) = map.get(text) {
        return s;
    }
    let s: &'static CStr = Box::leak(
        CString::new(text.replace('\0', " "))
            .expect("NULs replaced")
            .into_boxed_c_str(),
    );
    map.insert(text.to_string(), s);
    s
}

fn description(code: CUresult) -> &'static str {
    match code {
        CUDA_SUCCESS => "no error",
        CUDA_ERROR_INVALID_VALUE => "invalid argument",
        CUDA_ERROR_OUT_OF_MEMORY => "out of memory",
        CUDA_ERROR_NOT_INITIALIZED => "initialization error",
        CUDA_ERROR_DEINITIALIZED => "driver shutting down",
        CUDA_ERROR_NO_DEVICE => "no CUDA-capable device is detected",
        CUDA_ERROR_INVALID_DEVICE => "invalid device ordinal",
        CUDA_ERROR_INVALID_IMAGE => "device kernel image is invalid",
        CUDA_ERROR_INVALID_CONTEXT => "invalid device context",
        CUDA_ERROR_INVALID_PTX => "a PTX JIT compilation failed",
        CUDA_ERROR_INVALID_HANDLE => "invalid resource handle",
        CUDA_ERROR_NOT_FOUND => "named symbol not found",
        CUDA_ERROR_NOT_READY => "device not ready",
        CUDA_ERROR_ILLEGAL_ADDRESS => "an illegal memory access was encountered",
        CUDA_ERROR_LAUNCH_TIMEOUT => "the launch timed out and was terminated",
        CUDA_ERROR_CONTEXT_IS_DESTROYED => "context is destroyed",
        CUDA_ERROR_MISALIGNED_ADDRESS => "misaligned address",
        CUDA_ERROR_LAUNCH_FAILED => "unspecified launch failure",
        CUDA_ERROR_NOT_PERMITTED => "operation not permitted",
        CUDA_ERROR_NOT_SUPPORTED => "operation not supported",
        _ => "",
    }
}

/// The name of a `CUresult` (`"CUDA_ERROR_INVALID_VALUE"`, ...).
///
/// # Safety
/// `pStr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    api("cuGetErrorName", || {
        let name = leaked(&format!("{error:?}"));
        // SAFETY: the caller's out-pointer.
        unsafe { out(pStr, name.as_ptr()) }
    })
}

/// A description of a `CUresult`.
///
/// # Safety
/// `pStr` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, pStr: *mut *const c_char) -> CUresult {
    api("cuGetErrorString", || {
        let text = match description(error) {
            "" => format!("{error:?}"),
            d => d.to_string(),
        };
        // SAFETY: the caller's out-pointer.
        unsafe { out(pStr, leaked(&text).as_ptr()) }
    })
}

/// The device of ordinal `ordinal` (0 to `DEVARROW_EMU_DEVICES` - 1).
///
/// # Safety
/// `device` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    api("cuDeviceGet", || {
        require_init()?;
        check_device(ordinal)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(device, ordinal) }
    })
}

/// The number of devices: `DEVARROW_EMU_DEVICES` (default 1).
///
/// # Safety
/// `count` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    api("cuDeviceGetCount", || {
        require_init()?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(count, config_devices() as c_int) }
    })
}

/// The device name, [`DEVICE_NAME`], NUL-terminated and truncated to `len` bytes.
///
/// # Safety
/// `name` must be NULL or valid for `len` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    api("cuDeviceGetName", || {
        require_init()?;
        check_device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let bytes = DEVICE_NAME.as_bytes();
        let n = bytes.len().min(len as usize - 1);
        // SAFETY: `name` is valid for `len` bytes (caller's contract) and `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), name.cast::<u8>(), n);
            name.add(n).write(0);
        }
        Ok(())
    })
}

/// Device `dev`'s UUID: `devarrow-emu`, zeros, then `dev + 1` in the last byte (device
/// 0's is the UUID of the one-device emulator).
fn uuid(dev: CUdevice) -> CUuuid {
    let mut bytes = [0 as c_char; 16];
    for (b, v) in bytes.iter_mut().zip(*b"devarrow-emu\0\0\0\x01") {
        *b = v as c_char;
    }
    bytes[15] = (dev + 1) as c_char;
    CUuuid { bytes }
}

/// The device UUID (fixed).
///
/// # Safety
/// `uuid_out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid_out: *mut CUuuid, dev: CUdevice) -> CUresult {
    api("cuDeviceGetUuid", || {
        require_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(uuid_out, uuid(dev)) }
    })
}

/// The device UUID (fixed).
///
/// # Safety
/// `uuid_out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid_out: *mut CUuuid, dev: CUdevice) -> CUresult {
    api("cuDeviceGetUuid_v2", || {
        require_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(uuid_out, uuid(dev)) }
    })
}

/// The device's total memory (`DEVARROW_EMU_MEM_BYTES`, default 8 GiB).
///
/// # Safety
/// `bytes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    api("cuDeviceTotalMem_v2", || {
        require_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(bytes, driver().mem.total(dev as usize) as usize) }
    })
}

/// The value of device attribute number `attribute` on an H100-like device (SXM5,
/// compute capability 9.0, 132 multiprocessors); 0 for attributes it has no
/// meaningful value for.
pub fn attribute_value(attribute: u32) -> i32 {
    match attribute {
        1 => 1024,             // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,         // MAX_BLOCK_DIM_X, _Y
        4 => 64,               // MAX_BLOCK_DIM_Z
        5 => i32::MAX,         // MAX_GRID_DIM_X
        6 | 7 => 65535,        // MAX_GRID_DIM_Y, _Z
        8 => 48 << 10,         // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 64 << 10,         // TOTAL_CONSTANT_MEMORY
        10 => 32,              // WARP_SIZE
        11 => i32::MAX,        // MAX_PITCH
        12 => 65536,           // MAX_REGISTERS_PER_BLOCK
        13 => 1_980_000,       // CLOCK_RATE (kHz)
        14 | 30 => 512,        // TEXTURE_ALIGNMENT, SURFACE_ALIGNMENT
        15 => 1,               // GPU_OVERLAP
        16 => 132,             // MULTIPROCESSOR_COUNT
        17 | 18 => 0,          // KERNEL_EXEC_TIMEOUT, INTEGRATED
        19 => 1,               // CAN_MAP_HOST_MEMORY
        20 => 0,               // COMPUTE_MODE (default)
        21 | 22 => 131072,     // MAXIMUM_TEXTURE1D_WIDTH, 2D_WIDTH
        23 => 65536,           // MAXIMUM_TEXTURE2D_HEIGHT
        24..=26 => 16384,      // MAXIMUM_TEXTURE3D_*
        27 | 28 => 32768,      // MAXIMUM_TEXTURE2D_LAYERED_WIDTH/HEIGHT
        29 => 2048,            // MAXIMUM_TEXTURE2D_LAYERED_LAYERS
        31 | 32 => 1,          // CONCURRENT_KERNELS, ECC_ENABLED
        33..=35 => 0,          // PCI_BUS_ID, PCI_DEVICE_ID, TCC_DRIVER
        36 => 2_619_000,       // MEMORY_CLOCK_RATE (kHz)
        37 => 5120,            // GLOBAL_MEMORY_BUS_WIDTH
        38 => 50 << 20,        // L2_CACHE_SIZE
        39 => 2048,            // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 3,               // ASYNC_ENGINE_COUNT
        41 => 1,               // UNIFIED_ADDRESSING
        42 => 32768,           // MAXIMUM_TEXTURE1D_LAYERED_WIDTH
        43 => 2048,            // MAXIMUM_TEXTURE1D_LAYERED_LAYERS
        44 => 1,               // CAN_TEX2D_GATHER
        45 | 46 => 32768,      // MAXIMUM_TEXTURE2D_GATHER_*
        47 | 48 => 8192,       // MAXIMUM_TEXTURE3D_*_ALTERNATE
        49 => 32768,           // MAXIMUM_TEXTURE3D_DEPTH_ALTERNATE
        50 => 0,               // PCI_DOMAIN_ID
        51 => 32,              // TEXTURE_PITCH_ALIGNMENT
        52 | 53 => 32768,      // MAXIMUM_TEXTURECUBEMAP_*
        54 => 2046,            // MAXIMUM_TEXTURECUBEMAP_LAYERED_LAYERS
        55 => 32768,           // MAXIMUM_SURFACE1D_WIDTH
        56 => 131072,          // MAXIMUM_SURFACE2D_WIDTH
        57 => 65536,           // MAXIMUM_SURFACE2D_HEIGHT
        58..=60 => 16384,      // MAXIMUM_SURFACE3D_*
        61 => 32768,           // MAXIMUM_SURFACE1D_LAYERED_WIDTH
        62 => 2048,            // MAXIMUM_SURFACE1D_LAYERED_LAYERS
        63 | 64 => 32768,      // MAXIMUM_SURFACE2D_LAYERED_WIDTH/HEIGHT
        65 => 2048,            // MAXIMUM_SURFACE2D_LAYERED_LAYERS
        66 | 67 => 32768,      // MAXIMUM_SURFACECUBEMAP_*
        68 => 2046,            // MAXIMUM_SURFACECUBEMAP_LAYERED_LAYERS
        69 => 1 << 28,         // MAXIMUM_TEXTURE1D_LINEAR_WIDTH
        70 => 131072,          // MAXIMUM_TEXTURE2D_LINEAR_WIDTH
        71 => 65000,           // MAXIMUM_TEXTURE2D_LINEAR_HEIGHT
        72 => 2_097_120,       // MAXIMUM_TEXTURE2D_LINEAR_PITCH
        73 | 74 | 77 => 32768, // MAXIMUM_TEXTURE*_MIPMAPPED_*
        75 => 9,               // COMPUTE_CAPABILITY_MAJOR
        76 => 0,               // COMPUTE_CAPABILITY_MINOR
        78..=80 => 1,          // STREAM_PRIORITIES, GLOBAL_L1, LOCAL_L1
        81 => 233_472,         // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        82 => 65536,           // MAX_REGISTERS_PER_MULTIPROCESSOR
        83 => 1,               // MANAGED_MEMORY
        84..=86 => 0,          // MULTI_GPU_BOARD(_GROUP_ID), HOST_NATIVE_ATOMIC
        87 => 2,               // SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO
        88 => 0,               // PAGEABLE_MEMORY_ACCESS: kernels cannot read pageable memory
        89..=95 => 1,          // CONCURRENT_MANAGED_ACCESS .. COOPERATIVE_LAUNCH
        96 => 1,               // COOPERATIVE_MULTI_DEVICE_LAUNCH
        97 => 232_448,         // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        98 => 0,               // CAN_FLUSH_REMOTE_WRITES
        99 => 1,               // HOST_REGISTER_SUPPORTED
        100 | 101 => 0,        // PAGEABLE_..._HOST_PAGE_TABLES, DIRECT_MANAGED_MEM_ACCESS_FROM_HOST
        102 | 103 => 1,        // VIRTUAL_ADDRESS_MANAGEMENT, POSIX_FILE_DESCRIPTOR handles
        104 | 105 => 0,        // WIN32 handles
        106 => 32,             // MAX_BLOCKS_PER_MULTIPROCESSOR
        107 => 1,              // GENERIC_COMPRESSION_SUPPORTED
        108 => 32_505_856,     // MAX_PERSISTING_L2_CACHE_SIZE
        109 => 134_213_632,    // MAX_ACCESS_POLICY_WINDOW_SIZE
        110 => 1,              // GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
        111 => 1024,           // RESERVED_SHARED_MEMORY_PER_BLOCK
        112..=116 => 1, // SPARSE_CUDA_ARRAY .. MEMORY_POOLS_SUPPORTED, GPU_DIRECT_RDMA_SUPPORTED
        117 => 1,       // GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
        118 => 0,       // GPU_DIRECT_RDMA_WRITES_ORDERING
        119 => 1,       // MEMPOOL_SUPPORTED_HANDLE_TYPES (POSIX fd)
        120 | 121 => 1, // CLUSTER_LAUNCH, DEFERRED_MAPPING_CUDA_ARRAY_SUPPORTED
        124 => 1,       // IPC_EVENT_SUPPORTED
        125 => 4,       // MEM_SYNC_DOMAIN_COUNT
        126 => 1,       // TENSOR_MAP_ACCESS_SUPPORTED
        128 => 1,       // UNIFIED_FUNCTION_POINTERS
        130 | 133 => -1, // NUMA_ID, HOST_NUMA_ID
        _ => 0,
    }
}

/// A device attribute (see [`attribute_value`]).
///
/// # Safety
/// `pi` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    pi: *mut c_int,
    attrib: CUdevice_attribute,
    dev: CUdevice,
) -> CUresult {
    api("cuDeviceGetAttribute", || {
        require_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(pi, attribute_value(attrib as u32)) }
    })
}

/// The device's default memory pool.
///
/// # Safety
/// `pool_out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(
    pool_out: *mut CUmemoryPool,
    dev: CUdevice,
) -> CUresult {
    api("cuDeviceGetDefaultMemPool", || {
        require_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(pool_out, default_pool(dev as usize) as CUmemoryPool) }
    })
}

/// The device's current memory pool (always the default pool).
///
/// # Safety
/// `pool_out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(
    pool_out: *mut CUmemoryPool,
    dev: CUdevice,
) -> CUresult {
    api("cuDeviceGetMemPool", || {
        require_init()?;
        check_device(dev)?;
        // SAFETY: the caller's out-pointer.
        unsafe { out(pool_out, default_pool(dev as usize) as CUmemoryPool) }
    })
}

/// Whether device `dev` can access device `peerDev`'s memory directly once peer access is
/// enabled (`cuDeviceCanAccessPeer`): 1 for every pair of two different devices, unless
/// `DEVARROW_EMU_NO_PEER=1` (GPUs without a peer link: 0 for every pair); a device and
/// itself are 0, as NVIDIA's driver answers. An invalid ordinal is
/// `CUDA_ERROR_INVALID_DEVICE`, a NULL out-pointer `CUDA_ERROR_INVALID_VALUE` (CUDA driver
/// API, "Peer Context Memory Access").
///
/// # Safety
/// `canAccessPeer` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(
    canAccessPeer: *mut c_int,
    dev: CUdevice,
    peerDev: CUdevice,
) -> CUresult {
    api("cuDeviceCanAccessPeer", || {
        require_init()?;
        check_device(dev)?;
        check_device(peerDev)?;
        if canAccessPeer.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let can = dev != peerDev && !config_no_peer();
        // SAFETY: the caller's out-pointer (non-NULL).
        unsafe { out(canAccessPeer, c_int::from(can)) }
    })
}
