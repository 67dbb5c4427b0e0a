//! Helpers for code called from C: nothing may unwind across the boundary.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, Result};

/// Runs `f`, turning a panic into [`Error::Panic`].
pub fn catch_panic<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(Error::from_panic(p)))
}

/// Runs `f` for its side effects, swallowing (and reporting on stderr) any panic: for
/// callbacks such as `release` that have no way to report an error.
pub fn swallow_panic(what: &str, f: impl FnOnce()) {
    if let Err(p) = catch_unwind(AssertUnwindSafe(f)) {
        eprintln!(
            "devarrow: {}",
            Error::from_panic(p)
                .to_string()
                .replace("at the C boundary", what)
        );
    }
}
