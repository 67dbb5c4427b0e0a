//! The libcudf export (`ExportOptions::for_libcudf`) checked on any device: a batch of
//! every type the dialect converts, exported, imported back, downloaded; the arrays must
//! pass arrow-rs's `validate_full`, have libcudf's types, and hold the input's values.

use std::sync::Arc;

use arrow_array::builder::{BinaryViewBuilder, StringViewBuilder};
use arrow_array::types::UInt8Type;
use arrow_array::{
    Array, ArrayRef, BooleanArray, Decimal32Array, Decimal64Array, DictionaryArray,
    FixedSizeListArray, Float64Array, Int32Array, Int64Array, LargeListArray, LargeListViewArray,
    ListArray, ListViewArray, MapArray, RecordBatch, StringArray, StructArray,
};
use arrow_buffer::{NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use arrow_schema::{DataType, Field, Fields};
use devarrow_abi::device::Device;
use devarrow_abi::ffi::ArrowArray;
use devarrow_bridge::{DeviceBatch, ExportOptions, Transfer, TransferOptions};

/// Strings of every kind: inline (≤ 12 bytes), long (several data buffers), empty, null.
fn strings(n: usize) -> Vec<Option<String>> {
    (0..n)
        .map(|i| match i % 5 {
            0 => None,
            1 => Some(String::new()),
            2 => Some(format!("s{i}")),
            _ => Some(format!("a string longer than twelve bytes, number {i}")),
        })
        .collect()
}

fn string_views(n: usize) -> ArrayRef {
    let mut b = StringViewBuilder::new().with_fixed_block_size(64);
    for s in strings(n) {
        b.append_option(s);
    }
    Arc::new(b.finish())
}

/// The batch: every conversion of the dialect, nested ones included, and a column that
/// needs none.
pub fn input(n: usize) -> RecordBatch {
    let mut binary = BinaryViewBuilder::new().with_fixed_block_size(48);
    for s in strings(n) {
        binary.append_option(s.map(|s| s.into_bytes()));
    }
    // list views in order (as arrow-rs makes them from a list)
    let sizes: Vec<i32> = (0..n as i32).map(|i| i % 4).collect();
    let in_order = ListArray::new(
        Arc::new(Field::new("item", DataType::Int32, true)),
        OffsetBuffer::from_lengths(sizes.iter().map(|&s| s as usize)),
        Arc::new(Int32Array::from_iter(
            (0..sizes.iter().sum::<i32>()).map(|v| (v % 7 != 3).then_some(v)),
        )),
        Some(NullBuffer::from_iter((0..n).map(|i| i % 6 != 5))),
    );
    let list_view_in_order = ListViewArray::from(in_order);
    // list views out of order: row i views the values of row n - 1 - i
    let total: i32 = sizes.iter().sum();
    let mut starts = vec![0i32; n];
    let mut at = 0;
    for i in (0..n).rev() {
        starts[i] = at;
        at += sizes[i];
    }
    let child = Arc::new(Int64Array::from_iter(
        (0..total as i64).map(|v| (v % 5 != 0).then_some(v * 3)),
    ));
    let list_view_reversed = ListViewArray::new(
        Arc::new(Field::new("item", DataType::Int64, true)),
        ScalarBuffer::from(starts.clone()),
        ScalarBuffer::from(sizes.clone()),
        child,
        Some(NullBuffer::from_iter((0..n).map(|i| i % 7 != 2))),
    );
    // strings and a struct (fixed-width and view fields) under list views out of order
    let strings_child: ArrayRef =
        Arc::new(StringArray::from_iter((0..total).map(|v| {
            (v % 6 != 1).then(|| format!("value {v} {}", "x".repeat(v as usize % 15)))
        })));
    let list_view_strings = ListViewArray::new(
        Arc::new(Field::new("item", DataType::Utf8, true)),
        ScalarBuffer::from(starts.clone()),
        ScalarBuffer::from(sizes.clone()),
        strings_child,
        Some(NullBuffer::from_iter((0..n).map(|i| i % 5 != 3))),
    );
    let struct_child = StructArray::new(
        Fields::from(vec![
            Field::new("a", DataType::Int16, true),
            Field::new("b", DataType::Utf8View, true),
        ]),
        vec![
            Arc::new(arrow_array::Int16Array::from_iter(
                (0..total).map(|v| (v % 3 != 2).then_some(v as i16)),
            )),
            string_views(total as usize),
        ],
        Some(NullBuffer::from_iter((0..total).map(|v| v % 9 != 4))),
    );
    let list_view_structs = LargeListViewArray::new(
        Arc::new(Field::new("item", struct_child.data_type().clone(), true)),
        ScalarBuffer::from(starts.iter().map(|&s| s as i64).collect::<Vec<_>>()),
        ScalarBuffer::from(sizes.iter().map(|&s| s as i64).collect::<Vec<_>>()),
        Arc::new(struct_child),
        None,
    );
    let bools = Arc::new(BooleanArray::from_iter(
        (0..total).map(|v| (v % 4 != 1).then_some(v % 3 == 0)),
    ));
    let large_list_view_reversed = LargeListViewArray::new(
        Arc::new(Field::new("item", DataType::Boolean, true)),
        ScalarBuffer::from(starts.iter().map(|&s| s as i64).collect::<Vec<_>>()),
        ScalarBuffer::from(sizes.iter().map(|&s| s as i64).collect::<Vec<_>>()),
        bools,
        None,
    );
    let large_list = LargeListArray::new(
        Arc::new(Field::new("item", DataType::Utf8View, true)),
        OffsetBuffer::from_lengths(sizes.iter().map(|&s| s as usize)),
        string_views(total as usize),
        None,
    );
    let fixed = FixedSizeListArray::new(
        Arc::new(Field::new("item", DataType::Float64, true)),
        3,
        Arc::new(Float64Array::from_iter(
            (0..3 * n).map(|v| (v % 4 != 0).then_some(v as f64 / 2.0)),
        )),
        Some(NullBuffer::from_iter((0..n).map(|i| i % 3 != 1))),
    );
    let keys: ArrayRef = Arc::new(StringArray::from_iter_values(
        (0..total).map(|v| format!("k{v}")),
    ));
    let values: ArrayRef = Arc::new(Int64Array::from_iter(
        (0..total as i64).map(|v| (v % 3 != 0).then_some(v)),
    ));
    let entries = StructArray::new(
        Fields::from(vec![
            Field::new("keys", DataType::Utf8, false),
            Field::new("values", DataType::Int64, true),
        ]),
        vec![keys, values],
        None,
    );
    let map = MapArray::new(
        Arc::new(Field::new("entries", entries.data_type().clone(), false)),
        OffsetBuffer::from_lengths(sizes.iter().map(|&s| s as usize)),
        entries,
        None,
        false,
    );
    let d32 =
        Decimal32Array::from_iter((0..n as i32).map(|v| (v % 4 != 2).then_some(v * 1001 - 50_000)))
            .with_precision_and_scale(9, 2)
            .unwrap();
    let d64 = Decimal64Array::from_iter(
        (0..n as i64).map(|v| (v % 4 != 3).then_some(v * 100_000_007 - 1)),
    )
    .with_precision_and_scale(18, 4)
    .unwrap();
    let dict = DictionaryArray::<UInt8Type>::new(
        (0..n)
            .map(|i| (i % 9 != 4).then_some((i % 6) as u8))
            .collect(),
        string_views(6),
    );
    let st = StructArray::new(
        Fields::from(vec![
            Field::new("name", DataType::Utf8View, true),
            Field::new("n", DataType::Int32, true),
        ]),
        vec![
            string_views(n),
            Arc::new(Int32Array::from_iter((0..n as i32).map(Some))),
        ],
        Some(NullBuffer::from_iter((0..n).map(|i| i % 8 != 7))),
    );
    RecordBatch::try_from_iter([
        ("utf8_view", string_views(n)),
        ("binary_view", Arc::new(binary.finish()) as ArrayRef),
        ("list_view", Arc::new(list_view_in_order) as ArrayRef),
        (
            "list_view_reversed",
            Arc::new(list_view_reversed) as ArrayRef,
        ),
        (
            "large_list_view_reversed",
            Arc::new(large_list_view_reversed) as ArrayRef,
        ),
        ("list_view_strings", Arc::new(list_view_strings) as ArrayRef),
        ("list_view_structs", Arc::new(list_view_structs) as ArrayRef),
        ("large_list", Arc::new(large_list) as ArrayRef),
        ("fixed_size_list", Arc::new(fixed) as ArrayRef),
        ("map", Arc::new(map) as ArrayRef),
        ("decimal32", Arc::new(d32) as ArrayRef),
        ("decimal64", Arc::new(d64) as ArrayRef),
        ("dictionary", Arc::new(dict) as ArrayRef),
        ("struct", Arc::new(st) as ArrayRef),
        (
            "int64",
            Arc::new(Int64Array::from_iter(
                (0..n as i64).map(|v| (v % 2 == 0).then_some(v)),
            )) as ArrayRef,
        ),
    ])
    .unwrap()
}

/// The types the columns of [`input`] have after the conversions (binary views kept as
/// binary: the round trip turns off the refusal of what libcudf would refuse).
pub fn expected_types(batch: &RecordBatch) -> Vec<DataType> {
    let field = |name: &str, dt: DataType| Arc::new(Field::new(name, dt, true));
    let s = batch.schema();
    let map_entries = match s.field_with_name("map").unwrap().data_type() {
        DataType::Map(entries, _) => entries.clone(),
        _ => unreachable!(),
    };
    vec![
        DataType::Utf8,
        DataType::Binary,
        DataType::List(field("item", DataType::Int32)),
        DataType::List(field("item", DataType::Int64)),
        DataType::List(field("item", DataType::Boolean)),
        DataType::List(field("item", DataType::Utf8)),
        DataType::List(field(
            "item",
            DataType::Struct(Fields::from(vec![
                Field::new("a", DataType::Int16, true),
                Field::new("b", DataType::Utf8, true),
            ])),
        )),
        DataType::List(field("item", DataType::Utf8)),
        DataType::List(field("item", DataType::Float64)),
        DataType::List(map_entries),
        DataType::Decimal128(9, 2),
        DataType::Decimal128(18, 4),
        DataType::Dictionary(Box::new(DataType::Int8), Box::new(DataType::Utf8)),
        DataType::Struct(Fields::from(vec![
            Field::new("name", DataType::Utf8, true),
            Field::new("n", DataType::Int32, true),
        ])),
        DataType::Int64,
    ]
}

/// Each row of `array` as arrow-rs displays it: the logical values, whatever the layout
/// (a view and an offset string, a list view and a list, show alike).
pub fn rows(array: &dyn Array) -> Vec<String> {
    let array = match array.as_any().downcast_ref::<MapArray>() {
        // a map shows as `{k: v}`, the list of structs it becomes as `[{keys: k, ...}]`
        Some(map) => Arc::new(ListArray::new(
            Arc::new(Field::new(
                "entries",
                map.entries().data_type().clone(),
                false,
            )),
            map.offsets().clone(),
            Arc::new(map.entries().clone()),
            map.nulls().cloned(),
        )) as ArrayRef,
        None => arrow_array::make_array(array.to_data()),
    };
    let format =
        ArrayFormatter::try_new(array.as_ref(), &FormatOptions::default().with_null("∅")).unwrap();
    (0..array.len())
        .map(|i| {
            if array.is_null(i) {
                "∅".to_string()
            } else {
                format.value(i).to_string()
            }
        })
        .collect()
}

/// The null counts of an exported tree, depth first.
pub fn null_counts(array: &ArrowArray) -> Vec<i64> {
    let mut out = vec![array.null_count];
    for i in 0..array.n_children as usize {
        // SAFETY: an exported, unreleased array has `n_children` valid child pointers.
        let child = unsafe { &**array.children.add(i) };
        out.extend(null_counts(child));
    }
    out
}

/// The libcudf options of the round trip: every conversion, decimals widened too; binary
/// kept (libcudf would refuse it, checked separately).
pub fn options() -> ExportOptions {
    let mut options = ExportOptions::for_libcudf().widen_small_decimals(true);
    options.refuse_outside_libcudf = false;
    options
}

/// Exports `on_device` for libcudf, imports the export back on `device`, downloads it,
/// and checks it against `expected` (the batch `on_device` holds).
pub fn check_round_trip(device: &Arc<dyn Device>, on_device: &DeviceBatch, expected: &RecordBatch) {
    let (array, schema) = on_device.export_with(options()).unwrap();
    for (i, count) in null_counts(array.array()).into_iter().enumerate() {
        assert!(
            count >= 0,
            "array {i} of the export has an unknown null count"
        );
    }
    let imported = DeviceBatch::import_with_ffi_schema(device.clone(), array, &schema).unwrap();
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    let back = transfer.to_host(&imported).unwrap();
    assert_eq!(back.num_rows(), expected.num_rows());
    let types = expected_types(expected);
    for (i, field) in expected.schema().fields().iter().enumerate() {
        let got = back.column(i);
        assert_eq!(got.data_type(), &types[i], "column {}", field.name());
        got.to_data()
            .validate_full()
            .unwrap_or_else(|e| panic!("column {}: {e}", field.name()));
        assert_eq!(
            rows(got.as_ref()),
            rows(expected.column(i).as_ref()),
            "column {}",
            field.name()
        );
        assert_eq!(
            got.null_count(),
            expected.column(i).null_count(),
            "column {}",
            field.name()
        );
    }
}

/// The rows of [`input`] the tests use: fewer under Miri (interpreted).
pub const ROWS: usize = if cfg!(miri) { 24 } else { 300 };

/// The round trip of [`input`] on `device`: whole, and slices (only their rows uploaded).
pub fn round_trips(device: &Arc<dyn Device>) {
    let n = ROWS;
    let batch = input(n);
    let mut transfer = Transfer::new(device.clone(), TransferOptions::default());
    for expected in [
        batch.clone(),
        batch.slice(7, n - 9),
        batch.slice(n - 1, 1),
        batch.slice(0, 0),
    ] {
        let on_device = transfer.to_device(&expected).unwrap();
        check_round_trip(device, &on_device, &expected);
    }
}

/// The host waits of the libcudf export of a batch: the conversions read sizes back (a
/// view column's bytes, a list's last offset, a list view's first offset and whether it
/// is in order) once per level of nesting for the whole batch, not once per column.
/// `inner` is the device (wrapped to count the waits).
pub fn check_waits_per_level(inner: Arc<dyn super::CountedDevice>) {
    let device = Arc::new(super::InstrumentedDevice::wrapping(inner));
    let dyn_device: Arc<dyn Device> = device.clone();
    let n = 64;
    let large_list = |n: usize| -> ArrayRef {
        let sizes = (0..n).map(|i| i % 3);
        let values: i64 = (0..n).map(|i| (i % 3) as i64).sum();
        Arc::new(LargeListArray::new(
            Arc::new(Field::new("item", DataType::Int64, true)),
            OffsetBuffer::from_lengths(sizes),
            Arc::new(Int64Array::from_iter_values(0..values)),
            None,
        ))
    };
    let list_view = |n: usize| -> ArrayRef {
        let sizes: Vec<usize> = (0..n).map(|i| i % 4).collect();
        let total: usize = sizes.iter().sum();
        Arc::new(ListViewArray::from(ListArray::new(
            Arc::new(Field::new("item", DataType::Int32, true)),
            OffsetBuffer::from_lengths(sizes),
            Arc::new(Int32Array::from_iter_values(0..total as i32)),
            None,
        )))
    };
    let large_list_of_views = |n: usize| -> ArrayRef {
        let sizes = (0..n).map(|i| i % 3);
        let values = (0..n).map(|i| i % 3).sum();
        Arc::new(LargeListArray::new(
            Arc::new(Field::new("item", DataType::Utf8View, true)),
            OffsetBuffer::from_lengths(sizes),
            string_views(values),
            None,
        ))
    };
    // One level: three view columns and two large lists, each of them reading one size.
    let flat = RecordBatch::try_from_iter([
        ("v1", string_views(n)),
        ("v2", string_views(n)),
        ("l1", large_list(n)),
        ("v3", string_views(n)),
        ("l2", large_list(n)),
        (
            "a",
            Arc::new(Int64Array::from_iter_values(0..n as i64)) as ArrayRef,
        ),
    ])
    .unwrap();
    // Two levels: a list view (its first offset, then its last and whether it is in
    // order) and a large list of views (its last offset, then its child's bytes) beside
    // the columns of one level.
    let mut columns: Vec<(String, ArrayRef)> = flat
        .schema()
        .fields()
        .iter()
        .zip(flat.columns())
        .map(|(f, c)| (f.name().clone(), c.clone()))
        .collect();
    columns.push(("lv".into(), list_view(n)));
    columns.push(("lsv".into(), large_list_of_views(n)));
    let nested = RecordBatch::try_from_iter(columns).unwrap();
    let mut transfer = Transfer::new(dyn_device.clone(), TransferOptions::default());
    for (batch, levels) in [(&flat, 1), (&nested, 2)] {
        let on_device = transfer.to_device(batch).unwrap();
        on_device.event().wait_host().unwrap();
        let before = device.host_waits();
        let (array, schema) = on_device.export_with(options()).unwrap();
        let waits = device.host_waits() - before;
        // (an uploaded batch's null counts are known: none is counted on the device)
        assert_eq!(
            waits,
            levels,
            "{} columns, {levels} level(s) of sizes to read: one wait per level",
            batch.num_columns()
        );
        let imported =
            DeviceBatch::import_with_ffi_schema(dyn_device.clone(), array, &schema).unwrap();
        let back = transfer.to_host(&imported).unwrap();
        for (i, field) in batch.schema().fields().iter().enumerate() {
            assert_eq!(
                rows(back.column(i).as_ref()),
                rows(batch.column(i).as_ref()),
                "column {}",
                field.name()
            );
        }
    }
}
