//! devarrow's async producer (`async_stream::spawn_producer`) driven by a fake consumer:
//! `request(n)` with any `n` (zero and negative included) and `cancel`, from the test
//! thread and from inside the handler's callbacks, callbacks that return error codes,
//! tasks extracted at once, later (after `on_next_task` returned, even after it was
//! refused), twice, or with NULL; over a scripted source of batches, errors, panics and
//! arrays of another device or shape.
//!
//! Checks: no crash, `on_schema` first, never more tasks than units requested (the NULL
//! end needs none), nothing after `release`, `release` exactly once, no
//! handler call from inside `request`/`cancel`, and every array the source made released
//! exactly once once the consumer has extracted (or discarded) every task.
#![no_main]

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arbitrary::Unstructured;
use devarrow_abi::async_stream::spawn_producer;
use devarrow_abi::{
    cpu, ArrowAsyncDeviceStreamHandler, ArrowAsyncProducer, ArrowAsyncTask, ArrowDeviceArray,
    ArrowDeviceType, ArrowSchema, DeviceArray, Error,
};
use devarrow_fuzz::batches::{batch, other_batch, schema};
use devarrow_fuzz::counted::Ledger;
use devarrow_fuzz::run;
use devarrow_fuzz::tree::rare;
use futures::StreamExt;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: devarrow_fuzz::init(), |data: &[u8]| {
    run(|| one(&mut Unstructured::new(data)))
});

/// What the fake consumer does with the task of one `on_next_task` call.
#[derive(Clone, Copy, Debug)]
enum TaskAction {
    Extract,
    ExtractNull,
    Keep,
    ExtractTwice,
}

#[derive(Default)]
struct Script {
    schema_rc: c_int,
    /// Per `on_next_task` call: the return code, what to do with the task, and how many
    /// units to request from inside the callback.
    tasks: Vec<(c_int, TaskAction, i64)>,
}

#[derive(Default)]
struct Consumer {
    script: Script,
    /// The producer pointer from `on_schema`, NULL before it and after `release`; calls
    /// through it hold this lock, which `release` takes too.
    producer: Mutex<*mut ArrowAsyncProducer>,
    log: Mutex<Vec<&'static str>>,
    violations: Mutex<Vec<String>>,
    requested: Mutex<i64>,
    next_calls: AtomicUsize,
    released: AtomicBool,
    in_request: AtomicBool,
    kept: Mutex<Vec<ArrowAsyncTask>>,
    arrays: Mutex<Vec<DeviceArray>>,
}

// SAFETY: the raw pointers are only used under the locks above; the tasks are plain data
// the spec lets any thread extract.
unsafe impl Send for Consumer {}
// SAFETY: as above.
unsafe impl Sync for Consumer {}

impl Consumer {
    fn violation(&self, v: String) {
        self.violations.lock().unwrap().push(v);
    }

    fn enter(&self, what: &'static str) {
        if self.released.load(Ordering::SeqCst) {
            self.violation(format!("{what} after release"));
        }
        if self.in_request.load(Ordering::SeqCst) {
            // Only meaningful when request runs on the driver's thread, i.e. from a callback;
            // a call from the test thread at the same time is the driver's own business.
        }
        self.log.lock().unwrap().push(what);
    }

    /// Calls `request(n)` (or `cancel` when `n` is None) on the producer, if it is live
    /// (known from `on_schema`, not released); returns whether it did.
    fn call(&self, n: Option<i64>) -> bool {
        let producer = self.producer.lock().unwrap();
        if producer.is_null() {
            return false;
        }
        let p = *producer;
        if let Some(n) = n {
            if n > 0 {
                *self.requested.lock().unwrap() += n;
            }
            // SAFETY: live until release, which takes the lock we hold.
            unsafe { ((*p).request.unwrap())(p, n) };
        } else {
            // SAFETY: as above.
            unsafe { ((*p).cancel.unwrap())(p) };
        }
        true
    }

    fn extract(&self, task: &mut ArrowAsyncTask, into_out: bool) -> c_int {
        let Some(extract) = task.extract_data else {
            self.violation("a task without extract_data".into());
            return 0;
        };
        let mut out = ArrowDeviceArray::empty();
        let out_ptr = if into_out {
            &mut out as *mut _
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: a task devarrow made (or a copy), extracted into a writable struct.
        let rc = unsafe { extract(task, out_ptr) };
        if rc == 0 && into_out {
            // SAFETY: filled by devarrow from a DeviceArray of its source.
            match unsafe { DeviceArray::try_new(out) } {
                Ok(a) => self.arrays.lock().unwrap().push(a),
                Err(_) => self.violation("extract_data returned 0 and no array".into()),
            }
        } else if !out.is_released() {
            self.violation("a failed extract_data filled the array".into());
        }
        rc
    }
}

/// # Safety
/// `handler` is the fake handler made in `one`.
unsafe fn consumer<'a>(handler: *mut ArrowAsyncDeviceStreamHandler) -> &'a Consumer {
    // SAFETY: private_data is an Arc<Consumer> kept alive by `one`.
    unsafe { &*((*handler).private_data as *const Consumer) }
}

unsafe extern "C" fn on_schema(
    h: *mut ArrowAsyncDeviceStreamHandler,
    schema: *mut ArrowSchema,
) -> c_int {
    // SAFETY: devarrow calls us with our handler.
    let c = unsafe { consumer(h) };
    c.enter("schema");
    if c.log.lock().unwrap().len() != 1 {
        c.violation("on_schema is not the first call".into());
    }
    // SAFETY: valid for the call; moved out (and released by the drop).
    drop(unsafe { ArrowSchema::from_raw(schema) });
    // SAFETY: our handler; `producer` must be set before on_schema.
    let p = unsafe { (*h).producer };
    if p.is_null() {
        c.violation("producer not set before on_schema".into());
    }
    *c.producer.lock().unwrap() = p;
    c.script.schema_rc
}

unsafe extern "C" fn on_next_task(
    h: *mut ArrowAsyncDeviceStreamHandler,
    task: *mut ArrowAsyncTask,
    _metadata: *const c_char,
) -> c_int {
    // SAFETY: devarrow calls us with our handler.
    let c = unsafe { consumer(h) };
    c.enter(if task.is_null() { "end" } else { "task" });
    let k = c.next_calls.fetch_add(1, Ordering::SeqCst);
    let requested = *c.requested.lock().unwrap();
    // The NULL end takes no unit of demand (the producer's documented choice, as Arrow
    // C++'s): only tasks count against what was requested.
    if !task.is_null() && k as i64 + 1 > requested {
        c.violation(format!(
            "on_next_task call {} of {requested} requested",
            k + 1
        ));
    }
    let (rc, action, more) = c
        .script
        .tasks
        .get(k)
        .copied()
        .unwrap_or((0, TaskAction::Extract, 1));
    if !task.is_null() {
        // SAFETY: valid for the call; a bitwise copy is how a consumer keeps it.
        let mut copy = unsafe { std::ptr::read(task) };
        match action {
            TaskAction::Extract => {
                c.extract(&mut copy, true);
            }
            TaskAction::ExtractNull => {
                c.extract(&mut copy, false);
            }
            TaskAction::Keep => c.kept.lock().unwrap().push(copy),
            TaskAction::ExtractTwice => {
                let first = c.extract(&mut copy, true);
                // SAFETY: the original struct: a second extraction must be refused.
                let second = c.extract(unsafe { &mut *task }, true);
                if first == 0 && second == 0 {
                    c.violation("a task was extracted twice".into());
                }
            }
        }
    }
    if more != 0 {
        c.call(Some(more));
    }
    let _ = requested;
    rc
}

unsafe extern "C" fn on_error(
    h: *mut ArrowAsyncDeviceStreamHandler,
    _code: c_int,
    message: *const c_char,
    _metadata: *const c_char,
) {
    // SAFETY: devarrow calls us with our handler.
    let c = unsafe { consumer(h) };
    c.enter("error");
    if message.is_null() {
        c.violation("on_error without a message".into());
    }
}

unsafe extern "C" fn release(h: *mut ArrowAsyncDeviceStreamHandler) {
    // SAFETY: devarrow calls us with our handler.
    let c = unsafe { consumer(h) };
    c.enter("release");
    // Under the lock: no request/cancel is under way, and none follows.
    let mut p = c.producer.lock().unwrap();
    *p = std::ptr::null_mut();
    c.released.store(true, Ordering::SeqCst);
}

#[derive(Clone, Copy, Debug)]
enum Item {
    Batch(u8),
    OtherDevice,
    OtherShape,
    Error,
    Panic,
}

fn one(u: &mut Unstructured) -> arbitrary::Result<()> {
    let ledger = Arc::new(Ledger::default());
    let mut script = Script {
        schema_rc: if rare(u, 10)? { 22 } else { 0 },
        tasks: Vec::new(),
    };
    for _ in 0..u.int_in_range(0..=8)? {
        let rc = if rare(u, 10)? { u.arbitrary()? } else { 0 };
        let action = match u.int_in_range(0u8..=7)? {
            0..=3 => TaskAction::Extract,
            4 => TaskAction::ExtractNull,
            5 | 6 => TaskAction::Keep,
            _ => TaskAction::ExtractTwice,
        };
        let more = if rare(u, 3)? {
            u.int_in_range(-1..=3)?
        } else {
            0
        };
        script.tasks.push((rc, action, more));
    }
    let mut items = Vec::new();
    for _ in 0..u.int_in_range(0..=8)? {
        items.push(match u.int_in_range(0u8..=9)? {
            0..=5 => Item::Batch(u.arbitrary()?),
            6 => Item::OtherDevice,
            7 => Item::OtherShape,
            8 => Item::Error,
            _ => Item::Panic,
        });
    }
    let endless = rare(u, 6)?;
    let source_ledger = ledger.clone();
    let dropped = Arc::new(AtomicUsize::new(0));
    struct DropFlag(Arc<AtomicUsize>);
    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let flag = DropFlag(dropped.clone());
    let tail: Box<dyn Iterator<Item = Item> + Send> = if endless {
        Box::new(std::iter::repeat(Item::Batch(3)))
    } else {
        Box::new(std::iter::empty())
    };
    let source = futures::stream::iter(items.into_iter().chain(tail)).map(move |item| {
        let _keep = &flag;
        match item {
            Item::Batch(i) => Ok(source_ledger.count(cpu::export_batch_array(&batch(i)))),
            Item::OtherShape => Ok(source_ledger.count(cpu::export_batch_array(&other_batch()))),
            Item::OtherDevice => {
                // Zero rows: no buffer holds a byte, so any placement is true.
                let mut raw = cpu::export_batch_array(&batch(0)).into_raw();
                raw.device_type = ArrowDeviceType::CUDA;
                // SAFETY: as above; the struct came from a DeviceArray.
                let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
                Ok(source_ledger.count(array))
            }
            Item::Error => Err(Error::InvalidArgument("scripted".into())),
            Item::Panic => panic!("the source panicked"),
        }
    });
    let consumer = Arc::new(Consumer {
        script,
        ..Default::default()
    });
    let handler = Box::into_raw(Box::new(ArrowAsyncDeviceStreamHandler {
        on_schema: Some(on_schema),
        on_next_task: Some(on_next_task),
        on_error: Some(on_error),
        release: Some(release),
        producer: std::ptr::null_mut(),
        private_data: Arc::as_ptr(&consumer) as *mut c_void,
    }));
    // SAFETY: the handler stays valid until after `join` (freed below).
    let producer = unsafe { spawn_producer(schema(), ArrowDeviceType::CPU, source, handler) };
    let Ok(producer) = producer else {
        // SAFETY: refused; nothing uses the handler any more.
        drop(unsafe { Box::from_raw(handler) });
        return Ok(());
    };
    // The test thread's calls.
    for _ in 0..u.int_in_range(0..=10)? {
        match u.int_in_range(0u8..=9)? {
            0..=4 => drop(consumer.call(Some(u.int_in_range(1..=4)?))),
            5 => drop(consumer.call(Some(if u.arbitrary()? { 0 } else { -1 }))),
            6 => drop(consumer.call(None)),
            7 => {
                let kept: Vec<_> = consumer.kept.lock().unwrap().drain(..).collect();
                for mut t in kept {
                    consumer.extract(&mut t, u.arbitrary()?);
                }
            }
            8 => producer.cancel(),
            _ => std::thread::yield_now(),
        }
    }
    // End it: cancel (the consumer's or the owner's), then wait for release.
    // The consumer can cancel only once it has the producer (from on_schema); the owner's
    // cancel always works.
    if !(u.arbitrary()? && consumer.call(None)) {
        producer.cancel();
    }
    let started = Instant::now();
    while !producer.is_finished() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the producer did not stop after cancel: {:?}",
            consumer.log.lock().unwrap()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    let _ = producer.join();
    assert!(
        consumer.released.load(Ordering::SeqCst),
        "join returned before release"
    );
    // SAFETY: released: devarrow no longer uses the handler.
    drop(unsafe { Box::from_raw(handler) });
    let log = consumer.log.lock().unwrap().clone();
    assert_eq!(
        log.iter().filter(|e| **e == "release").count(),
        1,
        "release exactly once: {log:?}"
    );
    assert_eq!(
        log.last(),
        Some(&"release"),
        "release is the last call: {log:?}"
    );
    let violations = consumer.violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "{violations:?} in {log:?}");
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "the source is dropped exactly once"
    );
    // Tasks kept past release are still extracted (the spec makes it mandatory).
    let kept: Vec<_> = consumer.kept.lock().unwrap().drain(..).collect();
    for mut t in kept {
        consumer.extract(&mut t, false);
    }
    consumer.arrays.lock().unwrap().clear();
    ledger.assert_all_released_once("async_producer");
    Ok(())
}
