//! What the interop tests share: the Python interpreter to use, skipping (or failing when
//! `DEVARROW_REQUIRE_PYARROW=1`), the path of the cdylib, and running a program under a
//! time limit.
#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn python() -> String {
    std::env::var("DEVARROW_PYTHON")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "python3".into())
}

pub fn pyarrow_required() -> bool {
    std::env::var("DEVARROW_REQUIRE_PYARROW").as_deref() == Ok("1")
}

pub fn show(output: &Output) -> String {
    format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Prints `skipping: <reason>`, or fails when pyarrow is required.
pub fn skip(reason: &str) {
    assert!(
        !pyarrow_required(),
        "DEVARROW_REQUIRE_PYARROW=1 but {reason}"
    );
    println!("skipping: {reason}");
}

/// `Some(reason)` when the interpreter cannot import pyarrow or cffi.
pub fn missing_module(python: &str, module: &str) -> Option<String> {
    match Command::new(python)
        .args(["-c", &format!("import {module}")])
        .output()
    {
        Err(e) => Some(format!("cannot run {python:?}: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "{python} cannot import {module}:\n{}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Ok(_) => None,
    }
}

/// The cdylib `libdevarrow_interop.so`. `cargo test` builds it (the library's crate types
/// include `cdylib`) into the test binary's own `deps/` directory; `cargo build` puts it
/// one level up. If neither has it (a test binary run by hand), build it.
pub fn cdylib() -> PathBuf {
    let name = format!(
        "{}devarrow_interop{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let exe = std::env::current_exe().expect("the test binary's path");
    let deps = exe.parent().expect("the test binary's directory");
    let profile_dir = deps
        .parent()
        .expect("the test binary is in <target>/<profile>/deps");
    let candidates = [deps.join(&name), profile_dir.join(&name)];
    if let Some(lib) = candidates.iter().find(|p| p.exists()) {
        return lib.clone();
    }
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "-p", "devarrow-interop"]);
    if profile_dir.file_name().is_some_and(|p| p == "release") {
        cmd.arg("--release");
    }
    let status = cmd.status().expect("run cargo build");
    assert!(status.success(), "cargo build -p devarrow-interop failed");
    let lib = profile_dir.join(&name);
    assert!(
        lib.exists(),
        "{} not found after cargo build",
        lib.display()
    );
    lib
}

/// Runs `cmd`, killing it after `limit`; returns its output and whether it timed out.
pub fn run_with_limit(cmd: &mut Command, limit: Duration) -> (std::process::Output, bool) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let deadline = Instant::now() + limit;
    let mut timed_out = false;
    while child.try_wait().expect("wait for the program").is_none() {
        if Instant::now() >= deadline {
            timed_out = true;
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (
        child.wait_with_output().expect("collect the output"),
        timed_out,
    )
}
