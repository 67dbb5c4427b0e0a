//! Builds `c/device_interop.c` with the system C compiler (`$CC`, else `cc`) against
//! `include/arrow_c_device.h` and this crate's cdylib, and runs it: a C consumer and
//! producer of devarrow's device arrays, device stream and async device stream, both
//! ways (see the program's header comment for what each direction checks). The program
//! loads the CUDA driver itself with `dlopen`, so it builds without a CUDA toolkit.
//!
//! - `c_program_on_the_cpu_device`: everything on devarrow's CPU device; runs everywhere.
//! - `c_program_on_cuda`: on CUDA device 0, with the driver `dlopen("libcuda.so.1")` finds
//!   (the program inherits `LD_LIBRARY_PATH`, so under `.ci/emulated-gpu` that is the
//!   emulated driver). Skips with a printed reason when devarrow cannot open CUDA device 0,
//!   and fails instead when `DEVARROW_REQUIRE_GPU=1`.
//!
//! The compiler's and the program's output are shown when a test fails (and with
//! `--nocapture`: the program says what it checked). The program runs under a time limit,
//! so a deadlock fails the test instead of hanging it.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use common::{cdylib, run_with_limit, show};
use devarrow_bridge::select::{select_device, DeviceRequest};
use devarrow_testing::gpu::open_or_skip;

/// The C compiler: `$CC`, else `cc`.
fn cc() -> String {
    std::env::var("CC")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "cc".into())
}

/// The program, compiled once per test binary run.
fn program() -> &'static Path {
    static PROGRAM: OnceLock<PathBuf> = OnceLock::new();
    PROGRAM.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let source = manifest.join("c/device_interop.c");
        let include = manifest.join("../../include");
        let lib = cdylib();
        let lib_dir = lib.parent().expect("the cdylib's directory");
        // One name per run: concurrent runs in one target directory do not overwrite each
        // other's program.
        let exe = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("devarrow_device_interop_c_{}", std::process::id()));
        let mut compile = Command::new(cc());
        compile
            .args(["-std=c11", "-O1", "-g", "-pthread"])
            .args(["-Wall", "-Wextra", "-Werror", "-pedantic"])
            .arg("-I")
            .arg(&include)
            .arg(&source)
            .arg("-o")
            .arg(&exe)
            .arg(format!("-L{}", lib_dir.display()))
            .arg("-ldevarrow_interop")
            .arg("-ldl")
            .arg(format!("-Wl,-rpath,{}", lib_dir.display()));
        let (output, timed_out) = run_with_limit(&mut compile, Duration::from_secs(300));
        assert!(
            !timed_out && output.status.success(),
            "{compile:?} failed ({}{}):\n{}",
            output.status,
            if timed_out { ", timed out" } else { "" },
            show(&output)
        );
        exe
    })
}

/// Runs the program on `device` (`cpu` or `cuda`) and fails the test unless it succeeds.
fn run(device: &str) {
    let exe = program();
    // The cdylib's directory first, so the program gets the build it was linked against
    // (cargo's LD_LIBRARY_PATH, which wins over the RUNPATH, may name another build
    // first); the rest is kept: under .ci/emulated-gpu it holds the emulated libcuda.
    let lib = cdylib();
    let mut path = OsString::from(lib.parent().expect("the cdylib's directory"));
    if let Some(inherited) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(inherited);
    }
    let mut cmd = Command::new(exe);
    cmd.arg(device).env("LD_LIBRARY_PATH", path);
    let limit = Duration::from_secs(300);
    let (output, timed_out) = run_with_limit(&mut cmd, limit);
    let text = show(&output);
    println!("{text}");
    assert!(
        !timed_out,
        "{} {device} did not finish within {} s (deadlock?):\n{text}",
        exe.display(),
        limit.as_secs()
    );
    assert!(
        output.status.success(),
        "{} {device} failed ({}):\n{text}",
        exe.display(),
        output.status
    );
}

#[test]
fn c_program_on_the_cpu_device() {
    run("cpu");
}

#[test]
fn c_program_on_cuda() {
    // devarrow opens the device here only to decide whether to skip; the program opens
    // its own (in its own process).
    let Some((_lock, selected)) = open_or_skip(|| select_device(DeviceRequest::Cuda(0))) else {
        return;
    };
    println!("CUDA device 0: {} ({})", selected.name, selected.id);
    drop(selected);
    run("cuda");
}
