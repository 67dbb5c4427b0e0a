//! devarrow's exported C device stream (`stream::export_stream`) driven by a misbehaving
//! consumer: `get_schema`, `get_next` (with NULL or real out structs), `get_last_error`,
//! `release` (also through a kept copy of the callback), moves of the struct, and calls
//! on a released struct, in any order, over a scripted source that yields batches,
//! errors (one whose `Display` panics), panics, and arrays of another device or schema.
//!
//! Checks: no crash, codes are 0 or positive errno values, `out` stays released on error
//! and `get_last_error` then has a message, every array the source made is released
//! exactly once, and the source is dropped exactly once (by `release`).
#![no_main]

use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use arbitrary::Unstructured;
use arrow_schema::{ArrowError, SchemaRef};
use devarrow_abi::stream::{export_stream, DeviceBatchSource};
use devarrow_abi::{
    cpu, ArrowDeviceArray, ArrowDeviceArrayStream, ArrowDeviceType, ArrowSchema, DeviceArray,
    Error, Result,
};
use devarrow_fuzz::batches::{batch, other_batch, schema};
use devarrow_fuzz::counted::Ledger;
use devarrow_fuzz::run;
use devarrow_fuzz::tree::rare;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: devarrow_fuzz::init(), |data: &[u8]| {
    run(|| one(&mut Unstructured::new(data)))
});

#[derive(Debug)]
struct PanickyDisplay;

impl std::fmt::Display for PanickyDisplay {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        panic!("Display of an error panicked")
    }
}

impl std::error::Error for PanickyDisplay {}

#[derive(Debug, Clone, Copy)]
enum Item {
    Batch(u8),
    OtherDevice,
    OtherSchema,
    Error(u8),
    Panic,
}

struct Script {
    items: std::collections::VecDeque<Item>,
    device_type: ArrowDeviceType,
    panic_in_schema: bool,
    panic_in_device_type: bool,
    device_type_calls: AtomicUsize,
    ledger: Arc<Ledger>,
    drops: Arc<AtomicUsize>,
}

impl Drop for Script {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

impl DeviceBatchSource for Script {
    fn schema(&self) -> SchemaRef {
        if self.panic_in_schema {
            panic!("schema() panicked");
        }
        schema()
    }
    fn device_type(&self) -> ArrowDeviceType {
        // The first call is `export_stream`'s own, in Rust (a panic there is the caller's);
        // later ones come from the C callbacks, which must contain it.
        if self.panic_in_device_type && self.device_type_calls.fetch_add(1, Ordering::SeqCst) > 0 {
            panic!("device_type() panicked");
        }
        self.device_type
    }
    fn next_array(&mut self) -> Option<Result<DeviceArray>> {
        let item = self.items.pop_front()?;
        Some(match item {
            Item::Batch(i) => Ok(self.ledger.count(cpu::export_batch_array(&batch(i)))),
            Item::OtherSchema => Ok(self.ledger.count(cpu::export_batch_array(&other_batch()))),
            Item::OtherDevice => {
                // A zero-row batch: no buffer holds a byte, so any placement is true.
                let mut raw = cpu::export_batch_array(&batch(0)).into_raw();
                raw.device_type = ArrowDeviceType::CUDA;
                raw.device_id = 0;
                // SAFETY: as above; the struct came from a DeviceArray.
                let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
                Ok(self.ledger.count(array))
            }
            Item::Error(k) => Err(match k % 4 {
                0 => Error::InvalidArgument("scripted".into()),
                1 => Error::Arrow(ArrowError::IoError(
                    "disk\0gone".into(),
                    std::io::Error::other("x"),
                )),
                2 => Error::Arrow(ArrowError::ExternalError(Box::new(PanickyDisplay))),
                _ => Error::Callback {
                    operation: "scripted",
                    code: k as i32 - 100,
                    message: String::new(),
                },
            }),
            Item::Panic => panic!("next_array() panicked"),
        })
    }
}

fn check_code(code: i32) {
    assert!(code >= 0, "a negative return code {code}");
}

fn one(u: &mut Unstructured) -> arbitrary::Result<()> {
    let ledger = Arc::new(Ledger::default());
    let drops = Arc::new(AtomicUsize::new(0));
    let n_items = u.int_in_range(0..=8)?;
    let mut items = std::collections::VecDeque::new();
    for _ in 0..n_items {
        items.push_back(match u.int_in_range(0u8..=9)? {
            0..=4 => Item::Batch(u.arbitrary()?),
            5 => Item::OtherDevice,
            6 => Item::OtherSchema,
            7 | 8 => Item::Error(u.arbitrary()?),
            _ => Item::Panic,
        });
    }
    let source = Script {
        items,
        device_type: ArrowDeviceType::CPU,
        panic_in_schema: rare(u, 12)?,
        panic_in_device_type: rare(u, 12)?,
        device_type_calls: AtomicUsize::new(0),
        ledger: ledger.clone(),
        drops: drops.clone(),
    };
    // Where the C struct lives; a move leaves the old place released (and still valid).
    let mut places: Vec<Box<ArrowDeviceArrayStream>> =
        vec![Box::new(export_stream(source).into_raw())];
    // The callbacks, kept as a C consumer may keep them: they are called on whichever
    // place, the released ones (moved from, or released) included.
    let kept_release = places[0].release;
    let get_schema = places[0].get_schema.unwrap();
    let get_next = places[0].get_next.unwrap();
    let get_last_error = places[0].get_last_error.unwrap();
    let mut arrays: Vec<DeviceArray> = Vec::new();
    let mut schemas: Vec<ArrowSchema> = Vec::new();
    let mut released = false;
    let ops = u.int_in_range(0..=24)?;
    for _ in 0..ops {
        let which = if rare(u, 3)? {
            u.choose_index(places.len())?
        } else {
            places.len() - 1
        };
        let ptr: *mut ArrowDeviceArrayStream = &mut *places[which];
        // SAFETY (all calls below): `ptr` is a live struct that was exported by devarrow
        // (or the released place it was moved out of); devarrow's callbacks check that the
        // stream is unreleased before touching its private data.
        match u.int_in_range(0u8..=9)? {
            0 | 1 => {
                let null_out = rare(u, 10)?;
                let mut out = ArrowSchema::empty();
                let out_ptr = if null_out {
                    std::ptr::null_mut()
                } else {
                    &mut out
                };
                let code = unsafe { get_schema(ptr, out_ptr) };
                check_code(code);
                if code == 0 {
                    assert!(
                        out.release().is_some(),
                        "get_schema returned 0 without a schema"
                    );
                    schemas.push(out);
                } else {
                    assert!(out.release().is_none());
                    let msg = unsafe { get_last_error(ptr) };
                    if places[which].release.is_some() {
                        assert!(!msg.is_null(), "no message after an error");
                    }
                }
            }
            2..=5 => {
                let null_out = rare(u, 10)?;
                let mut out = ArrowDeviceArray::empty();
                let out_ptr = if null_out {
                    std::ptr::null_mut()
                } else {
                    &mut out
                };
                let code = unsafe { get_next(ptr, out_ptr) };
                check_code(code);
                if code != 0 {
                    assert!(out.is_released(), "out is filled although get_next failed");
                    let msg = unsafe { get_last_error(ptr) };
                    if places[which].release.is_some() {
                        assert!(!msg.is_null(), "no message after an error");
                        // SAFETY: a C string valid until the next call.
                        let _ = unsafe { CStr::from_ptr(msg) }.to_string_lossy();
                    }
                } else if !out.is_released() {
                    // SAFETY: filled by devarrow's producer from a DeviceArray.
                    let array = unsafe { DeviceArray::try_new(out) }.unwrap();
                    if u.arbitrary()? {
                        let _ = cpu::import_record_batch_with_schema(array, schema());
                    } else {
                        arrays.push(array);
                    }
                }
            }
            6 => {
                let msg: *const c_char = unsafe { get_last_error(ptr) };
                if !msg.is_null() {
                    // SAFETY: a C string valid until the next call.
                    let _ = unsafe { CStr::from_ptr(msg) }.to_bytes().len();
                }
            }
            7 => {
                // Release through the struct, or through the callback copied at the start
                // (a second release must then be a no-op).
                if rare(u, 3)? {
                    unsafe { (kept_release.unwrap())(ptr) };
                    released = true;
                } else if let Some(release) = places[which].release {
                    unsafe { release(ptr) };
                    released = true;
                    assert!(
                        places[which].release.is_none(),
                        "release marks the stream released"
                    );
                }
            }
            8 => {
                // Move the struct to a new place (the spec's "move").
                let moved = unsafe { std::ptr::replace(ptr, ArrowDeviceArrayStream::empty()) };
                places.push(Box::new(moved));
            }
            _ => {
                if u.arbitrary()? {
                    arrays.clear();
                } else {
                    schemas.clear();
                }
            }
        }
    }
    let _ = released;
    // The consumer's last duty: release whatever place still holds the stream.
    for place in &mut places {
        if let Some(release) = place.release {
            // SAFETY: an unreleased stream exported by devarrow.
            unsafe { release(&mut **place) };
        }
    }
    assert_eq!(
        drops.load(Ordering::SeqCst),
        1,
        "the source is dropped exactly once"
    );
    // Arrays outlive the stream (spec).
    for array in arrays.drain(..) {
        let _ = cpu::import_record_batch_with_schema(array, schema());
    }
    drop(schemas);
    ledger.assert_all_released_once("stream_export");
    Ok(())
}
