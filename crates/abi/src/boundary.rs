//! Helpers for code called from C: nothing may unwind across the boundary.

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, Result};
use crate::panic::{drop_payload, panic_message};

/// Runs `f`, turning a panic into [`Error::Panic`].
pub fn catch_panic<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(Error::from_panic(p)))
}

/// Runs `f` for its side effects, swallowing (and reporting on stderr) any panic: for
/// callbacks such as `release` that have no way to report an error.
///
/// Nothing here can unwind: the report is written with `writeln!` (an unwritable stderr,
/// e.g. a closed pipe, is ignored rather than panicking as `eprintln!` would), and the
/// panic payload is dropped under `catch_unwind` too, since its `Drop` may itself panic
/// (such a second payload is leaked).
pub fn swallow_panic(what: &str, f: impl FnOnce()) {
    if let Err(payload) = catch_unwind(AssertUnwindSafe(f)) {
        let message = panic_message(&*payload);
        let _ = writeln!(
            std::io::stderr(),
            "devarrow: panic caught {what}: {message}"
        );
        drop_payload(payload);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic payload whose `Drop` panics again.
    struct PanicsOnDrop;

    /// The payload of that second panic: a zero-sized type, so its box owns no
    /// allocation. `drop_payload` leaks the second payload by design (dropping it could
    /// panic once more); a `&str` payload (`panic!("...")`) would be a 16-byte heap box
    /// that Miri's leak check reports at the end of the test binary.
    struct SecondPanic;

    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            std::panic::panic_any(SecondPanic);
        }
    }

    #[test]
    fn swallow_panic_survives_a_payload_whose_drop_panics() {
        // Would unwind out of `swallow_panic` (and abort at a C boundary) if the payload
        // were dropped outside `catch_unwind`.
        swallow_panic("in a test", || std::panic::panic_any(PanicsOnDrop));
    }

    #[test]
    fn catch_panic_survives_a_payload_whose_drop_panics() {
        let err = catch_panic::<()>(|| std::panic::panic_any(PanicsOnDrop)).unwrap_err();
        assert!(matches!(err, Error::Panic(_)), "{err}");
    }

    #[test]
    fn swallow_panic_runs_the_closure() {
        let mut ran = false;
        swallow_panic("in a test", || ran = true);
        assert!(ran);
    }
}
