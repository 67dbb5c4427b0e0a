//! The importers on arbitrary `ArrowArray` trees under a generated schema: the CPU
//! importer (`cpu::import_record_batch`, or `cpu::import_array` for a non-struct root)
//! and the bridge (`DeviceBatch::import` on the CPU device, `Transfer::to_host`, and the
//! re-export of the imported batch read back by the CPU importer).
//!
//! Checks: no crash, no read outside a buffer (AddressSanitizer), typed errors, every
//! array released exactly once, and the CPU importer and the bridge agree whenever both
//! accept the array.
#![no_main]

use std::sync::Arc;

use arbitrary::Unstructured;
use arrow_array::RecordBatch;
use arrow_schema::{DataType, Field, Schema};
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::{cpu, DeviceArray};
use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_fuzz::tree::{self, rare, Gen};
use devarrow_fuzz::{run, touch, touch_batch, types};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: devarrow_fuzz::init(), |data: &[u8]| {
    run(|| one(&mut Unstructured::new(data)))
});

fn one(u: &mut Unstructured) -> arbitrary::Result<()> {
    let record_batch = !rare(u, 5)?;
    if record_batch {
        let fields = types::fields(u, 3, 3)?;
        let schema = Schema::new(fields.clone());
        let spec = tree::node(u, &DataType::Struct(fields), None, &mut Gen::default())?;
        let device = tree::device_fields(u)?;
        let options = TransferOptions::default()
            .with_staging_bytes(1 << u.int_in_range(7..=20)?)
            .with_chunk_bytes(1 << u.int_in_range(6..=16)?)
            .with_first_chunk_bytes(if rare(u, 2)? {
                0
            } else {
                1 << u.int_in_range(6..=12)?
            })
            .with_pack_threads(1);
        check_record_batch(&schema, &spec, &device, options);
    } else {
        let data_type = types::data_type(u, 3)?;
        let spec = tree::node(u, &data_type, None, &mut Gen::default())?;
        let device = tree::device_fields(u)?;
        let field = Field::new("x", data_type, true);
        let Ok(ffi) = devarrow_abi::ArrowSchema::try_from(&field) else {
            return Ok(());
        };
        let (mut raw, counters) = tree::build(&spec, &device);
        {
            // SAFETY: `raw` was built by the generator, which keeps `try_new`'s contract.
            let result = unsafe { DeviceArray::from_raw(&mut raw) }
                .and_then(|a| cpu::import_field_array(a, &ffi));
            if let Ok((_, array)) = &result {
                touch(&array.to_data());
            }
        }
        assert_eq!(counters.releases(), 1, "the array is released exactly once");
    }
    Ok(())
}

fn check_record_batch(
    schema: &Schema,
    spec: &tree::NodeSpec,
    device_fields: &tree::DeviceFields,
    options: TransferOptions,
) {
    let Ok(ffi) = devarrow_abi::ArrowSchema::try_from(schema) else {
        return;
    };
    // The CPU importer.
    let (mut raw, cpu_counters) = tree::build(spec, device_fields);
    // SAFETY: `raw` was built by the generator, which keeps `try_new`'s contract.
    let on_cpu: devarrow_abi::Result<RecordBatch> =
        unsafe { DeviceArray::from_raw(&mut raw) }.and_then(|a| cpu::import_record_batch(a, &ffi));
    if let Ok(batch) = &on_cpu {
        touch_batch(batch);
    }

    // The bridge on the CPU device.
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let (mut raw, bridge_counters) = tree::build(spec, device_fields);
    // SAFETY: as above.
    let imported = unsafe { DeviceArray::from_raw(&mut raw) }
        .and_then(|a| DeviceBatch::import(device.clone(), a, Arc::new(schema.clone())));
    let mut on_host = None;
    if let Ok(batch) = &imported {
        let _ = batch.device_bytes();
        let mut transfer = Transfer::new(device.clone(), options);
        let host = transfer.to_host(batch);
        if let Ok(host) = &host {
            touch_batch(host);
        }
        // The imported batch re-exported as it is, read by the CPU importer.
        let again = batch
            .export()
            .and_then(|(array, schema)| cpu::import_record_batch(array, &schema));
        if let Ok(again) = &again {
            touch_batch(again);
        }
        match (&on_cpu, &again) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "the re-export reads back as the CPU import"),
            (Ok(_), Err(e)) => panic!("the CPU importer accepts the array, not its re-export: {e}"),
            _ => {}
        }
        on_host = Some(host);
    }
    if let (Ok(a), Some(Ok(b))) = (&on_cpu, &on_host) {
        assert_eq!(a, b, "the CPU importer and the bridge agree");
    }
    drop(on_host);
    drop(imported);
    drop(on_cpu);
    assert_eq!(
        cpu_counters.releases(),
        1,
        "the CPU importer releases exactly once"
    );
    assert_eq!(
        bridge_counters.releases(),
        1,
        "the bridge releases exactly once"
    );
}
