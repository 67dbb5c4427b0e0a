//! An imported foreign slice moves only its bytes (issue #17), as devarrow's own slices
//! do: a small slice of a large column of every layout (views, lists of strings, maps,
//! fixed-size lists, structs, list views, unions, run-end encoded arrays, dictionaries,
//! nesting of them), with nulls, exported through the C data interface and imported with
//! `DeviceBatch::import_raw` on the CPU device, comes back equal to the slice from
//! `Transfer::to_host`, moving (`Transfer::stats`) at most a little more than
//! `Transfer::to_device` of the same slice, and its producer's release runs exactly once.
//!
//! Slices are exported as arrow-rs exports them (which pushes the cut into the children
//! of structs, fixed-size lists and sparse unions) and cut at the C level (every column's
//! own `offset` and `length` set, children whole, as Arrow C++ exports a slice), and with
//! the root struct carrying the slice.

// Not under Miri: columns of 100 000 rows, each moved several times (minutes per test
// interpreted). The same code paths run under Miri in bridge_bad_input.rs (malformed
// slices, every read-back kind) and c_boundary.rs.
#![cfg(not(miri))]

mod common;

use std::sync::Arc;

use arrow_array::types::{Int16Type, Int32Type, Int64Type, RunEndIndexType};
use arrow_array::{Array, ArrayRef, Float64Array, PrimitiveArray, RecordBatch, RunArray};
use arrow_schema::ffi::FFI_ArrowSchema;
use common::{count_releases, max_read_backs, releases, InstrumentedDevice};
use devarrow_abi::device::{CpuDevice, Device};
use devarrow_abi::{cpu, ArrowDeviceArray, DeviceArray};
use devarrow_bridge::{DeviceBatch, Transfer, TransferOptions};
use devarrow_testing::release::count_schema_releases;
use devarrow_testing::sample::describe_difference;
use devarrow_testing::slices::{self, SLICE_LEN, SLICE_OFFSET};

/// Bytes a download of an imported slice may move, when devarrow's own upload of the
/// slice moves `own`: bitmaps and the buffers under them are cut at byte boundaries (up
/// to 7 more items per buffer), and a bitmap is kept where the slice has no nulls (the
/// planner drops it; the import does not count bits on the device): a few more 64-byte
/// aligned buffers.
fn allowed(own: u64) -> u64 {
    own + own / 4 + 4 * 64
}

/// What moving one exported slice showed.
struct Moved {
    /// `to_host.bytes` of the download of the imported slice.
    moved: u64,
    /// `to_device.bytes` of devarrow's own upload of the slice.
    own: u64,
    /// Read-backs of the import.
    read_backs: u64,
}

/// Imports `exported` (a slice of `expected`) with `import_raw` on an instrumented CPU
/// device, downloads it and checks it against `expected`, the release counts of both
/// structs, and that its re-export holds the array; returns what moved.
fn import_slice(
    what: &str,
    (array, schema): (DeviceArray, FFI_ArrowSchema),
    expected: &RecordBatch,
) -> Moved {
    let device = InstrumentedDevice::new();
    let (array, array_releases) = count_releases(array);
    let mut raw_array = ArrowDeviceArray::empty();
    // SAFETY: `raw_array` is writable.
    unsafe { array.move_into(&mut raw_array) };
    let mut raw_schema = schema;
    // SAFETY: the schema was just exported, unreleased.
    let schema_releases = unsafe { count_schema_releases(&mut raw_schema) };
    // SAFETY: both structs are valid and unreleased, made by the CPU export; the array's
    // buffers are host memory, the CPU device's.
    let imported =
        unsafe { DeviceBatch::import_raw(device.clone(), &mut raw_array, &mut raw_schema) }
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(releases(&schema_releases), 1, "{what}: the schema, at once");
    let read_backs = device.host_copies();
    assert_eq!(
        device.on_device_copies(),
        read_backs,
        "{what}: a gather each"
    );
    assert!(
        read_backs <= max_read_backs(&expected.schema()),
        "{what}: {read_backs} read-backs"
    );
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let back = transfer
        .to_host(&imported)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    for column in back.columns() {
        column.to_data().validate_full().unwrap();
    }
    if let Some(diff) = describe_difference(expected, &back) {
        panic!("{what}: {diff}");
    }
    let moved = transfer.stats().to_host.bytes;
    assert!(
        imported.device_bytes() as u64 <= moved,
        "{what}: device_bytes counts what moves"
    );
    let mut upload = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
    upload.to_device(expected).unwrap();
    let own = upload.stats().to_device.bytes;
    // Moving it again moves the same bytes (the cut was planned once, at import).
    transfer.to_host(&imported).unwrap();
    assert_eq!(transfer.stats().to_host.bytes, 2 * moved, "{what}");
    assert_eq!(
        releases(&array_releases),
        0,
        "{what}: the batch holds the array"
    );
    drop(imported);
    assert_eq!(releases(&array_releases), 1, "{what}: released once");
    Moved {
        moved,
        own,
        read_backs,
    }
}

#[test]
fn a_small_slice_of_every_layout_moves_only_its_bytes() {
    for (name, column) in slices::columns(slices::ROWS) {
        let whole = slices::batch_of(name, column.clone());
        let slice = slices::batch_of(name, column.slice(SLICE_OFFSET, SLICE_LEN));
        let mut whole_bytes = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
        whole_bytes.to_device(&whole).unwrap();
        let whole_bytes = whole_bytes.stats().to_device.bytes;
        for (export, exported) in [
            ("arrow-rs slice", cpu::export_record_batch(&slice).unwrap()),
            (
                "C slice",
                slices::export_c_slice(&whole, SLICE_OFFSET, SLICE_LEN),
            ),
        ] {
            let what = format!("{name} ({export})");
            let Moved { moved, own, .. } = import_slice(&what, exported, &slice);
            assert!(
                moved <= allowed(own),
                "{what}: moved {moved} bytes, the slice is {own}"
            );
            // A 1% slice: far less than the column (dictionaries move whole: theirs is
            // 1 000 words, as large as the slice's keys).
            if !name.starts_with("dictionary") {
                assert!(
                    moved * 20 < whole_bytes,
                    "{what}: moved {moved} bytes of a column of {whole_bytes}"
                );
            }
        }
    }
}

#[test]
fn a_root_struct_carrying_the_slice_moves_only_its_bytes() {
    let columns = slices::columns(slices::ROWS);
    let whole = RecordBatch::try_from_iter(columns).unwrap();
    let slice = whole.slice(SLICE_OFFSET, SLICE_LEN);
    let (array, schema) = cpu::export_record_batch(&whole).unwrap();
    let mut raw = array.into_raw();
    raw.array.offset = SLICE_OFFSET as i64;
    raw.array.length = SLICE_LEN as i64;
    // SAFETY: `raw` came from a DeviceArray; the root's `offset + length` stays inside
    // its columns, which keep all their rows.
    let array = unsafe { DeviceArray::try_new(raw) }.unwrap();
    let Moved { moved, own, .. } = import_slice("root offset", (array, schema), &slice);
    assert!(
        moved <= allowed(own),
        "moved {moved} bytes, the slice is {own}"
    );
}

#[test]
fn nesting_takes_one_read_back_per_level_it_cuts() {
    let columns = slices::columns(10_000);
    let column = |name: &str| {
        let (_, c) = columns.iter().find(|(n, _)| *n == name).unwrap();
        slices::batch_of(name, c.slice(5_003, 100))
    };
    for (name, rounds) in [
        ("int64", 0),
        ("utf8", 1),
        ("list<int32>", 1),
        ("list<utf8>", 2),
        ("map<utf8, int32>", 2),
        ("list<list<utf8>>", 3),
        // the views, once the sizes of its buffers are known
        ("utf8_view", 2),
        ("dense_union<int32, utf8>", 2),
    ] {
        let slice = column(name);
        let Moved { read_backs, .. } =
            import_slice(name, cpu::export_record_batch(&slice).unwrap(), &slice);
        assert_eq!(read_backs, rounds, "{name}");
    }
    // The whole columns: the sizes at their own bounds tell everything, in one read-back
    // (but for the list view, whose views reach only part of its child: its child's
    // offsets there take a second).
    let whole = RecordBatch::try_from_iter(
        columns
            .into_iter()
            .filter(|(name, _)| !name.starts_with("list_view")),
    )
    .unwrap();
    let Moved { read_backs, .. } =
        import_slice("whole", cpu::export_record_batch(&whole).unwrap(), &whole);
    assert_eq!(read_backs, 1);
}

/// Run-end encoded columns of `R` run ends, runs of 1 to 5 rows over `rows` rows.
fn run_end_encoded<R: RunEndIndexType>(rows: usize) -> ArrayRef
where
    R::Native: TryFrom<usize>,
    <R::Native as TryFrom<usize>>::Error: std::fmt::Debug,
{
    let mut ends = Vec::new();
    let mut end = 0;
    while end < rows {
        end = (end + 1 + ends.len() % 5).min(rows);
        ends.push(R::Native::try_from(end).unwrap());
    }
    let values = Float64Array::from_iter((0..ends.len()).map(|r| (r % 4 != 1).then_some(r as f64)));
    Arc::new(RunArray::<R>::try_new(&PrimitiveArray::<R>::from_iter_values(ends), &values).unwrap())
}

#[test]
fn run_end_slices_cover_exactly_their_runs() {
    // Run ends of every width; slices at run boundaries, inside one run, across many,
    // empty, at both ends, and long enough that the search takes several rounds.
    let rows = 30_000;
    for column in [
        run_end_encoded::<Int16Type>(rows),
        run_end_encoded::<Int32Type>(rows),
        run_end_encoded::<Int64Type>(rows),
    ] {
        let whole = slices::batch_of("ree", column.clone());
        for (offset, len) in [
            (0, rows),
            (0, 1),
            (1, 1),
            (3, 3),
            (6, 4),
            (14_999, 1),
            (15_000, 2_000),
            (rows - 1, 1),
            (rows - 7, 7),
            (12_345, 0),
            (rows, 0),
        ] {
            let slice = slices::batch_of("ree", column.slice(offset, len));
            let what = format!("{} at {offset}+{len}", column.data_type());
            for exported in [
                cpu::export_record_batch(&slice).unwrap(),
                slices::export_c_slice(&whole, offset, len),
            ] {
                let Moved { moved, own, .. } = import_slice(&what, exported, &slice);
                assert!(moved <= allowed(own), "{what}: moved {moved}, own {own}");
            }
        }
    }
}

#[test]
fn an_imported_c_slice_uploads_only_its_bytes() {
    // The host side of the same layouts: arrow-rs imports a C slice (parents with
    // offsets over whole children) and devarrow uploads it (the planner cuts it).
    for (name, column) in slices::columns(slices::ROWS) {
        let whole = slices::batch_of(name, column.clone());
        let slice = slices::batch_of(name, column.slice(SLICE_OFFSET, SLICE_LEN));
        let (array, schema) = slices::export_c_slice(&whole, SLICE_OFFSET, SLICE_LEN);
        let (array, count) = count_releases(array);
        let imported = cpu::import_record_batch(array, &schema).unwrap();
        assert_eq!(imported, slice, "{name}");
        let device: Arc<dyn Device> = Arc::new(CpuDevice::new());
        let mut transfer = Transfer::new(device, TransferOptions::default());
        let on_device = transfer.to_device(&imported).unwrap();
        let mut own = Transfer::new(Arc::new(CpuDevice::new()), TransferOptions::default());
        own.to_device(&slice).unwrap();
        let (moved, own) = (
            transfer.stats().to_device.bytes,
            own.stats().to_device.bytes,
        );
        assert!(moved <= allowed(own), "{name}: uploaded {moved}, own {own}");
        assert_eq!(transfer.to_host(&on_device).unwrap(), slice, "{name}");
        drop(imported);
        assert_eq!(releases(&count), 1, "{name}");
    }
}

/// Issue #25: a 1 000-row slice of a 1 000 000-row view column as producers make them
/// (arrow-rs's builders at their default block sizes: about 30 variadic buffers of up to
/// 2 MiB; filtered, taken in a scattered order, concatenated: [`slices::large_view_columns`]),
/// exported through the C data interface and imported, moves about its own bytes, as
/// devarrow's own upload of the slice does: not the whole variadic buffers, nor the
/// whole stretch between the first and the last byte its views reach.
#[test]
fn a_slice_of_a_large_view_column_moves_only_its_bytes() {
    let rows = 1_000_000;
    for (name, column) in slices::large_view_columns(rows) {
        for offset in [0, 500_003, rows - SLICE_LEN] {
            let whole = slices::batch_of(name, column.clone());
            let slice = slices::batch_of(name, column.slice(offset, SLICE_LEN));
            for (export, exported) in [
                ("arrow-rs slice", cpu::export_record_batch(&slice).unwrap()),
                ("C slice", slices::export_c_slice(&whole, offset, SLICE_LEN)),
            ] {
                let what = format!("{name} at {offset} ({export})");
                let Moved { moved, own, .. } = import_slice(&what, exported, &slice);
                assert!(
                    moved <= allowed(own),
                    "{what}: moved {moved} bytes, the slice is {own} ({:.1}x)",
                    moved as f64 / own as f64
                );
            }
        }
    }
}

/// Issue #32, goal 8: a 1,000-row slice at row 500,003 of a 1,000,000-row view column of
/// very many small variadic buffers, exported through arrow-rs's C data interface and
/// imported with `import_with_ffi_schema`, then moved to the host: the link carries (the
/// import's read-backs and the download) at most 4 times the slice's own bytes (its
/// views and the bytes they reference), however many buffers the column has, and the
/// host's array holds only the buffers of those bytes.
#[test]
fn a_slice_of_a_view_column_of_many_blocks_moves_only_its_bytes() {
    let rows = 1_000_000;
    let offset = 500_003;
    let mut failures = Vec::new();
    for (name, column) in slices::many_block_view_columns(rows) {
        let slice = slices::batch_of(&name, column.slice(offset, SLICE_LEN));
        let whole = slices::batch_of(&name, column.clone());
        let logical = slices::logical_view_bytes(slice.column(0).as_ref());
        for (export, (array, schema)) in [
            ("arrow-rs slice", cpu::export_record_batch(&slice).unwrap()),
            ("C slice", slices::export_c_slice(&whole, offset, SLICE_LEN)),
        ] {
            let what = format!(
                "{name} ({} buffers), {export}",
                slices::data_buffers(&*column)
            );
            let device = InstrumentedDevice::new();
            let imported =
                DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
            let read_back = device.bytes_to_host();
            let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
            let back = transfer.to_host(&imported).unwrap();
            back.column(0).to_data().validate_full().unwrap();
            if let Some(diff) = describe_difference(&slice, &back) {
                panic!("{what}: {diff}");
            }
            let moved = device.bytes_to_host();
            assert_eq!(
                moved - read_back,
                transfer.stats().to_host.bytes,
                "{what}: the download"
            );
            let referenced = {
                let views = back.column(0).to_data();
                let views: &[u128] = views.buffers()[0].typed_data();
                let mut used: Vec<u32> = views
                    .iter()
                    .filter(|&&v| (v as u32) > 12)
                    .map(|&v| (v >> 64) as u32)
                    .collect();
                used.sort_unstable();
                used.dedup();
                used.len()
            };
            let held = slices::data_buffers(back.column(0).as_ref());
            let report = format!(
                "{what}: the link carried {moved} bytes ({read_back} read back at import) \
                 for a slice of {logical} ({:.2}x); the host's array holds {held} \
                 buffers, its views use {referenced}",
                moved as f64 / logical as f64
            );
            eprintln!("{report}");
            if moved > 4 * logical + 4096 || held > referenced.max(1) {
                failures.push(report);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Slices of a view column of many small buffers that reach few or none of them: every
/// value inline, every value null, both, empty, the views in reverse buffer order, and
/// the whole column. Each comes back equal, its views read back once and then the sizes
/// of only the buffers they point into (none: no second read-back), and the host's
/// array holds a buffer only where its views point.
#[test]
fn slices_of_many_blocks_that_reach_few_buffers_or_none() {
    use arrow_array::builder::StringViewBuilder;

    let rows = 20_000;
    let mut b = StringViewBuilder::new().with_fixed_block_size(16);
    for i in 0..rows {
        match i {
            10_000..11_000 => b.append_value(format!("s{}", i % 1_000)),
            11_000..12_000 => b.append_null(),
            _ => b.append_option((i % 7 != 3).then(|| slices::varied_text(i))),
        }
    }
    let column: ArrayRef = Arc::new(b.finish());
    let reversed = arrow_select::take::take(
        &column,
        &arrow_array::UInt32Array::from_iter_values((0..rows as u32).rev()),
        None,
    )
    .unwrap();
    assert!(
        slices::data_buffers(&*column) > 10_000,
        "a buffer per value or two"
    );
    // Offsets at multiples of 8: the bitmap's cut adds no earlier row.
    for (what, column, offset, len, read_backs, buffers) in [
        ("inline", &column, 10_000, 1_000, 1, 0),
        ("nulls", &column, 11_000, 1_000, 1, 0),
        ("inline then nulls", &column, 10_504, 1_000, 1, 0),
        ("empty", &column, 5_000, 0, 0, 0),
        ("reversed", &reversed, 3_000, 1_000, 2, 1),
        ("whole", &column, 0, rows, 1, slices::data_buffers(&*column)),
    ] {
        let whole = slices::batch_of("v", column.clone());
        let slice = whole.slice(offset, len);
        for (export, (array, schema)) in [
            ("arrow-rs slice", cpu::export_record_batch(&slice).unwrap()),
            ("C slice", slices::export_c_slice(&whole, offset, len)),
        ] {
            let what = format!("{what} ({export})");
            let device = InstrumentedDevice::new();
            let imported =
                DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
            assert_eq!(device.host_copies(), read_backs, "{what}: read-backs");
            let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
            let back = transfer.to_host(&imported).unwrap();
            back.column(0).to_data().validate_full().unwrap();
            if let Some(diff) = describe_difference(&slice, &back) {
                panic!("{what}: {diff}");
            }
            assert_eq!(
                slices::data_buffers(back.column(0).as_ref()),
                buffers,
                "{what}"
            );
        }
    }
}

/// Issue #32, goal 8, the upload side: `Transfer::to_device` of the same slices from
/// arrow-rs memory (an arrow-rs slice, and arrow-rs's import of a C slice: the column's
/// own offset over all its buffers) moves at most twice the slice's own bytes, into one
/// variadic buffer on the device, however many buffers the column has; and so does a
/// slice that uses most of a column of many small buffers (two thirds of its rows),
/// compacted when its buffers, each placed at 64 bytes with its 8-byte size, would cost
/// more than that.
#[test]
fn the_upload_of_a_slice_of_a_view_column_of_many_blocks_moves_only_its_bytes() {
    let rows = 1_000_000;
    let mut failures = Vec::new();
    let small_columns = slices::many_block_view_columns(3_000);
    for ((name, column), (_, small)) in slices::many_block_view_columns(rows)
        .into_iter()
        .zip(small_columns)
    {
        let whole = slices::batch_of(&name, column.clone());
        let small = slices::batch_of(&name, small);
        for (what, slice, one_buffer) in [
            (
                "arrow-rs slice",
                slices::batch_of(&name, column.slice(500_003, SLICE_LEN)),
                true,
            ),
            (
                "C slice imported by arrow-rs",
                cpu::import_record_batch_with_schema(
                    slices::export_c_slice(&whole, 500_003, SLICE_LEN).0,
                    whole.schema(),
                )
                .unwrap(),
                true,
            ),
            ("2,000 of 3,000 rows", small.slice(1_000, 2_000), false),
        ] {
            let what = format!(
                "{name} ({} buffers), {what}",
                slices::data_buffers(&*column)
            );
            let logical = slices::logical_view_bytes(slice.column(0).as_ref());
            let device = InstrumentedDevice::new();
            let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
            let on_device = transfer.to_device(&slice).unwrap();
            let moved = transfer.stats().to_device.bytes;
            let on_device_buffers = on_device.column(0).unwrap().n_buffers() - 3;
            assert_eq!(transfer.to_host(&on_device).unwrap(), slice, "{what}");
            let report = format!(
                "{what}: uploaded {moved} bytes for a slice of {logical} ({:.2}x) in {} \
                 variadic buffers",
                moved as f64 / logical as f64,
                on_device_buffers
            );
            eprintln!("{report}");
            if moved > 2 * logical + 4096 || (one_buffer && on_device_buffers > 1) {
                failures.push(report);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
