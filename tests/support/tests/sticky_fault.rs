//! `gpu::open_or_skip` stops the GPU tests of a binary whose earlier test left a sticky
//! CUDA fault, naming that test, instead of letting every later test fail for it.
//!
//! The parent test runs this binary again as a subprocess with
//! `DEVARROW_STICKY_FAULT_CHILD=1`, where the `child_*` tests run (they return at once
//! otherwise): the first faults on purpose (a kernel's store to an address never mapped),
//! the later ones must fail at `open_or_skip` without running.

use std::process::Command;

use devarrow_cuda::PrimaryContext;
use devarrow_testing::gpu::open_or_skip;

const CHILD: &str = "DEVARROW_STICKY_FAULT_CHILD";

fn in_child() -> bool {
    std::env::var(CHILD).as_deref() == Ok("1")
}

#[test]
fn child_1_leaves_a_sticky_fault() {
    if !in_child() {
        return;
    }
    let Some((_lock, dev)) = open_or_skip(|| PrimaryContext::open(0)) else {
        return;
    };
    let stream = dev.new_stream().unwrap();
    let gate = devarrow_testing::gate::Gate::new(&stream).unwrap();
    // SAFETY: deliberately not: the kernel writes 4 KiB at the device's page 1, never
    // mapped, a fault the driver finds while the stream runs (sticky), which is what this
    // test is about. (Not past the end of a small allocation: on the H200, 2026-11-29, 4 KiB past a
    // 16-byte allocation stayed inside its mapped page and did not fault; the emulated
    // driver faults there, as compute-sanitizer's memcheck would.)
    unsafe { gate.launch_fill(0x1000, 1024, 1) }.unwrap();
    gate.open();
    let _ = stream.synchronize();
    // The stream is leaked: destroying it in a faulted context fails too.
    std::mem::forget(stream);
    println!("child_1 faulted");
}

#[test]
fn child_2_must_not_run() {
    if !in_child() {
        return;
    }
    let Some((_lock, _dev)) = open_or_skip(|| PrimaryContext::open(0)) else {
        return;
    };
    println!("child_2 ran after the fault");
}

#[test]
fn child_3_must_not_run_either() {
    if !in_child() {
        return;
    }
    let Some((_lock, _dev)) = open_or_skip(|| PrimaryContext::open(0)) else {
        return;
    };
    println!("child_3 ran after the fault");
}

#[test]
fn a_sticky_fault_stops_the_binary_naming_the_test_that_left_it() {
    if in_child() {
        return;
    }
    // Skips (or, with DEVARROW_REQUIRE_GPU=1, fails) without a device, like any GPU test;
    // the device is not held while the child runs.
    let Some((lock, dev)) = open_or_skip(|| PrimaryContext::open(0)) else {
        return;
    };
    drop(dev);
    drop(lock);
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["child_", "--test-threads=1"])
        .env(CHILD, "1")
        // The child's deliberate fault is no driver misuse to report.
        .env_remove("DEVARROW_EMU_API_ERROR_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let all = format!("{stdout}\n{stderr}");
    let message = "sticky CUDA fault CUDA_ERROR_ILLEGAL_ADDRESS (700) left by test \
                   child_1_leaves_a_sticky_fault; later tests in this binary cannot run";
    assert_eq!(out.status.code(), Some(101), "the child's output:\n{all}");
    // Printed uncaptured when found, and as the failure of each later test.
    assert!(stderr.contains(message), "the child's output:\n{all}");
    assert_eq!(
        stdout.matches(message).count(),
        2,
        "the child's output:\n{all}"
    );
    for test in ["child_2_must_not_run", "child_3_must_not_run_either"] {
        assert!(
            stdout.contains(&format!("test {test} ... FAILED")),
            "the child's output:\n{all}"
        );
    }
    assert!(
        stdout.contains("test child_1_leaves_a_sticky_fault ... ok"),
        "the child's output:\n{all}"
    );
    assert!(
        !all.contains("ran after the fault"),
        "the child's output:\n{all}"
    );
}
