//! Foreign schemas with arbitrary format strings (and names, flags, metadata, children,
//! dictionaries) through the importers: `cpu::import_record_batch`, `cpu::import_array`,
//! `cpu::import_field_array` and the bridge's `DeviceBatch::import_with_ffi_schema`, each
//! with an `ArrowArray` tree generated for the type the schema parses to (or for a
//! guess when it does not parse).
//!
//! Checks: no crash and no panic out of devarrow (a schema that arrow-rs cannot read is a
//! typed error), and the array and the schema are each released exactly once.
#![no_main]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use arbitrary::Unstructured;
use arrow_schema::{DataType, Schema};
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::{cpu, DeviceArray};
use devarrow_bridge::DeviceBatch;
use devarrow_fuzz::tree::{self, rare, Gen};
use devarrow_fuzz::{run, schema, types};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: devarrow_fuzz::init(), |data: &[u8]| {
    run(|| one(&mut Unstructured::new(data)))
});

fn one(u: &mut Unstructured) -> arbitrary::Result<()> {
    let root: Option<&[u8]> = if rare(u, 4)? { None } else { Some(b"+s") };
    let ffi = schema::schema(u, root)?;
    // The harness's own look at the schema (arrow-rs may panic on it: not devarrow's doing
    // here), to generate an array of the right type.
    let parsed: Option<DataType> = catch_unwind(AssertUnwindSafe(|| DataType::try_from(&ffi)))
        .ok()
        .and_then(|r| r.ok());
    let data_type = match parsed {
        Some(dt) => dt,
        None => types::data_type(u, 2)?,
    };
    let spec = tree::node(u, &data_type, None, &mut Gen::default())?;
    let device = tree::device_fields(u)?;
    let which = u.int_in_range(0u8..=3)?;
    let (mut raw, counters) = tree::build(&spec, &device);
    {
        // SAFETY: `raw` was built by the generator, which keeps `try_new`'s contract.
        let array = unsafe { DeviceArray::from_raw(&mut raw) };
        match which {
            0 => drop(array.and_then(|a| cpu::import_record_batch(a, &ffi))),
            1 => drop(array.and_then(|a| cpu::import_array(a, &ffi))),
            2 => drop(array.and_then(|a| cpu::import_field_array(a, &ffi))),
            _ => {
                let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
                drop(array.and_then(|a| DeviceBatch::import_with_ffi_schema(device, a, &ffi)));
            }
        }
    }
    assert_eq!(counters.releases(), 1, "the array is released exactly once");
    // The schema: released by its drop (arrow-rs's FFI_ArrowSchema), exactly once (the
    // root release aborts on a second call).
    drop(ffi);
    let _ = Schema::empty();
    Ok(())
}
