//! The GPU tests of devarrow-cuda, in one test binary.
//!
//! Without a usable GPU each test prints `skipping: <reason>` and passes, unless the
//! environment sets `DEVARROW_REQUIRE_GPU=1`, in which case it fails.

use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use arrow_buffer::alloc::Allocation;
use arrow_data::ArrayData;
use arrow_schema::DataType;
use devarrow_abi::device::{
    host_page_size, CopyCounter, Device, DeviceToHost, HostToDevice, MemoryPoolPolicy,
};
use devarrow_abi::{ArrowDeviceArray, ArrowDeviceType, DeviceArray};
use devarrow_cuda::cudarc::driver::{result, sys};
use devarrow_cuda::kernels::{self, CopySegment, Kernels};
use devarrow_cuda::pool::{self, PoolPolicy};
use devarrow_cuda::{
    export_array_data, list_devices, live_host_registrations, CudaDevice, CudaDeviceOptions,
    CudaError, CudaMemory, CudaStream, DeviceBuffer, ForeignBuffer, HostWait, ImportedArray,
    ManagedBuffer, PinnedHostBuffer, PrimaryContext,
};
use devarrow_testing::gate::Gate;
use devarrow_testing::gpu::{unless_sanitized, EmulatedDriver, FailureInjection};
use devarrow_testing::kernel_oracles as reference;
use devarrow_testing::leaks::{
    emulated_mem_get_info_calls, DeviceMemoryCheck, DEVICE_MEMORY_MARGIN,
};

/// Device 0 with the test lock held, or `None` after printing why the test is skipped
/// (panics instead when `DEVARROW_REQUIRE_GPU=1`).
fn gpu() -> Option<(MutexGuard<'static, ()>, PrimaryContext)> {
    devarrow_testing::gpu::open_or_skip(|| PrimaryContext::open(0))
}

macro_rules! gpu_or_skip {
    () => {
        match gpu() {
            Some(held) => held,
            None => return,
        }
    };
}

/// Reproducible random inputs, the generator the oracles are tested with.
use devarrow_testing::kernel_oracles::SplitMix64 as Rng;

/// Lengths (in bits or elements) around every boundary the kernels care about.
fn lengths() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=70).collect();
    for m in [
        127usize,
        128,
        129,
        255,
        256,
        257,
        511,
        512,
        513,
        1000,
        1023,
        1024,
        1025,
        4095,
        4096,
        4097,
        8191,
        32768,
        65_535,
        65_536,
        65_537,
        100_003,
        1 << 20,
    ] {
        v.push(m);
    }
    v.push((1 << 22) + 77);
    v
}

/// A view of `len` bytes starting `shift` bytes into `buf`, holding `buf`.
fn view(buf: &Arc<DeviceBuffer>, shift: usize, len: usize) -> ForeignBuffer {
    assert!(shift + len <= buf.len());
    let owner: Arc<dyn Allocation> = buf.clone();
    // SAFETY: the range lies inside `buf`, which the view keeps alive; nothing writes it
    // while the view is used.
    unsafe {
        ForeignBuffer::new(
            buf.device_ptr() + shift as u64,
            len,
            ArrowDeviceType::CUDA,
            buf.device_id(),
            false,
            owner,
        )
    }
}

/// `bytes` uploaded to a fresh device buffer at `shift` bytes past a 256-aligned start.
fn upload_at(stream: &Arc<CudaStream>, bytes: &[u8], shift: usize) -> (Arc<DeviceBuffer>, u64) {
    let mut padded = vec![0xEEu8; shift];
    padded.extend_from_slice(bytes);
    let buf = Arc::new(DeviceBuffer::from_host(stream, &padded).unwrap());
    let ptr = buf.device_ptr() + shift as u64;
    (buf, ptr)
}

fn download(stream: &Arc<CudaStream>, buf: &DeviceBuffer) -> Vec<u8> {
    buf.to_host(stream).unwrap()
}

/// Free device memory after synchronizing and trimming the pool.
fn free_memory(dev: &PrimaryContext) -> usize {
    dev.synchronize().unwrap();
    dev.trim_memory_pool().unwrap();
    dev.memory_info().unwrap().0
}

#[test]
fn devices_are_listed_and_opened_on_the_primary_context() {
    let (_lock, dev) = gpu_or_skip!();
    let list = list_devices().unwrap();
    assert!(!list.is_empty());
    assert_eq!(list[0].id, 0);
    assert!(list[0].total_memory > 0);
    println!("device 0: {:?}", list[0]);
    assert!(dev.context().is_primary());
    // The primary context is the one the runtime and other libraries use.
    // SAFETY: device 0 exists; the retain is balanced by the release below.
    let primary = unsafe { result::primary_ctx::retain(dev.context().cu_device()) }.unwrap();
    assert_eq!(primary, dev.cu_context());
    // SAFETY: balances the retain above.
    unsafe { result::primary_ctx::release(dev.context().cu_device()) }.unwrap();
    let again = PrimaryContext::open(0).unwrap();
    assert_eq!(again, dev);
    match PrimaryContext::open(list.len()) {
        Err(CudaError::InvalidDeviceId { id, count }) => {
            assert_eq!((id, count), (list.len(), list.len()))
        }
        other => panic!("expected InvalidDeviceId, got {other:?}"),
    }
    let k1 = Kernels::for_context(dev.context()).unwrap();
    let k2 = Kernels::for_context(again.context()).unwrap();
    assert!(Arc::ptr_eq(&k1, &k2), "kernels are loaded once per context");
}

#[test]
fn device_pinned_and_managed_buffers_round_trip() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let mut rng = Rng(11);
    for len in [0usize, 1, 7, 255, 4096, (1 << 20) + 3] {
        let data = rng.bytes(len);
        let buf = DeviceBuffer::from_host(&stream, &data).unwrap();
        assert_eq!(buf.len(), len);
        assert_eq!(buf.device_ptr() % 256, 0);
        assert_eq!(download(&stream, &buf), data);
        let mut z = DeviceBuffer::zeroed(&stream, len).unwrap();
        assert!(download(&stream, &z).iter().all(|&b| b == 0));
        z.memset(&stream, 0x5A).unwrap();
        assert!(download(&stream, &z).iter().all(|&b| b == 0x5A));

        // pinned -> device -> pinned through the batched copy kernel
        let pinned = PinnedHostBuffer::from_slice(&dev, &data).unwrap();
        assert_eq!(pinned.device_type(), ArrowDeviceType::CUDA_HOST);
        let dbuf = DeviceBuffer::alloc(&stream, len).unwrap();
        let mut back = PinnedHostBuffer::alloc(&dev, len).unwrap();
        // SAFETY: all three ranges are live for `len` bytes and distinct; we synchronize
        // before reading or dropping them.
        unsafe {
            kernels::batched_copy(
                &stream,
                &[CopySegment {
                    src: pinned.device_ptr(),
                    dst: dbuf.device_ptr(),
                    len: len as u64,
                }],
            )
            .unwrap();
            kernels::batched_copy(
                &stream,
                &[CopySegment {
                    src: dbuf.device_ptr(),
                    dst: back.device_ptr(),
                    len: len as u64,
                }],
            )
            .unwrap();
        }
        stream.synchronize().unwrap();
        assert_eq!(back.as_mut_slice(), &data[..]);

        if dev.supports_managed_memory() {
            let mut managed = ManagedBuffer::alloc(&dev, len).unwrap();
            // SAFETY: no device work uses the fresh managed buffer.
            unsafe { managed.as_mut_slice() }.copy_from_slice(&data);
            let out = DeviceBuffer::alloc(&stream, len).unwrap();
            // SAFETY: both ranges live and distinct; synchronized below.
            unsafe {
                kernels::batched_copy(
                    &stream,
                    &[CopySegment {
                        src: managed.device_ptr(),
                        dst: out.device_ptr(),
                        len: len as u64,
                    }],
                )
                .unwrap();
            }
            assert_eq!(download(&stream, &out), data);
        }
    }
}

#[test]
fn freed_device_memory_is_kept_for_reuse_until_trimmed() {
    let (_lock, dev) = gpu_or_skip!();
    if !dev.supports_memory_pools() {
        println!("skipping: device {} has no memory pools", dev.id());
        return;
    }
    let stream = dev.new_stream().unwrap();
    let check = DeviceMemoryCheck::start(&dev);
    let before = check.free_at_start();
    let bytes = 256 << 20;
    drop(DeviceBuffer::alloc(&stream, bytes).unwrap());
    // A synchronization: the default pool (release threshold 0) would give the memory
    // back here, and the next allocation would map it again.
    stream.synchronize().unwrap();
    dev.synchronize().unwrap();
    let (kept, _) = dev.memory_info().unwrap();
    assert!(
        kept + bytes / 2 <= before,
        "devarrow's pool released its memory at a synchronization ({before} -> {kept} free)"
    );
    // Reused, not mapped again: free memory does not drop further.
    drop(DeviceBuffer::alloc(&stream, bytes).unwrap());
    stream.synchronize().unwrap();
    let (reused, _) = dev.memory_info().unwrap();
    assert!(reused + (4 << 20) >= kept, "{kept} -> {reused} free");
    // Trimming gives it back.
    check.assert_no_leak("after trimming");
}

#[test]
fn the_pool_policy_bounds_what_devarrow_keeps_and_short_memory_is_trimmed_first() {
    let (_lock, dev) = gpu_or_skip!();
    if !dev.supports_memory_pools() {
        println!("skipping: device {} has no memory pools", dev.id());
        return;
    }
    let stream = dev.new_stream().unwrap();
    let check = DeviceMemoryCheck::start(&dev);
    let before = check.free_at_start();
    // A release threshold of 0: what is freed goes back at the next synchronization.
    pool::set_policy(dev.context(), PoolPolicy::default().release_threshold(0)).unwrap();
    drop(DeviceBuffer::alloc(&stream, 256 << 20).unwrap());
    stream.synchronize().unwrap();
    dev.synchronize().unwrap();
    let (given_back, total) = dev.memory_info().unwrap();
    assert!(
        given_back + DEVICE_MEMORY_MARGIN >= before,
        "threshold 0 kept memory: {before} -> {given_back} free"
    );
    // Keep everything: then an allocation larger than the free memory, which only fits
    // once the pool gives back what it holds idle, succeeds (trimmed first, so no
    // driver call fails: the emulated run's API error log checks that).
    pool::set_policy(
        dev.context(),
        PoolPolicy::default().release_threshold(u64::MAX),
    )
    .unwrap();
    let held = before / 2;
    drop(DeviceBuffer::alloc(&stream, held).unwrap());
    stream.synchronize().unwrap();
    let (free_now, _) = dev.memory_info().unwrap();
    assert!(
        free_now + held / 2 <= before,
        "the pool keeps what was freed"
    );
    let big = free_now + held / 2;
    assert!(big < total);
    drop(DeviceBuffer::alloc(&stream, big).unwrap());
    stream.synchronize().unwrap();
    pool::set_policy(dev.context(), PoolPolicy::default()).unwrap();
    check.assert_no_leak("the pool policy test");
}

/// `MemoryPoolPolicy::retain_freed_memory` is the release threshold of devarrow's pool: raised, what
/// a cycle frees stays for the next cycle across synchronizations; back to the default,
/// the pool keeps at most 1 GiB (here: gives back what a threshold of 0 would not keep).
#[test]
fn retain_freed_memory_sets_what_the_pool_keeps_across_synchronizations() {
    let (_lock, dev) = gpu_or_skip!();
    if !dev.supports_memory_pools() {
        println!("skipping: device {} has no memory pools", dev.id());
        return;
    }
    let check = DeviceMemoryCheck::start(&dev);
    let before = check.free_at_start();
    let device = Arc::new(CudaDevice::new(dev.clone()).unwrap());
    let size = 512 << 20;
    device.retain_freed_memory(Some(2 * size)).unwrap();
    drop(device.allocate(size).unwrap());
    device.synchronize().unwrap();
    dev.synchronize().unwrap();
    let (kept, _) = dev.memory_info().unwrap();
    assert!(
        kept + size / 2 <= before,
        "a threshold of {} bytes kept nothing: {before} -> {kept} free",
        2 * size
    );
    device.retain_freed_memory(Some(0)).unwrap();
    drop(device.allocate(size).unwrap());
    device.synchronize().unwrap();
    dev.synchronize().unwrap();
    let (given_back, _) = dev.memory_info().unwrap();
    assert!(
        given_back + DEVICE_MEMORY_MARGIN >= before,
        "a threshold of 0 kept memory: {before} -> {given_back} free"
    );
    device.retain_freed_memory(None).unwrap();
    assert_eq!(pool::policy(dev.id()), PoolPolicy::default());
    drop(device);
    check.assert_no_leak("retain_freed_memory");
}

/// Zero-length pinned memory allocates nothing: the driver answers `cuMemAllocHost(0)`
/// with success and no pointer, so devarrow never asks it and keeps an empty buffer.
#[test]
fn zero_length_pinned_buffers_allocate_nothing() {
    let (_lock, dev) = gpu_or_skip!();
    let pinned = PinnedHostBuffer::alloc(&dev, 0).unwrap();
    assert!(pinned.as_slice().is_empty());
    assert_eq!((pinned.device_ptr(), pinned.len()), (0, 0));
    drop(pinned);
    let buffer = PinnedHostBuffer::from_slice(&dev, &[])
        .unwrap()
        .into_arrow_buffer();
    assert!(buffer.is_empty());
    drop(buffer);
    let device = CudaDevice::new(dev.clone()).unwrap();
    let staging = device.allocate_staging(0).unwrap();
    assert!(staging.as_slice().is_empty());
    drop(staging);
    assert!(dev.context().check_err().is_ok());
}

/// The leak check of these tests catches a leaked device buffer of any size by
/// devarrow's own counts (exact), and a large leak of memory devarrow does not count by
/// the device's free memory (beyond a margin sized for a real GPU).
#[test]
fn a_leaked_device_buffer_is_caught_by_the_leak_check() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let check = DeviceMemoryCheck::start(&dev);
    let stats = devarrow_cuda::memory_stats(dev.id());
    let buffer = DeviceBuffer::alloc(&stream, 4096).unwrap();
    let now = devarrow_cuda::memory_stats(dev.id());
    assert_eq!(now.live_buffers, stats.live_buffers + 1);
    assert_eq!(now.live_bytes, stats.live_bytes + 4096);
    assert_eq!(now.allocations, stats.allocations + 1);
    // Deliberately leaked: never freed, counted live for the rest of the process.
    std::mem::forget(buffer);
    let leak = check
        .leak()
        .expect("a forgotten 4 KiB device buffer is a leak");
    assert!(leak.contains("live device buffers"), "{leak}");

    // Memory devarrow does not count (a cudarc allocation), held past the check.
    let check = DeviceMemoryCheck::start(&dev);
    let theirs = stream
        .alloc_zeros::<u8>(DEVICE_MEMORY_MARGIN + (32 << 20))
        .unwrap();
    let leak = check.leak().expect("more than the margin is a leak");
    assert!(leak.contains("free device memory"), "{leak}");
    drop(theirs);
    check.assert_no_leak("after the cudarc allocation is freed");
}

/// `DeviceBuffer::alloc` asks the driver for the free memory (`cuMemGetInfo`, a round
/// trip) only when trimming the pool could matter, not on every allocation. (That it
/// still trims before an allocation the free memory cannot hold: the pool policy test
/// above.)
#[test]
fn a_steady_allocation_loop_does_not_ask_for_the_free_memory_every_time() {
    let (_lock, dev) = gpu_or_skip!();
    if emulated_mem_get_info_calls().is_none() {
        println!("skipping: counting cuMemGetInfo calls needs the emulated driver");
        return;
    }
    if !dev.supports_memory_pools() {
        println!("skipping: device {} has no memory pools", dev.id());
        return;
    }
    let stream = dev.new_stream().unwrap();
    drop(DeviceBuffer::alloc(&stream, 1 << 20).unwrap());
    let calls = || emulated_mem_get_info_calls().unwrap();
    let before = calls();
    for i in 0..200 {
        let a = DeviceBuffer::alloc(&stream, (1 << 20) + i * 256).unwrap();
        let b = DeviceBuffer::alloc(&stream, 4096).unwrap();
        drop((a, b));
    }
    stream.synchronize().unwrap();
    let asked = calls() - before;
    println!("{asked} cuMemGetInfo calls for 400 allocations");
    assert!(asked <= 2, "{asked} cuMemGetInfo calls for 400 allocations");
}

/// When devarrow's estimate of the free memory was too hopeful (another library took
/// memory since the driver was last asked) and the pool's allocation runs out of
/// memory, the pool's idle memory is given back and the allocation tried once more.
/// The emulator's failure injection plays the surprise: one `CUDA_ERROR_OUT_OF_MEMORY`.
#[test]
fn an_unexpected_out_of_memory_trims_the_pool_and_retries_once() {
    let (_lock, dev) = gpu_or_skip!();
    let Some(injection) = FailureInjection::find() else {
        println!("skipping: failure injection needs the emulated driver");
        return;
    };
    if !dev.supports_memory_pools() {
        println!("skipping: device {} has no memory pools", dev.id());
        return;
    }
    let stream = dev.new_stream().unwrap();
    pool::set_policy(
        dev.context(),
        PoolPolicy::default().release_threshold(u64::MAX),
    )
    .unwrap();
    drop(DeviceBuffer::alloc(&stream, 64 << 20).unwrap());
    drop(DeviceBuffer::alloc(&stream, 4096).unwrap());
    stream.synchronize().unwrap();
    let (kept, _) = dev.memory_info().unwrap();
    let before = injection.injected_failures();
    // The next fallible driver call is the pool's allocation (no cuMemGetInfo: 4 KiB is
    // far below the free memory devarrow estimates).
    injection.fail_nth_call(1);
    let buffer = DeviceBuffer::alloc(&stream, 4096);
    injection.fail_nth_call(0);
    assert_eq!(
        injection.injected_failures(),
        before + 1,
        "one allocation failed"
    );
    let buffer = buffer.expect("allocated on the second try");
    stream.synchronize().unwrap();
    let (after, _) = dev.memory_info().unwrap();
    assert!(
        after >= kept + (32 << 20),
        "the pool gave its idle memory back before the retry ({kept} -> {after} free)"
    );
    drop(buffer);
    pool::set_policy(dev.context(), PoolPolicy::default()).unwrap();
    assert!(dev.context().check_err().is_ok());
}

/// Events of a device with `HostWait::Block` block the waiting thread
/// (`CU_EVENT_BLOCKING_SYNC`) and are not timed (`CU_EVENT_DISABLE_TIMING`, cheaper to
/// record): `cuEventElapsedTime` on them is `CUDA_ERROR_INVALID_HANDLE`, as the driver
/// documents for untimed events. So are `HostWait::Spin`'s.
#[test]
fn blocking_host_waits_use_events_without_timing() {
    let (_lock, dev) = gpu_or_skip!();
    if !unless_sanitized("cuEventElapsedTime on untimed events (CUDA_ERROR_INVALID_HANDLE)") {
        return;
    }
    for (wait, flags) in [(HostWait::Spin, 0x2), (HostWait::Block, 0x3)] {
        for reuse in [false, true] {
            let device = CudaDevice::new(dev.clone()).unwrap().with_options(
                CudaDeviceOptions::default()
                    .host_wait(wait)
                    .reuse_events(reuse),
            );
            let (a, b) = (
                device.record_event().unwrap(),
                device.record_event().unwrap(),
            );
            b.wait_host().unwrap();
            // SAFETY: a CUDA sync event points to its live CUevent.
            let (ea, eb) = unsafe {
                (
                    *a.as_sync_event_ptr().cast::<sys::CUevent>(),
                    *b.as_sync_event_ptr().cast::<sys::CUevent>(),
                )
            };
            if let Some(recorded) = devarrow_testing::leaks::emulated_event_flags(ea) {
                assert_eq!(recorded, flags, "{wait:?}: CU_EVENT_* flags");
            }
            dev.bind_to_thread().unwrap();
            // SAFETY: both events are live (held above) and complete.
            let timed = unsafe { result::event::elapsed(ea, eb) };
            assert_eq!(
                timed.map_err(|e| e.0),
                Err(sys::CUresult::CUDA_ERROR_INVALID_HANDLE),
                "{wait:?} (reuse {reuse}): events are not timed"
            );
        }
    }
}

/// A restricted runtime (`DEVARROW_EMU_RESTRICTED=1`: a sandbox such as gVisor's
/// nvproxy) refuses `cuMemHostRegister` and managed memory with
/// `CUDA_ERROR_OPERATING_SYSTEM` and `cuMemcpyBatchAsync` with
/// `CUDA_ERROR_NOT_PERMITTED`: copies still work, one by one from staged memory, each
/// refusal is remembered (not asked again), and managed memory is a typed error.
#[test]
fn a_restricted_runtime_falls_back_on_its_refusals() {
    let (_lock, dev) = gpu_or_skip!();
    if std::env::var("DEVARROW_EMU_RESTRICTED").as_deref() != Ok("1") {
        println!("skipping: runs on the emulated driver with DEVARROW_EMU_RESTRICTED=1");
        return;
    }
    let device = CudaDevice::new(dev.clone()).unwrap().with_options(
        CudaDeviceOptions::default()
            .batch_copies(true)
            .register_pageable(Some(1)),
    );
    batch_round_trip(&device);
    assert_eq!(device.batch_copies_available(), Some(false));
    assert_eq!(device.batched_copy_calls(), 0);
    batch_round_trip(&device);
    assert_eq!(device.batched_copy_calls(), 0, "not asked again");

    let page = host_page_size();
    let pages = vec![7u8; 4 * page];
    let at = pages.as_ptr().align_offset(page);
    // SAFETY: the range lies in `pages`, which outlives the (refused) registrations.
    unsafe {
        assert!(device
            .register_host(pages.as_ptr().add(at), 2 * page)
            .unwrap()
            .is_none());
        assert!(device.host_registration_disabled());
        assert_eq!(device.host_registrations(), (0, 1));
        assert!(device
            .register_host(pages.as_ptr().add(at), 2 * page)
            .unwrap()
            .is_none());
    }
    assert_eq!(device.host_registrations(), (0, 1), "not asked again");
    assert_eq!(live_host_registrations(), 0);

    if dev.supports_managed_memory() {
        match ManagedBuffer::alloc(&dev, 4096) {
            Err(e @ CudaError::Refused { .. }) => {
                assert_eq!(
                    e.driver_result(),
                    Some(sys::CUresult::CUDA_ERROR_OPERATING_SYSTEM)
                );
                assert!(!e.is_sticky());
                println!("{e}");
            }
            other => panic!("expected Refused, got {other:?}"),
        }
    }
    // The context works on.
    let buf = DeviceBuffer::from_host(device.stream(), &[1u8, 2, 3]).unwrap();
    assert_eq!(download(device.stream(), &buf), vec![1, 2, 3]);
    assert!(dev.context().check_err().is_ok());
}

#[test]
fn a_module_that_does_not_load_reports_the_jits_log() {
    let (_lock, dev) = gpu_or_skip!();
    if !unless_sanitized("loading invalid PTX (CUDA_ERROR_INVALID_PTX is an API error)") {
        return;
    }
    dev.bind_to_thread().unwrap();
    let bad =
        ".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry broken() { frobnicate; }\n";
    match kernels::load_module(dev.context(), "broken.ptx", bad) {
        Err(CudaError::ModuleLoad {
            module,
            log,
            source,
        }) => {
            assert_eq!(module, "broken.ptx");
            assert!(!log.is_empty(), "the JIT gave no log ({source:?})");
            let message = CudaError::ModuleLoad {
                module,
                log: log.clone(),
                source,
            }
            .to_string();
            assert!(message.contains(&log), "{message}");
        }
        other => panic!("expected ModuleLoad, got {other:?}"),
    }
    // devarrow's own kernels still load.
    Kernels::for_context(dev.context()).unwrap();
}

#[test]
fn out_of_device_memory_is_a_typed_error_and_leaks_nothing() {
    let (_lock, dev) = gpu_or_skip!();
    if !unless_sanitized("provoking CUDA_ERROR_OUT_OF_MEMORY (reported as an API error)") {
        return;
    }
    let stream = dev.new_stream().unwrap();
    let check = DeviceMemoryCheck::start(&dev);
    let (_, total) = dev.memory_info().unwrap();
    for bytes in [total * 2, total + (1 << 30)] {
        match DeviceBuffer::alloc(&stream, bytes) {
            Err(CudaError::OutOfMemory { bytes: b }) => assert_eq!(b, bytes),
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
    }
    // the device still works
    let ok = DeviceBuffer::from_host(&stream, &[1u8, 2, 3]).unwrap();
    assert_eq!(download(&stream, &ok), vec![1, 2, 3]);
    drop(ok);
    check.assert_no_leak("after running out of memory");
}

/// An `Int32` array of `n` values in device memory, with a validity bitmap whose null
/// count the GPU computes.
fn int32_array(
    stream: &Arc<CudaStream>,
    values: DeviceBuffer,
    validity: &[u8],
    n: usize,
) -> ArrayData {
    let bitmap = DeviceBuffer::from_host(stream, validity).unwrap();
    let valid = kernels::count_set_bits(stream, &bitmap, 0, n).unwrap() as usize;
    assert_eq!(valid as u64, reference::count_set_bits(validity, 0, n));
    // SAFETY: the buffers are device memory, never read on the host; the layout (values
    // of 4*n bytes, bitmap of ceil(n/8) bytes, null count computed above) is valid.
    unsafe {
        ArrayData::builder(DataType::Int32)
            .len(n)
            .add_buffer(values.into_arrow_buffer())
            .null_bit_buffer(Some(bitmap.into_arrow_buffer()))
            .null_count(n - valid)
            .build_unchecked()
    }
}

#[test]
fn export_then_import_honours_the_sync_event() {
    let (_lock, dev) = gpu_or_skip!();
    let producer = dev.new_stream().unwrap();
    let consumer = dev.new_stream().unwrap();
    let n = 1 << 16;
    let value = 0x1234_0000u32;
    let values = DeviceBuffer::zeroed(&producer, 4 * n).unwrap();
    let values_ptr = values.device_ptr();
    let validity: Vec<u8> = (0..n.div_ceil(8)).map(|i| (i * 37) as u8).collect();
    // (count_set_bits synchronizes `producer`: the gated producer is launched after it)
    let data = int32_array(&producer, values, &validity, n);
    // The consumer's copy kernel reads the import: its descriptors uploaded now, as
    // `kernels::batched_copy` would (a synchronous upload, which waits for the consumer
    // stream: done once that waits for the gated producer, it would wait for the gate).
    let out = DeviceBuffer::alloc(&consumer, 4 * n).unwrap();
    let pieces = kernels::plan_batched_copy(
        &consumer,
        &[CopySegment {
            src: values_ptr,
            dst: out.device_ptr(),
            len: 4 * n as u64,
        }],
    )
    .unwrap();
    let flat: Vec<u64> = pieces.iter().flat_map(|p| [p.src, p.dst, p.len]).collect();
    let table = DeviceBuffer::from_host(&consumer, &flat).unwrap();
    let gate = Gate::new(&producer).unwrap();
    // SAFETY: `values_ptr` stays owned by `data` (and then the export) until release,
    // after the gate opens.
    unsafe { gate.launch_fill(values_ptr, n as u64, value).unwrap() };
    let exported = export_array_data(data, ArrowDeviceType::CUDA, &producer).unwrap();
    assert_eq!(exported.device_type(), ArrowDeviceType::CUDA);
    assert_eq!(exported.device_id(), 0);
    assert_eq!(exported.array().length, n as i64);
    assert_eq!(exported.array().n_buffers, 2);
    // SAFETY: the array of a DeviceArray is well-formed.
    assert_eq!(unsafe { exported.array().buffer(1) } as u64, values_ptr);
    assert!(!exported.sync_event().is_null());
    // SAFETY: sync_event points to the CUevent of the export.
    let event = unsafe { *exported.sync_event().cast::<sys::CUevent>() };
    // SAFETY: the event is alive (the export is unreleased).
    unsafe { gate.assert_pending(event, "the producer kernel waits at its gate") };

    // The import must not block the host: it would wait for the gate, closed until below
    // (the gate's time limit then fails the test).
    let imported = ImportedArray::import(exported, &consumer).unwrap();
    assert_eq!(imported.sync_event(), event);
    assert!(!imported.is_host_synchronized());
    // SAFETY: the root's buffer 1 holds n i32 values.
    let view = unsafe { imported.buffer(imported.array(), 1, 4 * n) }.unwrap();
    assert!(view.host_slice().is_none());
    assert_eq!(view.device_ptr(), values_ptr, "imported zero-copy");
    // SAFETY: the table holds the descriptors of a copy between live (the view holds the
    // import), distinct ranges; `table` and `out` outlive it (read back below).
    unsafe {
        kernels::launch_batched_copy(&consumer, table.device_ptr(), pieces.len() as u64).unwrap()
    };
    // SAFETY: the event is alive (the import holds the export).
    unsafe { gate.assert_pending(event, "the producer kernel waits at its gate") };
    gate.open();
    let mut got = vec![0u32; n];
    out.copy_to_host(&consumer, &mut got).unwrap();
    let expected: Vec<u32> = (0..n as u32).map(|i| value.wrapping_add(i)).collect();
    assert_eq!(
        got, expected,
        "the consumer read before the producer finished"
    );
    // validity bitmap, through the import
    // SAFETY: buffer 0 of the root is the validity bitmap of ceil(n/8) bytes.
    let bits = unsafe { imported.buffer(imported.array(), 0, n.div_ceil(8)) }.unwrap();
    assert_eq!(bits.to_host(&consumer).unwrap(), validity);
    assert_eq!(
        kernels::count_set_bits(&consumer, &bits, 0, n).unwrap(),
        n as u64 - imported.array().null_count as u64
    );
    drop(imported);
    drop(view);
    drop(bits);
}

/// A diagnostic, not a check of devarrow: on the only real GPU run (an H200, 2026-11-28,
/// at `9615f3d`) two
/// ordering tests found the timer spin (`dvx_spin_fill_u32`, 300 ms of `%globaltimer`)
/// over right after its launch. Here nothing runs between the launch and the query of an
/// event recorded after it, and the test writes uncaptured to stderr whether the kernel
/// was still running then, how long the host waited for it, and how long it ran by the
/// device's own event timer: the next GPU run tells whether the spin ends early by itself
/// (`%globaltimer` advancing faster than nanoseconds), or a host call between launch and
/// query waited for it (an implicitly synchronizing call: tests use `Gate` now). It
/// asserts only the data the kernel wrote.
#[test]
fn the_timer_spin_keeps_its_stream_busy_diagnostic() {
    use std::io::Write;
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let n = 1024usize;
    let spin_ns = 300_000_000u64;
    let dst = DeviceBuffer::zeroed(&stream, 4 * n).unwrap();
    let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.context().new_event(timed).unwrap();
    let end = stream.context().new_event(timed).unwrap();
    // the module loaded and everything allocated before the timed part
    // SAFETY: `dst` holds n u32s and lives until the stream is synchronized below.
    unsafe {
        devarrow_testing::spin::launch_spin_fill_u32(&stream, dst.device_ptr(), n as u64, 1, 0)
            .unwrap()
    };
    stream.synchronize().unwrap();

    let t = Instant::now();
    start.record(&stream).unwrap();
    // SAFETY: as above.
    unsafe {
        devarrow_testing::spin::launch_spin_fill_u32(
            &stream,
            dst.device_ptr(),
            n as u64,
            5,
            spin_ns,
        )
        .unwrap()
    };
    end.record(&stream).unwrap();
    let enqueued = t.elapsed();
    let state = if devarrow_testing::gpu::under_sanitizer() {
        "not queried (compute-sanitizer reports CUDA_ERROR_NOT_READY)".to_owned()
    } else {
        // SAFETY: the event is alive (we hold it).
        match unsafe { result::event::query(end.cu_event()) } {
            Ok(()) => "CUDA_SUCCESS: the spin was ALREADY OVER".to_owned(),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => {
                "CUDA_ERROR_NOT_READY: still running, as expected".to_owned()
            }
            Err(e) => format!("{e:?}"),
        }
    };
    let queried = t.elapsed();
    end.synchronize().unwrap();
    let waited = t.elapsed();
    let on_device = start.elapsed_ms(&end).unwrap();
    let _ = writeln!(
        std::io::stderr(),
        "timer spin diagnostic ({}): a {} ms spin; launch and records took {enqueued:?}; \
         cuEventQuery right after, at {queried:?}, answered {state}; the host waited until \
         {waited:?} for the end; the device's event timer says the kernel took {on_device:.1} ms",
        dev.name(),
        spin_ns / 1_000_000,
    );
    let got = dst.to_host(&stream).unwrap();
    let expected: Vec<u8> = (0..n as u32).flat_map(|i| (5 + i).to_le_bytes()).collect();
    assert!(got == expected, "the spin's fill wrote the wrong data");
}

#[test]
fn views_of_an_import_order_any_stream_after_the_producer() {
    let (_lock, dev) = gpu_or_skip!();
    let producer = dev.new_stream().unwrap();
    let consumer = dev.new_stream().unwrap();
    let other = dev.new_stream().unwrap();
    let n = 1 << 12;
    let value = 0x0abc_0000u32;
    let values = DeviceBuffer::zeroed(&producer, 4 * n).unwrap();
    let values_ptr = values.device_ptr();
    let validity = vec![0xffu8; n.div_ceil(8)];
    let data = int32_array(&producer, values, &validity, n);
    let gate = Gate::new(&producer).unwrap();
    // SAFETY: `values_ptr` stays owned by `data` (and then the export) until release,
    // after the gate opens.
    unsafe { gate.launch_fill(values_ptr, n as u64, value).unwrap() };
    let exported = export_array_data(data, ArrowDeviceType::CUDA, &producer).unwrap();
    let imported = ImportedArray::import(exported, &consumer).unwrap();
    // SAFETY: the root's buffer 1 holds n i32 values.
    let view = unsafe { imported.buffer(imported.array(), 1, 4 * n) }.unwrap();
    // read on a third stream, which the import itself did not order: the view does (the
    // read waits for the gated producer, opened while it waits)
    let got = gate.open_during(|| view.to_host(&other).unwrap());
    let expected: Vec<u8> = (0..n as u32)
        .flat_map(|i| value.wrapping_add(i).to_le_bytes())
        .collect();
    assert!(
        got == expected,
        "read on another stream before the producer finished"
    );
    drop(view);
    drop(imported);
}

#[test]
fn release_runs_on_another_thread_and_frees_the_memory() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let big = 64 << 20;
    // warm up (kernels, pools)
    let warm =
        export_array_data(uint8_array(&stream, 1024), ArrowDeviceType::CUDA, &stream).unwrap();
    drop(warm);
    let check = DeviceMemoryCheck::start(&dev);
    let before = check.free_at_start();
    let exported =
        export_array_data(uint8_array(&stream, big), ArrowDeviceType::CUDA, &stream).unwrap();
    let during = free_memory(&dev);
    assert!(
        during + big / 2 <= before,
        "64 MiB should be in use ({before} -> {during})"
    );
    std::thread::spawn(move || {
        // A fresh thread has no current context: release must bind it itself, and leave
        // the thread as it found it (no context current).
        assert_eq!(cudarc::driver::result::ctx::get_current().unwrap(), None);
        drop(exported);
        assert_eq!(cudarc::driver::result::ctx::get_current().unwrap(), None);
    })
    .join()
    .unwrap();
    assert!(dev.context().check_err().is_ok());
    // the same through a raw struct moved to the other thread and released by C-style
    // call, with an unrelated error left recorded on the context (cudarc's
    // `bind_to_thread` would return it instead of binding): release still binds, frees,
    // and leaves the thread without a current context
    let raw = export_array_data(uint8_array(&stream, big), ArrowDeviceType::CUDA, &stream)
        .unwrap()
        .into_raw();
    let raw = SendRaw(raw);
    dev.context()
        .record_err::<()>(Err(cudarc::driver::DriverError(
            cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE,
        )));
    std::thread::spawn(move || {
        let mut raw = raw;
        let release = raw.0.array.release.unwrap();
        // SAFETY: the struct is unreleased and ours; release is the producer's callback.
        unsafe { release(&mut raw.0.array) };
        assert!(raw.0.array.release.is_none());
        assert_eq!(cudarc::driver::result::ctx::get_current().unwrap(), None);
    })
    .join()
    .unwrap();
    let _ = dev.context().check_err(); // the injected error
    check.assert_no_leak("released on other threads");
}

struct SendRaw(ArrowDeviceArray);
// SAFETY: the C data interface allows releasing on any thread.
unsafe impl Send for SendRaw {}

/// A `UInt8` array of `len` bytes of device memory (zeroed, no validity).
fn uint8_array(stream: &Arc<CudaStream>, len: usize) -> ArrayData {
    let values = DeviceBuffer::zeroed(stream, len).unwrap();
    // SAFETY: device memory never read on the host; a valid UInt8 layout without nulls.
    unsafe {
        ArrayData::builder(DataType::UInt8)
            .len(len)
            .add_buffer(values.into_arrow_buffer())
            .build_unchecked()
    }
}

#[test]
fn ten_thousand_export_import_cycles_leave_device_memory_unchanged() {
    let (_lock, dev) = gpu_or_skip!();
    let producer = dev.new_stream().unwrap();
    let consumer = dev.new_stream().unwrap();
    let cycle = |len: usize| {
        let exported = export_array_data(
            uint8_array(&producer, len),
            ArrowDeviceType::CUDA,
            &producer,
        )
        .unwrap();
        let imported = ImportedArray::import(exported, &consumer).unwrap();
        // SAFETY: buffer 1 holds `len` bytes.
        let v = unsafe { imported.buffer(imported.array(), 1, len) }.unwrap();
        drop(imported);
        assert_eq!(v.len(), len);
        drop(v);
    };
    cycle(1 << 16);
    let check = DeviceMemoryCheck::start(&dev);
    for i in 0..10_000 {
        cycle((1 << 16) + (i % 7) * 1000);
    }
    assert!(dev.context().check_err().is_ok());
    println!(
        "free device memory before {}, after {}",
        check.free_at_start(),
        free_memory(&dev)
    );
    check.assert_no_leak("10,000 export/import cycles");
}

#[test]
fn host_and_managed_exports_are_host_readable_after_synchronization() {
    let (_lock, dev) = gpu_or_skip!();
    let producer = dev.new_stream().unwrap();
    let consumer = dev.new_stream().unwrap();
    let n = 4096usize;
    let pinned = PinnedHostBuffer::alloc(&dev, 4 * n).unwrap();
    let managed = dev
        .supports_managed_memory()
        .then(|| ManagedBuffer::alloc(&dev, 4 * n).unwrap());
    let gate = Gate::new(&producer).unwrap();
    // SAFETY: the pinned buffer holds n u32s and is owned by the export until release.
    unsafe { gate.launch_fill(pinned.device_ptr(), n as u64, 7).unwrap() };
    let data = ArrayData::builder(DataType::UInt32)
        .len(n)
        .add_buffer(pinned.into_arrow_buffer());
    // SAFETY: no host read happens before the event is synchronized below.
    let data = unsafe { data.build_unchecked() };
    let exported = export_array_data(data, ArrowDeviceType::CUDA_HOST, &producer).unwrap();
    let imported = ImportedArray::import(exported, &consumer).unwrap();
    gate.open_during(|| imported.synchronize_host().unwrap());
    assert!(imported.is_host_synchronized());
    // SAFETY: buffer 1 holds n u32s.
    let v = unsafe { imported.buffer(imported.array(), 1, 4 * n) }.unwrap();
    let bytes = v
        .host_slice()
        .expect("pinned memory is host-readable after sync");
    let got: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, (0..n as u32).map(|i| 7 + i).collect::<Vec<_>>());
    drop((imported, v));

    if let Some(managed) = managed {
        let gate = Gate::new(&producer).unwrap();
        // SAFETY: as above, for managed memory.
        unsafe { gate.launch_fill(managed.device_ptr(), n as u64, 9).unwrap() };
        // SAFETY: never read on the host before synchronization.
        let data = unsafe {
            ArrayData::builder(DataType::UInt32)
                .len(n)
                .add_buffer(managed.into_arrow_buffer())
                .build_unchecked()
        };
        let exported = export_array_data(data, ArrowDeviceType::CUDA_MANAGED, &producer).unwrap();
        assert_eq!(exported.device_type(), ArrowDeviceType::CUDA_MANAGED);
        let imported = ImportedArray::import(exported, &consumer).unwrap();
        gate.open_during(|| imported.synchronize_host().unwrap());
        // SAFETY: buffer 1 holds n u32s.
        let v = unsafe { imported.buffer(imported.array(), 1, 4 * n) }.unwrap();
        let bytes = v.host_slice().unwrap();
        assert_eq!(
            u32::from_le_bytes(bytes[4 * 100..4 * 101].try_into().unwrap()),
            109
        );
        drop((imported, v));
    }
}

/// `CudaDevice::make_raw_stream_wait`: a stream known only by its raw handle (a DLPack
/// consumer's) waits on the GPU for devarrow's event, the legacy default stream's special
/// handle too; an event with a NULL pointer (the CPU's) is a no-op. The consumers read
/// with raw copies, which nothing else orders after the device's stream: without the
/// waits they would copy the zeros from before the gated kernel.
#[test]
fn a_raw_stream_waits_on_the_devices_event() {
    let (_lock, dev) = gpu_or_skip!();
    let device = CudaDevice::new(dev.clone()).unwrap();
    let consumer = dev.new_stream().unwrap();
    let legacy = 1 as sys::CUstream; // CU_STREAM_LEGACY
    let n = 1 << 12;
    let value = 0x5a5a_0000u32;
    let values = DeviceBuffer::zeroed(device.stream(), 4 * n).unwrap();
    let out = DeviceBuffer::alloc(&consumer, 4 * n).unwrap();
    let out_legacy = DeviceBuffer::alloc(&consumer, 4 * n).unwrap();
    consumer.synchronize().unwrap(); // the allocations done before the legacy copy
    let gate = Gate::new(device.stream()).unwrap();
    // SAFETY: `values` outlives the kernel (read back below, after the gate opens; the
    // gate drops first).
    unsafe {
        gate.launch_fill(values.device_ptr(), n as u64, value)
            .unwrap()
    };
    let event = device.record_event().unwrap();
    // SAFETY: `consumer` is a live stream of the device's context, and CU_STREAM_LEGACY
    // names the default stream of the context the call binds; the event is the device's
    // own.
    unsafe {
        device
            .make_raw_stream_wait(consumer.cu_stream(), event.as_ref())
            .unwrap();
        device.make_raw_stream_wait(legacy, event.as_ref()).unwrap();
    }
    // A CPU event has no CUevent: nothing to wait for.
    let cpu_event = devarrow_abi::device::CpuDevice::default()
        .record_event()
        .unwrap();
    assert!(cpu_event.as_sync_event_ptr().is_null());
    // SAFETY: the pointer is NULL, so neither handle is used.
    unsafe { device.make_raw_stream_wait(consumer.cu_stream(), cpu_event.as_ref()) }.unwrap();
    // SAFETY: the ranges are live allocations of 4n bytes, distinct; the context is bound
    // (by the calls above); `out` and `out_legacy` are read only after the streams are
    // synchronized.
    unsafe {
        sys::cuMemcpyDtoDAsync_v2(
            out.device_ptr(),
            values.device_ptr(),
            4 * n,
            consumer.cu_stream(),
        )
        .result()
        .unwrap();
        sys::cuMemcpyDtoDAsync_v2(out_legacy.device_ptr(), values.device_ptr(), 4 * n, legacy)
            .result()
            .unwrap();
    }
    // The consumers' copies wait for the gated kernel (opened while they wait).
    gate.open_during(|| {
        consumer.synchronize().unwrap();
        // SAFETY: CU_STREAM_LEGACY of the bound context.
        unsafe { result::stream::synchronize(legacy) }.unwrap();
    });
    let expected: Vec<u32> = (0..n as u32).map(|i| value.wrapping_add(i)).collect();
    for (buffer, stream) in [
        (&out, "the consumer's stream"),
        (&out_legacy, "CU_STREAM_LEGACY"),
    ] {
        let mut got = vec![0u32; n];
        buffer.copy_to_host(&consumer, &mut got).unwrap();
        assert_eq!(
            got, expected,
            "{stream} copied before the device's work finished"
        );
    }
}

#[test]
fn a_null_sync_event_means_already_safe_and_foreign_devices_or_per_thread_streams_are_refused() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let exported =
        export_array_data(uint8_array(&stream, 100), ArrowDeviceType::CUDA, &stream).unwrap();
    stream.synchronize().unwrap();
    let mut raw = exported.into_raw();
    raw.sync_event = std::ptr::null_mut();
    // SAFETY: `raw` came from a DeviceArray; a NULL sync event is allowed, and true here
    // (the stream that wrote the data was synchronized above).
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let imported = ImportedArray::import(array, &stream).unwrap();
    assert!(imported.sync_event().is_null());
    assert!(imported.is_host_synchronized());
    // SAFETY: buffer 1 holds 100 bytes.
    let v = unsafe { imported.buffer(imported.array(), 1, 100) }.unwrap();
    assert_eq!(v.to_host(&stream).unwrap(), vec![0u8; 100]);
    drop((imported, v));

    let mut raw = export_array_data(uint8_array(&stream, 8), ArrowDeviceType::CUDA, &stream)
        .unwrap()
        .into_raw();
    raw.device_id = 1000;
    // SAFETY: `raw` came from a DeviceArray; only its device id is false, which the
    // importer refuses before touching the buffers or the event.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    match ImportedArray::import(array, &stream) {
        Err(CudaError::DeviceMismatch {
            expected: 0,
            found: 1000,
        }) => {}
        other => panic!("expected DeviceMismatch, got {other:?}"),
    }
    let mut raw = export_array_data(uint8_array(&stream, 8), ArrowDeviceType::CUDA, &stream)
        .unwrap()
        .into_raw();
    raw.device_type = ArrowDeviceType::ROCM;
    // SAFETY: `raw` came from a DeviceArray; only its device type is false, which the
    // importer refuses before touching the buffers or the event.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    assert!(matches!(
        ImportedArray::import(array, &stream),
        Err(CudaError::UnsupportedDeviceType { .. })
    ));
    // exporting as a non-CUDA device type is refused too
    assert!(matches!(
        export_array_data(uint8_array(&stream, 8), ArrowDeviceType::CPU, &stream),
        Err(CudaError::UnsupportedDeviceType { .. })
    ));
    // The per-thread default stream names another stream on every thread: refused where
    // devarrow keeps a stream to free or wait on later (from whichever thread drops).
    let per_thread = dev.context().per_thread_stream();
    assert!(matches!(
        DeviceBuffer::alloc(&per_thread, 64),
        Err(CudaError::InvalidArgument(_))
    ));
    let array = export_array_data(uint8_array(&stream, 8), ArrowDeviceType::CUDA, &stream).unwrap();
    assert!(matches!(
        ImportedArray::import(array, &per_thread),
        Err(CudaError::InvalidArgument(_))
    ));
}

// ----------------------------------------------------------------------------------------
// Kernels against their CPU oracles
// ----------------------------------------------------------------------------------------

#[test]
fn count_set_bits_matches_the_oracle() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let mut rng = Rng(21);
    for len in lengths() {
        for _ in 0..2 {
            let offset = rng.below(300) as usize;
            let shift = rng.below(17) as usize;
            let bytes = reference::bitmap_bytes(offset + len);
            let host = match rng.below(3) {
                0 => vec![0xFF; bytes],
                _ => rng.bytes(bytes),
            };
            let (buf, _) = upload_at(&stream, &host, shift);
            let v = view(&buf, shift, bytes);
            let got = kernels::count_set_bits(&stream, &v, offset, len).unwrap();
            assert_eq!(
                got,
                reference::count_set_bits(&host, offset, len),
                "len {len} offset {offset} shift {shift}"
            );
        }
    }
    // 64 MiB bitmap
    let host = rng.bytes(64 << 20);
    let buf = DeviceBuffer::from_host(&stream, &host).unwrap();
    let len = (host.len() * 8) - 13;
    assert_eq!(
        kernels::count_set_bits(&stream, &buf, 5, len).unwrap(),
        reference::count_set_bits(&host, 5, len)
    );
    // The counter is added to atomically, so it must be 8-byte aligned: a typed error,
    // not a misaligned-address fault.
    let counter = DeviceBuffer::from_host(&stream, &[0u8; 16]).unwrap();
    // SAFETY: both ranges are live device memory; the call is refused before any launch.
    let misaligned = unsafe {
        kernels::launch_count_set_bits(&stream, buf.device_ptr(), 0, 8, counter.device_ptr() + 4)
    };
    assert!(
        matches!(misaligned, Err(CudaError::InvalidArgument(_))),
        "{misaligned:?}"
    );
}

#[test]
fn copy_bitmap_matches_the_oracle() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let mut rng = Rng(22);
    for len in lengths() {
        let offset = rng.below(300) as usize;
        let shift = rng.below(17) as usize;
        let dst_shift = [0usize, 0, 4, 1][rng.below(4) as usize];
        let src_host = rng.bytes(reference::bitmap_bytes(offset + len));
        let expected = reference::copy_bitmap(&src_host, offset, len);
        let (src, src_ptr) = upload_at(&stream, &src_host, shift);
        let out_len = expected.len() + 32;
        let (dst, dst_ptr) = upload_at(&stream, &vec![0xA5u8; out_len], dst_shift);
        // SAFETY: the ranges lie in `src` and `dst`, distinct, alive until synchronized.
        unsafe {
            kernels::launch_copy_bitmap(&stream, src_ptr, offset as u64, len as u64, dst_ptr)
        }
        .unwrap();
        let got = download(&stream, &dst);
        let got = &got[dst_shift..];
        assert_eq!(
            &got[..expected.len()],
            &expected[..],
            "len {len} offset {offset} shift {shift}"
        );
        assert!(
            got[expected.len()..].iter().all(|&b| b == 0xA5),
            "wrote past the end"
        );
        drop(src);
    }
    // safe wrapper, 64 MiB
    let host = rng.bytes(64 << 20);
    let src = DeviceBuffer::from_host(&stream, &host).unwrap();
    let len = host.len() * 8 - 100;
    let mut dst = DeviceBuffer::alloc(&stream, reference::bitmap_bytes(len)).unwrap();
    kernels::copy_bitmap(&stream, &src, 3, len, &mut dst).unwrap();
    assert_eq!(
        download(&stream, &dst),
        reference::copy_bitmap(&host, 3, len)
    );
}

#[test]
fn unpack_and_pack_match_the_oracle() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let mut rng = Rng(23);
    for len in lengths() {
        // unpack
        let offset = rng.below(300) as usize;
        let shift = rng.below(17) as usize;
        let dst_shift = [0usize, 0, 8, 3][rng.below(4) as usize];
        let src_host = rng.bytes(reference::bitmap_bytes(offset + len));
        let expected = reference::unpack_bits(&src_host, offset, len);
        let (src, src_ptr) = upload_at(&stream, &src_host, shift);
        let (dst, dst_ptr) = upload_at(&stream, &vec![0xA5u8; len + 40], dst_shift);
        // SAFETY: ranges inside live, distinct buffers; synchronized by the download.
        unsafe {
            kernels::launch_unpack_bits(&stream, src_ptr, offset as u64, len as u64, dst_ptr)
        }
        .unwrap();
        let got = download(&stream, &dst);
        let got = &got[dst_shift..];
        assert_eq!(
            &got[..len],
            &expected[..],
            "unpack len {len} offset {offset} shift {shift}"
        );
        assert!(got[len..].iter().all(|&b| b == 0xA5));
        drop(src);

        // pack
        let shift = [0usize, 0, 5, 16][rng.below(4) as usize];
        let dst_shift = [0usize, 0, 4, 2][rng.below(4) as usize];
        let bools: Vec<u8> = rng
            .bytes(len)
            .iter()
            .map(|&b| if b < 100 { 0 } else { b & 3 })
            .collect();
        let expected = reference::pack_bools(&bools);
        let (src, src_ptr) = upload_at(&stream, &bools, shift);
        let (dst, dst_ptr) = upload_at(&stream, &vec![0xA5u8; expected.len() + 9], dst_shift);
        // SAFETY: ranges inside live, distinct buffers; synchronized by the download.
        unsafe { kernels::launch_pack_bools(&stream, src_ptr, len as u64, dst_ptr) }.unwrap();
        let got = download(&stream, &dst);
        let got = &got[dst_shift..];
        assert_eq!(
            &got[..expected.len()],
            &expected[..],
            "pack len {len} shift {shift}"
        );
        assert!(got[expected.len()..].iter().all(|&b| b == 0xA5));
        drop(src);
    }
    // safe wrappers round trip, 64 MiB of booleans
    let bools: Vec<u8> = rng.bytes(64 << 20).iter().map(|b| b & 1).collect();
    let src = DeviceBuffer::from_host(&stream, &bools).unwrap();
    let mut bits = DeviceBuffer::alloc(&stream, bools.len() / 8).unwrap();
    kernels::pack_bools(&stream, &src, bools.len(), &mut bits).unwrap();
    assert_eq!(download(&stream, &bits), reference::pack_bools(&bools));
    let mut back = DeviceBuffer::alloc(&stream, bools.len()).unwrap();
    kernels::unpack_bits(&stream, &bits, 0, bools.len(), &mut back).unwrap();
    assert_eq!(download(&stream, &back), bools);
}

#[test]
fn batched_copy_matches_the_oracle() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let mut rng = Rng(24);
    let mut sizes: Vec<usize> = (0..600).map(|_| rng.below(300) as usize).collect();
    sizes.extend((0..50).map(|_| rng.below(100_000) as usize));
    sizes.extend([16 * 1024, 16 * 1024 + 1, 8 << 20, 0, 1, 15, 16, 17]);
    let total: usize = sizes.iter().map(|s| s + 64).sum();
    let src_host = rng.bytes(total);
    let src = DeviceBuffer::from_host(&stream, &src_host).unwrap();
    let dst = DeviceBuffer::zeroed(&stream, total).unwrap();
    let mut segments = Vec::new();
    let mut expected = vec![0u8; total];
    let (mut s_at, mut d_at) = (0usize, 0usize);
    for &len in &sizes {
        let s = s_at + rng.below(32) as usize;
        let d = d_at + rng.below(32) as usize;
        segments.push(CopySegment {
            src: src.device_ptr() + s as u64,
            dst: dst.device_ptr() + d as u64,
            len: len as u64,
        });
        expected[d..d + len].copy_from_slice(&src_host[s..s + len]);
        s_at += len + 64;
        d_at += len + 64;
    }
    // SAFETY: every segment lies inside `src` / `dst`, destinations are disjoint; the
    // download synchronizes before the buffers drop.
    unsafe { kernels::batched_copy(&stream, &segments) }.unwrap();
    assert_eq!(download(&stream, &dst), expected);
}

#[test]
fn rebase_offsets_match_the_oracle() {
    let (_lock, dev) = gpu_or_skip!();
    let stream = dev.new_stream().unwrap();
    let mut rng = Rng(25);
    for n in lengths().into_iter().filter(|&n| n <= 1 << 20) {
        let o32: Vec<i32> = (0..n).map(|_| rng.next_u64() as i32).collect();
        let o64: Vec<i64> = (0..n).map(|_| rng.next_u64() as i64).collect();
        let (b32, b64) = (rng.next_u64() as i32, rng.next_u64() as i64);
        for (src_shift, dst_shift) in [(0usize, 0usize), (4, 4), (12, 0), (4, 8)] {
            let bytes: Vec<u8> = o32.iter().flat_map(|o| o.to_le_bytes()).collect();
            let (src, src_ptr) = upload_at(&stream, &bytes, src_shift);
            let (dst, dst_ptr) = upload_at(&stream, &vec![0u8; 4 * n], dst_shift);
            // SAFETY: n aligned i32s in each buffer; synchronized by the download.
            unsafe { kernels::launch_rebase_offsets_i32(&stream, src_ptr, n as u64, b32, dst_ptr) }
                .unwrap();
            let got: Vec<i32> = download(&stream, &dst)[dst_shift..]
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(
                got,
                reference::rebase_offsets_i32(&o32, b32),
                "i32 n {n} shifts {src_shift} {dst_shift}"
            );
            drop(src);
        }
        for (src_shift, dst_shift) in [(0usize, 0usize), (8, 8), (8, 0)] {
            let bytes: Vec<u8> = o64.iter().flat_map(|o| o.to_le_bytes()).collect();
            let (src, src_ptr) = upload_at(&stream, &bytes, src_shift);
            let (dst, dst_ptr) = upload_at(&stream, &vec![0u8; 8 * n], dst_shift);
            // SAFETY: n aligned i64s in each buffer; synchronized by the download.
            unsafe { kernels::launch_rebase_offsets_i64(&stream, src_ptr, n as u64, b64, dst_ptr) }
                .unwrap();
            let got: Vec<i64> = download(&stream, &dst)[dst_shift..]
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(
                got,
                reference::rebase_offsets_i64(&o64, b64),
                "i64 n {n} shifts {src_shift} {dst_shift}"
            );
            drop(src);
        }
    }
    // in place
    let offsets: Vec<i32> = (100..100 + 1000).collect();
    let buf = DeviceBuffer::from_host(&stream, &offsets).unwrap();
    // SAFETY: 1000 aligned i32s, rebased in place; synchronized by the copy below.
    unsafe {
        kernels::launch_rebase_offsets_i32(&stream, buf.device_ptr(), 1000, 100, buf.device_ptr())
    }
    .unwrap();
    let mut got = vec![0i32; 1000];
    buf.copy_to_host(&stream, &mut got).unwrap();
    assert_eq!(got, (0..1000).collect::<Vec<i32>>());
    // safe wrappers
    let offsets64: Vec<i64> = (7..7 + 1000).collect();
    let src = view(
        &Arc::new(DeviceBuffer::from_host(&stream, &offsets64).unwrap()),
        8,
        7992,
    );
    let mut dst = DeviceBuffer::alloc(&stream, 7992).unwrap();
    kernels::rebase_offsets_i64(&stream, &src, 999, 8, &mut dst).unwrap();
    let mut got = vec![0i64; 999];
    dst.copy_to_host(&stream, &mut got).unwrap();
    assert_eq!(got, (0..999).collect::<Vec<i64>>());
    let mut dst32 = DeviceBuffer::alloc(&stream, 4000).unwrap();
    kernels::rebase_offsets_i32(&stream, &buf, 1000, -5, &mut dst32).unwrap();
    let mut got32 = vec![0i32; 1000];
    dst32.copy_to_host(&stream, &mut got32).unwrap();
    assert_eq!(got32, (5..1005).collect::<Vec<i32>>());
}

/// Puts the emulated driver's `cuMemcpyBatchAsync` back as the environment says when the
/// test ends, even by a panic.
struct RestoreBatchCopy(Option<EmulatedDriver>);

impl Drop for RestoreBatchCopy {
    fn drop(&mut self) {
        if let Some(emulator) = self.0 {
            emulator.set_batch_copy(None);
        }
    }
}

/// Copies buffers of several sizes to `device` and back with one
/// `Device::copy_batch_to_device` and one `copy_batch_to_host`, and checks the bytes and
/// the copy count.
fn batch_round_trip(device: &CudaDevice) {
    let sizes = [1usize, 100, 4096, 65_537, 1 << 20];
    let inputs: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| (0..n).map(|i| (i * 31 + k) as u8).collect())
        .collect();
    let on_device: Vec<_> = sizes.iter().map(|&n| device.allocate(n).unwrap()).collect();
    let up: Vec<HostToDevice> = inputs
        .iter()
        .zip(&on_device)
        .map(|(h, d)| HostToDevice {
            src: h.as_ptr(),
            dst: d.address(),
            len: h.len(),
        })
        .collect();
    let mut outputs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    let down: Vec<DeviceToHost> = outputs
        .iter_mut()
        .zip(&on_device)
        .map(|(h, d)| DeviceToHost {
            src: d.address(),
            dst: h.as_mut_ptr(),
            len: h.len(),
        })
        .collect();
    let before = device.copy_count();
    // SAFETY: the inputs and outputs outlive the copies (waited for below), the outputs
    // are not read before; every device buffer holds its copy's length; no destination
    // overlaps another.
    unsafe {
        device.copy_batch_to_device(&up).unwrap();
        device.copy_batch_to_host(&down).unwrap();
    }
    device.record_event().unwrap().wait_host().unwrap();
    assert!(outputs == inputs, "the bytes came back");
    assert_eq!(device.copy_count() - before, 2 * sizes.len() as u64);
}

/// `Device::copy_batch_to_device` and `copy_batch_to_host` on CUDA: one
/// `cuMemcpyBatchAsync` each way with `CudaDeviceOptions::batch_copies` where the driver
/// has it; one copy each where it does not (the emulated driver made to answer
/// `CUDA_ERROR_NOT_SUPPORTED`, remembered by the device), with the option off, and on the
/// legacy default stream (which the call does not accept): the same bytes every way.
#[test]
fn lists_of_copies_go_in_one_batched_call_or_one_copy_each() {
    let (_lock, dev) = gpu_or_skip!();
    let emulator = EmulatedDriver::find();
    let _restore = RestoreBatchCopy(emulator);
    let batching = || {
        CudaDevice::new(dev.clone())
            .unwrap()
            .with_options(CudaDeviceOptions::default().batch_copies(true))
    };
    let device = batching();
    batch_round_trip(&device);
    let available = device.batch_copies_available();
    println!(
        "cuMemcpyBatchAsync available: {available:?}, {} calls",
        device.batched_copy_calls()
    );
    match available {
        Some(true) => assert_eq!(device.batched_copy_calls(), 2, "one call each way"),
        Some(false) => assert_eq!(device.batched_copy_calls(), 0),
        None => panic!("the device did not look for cuMemcpyBatchAsync"),
    }
    if emulator.is_some() {
        assert_eq!(
            available,
            Some(!EmulatedDriver::batch_copy_off_by_environment()),
            "the emulator has it unless DEVARROW_EMU_NO_BATCH_COPY=1"
        );
    }

    // Off: one copy each, and no look-up.
    let plain = CudaDevice::new(dev.clone())
        .unwrap()
        .with_options(CudaDeviceOptions::default().batch_copies(false));
    batch_round_trip(&plain);
    assert_eq!(plain.batched_copy_calls(), 0);
    assert_eq!(plain.batch_copies_available(), None);

    // The legacy default stream: not accepted by the call, so never tried.
    let legacy = CudaDevice::on_stream(dev.default_stream())
        .unwrap()
        .with_options(CudaDeviceOptions::default().batch_copies(true));
    batch_round_trip(&legacy);
    assert_eq!(legacy.batched_copy_calls(), 0);
    assert_eq!(legacy.batch_copies_available(), None);

    let Some(emulator) = emulator else {
        println!("skipping: a driver without cuMemcpyBatchAsync needs the emulated driver");
        return;
    };
    // A driver without it: CUDA_ERROR_NOT_SUPPORTED, then one copy each, remembered.
    emulator.set_batch_copy(Some(false));
    let without = batching();
    batch_round_trip(&without);
    assert_eq!(without.batch_copies_available(), Some(false));
    assert_eq!(without.batched_copy_calls(), 0);
    emulator.set_batch_copy(Some(true));
    batch_round_trip(&without);
    assert_eq!(
        without.batched_copy_calls(),
        0,
        "the device does not ask again"
    );
    let with = batching();
    batch_round_trip(&with);
    assert_eq!(with.batched_copy_calls(), 2);
    assert!(dev.context().check_err().is_ok());
}

/// `CudaDeviceOptions::register_pageable`: pageable memory from the threshold on is
/// registered (its whole pages, once; a range inside them takes one more use), copied
/// from and into directly, and unregistered when the last use drops; the partial pages
/// at its ends are not, so a neighbouring allocation in them is copied as pageable
/// memory while the registration lives; memory below
/// the threshold, devarrow's staging, someone else's pinned memory and ranges sharing
/// pages with a registration that does not hold them are not registered; a refusal of
/// the driver is counted and the range staged.
#[test]
fn pageable_memory_is_registered_for_copies_and_every_registration_is_undone() {
    let (_lock, dev) = gpu_or_skip!();
    let emulator = EmulatedDriver::find();
    let emulated_before = emulator.map(|e| e.host_registrations());
    assert_eq!(live_host_registrations(), 0);
    let device = CudaDevice::new(dev.clone())
        .unwrap()
        .with_options(CudaDeviceOptions::default().register_pageable(Some(64 << 10)));
    assert_eq!(device.host_registration_min_bytes(), Some(64 << 10));
    let page = host_page_size();
    // Page-aligned ranges of whole pages, registered whole (a range's partial pages at
    // its ends are not registered: tested below).
    let len = 1 << 20;
    let mut data_pages = vec![0u8; len + 2 * page];
    let mut back_pages = vec![0u8; len + 2 * page];
    let (data_at, back_at) = (
        data_pages.as_ptr().align_offset(page),
        back_pages.as_ptr().align_offset(page),
    );
    let data = &mut data_pages[data_at..data_at + len];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let data = &*data;
    // Every `register_host` below: the ranges lie in memory that outlives the
    // registrations, which are dropped after the copies using them have completed.
    // SAFETY: so the contract of `register_host` holds.
    unsafe {
        assert!(
            device.register_host(data.as_ptr(), 1000).unwrap().is_none(),
            "small"
        );
        let off = CudaDevice::new(dev.clone()).unwrap();
        assert_eq!(off.host_registration_min_bytes(), None);
        assert!(off
            .register_host(data.as_ptr(), data.len())
            .unwrap()
            .is_none());
        let staging = device.allocate_staging(1 << 20).unwrap();
        let staged = staging.as_slice();
        assert!(device
            .register_host(staged.as_ptr(), staged.len())
            .unwrap()
            .is_none());
        let pinned = PinnedHostBuffer::alloc(&dev, 1 << 20).unwrap();
        let theirs = pinned.as_slice();
        assert!(
            device
                .register_host(theirs.as_ptr(), theirs.len())
                .unwrap()
                .is_none(),
            "someone else's pinned memory is used as it is"
        );
    }
    assert_eq!(device.host_registrations(), (0, 0));
    assert_eq!(live_host_registrations(), 0);

    // SAFETY: as above.
    let (whole, part) = unsafe {
        (
            device
                .register_host(data.as_ptr(), data.len())
                .unwrap()
                .expect("registered"),
            device
                .register_host(data.as_ptr().add(3 * page), 100_000)
                .unwrap()
                .expect("one more use of the same pages"),
        )
    };
    assert_eq!(device.host_registrations(), (1, 0), "registered once");
    assert_eq!(live_host_registrations(), 1);
    if let (Some(e), Some((live, total))) = (emulator, emulated_before) {
        assert_eq!(e.host_registrations(), (live + 1, total + 1));
    }
    assert!(
        !device.is_pinned(data.as_ptr(), data.len()),
        "a copy from it must take a use of the registration"
    );
    let back = &mut back_pages[back_at..back_at + len];
    // SAFETY: as above.
    let back_registered = unsafe { device.register_host(back.as_ptr(), back.len()) }
        .unwrap()
        .expect("registered");
    assert_eq!(live_host_registrations(), 2);
    let on_device = device.allocate(data.len()).unwrap();
    // SAFETY: both host ranges are registered and outlive the copies (waited for below);
    // the device buffer holds `data.len()` bytes.
    unsafe {
        device
            .copy_batch_to_device(&[HostToDevice {
                src: data.as_ptr(),
                dst: on_device.address(),
                len: data.len(),
            }])
            .unwrap();
        device
            .copy_batch_to_host(&[DeviceToHost {
                src: on_device.address(),
                dst: back.as_mut_ptr(),
                len: back.len(),
            }])
            .unwrap();
    }
    device.record_event().unwrap().wait_host().unwrap();
    drop(part);
    assert_eq!(
        live_host_registrations(),
        2,
        "the other use holds the pages"
    );
    drop(whole);
    drop(back_registered);
    assert_eq!(live_host_registrations(), 0);
    assert!(back == data, "the bytes came back");
    if let (Some(e), Some((live, _))) = (emulator, emulated_before) {
        assert_eq!(e.host_registrations().0, live, "every registration undone");
    }

    // Only the whole pages of a range are registered: a neighbouring buffer in its last
    // partial page is ordinary pageable memory, copied into (as a pageable copy) while
    // the registration lives. (Registering the covering pages made that copy start in
    // registered memory and run past it: the emulated driver faults it.)
    let region = &mut back_pages[back_at..back_at + 22 * page];
    // SAFETY: as above (the range lies in `region`).
    let head = unsafe { device.register_host(region.as_ptr().add(100), 20 * page) }
        .unwrap()
        .expect("registered");
    if let (Some(e), Some((live, _))) = (emulator, emulated_before) {
        assert_eq!(e.host_registrations().0, live + 1);
    }
    let scratch = device.allocate(page).unwrap();
    let (at, n) = (20 * page + 200, page - 100);
    let neighbour = &mut region[at..at + n];
    assert!(!device.is_pinned(neighbour.as_ptr(), n));
    // SAFETY: the destination is `neighbour` (alive), the source lies in `scratch`
    // (`page` bytes); the copy completes before both are dropped (waited for below).
    unsafe {
        device
            .copy_to_host(scratch.address(), neighbour.as_mut_ptr(), n)
            .unwrap()
    };
    device.record_event().unwrap().wait_host().unwrap();
    drop(head);
    assert_eq!(live_host_registrations(), 0);

    // Shares pages with a registration without lying inside it: not registered.
    let half = data.len() / 2;
    // SAFETY: as above (both ranges lie in `data`).
    unsafe {
        let first_half = device
            .register_host(data.as_ptr(), half)
            .unwrap()
            .expect("registered");
        let across = device.register_host(data.as_ptr().add(half - page - 10), 100_000);
        assert!(across.unwrap().is_none());
        drop(first_half);
    }
    assert_eq!(device.host_registrations(), (4, 0));
    assert_eq!(live_host_registrations(), 0);

    // A refusal of the driver (an injected out of memory: the memlock limit): staged.
    if let Some(injection) = FailureInjection::find() {
        let before = injection.injected_failures();
        injection.fail_nth_call(1);
        // SAFETY: as above.
        let refused = unsafe { device.register_host(data.as_ptr(), data.len()) };
        injection.fail_nth_call(0);
        assert_eq!(injection.injected_failures(), before + 1);
        assert!(refused.unwrap().is_none());
        assert_eq!(device.host_registrations(), (4, 1));
        assert_eq!(live_host_registrations(), 0);
    }
    assert!(dev.context().check_err().is_ok());
}

/// The producer frees an exported buffer on its own stream at release, where the
/// stream-ordered allocator may hand the block to its next allocation at once; so an
/// import releases only after the consumer's queued reads have completed. Here the
/// consumer is held busy, its read queued, the import dropped, and the producer
/// allocates and overwrites at once (on the emulator, the same block): the read must still
/// see the exported values, not the new ones nor the free's poison.
#[test]
fn an_import_is_released_after_the_consumers_queued_reads_though_the_producer_reuses_the_memory() {
    let (_lock, dev) = gpu_or_skip!();
    let producer = dev.new_stream().unwrap();
    let consumer = dev.new_stream().unwrap();
    let n = 4096;
    let values = DeviceBuffer::from_host(&producer, &vec![7u8; n]).unwrap();
    let values_ptr = values.device_ptr();
    // SAFETY: the buffer only travels inside the exported array, never read on the host.
    let buffer = unsafe { values.into_arrow_buffer() };
    // SAFETY: n u8 values, no nulls: a UInt8 array of length n.
    let data = unsafe {
        ArrayData::builder(DataType::UInt8)
            .len(n)
            .null_count(0)
            .add_buffer(buffer)
            .build_unchecked()
    };
    let exported = export_array_data(data, ArrowDeviceType::CUDA, &producer).unwrap();
    let imported = ImportedArray::import(exported, &consumer).unwrap();
    // SAFETY: the root's buffer 1 holds n u8 values.
    let view = unsafe { imported.buffer(imported.array(), 1, n) }.unwrap();
    let out = DeviceBuffer::alloc(&consumer, n).unwrap();
    let busy = DeviceBuffer::alloc(&consumer, 1024).unwrap();
    let gate = Gate::new(&consumer).unwrap();
    // SAFETY: `busy` holds 256 u32s and lives until the end; the copy's ranges are live
    // (the view holds the import) and distinct, and `out` is read only after it.
    unsafe {
        gate.launch_fill(busy.device_ptr(), 256, 0).unwrap();
        sys::cuMemcpyDtoDAsync_v2(out.device_ptr(), view.device_ptr(), n, consumer.cu_stream())
            .result()
            .unwrap();
    }
    drop(view);
    // The read is still queued behind the gate when the import is dropped: the drop
    // waits for it (and returns only after the gate opened).
    gate.open_during(|| drop(imported));
    let mut again = DeviceBuffer::alloc(&producer, n).unwrap();
    if EmulatedDriver::find().is_some() {
        assert_eq!(
            again.device_ptr(),
            values_ptr,
            "the emulated pool reuses the block freed on the producer's stream"
        );
    }
    again.memset(&producer, 0x22).unwrap();
    producer.synchronize().unwrap();
    let read = out.to_host(&consumer).unwrap();
    assert!(
        read.iter().all(|&b| b == 7),
        "the consumer read {:?}... instead of 7s",
        &read[..8]
    );
    drop(busy);
}

// ---------------------------------------------------------------------------------------
// DeviceKernels of CudaDevice (convert.ptx) against CpuKernels
// ---------------------------------------------------------------------------------------

mod device_kernels {
    use std::ffi::c_void;

    use devarrow_abi::device::{CpuKernels, Device, DeviceKernels, RowIntegers, Validity};
    use devarrow_cuda::CudaDevice;

    use super::{gpu, Rng};

    /// Runs `op` on CpuKernels over host copies of `bufs` and on the CUDA device's kernels
    /// over device copies (`Device::kernels`), then compares every buffer afterwards.
    /// `table`: buffer `.0` is filled with the addresses of the buffers `.1` (u64 each),
    /// host or device ones. `None` when there is no GPU (the test skips).
    fn on_both(
        bufs: &[Vec<u8>],
        table: Option<(usize, &[usize])>,
        what: &str,
        op: impl Fn(&dyn DeviceKernels, &[*mut c_void]) -> devarrow_abi::Result<()>,
    ) -> Option<()> {
        let (_held, dev) = gpu()?;
        let device = CudaDevice::new(dev.clone()).unwrap();
        let kernels = device.kernels().expect("CudaDevice has kernels");
        // CPU
        let mut host: Vec<Vec<u8>> = bufs.to_vec();
        if let Some((t, of)) = table {
            host[t] = of
                .iter()
                .flat_map(|&i| (host[i].as_ptr() as u64).to_le_bytes())
                .collect();
        }
        let host_ptrs: Vec<*mut c_void> = host.iter_mut().map(|b| b.as_mut_ptr().cast()).collect();
        op(&CpuKernels, &host_ptrs).unwrap();
        // GPU
        let memory: Vec<_> = bufs
            .iter()
            .map(|b| device.allocate(b.len()).unwrap())
            .collect();
        let ptrs: Vec<*mut c_void> = memory.iter().map(|m| m.address()).collect();
        let mut uploads: Vec<Vec<u8>> = bufs.to_vec();
        if let Some((t, of)) = table {
            uploads[t] = of
                .iter()
                .flat_map(|&i| (ptrs[i] as u64).to_le_bytes())
                .collect();
        }
        for (b, &at) in uploads.iter().zip(&ptrs) {
            // SAFETY: `at` is a device allocation of `b.len()` bytes; `b` lives until the
            // event below has completed.
            unsafe { device.copy_to_device(b.as_ptr(), at, b.len()).unwrap() };
        }
        op(kernels, &ptrs).unwrap();
        let mut out: Vec<Vec<u8>> = bufs.iter().map(|b| vec![0u8; b.len()]).collect();
        for (o, &at) in out.iter_mut().zip(&ptrs) {
            // SAFETY: as above, the other way.
            unsafe { device.copy_to_host(at, o.as_mut_ptr(), o.len()).unwrap() };
        }
        device.record_event().unwrap().wait_host().unwrap();
        for (k, (got, want)) in out.iter().zip(&host).enumerate() {
            if Some(k) == table.map(|t| t.0) {
                continue;
            }
            assert!(got == want, "{what}: buffer {k} differs from CpuKernels'");
        }
        Some(())
    }

    fn i64s(v: &[i64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn u32s(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// List offsets (n + 1) of `sizes` (u32) and the validity bitmap.
    fn offsets_of(sizes: &[u8], bitmap: &[u8], bit_offset: u64, n: u64) -> Vec<i64> {
        let mut out = vec![0u8; 8 * (n as usize + 1)];
        let rows = RowIntegers {
            address: sizes.as_ptr().cast(),
            stride: 4,
            wide: false,
        };
        // SAFETY: host buffers of the sizes read and written.
        unsafe {
            CpuKernels
                .row_sizes(
                    rows,
                    Validity::new(bitmap.as_ptr().cast(), bit_offset),
                    n,
                    out.as_mut_ptr().cast(),
                )
                .unwrap();
            CpuKernels
                .inclusive_scan_i64(out.as_mut_ptr().cast(), n + 1)
                .unwrap();
        }
        out.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    const ROWS: [u64; 6] = [0, 1, 33, 1024, 1025, 5000];

    #[test]
    fn row_sizes_through_device_kernels() {
        let mut rng = Rng(201);
        for n in ROWS {
            for (stride, wide) in [(16u64, false), (8, true)] {
                let sizes = rng.bytes((n * stride) as usize);
                let bit_offset = rng.below(9);
                let bitmap = rng.bitmap((n + bit_offset).div_ceil(8) as usize + 1);
                let out = vec![0x5Au8; 8 * (n as usize + 1)];
                let what = format!("row_sizes n {n} stride {stride}");
                let done = on_both(&[sizes, bitmap, out], None, &what, |k, b| {
                    let rows = RowIntegers {
                        address: b[0],
                        stride,
                        wide,
                    };
                    // SAFETY: the buffers hold what the kernel reads and writes.
                    unsafe { k.row_sizes(rows, Validity::new(b[1], bit_offset), n, b[2]) }
                });
                if done.is_none() {
                    return;
                }
            }
        }
    }

    #[test]
    fn inclusive_scan_through_device_kernels() {
        let mut rng = Rng(202);
        for n in [1u64, 1023, 1024, 1025, 300_000] {
            let values: Vec<i64> = (0..n)
                .map(|_| rng.next_u64() as i64 >> rng.below(64))
                .collect();
            let what = format!("scan n {n}");
            let done = on_both(&[i64s(&values)], None, &what, |k, b| {
                // SAFETY: `n` int64s.
                unsafe { k.inclusive_scan_i64(b[0], n) }
            });
            if done.is_none() {
                return;
            }
        }
    }

    #[test]
    fn gather_view_bytes_through_device_kernels() {
        let mut rng = Rng(203);
        for n in ROWS {
            let buffers: Vec<Vec<u8>> = (0..2).map(|_| rng.bytes(500)).collect();
            let bit_offset = rng.below(9);
            let bitmap = rng.bitmap((n + bit_offset).div_ceil(8) as usize + 1);
            let mut views = Vec::new();
            let mut lens = Vec::new();
            for i in 0..n {
                let bit = bit_offset + i;
                let valid = bitmap[(bit / 8) as usize] & (1 << (bit % 8)) != 0;
                let mut view = rng.bytes(16);
                let len = if !valid {
                    0
                } else if rng.below(2) == 0 {
                    rng.below(13) as u32
                } else {
                    let len = 13 + rng.below(80) as u32;
                    view[8..12].copy_from_slice(&(rng.below(2) as u32).to_le_bytes());
                    view[12..].copy_from_slice(&(rng.below(500 - len as u64) as u32).to_le_bytes());
                    len
                };
                if valid {
                    view[..4].copy_from_slice(&len.to_le_bytes());
                }
                lens.push(len);
                views.extend_from_slice(&view);
            }
            let offsets = offsets_of(&u32s(&lens), &bitmap, bit_offset, n);
            let out = vec![0x5Au8; offsets[n as usize] as usize];
            let bufs = [
                views,
                bitmap,
                vec![0; 16], // the table of the two buffers
                i64s(&offsets),
                out,
                buffers[0].clone(),
                buffers[1].clone(),
                vec![0u8; 4 * (n as usize + 1)], // the offsets narrowed
            ];
            let what = format!("views n {n}");
            let done = on_both(&bufs, Some((2, &[5, 6])), &what, |k, b| {
                let validity = Validity::new(b[1], bit_offset);
                // SAFETY: the buffers hold what the gather reads and writes (the bytes
                // twice, the same), and the n + 1 narrowed offsets (each fits).
                unsafe {
                    k.gather_view_bytes(b[0], validity, n, b[2], b[3], b[4])?;
                    k.gather_view_bytes_narrowed(b[0], validity, n, b[2], b[3], b[4], b[7])
                }
            });
            if done.is_none() {
                return;
            }
        }
    }

    #[test]
    fn narrow_widen_and_fill_through_device_kernels() {
        let mut rng = Rng(204);
        for n in ROWS {
            let src = rng.bytes(8 * n as usize);
            let what = format!("narrow/widen/fill n {n}");
            let bufs = [
                src,
                vec![0u8; 4 * n as usize],
                vec![0u8; 16 * n as usize],
                vec![0u8; 4 * n as usize],
            ];
            let done = on_both(&bufs, None, &what, |k, b| {
                // SAFETY: the buffers hold what the kernels read and write.
                unsafe {
                    k.narrow_i64_to_i32(b[0], n, b[1])?;
                    k.widen_decimals(b[0], 8, n / 2, b[2])?;
                    k.widen_decimals(b[0], 4, n, b[2])?;
                    k.fill_offsets_i32(b[3], n, 0x4000_0003)
                }
            });
            if done.is_none() {
                return;
            }
        }
    }

    #[test]
    fn offsets_to_views_through_device_kernels() {
        let mut rng = Rng(207);
        for n in ROWS {
            let values = 50u64;
            let mut offsets = vec![0i64; values as usize + 1];
            for i in 0..values as usize {
                offsets[i + 1] = offsets[i] + [0, 5, 12, 13, 40][rng.below(5) as usize];
            }
            let data = rng.bytes(offsets[values as usize] as usize);
            let indices: Vec<u8> = (0..n)
                .flat_map(|_| (rng.below(values) as i32).to_le_bytes())
                .collect();
            for wide in [false, true] {
                let offset_bytes = if wide {
                    i64s(&offsets)
                } else {
                    u32s(&offsets.iter().map(|&o| o as u32).collect::<Vec<_>>())
                };
                let what = format!("offsets to views n {n} wide {wide}");
                let bufs = [
                    offset_bytes,
                    data.clone(),
                    indices.clone(),
                    vec![0u8; 16 * n as usize],
                ];
                let done = on_both(&bufs, None, &what, |k, b| {
                    let rows = RowIntegers {
                        address: b[0],
                        stride: if wide { 8 } else { 4 },
                        wide,
                    };
                    // SAFETY: the buffers hold what the kernel reads and writes.
                    unsafe { k.offsets_to_views(rows, b[1], b[2], n, b[3]) }
                });
                if done.is_none() {
                    return;
                }
            }
        }
    }

    #[test]
    fn compare_list_offsets_through_device_kernels() {
        let mut rng = Rng(205);
        for n in ROWS.into_iter().filter(|&n| n > 0) {
            let sizes: Vec<u32> = (0..n).map(|_| rng.below(4) as u32).collect();
            let bit_offset = rng.below(9);
            let bitmap = rng.bitmap((n + bit_offset).div_ceil(8) as usize + 1);
            let expected = offsets_of(&u32s(&sizes), &bitmap, bit_offset, n);
            for mode in 0..3 {
                let mut offsets: Vec<i64> = expected[..n as usize].to_vec();
                if mode > 0 {
                    offsets[rng.below(n) as usize] += 1;
                }
                let wide = mode == 2;
                let bytes = if wide {
                    i64s(&offsets)
                } else {
                    u32s(&offsets.iter().map(|&o| o as u32).collect::<Vec<_>>())
                };
                let what = format!("compare n {n} mode {mode}");
                let bufs = [bytes, i64s(&expected), vec![0u8; 4]];
                let done = on_both(&bufs, None, &what, |k, b| {
                    let rows = RowIntegers {
                        address: b[0],
                        stride: if wide { 8 } else { 4 },
                        wide,
                    };
                    // SAFETY: the buffers hold what the kernel reads and writes.
                    unsafe { k.compare_list_offsets(rows, n, b[1], b[2]) }
                });
                if done.is_none() {
                    return;
                }
            }
        }
    }

    #[test]
    fn gather_list_values_and_bits_through_device_kernels() {
        let mut rng = Rng(206);
        for n in ROWS {
            let sizes: Vec<u32> = (0..n).map(|_| rng.below(7) as u32).collect();
            let bit_offset = rng.below(9);
            let bitmap = rng.bitmap((n + bit_offset).div_ceil(8) as usize + 1);
            let new_offsets = offsets_of(&u32s(&sizes), &bitmap, bit_offset, n);
            let total = new_offsets[n as usize] as usize;
            let offsets: Vec<u32> = (0..n).map(|_| rng.below(1000) as u32).collect();
            for width in [1u64, 3, 8, 16] {
                let child = rng.bytes(1010 * width as usize);
                let bufs = [
                    child,
                    u32s(&offsets),
                    i64s(&new_offsets),
                    vec![0x5A; total * width as usize],
                ];
                let what = format!("list values n {n} width {width}");
                let done = on_both(&bufs, None, &what, |k, b| {
                    let rows = RowIntegers {
                        address: b[1],
                        stride: 4,
                        wide: false,
                    };
                    // SAFETY: the buffers hold what the gather reads and writes.
                    unsafe { k.gather_list_values(b[0], width, 3, rows, n, b[2], b[3]) }
                });
                if done.is_none() {
                    return;
                }
            }
            let bits = rng.bitmap(140);
            let bufs = [
                bits,
                u32s(&offsets),
                i64s(&new_offsets),
                vec![0x5A; 4 * total.div_ceil(32)],
            ];
            let what = format!("list bits n {n}");
            let done = on_both(&bufs, None, &what, |k, b| {
                let rows = RowIntegers {
                    address: b[1],
                    stride: 4,
                    wide: false,
                };
                // SAFETY: the buffers hold what the gather reads and writes.
                unsafe { k.gather_list_bits(b[0], 5, rows, n, b[2], b[3]) }
            });
            if done.is_none() {
                return;
            }
        }
    }

    #[test]
    fn count_set_bits_through_device_kernels() {
        let mut rng = Rng(207);
        for len in [0u64, 1, 77, 1024, 100_003] {
            let bitmap = rng.bitmap(((len + 13) / 8) as usize + 1);
            let what = format!("count len {len}");
            // the counter starts with garbage: the count overwrites it
            let done = on_both(&[bitmap, vec![0xAB; 8]], None, &what, |k, b| {
                // SAFETY: the bitmap holds 13 + len bits, the counter 8 aligned bytes.
                unsafe { k.count_set_bits(b[0], 13, len, b[1]) }
            });
            if done.is_none() {
                return;
            }
        }
    }

    #[test]
    fn misaligned_addresses_are_refused() {
        let Some((_held, dev)) = gpu() else {
            return;
        };
        let device = CudaDevice::new(dev.clone()).unwrap();
        let kernels = device.kernels().unwrap();
        let memory = device.allocate(64).unwrap();
        let at = memory.address();
        // SAFETY: nothing is enqueued for misaligned addresses (refused first).
        unsafe {
            assert!(kernels
                .inclusive_scan_i64(at.cast::<u8>().add(4).cast(), 2)
                .is_err());
            assert!(kernels
                .narrow_i64_to_i32(at.cast::<u8>().add(1).cast(), 2, at)
                .is_err());
            assert!(kernels.widen_decimals(at, 3, 2, at).is_err());
        }
        device.record_event().unwrap().wait_host().unwrap();
    }
}

/// A `CudaDevice`'s pinned memory makes no implicitly synchronizing driver call once the
/// device is open (issue 41, section 2): the descriptor table of its copies on the device
/// and the context's pinned reserve (`DEFAULT_PINNED_RESERVE_BYTES`, shared by every
/// `CudaDevice` of the context) are allocated when the first device is made; staging of
/// any size is a block of the reserve, handed out and given back with no driver call (a
/// block given back is handed out again as its last user left it: initialized, not
/// zeroed again); staging beyond the reserve is pageable memory, with no call either.
/// Only the explicit warm-up (`reserve_pinned`: `cuMemHostAlloc`) and trim
/// (`trim_pinned`: `cuMemFreeHost`) make calls. The emulated driver counts the calls; on
/// a real driver the count is skipped (said).
#[test]
fn staging_is_reused_without_allocating_pinned_memory_again() {
    use devarrow_cuda::DEFAULT_PINNED_RESERVE_BYTES;
    use devarrow_testing::gpu::ImplicitSyncs;
    let (_lock, dev) = gpu_or_skip!();
    let start = ImplicitSyncs::snapshot();
    let device = CudaDevice::new(dev.clone()).unwrap();
    let calls = |since: &Option<ImplicitSyncs>, name: &str| {
        since.as_ref().map(|since| {
            let counted = ImplicitSyncs::counted_since(since).unwrap();
            (counted.calls.get(name).copied().unwrap_or(0), counted)
        })
    };
    if let Some((allocs, counted)) = calls(&start, "cuMemHostAlloc") {
        // The reserve is made by the context's first device (here, unless a test before
        // left a block of its reserve alive); the kernels are loaded at open too, where a
        // test before has not loaded them in this context.
        assert!(
            matches!(allocs, 1 | 2),
            "the descriptor table and the reserve, at open: {counted}"
        );
    }
    let reserve = device.pinned_stats();
    assert_eq!(
        reserve.reserved, DEFAULT_PINNED_RESERVE_BYTES,
        "{reserve:?}"
    );
    assert_eq!(reserve.in_use, 0, "{reserve:?}");
    let second = CudaDevice::new(dev.clone()).unwrap();
    assert_eq!(second.pinned_stats(), reserve, "one reserve per context");
    let before = ImplicitSyncs::snapshot();
    let mut staging = device.allocate_staging(1 << 20).unwrap();
    staging.as_mut_slice().fill(0xab);
    let address = staging.as_slice().as_ptr();
    assert!(device.is_pinned(address, 1 << 20));
    drop(staging);
    let again = device.allocate_staging(1 << 20).unwrap();
    assert_eq!(again.as_slice().as_ptr(), address, "the block given back");
    assert!(
        again.as_slice().iter().all(|&b| b == 0xab),
        "as its last user left it"
    );
    let other = device.allocate_staging(4096).unwrap();
    let large = second.allocate_staging(48 << 20).unwrap();
    assert!(device.is_pinned(large.as_slice().as_ptr(), 48 << 20));
    // Beyond the reserve: pageable, not pinned, no driver call.
    let beyond = device
        .allocate_staging(DEFAULT_PINNED_RESERVE_BYTES)
        .unwrap();
    assert!(!device.is_pinned(beyond.as_slice().as_ptr(), 4096));
    assert!(
        beyond.as_slice().iter().all(|&b| b == 0),
        "pageable: zeroed"
    );
    assert_eq!(device.pageable_staging(), 1);
    drop((again, other, large, beyond));
    if let Some((_, counted)) = calls(&before, "cuMemHostAlloc") {
        assert!(counted.is_empty(), "staging of any size: {counted}");
    }
    // The explicit warm-up and trim.
    let before = ImplicitSyncs::snapshot();
    assert!(device.reserve_pinned(DEFAULT_PINNED_RESERVE_BYTES).unwrap() == 0);
    let added = device
        .reserve_pinned(DEFAULT_PINNED_RESERVE_BYTES + 1)
        .unwrap();
    assert!(added > DEFAULT_PINNED_RESERVE_BYTES, "{added}");
    let beyond = device
        .allocate_staging(DEFAULT_PINNED_RESERVE_BYTES)
        .unwrap();
    assert!(device.is_pinned(beyond.as_slice().as_ptr(), 4096));
    if let Some((allocs, counted)) = calls(&before, "cuMemHostAlloc") {
        assert_eq!((allocs, counted.total), (1, 1), "the warm-up: {counted}");
    }
    drop(beyond);
    let before = ImplicitSyncs::snapshot();
    let freed = second.trim_pinned();
    assert_eq!(freed, DEFAULT_PINNED_RESERVE_BYTES + added);
    assert_eq!(device.pinned_stats().reserved, 0);
    if let Some((frees, counted)) = calls(&before, "cuMemFreeHost") {
        assert_eq!((frees, counted.total), (2, 2), "the trim: {counted}");
    } else {
        println!(
            "skipping the count of implicitly synchronizing calls: the driver is not the \
             emulator, which counts them"
        );
    }
    drop((device, second));
}
