//! A deadlock guard for tests that wait on other threads.

use std::sync::mpsc;
use std::time::Duration;

/// Aborts the test process if a test hangs (a deadlock guard, not a timing assertion);
/// dropping it disarms it.
#[derive(Debug)]
pub struct Watchdog(Option<mpsc::Sender<()>>);

/// A [`Watchdog`] for the test `name`: aborts the process after 60 s (an hour under
/// Miri, where a test runs hundreds of times slower and Miri reports a real deadlock
/// itself).
pub fn watchdog(name: &'static str) -> Watchdog {
    let (tx, rx) = mpsc::channel::<()>();
    let limit = Duration::from_secs(if cfg!(miri) { 3600 } else { 60 });
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!("test {name} deadlocked");
            std::process::abort();
        }
    });
    Watchdog(Some(tx))
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}
