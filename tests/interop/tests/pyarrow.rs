//! Runs `python/test_pyarrow_interop.py` against this crate's cdylib.
//!
//! The interpreter is `$DEVARROW_PYTHON` (default `python3`). Without pyarrow (or cffi)
//! the test prints why and passes, unless `DEVARROW_REQUIRE_PYARROW=1`, when it fails.
//! The Python output is shown when the test fails (and with `--nocapture`).

mod common;

use std::path::Path;
use std::process::Command;

use common::{cdylib, missing_module, python, show, skip};

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
