//! The CPU device: columns read in place (the CPU device's memory is host memory) into
//! i64 lanes, the expression tree evaluated node by node with the same arithmetic and
//! overflow rules as the PTX kernels, and group keys encoded as the kernels encode them.

use arrow_schema::DataType;
use devarrow::abi::ArrowDeviceType;
use devarrow::bridge::DeviceColumn;

use super::automaton::Quit;
use super::convert::{civil_from_days, days_from_civil};
use super::expr::{op, string_key, ConcatPart, Joined, Node, OnFail, CHRONO_DAYS};
use super::{ComputeError, KEY_WORDS};
use crate::error::BoxError;
use crate::frame::{DeviceFrame, FrameColumn};

/// Values as i64 lanes and their validity (`None`: all valid; else 1 valid, 0 null).
#[derive(Debug, Clone)]
pub(crate) struct Lanes {
    pub values: Vec<i64>,
    pub valid: Option<Vec<u8>>,
}

impl Lanes {
    pub(crate) fn is_valid(&self, i: usize) -> bool {
        self.valid.as_ref().is_none_or(|v| v[i] != 0)
    }
}

/// The bytes of a buffer of a CPU-device column.
fn cpu_bytes<'a>(buffer: devarrow::bridge::ColumnBuffer<'a>) -> Result<&'a [u8], BoxError> {
    if buffer.device_type() != ArrowDeviceType::CPU {
        return Err(ComputeError::Input(format!(
            "a buffer on {:?} read as host memory",
            buffer.device_type()
        ))
        .into());
    }
    if buffer.is_empty() {
        return Ok(&[]);
    }
    // The buffer is CPU-device memory, which is host memory (checked above), owned by
    // the batch that the buffer borrows for 'a; the caller waited for the batch's event,
    // so its upload has completed and nothing writes it (device batches are immutable).
    // SAFETY: so `len` bytes at its address are initialised and live, unwritten, for 'a.
    Ok(unsafe { std::slice::from_raw_parts(buffer.as_ptr().cast::<u8>(), buffer.len()) })
}

/// The column's validity (1 valid), `None` without a bitmap.
fn validity(column: &DeviceColumn<'_>) -> Result<Option<Vec<u8>>, BoxError> {
    let Some(bitmap) = column.validity() else {
        return Ok(None);
    };
    let bits = cpu_bytes(bitmap)?;
    let (offset, len) = (column.offset(), column.len());
    if (offset + len).div_ceil(8) > bits.len() {
        return Err(ComputeError::Input("a validity bitmap too short".into()).into());
    }
    Ok(Some(
        (0..len)
            .map(|i| (bits[(offset + i) / 8] >> ((offset + i) % 8)) & 1)
            .collect(),
    ))
}

/// The `width`-byte little-endian values of a fixed-width column.
fn fixed<'a>(column: &DeviceColumn<'a>, width: usize) -> Result<&'a [u8], BoxError> {
    let values = column.values().ok_or("a column without a values buffer")?;
    let bytes = cpu_bytes(values)?;
    let (offset, len) = (column.offset(), column.len());
    let (start, end) = (offset * width, (offset + len) * width);
    bytes.get(start..end).ok_or_else(|| {
        ComputeError::Input(format!(
            "a values buffer of {} bytes, {end} needed",
            bytes.len()
        ))
        .into()
    })
}

/// Checks that `column` is on the CPU device and waits for its batch.
fn ready(column: &FrameColumn) -> Result<(), BoxError> {
    if column.device().device_type() != ArrowDeviceType::CPU {
        return Err(ComputeError::Input("a host computation of a non-CPU column".into()).into());
    }
    column.batch().event().wait_host()?;
    Ok(())
}

/// A column as lanes: decimals (whose values must fit 64 bits), integers, dates,
/// booleans and `UInt8` (a selection).
pub(crate) fn load(column: &FrameColumn, name: &str) -> Result<Lanes, BoxError> {
    ready(column)?;
    let c = column.column();
    let valid = validity(&c)?;
    let len = c.len();
    let values: Vec<i64> = match c.data_type() {
        DataType::Decimal128(..) => {
            let bytes = fixed(&c, 16)?;
            let mut out = Vec::with_capacity(len);
            for (i, chunk) in bytes.chunks_exact(16).enumerate() {
                let v = i128::from_le_bytes(chunk.try_into().expect("16 bytes"));
                let valid_row = valid.as_ref().is_none_or(|v| v[i] != 0);
                match i64::try_from(v) {
                    Ok(v) => out.push(v),
                    Err(_) if !valid_row => out.push(0),
                    Err(_) => {
                        return Err(ComputeError::Overflow(format!(
                            "column `{name}` holds {v} (row {i}), beyond the device's 64-bit lanes"
                        ))
                        .into())
                    }
                }
            }
            out
        }
        // A Float64's lanes are its bits (compared through `op::FLOAT_KEY`).
        DataType::Int64 | DataType::Float64 | DataType::Timestamp(..) | DataType::Duration(_) => {
            fixed(&c, 8)?
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect()
        }
        DataType::Int32 | DataType::Date32 => fixed(&c, 4)?
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
            .collect(),
        DataType::Int16 => fixed(&c, 2)?
            .chunks_exact(2)
            .map(|b| i16::from_le_bytes(b.try_into().expect("2 bytes")) as i64)
            .collect(),
        DataType::Int8 => fixed(&c, 1)?.iter().map(|&b| b as i8 as i64).collect(),
        DataType::UInt8 => fixed(&c, 1)?.iter().map(|&b| b as i64).collect(),
        DataType::UInt16 => fixed(&c, 2)?
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes(b.try_into().expect("2 bytes")) as i64)
            .collect(),
        DataType::UInt32 => fixed(&c, 4)?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as i64)
            .collect(),
        DataType::Boolean => {
            let bits = cpu_bytes(c.values().ok_or("a Boolean column without values")?)?;
            let offset = c.offset();
            if (offset + len).div_ceil(8) > bits.len() {
                return Err(ComputeError::Input("a Boolean values buffer too short".into()).into());
            }
            (0..len)
                .map(|i| ((bits[(offset + i) / 8] >> ((offset + i) % 8)) & 1) as i64)
                .collect()
        }
        other => {
            return Err(ComputeError::Input(format!(
                "column `{name}` is {other}, which the device does not compute on"
            ))
            .into())
        }
    };
    Ok(Lanes { values, valid })
}

/// The frame's column for `(index, name)`: by index when the name matches there, else by
/// name.
pub(crate) fn frame_column<'a>(
    frame: &'a DeviceFrame,
    index: usize,
    name: &str,
) -> Result<&'a FrameColumn, BoxError> {
    let by_index = frame
        .schema()
        .fields()
        .get(index)
        .filter(|f| f.name() == name)
        .and_then(|_| frame.column(index));
    by_index
        .or_else(|| frame.column_by_name(name))
        .ok_or_else(|| ComputeError::Input(format!("the frame has no column `{name}`")).into())
}

/// `x * mul` checked against `[lo, hi]`.
pub(crate) fn scaled(x: i64, mul: i64, lo: i64, hi: i64) -> Option<i64> {
    x.checked_mul(mul).filter(|v| (lo..=hi).contains(v))
}

/// One row of a binary operation on valid operands: `Err(())` on overflow.
pub(crate) fn binary_row(
    op: u32,
    a: i64,
    b: i64,
    lmul: i64,
    rmul: i64,
    lo: i64,
    hi: i64,
) -> Result<i64, ()> {
    if matches!(op, op::FADD | op::FSUB | op::FMUL | op::FDIV) {
        let (x, y) = (f64::from_bits(a as u64), f64::from_bits(b as u64));
        let r = match op {
            op::FADD => x + y,
            op::FSUB => x - y,
            op::FMUL => x * y,
            _ => x / y,
        };
        return Ok(r.to_bits() as i64);
    }
    if (op::BIT_AND..=op::SHR).contains(&op) {
        // The width's bits less one, from the largest value (`w - 1` bits).
        let mask = 64 - hi.leading_zeros();
        let extend = 63 - mask;
        return Ok(match op {
            op::BIT_AND => a & b,
            op::BIT_OR => a | b,
            op::BIT_XOR => a ^ b,
            op::SHL => ((a << (b as u32 & mask)) << extend) >> extend,
            _ => a >> (b as u32 & mask),
        });
    }
    if matches!(op, op::USHL | op::USHR) {
        // Zero-extended lanes of width w, `hi` = 2^w - 1: the mask w - 1.
        let mask = 63 - hi.leading_zeros();
        let amount = b as u32 & mask;
        return Ok(match op {
            op::USHL => (a << amount) & hi,
            _ => ((a as u64) >> amount) as i64,
        });
    }
    if matches!(op, op::GCD | op::LCM) {
        let (x, y) = (a.unsigned_abs(), b.unsigned_abs());
        let gcd = {
            let (mut p, mut q) = (x, y);
            while q != 0 {
                (p, q) = (q, p % q);
            }
            p
        };
        let r = match op {
            op::GCD => Some(gcd),
            _ if gcd == 0 => Some(0),
            _ => (x / gcd).checked_mul(y),
        };
        return r.and_then(|r| i64::try_from(r).ok()).ok_or(());
    }
    let a = a.checked_mul(lmul).ok_or(())?;
    let b = b.checked_mul(rmul).ok_or(())?;
    let r = match op {
        op::ADD => a.checked_add(b),
        op::SUB => a.checked_sub(b),
        op::MUL => a.checked_mul(b),
        // Truncated toward zero; None for a zero divisor or i64::MIN / -1.
        op::DIV => a.checked_div(b),
        op::REM => a.checked_rem(b),
        op::EQ => return Ok((a == b) as i64),
        op::NE => return Ok((a != b) as i64),
        op::LT => return Ok((a < b) as i64),
        op::LE => return Ok((a <= b) as i64),
        op::GT => return Ok((a > b) as i64),
        op::GE => return Ok((a >= b) as i64),
        _ => None,
    };
    r.filter(|v| (lo..=hi).contains(v)).ok_or(())
}

/// Each row's answer of a regular expression's `walk` (the default for a null row), or the host's
/// where the automaton gives up on a row ([`Quit`]: a Unicode word boundary by a byte past
/// ASCII), as the kernels leave the batch to the host.
pub(crate) fn regex_rows<T: Default>(
    values: &[Option<&[u8]>],
    text: &str,
    walk: impl Fn(&[u8]) -> Result<T, Quit>,
) -> Result<Vec<T>, ComputeError> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            Some(v) => walk(v).map_err(|Quit| {
                ComputeError::HostOnly(format!(
                    "`{text}`: row {i}'s word boundary by a character past ASCII"
                ))
            }),
            None => Ok(T::default()),
        })
        .collect()
}

/// Evaluates `node` over `frame` (every row) on the host.
pub(crate) fn eval(node: &Node, frame: &DeviceFrame, text: &str) -> Result<Lanes, BoxError> {
    let n = frame.num_rows();
    match node {
        Node::Column { index, name, .. } => load(frame_column(frame, *index, name)?, name),
        Node::StrIn {
            index,
            name,
            words,
            negated,
        } => {
            let (keys, valid) = string_words(frame_column(frame, *index, name)?, name)?;
            Ok(Lanes {
                values: keys
                    .iter()
                    .map(|k| i64::from(words.contains(k) != *negated))
                    .collect(),
                valid,
            })
        }
        Node::StrRegexInstr {
            index,
            name,
            table,
            skip,
            nth,
        } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            Ok(Lanes {
                values: regex_rows(&values, text, |v| table.instr(v, *skip, *nth))?,
                valid: values
                    .iter()
                    .any(Option::is_none)
                    .then(|| values.iter().map(|v| v.is_some() as u8).collect()),
            })
        }
        Node::StrRegexCount {
            index,
            name,
            table,
            skip,
        } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            Ok(Lanes {
                values: regex_rows(&values, text, |v| table.count(v, *skip))?,
                valid: values
                    .iter()
                    .any(Option::is_none)
                    .then(|| values.iter().map(|v| v.is_some() as u8).collect()),
            })
        }
        Node::StrRegex {
            index,
            name,
            table,
            negated,
        } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            Ok(Lanes {
                values: regex_rows(&values, text, |v| {
                    table.is_match(v).map(|m| i64::from(m != *negated))
                })?,
                valid: values
                    .iter()
                    .any(Option::is_none)
                    .then(|| values.iter().map(|v| v.is_some() as u8).collect()),
            })
        }
        Node::StrLike {
            index,
            name,
            pattern,
            negated,
        } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            if pattern.fold {
                if let Some(i) = values.iter().position(|v| v.is_some_and(|v| !v.is_ascii())) {
                    return Err(ComputeError::HostOnly(format!(
                        "`{text}`: row {i} is not ASCII (ILIKE folds Unicode's cases)"
                    ))
                    .into());
                }
            }
            Ok(Lanes {
                values: values
                    .iter()
                    .map(|v| v.is_some_and(|v| pattern.matches(v) != *negated) as i64)
                    .collect(),
                valid: values
                    .iter()
                    .any(Option::is_none)
                    .then(|| values.iter().map(|v| v.is_some() as u8).collect()),
            })
        }
        Node::Substr { .. }
        | Node::SplitPart { .. }
        | Node::Trim { .. }
        | Node::StrCase { .. }
        | Node::Concat { .. }
        | Node::Replace { .. }
        | Node::RegexReplace { .. }
        | Node::Pad { .. }
        | Node::Transform { .. }
        | Node::ToText { .. }
        | Node::StrChoice { .. } => {
            Err(ComputeError::Input(format!("`{text}` is a string, not a value of lanes")).into())
        }
        Node::StrCompare { sides, op } => {
            let side = |part: &ConcatPart| -> Result<Vec<Option<Vec<u8>>>, BoxError> {
                Ok(match part {
                    ConcatPart::Column { index, name } => {
                        view_values(frame_column(frame, *index, name)?, name)?
                            .into_iter()
                            .map(|v| v.map(<[u8]>::to_vec))
                            .collect()
                    }
                    ConcatPart::Literal(bytes) => vec![Some(bytes.clone()); n],
                })
            };
            let (a, b) = (side(&sides[0])?, side(&sides[1])?);
            let (mut lanes, mut valid) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for (a, b) in a.iter().zip(&b) {
                let answer = match (a, b) {
                    (Some(a), Some(b)) => Some(match *op {
                        op::EQ => a == b,
                        op::NE => a != b,
                        op::LT => a < b,
                        op::LE => a <= b,
                        op::GT => a > b,
                        _ => a >= b,
                    }),
                    _ => None,
                };
                lanes.push(i64::from(answer == Some(true)));
                valid.push(u8::from(answer.is_some()));
            }
            Ok(Lanes {
                values: lanes,
                valid: Some(valid),
            })
        }
        Node::Parse {
            index,
            name,
            to,
            on_fail,
        } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            let (mut lanes, mut valid) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for (i, value) in values.iter().enumerate() {
                let parsed = match value {
                    Some(v) => match (to.parse(v), on_fail) {
                        (Err(Quit), _) => {
                            return Err(ComputeError::HostOnly(format!(
                                "`{text}`: row {i}'s value is parsed by the host ({to:?})"
                            ))
                            .into())
                        }
                        (Ok(None), OnFail::Error) => {
                            return Err(ComputeError::Overflow(format!(
                                "`{text}`: row {i}'s value is no value of the cast's type \
                                 ({to:?})"
                            ))
                            .into())
                        }
                        (Ok(parsed), _) => parsed,
                    },
                    None => None,
                };
                lanes.push(parsed.unwrap_or(0));
                valid.push(u8::from(parsed.is_some()));
            }
            Ok(Lanes {
                values: lanes,
                valid: Some(valid),
            })
        }
        Node::StrKey { index, name, word } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            let (mut lanes, mut valid) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for value in &values {
                lanes.push(value.map_or(0, |v| super::expr::string_key_lanes(v)[*word as usize]));
                valid.push(u8::from(value.is_some()));
            }
            Ok(Lanes {
                values: lanes,
                valid: Some(valid),
            })
        }
        Node::StrLength {
            index,
            name,
            measure,
            mul,
        } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            let length = |v: &[u8]| match measure {
                0 => v.len(),
                1 => v.iter().filter(|b| *b & 0xC0 != 0x80).count(),
                _ => std::str::from_utf8(v)
                    .ok()
                    .and_then(|v| v.chars().next())
                    .map_or(0, |c| c as usize),
            };
            Ok(Lanes {
                values: values
                    .iter()
                    .map(|v| v.map_or(0, |v| length(v) as i64 * mul))
                    .collect(),
                valid: values
                    .iter()
                    .any(Option::is_none)
                    .then(|| values.iter().map(|v| v.is_some() as u8).collect()),
            })
        }
        Node::StrPos {
            index,
            name,
            needle,
        } => {
            let values = view_values(frame_column(frame, *index, name)?, name)?;
            let position = |v: &[u8]| -> i64 {
                if needle.is_empty() {
                    return 1;
                }
                match v.windows(needle.len()).position(|w| w == needle.as_slice()) {
                    Some(at) => v[..at].iter().filter(|b| *b & 0xC0 != 0x80).count() as i64 + 1,
                    None => 0,
                }
            };
            Ok(Lanes {
                values: values.iter().map(|v| v.map_or(0, position)).collect(),
                valid: values
                    .iter()
                    .any(Option::is_none)
                    .then(|| values.iter().map(|v| v.is_some() as u8).collect()),
            })
        }
        Node::Valid { index, name } => {
            let column = frame_column(frame, *index, name)?;
            ready(column)?;
            let valid = validity(&column.column())?;
            Ok(Lanes {
                values: match valid {
                    Some(v) => v.into_iter().map(i64::from).collect(),
                    None => vec![1; n],
                },
                valid: None,
            })
        }
        Node::Case {
            branches,
            otherwise,
        } => {
            let mut out = eval(otherwise, frame, text)?;
            // Last branch first, so that the first true condition wins.
            for (condition, value) in branches.iter().rev() {
                let (c, v) = (eval(condition, frame, text)?, eval(value, frame, text)?);
                for i in 0..n {
                    if c.is_valid(i) && c.values[i] != 0 {
                        out.values[i] = v.values[i];
                        if !v.is_valid(i) || out.valid.is_some() {
                            out.valid.get_or_insert_with(|| vec![1; n])[i] = v.is_valid(i) as u8;
                        }
                    }
                }
            }
            Ok(out)
        }
        Node::Subquery(expr) => {
            let v = super::expr::subquery_value(expr)?;
            eval(&Node::Literal(v), frame, text)
        }
        Node::Literal(v) => Ok(Lanes {
            values: vec![v.unwrap_or(0); n],
            valid: v.is_none().then(|| vec![0; n]),
        }),
        Node::Binary {
            op,
            left,
            right,
            lmul,
            rmul,
            lo,
            hi,
        } => {
            let (a, b) = (eval(left, frame, text)?, eval(right, frame, text)?);
            let mut values = vec![0i64; n];
            if *op == op::AND || *op == op::OR {
                // SQL's three-valued logic: false AND x is false, true OR x is true.
                let mut valid = vec![1u8; n];
                for i in 0..n {
                    let (av, bv) = (a.is_valid(i), b.is_valid(i));
                    let (x, y) = (a.values[i] != 0, b.values[i] != 0);
                    let (value, ok) = if *op == op::AND {
                        if (av && !x) || (bv && !y) {
                            (false, true)
                        } else {
                            (true, av && bv)
                        }
                    } else if (av && x) || (bv && y) {
                        (true, true)
                    } else {
                        (false, av && bv)
                    };
                    values[i] = if ok { value as i64 } else { 0 };
                    valid[i] = ok as u8;
                }
                let valid = valid.contains(&0).then_some(valid);
                return Ok(Lanes { values, valid });
            }
            let valid = match (&a.valid, &b.valid) {
                (None, None) => None,
                (Some(x), None) | (None, Some(x)) => Some(x.clone()),
                (Some(x), Some(y)) => Some(x.iter().zip(y).map(|(x, y)| x & y).collect()),
            };
            for i in 0..n {
                if valid.as_ref().is_some_and(|v| v[i] == 0) {
                    continue;
                }
                values[i] = binary_row(*op, a.values[i], b.values[i], *lmul, *rmul, *lo, *hi)
                    .map_err(|()| {
                        ComputeError::Overflow(format!(
                            "`{text}` overflows at row {i} ({} and {})",
                            a.values[i], b.values[i]
                        ))
                    })?;
            }
            Ok(Lanes { values, valid })
        }
        Node::ZoneUtc {
            local,
            value,
            zone,
            per_second,
            lo,
            hi,
        } => {
            let mut l = eval(local, frame, text)?;
            let v = value.as_ref().map(|v| eval(v, frame, text)).transpose()?;
            for i in 0..n {
                if !l.is_valid(i) {
                    continue;
                }
                let value = v.as_ref().map(|v| v.values[i]);
                l.values[i] = zone
                    .utc(l.values[i], value, *per_second, (*lo, *hi))
                    .ok_or_else(|| {
                        ComputeError::HostOnly(format!(
                            "`{text}`: row {i}'s local time has no instant of the zone {}'s \
                             table (1900 to 2100) that DataFusion or arrow maps it to",
                            zone.name
                        ))
                    })?;
            }
            Ok(l)
        }
        Node::ZoneLocal {
            input,
            zone,
            per_second,
            lo,
            hi,
        } => {
            let mut a = eval(input, frame, text)?;
            for i in 0..n {
                if !a.is_valid(i) {
                    continue;
                }
                a.values[i] = zone
                    .local(a.values[i], *per_second, (*lo, *hi))
                    .ok_or_else(|| {
                        ComputeError::HostOnly(format!(
                            "`{text}`: row {i} lies outside the zone {}'s table (1900 to \
                             2100) or its local time outside chrono's calendar",
                            zone.name
                        ))
                    })?;
            }
            Ok(a)
        }
        Node::Unary {
            op,
            input,
            mul,
            lo,
            hi,
            on_fail,
        } => {
            let a = eval(input, frame, text)?;
            match *op {
                op::NOT => Ok(Lanes {
                    values: a
                        .values
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| if a.is_valid(i) { (v == 0) as i64 } else { 0 })
                        .collect(),
                    valid: a.valid,
                }),
                op::FLOAT_KEY => Ok(Lanes {
                    values: a.values.iter().map(|&v| float_key(v)).collect(),
                    valid: a.valid,
                }),
                op::TO_FLOAT => Ok(Lanes {
                    values: a
                        .values
                        .iter()
                        .map(|&v| (v as f64 / *mul as f64).to_bits() as i64)
                        .collect(),
                    valid: a.valid,
                }),
                part if op::DATE_PARTS.contains(&part) => {
                    let mut values = vec![0i64; n];
                    let mut valid = vec![0u8; n];
                    for i in (0..n).filter(|&i| a.is_valid(i)) {
                        if let Some(part) = date_part(*op, a.values[i], *mul) {
                            (values[i], valid[i]) = (part, 1);
                        }
                    }
                    let valid = valid.contains(&0).then_some(valid);
                    Ok(Lanes { values, valid })
                }
                op::DAYS => {
                    let mut values = vec![0i64; n];
                    for i in (0..n).filter(|&i| a.is_valid(i)) {
                        let days = a.values[i].div_euclid(*mul);
                        if !(CHRONO_DAYS.0..=CHRONO_DAYS.1).contains(&days) {
                            return Err(ComputeError::Overflow(format!(
                                "`{text}`: row {i}'s day {days} is out of chrono's calendar"
                            ))
                            .into());
                        }
                        values[i] = days;
                    }
                    Ok(Lanes {
                        values,
                        valid: a.valid,
                    })
                }
                op::ADD_MONTHS => {
                    let mut values = vec![0i64; n];
                    for i in (0..n).filter(|&i| a.is_valid(i)) {
                        values[i] = add_months(a.values[i], *mul, (*lo, *hi)).ok_or_else(|| {
                            ComputeError::Overflow(format!(
                                "`{text}`: row {i}'s day {} plus {mul} months is out of \
                                 chrono's calendar",
                                a.values[i]
                            ))
                        })?;
                    }
                    Ok(Lanes {
                        values,
                        valid: a.valid,
                    })
                }
                op::TRUNC_TO => Ok(Lanes {
                    values: a.values.iter().map(|&v| v - v.rem_euclid(*mul)).collect(),
                    valid: a.valid,
                }),
                op::TRUNC_WEEK | op::TRUNC_MONTH | op::TRUNC_QUARTER | op::TRUNC_YEAR => {
                    let mut values = vec![0i64; n];
                    for i in (0..n).filter(|&i| a.is_valid(i)) {
                        values[i] =
                            date_trunc(*op, a.values[i], *mul, (*lo, *hi)).ok_or_else(|| {
                                ComputeError::Overflow(format!(
                                    "`{text}`: row {i} ({}) passes DataFusion's nanoseconds",
                                    a.values[i]
                                ))
                            })?;
                    }
                    Ok(Lanes {
                        values,
                        valid: a.valid,
                    })
                }
                op::FLOOR | op::CEIL | op::TRUNC | op::SQRT | op::ROUND => {
                    let mut values = vec![0i64; n];
                    for i in (0..n).filter(|&i| a.is_valid(i)) {
                        let x = f64::from_bits(a.values[i] as u64);
                        let y = match *op {
                            op::FLOOR => x.floor(),
                            op::CEIL => x.ceil(),
                            // DataFusion's makes a zero (-0.0 too) 0.0.
                            op::TRUNC if x == 0.0 => 0.0,
                            op::TRUNC => x.trunc(),
                            op::SQRT if x < 0.0 => {
                                return Err(ComputeError::Overflow(format!(
                                    "`{text}`: row {i} is negative ({x}), which sqrt refuses"
                                ))
                                .into())
                            }
                            op::SQRT => x.sqrt(),
                            _ => {
                                let factor = f64::from_bits(*mul as u64);
                                (x * factor).round() / factor
                            }
                        };
                        values[i] = y.to_bits() as i64;
                    }
                    Ok(Lanes {
                        values,
                        valid: a.valid,
                    })
                }
                op::FABS => Ok(Lanes {
                    values: a.values.iter().map(|&v| v & i64::MAX).collect(),
                    valid: a.valid,
                }),
                op::TOTAL_KEY | op::IS_NAN | op::SIGNUM => Ok(Lanes {
                    values: a
                        .values
                        .iter()
                        .map(|&v| {
                            let x = f64::from_bits(v as u64);
                            match *op {
                                op::TOTAL_KEY => v ^ ((v >> 63) & i64::MAX),
                                op::IS_NAN => x.is_nan() as i64,
                                _ if x == 0.0 => 0,
                                _ => x.signum().to_bits() as i64,
                            }
                        })
                        .collect(),
                    valid: a.valid,
                }),
                op::FACTORIAL => {
                    let mut values = vec![0i64; n];
                    for i in (0..n).filter(|&i| a.is_valid(i)) {
                        let v = a.values[i];
                        values[i] = (1..=v)
                            .try_fold(1i64, |f, k| f.checked_mul(k))
                            .filter(|_| v >= 0)
                            .ok_or_else(|| {
                                ComputeError::Overflow(format!(
                                    "`{text}`: row {i}'s factorial of {v}"
                                ))
                            })?;
                    }
                    Ok(Lanes {
                        values,
                        valid: a.valid,
                    })
                }
                op::IS_NULL | op::IS_NOT_NULL => Ok(Lanes {
                    values: (0..n)
                        .map(|i| (a.is_valid(i) == (*op == op::IS_NOT_NULL)) as i64)
                        .collect(),
                    valid: None,
                }),
                op::MINMAX_KEY => {
                    let mut values = vec![0i64; n];
                    for (i, out) in values.iter_mut().enumerate() {
                        if !a.is_valid(i) {
                            continue;
                        }
                        *out = minmax_float_key(a.values[i]).ok_or_else(|| {
                            ComputeError::HostOnly(format!(
                                "`{text}`: NaN or -0.0 at row {i} (DataFusion's min and max \
                                 of them depend on the rows' order)"
                            ))
                        })?;
                    }
                    Ok(Lanes {
                        values,
                        valid: a.valid,
                    })
                }
                _ => {
                    let mut values = vec![0i64; n];
                    let mut valid = a.valid.clone();
                    for (i, out) in values.iter_mut().enumerate() {
                        if !a.is_valid(i) {
                            continue;
                        }
                        let cast = match *op {
                            op::FLOAT_TO_INT => from_float(a.values[i], 1, false, *lo, *hi),
                            op::FLOAT_TO_DECIMAL => from_float(a.values[i], *mul, true, *lo, *hi),
                            op::DOWNSCALE => divided(a.values[i], *mul, true, *lo, *hi),
                            op::DECIMAL_TO_INT => divided(a.values[i], *mul, false, *lo, *hi),
                            op::FLOOR_DECIMAL | op::CEIL_DECIMAL => {
                                let (v, m) = (a.values[i], *mul);
                                let (q, r) = (v / m, v % m);
                                let q = match (*op == op::FLOOR_DECIMAL, r) {
                                    (true, r) if r < 0 => q - 1,
                                    (false, r) if r > 0 => q + 1,
                                    _ => q,
                                };
                                q.checked_mul(m).filter(|v| (*lo..=*hi).contains(v))
                            }
                            _ => scaled(a.values[i], *mul, *lo, *hi),
                        };
                        match cast {
                            Some(v) => *out = v,
                            None if *on_fail == OnFail::Null => {
                                valid.get_or_insert_with(|| vec![1; n])[i] = 0
                            }
                            None => {
                                return Err(ComputeError::Overflow(format!(
                                    "`{text}`: {} is out of range at row {i}",
                                    a.values[i]
                                ))
                                .into())
                            }
                        }
                    }
                    Ok(Lanes { values, valid })
                }
            }
        }
    }
}

/// `v / mul` as `unary_lanes`' ops 33 and 34 (arrow's casts of a decimal to a smaller
/// scale and to an integer): truncated toward zero, or (`round`) rounded half away from
/// zero (a remainder of at least half `mul`, an even power of ten); `None` outside
/// `[lo, hi]`.
pub(crate) fn divided(v: i64, mul: i64, round: bool, lo: i64, hi: i64) -> Option<i64> {
    let (q, r) = (v / mul, v % mul);
    let q = if round && 2 * r.unsigned_abs() >= mul.unsigned_abs() {
        q + r.signum()
    } else {
        q
    };
    (lo..=hi).contains(&q).then_some(q)
}

/// A Float64's bits cast as `unary_lanes`' ops 8 and 9 (arrow's casts): truncated
/// toward zero, or (`round`) times `mul` and rounded half away from zero; `None` for NaN,
/// infinities, magnitudes of 2^63 or more, and results outside `[lo, hi]`.
pub(crate) fn from_float(bits: i64, mul: i64, round: bool, lo: i64, hi: i64) -> Option<i64> {
    let x = f64::from_bits(bits as u64);
    let y = if round { x * mul as f64 } else { x };
    // Under 2^63 in magnitude (NaN is not).
    if y.is_nan() || y.abs() >= 9_223_372_036_854_775_808.0 {
        return None;
    }
    let t = if round { y.round() } else { y.trunc() } as i64;
    (lo..=hi).contains(&t).then_some(t)
}

/// A Float64's bits as an i64 whose signed order is the order DataFusion compares floats
/// in: `f64::total_cmp` (arrow's) but -0.0 equal to 0.0. -0.0 becomes 0.0, then negative
/// floats' bits but the sign are flipped, as `unary_lanes` computes it.
pub(crate) fn float_key(bits: i64) -> i64 {
    let bits = if bits == i64::MIN { 0 } else { bits };
    bits ^ ((bits >> 63) & i64::MAX)
}

/// A Float64's bits as `unary_lanes`' op 10 keys them for `min` and `max`: `None` for
/// NaN and -0.0 (see [`op::MINMAX_KEY`]).
pub(crate) fn minmax_float_key(bits: i64) -> Option<i64> {
    let nan = (bits & i64::MAX) as u64 > 0x7FF0_0000_0000_0000;
    (!nan && bits != i64::MIN).then_some(bits ^ ((bits >> 63) & i64::MAX))
}

/// Date part `op` ([`op::YEAR`] to [`op::ISOYEAR`], [`op::HOUR`], [`op::MINUTE`]) of
/// `value`, a count of units since 1970-01-01 (`per_day` of them a day: 1 for a
/// `Date32`'s days), as arrow's `date_part` takes it (chrono's calendar, ISO weeks from
/// Monday); `None` (null) where its day is outside [`CHRONO_DAYS`]. `unary_lanes`
/// computes the same.
pub(crate) fn date_part(op: u32, value: i64, per_day: i64) -> Option<i64> {
    let days = value.div_euclid(per_day);
    if !(CHRONO_DAYS.0..=CHRONO_DAYS.1).contains(&days) {
        return None;
    }
    let in_day = value.rem_euclid(per_day);
    match op {
        op::HOUR => return Some(in_day / (per_day / 24)),
        op::MINUTE => return Some(in_day / (per_day / 1440) % 60),
        _ => {}
    }
    // Sunday 0 (1970-01-01 was a Thursday) and Monday 0, the remainders of days' sign.
    let dow = ((days % 7) + 11) % 7;
    let monday0 = ((days % 7) + 10) % 7;
    // An ISO week's year and number are those of its Thursday.
    let thursday = days - monday0 + 3;
    Some(match op {
        op::YEAR => civil_from_days(days).0,
        op::MONTH => civil_from_days(days).1,
        op::DAY => civil_from_days(days).2,
        op::QUARTER => (civil_from_days(days).1 + 2) / 3,
        op::DOW => dow,
        op::ISODOW => monday0 + 1,
        op::DOY => day_of_year(days),
        op::WEEK => (day_of_year(thursday) - 1) / 7 + 1,
        op::ISOYEAR => civil_from_days(thursday).0,
        _ => unreachable!("date part {op}"),
    })
}

/// `date_trunc` ([`op::TRUNC_WEEK`] to [`op::TRUNC_YEAR`]) of `value`, a count of units
/// since 1970-01-01 (`per_day` of them a day), as DataFusion computes it in nanoseconds:
/// `None` (its error) where the value is outside `range` (its nanoseconds pass i64) or
/// the start is more than 106751 days from 1970. `unary_lanes` computes the same.
pub(crate) fn date_trunc(op: u32, value: i64, per_day: i64, range: (i64, i64)) -> Option<i64> {
    if !(range.0..=range.1).contains(&value) {
        return None;
    }
    let days = value.div_euclid(per_day);
    let (year, month, day) = civil_from_days(days);
    let start = match op {
        op::TRUNC_WEEK => days - (days + 3).rem_euclid(7),
        op::TRUNC_MONTH => days - (day - 1),
        op::TRUNC_QUARTER => days_from_civil(year, 1 + 3 * ((month - 1) / 3), 1),
        _ => days_from_civil(year, 1, 1),
    };
    (-106_751..=106_751)
        .contains(&start)
        .then_some(start * per_day)
}

/// Day count `days` plus `months` months, as chrono's `checked_add_months` (or
/// `checked_sub_months`): the same day of the month, or the month's last where it has
/// fewer; `None` where the day or the result is outside `range` (chrono's calendar).
pub(crate) fn add_months(days: i64, months: i64, range: (i64, i64)) -> Option<i64> {
    let within = |d: i64| (range.0..=range.1).contains(&d);
    if !within(days) {
        return None;
    }
    let (year, month, day) = civil_from_days(days);
    let total = (year * 12 + month - 1).checked_add(months)?;
    let (year, month) = (total.div_euclid(12), total.rem_euclid(12) + 1);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let last = match month {
        2 => 28 + i64::from(leap),
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    Some(days_from_civil(year, month, day.min(last))).filter(|d| within(*d))
}

/// The day of the year (1 to 366) of a day count since 1970-01-01.
fn day_of_year(days: i64) -> i64 {
    let (year, _, _) = civil_from_days(days);
    days - days_from_civil(year, 1, 1) + 1
}

/// A slice of each value of a string column (`substr`'s characters, `trim`'s value less
/// its spaces: [`Bounds::range`](super::expr::Bounds::range), as `view_substr` finds
/// it). An array of the column's own type.
pub(crate) fn slices(
    column: &FrameColumn,
    name: &str,
    bounds: super::expr::Bounds,
) -> Result<arrow_array::ArrayRef, BoxError> {
    use arrow_array::{LargeStringArray, StringArray, StringViewArray};

    let values = view_values(column, name)?;
    let mut out = Vec::with_capacity(values.len());
    for value in values {
        let Some(value) = value else {
            out.push(None);
            continue;
        };
        out.push(Some(
            std::str::from_utf8(&value[bounds.range(value)]).map_err(|e| {
                ComputeError::Input(format!("column `{name}`: a value is not UTF-8: {e}"))
            })?,
        ));
    }
    let data_type = column.column().data_type().clone();
    Ok(match data_type {
        DataType::Utf8 => std::sync::Arc::new(StringArray::from(out)),
        DataType::LargeUtf8 => std::sync::Arc::new(LargeStringArray::from(out)),
        _ => std::sync::Arc::new(StringViewArray::from(out)),
    })
}

/// Rows of string bytes (`None`: null) as an array of type `out` (`Utf8`, `LargeUtf8`,
/// `Utf8View`): each row checked to be UTF-8, and `Utf8`'s i32 offsets checked to hold
/// them (past them: `ComputeError::Overflow`, the host's own error to raise).
/// `lanes` written as strings of type `out` ([`Node::ToText`]), as
/// [`Text::write`](super::convert::Text::write) writes each valid one; a value it leaves to
/// the host is [`ComputeError::HostOnly`].
pub(crate) fn texts(
    lanes: &Lanes,
    how: super::convert::Text,
    out: &DataType,
    text: &str,
) -> Result<arrow_array::ArrayRef, BoxError> {
    let rows = (0..lanes.values.len())
        .map(|i| match lanes.is_valid(i) {
            false => Ok(None),
            true => how.write(lanes.values[i]).map(Some).ok_or_else(|| {
                ComputeError::HostOnly(format!(
                    "`{text}`: row {i}'s value is written by the host ({how:?})"
                ))
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    string_rows(rows, out, text)
}

pub(crate) fn string_rows(
    rows: Vec<Option<Vec<u8>>>,
    out: &DataType,
    text: &str,
) -> Result<arrow_array::ArrayRef, BoxError> {
    use arrow_array::{LargeStringArray, StringArray, StringViewArray};

    let total: usize = rows.iter().flatten().map(Vec::len).sum();
    if *out == DataType::Utf8 && total > i32::MAX as usize {
        return Err(ComputeError::Overflow(format!(
            "`{text}`: {total} bytes overflow Utf8's offsets"
        ))
        .into());
    }
    let rows = rows
        .into_iter()
        .map(|row| row.map(String::from_utf8).transpose())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ComputeError::Input(format!("`{text}`: a value is not UTF-8: {e}")))?;
    Ok(match out {
        DataType::Utf8 => std::sync::Arc::new(StringArray::from(rows)),
        DataType::LargeUtf8 => std::sync::Arc::new(LargeStringArray::from(rows)),
        _ => std::sync::Arc::new(StringViewArray::from(rows)),
    })
}

/// `concat`, `||` or `concat_ws` of each row's parts ([`Node::Concat`]), an array of
/// type `out`, as `concat_views` joins them; with `which`, each row's one part
/// `which[i]` (null outside the parts: [`Node::StrChoice`]).
pub(crate) fn concat(
    frame: &DeviceFrame,
    parts: &[ConcatPart],
    (joined, which): (Joined, Option<&[i64]>),
    out: &DataType,
    text: &str,
) -> Result<arrow_array::ArrayRef, BoxError> {
    let n = frame.num_rows();
    let mut columns = Vec::with_capacity(parts.len());
    for part in parts {
        columns.push(match part {
            ConcatPart::Column { index, name } => {
                let values = view_values(frame_column(frame, *index, name)?, name)?;
                if values.len() < n {
                    return Err(ComputeError::Input(format!(
                        "column `{name}`: fewer rows than its frame"
                    ))
                    .into());
                }
                Some(values)
            }
            ConcatPart::Literal(_) => None,
        });
    }
    let mut rows: Vec<Option<Vec<u8>>> = Vec::with_capacity(n);
    for i in 0..n {
        let (mut row, mut null, mut present) = (Vec::new(), false, 0);
        if which.is_some_and(|w| usize::try_from(w[i]).map_or(true, |w| w >= parts.len())) {
            rows.push(None);
            continue;
        }
        for (p, (part, column)) in parts.iter().zip(&columns).enumerate() {
            if joined == Joined::Separated && p == 0 {
                continue;
            }
            if which.is_some_and(|w| w[i] != p as i64) {
                continue;
            }
            let value = match (part, column) {
                (ConcatPart::Literal(bytes), _) => Some(bytes.as_slice()),
                (_, Some(values)) => values[i],
                (_, None) => None,
            };
            match (value, &parts[0]) {
                (None, _) => null |= joined == Joined::NullIfAny,
                (Some(value), ConcatPart::Literal(separator)) if joined == Joined::Separated => {
                    if present > 0 {
                        row.extend_from_slice(separator);
                    }
                    row.extend_from_slice(value);
                    present += 1;
                }
                (Some(value), _) => row.extend_from_slice(value),
            }
        }
        rows.push((!null).then_some(row));
    }
    string_rows(rows, out, text)
}

/// `replace(value, from, to)` of each value of a string column ([`Node::Replace`]), an
/// array of type `out`, as `replace_views` finds the occurrences: leftmost first, not
/// overlapping, none for an empty `from`.
pub(crate) fn replaced(
    column: &FrameColumn,
    name: &str,
    (from, to): (&[u8], &[u8]),
    out: &DataType,
    text: &str,
) -> Result<arrow_array::ArrayRef, BoxError> {
    let values = view_values(column, name)?;
    let mut rows: Vec<Option<Vec<u8>>> = Vec::with_capacity(values.len());
    for value in values {
        let Some(value) = value else {
            rows.push(None);
            continue;
        };
        let mut row = Vec::with_capacity(value.len());
        let mut j = 0;
        while j < value.len() {
            if !from.is_empty() && value[j..].starts_with(from) {
                row.extend_from_slice(to);
                j += from.len();
            } else {
                row.push(value[j]);
                j += 1;
            }
        }
        rows.push(Some(row));
    }
    string_rows(rows, out, text)
}

/// `lpad` (`rpad` with `right`) of each value of a string column to `target` characters
/// with `fill` ([`Node::Pad`]), an array of type `out`, as `pad_views` makes it.
pub(crate) fn padded(
    column: &FrameColumn,
    name: &str,
    (target, fill, right): (u64, &[u8], bool),
    out: &DataType,
    text: &str,
) -> Result<arrow_array::ArrayRef, BoxError> {
    let (padding, offsets) = super::expr::padding(fill, target);
    let values = view_values(column, name)?;
    let mut rows: Vec<Option<Vec<u8>>> = Vec::with_capacity(values.len());
    for value in values {
        let Some(value) = value else {
            rows.push(None);
            continue;
        };
        let leads: Vec<usize> = (0..value.len())
            .filter(|&j| value[j] & 0xC0 != 0x80)
            .collect();
        let row = match leads.get(target as usize) {
            Some(&cut) => value[..cut].to_vec(),
            None => {
                let pad = &padding[..offsets[target as usize - leads.len()] as usize];
                match right {
                    true => [value, pad].concat(),
                    false => [pad, value].concat(),
                }
            }
        };
        rows.push(Some(row));
    }
    string_rows(rows, out, text)
}

/// `reverse`, `repeat` or `translate` of each value of a string column
/// ([`Node::Transform`]), an array of type `out`, as `view_transform` makes it.
pub(crate) fn transformed(
    column: &FrameColumn,
    name: &str,
    op: &super::expr::Transform,
    out: &DataType,
    text: &str,
) -> Result<arrow_array::ArrayRef, BoxError> {
    let values = view_values(column, name)?;
    let rows = values
        .into_iter()
        .map(|value| value.map(|value| op.apply(value)))
        .collect();
    string_rows(rows, out, text)
}

/// `case` of each value of a string column, an array of the column's own type, by the
/// tables `unicode_case_views` walks ([`CaseTables`](super::unicase::CaseTables)).
pub(crate) fn cased(
    column: &FrameColumn,
    name: &str,
    case: super::expr::Case,
) -> Result<arrow_array::ArrayRef, BoxError> {
    use arrow_array::{LargeStringArray, StringArray, StringViewArray};

    let tables = super::unicase::CaseTables::get();
    let values = view_values(column, name)?;
    let mut out = Vec::with_capacity(values.len());
    for value in values {
        let Some(value) = value else {
            out.push(None);
            continue;
        };
        let value = std::str::from_utf8(value).map_err(|e| {
            ComputeError::Input(format!("column `{name}`: a value is not UTF-8: {e}"))
        })?;
        let cased = tables.apply(case, value);
        out.push(Some(cased));
    }
    Ok(match column.column().data_type() {
        DataType::Utf8 => std::sync::Arc::new(StringArray::from(out)),
        DataType::LargeUtf8 => std::sync::Arc::new(LargeStringArray::from(out)),
        _ => std::sync::Arc::new(StringViewArray::from(out)),
    })
}

/// The bytes of each value of a string column on the CPU device (`None`: null): a
/// `Utf8View` column's read where they lie (in the view, or in the variadic buffer it
/// names), a `Utf8` or `LargeUtf8` column's by its offsets.
pub(crate) fn view_values<'a>(
    column: &'a FrameColumn,
    name: &str,
) -> Result<Vec<Option<&'a [u8]>>, BoxError> {
    ready(column)?;
    let c = column.column();
    super::check_string(&c, name)?;
    let valid = validity(&c)?;
    let (offset, len) = (c.offset(), c.len());
    let outside = || -> BoxError {
        ComputeError::Input(format!(
            "column `{name}`: a string view points outside its buffers"
        ))
        .into()
    };
    let mut out = Vec::with_capacity(len);
    if let DataType::Utf8 | DataType::LargeUtf8 = c.data_type() {
        let width = if c.data_type() == &DataType::Utf8 {
            4
        } else {
            8
        };
        let offsets = cpu_bytes(c.buffer(1).ok_or("a string column without offsets")?)?;
        let data = match c.buffer(2) {
            Some(b) => cpu_bytes(b)?,
            None => &[],
        };
        let at = |j: usize| -> Result<usize, BoxError> {
            let b = offsets
                .get(j * width..j * width + width)
                .ok_or("an offsets buffer too short")?;
            let v = match b.len() {
                4 => i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))),
                _ => i64::from_le_bytes(b.try_into().expect("8 bytes")),
            };
            usize::try_from(v).map_err(|_| outside())
        };
        for i in 0..len {
            let (start, end) = (at(offset + i)?, at(offset + i + 1)?);
            let bytes = data.get(start..end).ok_or_else(outside)?;
            out.push(valid.as_ref().is_none_or(|v| v[i] != 0).then_some(bytes));
        }
        return Ok(out);
    }
    let views = cpu_bytes(c.buffer(1).ok_or("a view column without views")?)?;
    let views = views
        .get(offset * 16..(offset + len) * 16)
        .ok_or("a views buffer too short")?;
    // Buffers: validity, views, the variadic buffers, their sizes.
    let blocks = (2..c.n_buffers().saturating_sub(1))
        .map(|b| c.buffer(b).map_or(Ok(&[][..]), cpu_bytes))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, view) in views.chunks_exact(16).enumerate() {
        if valid.as_ref().is_some_and(|v| v[i] == 0) {
            out.push(None);
            continue;
        }
        let word = |at: usize| u32::from_le_bytes(view[at..at + 4].try_into().expect("4 bytes"));
        let l = word(0) as usize;
        out.push(Some(if l <= 12 {
            &view[4..4 + l]
        } else {
            let (block, at) = (word(8) as usize, word(12) as usize);
            blocks
                .get(block)
                .and_then(|b| b.get(at..at.checked_add(l)?))
                .ok_or_else(outside)?
        }));
    }
    Ok(out)
}

/// The frame's pending selection as 0/1 per row (all 1 without one).
pub(crate) fn selection(frame: &DeviceFrame) -> Result<Vec<u8>, BoxError> {
    let n = frame.num_rows();
    let Some(selection) = frame.selection() else {
        return Ok(vec![1; n]);
    };
    let lanes = load(selection, "selection")?;
    Ok((0..n)
        .map(|i| (lanes.is_valid(i) && lanes.values[i] != 0) as u8)
        .collect())
}

/// Each row's key words and the validity.
pub(crate) type KeyWords = (Vec<[u64; KEY_WORDS]>, Option<Vec<u8>>);

/// What a string of more than 12 bytes is among [`string_words`]' words: a length no
/// view of at most 12 bytes has, so it equals none of them.
pub(crate) const LONG_STRING: [u64; KEY_WORDS] = [u64::MAX; KEY_WORDS];

/// The words of each value of a string column (`Utf8View`, `Utf8`, `LargeUtf8`), per
/// row, and its validity: a value of at most 12 bytes its view (length, then its bytes,
/// zero-padded: what `view_in` compares with a literal's), a longer one [`LONG_STRING`].
pub(crate) fn string_words(column: &FrameColumn, name: &str) -> Result<KeyWords, BoxError> {
    let values = view_values(column, name)?;
    let valid = values
        .iter()
        .any(Option::is_none)
        .then(|| values.iter().map(|v| u8::from(v.is_some())).collect());
    let keys = values
        .iter()
        .map(|v| v.map_or([0; KEY_WORDS], |b| string_key(b).unwrap_or(LONG_STRING)))
        .collect();
    Ok((keys, valid))
}
