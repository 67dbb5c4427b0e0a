//! Support for GPU test binaries: one rule for every test that needs a GPU.

use std::sync::{Mutex, MutexGuard};

/// Serializes GPU tests of one binary: several measure free device memory, which
/// concurrent tests would disturb.
static GPU_LOCK: Mutex<()> = Mutex::new(());

/// Whether `DEVARROW_REQUIRE_GPU=1` is set: GPU tests must then fail, not skip.
pub fn gpu_required() -> bool {
    std::env::var("DEVARROW_REQUIRE_GPU").as_deref() == Ok("1")
}

/// Opens what a GPU test needs with the test lock held, or returns `None` after printing
/// `skipping: <reason>`; panics instead when [`gpu_required`].
pub fn open_or_skip<T, E: std::fmt::Display>(
    open: impl FnOnce() -> Result<T, E>,
) -> Option<(MutexGuard<'static, ()>, T)> {
    let guard = GPU_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    match open() {
        Ok(held) => Some((guard, held)),
        Err(e) => {
            if gpu_required() {
                panic!("DEVARROW_REQUIRE_GPU=1 but no GPU is usable: {e}");
            }
            println!("skipping: {e}");
            eprintln!("skipping: {e}");
            None
        }
    }
}
