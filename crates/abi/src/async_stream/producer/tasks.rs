//! The tasks a producer hands out (`ArrowAsyncTask`): their registry, and the C
//! callback that extracts a task's array.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::ProducerShared;
use crate::async_stream::lock;
use crate::boundary::{catch_panic, swallow_panic};
use crate::device_array::DeviceArray;
use crate::error::Error;
use crate::ffi::{ArrowAsyncTask, ArrowDeviceArray};

// ---------------------------------------------------------------------------------------
// Tasks
// ---------------------------------------------------------------------------------------

/// Ids of tasks; 0 is never used, so a task's `private_data` is never NULL before
/// extraction.
pub(super) static NEXT_TASK_ID: AtomicUsize = AtomicUsize::new(1);

/// A task not yet extracted: its array, and the producer that handed it out, kept alive
/// until the task is extracted (or reclaimed after a refusal).
pub(super) struct PendingTask {
    pub(super) array: DeviceArray,
    pub(super) _producer: Option<Arc<ProducerShared>>,
}

/// The tasks not yet extracted, by id.
pub(super) fn pending_tasks() -> &'static Mutex<HashMap<usize, PendingTask>> {
    static TASKS: OnceLock<Mutex<HashMap<usize, PendingTask>>> = OnceLock::new();
    TASKS.get_or_init(Default::default)
}

/// Wraps a device array in an `ArrowAsyncTask` whose `extract_data` hands it over exactly
/// once: into `out`, or released when `out` is NULL.
///
/// The task's `private_data` is an id in a process-wide registry, not a pointer, so the
/// task struct may be copied freely and outlives any producer. A second `extract_data` on
/// the task or on any copy of it returns `EINVAL` and touches nothing; so does one on a
/// struct whose `private_data` was not made here. A task made here (not by a producer)
/// that is never extracted keeps its array alive until the process ends.
pub fn new_task(array: DeviceArray) -> ArrowAsyncTask {
    register_task(array, None)
}

/// [`new_task`], keeping `producer` (its `ArrowAsyncProducer` struct included) alive until
/// the task is extracted or reclaimed.
pub(super) fn register_task(
    array: DeviceArray,
    producer: Option<Arc<ProducerShared>>,
) -> ArrowAsyncTask {
    let id = NEXT_TASK_ID.fetch_add(1, Ordering::Relaxed);
    lock(pending_tasks()).insert(
        id,
        PendingTask {
            array,
            _producer: producer,
        },
    );
    ArrowAsyncTask {
        extract_data: Some(extract_data),
        private_data: std::ptr::without_provenance_mut(id),
    }
}

/// Removes a task from the registry (`None` when already extracted). The caller drops it
/// outside the registry's lock: that releases its array (a foreign callback) and maybe
/// the last reference to its producer.
pub(super) fn take_task(id: usize) -> Option<PendingTask> {
    lock(pending_tasks()).remove(&id)
}

/// Removes every task that `producer` handed out and that is not extracted yet, and
/// releases their arrays (outside the registry's lock); returns how many there were. A
/// later `extract_data` on one of them finds nothing and returns `EINVAL`.
pub(super) fn reclaim_tasks_of(producer: &Arc<ProducerShared>) -> usize {
    let reclaimed: Vec<PendingTask> = {
        let mut tasks = lock(pending_tasks());
        let ids: Vec<usize> = tasks
            .iter()
            .filter(|(_, task)| {
                task._producer
                    .as_ref()
                    .is_some_and(|p| Arc::ptr_eq(p, producer))
            })
            .map(|(id, _)| *id)
            .collect();
        ids.iter().filter_map(|id| tasks.remove(id)).collect()
    };
    let n = reclaimed.len();
    swallow_panic(
        "while releasing the reclaimed tasks of a failed async stream",
        move || drop(reclaimed),
    );
    n
}

pub(super) unsafe extern "C" fn extract_data(
    task: *mut ArrowAsyncTask,
    out: *mut ArrowDeviceArray,
) -> c_int {
    let result = catch_panic(|| {
        if task.is_null() {
            return Err(Error::NullPointer {
                what: "ArrowAsyncTask",
            });
        }
        // SAFETY: a non-null `task` points to the task given to `on_next_task` or to a copy
        // the consumer made of it (spec: valid and writable for this call). The id is read
        // and the field cleared, so a repeated call on this very struct sees NULL.
        let id = unsafe { std::mem::replace(&mut (*task).private_data, std::ptr::null_mut()) };
        let pending = take_task(id.addr()).ok_or_else(|| {
            Error::InvalidArgument(
                "extract_data called on a task that was already extracted (or not made by \
                 this producer)"
                    .into(),
            )
        })?;
        if out.is_null() {
            drop(pending.array);
        } else {
            // SAFETY: a non-null `out` is a consumer-allocated, writable ArrowDeviceArray
            // (spec: extract_data); ownership of the array moves into it.
            unsafe { pending.array.move_into(out) };
        }
        // `pending._producer` drops here, after the array moved: the producer struct may
        // be freed now, but this call no longer needs it.
        Ok(())
    });
    match result {
        Ok(()) => 0,
        Err(e) => e.c_code(),
    }
}
