//! Random record batches for property tests: every type the bridge moves (random nulls,
//! nonzero offsets at every level of the tree, nesting, dictionaries, unions, views,
//! run-end encoding), seeded and reproducible.

use std::sync::Arc;

use arrow_array::builder::{BinaryViewBuilder, StringViewBuilder};
use arrow_array::types::{
    ArrowDictionaryKeyType, Int16Type, Int32Type, Int64Type, Int8Type, RunEndIndexType, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{
    make_array, Array, BooleanArray, DictionaryArray, FixedSizeListArray, GenericBinaryArray,
    GenericListArray, GenericListViewArray, GenericStringArray, MapArray, NullArray,
    PrimitiveArray, RecordBatch, RunArray, StructArray, UnionArray,
};
use arrow_buffer::{
    ArrowNativeType, BooleanBuffer, Buffer, NullBuffer, OffsetBuffer, ScalarBuffer,
};
use arrow_data::ArrayData;
use arrow_schema::{
    DataType, Field, FieldRef, Fields, IntervalUnit, Schema, TimeUnit, UnionFields, UnionMode,
};
use rand::rngs::StdRng;
use rand::Rng;

/// Prints the seed of a failing case while the panic unwinds.
#[derive(Debug)]
pub struct SeedReport(pub u64);

impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "property failed for seed {0}; rerun it alone with DEVARROW_SEED={0} \
                 DEVARROW_CASES=1",
                self.0
            );
        }
    }
}

/// The seeds of a property: `cases` of them from a fixed base (or `DEVARROW_SEED`).
pub fn seeds(base: u64, cases: usize) -> impl Iterator<Item = u64> {
    let base = std::env::var("DEVARROW_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(base);
    let cases = std::env::var("DEVARROW_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(cases);
    (0..cases as u64).map(move |i| base.wrapping_add(i))
}

/// Leaf types (no children).
fn leaf_type(rng: &mut StdRng) -> DataType {
    let leaves = [
        DataType::Null,
        DataType::Boolean,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::UInt8,
        DataType::UInt16,
        DataType::UInt32,
        DataType::UInt64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Decimal32(9, 2),
        DataType::Decimal64(18, 4),
        DataType::Decimal128(38, 10),
        DataType::Decimal256(76, 20),
        DataType::Date32,
        DataType::Date64,
        DataType::Time32(TimeUnit::Millisecond),
        DataType::Time64(TimeUnit::Nanosecond),
        DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        DataType::Duration(TimeUnit::Second),
        DataType::Interval(IntervalUnit::YearMonth),
        DataType::Interval(IntervalUnit::DayTime),
        DataType::Interval(IntervalUnit::MonthDayNano),
        DataType::FixedSizeBinary(rng.random_range(1..20)),
        DataType::Utf8,
        DataType::LargeUtf8,
        DataType::Binary,
        DataType::LargeBinary,
        DataType::Utf8View,
        DataType::BinaryView,
    ];
    leaves[rng.random_range(0..leaves.len())].clone()
}

fn item(data_type: DataType) -> FieldRef {
    Arc::new(Field::new("item", data_type, true))
}

fn struct_fields(rng: &mut StdRng, depth: usize) -> Fields {
    (0..rng.random_range(1..4))
        .map(|i| Field::new(format!("f{i}"), random_type(rng, depth), true))
        .collect()
}

const KEY_TYPES: [DataType; 8] = [
    DataType::Int8,
    DataType::Int16,
    DataType::Int32,
    DataType::Int64,
    DataType::UInt8,
    DataType::UInt16,
    DataType::UInt32,
    DataType::UInt64,
];

/// The number of type kinds [`type_of_kind`] knows: leaves, then one per nested kind.
pub const KINDS: usize = 13;

/// A random type of kind `kind` (0: a leaf; 1..KINDS: a nested kind) whose children are
/// at most `depth` levels deep.
pub fn type_of_kind(rng: &mut StdRng, kind: usize, depth: usize) -> DataType {
    let child = |rng: &mut StdRng| random_type(rng, depth.saturating_sub(1));
    match kind {
        1 => DataType::List(item(child(rng))),
        2 => DataType::LargeList(item(child(rng))),
        3 => DataType::ListView(item(child(rng))),
        4 => DataType::LargeListView(item(child(rng))),
        5 => DataType::FixedSizeList(item(child(rng)), rng.random_range(1..4)),
        6 => DataType::Struct(struct_fields(rng, depth.saturating_sub(1))),
        7 => {
            let entries = Fields::from(vec![
                Field::new("keys", DataType::Utf8, false),
                Field::new("values", child(rng), true),
            ]);
            DataType::Map(
                Arc::new(Field::new("entries", DataType::Struct(entries), false)),
                false,
            )
        }
        8 | 9 => {
            let n = rng.random_range(1..4);
            let mut ids: Vec<i8> = Vec::new();
            while ids.len() < n {
                let id = rng.random_range(0..30);
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            let fields: Vec<Field> = (0..n)
                .map(|i| Field::new(format!("u{i}"), child(rng), true))
                .collect();
            let mode = if kind == 8 {
                UnionMode::Sparse
            } else {
                UnionMode::Dense
            };
            DataType::Union(UnionFields::try_new(ids, fields).unwrap(), mode)
        }
        10 => {
            let key = KEY_TYPES[rng.random_range(0..KEY_TYPES.len())].clone();
            // Dictionary values: anything but a dictionary or run-end encoded array.
            let mut values = child(rng);
            while matches!(
                values,
                DataType::Dictionary(_, _) | DataType::RunEndEncoded(_, _) | DataType::Null
            ) {
                values = child(rng);
            }
            DataType::Dictionary(Box::new(key), Box::new(values))
        }
        11 => {
            let ends = [DataType::Int16, DataType::Int32, DataType::Int64];
            let ends = ends[rng.random_range(0..3)].clone();
            let mut values = child(rng);
            while matches!(values, DataType::RunEndEncoded(_, _)) {
                values = child(rng);
            }
            DataType::RunEndEncoded(
                Arc::new(Field::new("run_ends", ends, false)),
                Arc::new(Field::new("values", values, true)),
            )
        }
        12 => {
            // list<struct<...>>, the shape of nested rows.
            DataType::List(item(DataType::Struct(struct_fields(
                rng,
                depth.saturating_sub(2),
            ))))
        }
        _ => leaf_type(rng),
    }
}

/// A random type with nesting at most `depth` deep.
pub fn random_type(rng: &mut StdRng, depth: usize) -> DataType {
    if depth == 0 || rng.random_bool(0.45) {
        leaf_type(rng)
    } else {
        let kind = rng.random_range(1..KINDS);
        type_of_kind(rng, kind, depth)
    }
}

/// Random validity for `len` items: none, or about a third null.
fn random_nulls(rng: &mut StdRng, len: usize) -> Option<NullBuffer> {
    if rng.random_bool(0.4) {
        return None;
    }
    let bits: Vec<bool> = (0..len).map(|_| !rng.random_bool(0.3)).collect();
    Some(NullBuffer::from(bits))
}

fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random()).collect()
}

fn random_string(rng: &mut StdRng) -> String {
    // Sometimes longer than 12 bytes, so views use their variadic buffers.
    let len = if rng.random_bool(0.3) {
        rng.random_range(13..40)
    } else {
        rng.random_range(0..13)
    };
    (0..len)
        .map(|_| char::from(rng.random_range(b'a'..=b'z')))
        .collect()
}

fn random_strings(rng: &mut StdRng, len: usize, nulls: bool) -> Vec<Option<String>> {
    (0..len)
        .map(|_| (!nulls || !rng.random_bool(0.3)).then(|| random_string(rng)))
        .collect()
}

/// Offsets for `len` lists of 0..4 items each.
fn random_lengths(rng: &mut StdRng, len: usize) -> Vec<usize> {
    (0..len).map(|_| rng.random_range(0..4)).collect()
}

/// Random valid array data of `data_type` and `len` items. About half of the time it is
/// a slice of a longer array that keeps its offset (as `ArrayData` does, and the C data
/// interface shows), so nonzero offsets appear at every level of the tree.
fn random_data(rng: &mut StdRng, data_type: &DataType, len: usize) -> ArrayData {
    if rng.random_bool(0.5) {
        let (before, after) = (rng.random_range(0..10), rng.random_range(0..3));
        let whole = exact_data(rng, data_type, before + len + after);
        offset_slice(whole, before, len)
    } else {
        exact_data(rng, data_type, len)
    }
}

/// `data.slice(offset, len)`, except that a struct keeps the offset itself (an
/// `ArrayData` slice moves it to the struct's children).
fn offset_slice(data: ArrayData, offset: usize, len: usize) -> ArrayData {
    if !matches!(data.data_type(), DataType::Struct(_)) {
        return data.slice(offset, len);
    }
    let nulls = data.nulls().map(|n| n.slice(offset, len));
    let offset = data.offset() + offset;
    data.into_builder()
        .offset(offset)
        .len(len)
        .nulls(nulls)
        .build()
        .unwrap()
}

/// `array`'s data with `children` (logically the same as its own, but keeping their
/// offsets) in place of the normalized ones arrow-rs arrays hold.
fn with_children(array: &dyn Array, children: Vec<ArrayData>) -> ArrayData {
    array
        .to_data()
        .into_builder()
        .child_data(children)
        .build()
        .unwrap()
}

fn dictionary<K: ArrowDictionaryKeyType>(
    rng: &mut StdRng,
    len: usize,
    values: ArrayData,
) -> ArrayData {
    let n = values.len();
    let keys: Vec<Option<usize>> = (0..len)
        .map(|_| (n > 0 && !rng.random_bool(0.2)).then(|| rng.random_range(0..n)))
        .collect();
    let keys = PrimitiveArray::<K>::from_iter(
        keys.into_iter()
            .map(|k| k.map(|k| K::Native::from_usize(k).unwrap())),
    );
    let array = DictionaryArray::<K>::try_new(keys, make_array(values.clone())).unwrap();
    with_children(&array, vec![values])
}

fn run_ends<R: RunEndIndexType>(rng: &mut StdRng, len: usize, values: &DataType) -> ArrayData {
    let mut ends = Vec::new();
    let mut at = 0;
    while at < len {
        at = (at + rng.random_range(1..5)).min(len);
        ends.push(R::Native::from_usize(at).unwrap());
    }
    let values = random_data(rng, values, ends.len());
    let ends = PrimitiveArray::<R>::from_iter_values(ends);
    let array = RunArray::<R>::try_new(&ends, make_array(values.clone()).as_ref()).unwrap();
    with_children(&array, vec![ends.into_data(), values])
}

fn exact_data(rng: &mut StdRng, data_type: &DataType, len: usize) -> ArrayData {
    let nulls = random_nulls(rng, len);
    match data_type {
        DataType::Null => NullArray::new(len).into_data(),
        DataType::Boolean => {
            let bits: Vec<bool> = (0..len).map(|_| rng.random()).collect();
            BooleanArray::new(BooleanBuffer::from(bits), nulls).into_data()
        }
        DataType::Utf8 => {
            GenericStringArray::<i32>::from(random_strings(rng, len, true)).into_data()
        }
        DataType::LargeUtf8 => {
            GenericStringArray::<i64>::from(random_strings(rng, len, true)).into_data()
        }
        DataType::Binary | DataType::LargeBinary => {
            let values = random_strings(rng, len, true);
            let values: Vec<Option<&[u8]>> = values
                .iter()
                .map(|v| v.as_deref().map(str::as_bytes))
                .collect();
            if *data_type == DataType::Binary {
                GenericBinaryArray::<i32>::from_opt_vec(values).into_data()
            } else {
                GenericBinaryArray::<i64>::from_opt_vec(values).into_data()
            }
        }
        DataType::Utf8View => {
            let mut b = StringViewBuilder::new().with_fixed_block_size(rng.random_range(16..80));
            for v in random_strings(rng, len, true) {
                b.append_option(v);
            }
            b.finish().into_data()
        }
        DataType::BinaryView => {
            let mut b = BinaryViewBuilder::new().with_fixed_block_size(rng.random_range(16..80));
            for v in random_strings(rng, len, true) {
                b.append_option(v.map(String::into_bytes));
            }
            b.finish().into_data()
        }
        DataType::List(f) | DataType::LargeList(f) => {
            let lengths = random_lengths(rng, len);
            let child = random_data(rng, f.data_type(), lengths.iter().sum());
            let values = make_array(child.clone());
            let offsets = OffsetBuffer::from_lengths(lengths);
            if matches!(data_type, DataType::List(_)) {
                let a = GenericListArray::<i32>::try_new(f.clone(), offsets, values, nulls);
                with_children(&a.unwrap(), vec![child])
            } else {
                let offsets = OffsetBuffer::new(offsets.iter().map(|&o| o as i64).collect());
                let a = GenericListArray::<i64>::try_new(f.clone(), offsets, values, nulls);
                with_children(&a.unwrap(), vec![child])
            }
        }
        DataType::ListView(f) | DataType::LargeListView(f) => {
            let child_len = rng.random_range(0..12);
            let child = random_data(rng, f.data_type(), child_len);
            let values = make_array(child.clone());
            let (mut offsets, mut sizes) = (Vec::new(), Vec::new());
            for _ in 0..len {
                let size = rng.random_range(0..=child_len.min(4));
                offsets.push(rng.random_range(0..=child_len - size));
                sizes.push(size);
            }
            if matches!(data_type, DataType::ListView(_)) {
                let cast = |v: Vec<usize>| ScalarBuffer::from_iter(v.into_iter().map(|x| x as i32));
                let a = GenericListViewArray::<i32>::try_new(
                    f.clone(),
                    cast(offsets),
                    cast(sizes),
                    values,
                    nulls,
                );
                with_children(&a.unwrap(), vec![child])
            } else {
                let cast = |v: Vec<usize>| ScalarBuffer::from_iter(v.into_iter().map(|x| x as i64));
                let a = GenericListViewArray::<i64>::try_new(
                    f.clone(),
                    cast(offsets),
                    cast(sizes),
                    values,
                    nulls,
                );
                with_children(&a.unwrap(), vec![child])
            }
        }
        DataType::FixedSizeList(f, k) => {
            let child = random_data(rng, f.data_type(), len * *k as usize);
            let a = FixedSizeListArray::try_new(f.clone(), *k, make_array(child.clone()), nulls);
            with_children(&a.unwrap(), vec![child])
        }
        DataType::Struct(fields) => {
            let children: Vec<ArrayData> = fields
                .iter()
                .map(|f| random_data(rng, f.data_type(), len))
                .collect();
            let arrays = children.iter().cloned().map(make_array).collect();
            let a = StructArray::try_new(fields.clone(), arrays, nulls).unwrap();
            with_children(&a, children)
        }
        DataType::Map(entries, _) => {
            let DataType::Struct(fields) = entries.data_type() else {
                unreachable!("map entries are a struct")
            };
            let lengths = random_lengths(rng, len);
            let n = lengths.iter().sum();
            let keys = GenericStringArray::<i32>::from(random_strings(rng, n, false));
            let values = random_data(rng, fields[1].data_type(), n);
            let entries_data = with_children(
                &StructArray::try_new(
                    fields.clone(),
                    vec![Arc::new(keys.clone()), make_array(values.clone())],
                    None,
                )
                .unwrap(),
                vec![keys.into_data(), values],
            );
            let a = MapArray::try_new(
                entries.clone(),
                OffsetBuffer::from_lengths(lengths),
                StructArray::from(entries_data.clone()),
                nulls,
                false,
            );
            with_children(&a.unwrap(), vec![entries_data])
        }
        DataType::Union(fields, mode) => {
            let ids: Vec<i8> = fields.iter().map(|(id, _)| id).collect();
            let picks: Vec<usize> = (0..len).map(|_| rng.random_range(0..ids.len())).collect();
            let type_ids: ScalarBuffer<i8> = picks.iter().map(|&i| ids[i]).collect();
            let (children, offsets): (Vec<ArrayData>, _) = match mode {
                UnionMode::Sparse => (
                    fields
                        .iter()
                        .map(|(_, f)| random_data(rng, f.data_type(), len))
                        .collect(),
                    None,
                ),
                UnionMode::Dense => {
                    let lens: Vec<usize> = (0..ids.len())
                        .map(|c| {
                            let used = picks.iter().filter(|&&p| p == c).count();
                            if used > 0 {
                                used + rng.random_range(0..3)
                            } else {
                                rng.random_range(0..2)
                            }
                        })
                        .collect();
                    let offsets: ScalarBuffer<i32> = picks
                        .iter()
                        .map(|&p| rng.random_range(0..lens[p]) as i32)
                        .collect();
                    let children = fields
                        .iter()
                        .zip(&lens)
                        .map(|((_, f), &n)| random_data(rng, f.data_type(), n))
                        .collect();
                    (children, Some(offsets))
                }
            };
            let arrays = children.iter().cloned().map(make_array).collect();
            let a = UnionArray::try_new(fields.clone(), type_ids, offsets, arrays).unwrap();
            with_children(&a, children)
        }
        DataType::Dictionary(key, values) => {
            let n = rng.random_range(1..6);
            let values = random_data(rng, values, n);
            match key.as_ref() {
                DataType::Int8 => dictionary::<Int8Type>(rng, len, values),
                DataType::Int16 => dictionary::<Int16Type>(rng, len, values),
                DataType::Int32 => dictionary::<Int32Type>(rng, len, values),
                DataType::Int64 => dictionary::<Int64Type>(rng, len, values),
                DataType::UInt8 => dictionary::<UInt8Type>(rng, len, values),
                DataType::UInt16 => dictionary::<UInt16Type>(rng, len, values),
                DataType::UInt32 => dictionary::<UInt32Type>(rng, len, values),
                DataType::UInt64 => dictionary::<UInt64Type>(rng, len, values),
                other => unreachable!("key type {other}"),
            }
        }
        DataType::RunEndEncoded(ends, values) => match ends.data_type() {
            DataType::Int16 => run_ends::<Int16Type>(rng, len, values.data_type()),
            DataType::Int32 => run_ends::<Int32Type>(rng, len, values.data_type()),
            _ => run_ends::<Int64Type>(rng, len, values.data_type()),
        },
        dt => {
            // Every other leaf is fixed-width: random bytes are valid values.
            let width = match dt {
                DataType::FixedSizeBinary(n) => *n as usize,
                dt => dt.primitive_width().expect("a fixed-width type"),
            };
            ArrayData::builder(dt.clone())
                .len(len)
                .add_buffer(Buffer::from_vec(random_bytes(rng, len * width)))
                .nulls(nulls)
                .align_buffers(true)
                .build()
                .unwrap()
        }
    }
}

/// A random batch: 1 to 5 columns of random types (nesting up to 3 deep, always with a
/// list of structs), 0 to 30 rows, sometimes sliced.
pub fn random_batch(rng: &mut StdRng) -> Case {
    let mut types: Vec<DataType> = (0..rng.random_range(1..5))
        .map(|_| random_type(rng, 3))
        .collect();
    types.push(type_of_kind(rng, 12, 3));
    batch_of(rng, types)
}

/// A batch, and the struct array data it is exported from (with offsets kept at every
/// level, the root's included).
#[derive(Debug)]
pub struct Case {
    /// The batch.
    pub batch: RecordBatch,
    /// Its struct array data, as exported.
    pub data: ArrayData,
}

/// A batch of random columns of the given types.
pub fn batch_of(rng: &mut StdRng, types: Vec<DataType>) -> Case {
    let rows = rng.random_range(0..30);
    let fields: Fields = types
        .iter()
        .enumerate()
        .map(|(i, t)| Field::new(format!("c{i}"), t.clone(), true))
        .collect();
    let columns: Vec<ArrayData> = types.iter().map(|t| random_data(rng, t, rows)).collect();
    let data = ArrayData::builder(DataType::Struct(fields.clone()))
        .len(rows)
        .child_data(columns)
        .build()
        .unwrap();
    data.validate_full().unwrap();
    let data = if rows > 0 && rng.random_bool(0.5) {
        let offset = rng.random_range(0..rows);
        let len = rng.random_range(0..=rows - offset);
        offset_slice(data, offset, len)
    } else {
        data
    };
    let strukt = StructArray::from(data.clone());
    let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(strukt.len()));
    let batch = RecordBatch::try_new_with_options(
        Arc::new(Schema::new(fields)),
        strukt.columns().to_vec(),
        &options,
    )
    .unwrap();
    Case { batch, data }
}
