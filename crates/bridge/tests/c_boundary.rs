//! One call per crossing of the C boundary: `DeviceBatch::import_raw` takes a producer's
//! (`ArrowDeviceArray*`, `ArrowSchema*`) pair and releases each exactly once on every
//! path; `DeviceBatch::export_to` writes both structs to the consumer's storage, with the
//! root offset normalized on request.

use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, RecordBatch, StringArray};
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::{cpu, ArrowDeviceArray, ArrowSchema, DeviceArray, Error};
use devarrow_bridge::{DeviceBatch, ExportOptions, Transfer, TransferOptions};
use devarrow_testing::release::{count_releases, count_schema_releases, releases};
use devarrow_testing::sample;

fn cpu() -> Arc<dyn Device> {
    Arc::new(CpuDevice::new())
}

fn batch() -> RecordBatch {
    RecordBatch::try_from_iter([
        (
            "i",
            Arc::new(Int32Array::from(vec![Some(1), None, Some(3), Some(4)])) as ArrayRef,
        ),
        (
            "s",
            Arc::new(StringArray::from(vec!["a", "bb", "", "dddd"])) as ArrayRef,
        ),
    ])
    .unwrap()
}

/// A C producer's pair of structs for `batch`, each release counted.
struct CPair {
    array: ArrowDeviceArray,
    schema: ArrowSchema,
    array_releases: Arc<std::sync::atomic::AtomicUsize>,
    schema_releases: Arc<std::sync::atomic::AtomicUsize>,
}

fn c_pair(batch: &RecordBatch) -> CPair {
    let (array, schema) = cpu::export_record_batch(batch).unwrap();
    let (array, array_releases) = count_releases(array);
    let mut pair = CPair {
        array: ArrowDeviceArray::empty(),
        schema,
        array_releases,
        schema_releases: Default::default(),
    };
    // SAFETY: `pair.array` is writable.
    unsafe { array.move_into(&mut pair.array) };
    // SAFETY: the schema was just exported, unreleased.
    pair.schema_releases = unsafe { count_schema_releases(&mut pair.schema) };
    pair
}

#[test]
fn import_raw_takes_both_structs_in_one_call() {
    let expected = batch();
    let mut pair = c_pair(&expected);
    // SAFETY: both structs are valid and unreleased, made by the CPU export.
    let imported =
        unsafe { DeviceBatch::import_raw(cpu(), &mut pair.array, &mut pair.schema) }.unwrap();
    // Both were moved out of the caller's storage.
    assert!(pair.array.array.release.is_none());
    assert!(devarrow_abi::schema_is_released(&pair.schema));
    assert_eq!(
        releases(&pair.schema_releases),
        1,
        "the schema is released at once"
    );
    assert_eq!(
        releases(&pair.array_releases),
        0,
        "the array lives with the batch"
    );
    let back = Transfer::new(cpu(), TransferOptions::default())
        .to_host(&imported)
        .unwrap();
    assert_eq!(back, expected);
    drop(imported);
    assert_eq!(releases(&pair.array_releases), 1);
}

#[test]
fn import_raw_releases_each_struct_exactly_once_on_every_error() {
    // A NULL schema: the array is still taken and released.
    let mut pair = c_pair(&batch());
    // SAFETY: the array is valid; NULL is allowed.
    let err = unsafe { DeviceBatch::import_raw(cpu(), &mut pair.array, std::ptr::null_mut()) }
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NullPointer {
                what: "ArrowSchema"
            }
        ),
        "{err}"
    );
    assert_eq!(releases(&pair.array_releases), 1);
    assert!(pair.array.array.release.is_none());
    drop(pair.schema);
    assert_eq!(releases(&pair.schema_releases), 1);

    // A NULL array: the schema is still taken and released.
    let mut pair = c_pair(&batch());
    // SAFETY: the schema is valid; NULL is allowed.
    let err = unsafe { DeviceBatch::import_raw(cpu(), std::ptr::null_mut(), &mut pair.schema) }
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NullPointer {
                what: "ArrowDeviceArray"
            }
        ),
        "{err}"
    );
    assert_eq!(releases(&pair.schema_releases), 1);
    assert!(devarrow_abi::schema_is_released(&pair.schema));
    // SAFETY: the array is unreleased; taking it back releases it when dropped.
    drop(unsafe { DeviceArray::from_raw(&mut pair.array) }.unwrap());
    assert_eq!(releases(&pair.array_releases), 1);

    // A released array: the schema is released, nothing is released twice.
    let mut pair = c_pair(&batch());
    let mut released = ArrowDeviceArray::empty();
    // SAFETY: a released struct is valid input.
    let err =
        unsafe { DeviceBatch::import_raw(cpu(), &mut released, &mut pair.schema) }.unwrap_err();
    assert!(matches!(err, Error::Released { .. }), "{err}");
    assert_eq!(releases(&pair.schema_releases), 1);
    // SAFETY: as above.
    drop(unsafe { DeviceArray::from_raw(&mut pair.array) }.unwrap());
    assert_eq!(releases(&pair.array_releases), 1);

    // A schema that does not describe the array: both released, once.
    let mut pair = c_pair(&batch());
    let other = RecordBatch::try_from_iter([(
        "only",
        Arc::new(Int32Array::from(vec![1, 2, 3, 4])) as ArrayRef,
    )])
    .unwrap();
    let mut wrong = cpu::export_record_batch(&other).unwrap().1;
    // SAFETY: unreleased, just exported.
    let wrong_releases = unsafe { count_schema_releases(&mut wrong) };
    // SAFETY: both structs are valid and unreleased.
    let err = unsafe { DeviceBatch::import_raw(cpu(), &mut pair.array, &mut wrong) }.unwrap_err();
    assert!(matches!(err, Error::ChildCount { .. }), "{err}");
    assert_eq!(releases(&pair.array_releases), 1);
    assert_eq!(releases(&wrong_releases), 1);
    drop(pair.schema);
    assert_eq!(releases(&pair.schema_releases), 1);
}

#[test]
fn export_to_writes_both_structs_to_the_consumers_storage() {
    let expected = batch();
    let mut transfer = Transfer::new(cpu(), TransferOptions::default());
    let on_device = transfer.to_device(&expected).unwrap();
    let mut array = ArrowDeviceArray::empty();
    let mut schema = ArrowSchema::empty();
    // SAFETY: both destinations are writable.
    unsafe { on_device.export_to(ExportOptions::default(), &mut array, &mut schema) }.unwrap();
    // SAFETY: just written, unreleased.
    let again = unsafe { DeviceBatch::import_raw(cpu(), &mut array, &mut schema) }.unwrap();
    assert_eq!(transfer.to_host(&again).unwrap(), expected);
    // NULL destinations are an error, and nothing is written or leaked.
    // SAFETY: NULL is checked.
    let err =
        unsafe { on_device.export_to(ExportOptions::default(), std::ptr::null_mut(), &mut schema) }
            .unwrap_err();
    assert!(matches!(err, Error::NullPointer { .. }), "{err}");
}

#[test]
fn a_foreign_root_offset_can_be_normalized_on_export() {
    let whole = sample::every_type_batch();
    let n = whole.num_rows();
    let offset = 2;
    let (array, schema) = cpu::export_record_batch(&whole).unwrap();
    let (array, count) = count_releases(array);
    let mut raw = array.into_raw();
    raw.array.offset = offset as i64;
    raw.array.length = (n - offset) as i64;
    // SAFETY: `raw` came from a DeviceArray; `offset + length` stays `n`.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let imported = DeviceBatch::import_with_ffi_schema(cpu(), array, &schema).unwrap();
    let expected = whole.slice(offset, n - offset);

    let (plain, _) = imported.export().unwrap();
    assert_eq!(plain.array().offset, offset as i64, "kept by default");
    drop(plain);

    let options = ExportOptions::default().normalize_root_offset(true);
    let (normalized, schema) = imported.export_with(options).unwrap();
    assert_eq!(normalized.array().offset, 0);
    assert_eq!(normalized.array().length, (n - offset) as i64);
    let back = cpu::import_record_batch(normalized, &schema).unwrap();
    if let Some(diff) = sample::describe_difference(&expected, &back) {
        panic!("{diff}");
    }
    drop(back);
    drop(imported);
    assert_eq!(releases(&count), 1);
}
