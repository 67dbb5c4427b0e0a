//! Runs `python/test_pyarrow_interop.py` against this crate's cdylib.
//!
//! The interpreter is `$DEVARROW_PYTHON` (default `python3`). Without pyarrow (or cffi)
//! the test prints why and passes, unless `DEVARROW_REQUIRE_PYARROW=1`, when it fails.
//! The Python output is shown when the test fails (and with `--nocapture`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn python() -> String {
    std::env::var("DEVARROW_PYTHON")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "python3".into())
}

fn pyarrow_required() -> bool {
    std::env::var("DEVARROW_REQUIRE_PYARROW").as_deref() == Ok("1")
}

fn show(output: &Output) -> String {
    format!(
        "--- stdout ---\n{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Prints `skipping: <reason>`, or fails when pyarrow is required.
fn skip(reason: &str) {
    assert!(
        !pyarrow_required(),
        "DEVARROW_REQUIRE_PYARROW=1 but {reason}"
    );
    println!("skipping: {reason}");
}

/// `Some(reason)` when the interpreter cannot import pyarrow or cffi.
fn missing_module(python: &str, module: &str) -> Option<String> {
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
fn cdylib() -> PathBuf {
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

#[test]
fn pyarrow_interop() {
    let python = python();
    if let Some(why) = missing_module(&python, "pyarrow") {
        skip(&format!("pyarrow not installed ({why})"));
        return;
    }
    if let Some(why) = missing_module(&python, "cffi") {
        skip(&format!("cffi not installed ({why})"));
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/test_pyarrow_interop.py");
    let lib = cdylib();
    let output = Command::new(&python)
        .arg(&script)
        .arg(&lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python:?}: {e}"));
    let text = show(&output);
    println!("{text}");
    assert!(
        output.status.success(),
        "{} {} failed ({}):\n{text}",
        python,
        script.display(),
        output.status
    );
}
