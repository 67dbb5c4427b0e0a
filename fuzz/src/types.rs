//! Arrow data types from fuzz input: leaves, and nested types up to a depth (lists of
//! every kind, fixed-size lists, structs, maps, unions, dictionaries, run-end encoded).

use std::sync::Arc;

use arbitrary::{Result, Unstructured};
use arrow_schema::{DataType, Field, Fields, IntervalUnit, TimeUnit, UnionFields, UnionMode};

fn leaf(u: &mut Unstructured) -> Result<DataType> {
    Ok(match u.int_in_range(0u8..=27)? {
        0 => DataType::Null,
        1 => DataType::Boolean,
        2 => DataType::Int8,
        3 => DataType::Int16,
        4 => DataType::Int32,
        5 => DataType::Int64,
        6 => DataType::UInt8,
        7 => DataType::UInt32,
        8 => DataType::UInt64,
        9 => DataType::Float16,
        10 => DataType::Float32,
        11 => DataType::Float64,
        12 => DataType::Date32,
        13 => DataType::Date64,
        14 => DataType::Time32(TimeUnit::Second),
        15 => DataType::Time64(TimeUnit::Microsecond),
        16 => DataType::Timestamp(TimeUnit::Nanosecond, Some("UTC".into())),
        17 => DataType::Duration(TimeUnit::Millisecond),
        18 => DataType::Interval(IntervalUnit::MonthDayNano),
        19 => DataType::Decimal128(10, 2),
        20 => DataType::Decimal256(40, 3),
        21 => DataType::FixedSizeBinary(u.int_in_range(0..=5)?),
        22 => DataType::Utf8,
        23 => DataType::LargeUtf8,
        24 => DataType::Binary,
        25 => DataType::LargeBinary,
        26 => DataType::Utf8View,
        _ => DataType::BinaryView,
    })
}

fn field(u: &mut Unstructured, name: &str, depth: u32) -> Result<Arc<Field>> {
    Ok(Arc::new(Field::new(
        name,
        data_type(u, depth)?,
        u.arbitrary()?,
    )))
}

fn dictionary_key(u: &mut Unstructured) -> Result<DataType> {
    Ok(match u.int_in_range(0u8..=5)? {
        0 => DataType::Int8,
        1 => DataType::Int16,
        2 => DataType::Int32,
        3 => DataType::Int64,
        4 => DataType::UInt8,
        _ => DataType::UInt32,
    })
}

/// A data type; `depth` bounds the nesting (0: a leaf).
pub fn data_type(u: &mut Unstructured, depth: u32) -> Result<DataType> {
    if depth == 0 || u.ratio(1u8, 2)? {
        return leaf(u);
    }
    let d = depth - 1;
    Ok(match u.int_in_range(0u8..=11)? {
        0 => DataType::List(field(u, "item", d)?),
        1 => DataType::LargeList(field(u, "item", d)?),
        2 => DataType::ListView(field(u, "item", d)?),
        3 => DataType::LargeListView(field(u, "item", d)?),
        4 => DataType::FixedSizeList(field(u, "item", d)?, u.int_in_range(0..=3)?),
        5 => DataType::Struct(fields(u, d, 3)?),
        6 => {
            let key = Field::new(
                "key",
                if u.arbitrary()? {
                    DataType::Utf8
                } else {
                    DataType::Int32
                },
                false,
            );
            let value = Field::new("value", data_type(u, d)?, true);
            let entries = Field::new("entries", DataType::Struct(vec![key, value].into()), false);
            DataType::Map(Arc::new(entries), false)
        }
        7 | 8 => {
            let n = u.int_in_range(1..=3)?;
            let mut ids = Vec::new();
            let mut fs = Vec::new();
            for i in 0..n {
                // Distinct type ids, not necessarily 0..n.
                ids.push((i * 3 + u.int_in_range(0..=2)?) as i8);
                fs.push(Field::new(format!("u{i}"), data_type(u, d)?, true));
            }
            let mode = if u.arbitrary()? {
                UnionMode::Sparse
            } else {
                UnionMode::Dense
            };
            match UnionFields::try_new(ids, fs) {
                Ok(f) => DataType::Union(f, mode),
                Err(_) => DataType::Null,
            }
        }
        9 | 10 => DataType::Dictionary(Box::new(dictionary_key(u)?), Box::new(data_type(u, d)?)),
        _ => {
            let run_ends = match u.int_in_range(0u8..=2)? {
                0 => DataType::Int16,
                1 => DataType::Int32,
                _ => DataType::Int64,
            };
            DataType::RunEndEncoded(
                Arc::new(Field::new("run_ends", run_ends, false)),
                Arc::new(Field::new("values", data_type(u, d)?, true)),
            )
        }
    })
}

/// 1 to `max` fields named `f0`, `f1`, ...
pub fn fields(u: &mut Unstructured, depth: u32, max: usize) -> Result<Fields> {
    let n = u.int_in_range(1..=max)?;
    (0..n)
        .map(|i| field(u, &format!("f{i}"), depth))
        .collect::<Result<Vec<_>>>()
        .map(Fields::from)
}
