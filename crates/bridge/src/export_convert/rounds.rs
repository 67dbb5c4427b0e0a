//! The conversions' read-backs, planned for the whole batch: one round per level of
//! nesting, not one per column.
//!
//! A conversion that must know a value living on the device (a view column's total
//! bytes, a list's last offset, a list view's first offset and whether its views are in
//! order) does not read it at once: it returns a [`Step::Wait`] naming what it reads and
//! what it does with the values. [`all`] joins the steps of sibling columns (a batch's
//! columns, a struct's fields) into one, so that the walk ([`super::convert`]) reads
//! everything the batch needs in a round with one batched copy on the device into a
//! scratch buffer, one device-to-host copy and one host wait ([`Converter::read_round`]),
//! as the bridge's download reads the sizes of a foreign batch. What the values tell may
//! need more reads (a list's child converted after its offsets): the next round. A batch
//! of flat columns takes one round, a `list<utf8view>` two, however many columns there
//! are.
//!
//! Errors are those of the columns in order: a column's error is returned only once
//! every column before it has finished without one (the later columns' work is dropped),
//! so that a batch with several faults reports the same one as a walk column by column.

use std::ffi::c_void;

use devarrow_abi::device::DeviceCopy;
use devarrow_abi::{Error, Result};

use super::Converter;

/// A value to read back: `width` bytes (4: a signed `int32`, 8: an `int64`,
/// little-endian) at `address`, device memory.
#[derive(Debug, Clone, Copy)]
pub(super) struct Read {
    pub address: *const c_void,
    pub width: u64,
}

impl Read {
    /// An `int64` at `address`.
    pub fn i64(address: *const c_void) -> Self {
        Read { address, width: 8 }
    }
}

/// What a step does once its reads are back: the values, one per read in order.
pub(super) type Then<'a, T> =
    Box<dyn FnOnce(&mut Converter<'a>, &[i64]) -> Result<Step<'a, T>> + 'a>;

/// A conversion (of a column, a child, a buffer) in progress: done, or waiting for
/// values to be read back in the next round.
pub(super) enum Step<'a, T> {
    Done(T),
    Wait(Vec<Read>, Then<'a, T>),
}

impl<'a, T: 'a> Step<'a, T> {
    /// Reads `reads` in the next round, then continues with `then`.
    pub fn read(
        reads: Vec<Read>,
        then: impl FnOnce(&mut Converter<'a>, &[i64]) -> Result<Step<'a, T>> + 'a,
    ) -> Self {
        Step::Wait(reads, Box::new(then))
    }

    /// The step's value made into another once it is done.
    pub fn map<U: 'a>(self, f: impl FnOnce(T) -> U + 'a) -> Step<'a, U> {
        match self {
            Step::Done(value) => Step::Done(f(value)),
            Step::Wait(reads, then) => Step::Wait(
                reads,
                Box::new(move |converter, values| Ok(then(converter, values)?.map(f))),
            ),
        }
    }

    /// Continues with `f` once the step is done (at once if it is).
    pub fn and_then<U: 'a>(
        self,
        converter: &mut Converter<'a>,
        f: impl FnOnce(&mut Converter<'a>, T) -> Result<Step<'a, U>> + 'a,
    ) -> Result<Step<'a, U>> {
        match self {
            Step::Done(value) => f(converter, value),
            Step::Wait(reads, then) => Ok(Step::Wait(
                reads,
                Box::new(move |converter, values| then(converter, values)?.and_then(converter, f)),
            )),
        }
    }
}

/// The steps of `items` (each made by `f`, in order) joined into one, whose rounds read
/// what every unfinished one reads; done with their values in order. A step made or
/// continued with an error drops the steps after it and is the error once the steps
/// before it are done (see the module's documentation).
pub(super) fn all<'a, I, T: 'a>(
    converter: &mut Converter<'a>,
    items: impl IntoIterator<Item = I>,
    mut f: impl FnMut(&mut Converter<'a>, I) -> Result<Step<'a, T>>,
) -> Result<Step<'a, Vec<T>>> {
    let mut steps = Vec::new();
    let mut failed = None;
    for item in items {
        match f(converter, item) {
            Ok(step) => steps.push(step),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    joined(steps, failed)
}

/// [`all`] of steps made: done when every one is, the error once the steps before it are.
fn joined<'a, T: 'a>(steps: Vec<Step<'a, T>>, failed: Option<Error>) -> Result<Step<'a, Vec<T>>> {
    let reads: Vec<Read> = steps
        .iter()
        .flat_map(|step| match step {
            Step::Done(_) => &[][..],
            Step::Wait(reads, _) => &reads[..],
        })
        .copied()
        .collect();
    if !steps.iter().any(|step| matches!(step, Step::Wait(..))) {
        if let Some(e) = failed {
            return Err(e);
        }
        let done = steps.into_iter().map(|step| match step {
            Step::Done(value) => value,
            Step::Wait(..) => unreachable!("every step is done"),
        });
        return Ok(Step::Done(done.collect()));
    }
    Ok(Step::read(reads, move |converter, values| {
        let mut failed = failed;
        let mut next = Vec::with_capacity(steps.len());
        let mut at = 0;
        for step in steps {
            match step {
                Step::Done(value) => next.push(Step::Done(value)),
                Step::Wait(reads, then) => {
                    let mine = &values[at..at + reads.len()];
                    at += reads.len();
                    match then(converter, mine) {
                        Ok(step) => next.push(step),
                        Err(e) => {
                            // before every step left: it is the first error
                            failed = Some(e);
                            break;
                        }
                    }
                }
            }
        }
        joined(next, failed)
    }))
}

impl<'a> Converter<'a> {
    /// Runs `step` to its end: reads each round's values back ([`Converter::read_round`])
    /// and continues the step with them.
    pub(super) fn finish<T: 'a>(&mut self, mut step: Step<'a, T>) -> Result<T> {
        loop {
            match step {
                Step::Done(value) => return Ok(value),
                Step::Wait(reads, then) => {
                    let values = self.read_round(&reads)?;
                    step = then(self, &values)?;
                }
            }
        }
    }

    /// Reads `reads` back after the work enqueued so far: the values gathered on the device
    /// into one scratch buffer (one batched copy; none for a single value), copied to the
    /// host in one copy, one host wait.
    pub(super) fn read_round(&mut self, reads: &[Read]) -> Result<Vec<i64>> {
        if reads.is_empty() {
            return Ok(Vec::new());
        }
        let mut host = vec![0u8; 8 * reads.len()];
        // Lives until the copies are done (waited for, or the device synchronized).
        let mut scratch = None;
        let result = (|| {
            if let [read] = reads {
                // SAFETY: the read's address holds `width` bytes of device memory (the
                // batch's buffers in range, or memory this walk wrote); `host` holds 8
                // bytes, not read before the wait below.
                unsafe {
                    self.device.copy_to_host(
                        read.address,
                        host.as_mut_ptr(),
                        read.width as usize,
                    )?
                };
            } else {
                let base = scratch.insert(self.device.allocate(host.len())?).address();
                let copies: Vec<DeviceCopy> = reads
                    .iter()
                    .enumerate()
                    .map(|(i, read)| DeviceCopy {
                        src: read.address,
                        dst: super::at_mut(base, 8 * i as u64),
                        len: read.width as usize,
                    })
                    .collect();
                // Every source holds its `width` bytes of device memory (as above); the
                // destinations are disjoint 8-byte slots of the scratch, which lives until
                // the copies are done; `host` holds as many bytes as the scratch, not read
                // before the wait below.
                // SAFETY: the ranges just described.
                unsafe {
                    self.device.copy_on_device(&copies)?;
                    self.device
                        .copy_to_host(base, host.as_mut_ptr(), host.len())?;
                }
            }
            self.device.record_event()?.wait_host()
        })();
        if let Err(e) = result {
            // A copy may still write `host` or read the scratch: let it finish first.
            let _ = self.device.synchronize();
            return Err(e);
        }
        drop(scratch);
        Ok(reads
            .iter()
            .zip(host.chunks_exact(8))
            .map(|(read, bytes)| {
                if read.width == 4 {
                    i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as i64
                } else {
                    i64::from_le_bytes(bytes.try_into().expect("8 bytes"))
                }
            })
            .collect())
    }
}
