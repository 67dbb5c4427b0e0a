//! devarrow's async consumer (`async_stream::async_handler`) driven by a fake producer
//! that calls the handler's `on_schema`, `on_next_task`, `on_error` and `release` in any
//! order and number (also after `release`, while the Rust stream lives, as the module
//! documentation allows), with good, released, NULL and foreign schemas, devarrow tasks,
//! fake tasks (whose `extract_data` fails, fills nothing, or fills an arbitrary tree),
//! tasks without `extract_data`, and the NULL end; interleaved with polls, schema polls
//! and the drop of the Rust stream.
//!
//! Checks: no crash, no panic out of devarrow, `request`/`cancel` never after `release`,
//! at most one `cancel`, every task extracted exactly once, every array released
//! exactly once.
#![no_main]

use std::ffi::{c_char, c_int, c_void};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use arbitrary::Unstructured;
use arrow_schema::DataType;
use devarrow_abi::async_stream::{async_handler, new_task};
use devarrow_abi::{
    cpu, ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask, ArrowDeviceArray,
    ArrowDeviceType, ArrowSchema, DeviceArray,
};
use devarrow_fuzz::batches::{batch, schema};
use devarrow_fuzz::counted::Ledger;
use devarrow_fuzz::tree::{self, rare, Gen};
use devarrow_fuzz::{run, schema as foreign_schema};
use futures::Stream;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: devarrow_fuzz::init(), |data: &[u8]| {
    run(|| one(&mut Unstructured::new(data)))
});

#[derive(Default)]
struct Counters {
    requested: AtomicI64,
    requests: AtomicUsize,
    cancels: AtomicUsize,
    /// Set when the fake producer has called the handler's `release`.
    released: AtomicBool,
    after_release: AtomicUsize,
}

unsafe extern "C" fn fake_request(producer: *mut ArrowAsyncProducer, n: i64) {
    // SAFETY: private_data is the Counters, alive for the iteration.
    let c = unsafe { &*((*producer).private_data as *const Counters) };
    if c.released.load(Ordering::SeqCst) {
        c.after_release.fetch_add(1, Ordering::SeqCst);
    }
    assert!(n > 0, "devarrow requested {n}");
    c.requests.fetch_add(1, Ordering::SeqCst);
    c.requested.fetch_add(n, Ordering::SeqCst);
}

unsafe extern "C" fn fake_cancel(producer: *mut ArrowAsyncProducer) {
    // SAFETY: as above.
    let c = unsafe { &*((*producer).private_data as *const Counters) };
    if c.released.load(Ordering::SeqCst) {
        c.after_release.fetch_add(1, Ordering::SeqCst);
    }
    c.cancels.fetch_add(1, Ordering::SeqCst);
}

/// The data behind a fake task (its `private_data`).
struct FakeTask {
    code: c_int,
    array: Mutex<Option<(ArrowDeviceArray, Arc<tree::Counters>)>>,
    tree: Option<Arc<tree::Counters>>,
    extractions: AtomicUsize,
}

unsafe extern "C" fn fake_extract(task: *mut ArrowAsyncTask, out: *mut ArrowDeviceArray) -> c_int {
    // SAFETY: private_data is a FakeTask alive for the iteration.
    let t = unsafe { &*((*task).private_data as *const FakeTask) };
    t.extractions.fetch_add(1, Ordering::SeqCst);
    let array = t.array.lock().unwrap().take();
    if let Some((raw, _)) = array {
        if out.is_null() {
            // SAFETY: built by the generator.
            drop(unsafe { DeviceArray::try_new(raw) });
        } else {
            // SAFETY: devarrow passes a writable struct; the array is handed over (also
            // with a failing code: a misbehaving producer).
            unsafe { std::ptr::write(out, raw) };
        }
    }
    t.code
}

fn one(u: &mut Unstructured) -> arbitrary::Result<()> {
    let ledger = Ledger::default();
    let counters = Box::new(Counters::default());
    let mut fake_tasks: Vec<Box<FakeTask>> = Vec::new();
    let (handler, stream) = async_handler(u.int_in_range(0..=4)?);
    let mut stream = Some(stream);
    let h: *mut ArrowAsyncDeviceStreamHandler = handler.into_raw();
    let metadata: Vec<u8> = [
        1i32.to_ne_bytes().as_slice(),
        &3i32.to_ne_bytes(),
        b"key",
        &1i32.to_ne_bytes(),
        b"v",
    ]
    .concat();
    let producer = Box::into_raw(Box::new(ArrowAsyncProducer {
        device_type: if rare(u, 10)? {
            ArrowDeviceType::CUDA
        } else {
            ArrowDeviceType::CPU
        },
        request: Some(fake_request),
        cancel: Some(fake_cancel),
        additional_metadata: if u.arbitrary()? {
            metadata.as_ptr().cast()
        } else {
            std::ptr::null()
        },
        private_data: &*counters as *const Counters as *mut c_void,
    }));
    if !rare(u, 16)? {
        // SAFETY: the handler is live (owned by the stream until release).
        unsafe { (*h).producer = producer };
    }
    // SAFETY: as above; a C producer keeps the callbacks it needs.
    let (on_schema, on_next_task, on_error, release) = unsafe {
        (
            (*h).on_schema.unwrap(),
            (*h).on_next_task.unwrap(),
            (*h).on_error.unwrap(),
            (*h).release.unwrap(),
        )
    };
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut kept = Vec::new();
    let ops = u.int_in_range(0..=24)?;
    for _ in 0..ops {
        // After release, the handler struct lives only as long as the Rust stream: no call
        // on it once both are gone.
        let handler_alive = stream.is_some() || !counters.released.load(Ordering::SeqCst);
        // SAFETY (handler calls below): the handler struct is alive (see above); the
        // callbacks are devarrow's, called serially from this thread.
        match u.int_in_range(0u8..=11)? {
            0 | 1 if handler_alive => {
                let mut s = match u.int_in_range(0u8..=5)? {
                    0..=2 => ArrowSchema::try_from(schema().as_ref()).unwrap(),
                    3 => ArrowSchema::empty(),
                    _ => foreign_schema::schema(u, Some(b"+s"))?,
                };
                let ptr = if rare(u, 12)? {
                    std::ptr::null_mut()
                } else {
                    &mut s
                };
                let _ = unsafe { on_schema(h, ptr) };
            }
            2..=4 if handler_alive => {
                let code;
                match u.int_in_range(0u8..=7)? {
                    0..=3 => {
                        let array = ledger.count(cpu::export_batch_array(&batch(u.arbitrary()?)));
                        let mut task = new_task(array);
                        code = unsafe { on_next_task(h, &mut task, std::ptr::null()) };
                        if code != 0 {
                            // A refused task stays its producer's (the consumer's protocol
                            // decisions): reclaimed here, its array released.
                            let extract = task.extract_data.expect("new_task sets it");
                            // SAFETY: a devarrow task, extracted at most once here; a NULL
                            // out releases the array.
                            let _ = unsafe { extract(&mut task, std::ptr::null_mut()) };
                        }
                    }
                    4 => {
                        code = unsafe { on_next_task(h, std::ptr::null_mut(), std::ptr::null()) };
                    }
                    5 => {
                        let mut task = ArrowAsyncTask {
                            extract_data: None,
                            private_data: std::ptr::null_mut(),
                        };
                        code = unsafe { on_next_task(h, &mut task, std::ptr::null()) };
                    }
                    _ => {
                        let array = if u.arbitrary()? {
                            let dt = DataType::Struct(schema().fields().clone());
                            let spec = tree::node(u, &dt, None, &mut Gen::default())?;
                            let device = tree::device_fields(u)?;
                            Some(tree::build(&spec, &device))
                        } else {
                            None
                        };
                        let t = Box::new(FakeTask {
                            code: if rare(u, 4)? { u.arbitrary()? } else { 0 },
                            tree: array.as_ref().map(|(_, c)| c.clone()),
                            array: Mutex::new(array),
                            extractions: AtomicUsize::new(0),
                        });
                        let mut task = ArrowAsyncTask {
                            extract_data: Some(fake_extract),
                            private_data: &*t as *const FakeTask as *mut c_void,
                        };
                        fake_tasks.push(t);
                        // Metadata in the C data interface encoding (a producer must not pass else).
                        code = unsafe { on_next_task(h, &mut task, metadata.as_ptr().cast()) };
                        if code != 0 {
                            // Refused: the producer's again, reclaimed as above.
                            // SAFETY: the FakeTask lives in `fake_tasks`; NULL discards.
                            let _ = unsafe { fake_extract(&mut task, std::ptr::null_mut()) };
                        }
                    }
                }
                let _ = code;
            }
            5 if handler_alive => {
                let message: Option<Vec<u8>> = u.arbitrary()?;
                let message = message.map(|mut m| {
                    m.retain(|&b| b != 0);
                    m.push(0);
                    m
                });
                let ptr: *const c_char = message
                    .as_ref()
                    .map_or(std::ptr::null(), |m| m.as_ptr().cast());
                unsafe { on_error(h, u.arbitrary()?, ptr, std::ptr::null()) };
            }
            6 if handler_alive => {
                counters.released.store(true, Ordering::SeqCst);
                unsafe { release(h) };
            }
            7..=9 => {
                if let Some(s) = stream.as_mut() {
                    if let Poll::Ready(Some(Ok(array))) = Pin::new(s).poll_next(&mut cx) {
                        if u.arbitrary()? {
                            let _ = cpu::import_record_batch_with_schema(array, schema());
                        } else {
                            kept.push(array);
                        }
                    }
                }
            }
            10 => {
                if let Some(s) = stream.as_ref() {
                    let _ = s.poll_schema(&mut cx);
                    let _ = s.device_type();
                }
            }
            _ => {
                if rare(u, 2)? {
                    stream = None;
                } else {
                    kept.clear();
                }
            }
        }
    }
    // The producer's last duty: release (if it has not), then the consumer drops.
    if !counters.released.load(Ordering::SeqCst) {
        counters.released.store(true, Ordering::SeqCst);
        // SAFETY: the handler is alive until its release.
        unsafe { release(h) };
    }
    drop(stream);
    drop(kept);
    // SAFETY: from Box::into_raw above; devarrow no longer uses it after release.
    drop(unsafe { Box::from_raw(producer) });
    assert_eq!(
        counters.after_release.load(Ordering::SeqCst),
        0,
        "request/cancel after release"
    );
    assert!(
        counters.cancels.load(Ordering::SeqCst) <= 1,
        "cancel more than once"
    );
    for (i, t) in fake_tasks.iter().enumerate() {
        let n = t.extractions.load(Ordering::SeqCst);
        assert_eq!(n, 1, "fake task {i} extracted {n} times");
        if let Some((raw, _)) = t.array.lock().unwrap().take() {
            // SAFETY: never handed out.
            drop(unsafe { DeviceArray::try_new(raw) });
        }
    }
    for t in &fake_tasks {
        if let Some(c) = &t.tree {
            assert_eq!(
                c.releases(),
                1,
                "a fake task's array is released exactly once"
            );
        }
    }
    ledger.assert_all_released_once("async_consumer");
    drop(metadata);
    Ok(())
}
