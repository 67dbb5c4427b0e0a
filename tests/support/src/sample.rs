//! The "every type" record batch: one column of every Arrow type devarrow exchanges on the
//! CPU, with nulls, extension and field metadata and schema metadata. Shared by the
//! pyarrow interoperability tests and Rust tests.
//!
//! No type is excluded for pyarrow 26: every type below crosses pyarrow's
//! `_export_to_c_device` / `_import_from_c_device` both ways (see
//! `python/test_pyarrow_interop.py`). The one concession is that the empty sample is an
//! empty slice at offset 0, not at the end (see [`sample_data`]). pyarrow itself cannot
//! build month and day-time interval arrays (no type factory, no Python array class), so
//! Python's own every-type batch lacks them; they cross inside this batch.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::builder::{
    BinaryViewBuilder, Int32Builder, ListBuilder, MapBuilder, StringBuilder,
    StringDictionaryBuilder, StringViewBuilder,
};
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::*;
use arrow_buffer::{
    i256, BooleanBuffer, IntervalDayTime, IntervalMonthDayNano, NullBuffer, OffsetBuffer,
    ScalarBuffer,
};
use arrow_data::ArrayData;
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef, UnionFields, UnionMode};
use half::f16;

/// Rows of [`every_type_batch`].
pub const ROWS: usize = 6;

/// The key of the Arrow extension-type name in field metadata.
pub const EXTENSION_NAME_KEY: &str = "ARROW:extension:name";
/// The key of the Arrow extension-type metadata in field metadata.
pub const EXTENSION_METADATA_KEY: &str = "ARROW:extension:metadata";

/// The validity of most columns: rows 1 and 4 are null.
fn validity() -> NullBuffer {
    NullBuffer::from(vec![true, false, true, true, false, true])
}

fn opt<T: Copy>(values: [T; ROWS]) -> Vec<Option<T>> {
    let valid = validity();
    values
        .iter()
        .enumerate()
        .map(|(i, v)| valid.is_valid(i).then_some(*v))
        .collect()
}

fn meta(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Strings of every length class: empty, inline (<= 12 bytes) and out of line (> 12 bytes,
/// so view types need variadic buffers), with non-ASCII text.
const STRINGS: [&str; ROWS] = [
    "",
    "null-slot",
    "short",
    "a string longer than twelve bytes",
    "x",
    "héllo wörld, ünïcode and more than 12 bytes",
];

fn int_columns(cols: &mut Vec<(Field, ArrayRef)>) {
    macro_rules! ints {
        ($($name:literal, $arr:ty, $t:ty, $dt:expr;)*) => {$(
            cols.push((
                Field::new($name, $dt, true),
                Arc::new(<$arr>::from(opt([<$t>::MIN, 0, 1, <$t>::MAX, 7, 42 as $t]))),
            ));
        )*};
    }
    ints!(
        "int8", Int8Array, i8, DataType::Int8;
        "int16", Int16Array, i16, DataType::Int16;
        "int32", Int32Array, i32, DataType::Int32;
        "int64", Int64Array, i64, DataType::Int64;
        "uint8", UInt8Array, u8, DataType::UInt8;
        "uint16", UInt16Array, u16, DataType::UInt16;
        "uint32", UInt32Array, u32, DataType::UInt32;
        "uint64", UInt64Array, u64, DataType::UInt64;
    );
}

fn float_and_decimal_columns(cols: &mut Vec<(Field, ArrayRef)>) {
    let f = [-1.5f32, 0.0, 1.0e-3, f32::INFINITY, 2.0, -65504.0];
    cols.push((
        Field::new("float16", DataType::Float16, true),
        Arc::new(Float16Array::from(opt(f.map(f16::from_f32)))),
    ));
    cols.push((
        Field::new("float32", DataType::Float32, true),
        Arc::new(Float32Array::from(opt(f))),
    ));
    cols.push((
        Field::new("float64", DataType::Float64, false),
        Arc::new(Float64Array::from(vec![
            -1.5,
            f64::MIN_POSITIVE,
            1.0e300,
            f64::NEG_INFINITY,
            0.1,
            -0.0,
        ])),
    ));
    let d = [-123_456_789i64, 0, 1, 999_999_999, -1, 42];
    cols.push((
        Field::new("decimal32", DataType::Decimal32(9, 2), true),
        Arc::new(
            Decimal32Array::from(opt(d.map(|v| v as i32)))
                .with_precision_and_scale(9, 2)
                .unwrap(),
        ),
    ));
    cols.push((
        Field::new("decimal64", DataType::Decimal64(18, 3), true),
        Arc::new(
            Decimal64Array::from(opt(d.map(|v| v * 1_000_000_000)))
                .with_precision_and_scale(18, 3)
                .unwrap(),
        ),
    ));
    cols.push((
        Field::new("decimal128", DataType::Decimal128(38, 10), true),
        Arc::new(
            Decimal128Array::from(opt(d.map(|v| v as i128 * 10i128.pow(25))))
                .with_precision_and_scale(38, 10)
                .unwrap(),
        ),
    ));
    cols.push((
        Field::new("decimal256", DataType::Decimal256(76, 20), true),
        Arc::new(
            Decimal256Array::from(opt(d.map(|v| {
                i256::from_i128(v as i128 * 10i128.pow(27)) * i256::from_i128(10i128.pow(30))
            })))
            .with_precision_and_scale(76, 20)
            .unwrap(),
        ),
    ));
}

fn temporal_columns(cols: &mut Vec<(Field, ArrayRef)>) {
    const DAY_MS: i64 = 86_400_000;
    let days = [-719_162i32, 0, 1, 19_000, 2_932_896, 20_000];
    cols.push((
        Field::new("date32", DataType::Date32, true),
        Arc::new(Date32Array::from(opt(days))),
    ));
    cols.push((
        Field::new("date64", DataType::Date64, true),
        Arc::new(Date64Array::from(opt(days.map(|d| d as i64 * DAY_MS)))),
    ));
    let secs = [0i64, 1, 3_599, 43_200, 86_399, 12_345];
    cols.push((
        Field::new(
            "time32s",
            DataType::Time32(arrow_schema::TimeUnit::Second),
            true,
        ),
        Arc::new(Time32SecondArray::from(opt(secs.map(|s| s as i32)))),
    ));
    cols.push((
        Field::new(
            "time32ms",
            DataType::Time32(arrow_schema::TimeUnit::Millisecond),
            true,
        ),
        Arc::new(Time32MillisecondArray::from(opt(
            secs.map(|s| s as i32 * 1000 + 7)
        ))),
    ));
    cols.push((
        Field::new(
            "time64us",
            DataType::Time64(arrow_schema::TimeUnit::Microsecond),
            true,
        ),
        Arc::new(Time64MicrosecondArray::from(opt(
            secs.map(|s| s * 1_000_000 + 7)
        ))),
    ));
    cols.push((
        Field::new(
            "time64ns",
            DataType::Time64(arrow_schema::TimeUnit::Nanosecond),
            true,
        ),
        Arc::new(Time64NanosecondArray::from(opt(
            secs.map(|s| s * 1_000_000_000 + 7)
        ))),
    ));
    let ts = [-86_400i64, 0, 1, 1_700_000_000, 4_102_444_800, 951_782_400];
    macro_rules! timestamps {
        ($($name:literal, $arr:ty, $mul:expr, $tz:expr;)*) => {$(
            let mut array = <$arr>::from(opt(ts.map(|s| s * $mul + 3)));
            if let Some(tz) = $tz {
                array = array.with_timezone(tz);
            }
            cols.push((
                Field::new($name, array.data_type().clone(), true),
                Arc::new(array),
            ));
        )*};
    }
    timestamps!(
        "timestamp_s", TimestampSecondArray, 1, None::<&str>;
        "timestamp_ms_utc", TimestampMillisecondArray, 1_000, Some("UTC");
        "timestamp_us_offset", TimestampMicrosecondArray, 1_000_000, Some("+05:30");
        "timestamp_ns_named_tz", TimestampNanosecondArray, 1_000_000_000, Some("America/New_York");
        "timestamp_ns", TimestampNanosecondArray, 1_000_000_000, None::<&str>;
    );
    let durations = [-5i64, 0, 1, i64::MAX / 1_000_000_000, 123, -86_400];
    macro_rules! durations {
        ($($name:literal, $arr:ty;)*) => {$(
            let array = <$arr>::from(opt(durations));
            cols.push((
                Field::new($name, array.data_type().clone(), true),
                Arc::new(array),
            ));
        )*};
    }
    durations!(
        "duration_s", DurationSecondArray;
        "duration_ms", DurationMillisecondArray;
        "duration_us", DurationMicrosecondArray;
        "duration_ns", DurationNanosecondArray;
    );
    cols.push((
        Field::new(
            "interval_year_month",
            DataType::Interval(arrow_schema::IntervalUnit::YearMonth),
            true,
        ),
        Arc::new(IntervalYearMonthArray::from(opt([
            -14, 0, 1, 12, 1_000, 25,
        ]))),
    ));
    cols.push((
        Field::new(
            "interval_day_time",
            DataType::Interval(arrow_schema::IntervalUnit::DayTime),
            true,
        ),
        Arc::new(IntervalDayTimeArray::from(opt([
            IntervalDayTime::new(-1, -500),
            IntervalDayTime::new(0, 0),
            IntervalDayTime::new(1, 1),
            IntervalDayTime::new(365, 86_399_999),
            IntervalDayTime::new(2, 3),
            IntervalDayTime::new(i32::MAX, i32::MIN),
        ]))),
    ));
    cols.push((
        Field::new(
            "interval_month_day_nano",
            DataType::Interval(arrow_schema::IntervalUnit::MonthDayNano),
            true,
        ),
        Arc::new(IntervalMonthDayNanoArray::from(opt([
            IntervalMonthDayNano::new(-1, -2, -3),
            IntervalMonthDayNano::new(0, 0, 0),
            IntervalMonthDayNano::new(1, 2, 3),
            IntervalMonthDayNano::new(12, 31, 86_400_000_000_000),
            IntervalMonthDayNano::new(4, 5, 6),
            IntervalMonthDayNano::new(i32::MIN, i32::MAX, i64::MAX),
        ]))),
    ));
}

fn binary_columns(cols: &mut Vec<(Field, ArrayRef)>) {
    let strings = opt(STRINGS);
    let bytes: Vec<Option<&[u8]>> = strings.iter().map(|s| s.map(str::as_bytes)).collect();
    cols.push((
        Field::new("binary", DataType::Binary, true),
        Arc::new(BinaryArray::from(bytes.clone())),
    ));
    cols.push((
        Field::new("large_binary", DataType::LargeBinary, true),
        Arc::new(LargeBinaryArray::from(bytes.clone())),
    ));
    // Field metadata, and an extension type pyarrow does not know (kept as metadata).
    cols.push((
        Field::new("utf8", DataType::Utf8, true).with_metadata(meta(&[
            ("comment", "plain field metadata"),
            (EXTENSION_NAME_KEY, "devarrow.custom"),
            (EXTENSION_METADATA_KEY, "{\"version\":1}"),
        ])),
        Arc::new(StringArray::from(strings.clone())),
    ));
    cols.push((
        Field::new("large_utf8", DataType::LargeUtf8, true),
        Arc::new(LargeStringArray::from(strings.clone())),
    ));
    // Small blocks so the out-of-line strings spread over several variadic buffers.
    let mut builder = BinaryViewBuilder::new().with_fixed_block_size(40);
    for b in &bytes {
        builder.append_option(*b);
    }
    cols.push((
        Field::new("binary_view", DataType::BinaryView, true),
        Arc::new(builder.finish()),
    ));
    let mut builder = StringViewBuilder::new().with_fixed_block_size(40);
    for s in &strings {
        builder.append_option(*s);
    }
    let utf8_view = builder.finish();
    assert!(
        utf8_view.data_buffers().len() >= 2,
        "several variadic buffers"
    );
    cols.push((
        Field::new("utf8_view", DataType::Utf8View, true),
        Arc::new(utf8_view),
    ));
    cols.push((
        Field::new("fixed_size_binary", DataType::FixedSizeBinary(3), true),
        Arc::new(
            FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                opt([*b"abc", *b"def", [0, 1, 2], [255; 3], *b"xyz", *b"123"]).into_iter(),
                3,
            )
            .unwrap(),
        ),
    ));
    // The canonical extension type arrow.uuid (pyarrow imports it as pa.uuid()).
    let uuids: Vec<Option<[u8; 16]>> =
        opt([[0u8; 16], [1; 16], [0xab; 16], [0xff; 16], [2; 16], {
            let mut u = [0u8; 16];
            for (i, b) in u.iter_mut().enumerate() {
                *b = i as u8 * 17;
            }
            u
        }]);
    cols.push((
        Field::new("uuid", DataType::FixedSizeBinary(16), true).with_metadata(meta(&[
            (EXTENSION_NAME_KEY, "arrow.uuid"),
            (EXTENSION_METADATA_KEY, ""),
        ])),
        Arc::new(
            FixedSizeBinaryArray::try_from_sparse_iter_with_size(uuids.into_iter(), 16).unwrap(),
        ),
    ));
}

fn nested_columns(cols: &mut Vec<(Field, ArrayRef)>) {
    let int_item = Arc::new(Field::new("item", DataType::Int32, true));
    let str_item = Arc::new(Field::new("item", DataType::Utf8, true));
    // list<int32>: [[1, 2], null, [], [3, null, 4], null, [5]]
    cols.push((
        Field::new("list", DataType::List(int_item.clone()), true),
        Arc::new(ListArray::new(
            int_item.clone(),
            OffsetBuffer::new(ScalarBuffer::from(vec![0, 2, 2, 2, 5, 5, 6])),
            Arc::new(Int32Array::from(vec![
                Some(1),
                Some(2),
                Some(3),
                None,
                Some(4),
                Some(5),
            ])),
            Some(validity()),
        )),
    ));
    // large_list<utf8>
    cols.push((
        Field::new("large_list", DataType::LargeList(str_item.clone()), true),
        Arc::new(LargeListArray::new(
            str_item.clone(),
            OffsetBuffer::new(ScalarBuffer::from(vec![0i64, 1, 1, 3, 3, 3, 6])),
            Arc::new(StringArray::from(vec![
                Some("a"),
                Some("bb"),
                None,
                Some("a rather long string value"),
                Some(""),
                Some("z"),
            ])),
            Some(validity()),
        )),
    ));
    // fixed_size_list<int16, 2>
    let fsl_item = Arc::new(Field::new("item", DataType::Int16, true));
    cols.push((
        Field::new(
            "fixed_size_list",
            DataType::FixedSizeList(fsl_item.clone(), 2),
            true,
        ),
        Arc::new(FixedSizeListArray::new(
            fsl_item,
            2,
            Arc::new(Int16Array::from(vec![
                Some(1),
                Some(2),
                Some(0),
                Some(0),
                None,
                Some(4),
                Some(5),
                Some(6),
                Some(0),
                Some(0),
                Some(-7),
                None,
            ])),
            Some(validity()),
        )),
    ));
    // list_view<int32>: out-of-order and overlapping views.
    cols.push((
        Field::new("list_view", DataType::ListView(int_item.clone()), true),
        Arc::new(ListViewArray::new(
            int_item.clone(),
            ScalarBuffer::from(vec![3, 0, 0, 1, 0, 4]),
            ScalarBuffer::from(vec![2, 0, 0, 3, 0, 1]),
            Arc::new(Int32Array::from(vec![
                Some(10),
                Some(11),
                None,
                Some(13),
                Some(14),
            ])),
            Some(validity()),
        )),
    ));
    cols.push((
        Field::new(
            "large_list_view",
            DataType::LargeListView(str_item.clone()),
            true,
        ),
        Arc::new(LargeListViewArray::new(
            str_item.clone(),
            ScalarBuffer::from(vec![2i64, 0, 0, 0, 0, 1]),
            ScalarBuffer::from(vec![1i64, 0, 3, 2, 0, 2]),
            Arc::new(StringArray::from(vec![
                Some("p"),
                None,
                Some("a view element over twelve bytes"),
            ])),
            Some(validity()),
        )),
    ));
    // struct<a: int32, b: utf8 not null>
    let struct_fields = Fields::from(vec![
        Field::new("a", DataType::Int32, true),
        Field::new("b", DataType::Utf8, false),
    ]);
    cols.push((
        Field::new("struct", DataType::Struct(struct_fields.clone()), true),
        Arc::new(StructArray::new(
            struct_fields,
            vec![
                Arc::new(Int32Array::from(vec![
                    Some(1),
                    None,
                    None,
                    Some(4),
                    Some(5),
                    Some(6),
                ])),
                Arc::new(StringArray::from(vec![
                    "x",
                    "",
                    "z",
                    "w",
                    "",
                    "a longer struct field",
                ])),
            ],
            Some(validity()),
        )),
    ));
    // map<utf8, int32>
    let mut map = MapBuilder::new(None, StringBuilder::new(), Int32Builder::new());
    for (row, entries) in [
        &[("a", Some(1)), ("b", None)][..],
        &[],
        &[],
        &[("k", Some(-1))],
        &[],
        &[("x", Some(7)), ("y", Some(8)), ("zz", None)],
    ]
    .iter()
    .enumerate()
    {
        for (k, v) in entries.iter() {
            map.keys().append_value(k);
            map.values().append_option(*v);
        }
        map.append(validity().is_valid(row)).unwrap();
    }
    let map = map.finish();
    cols.push((
        Field::new("map", map.data_type().clone(), true),
        Arc::new(map),
    ));
    // Unions with non-consecutive type ids.
    let union_fields = UnionFields::try_new(
        vec![5, 7],
        vec![
            Field::new("i", DataType::Int32, true),
            Field::new("s", DataType::Utf8, true),
        ],
    )
    .unwrap();
    cols.push((
        Field::new(
            "sparse_union",
            DataType::Union(union_fields.clone(), UnionMode::Sparse),
            false,
        ),
        Arc::new(
            UnionArray::try_new(
                union_fields.clone(),
                ScalarBuffer::from(vec![5i8, 7, 5, 7, 7, 5]),
                None,
                vec![
                    Arc::new(Int32Array::from(vec![
                        Some(1),
                        None,
                        None,
                        None,
                        None,
                        Some(6),
                    ])),
                    Arc::new(StringArray::from(vec![
                        None,
                        Some("two"),
                        None,
                        None,
                        Some("a sparse union string"),
                        None,
                    ])),
                ],
            )
            .unwrap(),
        ),
    ));
    cols.push((
        Field::new(
            "dense_union",
            DataType::Union(union_fields.clone(), UnionMode::Dense),
            false,
        ),
        Arc::new(
            UnionArray::try_new(
                union_fields,
                ScalarBuffer::from(vec![7i8, 5, 5, 7, 5, 7]),
                Some(ScalarBuffer::from(vec![0i32, 0, 1, 1, 2, 2])),
                vec![
                    Arc::new(Int32Array::from(vec![Some(10), None, Some(30)])),
                    Arc::new(StringArray::from(vec![Some("d"), None, Some("dense!")])),
                ],
            )
            .unwrap(),
        ),
    ));
}

fn dictionary_columns(cols: &mut Vec<(Field, ArrayRef)>) {
    let words = StringArray::from(vec!["red", "green", "a long dictionary word"]);
    let keys = [0u8, 1, 2, 2, 0, 1];
    macro_rules! dicts {
        ($($name:literal, $kt:ty, $t:ty;)*) => {$(
            let array = DictionaryArray::<$kt>::try_new(
                PrimitiveArray::<$kt>::from(opt(keys.map(|k| k as $t))),
                Arc::new(words.clone()),
            )
            .unwrap();
            cols.push((
                Field::new($name, array.data_type().clone(), true),
                Arc::new(array),
            ));
        )*};
    }
    dicts!(
        "dict_int8", Int8Type, i8;
        "dict_uint8", UInt8Type, u8;
        "dict_int16", Int16Type, i16;
        "dict_uint16", UInt16Type, u16;
        "dict_int32", Int32Type, i32;
        "dict_uint32", UInt32Type, u32;
        "dict_int64", Int64Type, i64;
        "dict_uint64", UInt64Type, u64;
    );
    // An ordered dictionary.
    let ordered = DictionaryArray::<Int32Type>::try_new(
        Int32Array::from(vec![2, 1, 0, 0, 1, 2]),
        Arc::new(StringArray::from(vec!["low", "mid", "high"])),
    )
    .unwrap();
    cols.push((
        Field::new("dict_ordered", ordered.data_type().clone(), false).with_dict_is_ordered(true),
        Arc::new(ordered),
    ));
    // Dictionary with nested values: dictionary<int16, list<int64>>.
    let item = Arc::new(Field::new("item", DataType::Int64, true));
    let list_values = ListArray::new(
        item,
        OffsetBuffer::new(ScalarBuffer::from(vec![0, 2, 2, 3])),
        Arc::new(Int64Array::from(vec![Some(1), Some(2), None])),
        Some(NullBuffer::from(vec![true, true, false])),
    );
    let nested = DictionaryArray::<Int16Type>::try_new(
        Int16Array::from(opt([0, 2, 1, 1, 0, 0])),
        Arc::new(list_values),
    )
    .unwrap();
    cols.push((
        Field::new("dict_nested_values", nested.data_type().clone(), true),
        Arc::new(nested),
    ));
    // A dictionary nested inside a list: list<dictionary<int8, utf8>>.
    let mut builder = ListBuilder::new(StringDictionaryBuilder::<Int8Type>::new());
    for (row, words) in [
        &["a", "b"][..],
        &[],
        &["a"],
        &["c", "c", "a dictionary value inside a list"],
        &[],
        &["b"],
    ]
    .iter()
    .enumerate()
    {
        for w in words.iter() {
            builder.values().append_value(w);
        }
        builder.append(validity().is_valid(row));
    }
    let list_of_dict = builder.finish();
    cols.push((
        Field::new("list_of_dict", list_of_dict.data_type().clone(), true),
        Arc::new(list_of_dict),
    ));
}

fn run_end_columns(cols: &mut Vec<(Field, ArrayRef)>) {
    let ree = RunArray::<Int32Type>::try_new(
        &Int32Array::from(vec![2, 3, 6]),
        &StringArray::from(vec![
            Some("run"),
            None,
            Some("a long run-end encoded value"),
        ]),
    )
    .unwrap();
    cols.push((
        Field::new("run_end_encoded", ree.data_type().clone(), true),
        Arc::new(ree),
    ));
    let ree = RunArray::<Int16Type>::try_new(
        &Int16Array::from(vec![1, 4, 5, 6]),
        &Float64Array::from(vec![Some(1.0), Some(-2.5), None, Some(4.0)]),
    )
    .unwrap();
    cols.push((
        Field::new("run_end_encoded_i16", ree.data_type().clone(), true),
        Arc::new(ree),
    ));
    let ree = RunArray::<Int64Type>::try_new(
        &Int64Array::from(vec![3, 6]),
        &Int32Array::from(vec![Some(7), Some(8)]),
    )
    .unwrap();
    cols.push((
        Field::new("run_end_encoded_i64", ree.data_type().clone(), false),
        Arc::new(ree),
    ));
}

/// The schema metadata of [`every_type_batch`].
pub fn schema_metadata() -> HashMap<String, String> {
    meta(&[
        ("producer", "devarrow-interop"),
        ("description", "one column of every type, with nulls"),
    ])
}

/// One column of every Arrow type devarrow exchanges on the CPU, [`ROWS`] rows, with nulls
/// (rows 1 and 4 where the type has a validity bitmap), field metadata (including the
/// canonical extension type `arrow.uuid` and an unregistered `devarrow.custom`) and schema
/// metadata.
pub fn every_type_batch() -> RecordBatch {
    let mut cols: Vec<(Field, ArrayRef)> = vec![(
        Field::new("null", DataType::Null, true),
        Arc::new(NullArray::new(ROWS)),
    )];
    let bools = BooleanArray::new(
        BooleanBuffer::from(vec![true, true, false, true, false, false]),
        Some(validity()),
    );
    cols.push((Field::new("bool", DataType::Boolean, true), Arc::new(bools)));
    int_columns(&mut cols);
    float_and_decimal_columns(&mut cols);
    temporal_columns(&mut cols);
    binary_columns(&mut cols);
    nested_columns(&mut cols);
    dictionary_columns(&mut cols);
    run_end_columns(&mut cols);
    let (fields, arrays): (Vec<Field>, Vec<ArrayRef>) = cols.into_iter().unzip();
    let schema = Schema::new(fields).with_metadata(schema_metadata());
    RecordBatch::try_new(Arc::new(schema), arrays).expect("the every-type batch is valid")
}

/// The schema of [`every_type_batch`].
pub fn every_type_schema() -> SchemaRef {
    every_type_batch().schema()
}

/// [`every_type_batch`] sliced to rows 1..5 (logically: arrow-rs normalizes most arrays'
/// offsets into their buffers; [`sample_data`] keeps them).
pub fn sliced_every_type_batch() -> RecordBatch {
    every_type_batch().slice(1, 4)
}

/// The batches of the sample stream: the whole batch, the sliced batch, and an empty
/// (zero-row) batch.
pub fn sample_batches() -> Vec<RecordBatch> {
    let batch = every_type_batch();
    vec![batch.clone(), batch.slice(1, 4), batch.slice(0, 0)]
}

/// Number of samples ([`sample`], [`sample_data`]).
pub const SAMPLES: i32 = 3;

/// A sample batch by number, as the C functions take it: 0 the whole batch, 1 the sliced
/// batch (rows 1..5), 2 the empty batch.
pub fn sample(which: i32) -> Option<RecordBatch> {
    usize::try_from(which)
        .ok()
        .and_then(|i| sample_batches().into_iter().nth(i))
}

/// Sample `which` as the struct-array data it is exported from. The sliced sample is an
/// `ArrayData` slice of the whole batch, so each column carries a nonzero `offset` into
/// shared buffers across the C interface (a `RecordBatch::slice` would be
/// normalized by arrow-rs to offset 0 for most types).
pub fn sample_data(which: i32) -> Option<ArrayData> {
    let whole = StructArray::from(every_type_batch()).into_data();
    match which {
        0 => Some(whole),
        1 => Some(whole.slice(1, 4)),
        // Not `slice(ROWS, 0)`: pyarrow 26 imports a zero-length view array (Utf8View,
        // BinaryView) with a nonzero offset with a zero-size views buffer and then fails
        // its own validation ("View buffer size (bytes): 0 isn't large enough for length:
        // 0 and offset: 6"), even when pyarrow itself exported it.
        2 => Some(whole.slice(0, 0)),
        _ => None,
    }
}

/// Describes how `actual` differs from `expected`, column by column and row by row, or
/// `None` when they are equal (schema with metadata, and values).
pub fn describe_difference(expected: &RecordBatch, actual: &RecordBatch) -> Option<String> {
    if expected == actual {
        return None;
    }
    let mut out = Vec::new();
    if expected.schema().metadata() != actual.schema().metadata() {
        out.push(format!(
            "schema metadata: expected {:?}, got {:?}",
            expected.schema().metadata(),
            actual.schema().metadata()
        ));
    }
    if expected.num_columns() != actual.num_columns() || expected.num_rows() != actual.num_rows() {
        out.push(format!(
            "shape: expected {} columns x {} rows, got {} x {}",
            expected.num_columns(),
            expected.num_rows(),
            actual.num_columns(),
            actual.num_rows()
        ));
        return Some(out.join("\n"));
    }
    for (i, (ef, af)) in expected
        .schema()
        .fields()
        .iter()
        .zip(actual.schema().fields())
        .enumerate()
    {
        if ef != af {
            out.push(format!("field {i}: expected {ef:?}, got {af:?}"));
        }
        let (e, a) = (expected.column(i), actual.column(i));
        if e.as_ref() != a.as_ref() {
            let rows: Vec<usize> = (0..e.len())
                .filter(|&r| e.slice(r, 1).as_ref() != a.slice(r, 1).as_ref())
                .collect();
            out.push(format!(
                "column {:?}: values differ at rows {rows:?}: expected {e:?}, got {a:?}",
                ef.name()
            ));
        }
    }
    Some(out.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::ffi::FFI_ArrowSchema;

    #[test]
    fn every_type_batch_is_valid() {
        let batch = every_type_batch();
        for c in batch.columns() {
            c.to_data().validate_full().unwrap();
        }
        assert_eq!(batch.num_rows(), ROWS);
        let sliced = sliced_every_type_batch();
        let data = sample_data(1).unwrap();
        assert_eq!(
            data.offset(),
            0,
            "a sliced struct moves its offset to its children"
        );
        for c in data.child_data() {
            let expected = if matches!(c.data_type(), DataType::Struct(_)) {
                0
            } else {
                1
            };
            assert_eq!(c.offset(), expected, "{}", c.data_type());
        }
        assert_eq!(describe_difference(&batch, &batch), None);
        assert!(describe_difference(&batch, &sliced).is_some());
    }

    #[test]
    fn every_type_round_trips_through_devarrow() {
        for which in 0..SAMPLES {
            let batch = sample(which).unwrap();
            let array = devarrow_abi::cpu::export_array_data(&sample_data(which).unwrap());
            let schema = FFI_ArrowSchema::try_from(batch.schema().as_ref()).unwrap();
            let back = devarrow_abi::cpu::import_record_batch(array, &schema).unwrap();
            assert_eq!(describe_difference(&batch, &back), None, "sample {which}");
        }
    }
}
