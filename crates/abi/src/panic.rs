//! Panic payloads handled without unwinding: what the C boundary ([`crate::boundary`]) and
//! [`Error::from_panic`](crate::Error::from_panic) share. A leaf: it uses nothing else of
//! the crate.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// The message of a panic payload (`&str` or `String`), without consuming it.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "non-string panic payload"
    }
}

/// Drops a panic payload without letting a panic in its `Drop` escape: the payload of
/// such a second panic is forgotten (leaked) instead of dropped.
pub(crate) fn drop_payload(payload: Box<dyn std::any::Any + Send>) {
    if let Err(second) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
        std::mem::forget(second);
    }
}
