//! The owner of host memory that copies enqueued on a device use until they complete
//! ([`InFlight`]): the outputs direct downloads are copied into, the registrations that
//! let the device reach pageable memory. It frees what it holds only once those copies
//! are known to have completed, and leaks it otherwise.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use devarrow_abi::device::{Device, SyncEvent};
use devarrow_abi::Result;

/// What the copies enqueued on the device are known to have done with the memory held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copies {
    /// None enqueued yet, or all completed: the memory is the host's again.
    Done,
    /// Enqueued, maybe still running.
    Pending,
    /// Neither waiting for them nor synchronizing the device worked: they may run on.
    Lost,
}

/// Host memory (`T`: outputs, registrations) that copies enqueued on `device` may still
/// read or write, owned until those copies complete.
///
/// Made idle ([`InFlight::new`]); [`InFlight::enqueued`] says that copies using the memory
/// are (about to be) enqueued, [`InFlight::settle`] waits for them and hands the memory
/// back. Dropped without being settled, the guard synchronizes the device first. Where the
/// copies cannot be waited for (the wait and a synchronization both fail), the memory is
/// leaked, never freed under a DMA that may still run (which could write memory reused
/// meanwhile, or read or write pages the system has moved, for registrations); the driver
/// drops registrations with the context.
pub(super) struct InFlight<'d, T> {
    device: &'d dyn Device,
    /// `None` once settled (handed back).
    held: Option<T>,
    copies: Copies,
}

impl<'d, T> InFlight<'d, T> {
    /// Owns `held`, which no copy uses yet.
    pub(super) fn new(device: &'d dyn Device, held: T) -> Self {
        Self {
            device,
            held: Some(held),
            copies: Copies::Done,
        }
    }

    /// The memory held, to add to before copies use it.
    pub(super) fn held_mut(&mut self) -> &mut T {
        self.held.as_mut().expect("held until settled")
    }

    /// Copies on the device use the memory held from now on (mark it before enqueuing
    /// them: one may be enqueued even when the call enqueuing it fails).
    pub(super) fn enqueued(&mut self) {
        self.copies = Copies::Pending;
    }

    /// Waits for the copies (for `event`, recorded after them, or without one, for the
    /// whole device) and hands the memory back. Where that wait fails, it synchronizes
    /// the device: the memory is then freed, or, if even that fails, leaked. Returns the
    /// first error (that of the wait).
    pub(super) fn settle(mut self, event: Option<&Arc<dyn SyncEvent>>) -> Result<T> {
        if self.copies == Copies::Pending {
            let waited = match event {
                Some(event) => event.wait_host(),
                None => self.device.synchronize(),
            };
            let done = waited.is_ok() || self.device.synchronize().is_ok();
            self.copies = if done { Copies::Done } else { Copies::Lost };
            // On an error the memory goes with the guard: freed if done, leaked if not.
            waited?;
        }
        Ok(self.held.take().expect("held until settled"))
    }
}

impl<T> Drop for InFlight<'_, T> {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return; // settled: handed back
        };
        if self.copies == Copies::Pending {
            // Dropped before it was settled (an early return, a panic): the copies may
            // still run.
            self.copies = match self.device.synchronize() {
                Ok(()) => Copies::Done,
                Err(_) => Copies::Lost,
            };
        }
        match self.copies {
            Copies::Done => drop(held),
            // The copies may still run: the memory is never freed.
            _ => {
                let _leaked = ManuallyDrop::new(held);
            }
        }
    }
}

impl<T> std::fmt::Debug for InFlight<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight")
            .field("copies", &self.copies)
            .finish_non_exhaustive()
    }
}
