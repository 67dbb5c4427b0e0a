//! Batches moving between CUDA devices (`DeviceBatch::copy_to`): needs 2 devices or more,
//! which CI has on the emulated driver with `DEVARROW_EMU_DEVICES=2` and `=4`
//! (`.ci/emulated-gpu`, `MULTI_DEVICE_TESTS`), and once more without peer access
//! (`DEVARROW_EMU_NO_PEER=1`: the copies are staged through pinned host memory).
//!
//! With fewer devices each test prints `skipping: ...` and passes (even with
//! `DEVARROW_REQUIRE_GPU=1`, once a device opened).

// Not under Miri: needs the CUDA driver (dlopen), which Miri cannot load.
#![cfg(not(miri))]

use std::sync::{Arc, MutexGuard};

use devarrow_abi::device::{CopyCounter, Device};
use devarrow_abi::Error;
use devarrow_bridge::{DeviceBatch, ImportOptions, Transfer, TransferOptions};
use devarrow_cuda::cudarc::driver::sys;
use devarrow_cuda::CudaDevice;
use devarrow_testing::gpu::{open_or_skip, FailureInjection};
use devarrow_testing::leaks::DeviceMemoryCheck;
use devarrow_testing::release::{count_releases, releases};
use devarrow_testing::sample;

/// Every device, with the GPU test lock held; `None` (after printing why) with fewer
/// than 2.
fn devices() -> Option<(MutexGuard<'static, ()>, Vec<Arc<CudaDevice>>)> {
    let (guard, n) = open_or_skip(devarrow_cuda::device_count)?;
    if n < 2 {
        println!("skipping: {n} CUDA device(s); these tests need 2 (DEVARROW_EMU_DEVICES=2)");
        return None;
    }
    let devices = (0..n)
        .map(|i| CudaDevice::open(i).map(Arc::new).unwrap())
        .collect();
    Some((guard, devices))
}

/// Whether device `a` can access device `b`'s memory (`cuDeviceCanAccessPeer`).
fn can_access_peer(a: usize, b: usize) -> bool {
    let mut can = 0;
    // SAFETY: the driver checks both ordinals and writes to our local.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, a as i32, b as i32) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    can != 0
}

fn transfer(device: &Arc<CudaDevice>) -> Transfer {
    Transfer::new(device.clone(), TransferOptions::default())
}

/// A batch of every type, packed and imported, moves from every device to every other:
/// equal values, on the target device with its own event; one direct peer copy where
/// `cuDeviceCanAccessPeer` says so (the source makes no host copy), staged otherwise;
/// devarrow's memory counts of every device come back to where they started.
#[test]
fn a_batch_of_every_type_moves_between_every_pair_of_devices() {
    let Some((_lock, devices)) = devices() else {
        return;
    };
    let batch = sample::every_type_batch();
    // Everything loaded and allocated once per device before measuring.
    for d in &devices {
        let on = transfer(d).to_device(&batch).unwrap();
        assert_eq!(transfer(d).to_host(&on).unwrap(), batch);
    }
    let checks: Vec<DeviceMemoryCheck> = devices
        .iter()
        .map(|d| DeviceMemoryCheck::start(d.primary_context()))
        .collect();
    for (i, source) in devices.iter().enumerate() {
        let on_source = transfer(source).to_device(&batch).unwrap();
        let imported = {
            let (array, schema) = on_source.export().unwrap();
            DeviceBatch::import_with_ffi_schema(source.clone(), array, &schema).unwrap()
        };
        for (j, target) in devices.iter().enumerate() {
            if i == j {
                continue;
            }
            let target_dyn: Arc<dyn Device> = target.clone();
            for from in [&on_source, &imported] {
                let host_copies = source.copy_count();
                let copy = from.copy_to(&target_dyn).unwrap();
                let direct = source.copy_count() == host_copies;
                assert_eq!(
                    direct,
                    can_access_peer(j, i),
                    "{i} -> {j}: direct or staged"
                );
                assert_eq!(copy.device().device_id(), j as i64);
                assert!(!copy.is_imported());
                assert_eq!(
                    transfer(target).to_host(&copy).unwrap(),
                    batch,
                    "{i} -> {j}"
                );
            }
        }
        // The copy outlives its source: dropped at once, the source's memory is freed
        // only after the copy ran (the source's stream waits for the copy's event).
        let target: Arc<dyn Device> = devices[(i + 1) % devices.len()].clone();
        let copy = on_source.copy_to(&target).unwrap();
        drop(on_source);
        drop(imported);
        let mut back = Transfer::new(target.clone(), TransferOptions::default());
        assert_eq!(back.to_host(&copy).unwrap(), batch);
    }
    for (d, check) in checks.iter().enumerate() {
        check.assert_no_leak(format!("device {d}"));
    }
    println!("moved between {} devices", devices.len());
}

/// One driver failure injected at every fallible driver call of a copy from device 0 to
/// device 1 in turn: each is a typed error, no device memory is left behind on either
/// device, and the devices work on.
#[test]
fn a_driver_failure_in_a_peer_copy_is_a_typed_error_and_leaks_nothing() {
    let Some((_lock, devices)) = devices() else {
        return;
    };
    let Some(injection) = FailureInjection::find() else {
        println!("skipping: failure injection needs the emulated driver");
        return;
    };
    let batch = sample::every_type_batch();
    let (source, target) = (&devices[0], &devices[1]);
    let target_dyn: Arc<dyn Device> = target.clone();
    let on_source = transfer(source).to_device(&batch).unwrap();
    let warm = on_source.copy_to(&target_dyn).unwrap();
    assert_eq!(transfer(target).to_host(&warm).unwrap(), batch);
    drop(warm);
    let checks: Vec<DeviceMemoryCheck> = devices
        .iter()
        .map(|d| DeviceMemoryCheck::start(d.primary_context()))
        .collect();
    let mut failures = 0;
    for n in 1.. {
        let before = injection.injected_failures();
        injection.fail_nth_call(n);
        let result = on_source.copy_to(&target_dyn);
        injection.fail_nth_call(0);
        if injection.injected_failures() == before {
            // The copy made fewer than `n` fallible calls: every one has failed once.
            assert_eq!(transfer(target).to_host(&result.unwrap()).unwrap(), batch);
            break;
        }
        failures += 1;
        match result {
            Ok(copy) => assert_eq!(transfer(target).to_host(&copy).unwrap(), batch),
            // An allocation's out of memory is arrow's `MemoryError`, as everywhere.
            Err(e) => assert!(
                matches!(
                    e,
                    devarrow_abi::Error::Device { .. } | devarrow_abi::Error::Arrow(_)
                ),
                "call {n}: not a typed device error: {e:?}"
            ),
        }
        for (d, check) in checks.iter().enumerate() {
            check.assert_no_leak(format!("call {n} failed, device {d}"));
        }
    }
    assert!(
        failures >= 3,
        "only {failures} fallible calls were exercised"
    );
    println!("{failures} driver calls failed in turn, each a typed error");
    let copy = on_source.copy_to(&target_dyn).unwrap();
    assert_eq!(transfer(target).to_host(&copy).unwrap(), batch);
}

/// An `ArrowDeviceArray` of GPU 1 imported on a `CudaDevice` of GPU 0: refused with
/// `Error::DeviceMismatch` by default (the array released once), or, with
/// `ImportOptions::copy_from_other_device`, imported on GPU 1 and copied to GPU 0 (a
/// packed batch of GPU 0, equal values; the array released once, when the import
/// returns); no device memory is left behind on either device.
#[test]
fn an_array_of_another_device_is_refused_or_copied_on_request() {
    let Some((_lock, devices)) = devices() else {
        return;
    };
    let batch = sample::every_type_batch();
    let d0: Arc<dyn Device> = devices[0].clone();
    let checks: Vec<DeviceMemoryCheck> = devices
        .iter()
        .map(|d| DeviceMemoryCheck::start(d.primary_context()))
        .collect();
    {
        let on_1 = transfer(&devices[1]).to_device(&batch).unwrap();
        let export = || {
            let (array, _) = on_1.export().unwrap();
            assert_eq!(array.device_id(), 1);
            count_releases(array)
        };
        for options in [None, Some(ImportOptions::default())] {
            let (array, released) = export();
            let refused = match options {
                None => DeviceBatch::import(d0.clone(), array, on_1.schema()),
                Some(options) => {
                    DeviceBatch::import_with_options(d0.clone(), array, on_1.schema(), options)
                }
            };
            assert!(
                matches!(
                    refused,
                    Err(Error::DeviceMismatch {
                        expected: 0,
                        found: 1,
                        ..
                    })
                ),
                "{refused:?}"
            );
            assert_eq!(releases(&released), 1);
        }
        let (array, released) = export();
        let copy = DeviceBatch::import_with_options(
            d0.clone(),
            array,
            on_1.schema(),
            ImportOptions::default().copy_from_other_device(true),
        )
        .unwrap();
        assert_eq!(releases(&released), 1, "released once the copy was made");
        assert_eq!(copy.device().device_id(), 0);
        assert!(!copy.is_imported());
        drop(on_1);
        assert_eq!(transfer(&devices[0]).to_host(&copy).unwrap(), batch);
    }
    for (d, check) in checks.iter().enumerate() {
        check.assert_no_leak(format!("device {d}"));
    }
}
