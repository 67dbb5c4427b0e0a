//! Values written as strings and strings parsed as values, as arrow's casts do it: the
//! host twins of `lanes_to_text` ([`Text`]) and `view_parse` ([`Parse`]), and the
//! proleptic Gregorian calendar both use ([`days_from_civil`], [`civil_from_days`]).
//! Each parser answers only where its answer is certain without all of arrow's (or
//! lexical's) grammar; every other value is the host's ([`Quit`]).

use super::automaton::Quit;

/// How `Node::ToText` writes a lane: as arrow's cast to a string type writes a value of
/// the input's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Text {
    /// An integer (any width): its decimal digits, `-` first when negative.
    Int,
    /// A decimal of `scale` (0 to 18) digits after the point: its unscaled value's digits
    /// with the point before the last `scale` of them (`0.` and zeros first where it has
    /// fewer), as `format_decimal_str`. More digits than `precision` (which arrow would
    /// cut): the host's.
    Decimal { precision: u8, scale: u8 },
    /// A date (days since 1970-01-01): `YYYY-MM-DD`, years 0 to 9999 (others: the host's).
    Date,
    /// A Boolean: `true` or `false`.
    Bool,
    /// A timestamp's local time (`per_second` units a second since 1970-01-01T00:00:00):
    /// `YYYY-MM-DDTHH:MM:SS`, then a fraction of the second where it has one (3, 6 or 9
    /// digits, the fewest that hold it: chrono's), then its zone's fixed offset
    /// (`offset` seconds) as RFC 3339 writes it (`Z` for 0, else `+HH:MM`), none without a
    /// zone. Years outside 0 to 9999: the host's.
    Timestamp {
        per_second: i64,
        offset: Option<i32>,
    },
    /// `to_hex` of an integer: the lane as a u64 (a signed value sign-extended, as
    /// DataFusion's `as i64 as u64`) in lower-case hexadecimal digits, no leading zero.
    Hex,
    /// `chr` of an Int64: the character of that Unicode scalar value, in UTF-8; any other
    /// value is the host's (DataFusion's error).
    Char,
    /// `to_char` of a date with a literal format ([`date_format`]): its program, up to
    /// 16 steps (a 0 ends it), each an ASCII byte written as it is or a field
    /// ([`field`]). Years outside 0 to 9999: the host's.
    DateFormat([u8; 16]),
}

/// The fields of a [`Text::DateFormat`] program, as chrono writes them for a date
/// (`NaiveDate::format`; its times at midnight, as DataFusion's `to_char` of a date with
/// a time specifier, which casts it to a `Date64` first).
pub(crate) mod field {
    /// `%Y`: the year, 4 digits (0 to 9999).
    pub const YEAR: u8 = 0x80;
    /// `%m`: the month, 2 digits.
    pub const MONTH: u8 = 0x81;
    /// `%d`: the day of the month, 2 digits.
    pub const DAY: u8 = 0x82;
    /// `%y`: the year's last 2 digits.
    pub const YEAR_2: u8 = 0x83;
    /// `%j`: the day of the year, 3 digits.
    pub const ORDINAL: u8 = 0x84;
    /// `%H`, `%M`, `%S` of a date (its midnight): `00`.
    pub const ZEROS: u8 = 0x85;
    /// `%e`: the day of the month, 2 wide, padded with a space.
    pub const DAY_SPACE: u8 = 0x86;
}

/// The program of chrono's format `format` for a date ([`Text::DateFormat`]): literal
/// ASCII bytes (no NUL), `%Y %m %d %y %j %e %H %M %S %F %D %T %R %%`, at most 16
/// steps; `None` for anything else (names, padding modifiers, zones, `%C`, ...: the
/// host's).
pub(crate) fn date_format(format: &str) -> Option<[u8; 16]> {
    use field::*;
    let mut steps = Vec::new();
    let mut bytes = format.bytes();
    while let Some(b) = bytes.next() {
        if b != b'%' {
            if b == 0 || !b.is_ascii() {
                return None;
            }
            steps.push(b);
            continue;
        }
        match bytes.next()? {
            b'Y' => steps.push(YEAR),
            b'm' => steps.push(MONTH),
            b'd' => steps.push(DAY),
            b'y' => steps.push(YEAR_2),
            b'j' => steps.push(ORDINAL),
            b'e' => steps.push(DAY_SPACE),
            b'H' | b'M' | b'S' => steps.push(ZEROS),
            b'F' => steps.extend([YEAR, b'-', MONTH, b'-', DAY]),
            b'D' => steps.extend([MONTH, b'/', DAY, b'/', YEAR_2]),
            b'T' => steps.extend([ZEROS, b':', ZEROS, b':', ZEROS]),
            b'R' => steps.extend([ZEROS, b':', ZEROS]),
            b'%' => steps.push(b'%'),
            _ => return None,
        }
    }
    if steps.is_empty() || steps.len() > 16 {
        return None;
    }
    let mut program = [0u8; 16];
    program[..steps.len()].copy_from_slice(&steps);
    Some(program)
}

impl Text {
    /// The kernel's encoding (`lanes_to_text`): its kind (0 a number, 1 a date, 2 a
    /// Boolean, 3 a timestamp, 4 hexadecimal, 5 a character), the scale (a timestamp: its suffix's length), the
    /// precision (0: not checked; a timestamp: its units a second) and the suffix's
    /// bytes (little-endian).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // (what CUDA needs to know)
    pub(crate) fn kernel_args(self) -> (u32, u32, u32, u64) {
        match self {
            Text::Int => (0, 0, 0, 0),
            Text::Decimal { precision, scale } => (0, scale as u32, precision as u32, 0),
            Text::Date => (1, 0, 0, 0),
            Text::Bool => (2, 0, 0, 0),
            Text::Hex => (4, 0, 0, 0),
            Text::Char => (5, 0, 0, 0),
            // The program's bytes 0 to 7 in the suffix, 8 to 11 and 12 to 15 in the scale
            // and the precision (little-endian).
            Text::DateFormat(program) => {
                let word = |at: usize| u32::from_le_bytes(program[at..at + 4].try_into().unwrap());
                (
                    6,
                    word(8),
                    word(12),
                    u64::from_le_bytes(program[..8].try_into().unwrap()),
                )
            }
            Text::Timestamp { per_second, .. } => {
                let suffix = self.suffix();
                let mut bytes = [0u8; 8];
                bytes[..suffix.len()].copy_from_slice(&suffix);
                (
                    3,
                    suffix.len() as u32,
                    per_second as u32,
                    u64::from_le_bytes(bytes),
                )
            }
        }
    }

    /// A timestamp's zone as RFC 3339 writes it after the time (at most 6 bytes); empty
    /// for the other kinds.
    fn suffix(self) -> Vec<u8> {
        match self {
            Text::Timestamp {
                offset: Some(0), ..
            } => b"Z".to_vec(),
            Text::Timestamp {
                offset: Some(s), ..
            } => {
                let sign = if s < 0 { '-' } else { '+' };
                let s = s.unsigned_abs();
                format!("{sign}{:02}:{:02}", s / 3600, s % 3600 / 60).into_bytes()
            }
            _ => Vec::new(),
        }
    }

    /// The most bytes a value takes: 20 for an i64 (`-9223372036854775808`), one more for
    /// a decimal's point (or `-0.` and 18 digits); a timestamp's 19, a fraction of 10 and
    /// an offset of 6.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // (what CUDA needs to know)
    pub(crate) fn max_bytes(self) -> u64 {
        match self {
            Text::Timestamp { .. } => 35,
            // at most 4 bytes a step
            Text::DateFormat(_) => 64,
            _ => 21,
        }
    }

    /// `v` as arrow's cast writes it, or `None` where that is the host's to write (a
    /// date outside years 0 to 9999, a decimal of more digits than its precision).
    pub(crate) fn write(self, v: i64) -> Option<Vec<u8>> {
        match self {
            Text::Int => Some(v.to_string().into_bytes()),
            Text::Bool => Some(if v != 0 { &b"true"[..] } else { b"false" }.to_vec()),
            Text::Hex => Some(format!("{:x}", v as u64).into_bytes()),
            Text::Char => u32::try_from(v)
                .ok()
                .and_then(char::from_u32)
                .map(|c| c.to_string().into_bytes()),
            Text::Date => {
                let (y, m, d) = civil_from_days(v);
                (0..=9999)
                    .contains(&y)
                    .then(|| format!("{y:04}-{m:02}-{d:02}").into_bytes())
            }
            Text::DateFormat(program) => {
                let (y, m, d) = civil_from_days(v);
                if !(0..=9999).contains(&y) {
                    return None;
                }
                let ordinal = v - days_from_civil(y, 1, 1) + 1;
                let mut out = Vec::new();
                for step in program.into_iter().take_while(|s| *s != 0) {
                    let text = match step {
                        field::YEAR => format!("{y:04}"),
                        field::MONTH => format!("{m:02}"),
                        field::DAY => format!("{d:02}"),
                        field::YEAR_2 => format!("{:02}", y % 100),
                        field::ORDINAL => format!("{ordinal:03}"),
                        field::ZEROS => "00".to_string(),
                        field::DAY_SPACE => format!("{d:>2}"),
                        literal => char::from(literal).to_string(),
                    };
                    out.extend(text.into_bytes());
                }
                Some(out)
            }
            Text::Timestamp { per_second, .. } => {
                let (secs, units) = (v.div_euclid(per_second), v.rem_euclid(per_second));
                let nanos = units * (1_000_000_000 / per_second);
                let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
                let (y, m, d) = civil_from_days(days);
                if !(0..=9999).contains(&y) {
                    return None;
                }
                let fraction = if nanos == 0 {
                    String::new()
                } else if nanos % 1_000_000 == 0 {
                    format!(".{:03}", nanos / 1_000_000)
                } else if nanos % 1_000 == 0 {
                    format!(".{:06}", nanos / 1_000)
                } else {
                    format!(".{nanos:09}")
                };
                let (hh, mm, ss) = (sod / 3600, sod % 3600 / 60, sod % 60);
                let mut out =
                    format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}{fraction}").into_bytes();
                out.extend(self.suffix());
                Some(out)
            }
            Text::Decimal { precision, scale } => {
                let digits = v.unsigned_abs().to_string();
                if digits.len() > precision as usize {
                    return None;
                }
                let sign = if v < 0 { "-" } else { "" };
                let scale = scale as usize;
                Some(
                    if scale == 0 {
                        format!("{sign}{digits}")
                    } else if digits.len() > scale {
                        let (whole, fraction) = digits.split_at(digits.len() - scale);
                        format!("{sign}{whole}.{fraction}")
                    } else {
                        format!("{sign}0.{digits:0>scale$}")
                    }
                    .into_bytes(),
                )
            }
        }
    }
}

/// What `Node::Parse` parses a string as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parse {
    /// An integer within `[lo, hi]` (its type's range): [`parse_int`].
    Int { lo: i64, hi: i64 },
    /// A `Date32`: [`parse_date`].
    Date,
    /// A `Float64` (its bits): [`parse_number`].
    Float,
    /// A decimal of `scale`, within `[lo, hi]` (its precision's range): [`parse_number`].
    Decimal { scale: u8, lo: i64, hi: i64 },
    /// A timestamp of no zone in units of `per_second` a second: [`parse_timestamp`].
    Timestamp { per_second: i64 },
}

impl Parse {
    /// `value` parsed: `Ok(None)` where it is no value of the type, `Err(Quit)` where
    /// the parse is the host's.
    pub(crate) fn parse(self, value: &[u8]) -> Result<Option<i64>, Quit> {
        match self {
            Parse::Int { lo, hi } => Ok(parse_int(value, (lo, hi))),
            Parse::Date => parse_date(value),
            Parse::Float => parse_number(value, None),
            Parse::Decimal { scale, lo, hi } => {
                Ok(parse_number(value, Some(scale))?.filter(|v| (lo..=hi).contains(v)))
            }
            Parse::Timestamp { per_second } => parse_timestamp(value, per_second),
        }
    }

    /// The kernel's encoding (`view_parse`): its mode (0 an integer, 1 a date, 2 a
    /// float, 3 a decimal, its scale in bits 8 to 15, 4 a timestamp, its units a second
    /// in `lo`) and range.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // (what CUDA needs to know)
    pub(crate) fn kernel_args(self) -> (u32, i64, i64) {
        match self {
            Parse::Int { lo, hi } => (0, lo, hi),
            Parse::Date => (1, 0, 0),
            Parse::Float => (2, i64::MIN, i64::MAX),
            Parse::Decimal { scale, lo, hi } => (3 | u32::from(scale) << 8, lo, hi),
            Parse::Timestamp { per_second } => (4, per_second, 0),
        }
    }
}

/// A string value as arrow's cast parses it to a `Float64` (`scale` `None`: its bits,
/// lexical's correctly rounded parse) or to a decimal of `scale` (arrow's
/// `parse_string_to_decimal_native`: the fraction past the scale rounded half away from
/// zero by its first digit), for the values whose answer is certain without mirroring
/// all of either parser; every other value is the host's (`Err`):
///
/// - a float: `-`, then digits, then `.` and digits, then `e` or `E`, a sign and
///   digits, each part but the first digits optional, of at most 2^53 as an integer of
///   all its digits, whose power of ten (the exponent less the fraction's digits) is at
///   most 22 either way: exactly one IEEE 754 product or quotient of two exact doubles
///   (Clinger's fast path), or 0.0 (`-0.0` with `-`);
/// - a decimal: `-` or `+`, then digits and a `.` and digits, at least one digit in
///   all, at most 30 of them past the `.`, whose value at the scale fits i64 (no
///   whitespace, which arrow trims, and no other byte).
pub(crate) fn parse_number(value: &[u8], scale: Option<u8>) -> Result<Option<i64>, Quit> {
    const LIMIT: u64 = 922_337_203_685_477_579;
    let push = |m: u64, d: u8| match m > LIMIT {
        true => Err(Quit),
        false => Ok(m * 10 + u64::from(d)),
    };
    let digit = |k: usize| {
        value
            .get(k)
            .map(|b| b.wrapping_sub(b'0'))
            .filter(|d| *d < 10)
    };
    let negative = value.first() == Some(&b'-');
    let mut k = usize::from(negative || (scale.is_some() && value.first() == Some(&b'+')));
    let (mut m, mut int_digits, mut frac_digits, mut dropped) = (0u64, 0usize, 0usize, 0u8);
    while let Some(d) = digit(k) {
        m = push(m, d)?;
        int_digits += 1;
        k += 1;
    }
    if value.get(k) == Some(&b'.') {
        k += 1;
        if scale.is_none() && (int_digits == 0 || digit(k).is_none()) {
            return Err(Quit);
        }
        while let Some(d) = digit(k) {
            if frac_digits >= 30 {
                return Err(Quit);
            }
            frac_digits += 1;
            k += 1;
            match scale {
                Some(s) if frac_digits > usize::from(s) => {
                    if frac_digits == usize::from(s) + 1 {
                        dropped = d;
                    }
                }
                _ => m = push(m, d)?,
            }
        }
    }
    let mut exponent = 0i64;
    if scale.is_none() && matches!(value.get(k), Some(b'e' | b'E')) {
        k += 1;
        let minus = value.get(k) == Some(&b'-');
        k += usize::from(minus || value.get(k) == Some(&b'+'));
        let from = k;
        while let Some(d) = digit(k) {
            if exponent > 100_000 {
                return Err(Quit);
            }
            exponent = exponent * 10 + i64::from(d);
            k += 1;
        }
        if k == from {
            return Err(Quit);
        }
        if minus {
            exponent = -exponent;
        }
    }
    if k != value.len() || int_digits + frac_digits == 0 {
        return Err(Quit);
    }
    match scale {
        Some(s) => {
            for _ in frac_digits..usize::from(s) {
                m = push(m, 0)?;
            }
            m += u64::from(dropped >= 5);
            let v = m as i64;
            Ok(Some(if negative { -v } else { v }))
        }
        None => {
            if m > 1 << 53 {
                return Err(Quit);
            }
            let mut x = m as f64;
            if m != 0 {
                let e = exponent - frac_digits as i64;
                if e.abs() > 22 {
                    return Err(Quit);
                }
                let p = (0..e.abs()).fold(1.0f64, |p, _| p * 10.0);
                x = if e < 0 { x / p } else { x * p };
            }
            let x = if negative { -x } else { x };
            Ok(Some(x.to_bits() as i64))
        }
    }
}

/// A string value as arrow's cast parses it to a timestamp of no zone in units of
/// `per_second` a second (`string_to_datetime` against UTC, then the unit's
/// `from_naive_datetime`), for the forms whose answer is certain: `YYYY-MM-DD` alone, or
/// then `T`, `t` or a space, `HH:MM:SS`, a fraction of one or more digits (the first 9
/// kept), and nothing or `Z`/`z`. Fewer than 10 bytes, another date or separator, an
/// hour, minute or second out of range, a day its month lacks, a point with no digit, or
/// a value past the unit's 64 bits: no timestamp (`Ok(None)`). An offset or a zone, the
/// `HHMMSS` form, a leap second (`:60`), or bytes after the time: the host's (`Err`).
pub(crate) fn parse_timestamp(value: &[u8], per_second: i64) -> Result<Option<i64>, Quit> {
    let digit = |k: usize| {
        value
            .get(k)
            .map(|b| b.wrapping_sub(b'0'))
            .filter(|d| *d < 10)
    };
    let two = |k: usize| Some(i64::from(digit(k)?) * 10 + i64::from(digit(k + 1)?));
    if value.len() < 10 || value[4] != b'-' || value[7] != b'-' {
        return Ok(None);
    }
    let (Some(year), Some(month), Some(day)) =
        (two(0).zip(two(2)).map(|(a, b)| a * 100 + b), two(5), two(8))
    else {
        return Ok(None);
    };
    // A real date: its days name it back.
    let days = days_from_civil(year, month, day);
    if !(1..=12).contains(&month) || civil_from_days(days) != (year, month, day) {
        return Ok(None);
    }
    let (mut seconds, mut nanos) = (days * 86_400, 0i64);
    if value.len() > 10 {
        if !matches!(value[10], b'T' | b't' | b' ') {
            return Ok(None);
        }
        if value.len() < 19 || value[13] != b':' || value[16] != b':' {
            return Err(Quit);
        }
        let (Some(h), Some(m), Some(s)) = (two(11), two(14), two(17)) else {
            return Err(Quit);
        };
        match (h, m, s) {
            (24.., _, _) | (_, 60.., _) | (_, _, 61..) => return Ok(None),
            (_, _, 60) => return Err(Quit),
            _ => seconds += h * 3600 + m * 60 + s,
        }
        let mut k = 19;
        if value.get(k) == Some(&b'.') {
            k += 1;
            let from = k;
            while let Some(d) = digit(k) {
                if k - from < 9 {
                    nanos = nanos * 10 + i64::from(d);
                }
                k += 1;
            }
            if k == from {
                return Ok(None);
            }
            nanos *= 10i64.pow(9u32.saturating_sub((k - from) as u32));
        }
        match &value[k..] {
            [] | [b'Z' | b'z'] => {}
            // A zone: arrow's `Tz` of the rest, its leading white space trimmed; a
            // fixed offset is the device's, a name (or white space past ASCII) the host's.
            rest => {
                let at = rest
                    .iter()
                    .position(|b| !matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r'))
                    .ok_or(Quit)?;
                seconds -= fixed_offset(&rest[at..]).ok_or(Quit)?;
            }
        }
    }
    if per_second == 1_000_000_000 && seconds < 0 {
        (seconds, nanos) = (seconds + 1, nanos - 1_000_000_000);
    } else {
        nanos /= 1_000_000_000 / per_second;
    }
    Ok(seconds
        .checked_mul(per_second)
        .and_then(|v| v.checked_add(nanos)))
}

/// A zone as arrow's `parse_fixed_offset` reads it, in seconds east of UTC: the whole of
/// `[+-]HH:MM`, `[+-]HHMM` or `[+-]HH`, any two digits each (less than a day in all, as
/// chrono's `FixedOffset` takes); `None` for anything else (arrow then reads a zone's
/// name).
pub(crate) fn fixed_offset(zone: &[u8]) -> Option<i64> {
    let digits = match *zone {
        [_, h1, h2, b':', m1, m2] | [_, h1, h2, m1, m2] => [h1, h2, m1, m2],
        [_, h1, h2] => [h1, h2, b'0', b'0'],
        _ => return None,
    };
    let d = digits.map(|b| i64::from(b.wrapping_sub(b'0')));
    if d.iter().any(|d| *d > 9) {
        return None;
    }
    let seconds = (d[0] * 10 + d[1]) * 3600 + (d[2] * 10 + d[3]) * 60;
    if seconds >= 86_400 {
        return None;
    }
    match zone[0] {
        b'+' => Some(seconds),
        b'-' => Some(-seconds),
        _ => None,
    }
}

/// A string value as arrow's cast parses it to a `Date32` (`parse_date`), as days since
/// 1970-01-01, for values of at most 10 bytes with no sign: `YYYYMMDD`, or `YYYY-M-D`
/// with one or two digits of month and of day (bytes past the day that are no digits,
/// up to the tenth, ignored, as arrow's mask ignores them), a real date. A value of
/// more than 10 bytes (arrow parses it as a timestamp) or that starts with a sign (an
/// extended year) is the host's (`Err`).
pub(crate) fn parse_date(value: &[u8]) -> Result<Option<i64>, Quit> {
    if value.len() > 10 || value.first().is_some_and(|b| matches!(b, b'+' | b'-')) {
        return Err(Quit);
    }
    let mut d = [0u8; 10];
    let mut mask = 0u32;
    for (k, b) in value.iter().enumerate() {
        d[k] = b.wrapping_sub(b'0');
        mask |= u32::from(d[k] < 10) << k;
    }
    let hyphen = b'-'.wrapping_sub(b'0');
    let two = |k: usize| u32::from(d[k]) * 10 + u32::from(d[k + 1]);
    let (month, day) = if d[4] != hyphen {
        match (mask, value.len()) {
            (0xFF, 8) => (two(4), two(6)),
            _ => return Ok(None),
        }
    } else {
        match mask {
            0b11_0110_1111 if d[7] == hyphen => (two(5), two(8)),
            0b1_0110_1111 if d[7] == hyphen => (two(5), u32::from(d[8])),
            0b1_1010_1111 if d[6] == hyphen => (u32::from(d[5]), two(7)),
            0b1010_1111 if d[6] == hyphen => (u32::from(d[5]), u32::from(d[7])),
            _ => return Ok(None),
        }
    };
    let year = (two(0) * 100 + two(2)) as i64;
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let last = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    if !(1..=12).contains(&month) || !(1..=last).contains(&day) {
        return Ok(None);
    }
    Ok(Some(days_from_civil(year, month as i64, day as i64)))
}

/// The day count since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`, the inverse of [`civil_from_days`]).
pub(crate) fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The year, month (1 to 12) and day of the month of a day count since 1970-01-01 in the
/// proleptic Gregorian calendar (Howard Hinnant's `civil_from_days`, as `unary_lanes`
/// computes it).
pub(crate) fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// A string value as arrow's cast parses it to an integer (`atoi`'s checked parse after
/// trimming): ASCII whitespace (space, tab, line feed, form feed, carriage return) around
/// an optional `+` or `-` and at least one decimal digit, nothing else, the number within
/// `[lo, hi]`; else `None`.
pub(crate) fn parse_int(value: &[u8], (lo, hi): (i64, i64)) -> Option<i64> {
    let value = value.trim_ascii();
    let (negative, digits) = match value.first() {
        Some(b'-') => (true, &value[1..]),
        Some(b'+') => (false, &value[1..]),
        _ => (false, value),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // The magnitude, at most 2^63.
    let mut magnitude: u64 = 0;
    for d in digits {
        magnitude = magnitude
            .checked_mul(10)?
            .checked_add(u64::from(d - b'0'))
            .filter(|&m| m <= 1 << 63)?;
    }
    let v = match negative {
        true => (magnitude as i64).wrapping_neg(),
        false => i64::try_from(magnitude).ok()?,
    };
    (lo..=hi).contains(&v).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::DataType;

    /// `date_format`'s programs, and the formats it leaves to the host, against chrono's
    /// own writing of the same dates (arrow's `to_char` of a `Date32` is chrono's).
    #[test]
    fn date_formats_are_chronos() {
        use chrono::NaiveDate;
        let formats = [
            "%Y-%m-%d", "%F", "%D", "%y%j", "[%e]", "%F %T", "%R", "%%%Y%%", "%d.%m.%Y",
        ];
        let days = [
            0i64, -1, 59, 11_016, -719_528, 2_932_896, -36_524, 19_000, 10_957,
        ];
        for format in formats {
            let program = date_format(format).unwrap_or_else(|| panic!("{format}"));
            for v in days {
                let date = NaiveDate::from_num_days_from_ce_opt(v as i32 + 719_163).unwrap();
                // chrono writes a date's time specifiers only of a datetime (DataFusion's
                // `Date64` retry): its midnight.
                let want = date
                    .and_hms_opt(0, 0, 0)
                    .unwrap()
                    .format(format)
                    .to_string();
                let got = Text::DateFormat(program).write(v).unwrap();
                assert_eq!(String::from_utf8(got).unwrap(), want, "{format} of {date}");
            }
        }
        for format in ["", "%b", "%-d", "%", "%Y%", "é%Y", "%F %F %F", "%C", "%z"] {
            assert_eq!(date_format(format), None, "{format:?}");
        }
        let far = days_from_civil(10_000, 1, 1);
        assert_eq!(
            Text::DateFormat(date_format("%m").unwrap()).write(far),
            None
        );
    }

    /// Every string `parse_timestamp` answers (the device's part) is parsed as arrow's
    /// cast to a timestamp of each unit parses it: generated dates, separators, times,
    /// fractions and suffixes, and noise.
    #[test]
    fn timestamps_parsed_are_arrows() {
        use arrow_array::{Array, StringArray};
        use datafusion::arrow::compute::{cast_with_options, CastOptions};
        use datafusion::arrow::datatypes::TimeUnit;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let pick = |k: u64, xs: &[&str]| xs[k as usize % xs.len()].to_string();
        let mut words = Vec::new();
        for _ in 0..40_000 {
            let year = pick(
                next(9),
                &[
                    "0000", "1677", "1678", "1969", "1970", "2020", "2262", "2263", "9999",
                ],
            );
            let date = format!("{year}-{:02}-{:02}", next(14), next(33));
            let sep = pick(next(6), &["T", "t", " ", "_", "", "T"]);
            let time = match next(5) {
                0 => String::new(),
                1 => format!("{:02}{:02}{:02}", next(25), next(61), next(62)),
                _ => format!("{:02}:{:02}:{:02}", next(25), next(61), next(62)),
            };
            let fraction = match next(3) {
                0 => String::new(),
                _ => format!(".{}", &"0123456789012"[..next(14) as usize]),
            };
            let suffix = match next(12) {
                0..=2 => String::new(),
                3 => "Z".into(),
                4 => "z".into(),
                5 => " ".into(),
                6 => "x".into(),
                7 => " UTC".into(),
                // fixed offsets, in each of arrow's forms, after white space or not, any
                // two digits (a day's worth and past it too), and malformed ones
                _ => {
                    let space = pick(next(5), &["", "", " ", "\t ", "\u{a0}"]);
                    let sign = pick(next(5), &["+", "-", "+", "-", "*"]);
                    let (h, m) = (next(30), next(100));
                    let zone = match next(6) {
                        0 => format!("{h:02}:{m:02}"),
                        1 => format!("{h:02}{m:02}"),
                        2 => format!("{h:02}"),
                        3 => format!("{h:02}:{m:02}x"),
                        4 => format!("{h}:{m:02}"),
                        _ => format!("{h:02}:{m:02}"),
                    };
                    format!("{space}{sign}{zone}")
                }
            };
            words.push(format!("{date}{sep}{time}{fraction}{suffix}"));
        }
        let noise = b"0123456789-:T .Z";
        for _ in 0..10_000 {
            let len = next(30);
            words.push(
                (0..len)
                    .map(|_| noise[next(noise.len() as u64) as usize] as char)
                    .collect(),
            );
        }
        words.push("1677-09-21T00:12:43.145224192".into());
        words.push("1677-09-21T00:12:43.145224191".into());
        words.push("2262-04-11T23:47:16.854775807".into());
        words.push("2262-04-11T23:47:16.854775808".into());
        let strings = StringArray::from_iter_values(&words);
        for unit in [
            TimeUnit::Second,
            TimeUnit::Millisecond,
            TimeUnit::Microsecond,
            TimeUnit::Nanosecond,
        ] {
            let to = DataType::Timestamp(unit, None);
            let cast = cast_with_options(&strings, &to, &CastOptions::default())
                .unwrap()
                .to_data();
            let values = cast.buffers()[0].typed_data::<i64>();
            let per_second = match unit {
                TimeUnit::Second => 1,
                TimeUnit::Millisecond => 1_000,
                TimeUnit::Microsecond => 1_000_000,
                TimeUnit::Nanosecond => 1_000_000_000,
            };
            let mut answered = 0;
            for (i, w) in words.iter().enumerate() {
                if let Ok(v) = parse_timestamp(w.as_bytes(), per_second) {
                    answered += 1;
                    let want = cast.is_valid(i).then(|| values[i]);
                    assert_eq!(v, want, "{w:?} as {to}");
                }
            }
            assert!(answered > 15_000, "{answered} of {to} answered");
        }
        // Fixed offsets are the device's (compared with arrow's above): answered.
        for (w, want) in [
            ("2020-01-01T05:30:00+05:30", 1_577_836_800),
            ("2020-01-01 00:00:00.5 -0100", 1_577_840_400),
            ("2019-12-31T23:00:00\t+23", 1_577_750_400),
        ] {
            assert_eq!(parse_timestamp(w.as_bytes(), 1), Ok(Some(want)), "{w:?}");
        }
        // A day's offset or more, or a name: the host's (arrow's error, or its zone).
        for w in ["2020-01-01T00:00:00+24", "2020-01-01T00:00:00 UTC"] {
            assert_eq!(parse_timestamp(w.as_bytes(), 1), Err(Quit), "{w:?}");
        }
    }

    /// Every string `parse_number` answers (the device's part) is parsed as arrow's cast
    /// parses it, bit for bit: strings of digits, signs, dots, exponents and spaces.
    #[test]
    fn numbers_parsed_are_arrows() {
        use arrow_array::{Array, Decimal128Array, Float64Array, StringArray};
        use datafusion::arrow::compute::{cast_with_options, CastOptions};
        let alphabet = b"0123456789012345678900000.-+eE 5";
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let mut words: Vec<String> = (0..60_000)
            .map(|_| {
                let len = next(26);
                (0..len)
                    .map(|_| alphabet[next(alphabet.len() as u64) as usize] as char)
                    .collect()
            })
            .collect();
        // Plain numbers, so that most are the device's.
        for _ in 0..20_000 {
            let (int, frac) = (next(1 << 40) >> next(40), next(1 << 30) >> next(30));
            let sign = ["", "-", "+"][next(3) as usize];
            let exp = match next(4) {
                0 => format!("e{}", next(50) as i64 - 25),
                _ => String::new(),
            };
            words.push(format!(
                "{sign}{int}.{frac:0w$}{exp}",
                w = next(12) as usize
            ));
            words.push(format!("{sign}{int}{exp}"));
        }
        let strings = StringArray::from_iter_values(&words);
        let safe = CastOptions::default();
        let floats = cast_with_options(&strings, &DataType::Float64, &safe).unwrap();
        let floats = floats.as_any().downcast_ref::<Float64Array>().unwrap();
        let mut answered = 0;
        for (i, w) in words.iter().enumerate() {
            if let Ok(v) = parse_number(w.as_bytes(), None) {
                answered += 1;
                let want = floats.is_valid(i).then(|| floats.value(i).to_bits() as i64);
                assert_eq!(v, want, "{w:?} as a Float64");
            }
        }
        assert!(answered > 30_000, "{answered} floats answered");
        for (p, s) in [(18u8, 2i8), (10, 0), (38, 5), (18, 18), (6, 3)] {
            let to = DataType::Decimal128(p, s);
            let decimals = cast_with_options(&strings, &to, &safe).unwrap();
            let decimals = decimals.as_any().downcast_ref::<Decimal128Array>().unwrap();
            let hi = 10i64.checked_pow(u32::from(p)).map_or(i64::MAX, |v| v - 1);
            let lo = -hi;
            let parse = Parse::Decimal {
                scale: s as u8,
                lo,
                hi,
            };
            let mut answered = 0;
            for (i, w) in words.iter().enumerate() {
                if let Ok(v) = parse.parse(w.as_bytes()) {
                    answered += 1;
                    let want = decimals.is_valid(i).then(|| decimals.value(i) as i64);
                    assert_eq!(v, want, "{w:?} as {to}");
                }
            }
            assert!(answered > 5_000, "{answered} of {to} answered");
        }
    }
}
