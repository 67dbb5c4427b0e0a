//! Shared parts of devarrow's fuzz targets: data types and `ArrowArray` trees built from
//! fuzz input ([`types`], [`tree`]), foreign C schemas ([`schema`]), and the harness
//! plumbing ([`run`]): panics, release counting.
//!
//! # What the targets may get wrong, and what they may not
//!
//! devarrow's importers take arrays under the contract of the unsafe
//! `DeviceArray::try_new`: the struct tree is well-formed (its pointers valid for the
//! counts it states) and every buffer holds at least the bytes the C data interface gives
//! it for the struct's own `offset` and `length` (for a variable-length data buffer, up to
//! its last offset; for a variadic buffer of a view type, the size its sizes buffer
//! states). A producer that breaks that contract is undefined behaviour for any consumer
//! that reads the buffers, so the generator keeps it: every non-NULL buffer is a real host
//! allocation of exactly that size (AddressSanitizer catches a read one byte past it),
//! and a node whose sizes cannot be allocated (huge `length`/`offset`) gets NULL buffers.
//!
//! Everything else is the fuzzer's: `length`, `offset`, `null_count` (negative,
//! overflowing, too large), `n_buffers` and `n_children` against the schema, NULL buffer
//! and child pointers, released children and dictionaries, the *contents* of offsets,
//! sizes, views, type ids, run ends and dictionary keys, the alignment of buffers, and
//! the device fields (type, id, a `sync_event` on the CPU, reserved words).

pub mod schema;
pub mod tree;
pub mod types;

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    /// The message and place of the last panic on this thread.
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Replaces libfuzzer-sys's panic hook (which aborts on *every* panic, even one devarrow
/// catches on purpose, such as an arrow-rs assertion on malformed input inside
/// `cpu::import_array_as`) with one that records the panic; [`run`] turns a panic that
/// escapes into a crash. Set `DEVARROW_FUZZ_ABORT_ON_PANIC=1` to crash on caught panics
/// too (to list them while triaging), `DEVARROW_FUZZ_BACKTRACE=1` to record a backtrace
/// with each panic (slow: every caught panic pays for it).
pub fn init() {
    let abort_always = std::env::var_os("DEVARROW_FUZZ_ABORT_ON_PANIC").is_some_and(|v| v == "1");
    let backtraces = std::env::var_os("DEVARROW_FUZZ_BACKTRACE").is_some_and(|v| v == "1");
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if abort_always {
            default_hook(info);
            std::process::abort();
        }
        let message = if backtraces {
            format!("{info}\n{}", std::backtrace::Backtrace::force_capture())
        } else {
            format!("{info}")
        };
        LAST_PANIC.with(|p| *p.borrow_mut() = Some(message));
    }));
}

/// Runs one fuzz iteration; a panic that escapes it aborts with its message (a crash).
pub fn run(f: impl FnOnce() -> arbitrary::Result<()>) {
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        let message = LAST_PANIC.with(|p| p.borrow_mut().take());
        eprintln!(
            "devarrow-fuzz: a panic escaped the code under test: {}",
            message.as_deref().unwrap_or("(no message recorded)")
        );
        std::process::abort();
    }
}

/// The bytes of every buffer of `data` and its descendants, read once: a buffer arrow-rs
/// believes longer than its allocation is an AddressSanitizer report here.
pub fn touch(data: &arrow_data::ArrayData) -> u64 {
    let mut sum = 0u64;
    for b in data.buffers() {
        sum = b
            .as_slice()
            .iter()
            .fold(sum, |s, &x| s.wrapping_add(x as u64));
    }
    if let Some(nulls) = data.nulls() {
        let b = nulls.buffer();
        sum = b
            .as_slice()
            .iter()
            .fold(sum, |s, &x| s.wrapping_add(x as u64));
    }
    for c in data.child_data() {
        sum = sum.wrapping_add(touch(c));
    }
    sum
}

/// [`touch`] for every column of a record batch.
pub fn touch_batch(batch: &arrow_array::RecordBatch) -> u64 {
    use arrow_array::Array;
    batch
        .columns()
        .iter()
        .fold(0u64, |s, c| s.wrapping_add(touch(&c.to_data())))
}

pub mod batches;
pub mod counted;
