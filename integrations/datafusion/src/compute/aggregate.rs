//! Partial aggregates: the plan compiled from an `AggregateExec` (mode `Partial`), the
//! group table both devices produce ([`Groups`]), the CPU device's grouping, and the host
//! batch of the aggregate's output schema built from a group table.
//!
//! A group key is [`KEY_WORDS`] u64 words per group expression (a string of at most 12
//! bytes: its 16-byte Arrow view, length then its bytes, zero-padded; a longer one: the
//! view's first 8 bytes, length and first 4 bytes, then a 64-bit hash of all its bytes,
//! its bytes compared with those of its group's first row, [`ComputeError::KeyCollision`]
//! where two differ; a number: its i64 lane, then 0), then one word of null flags (bit
//! k: key k is null). A group's long strings come back with its table
//! ([`Groups::long`]). Each aggregate keeps
//! [`ACC_WORDS`] u64 words per group: `[lo, hi, count]`, where a sum is the 128-bit
//! two's complement `hi:lo` of the sum of its non-null values, a min or max is an i64
//! mapped to an order-preserving u64 (`v ^ 2^63` for max, `!(v ^ 2^63)` for min: the
//! largest mapped value wins, and 0 is the identity), and `count` the rows it saw (its
//! non-null values; every selected row for `count(*)`). Over `Float64` (its lanes its
//! bits), a sum is the double `lo`, added in the order the rows come: on CUDA an atomic
//! add, so equal to DataFusion's up to rounding, as any parallel sum. A `min` or `max` of
//! floats is that of their keys ([`expr::op::MINMAX_KEY`]: `f64::total_cmp`'s order),
//! exact where no NaN or -0.0 occurs. DataFusion's grouped ones depend on the rows' order
//! where they do (it replaces its state where `partial_cmp` is not the wanted order, so
//! a NaN replaces the state and the next value replaces the NaN), which no parallel
//! order reproduces: the key fails on them, and that batch is aggregated on the host.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::builder::StringViewBuilder;
use arrow_array::{
    ArrayRef, Date32Array, Decimal128Array, Float64Array, Int16Array, Int32Array, Int64Array,
    Int8Array, RecordBatch, RecordBatchOptions, UInt64Array,
};
use arrow_schema::{DataType, SchemaRef, TimeUnit};
use datafusion::physical_expr::expressions::{case, is_not_null, lit, CastExpr, Column, Literal};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::aggregates::{AggregateExec, AggregateMode};
use datafusion::physical_plan::ExecutionPlan;

use super::expr::{self, Node};
use super::host::{self, Lanes};
use super::{ComputeError, Unsupported, ACC_WORDS, KEY_WORDS};
use crate::error::BoxError;
use crate::frame::DeviceFrame;

/// Where a group key comes from.
#[derive(Debug, Clone)]
pub(crate) enum KeySource {
    /// A `Utf8View`, `Utf8` or `LargeUtf8` column (index in the input schema, name).
    String { index: usize, name: String },
    /// A numeric expression (integers, dates, decimals).
    Value(Node),
}

/// The aggregate functions on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AggKind {
    Sum,
    Count,
    Avg,
    Min,
    Max,
    /// `bit_and`: kept as the OR of the values' complements (0 the identity, as every
    /// accumulator's), the complement of which is the AND.
    BitAnd,
    BitOr,
    BitXor,
}

/// One aggregate: its function and argument (`None`: every row, `count(*)`).
#[derive(Debug, Clone)]
pub(crate) struct Agg {
    pub kind: AggKind,
    pub arg: Option<Node>,
    pub arg_type: Option<DataType>,
    pub text: String,
}

impl Agg {
    /// Whether it sums `Float64` lanes (their bits) as doubles: a `sum` or `avg` of
    /// floats (the only float aggregates compiled).
    pub(crate) fn is_float(&self) -> bool {
        matches!(self.kind, AggKind::Sum | AggKind::Avg) && self.arg_type == Some(DataType::Float64)
    }
}

/// The compiled partial aggregate.
#[derive(Debug)]
pub(crate) struct Plan {
    pub keys: Vec<(KeySource, DataType)>,
    pub aggs: Vec<Agg>,
    pub output: SchemaRef,
}

impl Plan {
    /// u64 words of a group's key.
    pub(crate) fn key_width(&self) -> usize {
        KEY_WORDS * self.keys.len() + 1
    }
}

/// The group table: `keys` (`key_width` words per group), `accs` (`ACC_WORDS` per
/// aggregate per group), and `long`: per key, none, or per group the bytes of its value
/// where it has more than 12 (its words hold a hash, not the value), else none.
#[derive(Debug, Default)]
pub(crate) struct Groups {
    pub count: usize,
    pub keys: Vec<u64>,
    pub accs: Vec<u64>,
    pub long: Vec<Vec<Vec<u8>>>,
}

const SIGN: u64 = 1 << 63;

/// The order-preserving map of a min or max (see the module).
pub(crate) fn minmax_word(kind: AggKind, v: i64) -> u64 {
    let u = (v as u64) ^ SIGN;
    if kind == AggKind::Min {
        !u
    } else {
        u
    }
}

fn minmax_value(kind: AggKind, w: u64) -> i64 {
    let u = if kind == AggKind::Min { !w } else { w };
    (u ^ SIGN) as i64
}

/// `CASE WHEN filter THEN value END`: an aggregate's argument under its `FILTER`.
fn filtered(
    filter: &Arc<dyn PhysicalExpr>,
    value: Arc<dyn PhysicalExpr>,
    text: &str,
) -> Result<Arc<dyn PhysicalExpr>, Unsupported> {
    case(None, vec![(filter.clone(), value)], None)
        .map_err(|e| Unsupported(format!("`{text}`: its FILTER as a CASE: {e}")))
}

pub(crate) fn compile(aggregate: &AggregateExec) -> Result<Plan, Unsupported> {
    if *aggregate.mode() != AggregateMode::Partial {
        return Err(Unsupported(format!(
            "a {:?} aggregate (the device runs Partial ones)",
            aggregate.mode()
        )));
    }
    let group_by = aggregate.group_expr();
    if group_by.has_grouping_set() || group_by.groups().len() > 1 {
        return Err(Unsupported(
            "GROUPING SETS, CUBE and ROLLUP run on the host".into(),
        ));
    }
    let input = aggregate.input_schema();
    let output = aggregate.schema();
    let mut keys = Vec::new();
    for (e, name) in group_by.expr() {
        let t = e
            .data_type(&input)
            .map_err(|err| Unsupported(format!("the type of group key `{name}`: {err}")))?;
        match &t {
            DataType::Utf8View | DataType::Utf8 | DataType::LargeUtf8 => {
                let Some(column) = e.downcast_ref::<Column>() else {
                    return Err(Unsupported(format!(
                        "group key `{e}`: a string key must be a column"
                    )));
                };
                keys.push((
                    KeySource::String {
                        index: column.index(),
                        name: column.name().to_string(),
                    },
                    t,
                ));
            }
            DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32
            | DataType::Date32
            | DataType::Timestamp(..)
            | DataType::Decimal128(..) => {
                let (node, _) = expr::compile(e, &input)?;
                keys.push((KeySource::Value(node), t));
            }
            other => {
                return Err(Unsupported(format!(
                    "group key `{name}` of type {other} has no device encoding"
                )))
            }
        }
    }
    let mut aggs = Vec::new();
    let mut field = keys.len();
    for (a, filter) in aggregate.aggr_expr().iter().zip(aggregate.filter_expr()) {
        let text = a.name().to_string();
        if a.is_distinct() {
            return Err(Unsupported(format!("`{text}`: DISTINCT runs on the host")));
        }
        if !a.order_bys().is_empty() {
            return Err(Unsupported(format!("`{text}`: ORDER BY runs on the host")));
        }
        let kind = match a.fun().name() {
            "sum" => AggKind::Sum,
            "count" => AggKind::Count,
            "avg" => AggKind::Avg,
            "min" => AggKind::Min,
            "max" => AggKind::Max,
            // Of booleans (lanes 0 and 1): all true is the least, any true the most.
            "bool_and" => AggKind::Min,
            "bool_or" => AggKind::Max,
            "bit_and" => AggKind::BitAnd,
            "bit_or" => AggKind::BitOr,
            "bit_xor" => AggKind::BitXor,
            other => {
                return Err(Unsupported(format!(
                    "aggregate function `{other}` has no device kernel"
                )))
            }
        };
        let args = a.expressions();
        if args.len() != 1 {
            return Err(Unsupported(format!(
                "`{text}` with {} arguments has no device kernel",
                args.len()
            )));
        }
        let arg = &args[0];
        // count(*) is count of a non-null literal: every row (unless a FILTER keeps
        // fewer).
        let every_row = kind == AggKind::Count
            && filter.is_none()
            && arg
                .downcast_ref::<Literal>()
                .is_some_and(|l| !l.value().is_null());
        let (arg, arg_type) = if every_row {
            (None, None)
        } else {
            // DataFusion sums an unsigned value as a UInt64 (`CAST(u AS UInt64)`): of one
            // of up to 32 bits, the cast widens nothing in its zero-extended lanes.
            let widened = arg.downcast_ref::<CastExpr>().filter(|c| {
                kind == AggKind::Sum
                    && c.cast_type() == &DataType::UInt64
                    && c.expr().data_type(&input).is_ok_and(|t| {
                        matches!(t, DataType::UInt8 | DataType::UInt16 | DataType::UInt32)
                    })
            });
            let base = widened.map_or_else(|| arg.clone(), |cast| cast.expr().clone());
            let base = match filter {
                // `agg(x) FILTER (WHERE f)` is `agg(CASE WHEN f THEN x END)`: the rows f
                // does not keep (false or null) give nulls, which none of these
                // aggregates takes in (count counts non-null values; a sum, min, max or
                // average of nothing is null, as of only nulls).
                Some(f) => filtered(f, base, &text)?,
                None => base,
            };
            let (node, t) = match expr::compile(&base, &input) {
                Ok((node, t)) => (
                    node,
                    if widened.is_some() {
                        DataType::UInt64
                    } else {
                        t
                    },
                ),
                // A count reads only its argument's validity: of a value with no lanes
                // (a string, a list), `CASE WHEN x IS NOT NULL THEN 1 END`.
                Err(_) if kind == AggKind::Count => {
                    let valid = is_not_null(base)
                        .and_then(|valid| case(None, vec![(valid, lit(1i64))], None))
                        .map_err(|e| Unsupported(format!("`{text}`: {e}")))?;
                    expr::compile(&valid, &input)?
                }
                Err(e) => return Err(e),
            };
            // A float's min or max is that of its key (NaN and -0.0 send the batch to
            // the host).
            let node = match (kind, &t) {
                (AggKind::Min | AggKind::Max, DataType::Float64) => expr::minmax_key(node),
                _ => node,
            };
            (Some(node), Some(t))
        };
        let states = if kind == AggKind::Avg { 2 } else { 1 };
        let fields = &output.fields()[field.min(output.fields().len())..];
        if fields.len() < states {
            return Err(Unsupported(format!(
                "`{text}`: the output schema has not its state fields"
            )));
        }
        let state = |i: usize| fields[i].data_type();
        let ok = match (kind, &arg_type) {
            (AggKind::Count, _) => state(0) == &DataType::Int64,
            (AggKind::Sum, Some(DataType::Decimal128(_, s))) => {
                matches!(state(0), DataType::Decimal128(_, ss) if *ss == *s)
            }
            (
                AggKind::Sum,
                Some(DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64),
            ) => state(0) == &DataType::Int64,
            // Unsigned values (zero-extended lanes) sum to a UInt64.
            (AggKind::Sum, Some(DataType::UInt64)) => state(0) == &DataType::UInt64,
            (AggKind::Avg, Some(DataType::Decimal128(_, s))) => {
                state(0) == &DataType::UInt64
                    && matches!(state(1), DataType::Decimal128(_, ss) if *ss == *s)
            }
            (AggKind::Min | AggKind::Max, Some(t)) => {
                matches!(
                    t,
                    DataType::Decimal128(..)
                        | DataType::Int8
                        | DataType::Int16
                        | DataType::Int32
                        | DataType::Int64
                        | DataType::UInt8
                        | DataType::UInt16
                        | DataType::UInt32
                        | DataType::Date32
                        | DataType::Timestamp(..)
                        | DataType::Float64
                        | DataType::Boolean
                ) && state(0) == t
                    // min and max of booleans are DataFusion's too, bool_and and
                    // bool_or only of booleans
                    && (t == &DataType::Boolean || !a.fun().name().starts_with("bool_"))
            }
            (AggKind::Sum, Some(DataType::Float64)) => state(0) == &DataType::Float64,
            // Of integers (a signed one's lanes sign-extended, an unsigned one's
            // zero-extended: AND, OR and XOR keep both so), a state of their type.
            (AggKind::BitAnd | AggKind::BitOr | AggKind::BitXor, Some(t)) => {
                expr::is_integer(t) && state(0) == t
            }
            (AggKind::Avg, Some(DataType::Float64)) => {
                state(0) == &DataType::UInt64 && state(1) == &DataType::Float64
            }
            _ => false,
        };
        if !ok {
            return Err(Unsupported(format!(
                "`{text}` over {} with state {} has no device kernel",
                arg_type.as_ref().map_or("*".to_string(), |t| t.to_string()),
                fields[..states]
                    .iter()
                    .map(|f| f.data_type().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        field += states;
        aggs.push(Agg {
            kind,
            arg,
            arg_type,
            text,
        });
    }
    if field != output.fields().len() {
        return Err(Unsupported(format!(
            "the aggregate's output has {} fields, the device builds {field}",
            output.fields().len()
        )));
    }
    Ok(Plan { keys, aggs, output })
}

/// The CPU device's group table of `frame`'s selected rows.
pub(crate) fn cpu_groups(plan: &Plan, frame: &DeviceFrame) -> Result<Groups, BoxError> {
    let n = frame.num_rows();
    let selected = host::selection(frame)?;
    let width = plan.key_width();
    // Every row's key, and the values of the string keys.
    let mut keys = vec![0u64; n * width];
    let mut strings: Vec<Option<Vec<Option<&[u8]>>>> = Vec::with_capacity(plan.keys.len());
    for (k, (source, _)) in plan.keys.iter().enumerate() {
        let (words, valid): host::KeyWords = match source {
            KeySource::String { index, name } => {
                let values = host::view_values(host::frame_column(frame, *index, name)?, name)?;
                let words = values
                    .iter()
                    .map(|v| {
                        v.map_or([0; KEY_WORDS], |b| {
                            expr::string_key_lanes(b).map(|w| w as u64)
                        })
                    })
                    .collect();
                let valid = values.iter().map(|v| u8::from(v.is_some())).collect();
                strings.push(Some(values));
                (words, Some(valid))
            }
            KeySource::Value(node) => {
                strings.push(None);
                let Lanes { values, valid } = host::eval(node, frame, "a group key")?;
                (values.iter().map(|&v| [v as u64, 0]).collect(), valid)
            }
        };
        for i in 0..n {
            let row = &mut keys[i * width..(i + 1) * width];
            if valid.as_ref().is_some_and(|v| v[i] == 0) {
                row[width - 1] |= 1 << k;
            } else {
                row[k * KEY_WORDS..(k + 1) * KEY_WORDS].copy_from_slice(&words[i]);
            }
        }
    }
    let args = plan
        .aggs
        .iter()
        .map(|a| {
            a.arg
                .as_ref()
                .map(|node| host::eval(node, frame, &a.text))
                .transpose()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut index: HashMap<&[u64], usize> = HashMap::new();
    let mut groups = Groups::default();
    // Each group's first row.
    let mut first = Vec::new();
    let naggs = plan.aggs.len();
    for i in 0..n {
        if selected[i] == 0 {
            continue;
        }
        let key = &keys[i * width..(i + 1) * width];
        let g = *index.entry(key).or_insert_with(|| {
            groups.keys.extend_from_slice(key);
            groups
                .accs
                .extend(std::iter::repeat_n(0, naggs * ACC_WORDS));
            first.push(i);
            groups.count += 1;
            groups.count - 1
        });
        // Long strings of one group agree in length, prefix and hash: their bytes must
        // (shorter ones are their words).
        for (k, values) in strings.iter().enumerate() {
            let Some(values) = values else { continue };
            let long = values[i].is_some_and(|b| b.len() > 12);
            if long && values[i] != values[first[g]] {
                return Err(collision(plan, k));
            }
        }
        for (a, (agg, arg)) in plan.aggs.iter().zip(&args).enumerate() {
            let acc = &mut groups.accs[(g * naggs + a) * ACC_WORDS..][..ACC_WORDS];
            let v = match arg {
                None => None,
                Some(lanes) if !lanes.is_valid(i) => continue,
                Some(lanes) => Some(lanes.values[i]),
            };
            acc[2] += 1;
            let Some(v) = v else { continue };
            let float = agg.is_float();
            match agg.kind {
                AggKind::Count => {}
                AggKind::Sum | AggKind::Avg if float => {
                    acc[0] = (f64::from_bits(acc[0]) + f64::from_bits(v as u64)).to_bits();
                }
                AggKind::Sum | AggKind::Avg => {
                    let sum = ((acc[1] as u128) << 64 | acc[0] as u128) as i128;
                    let sum = sum.wrapping_add(v as i128) as u128;
                    acc[0] = sum as u64;
                    acc[1] = (sum >> 64) as u64;
                }
                AggKind::Min | AggKind::Max => acc[0] = acc[0].max(minmax_word(agg.kind, v)),
                AggKind::BitAnd => acc[0] |= !(v as u64),
                AggKind::BitOr => acc[0] |= v as u64,
                AggKind::BitXor => acc[0] ^= v as u64,
            }
        }
    }
    groups.long = strings
        .iter()
        .map(|values| match values {
            Some(values) if values.iter().any(|v| v.is_some_and(|b| b.len() > 12)) => first
                .iter()
                .map(|&r| {
                    values[r]
                        .filter(|b| b.len() > 12)
                        .unwrap_or_default()
                        .to_vec()
                })
                .collect(),
            _ => Vec::new(),
        })
        .collect();
    Ok(groups)
}

/// The collision of two long strings of key `k` (of a batch the host then aggregates).
pub(crate) fn collision(plan: &Plan, k: usize) -> BoxError {
    let column = match &plan.keys[k].0 {
        KeySource::String { name, .. } => name.clone(),
        KeySource::Value(_) => format!("key {k}"),
    };
    ComputeError::KeyCollision { column }.into()
}

fn overflow(what: &str, v: i128, t: &DataType) -> BoxError {
    ComputeError::Overflow(format!("{what}: {v} does not fit {t}")).into()
}

/// The host batch of the aggregate's output schema from a group table (one row per
/// group; one row of empty states for an aggregate without keys and no group).
pub(crate) fn output(plan: &Plan, mut groups: Groups) -> Result<RecordBatch, BoxError> {
    let naggs = plan.aggs.len();
    let width = plan.key_width();
    if plan.keys.is_empty() && groups.count == 0 {
        groups.count = 1;
        groups.keys = vec![0; width];
        groups.accs = vec![0; naggs * ACC_WORDS];
    }
    let n = groups.count;
    let fields = plan.output.fields();
    let mut columns: Vec<ArrayRef> = Vec::with_capacity(fields.len());
    for (k, (_, t)) in plan.keys.iter().enumerate() {
        let null = |g: usize| groups.keys[g * width + width - 1] >> k & 1 == 1;
        let word = |g: usize| groups.keys[g * width + k * KEY_WORDS];
        let string = |g: usize| -> Result<String, BoxError> {
            let mut view = [0u8; 16];
            view[..8].copy_from_slice(&word(g).to_le_bytes());
            view[8..].copy_from_slice(&groups.keys[g * width + k * KEY_WORDS + 1].to_le_bytes());
            let len = u32::from_le_bytes(view[..4].try_into().expect("4 bytes")) as usize;
            let bytes = if len <= 12 {
                view[4..4 + len].to_vec()
            } else {
                // Its words hold a hash: its bytes came back with the table.
                let bytes = groups.long.get(k).and_then(|l| l.get(g));
                match bytes.filter(|b| b.len() == len) {
                    Some(b) => b.clone(),
                    None => {
                        return Err(ComputeError::Input(format!(
                            "group key {k}: no bytes for a value of {len}"
                        ))
                        .into())
                    }
                }
            };
            Ok(String::from_utf8(bytes)
                .map_err(|e| ComputeError::Input(format!("a group key is not UTF-8: {e}")))?)
        };
        let target = fields[k].data_type();
        let array: ArrayRef = match t {
            DataType::Utf8View => {
                let mut b = StringViewBuilder::with_capacity(n);
                for g in 0..n {
                    if null(g) {
                        b.append_null()
                    } else {
                        b.append_value(string(g)?)
                    }
                }
                Arc::new(b.finish())
            }
            DataType::Utf8 => offset_strings::<i32>(n, null, string)?,
            DataType::LargeUtf8 => offset_strings::<i64>(n, null, string)?,
            _ => {
                let lanes: Vec<Option<i64>> =
                    (0..n).map(|g| (!null(g)).then(|| word(g) as i64)).collect();
                values_array(&lanes, t, "a group key")?
            }
        };
        if array.data_type() != target {
            return Err(ComputeError::Input(format!(
                "group key {k} built as {}, the schema says {target}",
                array.data_type()
            ))
            .into());
        }
        columns.push(array);
    }
    let mut field = plan.keys.len();
    for (a, agg) in plan.aggs.iter().enumerate() {
        let acc = |g: usize| &groups.accs[(g * naggs + a) * ACC_WORDS..][..ACC_WORDS];
        let sum = |g: usize| ((acc(g)[1] as u128) << 64 | acc(g)[0] as u128) as i128;
        let count = |g: usize| acc(g)[2];
        match agg.kind {
            AggKind::Count => {
                columns.push(Arc::new(Int64Array::from_iter_values(
                    (0..n).map(|g| count(g) as i64),
                )));
            }
            AggKind::Sum | AggKind::Avg => {
                if agg.kind == AggKind::Avg {
                    // DataFusion's grouped avg state has a null count (as its sum) where a
                    // group saw no value; its ungrouped one a count of 0.
                    let grouped = !plan.keys.is_empty();
                    columns.push(Arc::new(
                        (0..n)
                            .map(|g| (count(g) > 0 || !grouped).then(|| count(g)))
                            .collect::<UInt64Array>(),
                    ));
                    field += 1;
                }
                let t = fields[field].data_type();
                if agg.is_float() {
                    columns.push(Arc::new(Float64Array::from_iter(
                        (0..n).map(|g| (count(g) > 0).then(|| f64::from_bits(acc(g)[0]))),
                    )));
                    field += 1;
                    continue;
                }
                let values: Vec<Option<i128>> =
                    (0..n).map(|g| (count(g) > 0).then(|| sum(g))).collect();
                let array: ArrayRef = match t {
                    DataType::Decimal128(p, s) => {
                        Arc::new(Decimal128Array::from(values).with_precision_and_scale(*p, *s)?)
                    }
                    DataType::Int64 => Arc::new(
                        values
                            .iter()
                            .map(|v| {
                                v.map(|v| i64::try_from(v).map_err(|_| overflow(&agg.text, v, t)))
                                    .transpose()
                            })
                            .collect::<Result<Int64Array, _>>()?,
                    ),
                    DataType::UInt64 => Arc::new(
                        values
                            .iter()
                            .map(|v| {
                                v.map(|v| u64::try_from(v).map_err(|_| overflow(&agg.text, v, t)))
                                    .transpose()
                            })
                            .collect::<Result<UInt64Array, _>>()?,
                    ),
                    other => {
                        return Err(ComputeError::Input(format!("a sum state of {other}")).into())
                    }
                };
                columns.push(array);
            }
            AggKind::Min | AggKind::Max if agg.arg_type == Some(DataType::Float64) => {
                // The key back to the float (its own inverse). DataFusion's grouped state
                // starts at f64::MIN (max) or f64::MAX (min), so a group of only -inf
                // (+inf) keeps it; its ungrouped one starts from the values.
                let grouped = !plan.keys.is_empty();
                let float = |g: usize| {
                    let key = minmax_value(agg.kind, acc(g)[0]);
                    let x = f64::from_bits((key ^ ((key >> 63) & i64::MAX)) as u64);
                    match agg.kind {
                        AggKind::Max if grouped => x.max(f64::MIN),
                        AggKind::Min if grouped => x.min(f64::MAX),
                        _ => x,
                    }
                };
                columns.push(Arc::new(Float64Array::from_iter(
                    (0..n).map(|g| (count(g) > 0).then(|| float(g))),
                )));
            }
            AggKind::Min | AggKind::Max => {
                let lanes: Vec<Option<i64>> = (0..n)
                    .map(|g| (count(g) > 0).then(|| minmax_value(agg.kind, acc(g)[0])))
                    .collect();
                columns.push(values_array(&lanes, fields[field].data_type(), &agg.text)?);
            }
            AggKind::BitAnd | AggKind::BitOr | AggKind::BitXor => {
                let lanes: Vec<Option<i64>> = (0..n)
                    .map(|g| {
                        let w = acc(g)[0];
                        let w = if agg.kind == AggKind::BitAnd { !w } else { w };
                        (count(g) > 0).then_some(w as i64)
                    })
                    .collect();
                columns.push(values_array(&lanes, fields[field].data_type(), &agg.text)?);
            }
        }
        field += 1;
    }
    let options = RecordBatchOptions::new().with_row_count(Some(n));
    Ok(RecordBatch::try_new_with_options(
        plan.output.clone(),
        columns,
        &options,
    )?)
}

/// A `Utf8` (`O` = i32) or `LargeUtf8` array of `n` rows: `string(g)`, or null where
/// `null(g)`.
fn offset_strings<O: arrow_array::OffsetSizeTrait>(
    n: usize,
    null: impl Fn(usize) -> bool,
    string: impl Fn(usize) -> Result<String, BoxError>,
) -> Result<ArrayRef, BoxError> {
    let mut b = arrow_array::builder::GenericStringBuilder::<O>::new();
    for g in 0..n {
        if null(g) {
            b.append_null()
        } else {
            b.append_value(string(g)?)
        }
    }
    Ok(Arc::new(b.finish()))
}

/// An array of `t` (integers, unsigned ones of up to 32 bits too, dates, decimals) from
/// lanes.
pub(crate) fn values_array(
    lanes: &[Option<i64>],
    t: &DataType,
    what: &str,
) -> Result<ArrayRef, BoxError> {
    fn narrow<T: TryFrom<i64>>(
        lanes: &[Option<i64>],
        t: &DataType,
        what: &str,
    ) -> Result<Vec<Option<T>>, BoxError> {
        lanes
            .iter()
            .map(|v| {
                v.map(|v| T::try_from(v).map_err(|_| overflow(what, v as i128, t)))
                    .transpose()
            })
            .collect()
    }
    Ok(match t {
        DataType::Decimal128(p, s) => Arc::new(
            Decimal128Array::from(lanes.iter().map(|v| v.map(i128::from)).collect::<Vec<_>>())
                .with_precision_and_scale(*p, *s)?,
        ),
        DataType::Int64 => Arc::new(Int64Array::from(lanes.to_vec())),
        // A Float64's lanes are its bits.
        DataType::Float64 => Arc::new(arrow_array::Float64Array::from(
            lanes
                .iter()
                .map(|v| v.map(|v| f64::from_bits(v as u64)))
                .collect::<Vec<_>>(),
        )),
        DataType::Int32 => Arc::new(Int32Array::from(narrow::<i32>(lanes, t, what)?)),
        DataType::Int16 => Arc::new(Int16Array::from(narrow::<i16>(lanes, t, what)?)),
        DataType::Int8 => Arc::new(Int8Array::from(narrow::<i8>(lanes, t, what)?)),
        DataType::UInt8 => Arc::new(arrow_array::UInt8Array::from(narrow::<u8>(lanes, t, what)?)),
        DataType::UInt16 => Arc::new(arrow_array::UInt16Array::from(narrow::<u16>(
            lanes, t, what,
        )?)),
        DataType::UInt32 => Arc::new(arrow_array::UInt32Array::from(narrow::<u32>(
            lanes, t, what,
        )?)),
        DataType::Date32 => Arc::new(Date32Array::from(narrow::<i32>(lanes, t, what)?)),
        DataType::Timestamp(unit, tz) => {
            use arrow_array::{
                TimestampMicrosecondArray, TimestampMillisecondArray, TimestampNanosecondArray,
                TimestampSecondArray,
            };
            let values = lanes.to_vec();
            match unit {
                TimeUnit::Second => {
                    Arc::new(TimestampSecondArray::from(values).with_timezone_opt(tz.clone()))
                }
                TimeUnit::Millisecond => {
                    Arc::new(TimestampMillisecondArray::from(values).with_timezone_opt(tz.clone()))
                }
                TimeUnit::Microsecond => {
                    Arc::new(TimestampMicrosecondArray::from(values).with_timezone_opt(tz.clone()))
                }
                TimeUnit::Nanosecond => {
                    Arc::new(TimestampNanosecondArray::from(values).with_timezone_opt(tz.clone()))
                }
            }
        }
        DataType::Duration(unit) => {
            use arrow_array::{
                DurationMicrosecondArray, DurationMillisecondArray, DurationNanosecondArray,
                DurationSecondArray,
            };
            let values = lanes.to_vec();
            match unit {
                TimeUnit::Second => Arc::new(DurationSecondArray::from(values)),
                TimeUnit::Millisecond => Arc::new(DurationMillisecondArray::from(values)),
                TimeUnit::Microsecond => Arc::new(DurationMicrosecondArray::from(values)),
                TimeUnit::Nanosecond => Arc::new(DurationNanosecondArray::from(values)),
            }
        }
        DataType::Boolean => Arc::new(arrow_array::BooleanArray::from(
            lanes.iter().map(|v| v.map(|v| v != 0)).collect::<Vec<_>>(),
        )),
        other => return Err(ComputeError::Input(format!("{what}: no array of {other}")).into()),
    })
}
