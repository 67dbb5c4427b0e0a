//! Property tests of the bridge on the CPU device: random record batches of every type
//! (random nulls, slices at every level, nesting, dictionaries, unions, views, run-end
//! encoding) must come back equal, and valid, from
//! - `Transfer::to_device` then `Transfer::to_host`;
//! - `DeviceBatch::export` then `DeviceBatch::import` then `to_host`;
//! - a zero-copy CPU export (offsets kept at every level) then `DeviceBatch::import` then
//!   `to_host`, and the re-export of the imported batch.
//!
//! Seeded and reproducible: a failure prints its seed; rerun one case with
//! `DEVARROW_SEED=<seed> DEVARROW_CASES=1`. `DEVARROW_CASES` sets the number of cases.

// Not under Miri: hundreds of random batches per property: hours under Miri. The
// import_array fuzz target covers the same round trips under AddressSanitizer.
#![cfg(not(miri))]

mod common;

use std::sync::Arc;

use arrow_array::{new_empty_array, Array, RecordBatch, StructArray};
use arrow_schema::{Field, Schema};
use common::random::{batch_of, random_batch, seeds, type_of_kind, Case, SeedReport, KINDS};
use common::{count_releases, max_read_backs, releases, InstrumentedDevice};
use devarrow_abi::cpu;
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_testing::sample::describe_difference;
use rand::rngs::StdRng;
use rand::SeedableRng;

fn assert_same(expected: &RecordBatch, actual: &RecordBatch, what: &str) {
    for column in actual.columns() {
        if let Err(e) = column.to_data().validate_full() {
            panic!("{what}: invalid result column {}: {e}", column.data_type());
        }
    }
    if let Some(diff) = describe_difference(expected, actual) {
        panic!("{what}: {diff}");
    }
}

/// Every way through the bridge, for one batch.
fn check(case: &Case) {
    let batch = &case.batch;
    let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());

    // Host -> device -> host.
    let on_device = transfer.to_device(batch).unwrap();
    assert_same(
        batch,
        &transfer.to_host(&on_device).unwrap(),
        "to_device/to_host",
    );

    // Packed batch -> export -> import -> host.
    let (array, schema) = on_device.export().unwrap();
    drop(on_device);
    let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
    assert_same(
        batch,
        &transfer.to_host(&imported).unwrap(),
        "export/import/to_host",
    );
    drop(imported);

    // Zero-copy CPU export (offsets at every level) -> import -> host; the foreign array
    // is released once, after the last user.
    let counting = InstrumentedDevice::new();
    let (array, count) = count_releases(cpu::export_array_data(&case.data));
    let imported = DeviceBatch::import(counting.clone(), array, batch.schema()).unwrap();
    let reads = counting.host_copies();
    assert!(
        reads <= max_read_backs(&batch.schema()),
        "{reads} read-backs for {:?}",
        batch.schema()
    );
    assert_eq!(
        counting.on_device_copies(),
        reads,
        "one gather per read-back"
    );
    let mut transfer = Transfer::new(counting.clone(), TransferOptions::default());
    assert_same(
        batch,
        &transfer.to_host(&imported).unwrap(),
        "cpu export/import/to_host",
    );
    let (exported, schema) = imported.export().unwrap();
    assert_eq!(exported.array().offset, case.data.offset() as i64);
    drop(imported);
    assert_eq!(releases(&count), 0, "the re-export holds the foreign array");
    let again = cpu::import_record_batch(exported, &schema).unwrap();
    assert_same(batch, &again, "re-export of an imported batch");
    drop(again);
    assert_eq!(releases(&count), 1);
}

#[test]
fn random_batches_round_trip() {
    for seed in seeds(0x5eed_0001, 200) {
        let _report = SeedReport(seed);
        let mut rng = StdRng::seed_from_u64(seed);
        check(&random_batch(&mut rng));
    }
}

#[test]
fn every_type_kind_round_trips() {
    for seed in seeds(0x5eed_1000, 12) {
        let _report = SeedReport(seed);
        for kind in 0..KINDS {
            let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(kind as u64));
            let types = (0..3).map(|_| type_of_kind(&mut rng, kind, 2)).collect();
            check(&batch_of(&mut rng, types));
        }
    }
}

#[test]
fn empty_and_zero_column_batches() {
    let mut rng = StdRng::seed_from_u64(7);
    for kind in 0..KINDS {
        let t = type_of_kind(&mut rng, kind, 2);
        let schema = Arc::new(Schema::new(vec![Field::new("c", t.clone(), true)]));
        let batch = RecordBatch::try_new(schema, vec![new_empty_array(&t)]).unwrap();
        let data = StructArray::from(batch.clone()).into_data();
        check(&Case { batch, data });
    }
    let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(5));
    let batch =
        RecordBatch::try_new_with_options(Arc::new(Schema::empty()), vec![], &options).unwrap();
    let data = StructArray::from(batch.clone()).into_data();
    assert_eq!(data.len(), 5);
    check(&Case { batch, data });
}
