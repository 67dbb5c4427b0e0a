//! The emulated driver, called directly (in process, no `dlopen`): the CUDA semantics it
//! promises, and the misuse it must catch.
//!
//! The emulator is process-global (by default one device, one primary context), so every
//! test holds one lock and retains the primary context for its duration. Its
//! configuration is read once per process: the tests of several devices
//! (`DEVARROW_EMU_DEVICES`) run this binary again in child processes ([`several_devices`]).

use std::ffi::{c_void, CStr};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{
    CUcontext, CUdevice_attribute, CUdeviceptr, CUevent, CUfunction, CUmemPool_attribute,
    CUmemcpyAttributes, CUmemcpySrcAccessOrder, CUmemoryPool, CUmemorytype, CUmodule,
    CUpointer_attribute, CUresult, CUstream,
};
use devarrow_emu::driver::context::*;
use devarrow_emu::driver::device::*;
use devarrow_emu::driver::memory::*;
use devarrow_emu::driver::module::*;
use devarrow_emu::driver::stream::*;
use devarrow_emu::driver::{DEVICE_ADDRESS_BASE, DEVICE_ADDRESS_END, FREED_POISON, POISON};

use CUresult::*;

static LOCK: Mutex<()> = Mutex::new(());

/// Checks a driver call.
fn ck(r: CUresult) {
    assert_eq!(r, CUDA_SUCCESS);
}

/// The emulator with the primary context retained and current on this thread.
struct Emu {
    _lock: MutexGuard<'static, ()>,
    ctx: CUcontext,
}

impl Emu {
    fn new() -> Self {
        let lock = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            ck(cuInit(0));
            ck(cuDevicePrimaryCtxRetain(&mut ctx, 0));
            ck(cuCtxSetCurrent(ctx));
        }
        Emu { _lock: lock, ctx }
    }

    fn stream(&self, flags: u32) -> CUstream {
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ck(unsafe { cuStreamCreate(&mut s, flags) });
        s
    }

    fn event(&self) -> CUevent {
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        ck(unsafe { cuEventCreate(&mut e, 0) });
        e
    }

    fn alloc(&self, len: usize) -> CUdeviceptr {
        let mut p: CUdeviceptr = 0;
        // SAFETY: valid out-pointer.
        ck(unsafe { cuMemAlloc_v2(&mut p, len) });
        p
    }

    fn pinned(&self, len: usize) -> &'static mut [u8] {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the memory is page-aligned host memory of `len`
        // bytes, freed only by `free_pinned`.
        unsafe {
            ck(cuMemHostAlloc(&mut p, len, 0));
            std::slice::from_raw_parts_mut(p.cast::<u8>(), len)
        }
    }

    fn free_memory(&self) -> usize {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        ck(unsafe { cuMemGetInfo_v2(&mut free, &mut total) });
        free
    }

    fn download(&self, p: CUdeviceptr, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        // SAFETY: `out` holds `len` bytes.
        ck(unsafe { cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), p, len) });
        out
    }

    fn upload(&self, p: CUdeviceptr, data: &[u8]) {
        // SAFETY: `data` holds `data.len()` bytes.
        ck(unsafe { cuMemcpyHtoD_v2(p, data.as_ptr().cast(), data.len()) });
    }
}

impl Drop for Emu {
    fn drop(&mut self) {
        // SAFETY: balances the retain of `new`.
        unsafe { cuDevicePrimaryCtxRelease_v2(0) };
    }
}

/// A host function that blocks its stream until opened.
struct Gate {
    open: Mutex<bool>,
    changed: Condvar,
}

impl Gate {
    /// Enqueues the gate on `stream`: nothing after it runs until [`Gate::open`].
    fn block(stream: CUstream) -> Arc<Gate> {
        unsafe extern "C" fn wait(data: *mut c_void) {
            // SAFETY: `data` is the Arc leaked by `block`, reclaimed exactly once here.
            let gate = unsafe { Arc::from_raw(data.cast::<Gate>()) };
            let mut open = gate.open.lock().unwrap();
            while !*open {
                open = gate.changed.wait(open).unwrap();
            }
        }
        let gate = Arc::new(Gate {
            open: Mutex::new(false),
            changed: Condvar::new(),
        });
        let data = Arc::into_raw(gate.clone()) as *mut c_void;
        // SAFETY: `wait` takes ownership of one reference of the gate.
        ck(unsafe { cuLaunchHostFunc(stream, Some(wait), data) });
        gate
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.changed.notify_all();
    }
}

#[test]
fn the_device_is_one_h100_like_gpu() {
    let _emu = Emu::new();
    let mut n = 0;
    let mut v = 0;
    let mut name = [0 as std::ffi::c_char; 128];
    let mut total = 0usize;
    // SAFETY: valid out-pointers and buffer sizes.
    unsafe {
        ck(cuDeviceGetCount(&mut n));
        assert_eq!(n, 1);
        let mut dev = -1;
        ck(cuDeviceGet(&mut dev, 0));
        assert_eq!(dev, 0);
        assert_eq!(cuDeviceGet(&mut dev, 1), CUDA_ERROR_INVALID_DEVICE);
        ck(cuDeviceGetName(name.as_mut_ptr(), 128, 0));
        assert_eq!(CStr::from_ptr(name.as_ptr()).to_str().unwrap(), DEVICE_NAME);
        ck(cuDeviceTotalMem_v2(&mut total, 0));
        assert!(total > 0);
        for (attr, want) in [
            (
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                9,
            ),
            (
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                132,
            ),
            (CUdevice_attribute::CU_DEVICE_ATTRIBUTE_WARP_SIZE, 32),
            (
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
                1024,
            ),
            (
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING,
                1,
            ),
            (
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
                1,
            ),
        ] {
            ck(cuDeviceGetAttribute(&mut v, attr, 0));
            assert_eq!(v, want, "{attr:?}");
        }
        assert_eq!(
            cuDeviceGetAttribute(&mut v, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_WARP_SIZE, 3),
            CUDA_ERROR_INVALID_DEVICE
        );
        let mut s: *const std::ffi::c_char = std::ptr::null();
        ck(cuGetErrorName(CUDA_ERROR_ILLEGAL_ADDRESS, &mut s));
        assert_eq!(
            CStr::from_ptr(s).to_str().unwrap(),
            "CUDA_ERROR_ILLEGAL_ADDRESS"
        );
        ck(cuGetErrorString(CUDA_ERROR_ILLEGAL_ADDRESS, &mut s));
        assert!(CStr::from_ptr(s)
            .to_str()
            .unwrap()
            .contains("illegal memory access"));
        ck(cuDriverGetVersion(&mut v));
        assert_eq!(v, 12080);
    }
}

#[test]
fn calls_need_a_current_context_on_the_calling_thread() {
    let emu = Emu::new();
    let p = emu.alloc(64);
    let ctx = emu.ctx as usize;
    std::thread::spawn(move || {
        let mut q: CUdeviceptr = 0;
        let mut current: CUcontext = 1 as CUcontext;
        // SAFETY: valid out-pointers; `p` is a live allocation.
        unsafe {
            ck(cuCtxGetCurrent(&mut current));
            assert!(current.is_null(), "a new thread has no current context");
            assert_eq!(cuMemAlloc_v2(&mut q, 8), CUDA_ERROR_INVALID_CONTEXT);
            let mut s: CUstream = std::ptr::null_mut();
            assert_eq!(cuStreamCreate(&mut s, 1), CUDA_ERROR_INVALID_CONTEXT);
            ck(cuCtxSetCurrent(ctx as CUcontext));
            ck(cuMemFree_v2(p));
            ck(cuCtxSetCurrent(std::ptr::null_mut()));
            assert_eq!(cuMemAlloc_v2(&mut q, 8), CUDA_ERROR_INVALID_CONTEXT);
        }
    })
    .join()
    .unwrap();
}

#[test]
fn device_memory_is_poisoned_aligned_and_not_host_addressable() {
    let emu = Emu::new();
    let p = emu.alloc(1000);
    assert_eq!(p % 256, 0);
    assert!((DEVICE_ADDRESS_BASE..DEVICE_ADDRESS_END).contains(&p));
    assert!(emu.download(p, 1000).iter().all(|&b| b == POISON));
    let data: Vec<u8> = (0..1000).map(|i| i as u8).collect();
    emu.upload(p, &data);
    assert_eq!(emu.download(p, 1000), data);
    // SAFETY: every call below is given ranges it checks (and rejects).
    unsafe {
        let mut out = vec![0u8; 1001];
        assert_eq!(
            cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), p, 1001),
            CUDA_ERROR_ILLEGAL_ADDRESS,
            "one byte past the end"
        );
        assert_eq!(
            cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), p + 1000, 1),
            CUDA_ERROR_ILLEGAL_ADDRESS
        );
        assert_eq!(
            cuMemcpyHtoD_v2(p + 1, out.as_ptr().cast(), 1000),
            CUDA_ERROR_ILLEGAL_ADDRESS
        );
        assert_eq!(cuMemFree_v2(p + 256), CUDA_ERROR_INVALID_VALUE);
        ck(cuMemFree_v2(p));
        assert_eq!(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE, "double free");
        assert_eq!(
            cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), p, 8),
            CUDA_ERROR_ILLEGAL_ADDRESS,
            "use after free"
        );
        let mut v = 0u32;
        assert_eq!(
            cuPointerGetAttribute(
                (&mut v as *mut u32).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                out.as_ptr() as u64
            ),
            CUDA_ERROR_INVALID_VALUE,
            "pageable host memory is unknown to the driver"
        );
        // Several attributes at once: pageable memory reads as zeros, without an error.
        let mut memory_type = 7u32;
        let mut buffer_id = 7u64;
        let mut attributes = [
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        ];
        let mut data: [*mut c_void; 2] = [
            (&mut memory_type as *mut u32).cast(),
            (&mut buffer_id as *mut u64).cast(),
        ];
        ck(cuPointerGetAttributes(
            2,
            attributes.as_mut_ptr(),
            data.as_mut_ptr(),
            out.as_ptr() as u64,
        ));
        assert_eq!((memory_type, buffer_id), (0, 0));
        let q = emu.alloc(64);
        ck(cuPointerGetAttributes(
            2,
            attributes.as_mut_ptr(),
            data.as_mut_ptr(),
            q + 8,
        ));
        assert_eq!(
            memory_type,
            CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
            "device memory"
        );
        assert_ne!(buffer_id, 0);
        ck(cuMemFree_v2(q));
    }
}

/// A child process dereferencing a device pointer on the host crashes.
#[test]
fn a_host_dereference_of_device_memory_crashes() {
    if std::env::var_os("EMU_DEREF_CHILD").is_some() {
        let emu = Emu::new();
        let p = emu.alloc(64);
        // SAFETY: deliberately invalid: this must crash the (child) process.
        let v = unsafe { std::ptr::read_volatile(p as *const u8) };
        println!("read {v} from device memory on the host");
        std::process::exit(0);
    }
    // Through a shell, to keep the crash from dumping core.
    let out = std::process::Command::new("sh")
        .args([
            "-c",
            "ulimit -c 0; exec \"$0\" --exact a_host_dereference_of_device_memory_crashes --nocapture",
        ])
        .arg(std::env::current_exe().unwrap())
        .env("EMU_DEREF_CHILD", "1")
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(11), "SIGSEGV expected: {out:?}");
}

/// NVIDIA's driver frees device memory on a thread with no current context: the pointer
/// names its allocation and so its context. Outside producers do that (a release
/// callback run on whichever thread drops the array), so the emulator must accept it,
/// and still synchronize the allocation's context first.
#[test]
fn device_memory_is_freed_without_a_current_context() {
    let emu = Emu::new();
    let before = emu.free_memory();
    let p = emu.alloc(1 << 20);
    let stream = emu.stream(1);
    // Work queued on the allocation that the free must wait for.
    let gate = Gate::block(stream);
    // SAFETY: `p` is a live allocation of 1 MiB.
    ck(unsafe { cuMemsetD8Async(p, 7, 1 << 20, stream) });
    let freed = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            let mut current: CUcontext = 1 as CUcontext;
            std::thread::sleep(Duration::from_millis(20));
            gate.open();
            // SAFETY: valid out-pointer; `p` is a live allocation, freed once.
            unsafe {
                ck(cuCtxGetCurrent(&mut current));
                assert!(current.is_null());
                let freed = cuMemFree_v2(p);
                assert_eq!(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE, "double free");
                assert_eq!(cuMemFree_v2(p + 256), CUDA_ERROR_INVALID_VALUE);
                ck(cuMemFree_v2(0));
                freed
            }
        })
    }
    .join()
    .unwrap();
    assert_eq!(freed, CUDA_SUCCESS);
    assert_eq!(emu.free_memory(), before);
    // SAFETY: our stream, destroyed once.
    ck(unsafe { cuStreamDestroy_v2(stream) });
}

/// `cuMemAllocHost(0)` / `cuMemHostAlloc(0)` succeed without allocating and leave the
/// out-pointer as it was (as `cudaMallocHost(&p, 0)` does on NVIDIA's driver); freeing
/// NULL pinned memory succeeds.
#[test]
fn pinned_allocations_of_zero_bytes_succeed_without_allocating() {
    let _emu = Emu::new();
    let sentinel = 0x1234usize as *mut c_void;
    let mut p = sentinel;
    // SAFETY: valid out-pointers; NULL is freed as nothing.
    unsafe {
        ck(cuMemAllocHost_v2(&mut p, 0));
        assert_eq!(p, sentinel, "the out-pointer is left as it was");
        ck(cuMemHostAlloc(&mut p, 0, 0x3));
        assert_eq!(p, sentinel);
        assert_eq!(cuMemHostAlloc(&mut p, 0, 0x100), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cuMemAllocHost_v2(std::ptr::null_mut(), 0),
            CUDA_ERROR_INVALID_VALUE
        );
        ck(cuMemFreeHost(std::ptr::null_mut()));
        // Device memory keeps cuMemAlloc's documented answer to 0 bytes.
        let mut d: CUdeviceptr = 0;
        assert_eq!(cuMemAlloc_v2(&mut d, 0), CUDA_ERROR_INVALID_VALUE);
    }
}

/// `cuMemcpyPeerAsync` within the one emulated device's context: a device-to-device copy
/// in stream order, with the driver's argument checks.
#[test]
fn peer_copies_within_one_context_run_on_the_stream() {
    let emu = Emu::new();
    let (a, b) = (emu.alloc(4096), emu.alloc(4096));
    let data: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    emu.upload(a, &data);
    let stream = emu.stream(1);
    let pinned = emu.pinned(4096);
    let ctx = emu.ctx;
    // SAFETY: live allocations of 4096 bytes; our stream and context.
    unsafe {
        ck(cuMemcpyPeerAsync(b + 16, ctx, a, ctx, 1000, stream));
        ck(cuMemcpyPeerAsync(b, ctx, a, ctx, 0, stream));
        ck(cuStreamSynchronize(stream));
        let null = std::ptr::null_mut();
        assert_eq!(
            cuMemcpyPeerAsync(b, null, a, ctx, 16, stream),
            CUDA_ERROR_INVALID_CONTEXT
        );
        // Pinned host memory is not device memory of the context.
        assert_eq!(
            cuMemcpyPeerAsync(pinned.as_mut_ptr() as CUdeviceptr, ctx, a, ctx, 16, stream),
            CUDA_ERROR_INVALID_VALUE
        );
        ck(cuMemFreeHost(pinned.as_mut_ptr().cast()));
    }
    let out = emu.download(b, 4096);
    assert_eq!(&out[16..1016], &data[..1000]);
    assert!(out[..16].iter().all(|&x| x == POISON));
    // SAFETY: our allocations and stream, each released once.
    unsafe {
        ck(cuMemFree_v2(a));
        ck(cuMemFree_v2(b));
        ck(cuStreamDestroy_v2(stream));
    }
}

/// Events keep their creation flags (`devarrow_emu_event_flags`), and those created with
/// `CU_EVENT_DISABLE_TIMING` cannot be timed (`CUDA_ERROR_INVALID_HANDLE`, as the
/// driver documents for `cuEventElapsedTime`), blocking-sync ones included.
#[test]
fn untimed_events_keep_their_flags_and_cannot_be_timed() {
    let emu = Emu::new();
    let stream = emu.stream(1);
    let mut ms = 0f32;
    for (flags, timed) in [(0u32, true), (1, true), (2, false), (3, false)] {
        let (mut a, mut b): (CUevent, CUevent) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid out-pointers; our stream; events destroyed once.
        unsafe {
            ck(cuEventCreate(&mut a, flags));
            ck(cuEventCreate(&mut b, flags));
            assert_eq!(devarrow_emu_event_flags(a), i64::from(flags));
            ck(cuEventRecord(a, stream));
            ck(cuEventRecord(b, stream));
            ck(cuEventSynchronize(b));
            let r = cuEventElapsedTime(&mut ms, a, b);
            if timed {
                ck(r);
            } else {
                assert_eq!(r, CUDA_ERROR_INVALID_HANDLE, "flags {flags}");
            }
            ck(cuEventDestroy_v2(a));
            ck(cuEventDestroy_v2(b));
            assert_eq!(devarrow_emu_event_flags(a), -1);
        }
    }
    // SAFETY: our stream, destroyed once.
    ck(unsafe { cuStreamDestroy_v2(stream) });
}

/// `devarrow_emu_mem_get_info_calls` counts `cuMemGetInfo` calls.
#[test]
fn mem_get_info_calls_are_counted() {
    let emu = Emu::new();
    let before = devarrow_emu_mem_get_info_calls();
    emu.free_memory();
    emu.free_memory();
    assert_eq!(devarrow_emu_mem_get_info_calls(), before + 2);
}

/// A restricted runtime (`DEVARROW_EMU_RESTRICTED=1`, read once per process): run in a
/// child process of this test binary with the variable set, which runs the checks.
#[test]
fn a_restricted_runtime_refuses_registration_batches_and_managed_memory() {
    if std::env::var("DEVARROW_EMU_RESTRICTED").as_deref() != Ok("1") {
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_restricted_runtime_refuses_registration_batches_and_managed_memory",
                "--nocapture",
            ])
            .env("DEVARROW_EMU_RESTRICTED", "1")
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&child.stdout);
        assert!(
            child.status.success() && out.contains("1 passed"),
            "{out}\n{}",
            String::from_utf8_lossy(&child.stderr)
        );
        return;
    }
    let emu = Emu::new();
    let stream = emu.stream(1);
    let d = emu.alloc(8192);
    let mut host = vec![0u8; 3 * 4096];
    let page = (host.as_mut_ptr() as usize).next_multiple_of(4096);
    let mut m: CUdeviceptr = 0;
    // SAFETY: a live page of `host`; valid out-pointers and arrays of 2 copies.
    unsafe {
        assert_eq!(
            cuMemHostRegister_v2(page as *mut c_void, 4096, 0),
            CUDA_ERROR_OPERATING_SYSTEM
        );
        assert_eq!(
            cuMemAllocManaged(&mut m, 4096, 1),
            CUDA_ERROR_OPERATING_SYSTEM
        );
        let mut dsts = [d, d + 4096];
        let mut srcs = [page as CUdeviceptr, page as CUdeviceptr];
        let mut sizes = [16usize, 16];
        let mut attrs: [CUmemcpyAttributes; 1] = std::mem::zeroed();
        attrs[0].srcAccessOrder = CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
        let mut idxs = [0usize];
        let mut fail = 0usize;
        assert_eq!(
            cuMemcpyBatchAsync(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                2,
                attrs.as_mut_ptr(),
                idxs.as_mut_ptr(),
                1,
                &mut fail,
                stream,
            ),
            CUDA_ERROR_NOT_PERMITTED
        );
        // Not sticky: the context still works.
        ck(cuMemcpyHtoDAsync_v2(d, page as *const c_void, 16, stream));
        ck(cuStreamSynchronize(stream));
        ck(cuMemFree_v2(d));
        ck(cuStreamDestroy_v2(stream));
    }
}

#[test]
fn memory_is_accounted_exactly_and_runs_out() {
    let emu = Emu::new();
    let before = emu.free_memory();
    let p = emu.alloc(1 << 20);
    assert_eq!(emu.free_memory(), before - (1 << 20));
    let q = emu.alloc(100);
    assert_eq!(emu.free_memory(), before - (1 << 20) - 256);
    let mut total = 0usize;
    let mut r: CUdeviceptr = 0;
    // SAFETY: valid out-pointers; frees of our allocations.
    unsafe {
        ck(cuDeviceTotalMem_v2(&mut total, 0));
        assert_eq!(cuMemAlloc_v2(&mut r, total), CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(cuMemAlloc_v2(&mut r, 0), CUDA_ERROR_INVALID_VALUE);
        ck(cuMemFree_v2(p));
        ck(cuMemFree_v2(q));
    }
    assert_eq!(emu.free_memory(), before);
}

#[test]
fn the_pool_keeps_freed_memory_until_a_synchronization_or_a_trim() {
    let emu = Emu::new();
    let s = emu.stream(1);
    let before = emu.free_memory();
    let mut p: CUdeviceptr = 0;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid out-pointers; the allocation is freed once.
    unsafe {
        ck(cuMemAllocAsync(&mut p, 4 << 20, s));
        assert_eq!(emu.free_memory(), before - (4 << 20));
        ck(cuMemFreeAsync(p, s));
        assert_eq!(
            cuMemFreeAsync(p, s),
            CUDA_ERROR_INVALID_VALUE,
            "double free"
        );
        ck(cuStreamSynchronize(s));
        // released at the synchronization (release threshold 0)
        assert_eq!(emu.free_memory(), before);
        ck(cuDeviceGetDefaultMemPool(&mut pool, 0));
        let mut threshold: u64 = u64::MAX;
        ck(cuMemPoolSetAttribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        ));
        ck(cuMemAllocAsync(&mut p, 4 << 20, s));
        ck(cuMemFreeAsync(p, s));
        ck(cuStreamSynchronize(s));
        assert_eq!(emu.free_memory(), before - (4 << 20), "kept by the pool");
        ck(cuMemPoolTrimTo(pool, 0));
        assert_eq!(emu.free_memory(), before);
        threshold = 0;
        ck(cuMemPoolSetAttribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        ));
        ck(cuStreamDestroy_v2(s));
    }
}

#[test]
fn streams_run_in_order_and_events_report_progress() {
    let emu = Emu::new();
    let (a, b) = (emu.stream(1), emu.stream(1));
    let p = emu.alloc(8);
    let e = emu.event();
    // SAFETY: valid handles and ranges; `host` outlives the synchronizations below.
    unsafe {
        assert_eq!(cuEventQuery(e), CUDA_SUCCESS, "never recorded: complete");
        let gate = Gate::block(a);
        let one = [1u8; 8];
        ck(cuMemcpyHtoDAsync_v2(p, one.as_ptr().cast(), 8, a));
        ck(cuEventRecord(e, a));
        assert_eq!(cuStreamQuery(a), CUDA_ERROR_NOT_READY);
        assert_eq!(cuEventQuery(e), CUDA_ERROR_NOT_READY);
        // b waits for a's copy: its copy reads 1s once the gate opens
        ck(cuStreamWaitEvent(b, e, 0));
        // destroying a waited-on event is fine
        ck(cuEventDestroy_v2(e));
        let host = emu.pinned(8);
        host.fill(0);
        ck(cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), p, 8, b));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(cuStreamQuery(b), CUDA_ERROR_NOT_READY, "b waits on a");
        assert_eq!(host, &[0u8; 8], "into pinned memory: asynchronous");
        gate.open();
        ck(cuStreamSynchronize(b));
        assert_eq!(host, &[1u8; 8]);
        ck(cuMemFreeHost(host.as_mut_ptr().cast()));
        ck(cuStreamDestroy_v2(a));
        ck(cuStreamDestroy_v2(b));
        ck(cuMemFree_v2(p));
    }
}

#[test]
fn pageable_copies_stage_at_the_call_and_complete_before_returning() {
    let emu = Emu::new();
    let s = emu.stream(1);
    let p = emu.alloc(8);
    // SAFETY: valid handles and ranges.
    unsafe {
        let gate = Gate::block(s);
        let mut pageable = [7u8; 8];
        let pinned = emu.pinned(8);
        pinned.fill(7);
        ck(cuMemcpyHtoDAsync_v2(p, pageable.as_ptr().cast(), 4, s));
        ck(cuMemcpyHtoDAsync_v2(p + 4, pinned.as_ptr().cast(), 4, s));
        // changed after the calls, before the copies ran
        pageable.fill(9);
        pinned.fill(9);
        let opener = {
            let gate = gate.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                gate.open();
            })
        };
        let t = Instant::now();
        let mut out = [0u8; 8];
        // into pageable memory: returns once the copy (after the gate) ran
        ck(cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), p, 8, s));
        assert!(t.elapsed() >= Duration::from_millis(40));
        assert_eq!(
            out,
            [7, 7, 7, 7, 9, 9, 9, 9],
            "pageable staged at the call, pinned read later"
        );
        opener.join().unwrap();
        ck(cuMemFreeHost(pinned.as_mut_ptr().cast()));
        ck(cuMemFree_v2(p));
        ck(cuStreamDestroy_v2(s));
    }
}

#[test]
fn the_legacy_null_stream_waits_for_blocking_streams_only() {
    let emu = Emu::new();
    let (blocking, nonblocking) = (emu.stream(0), emu.stream(1));
    // SAFETY: valid handles.
    unsafe {
        let gate = Gate::block(blocking);
        let gate2 = Gate::block(nonblocking);
        let e = emu.event();
        ck(cuEventRecord(e, std::ptr::null_mut()));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            cuEventQuery(e),
            CUDA_ERROR_NOT_READY,
            "NULL stream waits for the blocking stream"
        );
        gate.open();
        ck(cuEventSynchronize(e));
        // the non-blocking stream is still blocked, and did not hold the NULL stream
        assert_eq!(cuStreamQuery(nonblocking), CUDA_ERROR_NOT_READY);
        gate2.open();
        ck(cuCtxSynchronize());
        ck(cuEventDestroy_v2(e));
        ck(cuStreamDestroy_v2(blocking));
        ck(cuStreamDestroy_v2(nonblocking));
    }
}

/// `CU_STREAM_PER_THREAD` names the calling thread's own per-thread default stream, a
/// blocking stream (CUDA driver API, "Stream synchronization behavior": "not a
/// non-blocking stream and will synchronize with the legacy default stream"): the
/// legacy NULL stream waits for it, it does not wait for other streams, a wait enqueued
/// on it is not an implicit synchronization, and another thread's is another stream.
#[test]
fn the_per_thread_default_stream_is_the_threads_own_and_blocks_only_the_legacy_stream() {
    let emu = Emu::new();
    let per_thread = 2 as CUstream;
    let other = emu.stream(0);
    // SAFETY: valid handles.
    unsafe {
        let held = Gate::block(other);
        let e = emu.event();
        ck(cuEventRecord(e, other));
        let before = implicit_syncs();
        ck(cuStreamWaitEvent(per_thread, e, 0));
        assert_eq!(implicit_syncs().0, before.0, "a wait on it: not counted");
        let after = emu.event();
        ck(cuEventRecord(after, per_thread));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            cuEventQuery(after),
            CUDA_ERROR_NOT_READY,
            "it waits on the event"
        );
        assert_eq!(cuStreamQuery(per_thread), CUDA_ERROR_NOT_READY);
        // Another thread's per-thread default stream is another stream: idle.
        let ctx = {
            let mut ctx = std::ptr::null_mut();
            ck(cuCtxGetCurrent(&mut ctx));
            ctx as usize
        };
        let idle = std::thread::spawn(move || {
            ck(cuCtxSetCurrent(ctx as CUcontext));
            cuStreamQuery(2 as CUstream)
        })
        .join()
        .unwrap();
        assert_eq!(idle, CUDA_SUCCESS, "another thread's per-thread stream");
        // The legacy stream waits for it (a blocking stream).
        let legacy = emu.event();
        ck(cuEventRecord(legacy, std::ptr::null_mut()));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(cuEventQuery(legacy), CUDA_ERROR_NOT_READY);
        held.open();
        ck(cuStreamSynchronize(per_thread));
        ck(cuEventSynchronize(legacy));
        for e in [e, after, legacy] {
            ck(cuEventDestroy_v2(e));
        }
        ck(cuStreamDestroy_v2(other));
    }
}

/// The implicit synchronization counts of the emulator (`devarrow_emu_implicit_syncs`):
/// total and `name -> count`.
fn implicit_syncs() -> (u64, std::collections::BTreeMap<String, u64>) {
    use devarrow_emu::driver::sync::devarrow_emu_implicit_syncs;
    let mut buf = vec![0 as std::ffi::c_char; 1 << 16];
    // SAFETY: `buf` holds `buf.len()` bytes.
    let total = unsafe { devarrow_emu_implicit_syncs(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated by the call.
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
    let counts = text
        .lines()
        .map(|line| {
            let (name, n) = line.rsplit_once(' ').unwrap();
            (name.to_owned(), n.parse().unwrap())
        })
        .collect();
    (total, counts)
}

/// How the counts changed from `before` to now: `(total, the calls whose count grew)`.
fn syncs_since(
    before: &(u64, std::collections::BTreeMap<String, u64>),
) -> (u64, Vec<(String, u64)>) {
    let now = implicit_syncs();
    let grew = now
        .1
        .iter()
        .filter_map(|(name, &n)| {
            let was = before.1.get(name).copied().unwrap_or(0);
            (n > was).then(|| (name.clone(), n - was))
        })
        .collect();
    (now.0 - before.0, grew)
}

/// The calls of the programming guide's "Implicit Synchronization" (page-locked host
/// allocation and registration, device allocation outside the pool, the synchronous
/// memset) return at once, but order every stream of the context, non-blocking ones
/// included, after the work enqueued before them: an event recorded afterwards on an
/// idle stream completes only once a stream held by a host function runs again. Each is
/// counted once, under its name. A stream-ordered allocation orders nothing and is not
/// counted.
#[test]
fn allocations_and_registrations_order_every_stream_after_the_work_before_them() {
    let emu = Emu::new();
    let (held, idle) = (emu.stream(1), emu.stream(1));
    let target = emu.alloc(4096);
    let mut backing = Vec::new();
    let pages = aligned_pages(&mut backing, 2);
    let mut registered = false;
    type Call<'a> = (&'static str, Box<dyn FnMut() + 'a>);
    let allocated: std::cell::RefCell<Vec<CUdeviceptr>> = Default::default();
    let pinned: std::cell::RefCell<Vec<*mut c_void>> = Default::default();
    let mut calls: Vec<Call> = vec![
        (
            "cuMemAlloc_v2",
            Box::new(|| {
                let mut p = 0;
                // SAFETY: a valid out-pointer.
                ck(unsafe { cuMemAlloc_v2(&mut p, 256) });
                allocated.borrow_mut().push(p);
            }),
        ),
        (
            "cuMemAllocManaged",
            Box::new(|| {
                let mut p = 0;
                // SAFETY: a valid out-pointer; CU_MEM_ATTACH_GLOBAL.
                ck(unsafe { cuMemAllocManaged(&mut p, 256, 1) });
                allocated.borrow_mut().push(p);
            }),
        ),
        (
            "cuMemAllocHost_v2",
            Box::new(|| {
                let mut p = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                ck(unsafe { cuMemAllocHost_v2(&mut p, 256) });
                pinned.borrow_mut().push(p);
            }),
        ),
        (
            "cuMemHostAlloc",
            Box::new(|| {
                let mut p = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                ck(unsafe { cuMemHostAlloc(&mut p, 256, 0) });
                pinned.borrow_mut().push(p);
            }),
        ),
        (
            "cuMemHostRegister_v2",
            Box::new(|| {
                // SAFETY: two whole pages of `backing`, unregistered below.
                ck(unsafe { cuMemHostRegister_v2(pages.cast(), 2 * 4096, 0) });
                registered = true;
            }),
        ),
        (
            "cuMemHostUnregister",
            Box::new(|| {
                // SAFETY: registered by the call before, no copy uses it.
                ck(unsafe { cuMemHostUnregister(pages.cast()) });
            }),
        ),
        (
            "cuMemsetD8_v2",
            // SAFETY: 4096 bytes of device memory.
            Box::new(|| ck(unsafe { cuMemsetD8_v2(target, 7, 4096) })),
        ),
    ];
    for (name, call) in &mut calls {
        // SAFETY: valid handles; the gate is opened before the streams are destroyed.
        unsafe {
            let gate = Gate::block(held);
            let before = implicit_syncs();
            call();
            let after = emu.event();
            ck(cuEventRecord(after, idle));
            std::thread::sleep(Duration::from_millis(20));
            assert_eq!(
                cuEventQuery(after),
                CUDA_ERROR_NOT_READY,
                "{name}: later work on another (non-blocking) stream waits for the held one"
            );
            assert_eq!(
                syncs_since(&before),
                (1, vec![(name.to_string(), 1)]),
                "{name} counted once"
            );
            gate.open();
            ck(cuEventSynchronize(after));
            ck(cuEventDestroy_v2(after));
        }
    }
    drop(calls);
    assert!(registered);
    // Stream-ordered allocation: not an implicit synchronization.
    // SAFETY: valid handles; the gate is opened before the streams are destroyed.
    unsafe {
        let gate = Gate::block(held);
        let before = implicit_syncs();
        let mut p = 0;
        ck(cuMemAllocAsync(&mut p, 256, idle));
        let after = emu.event();
        ck(cuEventRecord(after, idle));
        ck(cuEventSynchronize(after));
        assert_eq!(cuStreamQuery(held), CUDA_ERROR_NOT_READY);
        ck(cuMemFreeAsync(p, idle));
        assert_eq!(syncs_since(&before), (0, vec![]));
        gate.open();
        ck(cuCtxSynchronize());
        ck(cuEventDestroy_v2(after));
        for p in allocated.take() {
            ck(cuMemFree_v2(p));
        }
        for p in pinned.take() {
            ck(cuMemFreeHost(p));
        }
        ck(cuMemFree_v2(target));
        ck(cuStreamDestroy_v2(held));
        ck(cuStreamDestroy_v2(idle));
    }
}

/// `cuMemFree` (of memory not from a pool) and `cuMemFreeHost` block the host until all
/// work of the context has run, a non-blocking stream held by a host function included,
/// and are counted; `cuMemFree` of pool memory returns at once and is not ("will not
/// perform any implicit synchronization").
#[test]
fn frees_of_device_and_pinned_memory_wait_for_the_whole_context() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let emu = Emu::new();
    let held = emu.stream(1);
    type Free = (&'static str, Box<dyn Fn() -> CUresult>);
    let frees: [Free; 2] = [
        ("cuMemFree_v2", {
            let p = emu.alloc(256);
            // SAFETY: a live allocation, freed once.
            Box::new(move || unsafe { cuMemFree_v2(p) })
        }),
        ("cuMemFreeHost", {
            let p = emu.pinned(256).as_mut_ptr().cast::<c_void>();
            // SAFETY: a live pinned allocation, freed once.
            Box::new(move || unsafe { cuMemFreeHost(p) })
        }),
    ];
    for (name, free) in frees {
        let gate = Gate::block(held);
        let opened = Arc::new(AtomicBool::new(false));
        let opener = {
            let (gate, opened) = (gate.clone(), opened.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                opened.store(true, Ordering::SeqCst);
                gate.open();
            })
        };
        let before = implicit_syncs();
        ck(free());
        assert!(
            opened.load(Ordering::SeqCst),
            "{name} returned while a stream was held"
        );
        assert_eq!(syncs_since(&before), (1, vec![(name.to_string(), 1)]));
        opener.join().unwrap();
    }
    // Pool memory: freed at once, not counted.
    // SAFETY: valid handles; the gate is opened before the stream is destroyed.
    unsafe {
        let gate = Gate::block(held);
        let other = emu.stream(1);
        let mut p = 0;
        ck(cuMemAllocAsync(&mut p, 256, other));
        ck(cuStreamSynchronize(other));
        ck(cuStreamDestroy_v2(other));
        let before = implicit_syncs();
        ck(cuMemFree_v2(p));
        assert_eq!(cuStreamQuery(held), CUDA_ERROR_NOT_READY, "not waited for");
        assert_eq!(syncs_since(&before), (0, vec![]));
        gate.open();
        ck(cuStreamSynchronize(held));
        ck(cuStreamDestroy_v2(held));
    }
}

/// Every call that enqueues work on the legacy NULL stream is counted once, under its
/// name: the synchronous copies, and any stream call given NULL or `CU_STREAM_LEGACY`;
/// the same calls on a created stream are not. `cuCtxSynchronize` is counted too. The
/// per-call counts read back with `devarrow_emu_implicit_sync_count`, and the listing is
/// cut to whole lines that fit.
#[test]
fn commands_on_the_legacy_stream_and_context_synchronizations_are_counted() {
    use devarrow_emu::driver::sync::{
        devarrow_emu_implicit_sync_count, devarrow_emu_implicit_syncs,
    };
    let emu = Emu::new();
    let s = emu.stream(0);
    let p = emu.alloc(64);
    let data = [3u8; 64];
    let legacy = 1 as CUstream;
    let count = |name: &CStr| {
        // SAFETY: a NUL-terminated name.
        unsafe { devarrow_emu_implicit_sync_count(name.as_ptr()) }
    };
    // SAFETY: valid handles and ranges.
    unsafe {
        let before = implicit_syncs();
        let htod = count(c"cuMemcpyHtoD_v2");
        emu.upload(p, &data);
        assert_eq!(count(c"cuMemcpyHtoD_v2"), htod + 1);
        assert_eq!(emu.download(p, 64), data);
        ck(cuMemcpyHtoDAsync_v2(p, data.as_ptr().cast(), 64, s));
        ck(cuMemcpyHtoDAsync_v2(
            p,
            data.as_ptr().cast(),
            64,
            std::ptr::null_mut(),
        ));
        ck(cuMemcpyHtoDAsync_v2(p, data.as_ptr().cast(), 64, legacy));
        let e = emu.event();
        ck(cuEventRecord(e, std::ptr::null_mut()));
        ck(cuStreamWaitEvent(s, e, 0));
        ck(cuEventRecord(e, s));
        ck(cuStreamWaitEvent(std::ptr::null_mut(), e, 0));
        ck(cuStreamSynchronize(s));
        ck(cuStreamSynchronize(std::ptr::null_mut()));
        ck(cuCtxSynchronize());
        let expected: Vec<(String, u64)> = [
            ("cuCtxSynchronize", 1),
            ("cuEventRecord", 1),
            ("cuMemcpyDtoH_v2", 1),
            ("cuMemcpyHtoDAsync_v2", 2),
            ("cuMemcpyHtoD_v2", 1),
            ("cuStreamSynchronize", 1),
            ("cuStreamWaitEvent", 1),
        ]
        .into_iter()
        .map(|(n, c)| (n.to_owned(), c))
        .collect();
        assert_eq!(syncs_since(&before), (8, expected));
        assert_eq!(
            devarrow_emu_implicit_sync_count(std::ptr::null()),
            implicit_syncs().0,
            "NULL: the total"
        );
        assert_eq!(count(c"cuNoSuchCall"), 0);
        // A listing cut to what fits: whole lines, NUL-terminated.
        let mut small = [0x7f as std::ffi::c_char; 24];
        let total = devarrow_emu_implicit_syncs(small.as_mut_ptr(), small.len());
        assert_eq!(total, implicit_syncs().0);
        let text = CStr::from_ptr(small.as_ptr()).to_str().unwrap();
        assert!(text.len() < small.len() && text.lines().all(|l| l.contains(' ')));
        assert!(text.is_empty() || text.ends_with('\n'), "{text:?}");
        ck(cuEventDestroy_v2(e));
        ck(cuMemFree_v2(p));
        ck(cuStreamDestroy_v2(s));
    }
}

#[test]
fn host_functions_may_not_call_the_driver() {
    let emu = Emu::new();
    let s = emu.stream(1);
    static SEEN: Mutex<Option<CUresult>> = Mutex::new(None);
    unsafe extern "C" fn call(_: *mut c_void) {
        let mut n = 0;
        // SAFETY: valid out-pointer.
        *SEEN.lock().unwrap() = Some(unsafe { cuDeviceGetCount(&mut n) });
    }
    // SAFETY: `call` takes no data.
    unsafe {
        ck(cuLaunchHostFunc(s, Some(call), std::ptr::null_mut()));
        ck(cuStreamSynchronize(s));
        ck(cuStreamDestroy_v2(s));
    }
    assert_eq!(*SEEN.lock().unwrap(), Some(CUDA_ERROR_NOT_PERMITTED));
}

#[test]
fn pinned_and_managed_memory_are_known_by_their_attributes() {
    let emu = Emu::new();
    let mut p: *mut c_void = std::ptr::null_mut();
    let mut m: CUdeviceptr = 0;
    let d = emu.alloc(16);
    // SAFETY: valid out-pointers of the attribute types.
    unsafe {
        ck(cuMemHostAlloc(&mut p, 10000, 0x3));
        assert_eq!(p as usize % 4096, 0);
        let mut flags = 0u32;
        ck(cuMemHostGetFlags(
            &mut flags,
            p.cast::<u8>().add(9999).cast(),
        ));
        assert_eq!(flags, 0x3);
        let mut dp: CUdeviceptr = 0;
        ck(cuMemHostGetDevicePointer_v2(&mut dp, p, 0));
        assert_eq!(dp, p as u64, "unified addressing");
        let attr = |ptr: u64, a: CUpointer_attribute| {
            let mut v = 0u64;
            let r = cuPointerGetAttribute((&mut v as *mut u64).cast(), a, ptr);
            (r, v)
        };
        use CUpointer_attribute::*;
        assert_eq!(
            attr(p as u64 + 5, CU_POINTER_ATTRIBUTE_MEMORY_TYPE).1 as u32,
            1
        );
        assert_eq!(attr(d, CU_POINTER_ATTRIBUTE_MEMORY_TYPE).1 as u32, 2);
        assert_eq!(
            attr(d, CU_POINTER_ATTRIBUTE_HOST_POINTER).0,
            CUDA_ERROR_INVALID_VALUE
        );
        let (first, last) = (
            attr(p as u64, CU_POINTER_ATTRIBUTE_BUFFER_ID),
            attr(p as u64 + 9999, CU_POINTER_ATTRIBUTE_BUFFER_ID),
        );
        assert_eq!(first, last);
        assert_ne!(first.1, attr(d, CU_POINTER_ATTRIBUTE_BUFFER_ID).1);
        assert_eq!(attr(d + 3, CU_POINTER_ATTRIBUTE_CONTEXT).1, emu.ctx as u64);
        assert_eq!(
            attr(p as u64 + 10000, CU_POINTER_ATTRIBUTE_MEMORY_TYPE).0,
            CUDA_ERROR_INVALID_VALUE,
            "one past the end"
        );
        let mut f = 0u32;
        assert_eq!(
            cuMemHostGetFlags(&mut f, d as *mut c_void),
            CUDA_ERROR_INVALID_VALUE
        );
        ck(cuMemAllocManaged(&mut m, 64, 1));
        assert_eq!(attr(m, CU_POINTER_ATTRIBUTE_IS_MANAGED).1 as u32, 1);
        // managed memory is host memory too
        std::ptr::write_bytes(m as *mut u8, 3, 64);
        assert_eq!(emu.download(m, 4), vec![3; 4]);
        assert_eq!(
            cuMemFree_v2(p as u64),
            CUDA_ERROR_INVALID_VALUE,
            "pinned is not cuMemFree'd"
        );
        ck(cuMemFreeHost(p));
        ck(cuMemFree_v2(m));
        ck(cuMemFree_v2(d));
    }
}

#[test]
fn stream_ordered_memory_is_usable_only_in_stream_order() {
    let emu = Emu::new();
    let (a, b) = (emu.stream(1), emu.stream(1));
    let mut p: CUdeviceptr = 0;
    // SAFETY: valid handles and ranges; the context is reset at the end (sticky error).
    unsafe {
        let gate = Gate::block(a);
        ck(cuMemAllocAsync(&mut p, 64, a));
        ck(cuMemFreeAsync(p, a));
        let data = [1u8; 64];
        assert_eq!(
            cuMemcpyHtoDAsync_v2(p, data.as_ptr().cast(), 64, b),
            CUDA_ERROR_ILLEGAL_ADDRESS,
            "no new work after the free was requested"
        );
        gate.open();
        ck(cuStreamSynchronize(a));

        // Used on stream b before its allocation ran on (blocked) stream a: a fault.
        let gate = Gate::block(a);
        ck(cuMemAllocAsync(&mut p, 64, a));
        ck(cuMemcpyHtoDAsync_v2(p, data.as_ptr().cast(), 64, b));
        assert_eq!(cuStreamSynchronize(b), CUDA_ERROR_ILLEGAL_ADDRESS);
        gate.open();
        // sticky: the context is unusable now
        let mut q: CUdeviceptr = 0;
        assert_eq!(cuMemAlloc_v2(&mut q, 8), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
        let mut old_id = 0;
        ck(cuCtxGetId(emu.ctx, &mut old_id));
        ck(cuDevicePrimaryCtxReset_v2(0));
        let mut ctx: CUcontext = std::ptr::null_mut();
        ck(cuDevicePrimaryCtxRetain(&mut ctx, 0));
        assert_eq!(
            ctx, emu.ctx,
            "the primary context keeps its handle, as the driver's"
        );
        let mut new_id = 0;
        ck(cuCtxGetId(ctx, &mut new_id));
        assert_ne!(new_id, old_id, "a new context behind it");
        ck(cuDevicePrimaryCtxRelease_v2(0));
        ck(cuCtxSetCurrent(ctx));
        ck(cuMemAlloc_v2(&mut q, 8));
        ck(cuMemFree_v2(q));
    }
}

/// A pool of device memory on the emulated device (`cuMemPoolCreate`).
fn create_pool() -> Result<CUmemoryPool, CUresult> {
    use cudarc::driver::sys::{
        CUmemAllocationHandleType, CUmemAllocationType, CUmemLocationType, CUmemPoolProps,
    };
    // SAFETY: a plain-old-data struct; all zeros is a valid value of each field.
    let mut props: CUmemPoolProps = unsafe { std::mem::zeroed() };
    props.allocType = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    props.handleTypes = CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    props.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: valid pointers to the properties and the out-handle.
    match unsafe { cuMemPoolCreate(&mut pool, &props) } {
        CUDA_SUCCESS => Ok(pool),
        e => Err(e),
    }
}

/// `cuDevicePrimaryCtxReset` leaves the primary context *inactive*: it "does not release"
/// it (the retains stay counted), calls in it fail with `CUDA_ERROR_CONTEXT_IS_DESTROYED`
/// and the pools created in it are gone, until a retain makes it active again under the
/// same handle with a new id (as NVIDIA's driver does: JuliaGPU/CUDA.jl#16,
/// lupinemachines/lupine#844).
#[test]
fn a_reset_primary_context_is_inactive_until_retained_again() {
    let emu = Emu::new();
    // SAFETY: plain driver calls with valid out-pointers; the context is reset on purpose.
    unsafe {
        let pool = create_pool().unwrap();
        let s = emu.stream(1);
        let mut p: CUdeviceptr = 0;
        ck(cuMemAllocFromPoolAsync(&mut p, 64, pool, s));
        ck(cuMemFreeAsync(p, s));
        ck(cuStreamSynchronize(s));
        let mut old_id = 0;
        ck(cuCtxGetId(emu.ctx, &mut old_id));
        let (mut flags, mut active) = (0u32, 0i32);
        ck(cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!(active, 1);

        ck(cuDevicePrimaryCtxReset_v2(0));
        ck(cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!(active, 0, "a reset primary context is inactive");
        let mut current: CUcontext = std::ptr::null_mut();
        ck(cuCtxGetCurrent(&mut current));
        assert_eq!(current, emu.ctx, "the thread still names it");
        let mut q: CUdeviceptr = 0;
        assert_eq!(cuMemAlloc_v2(&mut q, 8), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        assert_eq!(cuCtxSynchronize(), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        let mut id = 0;
        assert_eq!(
            cuCtxGetId(emu.ctx, &mut id),
            CUDA_ERROR_CONTEXT_IS_DESTROYED
        );
        assert_eq!(
            cuCtxGetId(std::ptr::null_mut(), &mut id),
            CUDA_ERROR_CONTEXT_IS_DESTROYED
        );
        let mut s2: CUstream = std::ptr::null_mut();
        assert_eq!(cuStreamCreate(&mut s2, 1), CUDA_ERROR_CONTEXT_IS_DESTROYED);
        ck(cuCtxSetCurrent(emu.ctx));
        assert_eq!(cuMemAlloc_v2(&mut q, 8), CUDA_ERROR_CONTEXT_IS_DESTROYED);

        let mut ctx: CUcontext = std::ptr::null_mut();
        ck(cuDevicePrimaryCtxRetain(&mut ctx, 0));
        assert_eq!(ctx, emu.ctx, "the same handle");
        ck(cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!(active, 1);
        ck(cuCtxGetId(ctx, &mut id));
        assert_ne!(id, old_id, "a new context behind the handle");
        ck(cuMemAlloc_v2(&mut q, 8));
        ck(cuMemFree_v2(q));
        assert_eq!(
            cuMemAllocFromPoolAsync(&mut q, 64, pool, std::ptr::null_mut()),
            CUDA_ERROR_INVALID_VALUE,
            "the pool created in the reset context is gone"
        );
        assert_eq!(cuMemPoolDestroy(pool), CUDA_ERROR_INVALID_VALUE);
        let pool = create_pool().unwrap();
        ck(cuMemAllocFromPoolAsync(
            &mut q,
            64,
            pool,
            std::ptr::null_mut(),
        ));
        ck(cuMemFreeAsync(q, std::ptr::null_mut()));
        ck(cuCtxSynchronize());
        ck(cuMemPoolDestroy(pool));
        // Both retains (before and after the reset) are released: the emulator's drop
        // releases the first, this the second, and the context stays active until then.
        ck(cuDevicePrimaryCtxRelease_v2(0));
        ck(cuDevicePrimaryCtxGetState(0, &mut flags, &mut active));
        assert_eq!(active, 1, "one retain left");
    }
}

/// A pool (`cuMemPoolCreate`) that keeps what is freed across synchronizations, with
/// the three reuse flags (follow event dependencies, opportunistic, internal
/// dependencies).
fn keeping_pool(reuse: [i32; 3]) -> CUmemoryPool {
    let pool = create_pool().unwrap();
    let mut threshold = u64::MAX;
    // SAFETY: a live pool; each value has the attribute's type.
    unsafe {
        ck(cuMemPoolSetAttribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        ));
        set_reuse(pool, reuse);
    }
    pool
}

/// Sets the three `CU_MEMPOOL_ATTR_REUSE_*` flags of `pool`.
///
/// # Safety
/// `pool` must be a live pool.
unsafe fn set_reuse(pool: CUmemoryPool, reuse: [i32; 3]) {
    let attrs = [
        CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC,
        CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
    ];
    for (attr, mut value) in attrs.into_iter().zip(reuse) {
        // SAFETY: the caller's live pool; reuse flags are `int`s.
        ck(unsafe { cuMemPoolSetAttribute(pool, attr, (&mut value as *mut i32).cast()) });
    }
}

/// `cuMemAllocFromPoolAsync` of `len` bytes.
///
/// # Safety
/// `pool` and `stream` must be live.
unsafe fn alloc_from(pool: CUmemoryPool, len: usize, stream: CUstream) -> CUdeviceptr {
    let mut p: CUdeviceptr = 0;
    // SAFETY: the caller's live handles and a valid out-pointer.
    ck(unsafe { cuMemAllocFromPoolAsync(&mut p, len, pool, stream) });
    p
}

/// The stream-ordered allocator reuses a freed block as NVIDIA's pools do: on the stream
/// that freed it at once (stream order makes it safe), on another stream only once the
/// free ran (opportunistic), once that stream waits for an event recorded after the free
/// (event dependencies), or by making it wait for the free (internal dependencies); each
/// per the pool's `CU_MEMPOOL_ATTR_REUSE_*` flags. A free fills the block with
/// `FREED_POISON` when it runs.
#[test]
fn stream_ordered_frees_are_reused_per_the_pools_reuse_rules() {
    let emu = Emu::new();
    let (a, b) = (emu.stream(1), emu.stream(1));
    // SAFETY: valid handles and ranges; every allocation is freed.
    unsafe {
        let pool = keeping_pool([0, 0, 0]);
        // The same stream: at once, before the free ran (the stream is held).
        let gate = Gate::block(a);
        let x = alloc_from(pool, 256, a);
        ck(cuMemFreeAsync(x, a));
        let y = alloc_from(pool, 256, a);
        assert_eq!(y, x, "reused on the freeing stream at once");
        // Another stream, the free not run, no rule allowing it: fresh memory.
        ck(cuMemFreeAsync(y, a));
        let z = alloc_from(pool, 256, b);
        assert_ne!(z, x, "no reuse across streams without a rule");
        gate.open();
        ck(cuStreamSynchronize(a));
        // Even once the free ran, with every flag off.
        let w = alloc_from(pool, 256, b);
        assert_ne!(w, x);
        ck(cuMemFreeAsync(z, b));
        ck(cuMemFreeAsync(w, b));
        ck(cuStreamSynchronize(b));

        // Opportunistic: once the free ran, another stream reuses it, and reads the
        // poison the free left.
        set_reuse(pool, [0, 1, 0]);
        let x = alloc_from(pool, 4096, a);
        ck(cuMemsetD8Async(x, 0x11, 4096, a));
        let gate = Gate::block(a);
        ck(cuMemFreeAsync(x, a));
        let held = alloc_from(pool, 4096, b);
        assert_ne!(held, x, "the free has not run yet");
        gate.open();
        ck(cuStreamSynchronize(a));
        let y = alloc_from(pool, 4096, b);
        assert_eq!(y, x, "opportunistic reuse of a completed free");
        ck(cuStreamSynchronize(b));
        assert_eq!(emu.download(y, 4096), vec![FREED_POISON; 4096]);
        ck(cuMemFreeAsync(y, b));
        ck(cuMemFreeAsync(held, b));
        ck(cuStreamSynchronize(b));

        // Event dependencies: the allocating stream waits for an event recorded after
        // the free, which has not run yet.
        set_reuse(pool, [1, 0, 0]);
        let x = alloc_from(pool, 512, a);
        let gate = Gate::block(a);
        ck(cuMemFreeAsync(x, a));
        let held = alloc_from(pool, 512, b);
        assert_ne!(held, x, "no dependency yet");
        let e = emu.event();
        ck(cuEventRecord(e, a));
        ck(cuStreamWaitEvent(b, e, 0));
        let y = alloc_from(pool, 512, b);
        assert_eq!(y, x, "reuse following the event dependency");
        gate.open();
        ck(cuMemFreeAsync(y, b));
        ck(cuMemFreeAsync(held, b));
        ck(cuStreamSynchronize(b));

        // Internal dependencies: the allocation makes its stream wait for the free.
        set_reuse(pool, [0, 0, 1]);
        let x = alloc_from(pool, 1024, a);
        let gate = Gate::block(a);
        ck(cuMemFreeAsync(x, a));
        let y = alloc_from(pool, 1024, b);
        assert_eq!(y, x, "reuse with an inserted dependency");
        ck(cuEventRecord(e, b));
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            cuEventQuery(e),
            CUDA_ERROR_NOT_READY,
            "stream b waits for the free on the held stream a"
        );
        gate.open();
        ck(cuMemFreeAsync(y, b));
        ck(cuStreamSynchronize(b));
        ck(cuStreamSynchronize(a));

        ck(cuEventDestroy_v2(e));
        destroy_pool(pool);
        ck(cuStreamDestroy_v2(a));
        ck(cuStreamDestroy_v2(b));
    }
}

/// Destroys a pool of [`keeping_pool`], first setting the release threshold back to 0:
/// the emulator's pools share one accounting (its limitation), so the threshold set for
/// the pool would stay for the default pool of later tests.
///
/// # Safety
/// `pool` must be a live pool with nothing allocated from it.
unsafe fn destroy_pool(pool: CUmemoryPool) {
    let mut threshold = 0u64;
    // SAFETY: the caller's live pool; the threshold is a `cuuint64_t`.
    unsafe {
        ck(cuMemPoolSetAttribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        ));
        ck(cuMemPoolDestroy(pool));
    }
}

/// A reader on another stream that is not ordered before a stream-ordered free reads
/// wrong data deterministically (the block reused by the freeing stream, or the free's
/// poison), instead of the stale right data; one that the freeing stream waits for
/// reads the right data; and a freed block nobody reused still faults.
#[test]
fn a_reader_not_ordered_before_a_free_reads_reused_data_or_poison() {
    let emu = Emu::new();
    let (a, b, c) = (emu.stream(1), emu.stream(1), emu.stream(1));
    let host = emu.pinned(4096);
    // SAFETY: valid handles and ranges; the context is reset at the end (sticky fault).
    unsafe {
        let pool = keeping_pool([1, 1, 0]);
        let written = emu.event();
        // Writes 0x11 to a fresh block on `a`, and lets `b` wait for the writing only,
        // then holds `b` and enqueues its read of the block into `host`.
        let setup = |host: &mut [u8]| {
            host.fill(0);
            let x = alloc_from(pool, 4096, a);
            ck(cuMemsetD8Async(x, 0x11, 4096, a));
            ck(cuEventRecord(written, a));
            ck(cuStreamWaitEvent(b, written, 0));
            let gate = Gate::block(b);
            ck(cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), x, 4096, b));
            (x, gate)
        };

        // The producer frees without waiting for the reader and allocates again on its
        // stream: the reader reads the new allocation's data.
        let (x, gate) = setup(host);
        ck(cuMemFreeAsync(x, a));
        let y = alloc_from(pool, 4096, a);
        assert_eq!(y, x);
        ck(cuMemsetD8Async(y, 0x22, 4096, a));
        ck(cuStreamSynchronize(a));
        gate.open();
        ck(cuStreamSynchronize(b));
        assert_eq!(host, &vec![0x22; 4096][..], "the reused block's data");
        ck(cuMemFreeAsync(y, a));

        // Reused by another stream once the free ran: the reader reads the poison.
        let (x, gate) = setup(host);
        ck(cuMemFreeAsync(x, a));
        ck(cuStreamSynchronize(a));
        let z = alloc_from(pool, 4096, c);
        assert_eq!(z, x, "opportunistic reuse on stream c");
        ck(cuStreamSynchronize(c));
        gate.open();
        ck(cuStreamSynchronize(b));
        assert_eq!(host, &vec![FREED_POISON; 4096][..], "the free's poison");
        ck(cuMemFreeAsync(z, c));
        ck(cuStreamSynchronize(c));

        // The freeing stream waits for the reader: the right data.
        let (x, gate) = setup(host);
        let read = emu.event();
        ck(cuEventRecord(read, b));
        ck(cuStreamWaitEvent(a, read, 0));
        ck(cuMemFreeAsync(x, a));
        let y = alloc_from(pool, 4096, a);
        ck(cuMemsetD8Async(y, 0x22, 4096, a));
        gate.open();
        ck(cuStreamSynchronize(a));
        ck(cuStreamSynchronize(b));
        assert_eq!(host, &vec![0x11; 4096][..], "ordered before the free");
        ck(cuMemFreeAsync(y, a));
        ck(cuStreamSynchronize(a));

        // Freed and not reused: the reader's access faults, as before.
        ck(cuMemPoolTrimTo(pool, 0));
        let (x, gate) = setup(host);
        ck(cuMemFreeAsync(x, a));
        ck(cuStreamSynchronize(a));
        gate.open();
        assert_eq!(cuStreamSynchronize(b), CUDA_ERROR_ILLEGAL_ADDRESS);
        destroy_pool(pool);
        ck(cuDevicePrimaryCtxReset_v2(0));
    }
}

/// A kernel's out-of-bounds store is a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`; in bounds, the
/// kernel computes what it should.
#[test]
fn kernels_run_on_the_stream_and_faults_are_sticky() {
    let emu = Emu::new();
    let s = emu.stream(1);
    let src = std::ffi::CString::new(include_str!("../../support/testing.ptx")).unwrap();
    let mut module: CUmodule = std::ptr::null_mut();
    let mut f: CUfunction = std::ptr::null_mut();
    let n: u64 = 1000;
    let p = emu.alloc(4 * n as usize);
    // SAFETY: valid handles; the parameters match dvx_spin_fill_u32(u64, u64, u32, u64).
    unsafe {
        ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
        assert_eq!(
            cuModuleGetFunction(&mut f, module, c"no_such_kernel".as_ptr()),
            CUDA_ERROR_NOT_FOUND
        );
        ck(cuModuleGetFunction(
            &mut f,
            module,
            c"dvx_spin_fill_u32".as_ptr(),
        ));
        let launch = |dst: u64, n: u64| {
            let (mut dst, mut n, mut value, mut spin) = (dst, n, 5u32, 0u64);
            let mut params: [*mut c_void; 4] = [
                (&mut dst as *mut u64).cast(),
                (&mut n as *mut u64).cast(),
                (&mut value as *mut u32).cast(),
                (&mut spin as *mut u64).cast(),
            ];
            cuLaunchKernel(
                f,
                2,
                1,
                1,
                128,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(
            cuLaunchKernel(
                f,
                1,
                1,
                1,
                2048,
                1,
                1,
                0,
                s,
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ),
            CUDA_ERROR_INVALID_VALUE,
            "too many threads per block"
        );
        ck(launch(p, n));
        ck(cuStreamSynchronize(s));
        let got = emu.download(p, 4 * n as usize);
        let want: Vec<u8> = (0..n as u32).flat_map(|i| (5 + i).to_le_bytes()).collect();
        assert_eq!(got, want);
        // one element too many
        ck(launch(p, n + 1));
        assert_eq!(cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(cuStreamQuery(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        ck(cuDevicePrimaryCtxReset_v2(0));
    }
}

/// The gate kernel of `testing.ptx` (`dvx_gate_fill_u32`) spins on a flag in mapped pinned
/// host memory until the host writes it: the kernel runs on the stream's worker while
/// the host goes on, each of its volatile loads reads the host's memory afresh, and
/// nothing but the flag ends it (not the time that passes).
#[test]
fn a_kernel_spins_on_mapped_host_memory_until_the_host_writes_it() {
    let emu = Emu::new();
    let s = emu.stream(1);
    let src = std::ffi::CString::new(include_str!("../../support/testing.ptx")).unwrap();
    let n: u64 = 300;
    let dst = emu.alloc(4 * n as usize);
    let mut module: CUmodule = std::ptr::null_mut();
    let mut f: CUfunction = std::ptr::null_mut();
    let mut host: *mut c_void = std::ptr::null_mut();
    let mut flag: CUdeviceptr = 0;
    // The flag is a naturally aligned u32 of the pinned allocation, accessed on the host
    // through an atomic only, freed after the stream is synchronized.
    // SAFETY: valid handles and out-pointers; the parameters match
    // dvx_gate_fill_u32(u64, u64, u64, u32).
    unsafe {
        ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
        ck(cuModuleGetFunction(
            &mut f,
            module,
            c"dvx_gate_fill_u32".as_ptr(),
        ));
        ck(cuMemHostAlloc(&mut host, 4096, 0x1 | 0x2)); // PORTABLE | DEVICEMAP
        let open = std::sync::atomic::AtomicU32::from_ptr(host.cast::<u32>());
        open.store(0, std::sync::atomic::Ordering::SeqCst);
        ck(cuMemHostGetDevicePointer_v2(&mut flag, host, 0));
        let (mut flag, mut dst, mut len, mut value) = (flag, dst, n, 9u32);
        let mut params: [*mut c_void; 4] = [
            (&mut flag as *mut u64).cast(),
            (&mut dst as *mut u64).cast(),
            (&mut len as *mut u64).cast(),
            (&mut value as *mut u32).cast(),
        ];
        ck(cuLaunchKernel(
            f,
            2,
            1,
            1,
            128,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ));
        let done = emu.event();
        ck(cuEventRecord(done, s));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            cuEventQuery(done),
            CUDA_ERROR_NOT_READY,
            "the gate is closed"
        );
        assert_eq!(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
        // Nothing was written yet.
        assert_eq!(emu.download(dst, 4), vec![POISON; 4]);
        open.store(1, std::sync::atomic::Ordering::SeqCst);
        ck(cuStreamSynchronize(s));
        ck(cuEventQuery(done));
        let want: Vec<u8> = (0..n as u32).flat_map(|i| (9 + i).to_le_bytes()).collect();
        assert_eq!(emu.download(dst, 4 * n as usize), want);
        ck(cuEventDestroy_v2(done));
        ck(cuMemFreeHost(host));
        ck(cuMemFree_v2(dst));
        ck(cuStreamDestroy_v2(s));
        ck(cuModuleUnload(module));
    }
}

#[test]
fn events_time_the_work_between_them() {
    let emu = Emu::new();
    let s = emu.stream(1);
    let (start, end) = (emu.event(), emu.event());
    let mut untimed: CUevent = std::ptr::null_mut();
    let mut ms = -1.0f32;
    // SAFETY: valid handles and out-pointers.
    unsafe {
        ck(cuEventCreate(&mut untimed, 2));
        assert_eq!(
            cuEventElapsedTime(&mut ms, start, end),
            CUDA_ERROR_INVALID_HANDLE,
            "not recorded"
        );
        let gate = Gate::block(s);
        ck(cuEventRecord(start, s));
        unsafe extern "C" fn nap(_: *mut c_void) {
            std::thread::sleep(Duration::from_millis(30));
        }
        ck(cuLaunchHostFunc(s, Some(nap), std::ptr::null_mut()));
        ck(cuEventRecord(end, s));
        ck(cuEventRecord(untimed, s));
        assert_eq!(
            cuEventElapsedTime(&mut ms, start, end),
            CUDA_ERROR_NOT_READY
        );
        gate.open();
        ck(cuEventSynchronize(end));
        ck(cuEventElapsedTime(&mut ms, start, end));
        assert!((25.0..2000.0).contains(&ms), "{ms} ms");
        assert_eq!(
            cuEventElapsedTime(&mut ms, start, untimed),
            CUDA_ERROR_INVALID_HANDLE,
            "CU_EVENT_DISABLE_TIMING"
        );
        for e in [start, end, untimed] {
            ck(cuEventDestroy_v2(e));
        }
        ck(cuStreamDestroy_v2(s));
    }
}

#[test]
fn modules_parse_ptx_and_unloading_invalidates_their_functions() {
    let emu = Emu::new();
    let mut module: CUmodule = std::ptr::null_mut();
    let mut f: CUfunction = std::ptr::null_mut();
    let src =
        std::ffi::CString::new(include_str!("../../../crates/cuda/kernels/copy.ptx")).unwrap();
    // SAFETY: NUL-terminated images, valid out-pointers and handles.
    unsafe {
        assert_eq!(
            cuModuleLoadData(&mut module, c"this is not PTX".as_ptr().cast()),
            CUDA_ERROR_INVALID_PTX
        );
        ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
        ck(cuModuleGetFunction(
            &mut f,
            module,
            c"dvx_batched_copy".as_ptr(),
        ));
        let mut again: CUfunction = std::ptr::null_mut();
        ck(cuModuleGetFunction(
            &mut again,
            module,
            c"dvx_batched_copy".as_ptr(),
        ));
        assert_eq!(f, again, "one handle per function");
        assert_eq!(
            cuModuleGetFunction(&mut again, module, c"dvx_ld_word".as_ptr()),
            CUDA_ERROR_NOT_FOUND,
            "a .func is not an entry"
        );
        ck(cuModuleUnload(module));
        assert_eq!(
            cuLaunchKernel(
                f,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(cuModuleUnload(module), CUDA_ERROR_INVALID_HANDLE);
    }
    drop(emu);
}

/// One `cuMemcpyBatchAsync` call with `copies` (`(dst, src, len)`) and one attribute set
/// of `order` on `stream`: the result and `failIdx`.
///
/// # Safety
/// As `cuMemcpyBatchAsync`: the ranges must stay valid until the batch has run.
unsafe fn batch_copy(
    copies: &[(u64, u64, usize)],
    order: CUmemcpySrcAccessOrder,
    stream: CUstream,
) -> (CUresult, usize) {
    let mut dsts: Vec<CUdeviceptr> = copies.iter().map(|c| c.0).collect();
    let mut srcs: Vec<CUdeviceptr> = copies.iter().map(|c| c.1).collect();
    let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
    // SAFETY: plain data; zero is a valid value of every field.
    let mut attrs: [CUmemcpyAttributes; 1] = [unsafe { std::mem::zeroed() }];
    attrs[0].srcAccessOrder = order;
    let mut starts = [0usize];
    let mut fail = 0usize;
    // SAFETY: the arrays hold `copies.len()` and 1 entries; the ranges are the caller's.
    let r = unsafe {
        cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            copies.len(),
            attrs.as_mut_ptr(),
            starts.as_mut_ptr(),
            1,
            &mut fail,
            stream,
        )
    };
    (r, fail)
}

#[test]
fn batched_copies_run_in_stream_order_and_name_the_copy_that_fails() {
    let emu = Emu::new();
    let s = emu.stream(1);
    let d = emu.alloc(64);
    use CUmemcpySrcAccessOrder::*;
    // SAFETY: valid handles; every range stays valid until the stream is synchronized.
    unsafe {
        let gate = Gate::block(s);
        let mut pageable = [1u8; 16];
        let staged = [2u8; 16];
        let pinned = emu.pinned(32);
        pinned[..16].fill(3);
        let (r, _) = batch_copy(
            &[
                (d, pageable.as_ptr() as u64, 16),
                (d + 16, pinned.as_ptr() as u64, 16),
                (d + 48, staged.as_ptr() as u64, 0),
            ],
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            s,
        );
        ck(r);
        let (r, _) = batch_copy(
            &[(d + 32, staged.as_ptr() as u64, 16)],
            CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL,
            s,
        );
        ck(r);
        // Device to host and device to device in one batch, after the uploads.
        let (r, _) = batch_copy(
            &[(pinned.as_ptr() as u64 + 16, d, 16), (d + 48, d + 16, 16)],
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            s,
        );
        ck(r);
        // Written after the calls, before the batches ran: read in stream order, except
        // the source read during its call.
        pageable.fill(9);
        pinned[..16].fill(8);
        assert_eq!(pinned[16..], [0xCD; 16], "nothing ran yet");
        gate.open();
        ck(cuStreamSynchronize(s));
        let got = emu.download(d, 64);
        assert_eq!(
            got[..16],
            [9; 16],
            "a pageable source read when the batch ran"
        );
        assert_eq!(
            got[16..32],
            [8; 16],
            "a pinned source read when the batch ran"
        );
        assert_eq!(got[32..48], [2; 16], "read during the call");
        assert_eq!(got[48..], [8; 16], "device to device");
        assert_eq!(pinned[16..], [9; 16], "device to host");

        // The copy that fails is named; nothing of the batch runs.
        let far = d + 4096 * 1024;
        let (r, fail) = batch_copy(
            &[
                (d, staged.as_ptr() as u64, 16),
                (far, staged.as_ptr() as u64, 16),
            ],
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            s,
        );
        assert_eq!((r, fail), (CUDA_ERROR_ILLEGAL_ADDRESS, 1));
        // Not on the legacy NULL stream.
        let (r, fail) = batch_copy(
            &[(d, staged.as_ptr() as u64, 16)],
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            std::ptr::null_mut(),
        );
        assert_eq!((r, fail), (CUDA_ERROR_INVALID_VALUE, usize::MAX));
        let (r, _) = batch_copy(
            &[(d, staged.as_ptr() as u64, 16)],
            CU_MEMCPY_SRC_ACCESS_ORDER_INVALID,
            s,
        );
        assert_eq!(r, CUDA_ERROR_INVALID_VALUE, "an invalid access order");
        assert_eq!(
            batch_copy(&[], CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, s).0,
            CUDA_ERROR_INVALID_VALUE,
            "no copies"
        );
        // A driver without it.
        devarrow_emu_set_batch_copy(0);
        let (r, fail) = batch_copy(
            &[(d, staged.as_ptr() as u64, 16)],
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            s,
        );
        devarrow_emu_set_batch_copy(-1);
        assert_eq!((r, fail), (CUDA_ERROR_NOT_SUPPORTED, usize::MAX));
        ck(cuStreamSynchronize(s));
        assert_eq!(emu.download(d, 16), vec![9; 16], "no failed batch ran");
        ck(cuMemFreeHost(pinned.as_mut_ptr().cast()));
        ck(cuMemFree_v2(d));
        ck(cuStreamDestroy_v2(s));
    }
}

/// `pages` pages of page-aligned host memory, inside `backing`.
fn aligned_pages(backing: &mut Vec<u8>, pages: usize) -> *mut u8 {
    *backing = vec![0u8; (pages + 1) * 4096];
    let at = backing.as_ptr().align_offset(4096);
    // SAFETY: `at + pages * 4096` bytes fit in the `(pages + 1) * 4096` allocated.
    unsafe { backing.as_mut_ptr().add(at) }
}

#[test]
fn registered_host_memory_is_copied_in_place_and_pages_register_once() {
    let emu = Emu::new();
    let s = emu.stream(1);
    let d = emu.alloc(4096);
    let mut backing = Vec::new();
    let base = aligned_pages(&mut backing, 3);
    let page = |i: usize| base.wrapping_add(i * 4096);
    let registered = || {
        let mut total = 0u64;
        // SAFETY: a valid out-pointer.
        let live = unsafe { devarrow_emu_host_registrations(&mut total) };
        (live, total)
    };
    let (live_before, total_before) = registered();
    // SAFETY: the pages stay allocated (in `backing`) until the end of the test, and are
    // unregistered before; the copies' ranges lie in them.
    unsafe {
        ck(cuMemHostRegister_v2(page(0).cast(), 2 * 4096 - 100, 0x1));
        assert_eq!(registered(), (live_before + 1, total_before + 1));
        let mut memory_type = 0u32;
        ck(cuPointerGetAttribute(
            (&mut memory_type as *mut u32).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            page(1) as u64,
        ));
        assert_eq!(
            memory_type, 1,
            "registered memory is host memory the driver knows"
        );
        // Its last page is locked as a whole: a range starting on it is refused.
        assert_eq!(
            cuMemHostRegister_v2(page(1).wrapping_add(4000).cast(), 200, 0),
            CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        );
        // The next page is free.
        ck(cuMemHostRegister_v2(page(2).cast(), 4096, 0));
        ck(cuMemHostUnregister(page(2).cast()));
        assert_eq!(
            cuMemHostUnregister(page(1).cast()),
            CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
            "not where it was registered"
        );
        // A copy reads registered memory when it runs, not during the call.
        let gate = Gate::block(s);
        std::slice::from_raw_parts_mut(page(0), 64).fill(4);
        ck(cuMemcpyHtoDAsync_v2(d, page(0).cast(), 64, s));
        std::slice::from_raw_parts_mut(page(0), 64).fill(5);
        gate.open();
        ck(cuStreamSynchronize(s));
        assert_eq!(emu.download(d, 64), vec![5; 64]);
        ck(cuMemHostUnregister(page(0).cast()));
        assert_eq!(registered(), (live_before, total_before + 2));

        // Unregistered while a copy that reads it is still queued: the copy faults.
        ck(cuMemHostRegister_v2(page(0).cast(), 4096, 0));
        let gate = Gate::block(s);
        ck(cuMemcpyHtoDAsync_v2(d, page(0).cast(), 64, s));
        ck(cuMemHostUnregister(page(0).cast()));
        gate.open();
        assert_eq!(cuStreamSynchronize(s), CUDA_ERROR_ILLEGAL_ADDRESS);
        ck(cuDevicePrimaryCtxReset_v2(0));
    }
}

// ------------------------------------------------------------------------------------
// Several devices (`DEVARROW_EMU_DEVICES`)
// ------------------------------------------------------------------------------------

/// Set in the child processes of [`several_devices`]: the emulator reads its
/// configuration once per process, so the tests of 2 and 4 devices run this binary again
/// with `DEVARROW_EMU_DEVICES` set, and only there does [`several_devices_child`] run.
const CHILD: &str = "DEVARROW_EMU_TEST_CHILD";

/// Runs [`several_devices_child`] in a child process of this binary with `env` set, and
/// checks that it ran and passed.
fn run_child(env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "several_devices_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("several devices checked"),
        "child with {env:?} failed:\n{stdout}\n{stderr}"
    );
}

/// Which misuse [`misused_handle_child`] commits (unset: it does nothing).
const MISUSE: &str = "DEVARROW_EMU_TEST_MISUSE";

/// A stream or event handle the driver never handed out, or one already destroyed, ends
/// the process with a message naming the call, as NVIDIA's driver (which dereferences
/// handles) would crash there: no error code a caller or a test could rely on. Each
/// misuse runs in a child process of this binary. NULL and `CU_STREAM_LEGACY` are valid
/// stream handles, `CU_STREAM_PER_THREAD` too (the calling thread's per-thread default
/// stream).
#[test]
fn misused_stream_and_event_handles_abort_naming_the_call() {
    {
        let _emu = Emu::new();
        // SAFETY: the special stream handles, valid in the current context.
        unsafe {
            ck(cuStreamQuery(std::ptr::null_mut()));
            ck(cuStreamQuery(1 as CUstream));
            ck(cuStreamQuery(2 as CUstream));
        }
    }
    for (misuse, message) in [
        (
            "garbage_stream",
            "devarrow-emu: fatal: cuStreamSynchronize: stream handle 0xdead0 was never handed \
             out by the driver",
        ),
        (
            "destroyed_stream",
            "devarrow-emu: fatal: cuStreamQuery: stream handle 0x",
        ),
        (
            "garbage_event",
            "devarrow-emu: fatal: cuEventQuery: event handle 0xdead0 was never handed out",
        ),
        (
            "destroyed_event",
            "devarrow-emu: fatal: cuStreamWaitEvent: event handle 0x",
        ),
        (
            "event_as_stream",
            "devarrow-emu: fatal: cuLaunchHostFunc: stream handle 0x",
        ),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "misused_handle_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(MISUSE, misuse)
            .env_remove("DEVARROW_EMU_API_ERROR_LOG")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(SIGABRT),
            "{misuse}: the child must abort ({:?}):\n{stdout}\n{stderr}",
            out.status
        );
        assert!(
            stderr.contains(message) && stderr.contains("NVIDIA's driver does not validate"),
            "{misuse}: expected {message:?} in:\n{stderr}"
        );
        assert!(
            stdout.contains(&format!("{misuse}: committing")),
            "{misuse}: the child did not get there:\n{stdout}\n{stderr}"
        );
    }
}

/// The signal `std::process::abort` ends a process with.
const SIGABRT: i32 = 6;

/// The misuse [`misused_stream_and_event_handles_abort_naming_the_call`] asks for, in a
/// child process: it must not return.
#[test]
fn misused_handle_child() {
    let Ok(misuse) = std::env::var(MISUSE) else {
        return;
    };
    let emu = Emu::new();
    let stream = emu.stream(1);
    let event = emu.event();
    unsafe extern "C" fn nothing(_: *mut c_void) {}
    // SAFETY: (the whole test) deliberately not, for the call of `misuse`: the handles
    // before it are live.
    unsafe {
        let garbage = 0xdead0usize;
        match misuse.as_str() {
            "destroyed_stream" => ck(cuStreamDestroy_v2(stream)),
            "destroyed_event" => ck(cuEventDestroy_v2(event)),
            _ => {}
        }
        println!("{misuse}: committing");
        let r = match misuse.as_str() {
            "garbage_stream" => cuStreamSynchronize(garbage as CUstream),
            "destroyed_stream" => cuStreamQuery(stream),
            "garbage_event" => cuEventQuery(garbage as CUevent),
            "destroyed_event" => cuStreamWaitEvent(stream, event, 0),
            "event_as_stream" => cuLaunchHostFunc(
                event as usize as CUstream,
                Some(nothing),
                std::ptr::null_mut(),
            ),
            other => panic!("no misuse {other}"),
        };
        panic!("{misuse}: the call returned {r:?}");
    }
}

/// 2 and 4 emulated devices, with peer access and without (`DEVARROW_EMU_NO_PEER=1`).
#[test]
fn several_devices() {
    run_child(&[("DEVARROW_EMU_DEVICES", "2")]);
    run_child(&[("DEVARROW_EMU_DEVICES", "4")]);
    run_child(&[("DEVARROW_EMU_DEVICES", "2"), ("DEVARROW_EMU_NO_PEER", "1")]);
}

/// What [`several_devices`] checks, in a process where `DEVARROW_EMU_DEVICES` is set:
/// each device has its own primary context, memory accounting, default pool and address
/// range (`CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` tells the device); `cuMemcpyPeerAsync`
/// copies between any two devices, peer access or not; a plain copy or a kernel of one
/// device touching another's memory fails with `CUDA_ERROR_ILLEGAL_ADDRESS` unless peer
/// access from the first to the second is enabled; `cuCtxEnablePeerAccess` and
/// `cuCtxDisablePeerAccess` return the documented errors.
#[test]
fn several_devices_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let n: i32 = std::env::var("DEVARROW_EMU_DEVICES")
        .unwrap()
        .parse()
        .unwrap();
    let no_peer = std::env::var("DEVARROW_EMU_NO_PEER").as_deref() == Ok("1");
    const LEN: usize = 4096;
    // SAFETY: (the whole test) plain driver calls with valid out-pointers; every pointer
    // passed is a live allocation of LEN bytes or a host buffer of that size.
    unsafe {
        ck(cuInit(0));
        let mut count = 0;
        ck(cuDeviceGetCount(&mut count));
        assert_eq!(count, n);
        let mut dev = -1;
        assert_eq!(cuDeviceGet(&mut dev, n), CUDA_ERROR_INVALID_DEVICE);
        let mut ctxs = Vec::new();
        let mut pools = Vec::new();
        for d in 0..n {
            ck(cuDeviceGet(&mut dev, d));
            let mut ctx: CUcontext = std::ptr::null_mut();
            ck(cuDevicePrimaryCtxRetain(&mut ctx, d));
            ck(cuCtxSetCurrent(ctx));
            let mut got = -1;
            ck(cuCtxGetDevice(&mut got));
            assert_eq!(got, d);
            let mut pool: CUmemoryPool = std::ptr::null_mut();
            ck(cuDeviceGetDefaultMemPool(&mut pool, d));
            assert!(!ctxs.contains(&ctx) && !pools.contains(&pool));
            ctxs.push(ctx);
            pools.push(pool);
            for peer in 0..n {
                let mut can = -1;
                ck(cuDeviceCanAccessPeer(&mut can, d, peer));
                assert_eq!(can, i32::from(d != peer && !no_peer), "{d} -> {peer}");
            }
        }
        let mut can = 0;
        assert_eq!(
            cuDeviceCanAccessPeer(&mut can, 0, n),
            CUDA_ERROR_INVALID_DEVICE
        );

        // One allocation per device, each in its device's range and accounting.
        let free_of = |ctx: CUcontext| {
            ck(cuCtxSetCurrent(ctx));
            let (mut free, mut total) = (0usize, 0usize);
            ck(cuMemGetInfo_v2(&mut free, &mut total));
            free
        };
        let free_before: Vec<usize> = ctxs.iter().map(|&c| free_of(c)).collect();
        let mut ptrs = Vec::new();
        for (d, &ctx) in ctxs.iter().enumerate() {
            ck(cuCtxSetCurrent(ctx));
            let mut p: CUdeviceptr = 0;
            ck(cuMemAlloc_v2(&mut p, LEN * (d + 1)));
            let mut ordinal = -1i32;
            ck(cuPointerGetAttribute(
                (&mut ordinal as *mut i32).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p,
            ));
            assert_eq!(ordinal, d as i32);
            let mut owner: CUcontext = std::ptr::null_mut();
            ck(cuPointerGetAttribute(
                (&mut owner as *mut CUcontext).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_CONTEXT,
                p,
            ));
            assert_eq!(owner, ctx);
            let data: Vec<u8> = (0..LEN).map(|i| (i + 31 * d) as u8).collect();
            ck(cuMemcpyHtoD_v2(p, data.as_ptr().cast(), LEN));
            ptrs.push(p);
        }
        for (d, &ctx) in ctxs.iter().enumerate() {
            // Each device's free memory went down by its own allocation only.
            assert_eq!(free_before[d] - free_of(ctx), LEN * (d + 1), "device {d}");
        }

        // Peer copies between every pair, without peer access, on a stream of the
        // destination's device.
        for (src, &src_ctx) in ctxs.iter().enumerate() {
            for (dst, &dst_ctx) in ctxs.iter().enumerate() {
                if src == dst {
                    continue;
                }
                ck(cuCtxSetCurrent(dst_ctx));
                let mut s: CUstream = std::ptr::null_mut();
                ck(cuStreamCreate(&mut s, 1));
                let mut tmp: CUdeviceptr = 0;
                ck(cuMemAlloc_v2(&mut tmp, LEN));
                ck(cuMemcpyPeerAsync(tmp, dst_ctx, ptrs[src], src_ctx, LEN, s));
                ck(cuStreamSynchronize(s));
                let mut out = vec![0u8; LEN];
                ck(cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), tmp, LEN));
                let want: Vec<u8> = (0..LEN).map(|i| (i + 31 * src) as u8).collect();
                assert_eq!(out, want, "peer copy {src} -> {dst}");
                // The contexts must name the pointers' devices.
                assert_eq!(
                    cuMemcpyPeerAsync(tmp, src_ctx, ptrs[src], src_ctx, LEN, s),
                    CUDA_ERROR_INVALID_VALUE
                );
                ck(cuMemFree_v2(tmp));
                ck(cuStreamDestroy_v2(s));
            }
        }

        // A plain copy on device 0 touching device 1's memory faults without peer access.
        let (c0, c1) = (ctxs[0], ctxs[1]);
        ck(cuCtxSetCurrent(c0));
        let mut host = vec![0u8; LEN];
        assert_eq!(
            cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptrs[1], LEN),
            CUDA_ERROR_ILLEGAL_ADDRESS
        );
        assert_eq!(
            cuMemcpyDtoD_v2(ptrs[1], ptrs[0], LEN),
            CUDA_ERROR_ILLEGAL_ADDRESS
        );
        assert_eq!(cuMemsetD8_v2(ptrs[1], 0, LEN), CUDA_ERROR_ILLEGAL_ADDRESS);
        // The documented errors of cuCtxEnablePeerAccess / cuCtxDisablePeerAccess.
        assert_eq!(cuCtxEnablePeerAccess(c0, 0), CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(
            cuCtxEnablePeerAccess(std::ptr::null_mut(), 0),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(cuCtxEnablePeerAccess(c1, 1), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            cuCtxDisablePeerAccess(c1),
            CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
        );
        if no_peer {
            assert_eq!(
                cuCtxEnablePeerAccess(c1, 0),
                CUDA_ERROR_PEER_ACCESS_UNSUPPORTED
            );
        } else {
            ck(cuCtxEnablePeerAccess(c1, 0));
            assert_eq!(
                cuCtxEnablePeerAccess(c1, 0),
                CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
            );
            // Device 0 now reaches device 1's memory; not the reverse.
            ck(cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptrs[1], LEN));
            let want: Vec<u8> = (0..LEN).map(|i| (i + 31) as u8).collect();
            assert_eq!(host, want);
            ck(cuCtxSetCurrent(c1));
            assert_eq!(
                cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptrs[0], LEN),
                CUDA_ERROR_ILLEGAL_ADDRESS
            );
            assert_eq!(
                cuCtxDisablePeerAccess(c0),
                CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
            );
            ck(cuCtxSetCurrent(c0));
            // A kernel of device 0 writing device 1's memory, peer access enabled.
            let src = std::ffi::CString::new(include_str!("../../support/testing.ptx")).unwrap();
            let mut module: CUmodule = std::ptr::null_mut();
            let mut f: CUfunction = std::ptr::null_mut();
            ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
            ck(cuModuleGetFunction(
                &mut f,
                module,
                c"dvx_spin_fill_u32".as_ptr(),
            ));
            let launch = |dst: u64| {
                let (mut dst, mut n, mut value, mut spin) = (dst, 64u64, 5u32, 0u64);
                let mut params: [*mut c_void; 4] = [
                    (&mut dst as *mut u64).cast(),
                    (&mut n as *mut u64).cast(),
                    (&mut value as *mut u32).cast(),
                    (&mut spin as *mut u64).cast(),
                ];
                ck(cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    64,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ));
                cuCtxSynchronize()
            };
            ck(launch(ptrs[1]));
            ck(cuCtxSetCurrent(c1));
            ck(cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptrs[1], 256));
            let want: Vec<u8> = (0..64u32).flat_map(|i| (5 + i).to_le_bytes()).collect();
            assert_eq!(&host[..256], &want[..]);
            // Disabled again: the same kernel faults, and the fault is sticky in
            // device 0's context only.
            ck(cuCtxSetCurrent(c0));
            ck(cuCtxDisablePeerAccess(c1));
            assert_eq!(
                cuCtxDisablePeerAccess(c1),
                CUDA_ERROR_PEER_ACCESS_NOT_ENABLED
            );
            assert_eq!(launch(ptrs[1]), CUDA_ERROR_ILLEGAL_ADDRESS);
            assert_eq!(cuCtxSynchronize(), CUDA_ERROR_ILLEGAL_ADDRESS);
            ck(cuCtxSetCurrent(c1));
            ck(cuCtxSynchronize());
            // The reset clears device 0 (its memory included) and nothing else.
            ck(cuDevicePrimaryCtxReset_v2(0));
            ck(cuCtxSetCurrent(c1));
            ck(cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptrs[1], 4));
            assert_eq!(&host[..4], &5u32.to_le_bytes());
            ck(cuDevicePrimaryCtxRetain(&mut ctxs[0], 0));
            ptrs[0] = 0;
        }
        for (d, &p) in ptrs.iter().enumerate() {
            if p != 0 {
                ck(cuMemFree_v2(p));
            }
            ck(cuDevicePrimaryCtxRelease_v2(d as i32));
        }
        if !no_peer {
            // The retain after the reset, released too.
            ck(cuDevicePrimaryCtxRelease_v2(0));
        }
    }
    println!("several devices checked: {n}");
}

/// `atom.cas.b64` and `atom.cas.b32` (global and shared) are atomic compare-and-swaps,
/// as the PTX ISA defines them (`d = [a]; [a] = d == b ? c : d`): of 512 threads in 4
/// blocks claiming 8 global slots, exactly one claims each (and only a thread of that
/// slot), one per block claims a shared slot, and a CAS loop computes the largest id.
#[test]
fn atom_cas_claims_each_slot_once() {
    const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry cas_claim(
    .param .u64 p_slots,
    .param .u64 p_wins,
    .param .u64 p_max
)
{
    .shared .align 8 .b64 s_slot;
    .reg .pred %p<4>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [p_slots];
    ld.param.u64 %rd2, [p_wins];
    ld.param.u64 %rd9, [p_max];
    mov.u32 %r1, %tid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %ctaid.x;
    mad.lo.u32 %r4, %r3, %r2, %r1;
    and.b32 %r5, %r4, 7;
    mul.wide.u32 %rd3, %r5, 8;
    add.u64 %rd4, %rd1, %rd3;
    cvt.u64.u32 %rd5, %r4;
    add.u64 %rd5, %rd5, 1;
    atom.global.cas.b64 %rd6, [%rd4], 0, %rd5;
    setp.eq.u64 %p1, %rd6, 0;
    @%p1 atom.global.add.u32 %r6, [%rd2], 1;
    setp.eq.u32 %p3, %r1, 0;
    @%p3 st.shared.u64 [s_slot], 0;
    bar.sync 0;
    atom.shared.cas.b64 %rd7, [s_slot], 0, %rd5;
    setp.eq.u64 %p1, %rd7, 0;
    @%p1 atom.global.add.u32 %r6, [%rd2+4], 1;
    ld.global.u32 %r7, [%rd9];
MAX_LOOP:
    setp.ge.u32 %p2, %r7, %r4;
    @%p2 bra MAX_DONE;
    atom.global.cas.b32 %r8, [%rd9], %r7, %r4;
    setp.eq.u32 %p2, %r8, %r7;
    @%p2 bra MAX_DONE;
    mov.u32 %r7, %r8;
    bra.uni MAX_LOOP;
MAX_DONE:
    ret;
}
"#;
    let emu = Emu::new();
    let s = emu.stream(1);
    let src = std::ffi::CString::new(PTX).unwrap();
    let mut module: CUmodule = std::ptr::null_mut();
    let mut f: CUfunction = std::ptr::null_mut();
    let slots = emu.alloc(64);
    let wins = emu.alloc(8);
    let max = emu.alloc(4);
    emu.upload(slots, &[0u8; 64]);
    emu.upload(wins, &[0u8; 8]);
    emu.upload(max, &[0u8; 4]);
    // SAFETY: valid handles; the parameters match cas_claim(u64, u64, u64), each
    // pointing to device memory of the sizes the kernel reads and writes.
    unsafe {
        ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
        ck(cuModuleGetFunction(&mut f, module, c"cas_claim".as_ptr()));
        let (mut a, mut b, mut c) = (slots, wins, max);
        let mut params: [*mut c_void; 3] = [
            (&mut a as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut c as *mut u64).cast(),
        ];
        ck(cuLaunchKernel(
            f,
            4,
            1,
            1,
            128,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ));
        ck(cuStreamSynchronize(s));
    }
    let got = emu.download(slots, 64);
    for (j, word) in got.chunks_exact(8).enumerate() {
        let claimed = u64::from_le_bytes(word.try_into().unwrap());
        assert!(
            claimed > 0 && (claimed - 1) % 8 == j as u64,
            "slot {j}: {claimed}"
        );
    }
    let wins = emu.download(wins, 8);
    assert_eq!(u32::from_le_bytes(wins[..4].try_into().unwrap()), 8);
    assert_eq!(u32::from_le_bytes(wins[4..].try_into().unwrap()), 4);
    let max = emu.download(max, 4);
    assert_eq!(u32::from_le_bytes(max.try_into().unwrap()), 511);
}

/// `{add,sub,mul,div}.rn.f64` and `cvt.rn.f64.s64` on 64-bit registers (bit-size
/// registers go with any type of their size) are IEEE 754 binary64 rounded to the
/// nearest even, as the PTX ISA defines them: each of 64 threads computes its row's
/// `(a + b, a - b, a * b, a / b, (double) i)` and the results equal Rust's, bit for bit
/// (infinities, a zero divisor, inexact quotients and a conversion that rounds among them).
#[test]
fn binary64_arithmetic_rounds_to_nearest_even() {
    const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry f64_ops(
    .param .u64 p_a,
    .param .u64 p_b,
    .param .u64 p_i,
    .param .u64 p_out
)
{
    .reg .b32 %r<4>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_a];
    ld.param.u64 %rd2, [p_b];
    ld.param.u64 %rd3, [p_i];
    ld.param.u64 %rd4, [p_out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd5, %r1, 8;
    add.u64 %rd6, %rd1, %rd5;
    ld.global.u64 %rd7, [%rd6];
    add.u64 %rd6, %rd2, %rd5;
    ld.global.u64 %rd8, [%rd6];
    add.u64 %rd6, %rd3, %rd5;
    ld.global.u64 %rd9, [%rd6];
    mul.wide.u32 %rd5, %r1, 40;
    add.u64 %rd6, %rd4, %rd5;
    add.rn.f64 %rd10, %rd7, %rd8;
    st.global.u64 [%rd6], %rd10;
    sub.rn.f64 %rd10, %rd7, %rd8;
    st.global.u64 [%rd6+8], %rd10;
    mul.rn.f64 %rd10, %rd7, %rd8;
    st.global.u64 [%rd6+16], %rd10;
    div.rn.f64 %rd10, %rd7, %rd8;
    st.global.u64 [%rd6+24], %rd10;
    cvt.rn.f64.s64 %rd10, %rd9;
    st.global.u64 [%rd6+32], %rd10;
    ret;
}
"#;
    let n = 64usize;
    let a: Vec<f64> = (0..n)
        .map(|i| match i % 8 {
            0 => f64::INFINITY,
            1 => 1.0 / 3.0,
            2 => -0.0,
            _ => (i as f64) * 1.1 - 17.25,
        })
        .collect();
    let b: Vec<f64> = (0..n)
        .map(|i| match i % 5 {
            0 => 0.0,
            1 => 3.0,
            _ => 0.1 * i as f64 + 1e-300,
        })
        .collect();
    let ints: Vec<i64> = (0..n as i64)
        .map(|i| match i % 4 {
            0 => (1 << 53) + 1 + i,
            1 => i64::MIN + i,
            2 => -i * 1_000_003,
            _ => i64::MAX - i,
        })
        .collect();
    let bytes = |v: &[u64]| v.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<_>>();
    let emu = Emu::new();
    let s = emu.stream(1);
    let src = std::ffi::CString::new(PTX).unwrap();
    let mut module: CUmodule = std::ptr::null_mut();
    let mut f: CUfunction = std::ptr::null_mut();
    let (da, db, di, out) = (
        emu.alloc(8 * n),
        emu.alloc(8 * n),
        emu.alloc(8 * n),
        emu.alloc(40 * n),
    );
    emu.upload(
        da,
        &bytes(&a.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
    );
    emu.upload(
        db,
        &bytes(&b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
    );
    emu.upload(
        di,
        &bytes(&ints.iter().map(|&x| x as u64).collect::<Vec<_>>()),
    );
    // SAFETY: valid handles; the parameters match f64_ops(u64, u64, u64, u64), each
    // pointing to device memory of the sizes the kernel's 64 threads read and write.
    unsafe {
        ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
        ck(cuModuleGetFunction(&mut f, module, c"f64_ops".as_ptr()));
        let (mut pa, mut pb, mut pi, mut po) = (da, db, di, out);
        let mut params: [*mut c_void; 4] = [
            (&mut pa as *mut u64).cast(),
            (&mut pb as *mut u64).cast(),
            (&mut pi as *mut u64).cast(),
            (&mut po as *mut u64).cast(),
        ];
        ck(cuLaunchKernel(
            f,
            1,
            1,
            1,
            n as u32,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ));
        ck(cuStreamSynchronize(s));
    }
    let got = emu.download(out, 40 * n);
    for i in 0..n {
        let word = |k: usize| {
            let at = 40 * i + 8 * k;
            u64::from_le_bytes(got[at..at + 8].try_into().unwrap())
        };
        let want = [
            (a[i] + b[i]).to_bits(),
            (a[i] - b[i]).to_bits(),
            (a[i] * b[i]).to_bits(),
            (a[i] / b[i]).to_bits(),
            (ints[i] as f64).to_bits(),
        ];
        for (k, want) in want.into_iter().enumerate() {
            assert_eq!(word(k), want, "row {i}, result {k}");
        }
    }
}

/// `atom.global.add.f64` and `red.global.add.f64` (sm_60 and later): 256 threads add to
/// one double (no update lost, whatever the order) and `atom` gives each the value it
/// replaced; each addend a small positive integer, so every order's sum is exact and equal.
#[test]
fn atomic_f64_adds_lose_no_update() {
    const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry f64_atomics(
    .param .u64 p_sum,
    .param .u64 p_old
)
{
    .reg .b32 %r<4>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_sum];
    ld.param.u64 %rd2, [p_old];
    mov.u32 %r1, %tid.x;
    cvt.u64.u32 %rd3, %r1;
    add.u64 %rd3, %rd3, 1;
    cvt.rn.f64.s64 %rd4, %rd3;
    atom.global.add.f64 %rd5, [%rd1], %rd4;
    mul.wide.u32 %rd6, %r1, 8;
    add.u64 %rd6, %rd2, %rd6;
    st.global.u64 [%rd6], %rd5;
    red.global.add.f64 [%rd1+8], %rd4;
    ret;
}
"#;
    let n = 256usize;
    let emu = Emu::new();
    let s = emu.stream(1);
    let (sum, old) = (emu.alloc(16), emu.alloc(8 * n));
    emu.upload(sum, &[0u8; 16]);
    // f64_atomics(u64, u64): 16 bytes of sums and a double per thread of the 256.
    launch_with_two_addresses(s, PTX, c"f64_atomics", (sum, old), n as u32);
    let got = emu.download(sum, 16);
    let word =
        |b: &[u8], at: usize| f64::from_bits(u64::from_le_bytes(b[at..at + 8].try_into().unwrap()));
    let want = (1..=n).sum::<usize>() as f64;
    assert_eq!((word(&got, 0), word(&got, 8)), (want, want));
    // Each old value is a sum of a subset of the others' addends: distinct, below the
    // total.
    let olds = emu.download(old, 8 * n);
    let mut seen: Vec<f64> = (0..n).map(|i| word(&olds, 8 * i)).collect();
    seen.sort_by(f64::total_cmp);
    seen.dedup();
    assert_eq!(seen.len(), n, "every thread replaced another value");
    assert!(seen.iter().all(|&v| v < want));
}

/// `atom.global.{and,or,xor}.b64`, `red.global.or.b64`, and `.b32` and shared-memory
/// forms (all of sm_70's): 256 threads combine their values into words (no update lost,
/// whatever the order), and `atom` gives each the word it replaced.
#[test]
fn bitwise_atomics_lose_no_update() {
    const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry bit_atomics(
    .param .u64 p_words,
    .param .u64 p_old
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<16>;
    .shared .align 8 .b64 s_word;

    ld.param.u64 %rd1, [p_words];
    ld.param.u64 %rd2, [p_old];
    mov.u32 %r1, %tid.x;
    // v = a bit of its own (1 << (tid % 64)), and tid * 0x9E3779B97F4A7C15
    and.b32 %r2, %r1, 63;
    mov.u64 %rd3, 1;
    shl.b64 %rd3, %rd3, %r2;
    cvt.u64.u32 %rd4, %r1;
    mul.lo.u64 %rd4, %rd4, 0x9E3779B97F4A7C15;
    atom.global.or.b64 %rd5, [%rd1], %rd3;
    not.b64 %rd6, %rd3;
    atom.global.and.b64 %rd7, [%rd1+8], %rd6;
    atom.global.xor.b64 %rd8, [%rd1+16], %rd4;
    red.global.or.b64 [%rd1+24], %rd4;
    cvt.u32.u64 %r3, %rd4;
    atom.global.xor.b32 %r4, [%rd1+32], %r3;
    setp.eq.u32 %p1, %r1, 0;
    @%p1 st.shared.u64 [s_word], 0;
    bar.sync 0;
    atom.shared.xor.b64 %rd9, [s_word], %rd4;
    bar.sync 0;
    @%p1 ld.shared.u64 %rd10, [s_word];
    @%p1 st.global.u64 [%rd1+40], %rd10;
    mul.wide.u32 %rd11, %r1, 8;
    add.u64 %rd11, %rd2, %rd11;
    st.global.u64 [%rd11], %rd5;
    ret;
}
"#;
    let n = 256usize;
    let emu = Emu::new();
    let s = emu.stream(1);
    let (words, old) = (emu.alloc(48), emu.alloc(8 * n));
    let mut init = [0u8; 48];
    init[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    emu.upload(words, &init);
    // bit_atomics(u64, u64): 48 bytes of words and a u64 per thread of the 256.
    launch_with_two_addresses(s, PTX, c"bit_atomics", (words, old), n as u32);
    let got = emu.download(words, 48);
    let word = |at: usize| u64::from_le_bytes(got[at..at + 8].try_into().unwrap());
    let values: Vec<u64> = (0..n as u64)
        .map(|t| t.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect();
    let xor = values.iter().fold(0u64, |a, v| a ^ v);
    let or = values.iter().fold(0u64, |a, v| a | v);
    assert_eq!(word(0), u64::MAX, "every bit set by some thread");
    assert_eq!(word(8), 0, "every bit cleared by some thread");
    assert_eq!(word(16), xor);
    assert_eq!(word(24), or);
    assert_eq!(
        word(32) & 0xFFFF_FFFF,
        xor & 0xFFFF_FFFF,
        "b32: the low word only"
    );
    assert_eq!(word(32) >> 32, 0, "b32 writes no byte past its word");
    assert_eq!(word(40), xor, "shared memory");
    // The or's old values: each a subset of the bits the others set, the first 0.
    let olds = emu.download(old, 8 * n);
    let olds: Vec<u64> = (0..n)
        .map(|i| u64::from_le_bytes(olds[8 * i..8 * i + 8].try_into().unwrap()))
        .collect();
    assert!(olds.contains(&0), "one thread saw the word unset");
}

/// Loads `ptx` and runs `entry` (two u64 parameters, `addresses`: device memory the
/// kernel reads and writes within its bounds) in one block of `threads` threads on
/// stream `s`, to the end.
fn launch_with_two_addresses(
    s: CUstream,
    ptx: &str,
    entry: &std::ffi::CStr,
    addresses: (u64, u64),
    threads: u32,
) {
    let src = std::ffi::CString::new(ptx).unwrap();
    let mut module: CUmodule = std::ptr::null_mut();
    let mut f: CUfunction = std::ptr::null_mut();
    let (mut a, mut b) = addresses;
    // SAFETY: valid handles; the kernel takes (u64, u64), addresses of device memory
    // the caller sized for `threads` threads.
    unsafe {
        ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
        ck(cuModuleGetFunction(&mut f, module, entry.as_ptr()));
        let mut params: [*mut c_void; 2] =
            [(&mut a as *mut u64).cast(), (&mut b as *mut u64).cast()];
        ck(cuLaunchKernel(
            f,
            1,
            1,
            1,
            threads,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ));
        ck(cuStreamSynchronize(s));
    }
}

/// Runs `entry` of `ptx` (parameters: the input's address, the output's) in one block of
/// a thread per value of `values` (doubles), each writing `out_bytes` bytes; the output.
fn doubles_through(ptx: &str, entry: &std::ffi::CStr, values: &[f64], out_bytes: usize) -> Vec<u8> {
    let n = values.len();
    let emu = Emu::new();
    let s = emu.stream(1);
    let (input, out) = (emu.alloc(8 * n), emu.alloc(out_bytes * n));
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .collect();
    emu.upload(input, &bytes);
    // The kernel takes (u64, u64): it reads a double and writes `out_bytes` per thread.
    launch_with_two_addresses(s, ptx, entry, (input, out), n as u32);
    emu.download(out, out_bytes * n)
}

/// `cvt.{rni,rzi,rmi,rpi}.f64.f64` round a double to an integral double (ties to even,
/// toward zero, down, up) and `sqrt.rn.f64` takes its square root, correctly rounded,
/// as PTX documents them: zeros keep their sign, infinities stay, a negative operand's
/// root is NaN.
#[test]
fn doubles_round_to_integers_and_take_square_roots() {
    const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry rounds(
    .param .u64 p_in,
    .param .u64 p_out
)
{
    .reg .b32 %r<4>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_in];
    ld.param.u64 %rd2, [p_out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 8;
    add.u64 %rd4, %rd1, %rd3;
    ld.global.u64 %rd5, [%rd4];
    cvt.rni.f64.f64 %rd6, %rd5;
    cvt.rzi.f64.f64 %rd7, %rd5;
    cvt.rmi.f64.f64 %rd8, %rd5;
    cvt.rpi.f64.f64 %rd9, %rd5;
    sqrt.rn.f64 %rd10, %rd5;
    mul.wide.u32 %rd3, %r1, 40;
    add.u64 %rd4, %rd2, %rd3;
    st.global.u64 [%rd4], %rd6;
    st.global.u64 [%rd4+8], %rd7;
    st.global.u64 [%rd4+16], %rd8;
    st.global.u64 [%rd4+24], %rd9;
    st.global.u64 [%rd4+32], %rd10;
    ret;
}
"#;
    let values = [
        2.5,
        -2.5,
        3.5,
        0.499_999_999_999_999_94,
        -0.3,
        -0.0,
        1e300,
        f64::INFINITY,
        f64::NEG_INFINITY,
        2.0,
        4_503_599_627_370_497.0,
        -7.75,
    ];
    let got = doubles_through(PTX, c"rounds", &values, 40);
    let word = |at: usize| f64::from_bits(u64::from_le_bytes(got[at..at + 8].try_into().unwrap()));
    for (i, v) in values.iter().enumerate() {
        let want = [
            v.round_ties_even(),
            v.trunc(),
            v.floor(),
            v.ceil(),
            v.sqrt(),
        ];
        for (k, want) in want.iter().enumerate() {
            let got = word(40 * i + 8 * k);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{v}: op {k} gave {got}, not {want}"
            );
        }
    }
    assert_eq!(
        word(40 * 5 + 16).to_bits(),
        (-0.0f64).to_bits(),
        "floor keeps -0.0"
    );
    assert!(word(40 * 11 + 32).is_nan(), "the root of a negative is NaN");
}

/// A kernel converting each thread's u64 (`cvt.rzi.s64.f64` of a double) into a u64.
const FLOAT_TO_S64: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry to_s64(
    .param .u64 p_in,
    .param .u64 p_out
)
{
    .reg .b32 %r<4>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [p_in];
    ld.param.u64 %rd2, [p_out];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 8;
    add.u64 %rd4, %rd1, %rd3;
    ld.global.u64 %rd5, [%rd4];
    cvt.rzi.s64.f64 %rd6, %rd5;
    add.u64 %rd4, %rd2, %rd3;
    st.global.u64 [%rd4], %rd6;
    ret;
}
"#;

/// `cvt.rzi.s64.f64`: truncated toward zero, clamped to the s64 range, NaN 0, as PTX
/// documents its float-to-integer conversions.
#[test]
fn float_to_integer_truncates_and_saturates() {
    let values = [
        2.5,
        -2.5,
        0.999_999,
        -0.999_999,
        -0.0,
        1e300,
        -1e300,
        f64::NAN,
        f64::INFINITY,
        9.223_372_036_854_775e18,
        i64::MIN as f64,
        4_503_599_627_370_497.0,
    ];
    let got = doubles_through(FLOAT_TO_S64, c"to_s64", &values, 8);
    let want: [i64; 12] = [
        2,
        -2,
        0,
        0,
        0,
        i64::MAX,
        i64::MIN,
        0,
        i64::MAX,
        9_223_372_036_854_774_784,
        i64::MIN,
        4_503_599_627_370_497,
    ];
    for (i, want) in want.iter().enumerate() {
        let v = i64::from_le_bytes(got[8 * i..8 * i + 8].try_into().unwrap());
        assert_eq!(v, *want, "{}", values[i]);
    }
}

/// `and`, `or` and `xor` of predicates take negated sources (`!%p`), as ptxas accepts
/// them: each of 4 threads combines its bits 0 and 1, plain and negated, and the results
/// are Rust's.
#[test]
fn predicate_logic_takes_negated_sources() {
    const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry logic(
    .param .u64 p_out
)
{
    .reg .pred %p<8>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<4>;

    ld.param.u64 %rd1, [p_out];
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 1;
    setp.ne.u32 %p1, %r2, 0;
    and.b32 %r2, %r1, 2;
    setp.ne.u32 %p2, %r2, 0;
    and.pred %p3, %p1, !%p2;
    or.pred %p4, !%p1, %p2;
    xor.pred %p5, !%p1, !%p2;
    and.pred %p6, !%p1, !%p2;
    selp.u32 %r3, 1, 0, %p3;
    selp.u32 %r4, 2, 0, %p4;
    selp.u32 %r5, 4, 0, %p5;
    selp.u32 %r6, 8, 0, %p6;
    or.b32 %r3, %r3, %r4;
    or.b32 %r3, %r3, %r5;
    or.b32 %r3, %r3, %r6;
    mul.wide.u32 %rd2, %r1, 4;
    add.u64 %rd2, %rd1, %rd2;
    st.global.u32 [%rd2], %r3;
    ret;
}
"#;
    let emu = Emu::new();
    let s = emu.stream(1);
    let src = std::ffi::CString::new(PTX).unwrap();
    let mut module: CUmodule = std::ptr::null_mut();
    let mut f: CUfunction = std::ptr::null_mut();
    let out = emu.alloc(16);
    // SAFETY: valid handles; the one parameter matches logic(u64), pointing to 16 bytes
    // of device memory, one u32 per thread.
    unsafe {
        ck(cuModuleLoadData(&mut module, src.as_ptr().cast()));
        ck(cuModuleGetFunction(&mut f, module, c"logic".as_ptr()));
        let mut a = out;
        let mut params: [*mut c_void; 1] = [(&mut a as *mut u64).cast()];
        ck(cuLaunchKernel(
            f,
            1,
            1,
            1,
            4,
            1,
            1,
            0,
            s,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        ));
        ck(cuStreamSynchronize(s));
    }
    let got = emu.download(out, 16);
    for (i, word) in got.chunks_exact(4).enumerate() {
        let (p1, p2) = (i & 1 != 0, i & 2 != 0);
        let want = u32::from(p1 && !p2)
            | u32::from(!p1 || p2) << 1
            | u32::from(!p1 ^ !p2) << 2
            | u32::from(!p1 && !p2) << 3;
        assert_eq!(
            u32::from_le_bytes(word.try_into().unwrap()),
            want,
            "thread {i}"
        );
    }
}

/// `cvt.rn.f64.u64`, which NVIDIA's ptxas accepts, converts an unsigned 64-bit integer to
/// the nearest double, ties to even (values past 2^63 are no negative numbers).
#[test]
fn unsigned_integers_convert_to_doubles() {
    let values: [u64; 4] = [0, (1 << 53) + 1, u64::MAX, 1 << 63];
    let ptx = FLOAT_TO_S64.replace("cvt.rzi.s64.f64", "cvt.rn.f64.u64");
    let bits: Vec<f64> = values.iter().map(|v| f64::from_bits(*v)).collect();
    let got = doubles_through(&ptx, c"to_s64", &bits, 8);
    for (word, v) in got.chunks_exact(8).zip(values) {
        let got = f64::from_bits(u64::from_le_bytes(word.try_into().unwrap()));
        assert_eq!(got, v as f64, "{v}");
    }
}
