//! Builds `cpp/async_stream.cc` with the system `g++` against the headers and `libarrow`
//! of the pyarrow wheel of `$DEVARROW_PYTHON` (default `python3`) and this crate's cdylib,
//! then runs it: devarrow's async device stream producer read by Arrow C++'s
//! `CreateAsyncDeviceStreamHandler` (default queue size), and Arrow C++'s
//! `ExportAsyncRecordBatchReader` read by devarrow's consumer, batch values and metadata
//! checked (see the program's header comment for the cases).
//!
//! Without pyarrow or `g++` (`$CXX` if set) the test prints why and passes, unless
//! `DEVARROW_REQUIRE_PYARROW=1`, when it fails. The compiler's and the program's output are
//! shown when the test fails (and with `--nocapture`). The program runs under a time limit,
//! so a deadlock fails the test instead of hanging it.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{cdylib, python, run_with_limit, show, skip};

/// The compiler: `$CXX`, else `g++`.
fn cxx() -> String {
    std::env::var("CXX")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "g++".into())
}

/// pyarrow's include directory and the directory holding `libarrow.so.*`, or why not.
fn pyarrow_dirs(python: &str) -> Result<(PathBuf, PathBuf), String> {
    let output = Command::new(python)
        .args([
            "-c",
            "import pyarrow; print(pyarrow.__version__); print(pyarrow.get_include()); \
             print(pyarrow.get_library_dirs()[0])",
        ])
        .output()
        .map_err(|e| format!("cannot run {python:?}: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{python} cannot import pyarrow:\n{}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    let [version, include, libdir] = lines[..] else {
        return Err(format!("unexpected output from {python}: {text:?}"));
    };
    println!("pyarrow {version}: headers {include}, libraries {libdir}");
    Ok((PathBuf::from(include), PathBuf::from(libdir)))
}

/// `libarrow.so.<ABI version>` in pyarrow's library directory (the wheel ships no
/// unversioned `libarrow.so`, so the program links it by its full path).
fn libarrow(libdir: &Path) -> Result<PathBuf, String> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(libdir)
        .map_err(|e| format!("cannot list {}: {e}", libdir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("libarrow.so."))
                .is_some_and(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()))
        })
        .collect();
    found.sort();
    found
        .pop()
        .ok_or_else(|| format!("no libarrow.so.<N> in {}", libdir.display()))
}

/// Whether the compiler runs at all (`--version`), or why not.
fn compiler_available(cxx: &str) -> Result<(), String> {
    match Command::new(cxx).arg("--version").output() {
        Err(e) => Err(format!("cannot run {cxx:?}: {e}")),
        Ok(o) if !o.status.success() => Err(format!("{cxx} --version failed: {}", show(&o))),
        Ok(_) => Ok(()),
    }
}

#[test]
fn arrow_cpp_async_device_stream() {
    let python = python();
    let (include, libdir) = match pyarrow_dirs(&python) {
        Ok(dirs) => dirs,
        Err(why) => return skip(&format!("pyarrow not installed ({why})")),
    };
    let cxx = cxx();
    if let Err(why) = compiler_available(&cxx) {
        return skip(&format!("no C++ compiler ({why})"));
    }
    let libarrow = libarrow(&libdir).unwrap_or_else(|why| panic!("{why}"));
    let lib = cdylib();
    let lib_dir = lib.parent().expect("the cdylib's directory");

    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("cpp/async_stream.cc");
    // One name per run: concurrent runs in one target directory do not overwrite each
    // other's program. Removed after a successful run, kept for debugging otherwise.
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("devarrow_async_stream_cpp_{}", std::process::id()));
    let mut compile = Command::new(&cxx);
    compile
        .args(["-std=c++20", "-O1", "-g", "-pthread", "-Wall"])
        .arg("-I")
        .arg(&include)
        .arg(&source)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-ldevarrow_interop")
        .arg(&libarrow)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg(format!("-Wl,-rpath,{}", libdir.display()));
    let (output, timed_out) = run_with_limit(&mut compile, Duration::from_secs(600));
    assert!(
        !timed_out && output.status.success(),
        "{compile:?} failed ({}{}):\n{}",
        output.status,
        if timed_out { ", timed out" } else { "" },
        show(&output)
    );

    // The rpath finds both libraries; cargo's LD_LIBRARY_PATH (which wins over a RUNPATH)
    // could name another build of the cdylib first.
    let mut program = Command::new(&exe);
    program.env_remove("LD_LIBRARY_PATH");
    let (output, timed_out) = run_with_limit(&mut program, Duration::from_secs(120));
    let text = show(&output);
    println!("{text}");
    assert!(
        !timed_out,
        "{} did not finish within 120 s (deadlock?):\n{text}",
        exe.display()
    );
    assert!(
        output.status.success(),
        "{} failed ({}):\n{text}",
        exe.display(),
        output.status
    );
    let _ = std::fs::remove_file(&exe);
}
