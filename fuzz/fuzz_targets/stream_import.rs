//! devarrow consuming a fake foreign C device stream that misbehaves: `get_schema` and
//! `get_next` return arbitrary codes (also negative ones), fill `out` or not (also on
//! error), hand out released or foreign-format schemas, arrays of another device, arrays
//! of arbitrary structure (the importer's trees), and `get_last_error` returns NULL or
//! arbitrary bytes. The consumers: `DeviceArrayStream` (schema / next_array in any
//! order), `DeviceArrayStreamReader`, and the bridge's `DeviceStreamReader` (with
//! `into_host`) on the CPU device.
//!
//! Checks: no crash, no panic out of devarrow, the stream released exactly once and never
//! called after release, every array and schema handed out released exactly once.
#![no_main]

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use arbitrary::Unstructured;
use arrow_schema::DataType;
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::stream::{DeviceArrayStream, DeviceArrayStreamReader};
use devarrow_abi::{
    cpu, ArrowDeviceArray, ArrowDeviceArrayStream, ArrowDeviceType, ArrowSchema, DeviceArray,
};
use devarrow_bridge::{DeviceStreamReader, TransferOptions};
use devarrow_fuzz::batches::{batch, other_batch, schema};
use devarrow_fuzz::counted::Ledger;
use devarrow_fuzz::tree::{self, rare, Gen};
use devarrow_fuzz::{run, schema as foreign_schema};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: devarrow_fuzz::init(), |data: &[u8]| {
    run(|| one(&mut Unstructured::new(data)))
});

/// What `get_schema` hands out.
enum SchemaOut {
    Good,
    Nothing,
    Foreign(ArrowSchema),
}

/// What `get_next` writes into `out`.
enum ArrayOut {
    Batch(u8),
    OtherSchema,
    OtherDevice,
    End,
    Tree(ArrowDeviceArray, Arc<tree::Counters>),
}

struct Step<T> {
    code: c_int,
    out: T,
}

#[derive(Default)]
struct FakeState {
    schemas: VecDeque<Step<SchemaOut>>,
    arrays: VecDeque<Step<ArrayOut>>,
    /// What get_last_error returns: `None` for NULL.
    error: Option<CString>,
    releases: usize,
    after_release: Vec<&'static str>,
    trees: Vec<Arc<tree::Counters>>,
}

struct Fake {
    state: Mutex<FakeState>,
    ledger: Ledger,
}

/// # Safety
/// `stream` is the fake stream made in `one`, whose private data outlives it.
unsafe fn fake<'a>(stream: *mut ArrowDeviceArrayStream) -> &'a Fake {
    // SAFETY: per the contract.
    unsafe { &*((*stream).private_data as *const Fake) }
}

/// # Safety
/// As [`fake`].
unsafe fn check_live(stream: *mut ArrowDeviceArrayStream, what: &'static str) -> &'static Fake {
    // SAFETY: per the contract (the Fake is leaked until the end of the iteration).
    let f: &'static Fake = unsafe { fake(stream) };
    // SAFETY: the struct is live.
    if unsafe { (*stream).release.is_none() } {
        f.state.lock().unwrap().after_release.push(what);
    }
    f
}

unsafe extern "C" fn get_schema(
    stream: *mut ArrowDeviceArrayStream,
    out: *mut ArrowSchema,
) -> c_int {
    // SAFETY: devarrow calls us on our stream.
    let f = unsafe { check_live(stream, "get_schema") };
    let step = f.state.lock().unwrap().schemas.pop_front();
    let Some(step) = step else { return 0 };
    let schema = match step.out {
        SchemaOut::Good => Some(ArrowSchema::try_from(schema().as_ref()).unwrap()),
        SchemaOut::Nothing => None,
        SchemaOut::Foreign(s) => Some(s),
    };
    if let Some(schema) = schema {
        if out.is_null() {
            drop(schema);
        } else {
            // SAFETY: devarrow passes a writable (released) struct.
            unsafe { std::ptr::write(out, schema) };
        }
    }
    step.code
}

unsafe extern "C" fn get_next(
    stream: *mut ArrowDeviceArrayStream,
    out: *mut ArrowDeviceArray,
) -> c_int {
    // SAFETY: devarrow calls us on our stream.
    let f = unsafe { check_live(stream, "get_next") };
    let step = f.state.lock().unwrap().arrays.pop_front();
    let Some(step) = step else { return 0 };
    let array = match step.out {
        ArrayOut::Batch(i) => Some(
            f.ledger
                .count(cpu::export_batch_array(&batch(i)))
                .into_raw(),
        ),
        ArrayOut::OtherSchema => Some(
            f.ledger
                .count(cpu::export_batch_array(&other_batch()))
                .into_raw(),
        ),
        ArrayOut::OtherDevice => {
            // Zero rows: no buffer holds a byte, so any placement is true.
            let mut raw = f
                .ledger
                .count(cpu::export_batch_array(&batch(0)))
                .into_raw();
            raw.device_type = ArrowDeviceType::CUDA_HOST;
            Some(raw)
        }
        ArrayOut::End => None,
        ArrayOut::Tree(raw, counters) => {
            f.state.lock().unwrap().trees.push(counters);
            Some(raw)
        }
    };
    if let Some(array) = array {
        if out.is_null() {
            // SAFETY: an unreleased array meeting try_new's contract (as made above).
            drop(unsafe { DeviceArray::try_new(array) });
        } else {
            // SAFETY: devarrow passes a writable (released) struct.
            unsafe { std::ptr::write(out, array) };
        }
    }
    step.code
}

unsafe extern "C" fn get_last_error(stream: *mut ArrowDeviceArrayStream) -> *const c_char {
    // SAFETY: devarrow calls us on our stream.
    let f = unsafe { check_live(stream, "get_last_error") };
    let state = f.state.lock().unwrap();
    state
        .error
        .as_ref()
        .map_or(std::ptr::null(), |e| e.as_ptr())
}

unsafe extern "C" fn release(stream: *mut ArrowDeviceArrayStream) {
    // SAFETY: devarrow calls us on our stream.
    let f = unsafe { check_live(stream, "release") };
    f.state.lock().unwrap().releases += 1;
    // SAFETY: the struct is live; NULL marks it released. The Fake stays alive (leaked
    // until the end of the iteration) so that a late call is recorded, not a use after
    // free.
    unsafe { (*stream).release = None };
}

fn code(u: &mut Unstructured) -> arbitrary::Result<c_int> {
    Ok(if rare(u, 4)? {
        match u.int_in_range(0u8..=3)? {
            0 => -1,
            1 => 5,
            2 => 22,
            _ => u.arbitrary()?,
        }
    } else {
        0
    })
}

fn one(u: &mut Unstructured) -> arbitrary::Result<()> {
    let mut state = FakeState::default();
    for _ in 0..u.int_in_range(0..=3)? {
        let out = match u.int_in_range(0u8..=5)? {
            0..=2 => SchemaOut::Good,
            3 => SchemaOut::Nothing,
            _ => SchemaOut::Foreign(foreign_schema::schema(u, None)?),
        };
        state.schemas.push_back(Step {
            code: code(u)?,
            out,
        });
    }
    // The consumer, chosen now: the arrays must fit the schema it reads them with.
    let consumer = u.int_in_range(0u8..=2)?;
    // The schema the arrays are read with: always the good one for the raw
    // DeviceArrayStream (this harness imports with it), and for the readers the first
    // schema get_schema hands out (they call it once). An array's buffer sizes are only
    // defined against a type: a foreign schema whose types have other widths than the
    // batches' (a decimal where the batch has an int64) would make a batch an array that
    // breaks `DeviceArray::try_new`'s contract, undetectably. So for a foreign schema
    // every array is a tree generated for its type (or, when it does not parse and the
    // reader never reads an array, the end).
    let foreign_type: Option<Option<DataType>> = match state.schemas.front() {
        Some(Step {
            code: 0,
            out: SchemaOut::Foreign(ffi),
        }) if consumer != 0 => Some(
            catch_unwind(AssertUnwindSafe(|| DataType::try_from(ffi)))
                .ok()
                .and_then(|r| r.ok()),
        ),
        _ => None,
    };
    for _ in 0..u.int_in_range(0..=6)? {
        let pick = u.int_in_range(0u8..=9)?;
        let pick = match &foreign_type {
            Some(Some(_)) if pick != 6 => 7,
            Some(None) => 6,
            _ => pick,
        };
        let out = match pick {
            0..=3 => ArrayOut::Batch(u.arbitrary()?),
            4 => ArrayOut::OtherSchema,
            5 => ArrayOut::OtherDevice,
            6 => ArrayOut::End,
            _ => {
                let dt = match &foreign_type {
                    Some(Some(dt)) => dt.clone(),
                    _ => DataType::Struct(schema().fields().clone()),
                };
                let spec = tree::node(u, &dt, None, &mut Gen::default())?;
                let device = tree::device_fields(u)?;
                let (raw, counters) = tree::build(&spec, &device);
                ArrayOut::Tree(raw, counters)
            }
        };
        state.arrays.push_back(Step {
            code: code(u)?,
            out,
        });
    }
    state.error = match u.int_in_range(0u8..=2)? {
        0 => None,
        1 => Some(c"scripted failure".to_owned()),
        _ => {
            let mut bytes: Vec<u8> = u.arbitrary()?;
            bytes.retain(|&b| b != 0);
            Some(CString::new(bytes).unwrap())
        }
    };
    let device_type = if rare(u, 8)? {
        ArrowDeviceType::CUDA
    } else {
        ArrowDeviceType::CPU
    };
    // Leaked for the iteration (freed at the end), so late calls are recorded.
    let fake: &'static Fake = Box::leak(Box::new(Fake {
        state: Mutex::new(state),
        ledger: Ledger::default(),
    }));
    let mut raw = ArrowDeviceArrayStream {
        device_type,
        get_schema: Some(get_schema),
        get_next: Some(get_next),
        get_last_error: if rare(u, 20)? {
            None
        } else {
            Some(get_last_error)
        },
        release: Some(release),
        private_data: fake as *const Fake as *mut c_void,
    };
    let steps = u.int_in_range(0..=10)?;
    match consumer {
        0 => {
            // SAFETY: `raw` is our fake, whose callbacks follow the interface's calling
            // convention; every array it hands out meets try_new's contract.
            if let Ok(mut stream) = unsafe { DeviceArrayStream::from_raw(&mut raw) } {
                for _ in 0..steps {
                    if u.arbitrary()? {
                        drop(stream.schema());
                    } else if let Ok(Some(array)) = stream.next_array() {
                        let _ = cpu::import_record_batch_with_schema(array, schema());
                    }
                }
            }
        }
        1 => {
            // SAFETY: as above.
            if let Ok(reader) = unsafe { DeviceArrayStreamReader::from_raw(&mut raw) } {
                for item in reader.take(steps) {
                    drop(item);
                }
            }
        }
        _ => {
            let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
            // SAFETY: as above.
            if let Ok(reader) = unsafe { DeviceStreamReader::from_raw(&mut raw, device) } {
                if u.arbitrary()? {
                    let mut reader = reader;
                    for _ in 0..steps {
                        if !matches!(reader.next_batch(), Ok(Some(_))) {
                            break;
                        }
                    }
                } else {
                    let mut host = reader.into_host(TransferOptions::default());
                    for _ in 0..steps {
                        if !matches!(host.next_batch(), Ok(Some(_))) {
                            break;
                        }
                    }
                }
            }
        }
    }
    // SAFETY: reclaimed once; nothing refers to it any more (the stream is released or
    // was never taken: then it is released here).
    let fake = unsafe { Box::from_raw(fake as *const Fake as *mut Fake) };
    let mut state = fake.state.into_inner().unwrap();
    if raw.release.is_some() {
        // Never taken by devarrow (from_raw moved it out otherwise): release it ourselves.
        state.releases += 1;
    }
    assert!(
        state.after_release.is_empty(),
        "called after release: {:?}",
        state.after_release
    );
    assert_eq!(state.releases, 1, "the stream is released exactly once");
    // Arrays and schemas never handed out are dropped by us.
    for step in state.arrays.drain(..) {
        if let ArrayOut::Tree(raw, counters) = step.out {
            // SAFETY: built by the generator, never handed out.
            drop(unsafe { DeviceArray::try_new(raw) });
            state.trees.push(counters);
        }
    }
    drop(state.schemas);
    fake.ledger.assert_all_released_once("stream_import");
    for (i, t) in state.trees.iter().enumerate() {
        assert_eq!(t.releases(), 1, "tree {i} is released exactly once");
    }
    Ok(())
}
