//! The driver: the thread that pulls the Rust stream and calls the consumer's handler
//! (schema, tasks, errors, the end), as the consumer's demand allows.

use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use arrow_schema::ffi::FFI_ArrowSchema;
use futures::Stream;

use super::tasks::{reclaim_tasks_of, register_task, take_task};
use super::{ProducerShared, Wait};
use crate::async_stream::WithMetadata;
use crate::boundary::swallow_panic;
use crate::device_array::DeviceArray;
use crate::error::{Error, Result};
use crate::ffi::{ArrowAsyncDeviceStreamHandler, ArrowAsyncTask, ArrowDeviceType, ArrowSchema};
use crate::metadata::Metadata;

// ---------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------

pub(super) type OnSchema =
    unsafe extern "C" fn(*mut ArrowAsyncDeviceStreamHandler, *mut ArrowSchema) -> c_int;
pub(super) type OnNextTask = unsafe extern "C" fn(
    *mut ArrowAsyncDeviceStreamHandler,
    *mut ArrowAsyncTask,
    *const c_char,
) -> c_int;
pub(super) type OnError =
    unsafe extern "C" fn(*mut ArrowAsyncDeviceStreamHandler, c_int, *const c_char, *const c_char);
pub(super) type Release = unsafe extern "C" fn(*mut ArrowAsyncDeviceStreamHandler);

pub(super) type BoxedItems = Pin<Box<dyn Stream<Item = Result<WithMetadata<DeviceArray>>> + Send>>;

/// Reports `error` through `on_error` (the message copied into a C string).
///
/// # Safety
/// `handler` must be a live handler whose `on_error` is `on_error`.
pub(super) unsafe fn report(
    handler: *mut ArrowAsyncDeviceStreamHandler,
    on_error: OnError,
    error: &Error,
) {
    let code = error.c_code();
    let message =
        CString::new(error.to_string().replace('\0', "\\0")).expect("interior NULs were replaced");
    // SAFETY: per the contract; the message outlives the call, metadata is NULL.
    unsafe { on_error(handler, code, message.as_ptr(), std::ptr::null()) };
}

/// Makes the last calls of a producer exactly once, also when the driver never runs or
/// unwinds: `on_error` when an error is pending, then `release`. The producer struct is
/// not freed here: it lives as long as its [`ProducerShared`], which the driver, the
/// [`ProducerHandle`] and every task not yet extracted hold.
pub(super) struct Finisher {
    pub(super) handler: *mut ArrowAsyncDeviceStreamHandler,
    pub(super) on_error: OnError,
    pub(super) release: Release,
    pub(super) shared: Arc<ProducerShared>,
    pub(super) released: bool,
    /// Reported with `on_error` before `release`.
    pub(super) pending_error: Option<Error>,
    /// The stream failed (an error was reported, or the consumer returned non-zero): the
    /// tasks not extracted by now are reclaimed before `release`.
    pub(super) failed: bool,
}

impl Finisher {
    pub(super) fn finish(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        if let Some(error) = self.pending_error.take() {
            self.failed = true;
            // SAFETY: the handler is live until `release` below; it was validated to have
            // this `on_error` when the producer was spawned.
            unsafe { report(self.handler, self.on_error, &error) };
        }
        if self.failed {
            // After `on_error` (a consumer may extract its queued tasks there, as
            // devarrow's does), before `release`: a consumer that drops its queue on an
            // error without extracting (Arrow C++'s) would leak them otherwise. See the
            // module documentation, "Tasks a consumer never extracts".
            reclaim_tasks_of(&self.shared);
        }
        // From here on `request` and `cancel` are no-ops (a consumer may still call them
        // while it holds tasks, as Arrow C++'s does).
        self.shared.finish();
        // SAFETY: the handler is live and this is the last call on it; `release` was
        // validated when the producer was spawned.
        unsafe { (self.release)(self.handler) };
    }
}

impl Drop for Finisher {
    fn drop(&mut self) {
        self.finish();
    }
}

/// How the driver's loop ended.
pub(super) enum Outcome {
    /// The NULL task was delivered.
    Finished,
    /// `cancel` was called.
    Cancelled,
    /// An error to report with `on_error`.
    Failed(Error),
    /// The consumer returned non-zero: no `on_error`, the error is only for `join`.
    Rejected(Error),
}

pub(super) struct Driver {
    // Fields drop in this order: the source first, the finisher (release) last.
    pub(super) source: Option<BoxedItems>,
    pub(super) schema: Option<FFI_ArrowSchema>,
    pub(super) handler: *mut ArrowAsyncDeviceStreamHandler,
    pub(super) on_schema: OnSchema,
    pub(super) on_next_task: OnNextTask,
    pub(super) device_type: ArrowDeviceType,
    pub(super) n_fields: usize,
    pub(super) finisher: Finisher,
}

// SAFETY: the raw pointer is the consumer's handler, which the spec lets the producer
// call from any thread, serialized (only the driver thread calls it); the source stream,
// the schema and the shared state are Send.
unsafe impl Send for Driver {}

impl Driver {
    pub(super) fn shared(&self) -> &ProducerShared {
        &self.finisher.shared
    }

    pub(super) fn run(mut self) -> Result<()> {
        // Should `drive` unwind, the finisher reports its pending "stopped unexpectedly".
        let outcome = self.drive();
        self.finisher.pending_error = None;
        let source = self.source.take();
        swallow_panic("while dropping the async producer's source", move || {
            drop(source)
        });
        let result = match outcome {
            Outcome::Finished | Outcome::Cancelled => Ok(()),
            Outcome::Failed(error) => {
                // SAFETY: the handler is live (not yet released) and has this on_error.
                unsafe { report(self.handler, self.finisher.on_error, &error) };
                self.finisher.failed = true;
                Err(error)
            }
            Outcome::Rejected(error) => {
                self.finisher.failed = true;
                Err(error)
            }
        };
        self.finisher.finish();
        result
    }

    pub(super) fn stopped(wait: Wait) -> Option<Outcome> {
        match wait {
            Wait::Serve => None,
            Wait::Cancelled => Some(Outcome::Cancelled),
            Wait::Invalid(n) => Some(Outcome::Failed(Error::InvalidArgument(format!(
                "ArrowAsyncProducer.request needs n > 0, got {n}"
            )))),
        }
    }

    pub(super) fn drive(&mut self) -> Outcome {
        let mut schema = self.schema.take().unwrap_or_else(FFI_ArrowSchema::empty);
        // SAFETY: the handler is live; `handler->producer` was set before this first call;
        // the schema is valid for the call and the consumer may move it out.
        let rc = unsafe { (self.on_schema)(self.handler, &mut schema) };
        // Releases the schema unless the consumer moved it out.
        drop(schema);
        if rc != 0 {
            return Outcome::Rejected(callback_error("on_schema", rc));
        }
        loop {
            // The source is polled before waiting for demand (one item ahead of it, as
            // Arrow C++'s producer does), so that its end is found and sent without a
            // request.
            let next = self.next_item();
            if let Some(outcome) = self.shared().stop().and_then(Self::stopped) {
                return outcome;
            }
            let item = match next {
                // Only when stopped, handled above.
                Next::Interrupted => continue,
                Next::Item(Err(error)) => return Outcome::Failed(error),
                Next::Item(Ok(item)) => item,
                Next::End => {
                    // SAFETY: the handler is live; a NULL task marks the end of the stream
                    // (it takes no requested unit).
                    let rc = unsafe {
                        (self.on_next_task)(self.handler, std::ptr::null_mut(), std::ptr::null())
                    };
                    return match rc {
                        0 => Outcome::Finished,
                        rc => Outcome::Rejected(callback_error("on_next_task", rc)),
                    };
                }
            };
            if let Err(error) = self.check(&item.data) {
                return Outcome::Failed(error);
            }
            let metadata = match encode_optional(&item.metadata) {
                Ok(metadata) => metadata,
                Err(error) => return Outcome::Failed(error),
            };
            if let Some(outcome) = Self::stopped(self.shared().wait()) {
                return outcome;
            }
            let mut task = register_task(item.data, Some(self.finisher.shared.clone()));
            let id = task.private_data.addr();
            let metadata_ptr = metadata
                .as_ref()
                .map_or(std::ptr::null(), |m| m.as_ptr().cast::<c_char>());
            // SAFETY: the handler is live; the task and the metadata are valid for the
            // duration of the call (the consumer copies them to keep them).
            let rc = unsafe { (self.on_next_task)(self.handler, &mut task, metadata_ptr) };
            if rc != 0 {
                // The consumer refused the task, so it is still ours (see the module's
                // protocol decisions): reclaim it. Should the consumer have extracted it
                // anyway, the registry finds nothing and nothing is freed twice.
                drop(take_task(id));
                return Outcome::Rejected(callback_error("on_next_task", rc));
            }
        }
    }

    /// Polls the source for its next item, giving up when cancelled or on a bad request.
    pub(super) fn next_item(&mut self) -> Next {
        let Some(source) = self.source.as_mut() else {
            return Next::End;
        };
        let shared = &*self.finisher.shared;
        let polled = catch_unwind(AssertUnwindSafe(|| {
            futures::executor::block_on(futures::future::poll_fn(|cx| {
                shared.interrupt.register(cx.waker());
                if shared.interrupted() {
                    return Poll::Ready(Next::Interrupted);
                }
                source.as_mut().poll_next(cx).map(|item| match item {
                    Some(item) => Next::Item(item),
                    None => Next::End,
                })
            }))
        }));
        polled.unwrap_or_else(|payload| {
            // A panicking stream is not polled again.
            let source = self.source.take();
            swallow_panic(
                "while dropping a panicked async producer source",
                move || drop(source),
            );
            Next::Item(Err(Error::from_panic(payload)))
        })
    }

    pub(super) fn check(&self, array: &DeviceArray) -> Result<()> {
        if array.device_type() != self.device_type {
            return Err(Error::InvalidArgument(format!(
                "the async producer offers {} arrays, but the source yielded one on {}",
                self.device_type,
                array.device_type()
            )));
        }
        if array.array().n_children != self.n_fields as i64 {
            return Err(Error::InvalidArgument(format!(
                "the source yielded a struct array with {} children for a schema of {} fields",
                array.array().n_children,
                self.n_fields
            )));
        }
        Ok(())
    }
}

pub(super) enum Next {
    Item(Result<WithMetadata<DeviceArray>>),
    End,
    Interrupted,
}

/// The C encoding of `metadata`, `None` (NULL) when it is empty.
pub(super) fn encode_optional(metadata: &Metadata) -> Result<Option<Box<[u8]>>> {
    if metadata.is_empty() {
        return Ok(None);
    }
    metadata.encode().map(|m| Some(m.into_boxed_slice()))
}

pub(super) fn callback_error(operation: &'static str, code: c_int) -> Error {
    Error::Callback {
        operation,
        code,
        message: "the consumer returned an error code".into(),
    }
}
