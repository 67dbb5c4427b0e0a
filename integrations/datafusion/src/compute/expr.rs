//! Compiling DataFusion's physical expressions into the device's expression tree
//! ([`Node`]): every value a signed 64-bit lane (decimals as their unscaled value at the
//! node's scale, integers and dates as themselves, booleans 0 or 1) plus a validity
//! flag, so one set of elementwise operations serves every supported type.

use std::sync::Arc;

use arrow_schema::{DataType, Schema, TimeUnit};
use datafusion::common::ScalarValue;
use datafusion::logical_expr::Operator;
use datafusion::physical_expr::expressions::{
    BinaryExpr, CaseExpr, CastExpr, Column, InListExpr, IsNotNullExpr, IsNullExpr, LikeExpr,
    Literal, NegativeExpr, NotExpr, TryCastExpr,
};
use datafusion::physical_expr::{PhysicalExpr, ScalarFunctionExpr};

use super::automaton::{ilike_pattern, RegexTable};
use super::convert::{Parse, Text};
use super::{Unsupported, KEY_WORDS};

/// Binary operation codes (shared with `kernels/compute.ptx`'s `binary_i64`).
pub(crate) mod op {
    pub const ADD: u32 = 0;
    pub const SUB: u32 = 1;
    pub const MUL: u32 = 2;
    pub const EQ: u32 = 3;
    pub const NE: u32 = 4;
    pub const LT: u32 = 5;
    pub const LE: u32 = 6;
    pub const GT: u32 = 7;
    pub const GE: u32 = 8;
    pub const AND: u32 = 9;
    pub const OR: u32 = 10;
    /// Binary: `+ - * /` of two Float64 lanes (their bits), IEEE 754, rounded to the
    /// nearest even; never an error (a zero divisor gives an infinity or NaN, as
    /// arrow's kernels do).
    pub const FADD: u32 = 11;
    pub const FSUB: u32 = 12;
    pub const FMUL: u32 = 13;
    pub const FDIV: u32 = 14;
    /// Binary: `/` of two integers or two decimals (the dividend scaled up by `lmul`
    /// first), truncated toward zero as arrow divides, checked against `[lo, hi]`; a
    /// zero divisor flags an overflow (the host computes the batch and DataFusion
    /// raises its own error).
    pub const DIV: u32 = 15;
    /// Binary: `%` of two integers or two decimals (aligned to the larger scale), the
    /// sign of the dividend; checks as [`DIV`]'s.
    pub const REM: u32 = 16;
    /// Binary: `&`, `|`, `^` of two integers of one type (never an error).
    pub const BIT_AND: u32 = 17;
    pub const BIT_OR: u32 = 18;
    pub const BIT_XOR: u32 = 19;
    /// Binary: `<<` and `>>` of two signed integers of the result's width `w` (from
    /// `hi`, its largest value: `w - 1` its bits), as arrow's `wrapping_shl` and
    /// `wrapping_shr`: the amount's low bits, `b & (w - 1)`; a left shift's result the
    /// low `w` bits, sign-extended; a right shift arithmetic. Never an error.
    pub const SHL: u32 = 20;
    pub const SHR: u32 = 21;
    /// Binary: `gcd` and `lcm` of two Int64s, as DataFusion's: of their absolute values
    /// (a zero's `gcd` the other's, `lcm` 0); a result past `i64::MAX` fails.
    pub const GCD: u32 = 22;
    pub const LCM: u32 = 23;
    /// Binary: `<<` and `>>` of two unsigned integers of the result's width `w` (from
    /// `hi`, its largest value, `2^w - 1`), as arrow's `wrapping_shl` and
    /// `wrapping_shr`: the amount `b & (w - 1)`; a left shift's result the low `w` bits
    /// (zero-extended lanes); a right shift logical. Never an error.
    pub const USHL: u32 = 24;
    pub const USHR: u32 = 25;
    /// Unary (`unary_i64`): logical not (validity kept).
    pub const NOT: u32 = 0;
    /// Unary: 1 where null, always valid.
    pub const IS_NULL: u32 = 1;
    /// Unary: 1 where not null, always valid.
    pub const IS_NOT_NULL: u32 = 2;
    /// Unary: `v * mul`, then checked against `[lo, hi]`.
    pub const CAST: u32 = 3;
    /// Unary: a date's year (proleptic Gregorian, as `date_part('year', d)`).
    pub const YEAR: u32 = 4;
    /// Unary: a date's month, 1 to 12.
    pub const MONTH: u32 = 5;
    /// Unary: a Float64's bits (its lanes) as an i64 whose signed order is the order
    /// DataFusion compares floats in (`f64::total_cmp`, NaN above everything, but -0.0
    /// equal to 0.0): -0.0 made 0.0, then `v ^ ((v >> 63) & i64::MAX)`, so that
    /// comparisons of floats are comparisons of these keys.
    pub const FLOAT_KEY: u32 = 6;
    /// Unary: a cast to Float64, `(double) v / (double) mul` (an integer: `mul` 1; a
    /// decimal: 10^scale), as arrow's cast rounds it.
    pub const TO_FLOAT: u32 = 7;
    /// Unary: a cast of a Float64 (its bits) to an integer, truncated toward zero, as
    /// arrow's cast; NaN, infinities and values out of `[lo, hi]` fail.
    pub const FLOAT_TO_INT: u32 = 8;
    /// Unary: a cast of a Float64 to a decimal, `v * mul` (10^scale) rounded half away
    /// from zero, as arrow's cast; checked against `[lo, hi]` (the precision's range).
    pub const FLOAT_TO_DECIMAL: u32 = 9;
    /// Unary: a Float64's bits as the key of a `min` or `max` ([`FLOAT_KEY`]'s, in
    /// `f64::total_cmp`'s order, -0.0 kept below 0.0); NaN and -0.0 are
    /// [`ComputeError::HostOnly`](crate::compute::ComputeError::HostOnly): DataFusion's grouped
    /// `min` and `max` of them depend on the rows' order (it replaces its state where
    /// `partial_cmp` is not `Less`/`Greater` as wanted), so such a batch goes to the
    /// host. The key is its own inverse.
    pub const MINMAX_KEY: u32 = 10;
    /// Unary: a date's day of the month, 1 to 31.
    pub const DAY: u32 = 11;
    /// Unary: a date's quarter, 1 to 4.
    pub const QUARTER: u32 = 12;
    /// Unary: a date's day of the week, Sunday 0 to Saturday 6 (`dow`).
    pub const DOW: u32 = 13;
    /// Unary: a date's day of the year, 1 to 366 (`doy`).
    pub const DOY: u32 = 14;
    /// Unary: a date's ISO week, 1 to 53 (`week`: that of the week's Thursday).
    pub const WEEK: u32 = 15;
    /// Unary: a date's ISO day of the week, Monday 1 to Sunday 7 (`isodow`).
    pub const ISODOW: u32 = 16;
    /// Unary: a date's ISO year (`isoyear`: that of its week's Thursday).
    pub const ISOYEAR: u32 = 17;
    /// Unary: a Float64's absolute value (its bits, the sign bit cleared, as `f64::abs`,
    /// NaN's too).
    pub const FABS: u32 = 18;
    /// Unary: a timestamp's hour, 0 to 23 (`mul`: its units a day).
    pub const HOUR: u32 = 19;
    /// Unary: a timestamp's minute, 0 to 59 (`mul`: its units a day).
    pub const MINUTE: u32 = 20;
    /// The date parts: each null where its day is outside chrono's calendar
    /// (`CHRONO_DAYS`).
    pub const DATE_PARTS: [u32; 11] = [
        YEAR, MONTH, DAY, QUARTER, DOW, DOY, WEEK, ISODOW, ISOYEAR, HOUR, MINUTE,
    ];
    /// Unary: a timestamp's day (`CAST(ts AS DATE)`: its count floored to whole days,
    /// `mul` its units a day); a day out of chrono's calendar fails.
    pub const DAYS: u32 = 21;
    /// Unary: `floor`, `ceil`, `trunc` of a Float64 (its bits), as `f64`'s (but
    /// DataFusion's `trunc` makes -0.0 0.0).
    pub const FLOOR: u32 = 22;
    pub const CEIL: u32 = 23;
    pub const TRUNC: u32 = 24;
    /// Unary: `sqrt` of a Float64, correctly rounded; a negative value (not -0.0 or NaN)
    /// fails, as DataFusion's `sqrt` refuses it.
    pub const SQRT: u32 = 25;
    /// Unary: `round(x, d)` of a Float64, DataFusion's `(x * f).round() / f` with `f`
    /// (`mul`'s bits) = `10f64.powi(d)`, rounding half away from zero.
    pub const ROUND: u32 = 26;
    /// Unary: a timestamp truncated to a multiple of `mul` of its units (`date_trunc`
    /// to a second, minute, hour or day): `v - v.rem_euclid(mul)`.
    pub const TRUNC_TO: u32 = 27;
    /// Unary: `date_trunc` of a timestamp with no zone to its week (from Monday), month,
    /// quarter or year (`mul` its units a day), as DataFusion's: in nanoseconds, so a
    /// value outside `[lo, hi]` (its unit's nanoseconds passing i64) fails, and so does a
    /// start more than 106751 days from 1970.
    pub const TRUNC_WEEK: u32 = 28;
    pub const TRUNC_MONTH: u32 = 29;
    pub const TRUNC_QUARTER: u32 = 30;
    pub const TRUNC_YEAR: u32 = 31;
    /// Unary: a day count plus `mul` months, as chrono's `checked_add_months` (and
    /// `checked_sub_months` for fewer): the same day of the month, or the month's last
    /// where it has fewer days; a day, or a result, outside `[lo, hi]` (chrono's
    /// calendar) fails.
    pub const ADD_MONTHS: u32 = 32;
    /// Unary: a decimal to a smaller scale, `v / mul` (10^(scales' difference)) rounded
    /// half away from zero, as arrow's cast; checked against `[lo, hi]` (the precision's
    /// range).
    pub const DOWNSCALE: u32 = 33;
    /// Unary: a decimal to an integer, `v / mul` (10^scale) truncated toward zero, as
    /// arrow's cast; checked against `[lo, hi]` (the integer's range).
    pub const DECIMAL_TO_INT: u32 = 34;
    /// Unary: `floor` of a decimal, `v` down to a multiple of `mul` (10^scale), as
    /// DataFusion's `floor_decimal_value`; checked against `[lo, hi]` (the precision's
    /// range).
    pub const FLOOR_DECIMAL: u32 = 35;
    /// Unary: `ceil` of a decimal, `v` up to a multiple of `mul` (10^scale), as
    /// DataFusion's `ceil_decimal_value`; checked as [`FLOOR_DECIMAL`].
    pub const CEIL_DECIMAL: u32 = 36;
    /// Unary: a Float64's bits as a key in `f64::total_cmp`'s order (-0.0 below 0.0, a
    /// NaN by its sign), as arrow compares floats in `greatest` and `least`.
    pub const TOTAL_KEY: u32 = 37;
    /// Unary: whether a Float64 is NaN (a Boolean).
    pub const IS_NAN: u32 = 38;
    /// Unary: DataFusion's `signum` of a Float64: 0.0 for either zero, NaN (`f64::NAN`'s
    /// bits) for a NaN, else 1.0 of its sign.
    pub const SIGNUM: u32 = 39;
    /// Unary: `factorial` of an Int64, as DataFusion's; a negative value or one past 20
    /// fails.
    pub const FACTORIAL: u32 = 40;
}

/// The byte a [`LikePattern`]'s piece holds for `_` (any one character): never a byte of
/// UTF-8, so never one of a literal's.
pub(crate) const ANY_CHAR: u8 = 0xFF;

/// A `LIKE` pattern, as arrow's `like` kernel reads it: `%` any run of characters, `_`
/// any one character, `\` the next character literally (a trailing `\` itself). Its
/// pieces between the `%`s, in order (literal bytes, [`ANY_CHAR`] for each `_`), and
/// whether the value must start with the first piece and end with the last. `'abc'`
/// (exact) is one piece anchored at both ends; `'%'` no piece. `fold` (ILIKE): the
/// pattern is ASCII, its letters in lower case, and a value's letters compare in lower
/// case; a value that is not ASCII is the host's (Unicode case folding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LikePattern {
    pub(crate) pieces: Vec<Vec<u8>>,
    pub(crate) anchored_start: bool,
    pub(crate) anchored_end: bool,
    pub(crate) fold: bool,
}

impl LikePattern {
    /// `pattern`'s pieces; with `fold` (ILIKE, an ASCII pattern), in lower case.
    pub(crate) fn parse(pattern: &str, fold: bool) -> Self {
        let mut pieces = Vec::new();
        let mut piece = Vec::new();
        let mut anchored_end = true;
        let mut chars = pattern.chars();
        let mut utf8 = [0u8; 4];
        while let Some(c) = chars.next() {
            anchored_end = c != '%';
            match c {
                '%' if !piece.is_empty() => pieces.push(std::mem::take(&mut piece)),
                '%' => {}
                '_' => piece.push(ANY_CHAR),
                '\\' => {
                    let literal = chars.next().unwrap_or('\\');
                    piece.extend_from_slice(literal.encode_utf8(&mut utf8).as_bytes());
                }
                c => piece.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes()),
            }
        }
        if !piece.is_empty() {
            pieces.push(piece);
        }
        if fold {
            for piece in &mut pieces {
                piece.make_ascii_lowercase();
            }
        }
        Self {
            pieces,
            anchored_start: !pattern.starts_with('%'),
            anchored_end,
            fold,
        }
    }

    /// Exactly `value` (a string's bytes).
    pub(crate) fn exact(value: &[u8]) -> Self {
        Self::literal(vec![value.to_vec()], true, true)
    }

    /// Literal pieces, compared as they are.
    pub(crate) fn literal(pieces: Vec<Vec<u8>>, anchored_start: bool, anchored_end: bool) -> Self {
        Self {
            pieces,
            anchored_start,
            anchored_end,
            fold: false,
        }
    }

    /// Whether `value` (UTF-8) matches: the device's algorithm. Each piece at its
    /// leftmost place at or after the previous one's end (the first at 0 where anchored;
    /// the last ending at the end where anchored). A piece matches at least as many bytes
    /// as it holds (each `_` one character, one to four bytes), so its start is at most
    /// the value's length minus its own. Leftmost is right: a piece's end grows with its
    /// start, and a match that starts inside a character (only one that starts with `_`
    /// can) ends where the match at that character's start does.
    pub(crate) fn matches(&self, value: &[u8]) -> bool {
        let n = self.pieces.len();
        if n == 0 {
            return !self.anchored_start || value.is_empty();
        }
        let mut pos = 0usize;
        for (j, piece) in self.pieces.iter().enumerate() {
            let Some(mut hi) = value.len().checked_sub(piece.len()) else {
                return false;
            };
            if j == 0 && self.anchored_start {
                hi = 0;
            }
            let last_at_end = j == n - 1 && self.anchored_end;
            let Some(end) = (pos..=hi)
                .filter_map(|at| match_at(value, at, piece, self.fold))
                .find(|&end| !last_at_end || end == value.len())
            else {
                return false;
            };
            pos = end;
        }
        true
    }
}

/// Where `piece` ends if it matches `value` from byte `at`: its literal bytes equal (the
/// value's in ASCII lower case with `fold`), each [`ANY_CHAR`] one byte and the
/// continuation bytes (`10xxxxxx`) after it.
fn match_at(value: &[u8], at: usize, piece: &[u8], fold: bool) -> Option<usize> {
    let mut i = at;
    for &p in piece {
        let &v = value.get(i)?;
        i += 1;
        let v = if fold { v.to_ascii_lowercase() } else { v };
        if p == ANY_CHAR {
            while value.get(i).is_some_and(|b| b & 0xC0 == 0x80) {
                i += 1;
            }
        } else if v != p {
            return None;
        }
    }
    Some(i)
}

/// What an out-of-range value becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnFail {
    /// The query fails ([`ComputeError::Overflow`](super::ComputeError::Overflow)).
    Error,
    /// The row becomes null (`TRY_CAST`, a safe cast).
    Null,
}

/// What [`Node::StrCase`] makes of each letter of a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Case {
    /// `upper`: every letter in upper case.
    Upper,
    /// `lower`: every letter in lower case.
    Lower,
    /// `initcap`, as DataFusion's: a letter right after a letter or digit of the value
    /// in lower case, any other (the value's first included) in upper case.
    Initcap,
}

/// A node of a device expression. Every node's values are i64 lanes.
#[derive(Debug, Clone)]
pub(crate) enum Node {
    /// A column of the input (its index in the compiled schema, its name, and its type).
    Column {
        index: usize,
        name: String,
        #[allow(dead_code)] // its type, for Debug
        data_type: DataType,
    },
    /// A constant (`None`: null).
    Literal(Option<i64>),
    /// The value of an uncorrelated scalar subquery (DataFusion's `ScalarSubqueryExpr`,
    /// whose `ScalarSubqueryExec` runs the subquery before the plan under it): known only
    /// when the plan runs, read on the host at each evaluation and filled in as a
    /// constant ([`subquery_value`]).
    Subquery(Arc<dyn PhysicalExpr>),
    /// `left op right`, each operand first multiplied by its factor (decimal scale
    /// alignment), the result (of arithmetic) checked against `[lo, hi]`; overflow of
    /// the 64-bit lanes is an error.
    Binary {
        op: u32,
        left: Box<Node>,
        right: Box<Node>,
        lmul: i64,
        rmul: i64,
        lo: i64,
        hi: i64,
    },
    /// Whether a string column's value is one of `words` (`col = 'x'`, `col IN ('x',
    /// 'y')`, negated for `<>` and `NOT IN`): each literal as the 16 bytes of its view
    /// (length, then its at most 12 bytes inline, zero-padded), which a value's view
    /// equals exactly when the value equals the literal (a longer value's length differs).
    /// A null value gives null.
    StrIn {
        index: usize,
        name: String,
        words: Vec<[u64; 2]>,
        negated: bool,
    },
    /// Whether a string column's value matches a `LIKE` pattern (negated for `NOT
    /// LIKE`; an exact pattern for `=` and `<>` with a literal of more than 12 bytes). A
    /// null value gives null. The values' bytes are read where they lie: in the view, or
    /// in its buffer (a view outside its buffer is an input error).
    StrLike {
        index: usize,
        name: String,
        pattern: LikePattern,
        negated: bool,
    },
    /// Whether a string column's value holds a match of a regular expression (`~`,
    /// `~*`, `regexp_like`; negated for `!~` and `!~*`): its automaton's table walked
    /// byte by byte ([`RegexTable`]). A null value gives null; a view outside its buffer
    /// is an input error.
    StrRegex {
        index: usize,
        name: String,
        table: Arc<RegexTable>,
        negated: bool,
    },
    /// `regexp_count(col, pattern[, start[, flags]])`: how many matches of a regular
    /// expression a string column's value holds from its character `skip` on, one after
    /// the other ([`RegexTable::count`]).
    /// A null value gives null; a view outside its buffer is an input error.
    StrRegexCount {
        index: usize,
        name: String,
        table: Arc<RegexTable>,
        skip: u64,
    },
    /// `regexp_instr(col, pattern[, start[, n[, flags[, 0]]]])`: the character position
    /// (1-based) in a string column's value of the start of the `nth` match of a regular
    /// expression in the value from its character `skip` on, 0 where there is none
    /// ([`RegexTable::instr`]). A null value
    /// gives null; a view outside its buffer is an input error.
    StrRegexInstr {
        index: usize,
        name: String,
        table: Arc<RegexTable>,
        skip: u64,
        nth: u64,
    },
    /// `substr(col, start[, count])` of a string column, as DataFusion's `substr` takes
    /// characters ([`substr_chars`]): a string value of the column's type, so only the
    /// root of a projection's expression ([`substr_node`]), never lanes.
    Substr {
        index: usize,
        name: String,
        /// Characters `first` to `end` (exclusive), from [`substr_chars`]; with
        /// `from_end`, each counted back from the value's end (`left` and `right`
        /// counting from the end: [`Bounds::FromEnd`]).
        first: u64,
        end: u64,
        from_end: bool,
    },
    /// `split_part(col, delimiter, n)` of a string column, a literal delimiter of 1 to 8
    /// bytes and a literal `n` (not 0): the value split at the delimiter's leftmost
    /// occurrences that do not overlap, its `n`th part (from 1), or split at the
    /// rightmost, its `-n`th part from the end; fewer parts: empty (DataFusion's
    /// `split_nth` / `rsplit_nth`). A string value of the column's type, so only the root
    /// of a projection's expression ([`substr_node`]), never lanes. With `through`,
    /// `substr_index(col, delimiter, n)` (DataFusion's `substr_index_slice`): the value
    /// up to that part's end (`n > 0`: before the `n`th delimiter) or from that part's
    /// start (`n < 0`: after the `-n`th from the end); fewer delimiters: the whole value.
    SplitPart {
        index: usize,
        name: String,
        delimiter: Vec<u8>,
        n: i64,
        through: bool,
    },
    /// `btrim(col[, chars])` (`trim`), `ltrim` or `rtrim` of a string column: the ASCII
    /// characters of `set` (bit `b` for byte `b`: a space, DataFusion's default, or each
    /// of a literal's) taken off the start (`left`) and the end (`right`), a string value
    /// of the column's type, so only the root of a projection's expression
    /// ([`string_node`]), never lanes.
    Trim {
        index: usize,
        name: String,
        left: bool,
        right: bool,
        set: [u64; 2],
    },
    /// `upper(col)`, `lower(col)` or `initcap(col)` ([`Case`]) of a string column, as
    /// DataFusion's (Unicode's case mappings: [`CaseTables`](super::unicase::CaseTables);
    /// `lower` of a value with `Σ` is
    /// [`ComputeError::HostOnly`](super::ComputeError::HostOnly)): a string value of the
    /// column's type, so only the root of a projection's expression ([`string_node`]),
    /// never lanes.
    StrCase {
        index: usize,
        name: String,
        case: Case,
    },
    /// `concat(...)`, `a || b || ...` or `concat_ws(sep, ...)` of string columns and
    /// literals ([`Joined`]'s rule), a new string column of the expression's type
    /// (`out`), so only the root of a projection's expression ([`string_node`]), never
    /// lanes.
    Concat {
        parts: Vec<ConcatPart>,
        joined: Joined,
        out: DataType,
    },
    /// `replace(col, from, to)` of a string column and two string literals: every
    /// occurrence of `from`, leftmost first and not overlapping, replaced by `to` (an
    /// empty `from` replaces nothing, as DataFusion's); a new string column of the
    /// expression's type (`out`), so only the root of a projection's expression
    /// ([`string_node`]), never lanes.
    Replace {
        index: usize,
        name: String,
        from: Vec<u8>,
        to: Vec<u8>,
        out: DataType,
    },
    /// `regexp_replace(col, pattern, replacement[, flags])` of a string column: the first
    /// match (every one with the `g` flag) of a regular expression replaced by a literal
    /// of no group reference ([`RegexTable::replace`]); a
    /// new string column of the expression's type (`out`), so only the root of a
    /// projection's expression ([`string_node`]), never lanes.
    RegexReplace {
        index: usize,
        name: String,
        table: Arc<RegexTable>,
        replacement: Vec<u8>,
        global: bool,
        out: DataType,
    },
    /// `lpad(col, target[, fill])` (`rpad` with `right`) of a string column, a literal
    /// target (0 to 16384 characters; negative is 0) and a literal fill (a space by
    /// default): the value's first `target` characters, or the value padded with the
    /// fill repeated to `target` characters; a new string column of the expression's
    /// type (`out`), so only the root of a projection's expression ([`string_node`]).
    Pad {
        index: usize,
        name: String,
        target: u64,
        fill: Vec<u8>,
        right: bool,
        out: DataType,
    },
    /// `reverse(col)`, `repeat(col, n)`, `translate(col, from, to)` or `overlay(...)` of a
    /// string column
    /// ([`Transform`]); a new string column of the expression's type (`out`), so only the
    /// root of a projection's expression ([`string_node`]).
    Transform {
        index: usize,
        name: String,
        op: Transform,
        out: DataType,
    },
    /// `strpos(col, needle)` (`instr`, `position`) of a string column and a string
    /// literal: the position in characters (from 1) of the needle's first occurrence,
    /// 0 where none, 1 for an empty needle. A null value gives null.
    StrPos {
        index: usize,
        name: String,
        needle: Vec<u8>,
    },
    /// The length of a string column's value (`measure` 0: `octet_length` in bytes; 1:
    /// `character_length` in characters), times `mul` (8 for `bit_length`); or (2) its
    /// first character's code point, 0 for an empty value (`ascii`). A null value gives
    /// null.
    StrLength {
        index: usize,
        name: String,
        measure: u32,
        mul: i64,
    },
    /// `CAST(col AS <integer or date>)` of a string column, each value parsed as arrow's
    /// cast parses it ([`Parse::parse`]); `on_fail` where a value is none (`TRY_CAST`, a
    /// safe cast: null). A value whose parse is the host's (a date of more than 10 bytes
    /// or a sign) leaves the batch to the host
    /// ([`ComputeError::HostOnly`](super::ComputeError::HostOnly)). A null value gives
    /// null.
    Parse {
        index: usize,
        name: String,
        to: Parse,
        on_fail: OnFail,
    },
    /// `CAST(x AS <string type>)` of an integer, decimal, date or Boolean expression:
    /// each value as arrow's cast writes it ([`Text::write`]); a new string column of
    /// type `out`, so only the root of a projection's expression ([`string_node`]),
    /// never lanes. A value arrow writes otherwise (a date outside years 0 to 9999, a
    /// decimal of more digits than its precision) leaves the batch to the host
    /// ([`ComputeError::HostOnly`](super::ComputeError::HostOnly)).
    ToText {
        input: Box<Node>,
        text: Text,
        out: DataType,
    },
    /// `CASE [x] WHEN c THEN v ... [ELSE e] END` whose values are strings (string columns,
    /// literals, values cast to strings; `coalesce` and `nullif` of strings, which
    /// DataFusion writes so): `which` gives each row the index of the part its branch
    /// takes (its lanes: [`Node::Case`] of index literals), -1 for a null value; the row
    /// is that part's value (null where it is null). A new string column of type `out`,
    /// so only the root of a projection's expression ([`string_node`]).
    StrChoice {
        which: Box<Node>,
        parts: Vec<ConcatPart>,
        out: DataType,
    },
    /// `a <op> b` ([`op::EQ`] to [`op::GE`]) of two strings a row, each a string column
    /// or a literal (one at least a column), compared byte by byte (arrow's order of
    /// strings), as lanes of 1 or 0; null where either is.
    StrCompare {
        sides: Box<[ConcatPart; 2]>,
        op: u32,
    },
    /// 1 where a column's row is valid, else 0 (always valid): `IS [NOT] NULL` of a
    /// column of any type (only its validity bitmap is read).
    Valid { index: usize, name: String },
    /// Lane `word` (0 or 1) of a string column's value as a join key
    /// ([`string_key_lanes`]): only a join's probe keys, never compiled from an expression.
    /// A null value gives null.
    StrKey {
        index: usize,
        name: String,
        word: u8,
    },
    /// `CASE WHEN c1 THEN v1 ... ELSE e END`: the value of the first branch whose
    /// condition is true (not null), else `otherwise` (a null literal without `ELSE`).
    Case {
        branches: Vec<(Node, Node)>,
        otherwise: Box<Node>,
    },
    /// A unary operation ([`op::NOT`], [`op::IS_NULL`], [`op::IS_NOT_NULL`],
    /// [`op::CAST`]: `v * mul` checked against `[lo, hi]`, `on_fail` when not;
    /// [`op::YEAR`], [`op::MONTH`] of a date).
    Unary {
        op: u32,
        input: Box<Node>,
        mul: i64,
        lo: i64,
        hi: i64,
        on_fail: OnFail,
    },
    /// A timestamp's local time in a zone whose offset changes: the value (of
    /// `per_second` units a second) plus the zone's offset at that instant
    /// ([`ZoneTable`], chrono-tz's, as arrow reads it). An instant outside the table's
    /// years, or a local time outside `[lo, hi]` (chrono's calendar), leaves the batch to
    /// the host ([`ComputeError::HostOnly`](super::ComputeError::HostOnly)).
    ZoneLocal {
        input: Box<Node>,
        zone: Arc<ZoneTable>,
        per_second: i64,
        lo: i64,
        hi: i64,
    },
    /// The instant of a local time (`local`, of `per_second` units a second) in a zone
    /// whose offset changes ([`ZoneTable::utc`], chrono's `and_local_timezone`): with a
    /// `value`, as DataFusion's `date_trunc` maps a truncated local time back (an
    /// ambiguous time by the offset of `value`, the timestamp truncated; a skipped one
    /// from three hours earlier); without, as chrono's `single()` (arrow's months and
    /// days of a zone: only a time of one instant). Where DataFusion or arrow would fail,
    /// or an instant lies outside the table or the result outside `[lo, hi]`, the batch
    /// goes to the host.
    ZoneUtc {
        local: Box<Node>,
        value: Option<Box<Node>>,
        zone: Arc<ZoneTable>,
        per_second: i64,
        lo: i64,
        hi: i64,
    },
}

/// The offsets from UTC of a time zone whose offset changes (daylight saving, a new
/// standard time), as arrow's `Tz` (chrono-tz) gives them, from December 1899 to January
/// 2100 (UTC): the spans of one offset, each from its first second. Made by probing the zone every two
/// hours and bisecting each change to its second ([`ZoneTable::of`], once per zone and
/// process), so a span shorter than two hours that returns to the offset before it
/// would be missed: none is in the time zone database.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ZoneTable {
    /// The zone's name.
    pub(crate) name: String,
    /// Each span's first second (UTC, since the epoch), ascending; the first is the
    /// table's start.
    pub(crate) starts: Vec<i64>,
    /// Each span's offset in seconds (local time less UTC).
    pub(crate) offsets: Vec<i64>,
    /// The first second past the table.
    pub(crate) end: i64,
}

/// A day, in seconds.
const DAY_SECONDS: i64 = 86_400;

impl ZoneTable {
    /// 1899-12-01T00:00:00Z: a month before 1900, so that a local time of 1900 (a date
    /// truncated to its year's first day) has a day of table either side.
    const START: i64 = -2_211_667_200;
    /// 2100-02-01T00:00:00Z, likewise.
    const END: i64 = 4_105_123_200;
    /// The probes' step.
    const STEP: i64 = 7_200;

    /// The table of `zone` (arrow's `Tz` names: the time zone database's), `None` for a
    /// zone arrow does not know. Made once per zone and process.
    pub(crate) fn of(zone: &str) -> Option<Arc<ZoneTable>> {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        static TABLES: OnceLock<Mutex<HashMap<String, Option<Arc<ZoneTable>>>>> = OnceLock::new();
        let mut tables = TABLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        tables
            .entry(zone.to_string())
            .or_insert_with(|| Self::probe(zone).map(Arc::new))
            .clone()
    }

    /// The offset of `zone` at `second` as arrow computes a local time (the local
    /// date-time less the UTC one).
    fn offset(tz: &arrow_array::timezone::Tz, second: i64) -> Option<i64> {
        use arrow_array::types::TimestampSecondType;
        let local = arrow_array::temporal_conversions::as_datetime_with_timezone::<
            TimestampSecondType,
        >(second, *tz)?;
        Some(local.naive_local().and_utc().timestamp() - local.timestamp())
    }

    fn probe(zone: &str) -> Option<ZoneTable> {
        let tz: arrow_array::timezone::Tz = zone.parse().ok()?;
        let offset = |second| Self::offset(&tz, second);
        let mut table = ZoneTable {
            name: zone.to_string(),
            starts: vec![Self::START],
            offsets: vec![offset(Self::START)?],
            end: Self::END,
        };
        let mut at = Self::START;
        while at < Self::END - 1 {
            let next = (at + Self::STEP).min(Self::END - 1);
            let now = offset(next)?;
            if now != *table.offsets.last()? {
                // The first second of the new offset, in (at, next].
                let (mut before, mut after) = (at, next);
                while after - before > 1 {
                    let mid = before + (after - before) / 2;
                    if offset(mid)? == now {
                        after = mid;
                    } else {
                        before = mid;
                    }
                }
                table.starts.push(after);
                table.offsets.push(now);
            }
            at = next;
        }
        Some(table)
    }

    /// The offset in seconds at `second` (UTC), `None` outside the table.
    pub(crate) fn offset_at(&self, second: i64) -> Option<i64> {
        if second < self.starts[0] || second >= self.end {
            return None;
        }
        let span = self.starts.partition_point(|&s| s <= second) - 1;
        Some(self.offsets[span])
    }

    /// Whether every span lasts three days or more: then a window of two days holds one
    /// change at most, which [`ZoneTable::utc`] relies on.
    pub(crate) fn changes_days_apart(&self) -> bool {
        self.starts
            .windows(2)
            .all(|w| w[1] - w[0] >= 3 * DAY_SECONDS)
            && self.end - self.starts[self.starts.len() - 1] >= 3 * DAY_SECONDS
    }

    /// The instants whose local time is `local` (`per` units a second), from the two
    /// offsets a day either side of it (one change at most between them): the one of the
    /// offset before the change, the one of the offset after (`None` for one that does
    /// not map to `local`), and the offset before. `None` outside the table.
    fn instants(&self, local: i64, per: i64) -> Option<(Option<i64>, Option<i64>, i64)> {
        let second = local.div_euclid(per);
        let before = self.offset_at(second - DAY_SECONDS)?;
        let after = self.offset_at(second + DAY_SECONDS)?;
        let maps = |offset: i64| -> Option<Option<i64>> {
            let instant = local - offset * per;
            Some((self.offset_at(instant.div_euclid(per))? == offset).then_some(instant))
        };
        Some((maps(before)?, maps(after)?, before))
    }

    /// The instant of local time `local` (chrono's `and_local_timezone`). With a `value`,
    /// as DataFusion's `date_trunc` maps a truncated local time back to UTC: the one
    /// instant; of two (a time the clocks went back over), the one whose offset is
    /// `value`'s (the timestamp truncated), else the later; of none (a time the clocks
    /// skipped), the one instant of three hours earlier, three hours later. Without, as
    /// chrono's `single()`: the one instant only. `None` where DataFusion or chrono
    /// fails, outside the table, or past `[lo, hi]`. Needs
    /// [`ZoneTable::changes_days_apart`].
    pub(crate) fn utc(
        &self,
        local: i64,
        value: Option<i64>,
        per: i64,
        (lo, hi): (i64, i64),
    ) -> Option<i64> {
        let instant = match (self.instants(local, per)?, value) {
            // chrono's `single()`: a time of one instant only.
            ((Some(a), Some(b), _), None) if a != b => return None,
            ((Some(a), _, _) | (None, Some(a), _), None) => a,
            ((None, None, _), None) => return None,
            ((Some(a), Some(b), before), Some(value)) if a != b => {
                if before == self.offset_at(value.div_euclid(per))? {
                    a
                } else {
                    b
                }
            }
            ((Some(a), _, _) | (None, Some(a), _), Some(_)) => a,
            ((None, None, _), Some(_)) => {
                let shift = 3 * 3_600 * per;
                match self.instants(local - shift, per)? {
                    (Some(a), Some(b), _) if a != b => return None,
                    (Some(a), _, _) | (None, Some(a), _) => a + shift,
                    (None, None, _) => return None,
                }
            }
        };
        Some(instant).filter(|i| (lo..=hi).contains(i))
    }

    /// The local time of `value` (`per_second` units a second), `None` outside the table
    /// or past `[lo, hi]`.
    pub(crate) fn local(&self, value: i64, per_second: i64, (lo, hi): (i64, i64)) -> Option<i64> {
        let offset = self.offset_at(value.div_euclid(per_second))?;
        value
            .checked_add(offset * per_second)
            .filter(|l| (lo..=hi).contains(l))
    }
}

/// The largest decimal scale difference a lane can align (10^18 fits an i64).
const MAX_POW10: u32 = 18;

pub(crate) fn pow10(k: u32) -> Option<i64> {
    (k <= MAX_POW10).then(|| 10i64.pow(k))
}

/// One argument of a [`Node::Concat`]: a string column, or a literal's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConcatPart {
    Column { index: usize, name: String },
    Literal(Vec<u8>),
}

/// How a [`Node::Concat`] joins its parts (the code `concat_views` takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Joined {
    /// `concat`: a null part is empty; the result is never null.
    SkipNulls = 0,
    /// `||`: a null part makes the row null.
    NullIfAny = 1,
    /// `concat_ws`: the first part (a literal) between the parts that are not null;
    /// the result is never null.
    Separated = 2,
}

/// What a type is on the device's lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Decimal(i8),
    Int,
    Date,
    Bool,
    /// Float64, as its bits: compared only (through [`op::FLOAT_KEY`]).
    Float,
    /// A timestamp (any time zone: an instant), its i64 count of `unit`s since the
    /// epoch: compared with timestamps of its unit, and its date parts taken.
    Timestamp(TimeUnit),
    /// A duration, its i64 count of `unit`s: the difference of two timestamps of its
    /// unit, added to or taken from them, and compared with durations of its unit.
    Duration(TimeUnit),
}

fn kind(data_type: &DataType) -> Result<Kind, Unsupported> {
    Ok(match data_type {
        DataType::Decimal128(_, s) if *s >= 0 && *s as u32 <= MAX_POW10 => Kind::Decimal(*s),
        DataType::Decimal128(p, s) => {
            return Err(Unsupported(format!(
                "Decimal128({p}, {s}) has no device operator (scales 0 to {MAX_POW10} only)"
            )))
        }
        // Unsigned integers of up to 32 bits fit the lanes as they are (their values are
        // never negative, so the signed operations give arrow's unsigned results).
        DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32 => Kind::Int,
        DataType::Date32 => Kind::Date,
        DataType::Timestamp(unit, _) => Kind::Timestamp(*unit),
        DataType::Duration(unit) => Kind::Duration(*unit),
        DataType::Boolean => Kind::Bool,
        DataType::Float64 => Kind::Float,
        other => return Err(Unsupported(format!("{other} has no device operator"))),
    })
}

/// The range of values a lane of `data_type` may hold (a narrower integer).
/// Whether `t` is an integer type whose values are lanes (Int8 to Int64, UInt8 to
/// UInt32: not UInt64).
pub(crate) fn is_integer(t: &DataType) -> bool {
    matches!(kind(t), Ok(Kind::Int))
}

fn range_of(data_type: &DataType) -> (i64, i64) {
    match data_type {
        DataType::Int8 => (i8::MIN as i64, i8::MAX as i64),
        DataType::Int16 => (i16::MIN as i64, i16::MAX as i64),
        DataType::UInt8 => (0, u8::MAX as i64),
        DataType::UInt16 => (0, u16::MAX as i64),
        DataType::UInt32 => (0, u32::MAX as i64),
        DataType::Int32 | DataType::Date32 => (i32::MIN as i64, i32::MAX as i64),
        _ => (i64::MIN, i64::MAX),
    }
}

/// `|v| < 10^precision` for a decimal of that precision (any i64 when above 18).
fn precision_range(precision: u8) -> (i64, i64) {
    match pow10(precision as u32) {
        Some(p) => (-(p - 1), p - 1),
        None => (i64::MIN, i64::MAX),
    }
}

/// Compiles `expr` over `input` into a node and its type.
pub(crate) fn compile(
    expr: &Arc<dyn PhysicalExpr>,
    input: &Schema,
) -> Result<(Node, DataType), Unsupported> {
    let data_type = expr
        .data_type(input)
        .map_err(|e| Unsupported(format!("the type of `{expr}`: {e}")))?;
    let node = compile_node(expr, input, &data_type)?;
    Ok((node, data_type))
}

fn compile_node(
    expr: &Arc<dyn PhysicalExpr>,
    input: &Schema,
    data_type: &DataType,
) -> Result<Node, Unsupported> {
    if let Some(column) = expr.downcast_ref::<Column>() {
        kind(data_type)?;
        if column.index() >= input.fields().len() {
            return Err(Unsupported(format!(
                "column `{}` (index {}) is not in the input",
                column.name(),
                column.index()
            )));
        }
        return Ok(Node::Column {
            index: column.index(),
            name: column.name().to_string(),
            data_type: data_type.clone(),
        });
    }
    if let Some(literal) = expr.downcast_ref::<Literal>() {
        return literal_node(literal.value());
    }
    if expr
        .downcast_ref::<datafusion::physical_expr::scalar_subquery::ScalarSubqueryExpr>()
        .is_some()
    {
        // Its value's type must be one of lanes (as a literal's).
        kind(data_type)?;
        return Ok(Node::Subquery(expr.clone()));
    }
    if let Some(binary) = expr.downcast_ref::<BinaryExpr>() {
        if let Some(negated) = regex_operator(binary.op()) {
            let case = if matches!(
                binary.op(),
                Operator::RegexIMatch | Operator::RegexNotIMatch
            ) {
                Some("i")
            } else {
                None
            };
            let what = binary.to_string();
            return regex_node(&what, (binary.left(), binary.right(), case), negated, input);
        }
        if let Some(node) = string_equality(binary, input)? {
            return Ok(node);
        }
        if let Some(node) = string_comparison(binary, input) {
            return Ok(node);
        }
        if matches!(
            binary.op(),
            Operator::IsDistinctFrom | Operator::IsNotDistinctFrom
        ) {
            return distinct_node(binary, input);
        }
        return binary_node(binary, input, data_type);
    }
    if let Some(in_list) = expr.downcast_ref::<InListExpr>() {
        return string_in_list(in_list.expr(), in_list.list(), in_list.negated(), input);
    }
    if let Some(not) = expr.downcast_ref::<NotExpr>() {
        let (input_node, t) = compile(not.arg(), input)?;
        if t != DataType::Boolean {
            return Err(Unsupported(format!("NOT of {t}")));
        }
        return Ok(unary(op::NOT, input_node));
    }
    if let Some(negative) = expr.downcast_ref::<NegativeExpr>() {
        // -x as 0 - x (checked: -i64::MIN, and an Int32's -i32::MIN, overflow).
        let (input_node, t) = compile(negative.arg(), input)?;
        if !matches!(kind(&t)?, Kind::Decimal(_) | Kind::Int) {
            return Err(Unsupported(format!("the negation of {t}")));
        }
        let (lo, hi) = range_of(&t);
        return Ok(Node::Binary {
            op: op::SUB,
            left: Box::new(Node::Literal(Some(0))),
            right: Box::new(input_node),
            lmul: 1,
            rmul: 1,
            lo,
            hi,
        });
    }
    if let Some(is_null) = expr.downcast_ref::<IsNullExpr>() {
        if let Some(valid) = validity_of(is_null.arg(), input) {
            return Ok(unary(op::NOT, valid));
        }
        let (input_node, _) = compile(is_null.arg(), input)?;
        return Ok(unary(op::IS_NULL, input_node));
    }
    if let Some(is_not_null) = expr.downcast_ref::<IsNotNullExpr>() {
        if let Some(valid) = validity_of(is_not_null.arg(), input) {
            return Ok(valid);
        }
        let (input_node, _) = compile(is_not_null.arg(), input)?;
        return Ok(unary(op::IS_NOT_NULL, input_node));
    }
    if let Some(cast) = expr.downcast_ref::<CastExpr>() {
        let on_fail = if cast.cast_options().safe {
            OnFail::Null
        } else {
            OnFail::Error
        };
        return cast_node(cast.expr(), cast.cast_type(), input, on_fail);
    }
    if let Some(cast) = expr.downcast_ref::<TryCastExpr>() {
        return cast_node(cast.expr(), cast.cast_type(), input, OnFail::Null);
    }
    if let Some(case) = expr.downcast_ref::<CaseExpr>() {
        return case_node(case, input, data_type);
    }
    if let Some(like) = expr.downcast_ref::<LikeExpr>() {
        return like_node(like, input);
    }
    if let Some(function) = expr.downcast_ref::<ScalarFunctionExpr>() {
        // `to_timestamp(s)` of no session time zone and `to_date(s)` of one string parse
        // it as arrow's cast does (`string_to_datetime` in UTC and its nanoseconds;
        // `Date32Type::parse`), failing the query where a value is none: the cast
        // `CAST(s AS ...)` of a failing value, whose error the host raises.
        if let (name @ ("to_timestamp" | "to_date"), [s]) = (function.name(), function.args()) {
            let to = match name {
                "to_timestamp" => DataType::Timestamp(TimeUnit::Nanosecond, None),
                _ => DataType::Date32,
            };
            if function.return_type() == &to && string_column(s, input).is_some() {
                return cast_node(s, &to, input, OnFail::Error);
            }
        }
        match function.name() {
            "date_part" => return date_part_node(function, input),
            "date_trunc" | "datetrunc" => return date_trunc_node(function, input),
            "starts_with" | "ends_with" | "contains" => return affix_node(function, input),
            "regexp_like" => return regexp_like_node(function, input),
            "regexp_count" => return regexp_count_node(function, input),
            "regexp_instr" => return regexp_instr_node(function, input),
            "character_length" | "char_length" | "length" | "octet_length" | "bit_length"
            | "ascii" => return length_node(function, input),
            "abs" | "nullif" | "greatest" | "least" => return as_case(function, input, data_type),
            "to_timestamp"
            | "to_timestamp_seconds"
            | "to_timestamp_millis"
            | "to_timestamp_micros"
            | "to_timestamp_nanos" => return to_timestamp_node(function, input, data_type),
            "strpos" | "instr" | "position" => return strpos_node(function, input),
            "floor" | "ceil" | "trunc" | "sqrt" | "round" => {
                return float_function_node(function, input, data_type)
            }
            "gcd" | "lcm" | "factorial" | "isnan" | "iszero" | "signum" | "nanvl" => {
                return number_function_node(function, input, data_type)
            }
            "find_in_set" => return find_in_set_node(function, input, data_type),
            _ => {}
        }
        return Err(Unsupported(format!(
            "function `{}` has no device kernel",
            function.name()
        )));
    }
    Err(Unsupported(format!("`{expr}` has no device kernel")))
}

/// A string's view words, where it has at most 12 bytes: its 16-byte view (length, then
/// the bytes inline, zero-padded), as a group key and as a literal compared with views.
pub(crate) fn string_key(bytes: &[u8]) -> Option<[u64; KEY_WORDS]> {
    if bytes.len() > 12 {
        return None;
    }
    let mut view = [0u8; 16];
    view[..4].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
    view[4..4 + bytes.len()].copy_from_slice(bytes);
    Some([
        u64::from_le_bytes(view[..8].try_into().expect("8 bytes")),
        u64::from_le_bytes(view[8..].try_into().expect("8 bytes")),
    ])
}

/// A string's two lanes as a join key: the first 8 bytes of its view (its length, then
/// its first 4 bytes, zero-padded), then the view's last 8 bytes where it has at most 12
/// bytes (the rest of it, zero-padded: the lanes are the value), else the hash of all its
/// bytes (`view_key`'s; equal lanes of such values are compared byte by byte after the
/// probe: `join_verify_view`).
pub(crate) fn string_key_lanes(bytes: &[u8]) -> [i64; 2] {
    let mut view = [0u8; 16];
    view[..4].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
    let inline = bytes.len().min(12);
    view[4..4 + inline].copy_from_slice(&bytes[..inline]);
    let first = i64::from_le_bytes(view[..8].try_into().expect("8 bytes"));
    if bytes.len() <= 12 {
        return [
            first,
            i64::from_le_bytes(view[8..].try_into().expect("8 bytes")),
        ];
    }
    let words = bytes.chunks(8).map(|chunk| {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        i64::from_le_bytes(word)
    });
    [first, hash(words) as i64]
}

/// The hash of a row's keys (the same as `join_probe`'s, and as `group_rows`').
pub(crate) fn hash(words: impl Iterator<Item = i64>) -> u64 {
    let mut h: u64 = 0x9E37_79B9_7F4A_7C15;
    for w in words {
        h = (h ^ w as u64).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^= h >> 33;
    }
    h
}

/// The bytes of a string literal (`None`: not a string literal; an error: null).
fn string_literal(expr: &Arc<dyn PhysicalExpr>) -> Result<Option<Vec<u8>>, Unsupported> {
    let Some(literal) = expr.downcast_ref::<Literal>() else {
        return Ok(None);
    };
    let text = match literal.value() {
        ScalarValue::Utf8(v) | ScalarValue::Utf8View(v) | ScalarValue::LargeUtf8(v) => v,
        _ => return Ok(None),
    };
    let Some(text) = text else {
        return Err(Unsupported(
            "a null string literal has no device kernel".into(),
        ));
    };
    Ok(Some(text.as_bytes().to_vec()))
}

/// Whether a `Utf8View` column (or its first `k` characters) equals one of `literals`
/// (negated: none): literals of at most 12 bytes by their views ([`Node::StrIn`]),
/// longer ones by their bytes ([`Node::StrLike`], exact), or-ed. The first `k` characters
/// of a value equal a literal of exactly `k` characters where the value starts with it
/// (UTF-8 is prefix-free), one of fewer where the value is it, and never one of more.
fn string_equals(subject: Subject, literals: Vec<Vec<u8>>, negated: bool) -> Node {
    let Subject {
        index,
        name,
        prefix,
    } = subject;
    let mut short = Vec::new();
    let mut patterns = Vec::new();
    for literal in literals {
        let chars = String::from_utf8_lossy(&literal).chars().count();
        match prefix {
            Some(k) if chars > k => {}
            Some(k) if chars == k => {
                patterns.push(LikePattern::literal(vec![literal], true, false))
            }
            _ => match string_key(&literal) {
                Some(key) => short.push(key),
                None => patterns.push(LikePattern::exact(&literal)),
            },
        }
    }
    let mut tests = Vec::new();
    if !short.is_empty() || patterns.is_empty() {
        // (No word at all: equal to nothing, null where the value is.)
        tests.push(Node::StrIn {
            index,
            name: name.clone(),
            words: short,
            negated: false,
        });
    }
    for pattern in patterns {
        tests.push(Node::StrLike {
            index,
            name: name.clone(),
            pattern,
            negated: false,
        });
    }
    let mut tests = tests.into_iter();
    let mut any = tests.next().expect("at least one test");
    for test in tests {
        any = logical(op::OR, any, test);
    }
    match (negated, any) {
        (false, any) => any,
        // One test negates itself in its kernel.
        (
            true,
            Node::StrIn {
                index, name, words, ..
            },
        ) => Node::StrIn {
            index,
            name,
            words,
            negated: true,
        },
        (
            true,
            Node::StrLike {
                index,
                name,
                pattern,
                ..
            },
        ) => Node::StrLike {
            index,
            name,
            pattern,
            negated: true,
        },
        (true, any) => unary(op::NOT, any),
    }
}

/// A string column of the input: `Utf8View`, `Utf8` or `LargeUtf8` (`None`: not a
/// column, or another type). The device reads the last two through views made of their
/// offsets.
fn view_column(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<(usize, String)> {
    let column = expr.downcast_ref::<Column>()?;
    let field = input.fields().get(column.index())?;
    super::string_type(field.data_type()).then(|| (column.index(), column.name().into()))
}

/// A string column, or a cast of one to another string type (DataFusion's coercion of a
/// function's arguments: the same bytes), as [`view_column`].
fn string_column(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<(usize, String)> {
    let expr = match expr.downcast_ref::<CastExpr>() {
        Some(cast) if super::string_type(cast.cast_type()) => cast.expr(),
        _ => expr,
    };
    view_column(expr, input)
}

/// What a string comparison compares: a string column, or the first `k` characters
/// of one (`substr(col, 1, k)`, `k` at least 1).
struct Subject {
    index: usize,
    name: String,
    prefix: Option<usize>,
}

fn view_subject(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<Subject> {
    if let Some((index, name)) = view_column(expr, input) {
        return Some(Subject {
            index,
            name,
            prefix: None,
        });
    }
    let function = expr.downcast_ref::<ScalarFunctionExpr>()?;
    if !matches!(function.name(), "substr" | "substring") {
        return None;
    }
    let [column, start, count] = function.args() else {
        return None;
    };
    let (index, name) = view_column(column, input)?;
    let k = usize::try_from(int_literal(count)?)
        .ok()
        .filter(|k| *k >= 1)?;
    (int_literal(start)? == 1).then_some(Subject {
        index,
        name,
        prefix: Some(k),
    })
}

/// `col = 'x'`, `'x' = col`, `col <> 'x'` over a string column.
fn string_equality(binary: &BinaryExpr, input: &Schema) -> Result<Option<Node>, Unsupported> {
    let negated = match binary.op() {
        Operator::Eq => false,
        Operator::NotEq => true,
        _ => return Ok(None),
    };
    let (subject, literal) = match view_subject(binary.left(), input) {
        Some(c) => (c, binary.right()),
        None => match view_subject(binary.right(), input) {
            Some(c) => (c, binary.left()),
            None => return Ok(None),
        },
    };
    let Some(bytes) = string_literal(literal)? else {
        return Ok(None);
    };
    Ok(Some(string_equals(subject, vec![bytes], negated)))
}

/// `a <op> b` of strings where [`string_equality`] does not apply: two string columns
/// (or casts of them between string types), or a column and a literal under `<`, `<=`,
/// `>`, `>=` ([`Node::StrCompare`]).
fn string_comparison(binary: &BinaryExpr, input: &Schema) -> Option<Node> {
    let op = comparison_op(binary.op())?;
    let side = |e: &Arc<dyn PhysicalExpr>| match string_column(e, input) {
        Some((index, name)) => Some(ConcatPart::Column { index, name }),
        None => string_literal(e).ok()?.map(ConcatPart::Literal),
    };
    let sides = [side(binary.left())?, side(binary.right())?];
    if !sides.iter().any(|s| matches!(s, ConcatPart::Column { .. })) {
        return None;
    }
    Some(Node::StrCompare {
        sides: Box::new(sides),
        op,
    })
}

/// The comparison `op` of a comparison operator ([`op::EQ`] to [`op::GE`]).
fn comparison_op(operator: &Operator) -> Option<u32> {
    Some(match operator {
        Operator::Eq => op::EQ,
        Operator::NotEq => op::NE,
        Operator::Lt => op::LT,
        Operator::LtEq => op::LE,
        Operator::Gt => op::GT,
        Operator::GtEq => op::GE,
        _ => return None,
    })
}

/// `col IN ('x', 'y', ...)` and `NOT IN` over a string column.
fn string_in_list(
    expr: &Arc<dyn PhysicalExpr>,
    list: &[Arc<dyn PhysicalExpr>],
    negated: bool,
    input: &Schema,
) -> Result<Node, Unsupported> {
    let Some(subject) = view_subject(expr, input) else {
        // Numbers: `x = a OR x = b ...` (NOT of it for NOT IN), which has IN's
        // three-valued logic for a list of non-null literals.
        if list.is_empty()
            || list
                .iter()
                .any(|item| item.downcast_ref::<Literal>().is_none())
        {
            return Err(Unsupported(format!(
                "`{expr} IN (...)` has no device kernel (a list of literals only)"
            )));
        }
        let equal = |item: &Arc<dyn PhysicalExpr>| -> Arc<dyn PhysicalExpr> {
            Arc::new(BinaryExpr::new(expr.clone(), Operator::Eq, item.clone()))
        };
        let mut any = equal(&list[0]);
        for item in &list[1..] {
            any = Arc::new(BinaryExpr::new(any, Operator::Or, equal(item)));
        }
        if negated {
            any = Arc::new(NotExpr::new(any));
        }
        return compile(&any, input).map(|(node, _)| node);
    };
    if list.is_empty() {
        return Err(Unsupported("an empty IN list has no device kernel".into()));
    }
    let mut literals = Vec::with_capacity(list.len());
    for item in list {
        literals.push(
            string_literal(item)?.ok_or_else(|| {
                Unsupported(format!("`{item}` in an IN list has no device kernel"))
            })?,
        );
    }
    Ok(string_equals(subject, literals, negated))
}

/// A projection's string value the device computes: [`substr_node`]'s, or `upper(col)`,
/// `lower(col)` or `initcap(col)` of a string column ([`Node::StrCase`]). With its
/// type: the column's.
pub(crate) fn string_node(
    expr: &Arc<dyn PhysicalExpr>,
    input: &Schema,
) -> Option<(Node, DataType)> {
    if let Some(substr) = substr_node(expr, input) {
        return Some(substr);
    }
    if let Some(concat) = concat_node(expr, input) {
        return Some(concat);
    }
    if let Some(text) = text_node(expr, input) {
        return Some(text);
    }
    if let Some(choice) = choice_node(expr, input) {
        return Some(choice);
    }
    let function = expr.downcast_ref::<ScalarFunctionExpr>()?;
    // `to_char` (`date_format`) of a date with a literal format chrono writes as fields.
    if let ("to_char", [x, format]) = (function.name(), function.args()) {
        let out = expr.data_type(input).ok()?;
        let program =
            super::convert::date_format(std::str::from_utf8(&string_literal(format).ok()??).ok()?)?;
        let (node, from) = compile(x, input).ok()?;
        if from != DataType::Date32 || !super::string_type(&out) {
            return None;
        }
        let node = Node::ToText {
            input: Box::new(node),
            text: Text::DateFormat(program),
            out: out.clone(),
        };
        return Some((node, out));
    }
    if let ("to_hex" | "chr", [x]) = (function.name(), function.args()) {
        let out = expr.data_type(input).ok()?;
        let (node, from) = compile(x, input).ok()?;
        let text = match function.name() {
            "to_hex" if kind(&from).ok()? == Kind::Int => Text::Hex,
            "chr" if from == DataType::Int64 => Text::Char,
            _ => return None,
        };
        let node = Node::ToText {
            input: Box::new(node),
            text,
            out: out.clone(),
        };
        return Some((node, out));
    }
    if matches!(function.name(), "lpad" | "rpad") {
        let (column, target, fill) = match function.args() {
            [column, target] => (column, target, None),
            [column, target, fill] => (column, target, Some(fill)),
            _ => return None,
        };
        let out = expr.data_type(input).ok()?;
        let (index, name) = string_column(column, input)?;
        let target = int_literal(target)?.max(0);
        if target > 16_384 {
            return None;
        }
        let fill = match fill {
            Some(fill) => string_literal(fill).ok()??,
            None => b" ".to_vec(),
        };
        let node = Node::Pad {
            index,
            name,
            target: target as u64,
            fill,
            right: function.name() == "rpad",
            out: out.clone(),
        };
        return super::string_type(&out).then_some((node, out));
    }
    if let ("reverse" | "repeat" | "translate" | "overlay", [column, rest @ ..]) =
        (function.name(), function.args())
    {
        let out = expr.data_type(input).ok()?;
        let (index, name) = string_column(column, input)?;
        let op = match (function.name(), rest) {
            ("reverse", []) => Transform::Reverse,
            // DataFusion's: nothing for a count of 0 or less.
            ("repeat", [n]) => {
                let n = u64::try_from(int_literal(n)?.max(0)).ok()?;
                if n > MAX_REPEAT {
                    return None;
                }
                Transform::Repeat(n)
            }
            ("translate", [from, to]) => {
                let (Ok(Some(from)), Ok(Some(to))) = (string_literal(from), string_literal(to))
                else {
                    return None;
                };
                Transform::translate(&from, &to)?
            }
            // A start below 1 is DataFusion's error: the host's.
            ("overlay", [with, start, count @ ..]) if count.len() < 2 => {
                let with = string_literal(with).ok()??;
                let start = int_literal(start).filter(|s| *s >= 1)?;
                let count = match count {
                    [count] => int_literal(count)?,
                    _ => std::str::from_utf8(&with).ok()?.chars().count() as i64,
                };
                Transform::Overlay {
                    prefix: (start - 1) as u64,
                    end: (start - 1).saturating_add(count).max(0) as u64,
                    with,
                }
            }
            _ => return None,
        };
        let node = Node::Transform {
            index,
            name,
            op,
            out: out.clone(),
        };
        return super::string_type(&out).then_some((node, out));
    }
    if function.name() == "regexp_replace" {
        return regexp_replace_node(function, input);
    }
    if let ("replace", [column, from, to]) = (function.name(), function.args()) {
        let out = expr.data_type(input).ok()?;
        let (index, name) = string_column(column, input)?;
        let (Ok(Some(from)), Ok(Some(to))) = (string_literal(from), string_literal(to)) else {
            return None;
        };
        let node = Node::Replace {
            index,
            name,
            from,
            to,
            out: out.clone(),
        };
        return super::string_type(&out).then_some((node, out));
    }
    if let ("btrim" | "trim" | "ltrim" | "rtrim", [column, chars]) =
        (function.name(), function.args())
    {
        // Characters to take off: ASCII ones only (a set of bits, one per byte value).
        let chars = string_literal(chars).ok()??;
        let (index, name) = view_column(column, input)?;
        let node = Node::Trim {
            index,
            name,
            left: function.name() != "rtrim",
            right: function.name() != "ltrim",
            set: ascii_set(&chars)?,
        };
        return Some((node, input.field(index).data_type().clone()));
    }
    let [column] = function.args() else {
        return None;
    };
    let (index, name) = view_column(column, input)?;
    let node = match function.name() {
        "upper" | "lower" | "initcap" => Node::StrCase {
            index,
            name,
            case: match function.name() {
                "upper" => Case::Upper,
                "lower" => Case::Lower,
                _ => Case::Initcap,
            },
        },
        "btrim" | "trim" | "ltrim" | "rtrim" => Node::Trim {
            index,
            name,
            left: function.name() != "rtrim",
            right: function.name() != "ltrim",
            set: ascii_set(b" ").expect("a space is ASCII"),
        },
        _ => return None,
    };
    Some((node, input.field(index).data_type().clone()))
}

/// `chars` as a set of ASCII bytes (bit `b` of the pair for byte `b`); `None` where one
/// is not ASCII.
fn ascii_set(chars: &[u8]) -> Option<[u64; 2]> {
    let mut set = [0u64; 2];
    for &b in chars {
        if b >= 128 {
            return None;
        }
        set[usize::from(b / 64)] |= 1 << (b % 64);
    }
    Some(set)
}

/// A string the device reads as one part of a row's value: a string literal, or a string
/// column (or a cast of one between string types). (A string the device computes, a
/// value cast to one say, is made a column first: [`DeviceExpr::compile`](super::DeviceExpr::compile).)
fn string_part(e: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<ConcatPart> {
    if let Ok(Some(bytes)) = string_literal(e) {
        return Some(ConcatPart::Literal(bytes));
    }
    let (index, name) = string_column(e, input)?;
    Some(ConcatPart::Column { index, name })
}

/// A `CASE` whose values are strings ([`Node::StrChoice`]), and `nullif(a, b)` of strings
/// as `CASE WHEN a = b THEN NULL ELSE a END`. (DataFusion writes `coalesce` as a `CASE`.)
fn choice_node(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<(Node, DataType)> {
    let out = expr.data_type(input).ok()?;
    if !super::string_type(&out) {
        return None;
    }
    let nullif;
    let case = match expr.downcast_ref::<CaseExpr>() {
        Some(case) => case,
        None => {
            let function = expr.downcast_ref::<ScalarFunctionExpr>()?;
            let ("nullif", [a, b]) = (function.name(), function.args()) else {
                return None;
            };
            let null: Arc<dyn PhysicalExpr> =
                Arc::new(Literal::new(ScalarValue::try_from(&out).ok()?));
            let equal: Arc<dyn PhysicalExpr> =
                Arc::new(BinaryExpr::new(a.clone(), Operator::Eq, b.clone()));
            nullif = CaseExpr::try_new(None, vec![(equal, null)], Some(a.clone())).ok()?;
            &nullif
        }
    };
    let mut parts = Vec::new();
    // A value's part, or -1 for a null literal.
    let mut index_of = |value: &Arc<dyn PhysicalExpr>| -> Option<i64> {
        if let Some(literal) = value.downcast_ref::<Literal>() {
            if literal.value().is_null() {
                return Some(-1);
            }
        }
        parts.push(string_part(value, input)?);
        Some(parts.len() as i64 - 1)
    };
    let mut branches = Vec::with_capacity(case.when_then_expr().len());
    for (when, then) in case.when_then_expr() {
        let condition: Arc<dyn PhysicalExpr> = match case.expr() {
            Some(base) => Arc::new(BinaryExpr::new(base.clone(), Operator::Eq, when.clone())),
            None => when.clone(),
        };
        let (condition, t) = compile(&condition, input).ok()?;
        if t != DataType::Boolean {
            return None;
        }
        branches.push((condition, Node::Literal(Some(index_of(then)?))));
    }
    let otherwise = match case.else_expr() {
        Some(e) => index_of(e)?,
        None => -1,
    };
    let which = Node::Case {
        branches,
        otherwise: Box::new(Node::Literal(Some(otherwise))),
    };
    let node = Node::StrChoice {
        which: Box::new(which),
        parts,
        out: out.clone(),
    };
    Some((node, out))
}

/// `CAST(x AS <string type>)` (or `TRY_CAST`: writing a value never fails) of an
/// expression of integers, decimals, dates, Booleans or timestamps (of no zone or a fixed
/// one): [`Node::ToText`].
fn text_node(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<(Node, DataType)> {
    let (inner, out) = if let Some(cast) = expr.downcast_ref::<CastExpr>() {
        (cast.expr(), cast.cast_type())
    } else {
        let cast = expr.downcast_ref::<TryCastExpr>()?;
        (cast.expr(), cast.cast_type())
    };
    if !super::string_type(out) {
        return None;
    }
    let (node, from) = compile(inner, input).ok()?;
    let text = match (kind(&from).ok()?, &from) {
        (Kind::Int, _) => Text::Int,
        (Kind::Decimal(scale), DataType::Decimal128(precision, _)) => Text::Decimal {
            precision: *precision,
            scale: scale as u8,
        },
        (Kind::Date, _) => Text::Date,
        (Kind::Bool, _) => Text::Bool,
        // The local time of a fixed zone (changing ones are the host's).
        (Kind::Timestamp(unit), DataType::Timestamp(_, zone)) => {
            let per_second = units_per_day(unit) / 86_400;
            let offset = match zone {
                None => None,
                Some(z) => Some(i32::try_from(fixed_offset(z, unit)? / per_second).ok()?),
            };
            let node = local_time(node, zone, unit).ok()?;
            return Some((
                Node::ToText {
                    input: Box::new(node),
                    text: Text::Timestamp { per_second, offset },
                    out: out.clone(),
                },
                out.clone(),
            ));
        }
        _ => return None,
    };
    let node = Node::ToText {
        input: Box::new(node),
        text,
        out: out.clone(),
    };
    Some((node, out.clone()))
}

/// `concat(...)`, `concat_ws(sep, ...)` (a literal separator) or a tree of `||` whose
/// operands are string columns (or casts of them between string types: the same bytes)
/// and string literals, with the expression's type: [`Node::Concat`]. DataFusion drops
/// `concat`'s null literals itself; a null literal elsewhere stays on the host.
fn concat_node(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<(Node, DataType)> {
    let out = expr.data_type(input).ok()?;
    if !super::string_type(&out) {
        return None;
    }
    let part = |e: &Arc<dyn PhysicalExpr>| string_part(e, input);
    let (parts, joined) = if let Some(function) = expr.downcast_ref::<ScalarFunctionExpr>() {
        let joined = match function.name() {
            "concat" => Joined::SkipNulls,
            "concat_ws" => Joined::Separated,
            _ => return None,
        };
        let parts = function
            .args()
            .iter()
            .map(part)
            .collect::<Option<Vec<_>>>()?;
        if joined == Joined::Separated && !matches!(parts.first(), Some(ConcatPart::Literal(_))) {
            return None;
        }
        (parts, joined)
    } else {
        fn operands(e: &Arc<dyn PhysicalExpr>, out: &mut Vec<Arc<dyn PhysicalExpr>>) {
            // A cast between string types (DataFusion's coercion of a nested `||`).
            let inner = match e.downcast_ref::<CastExpr>() {
                Some(cast) if super::string_type(cast.cast_type()) => cast.expr(),
                _ => e,
            };
            match inner.downcast_ref::<BinaryExpr>() {
                Some(b) if *b.op() == Operator::StringConcat => {
                    operands(b.left(), out);
                    operands(b.right(), out);
                }
                _ => out.push(e.clone()),
            }
        }
        let binary = expr.downcast_ref::<BinaryExpr>()?;
        if *binary.op() != Operator::StringConcat {
            return None;
        }
        let mut all = Vec::new();
        operands(expr, &mut all);
        let parts = all.iter().map(part).collect::<Option<Vec<_>>>()?;
        (parts, Joined::NullIfAny)
    };
    Some((
        Node::Concat {
            parts,
            joined,
            out: out.clone(),
        },
        out,
    ))
}

/// The padding of `lpad`/`rpad` to `target` characters: `fill` repeated to `target`
/// characters, and the bytes after each number of them (`target + 1` offsets; all 0
/// for an empty fill).
pub(crate) fn padding(fill: &[u8], target: u64) -> (Vec<u8>, Vec<u64>) {
    let fill = std::str::from_utf8(fill).unwrap_or_default();
    let mut chars = fill.chars().cycle();
    let (mut bytes, mut offsets) = (String::new(), vec![0u64]);
    for _ in 0..target {
        if let Some(c) = chars.next() {
            bytes.push(c);
        }
        offsets.push(bytes.len() as u64);
    }
    (bytes.into_bytes(), offsets)
}

/// The bytes of a value a string slice keeps: [`Node::Substr`]'s characters, or
/// [`Node::Trim`]'s value less its spaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bounds {
    /// Characters `first` to `end` (exclusive; `u64::MAX`: all the rest) of
    /// [`substr_chars`], clamped to the value.
    Chars(u64, u64),
    /// [`Bounds::Chars`] of `c - first` to `c - end` (each 0 at least), `c` the value's
    /// characters: `right(s, n)` for `n > 0` is `(n, 0)`, `left(s, n)` for `n < 0`
    /// `(u64::MAX, |n|)`, as DataFusion's count from the end.
    FromEnd(u64, u64),
    /// The value less the ASCII bytes of `set` at the start (`left`) and the end
    /// (`right`).
    Trim {
        left: bool,
        right: bool,
        set: [u64; 2],
    },
    /// [`Node::SplitPart`]'s part: `delimiter`'s first `len` bytes (1 to 8,
    /// little-endian), part `n` (not 0); with `through`, the value up to the part's end
    /// or from its start (`substr_index`).
    Split {
        delimiter: u64,
        len: u32,
        n: i64,
        through: bool,
    },
}

impl Bounds {
    /// The slice of `node` (a `Substr` or a `Trim`), with its column.
    pub(crate) fn of(node: &Node) -> Option<(Self, usize, &str)> {
        match node {
            Node::Substr {
                index,
                name,
                first,
                end,
                from_end,
            } => {
                let bounds = match from_end {
                    true => Self::FromEnd(*first, *end),
                    false => Self::Chars(*first, *end),
                };
                Some((bounds, *index, name))
            }
            Node::Trim {
                index,
                name,
                left,
                right,
                set,
            } => Some((
                Self::Trim {
                    left: *left,
                    right: *right,
                    set: *set,
                },
                *index,
                name,
            )),
            Node::SplitPart {
                index,
                name,
                delimiter,
                n,
                through,
            } => {
                let mut packed = [0u8; 8];
                packed[..delimiter.len()].copy_from_slice(delimiter);
                Some((
                    Self::Split {
                        delimiter: u64::from_le_bytes(packed),
                        len: delimiter.len() as u32,
                        n: *n,
                        through: *through,
                    },
                    *index,
                    name,
                ))
            }
            _ => None,
        }
    }

    /// The byte range of `value` (UTF-8) kept, as `view_substr` finds it: characters
    /// counted by their lead bytes (those that are not `10xxxxxx`); spaces are bytes
    /// 0x20; a split's delimiters found byte by byte, leftmost (or, from the end,
    /// rightmost) first, not overlapping.
    pub(crate) fn range(self, value: &[u8]) -> std::ops::Range<usize> {
        match self {
            Self::Split {
                delimiter,
                len,
                n,
                through,
            } => {
                let delimiter = &delimiter.to_le_bytes()[..len as usize];
                let at = |i: usize| value[i..].starts_with(delimiter);
                let len = delimiter.len();
                let whole = 0..value.len();
                if n > 0 {
                    let (mut skip, mut start, mut from) = (n - 1, 0, 0);
                    loop {
                        match (from..=value.len().saturating_sub(len))
                            .find(|&i| i + len <= value.len() && at(i))
                        {
                            Some(i) if skip == 0 && through => return 0..i,
                            Some(i) if skip == 0 => return start..i,
                            Some(i) => (skip, start, from) = (skip - 1, i + len, i + len),
                            None if through => return whole,
                            None if skip == 0 => return start..value.len(),
                            None => return 0..0,
                        }
                    }
                }
                // From the end: the part before -n - 1 delimiters.
                let (mut skip, mut end, mut by) = (!n, value.len(), value.len());
                loop {
                    let found = (by >= len)
                        .then(|| (0..=by - len).rev().find(|&i| at(i)))
                        .flatten();
                    match found {
                        Some(i) if skip == 0 && through => return i + len..value.len(),
                        Some(i) if skip == 0 => return i + len..end,
                        Some(i) => (skip, end, by) = (skip - 1, i, i),
                        None if through => return whole,
                        None if skip == 0 => return 0..end,
                        None => return 0..0,
                    }
                }
            }
            Self::FromEnd(first, end) => {
                let c = value.iter().filter(|b| *b & 0xC0 != 0x80).count() as u64;
                Self::Chars(c.saturating_sub(first), c.saturating_sub(end)).range(value)
            }
            Self::Chars(first, end) => {
                let (mut from, mut to) = (value.len(), value.len());
                let leads = value
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| *b & 0xC0 != 0x80)
                    .map(|(at, _)| at);
                for (c, at) in leads.enumerate() {
                    if c as u64 == first {
                        from = at;
                    }
                    if c as u64 == end {
                        to = at;
                        break;
                    }
                }
                from..to
            }
            Self::Trim { left, right, set } => {
                let trimmed =
                    |b: &&u8| **b < 128 && set[usize::from(**b / 64)] >> (**b % 64) & 1 != 0;
                let from = match left {
                    true => value.iter().take_while(trimmed).count(),
                    false => 0,
                };
                let to = match right {
                    true => value.len() - value[from..].iter().rev().take_while(trimmed).count(),
                    false => value.len(),
                };
                from..to
            }
        }
    }

    #[cfg(feature = "cuda")]
    /// `view_substr`'s arguments: `first`, `end` and the mode's bits above bit 0 (0:
    /// characters; bits 1 and 2: the trim of the start's and the end's bytes of the set
    /// in `first` and `end`; bit 3 and the length in bits 8 to 15: a split, its delimiter
    /// in `first`, its part in `end`, with bit 5 the value through the part
    /// (`substr_index`); bit 4: characters counted from the end).
    pub(crate) fn kernel_args(self) -> (u64, u64, u32) {
        match self {
            Self::Chars(first, end) => (first, end, 0),
            Self::FromEnd(first, end) => (first, end, 16),
            Self::Trim { left, right, set } => (
                set[0],
                set[1],
                (u32::from(left) | u32::from(right) << 1) << 1,
            ),
            Self::Split {
                delimiter,
                len,
                n,
                through,
            } => (delimiter, n as u64, 8 | u32::from(through) << 5 | len << 8),
        }
    }

    #[cfg(feature = "cuda")]
    /// Whether a result may pass 12 bytes (at most 3 characters cannot).
    pub(crate) fn may_be_long(self) -> bool {
        match self {
            Self::Chars(first, end) => end.saturating_sub(first) > 3,
            Self::FromEnd(first, end) => first.saturating_sub(end) > 3,
            Self::Split { .. } => true,
            Self::Trim { .. } => true,
        }
    }
}

/// What [`Node::Transform`] makes of each value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Transform {
    /// Its characters in reverse order (DataFusion's `chars().rev()`).
    Reverse,
    /// The value `n` times (a literal of 0 to [`MAX_REPEAT`]).
    Repeat(u64),
    /// Each ASCII byte `b` as `table[b]`, none where that is 255 (`translate` with ASCII
    /// literals, as DataFusion's byte table: the first occurrence of a byte in `from`
    /// maps it to `to`'s byte at that place, or deletes it past `to`'s end); other
    /// bytes as they are.
    Translate(Box<[u8; 128]>),
    /// `overlay(s placing with from start [for count])` of literals (`start` at least
    /// 1): the value's bytes before character `prefix` (`start - 1`), then `with`, then
    /// the value's from character `end` (`start - 1 + count`, 0 at least; `count`
    /// `with`'s characters by default); a character past the value is its end, as
    /// DataFusion's `overlay_bounds`.
    Overlay {
        prefix: u64,
        end: u64,
        with: Vec<u8>,
    },
}

impl Transform {
    /// `translate`'s table of ASCII `from` and `to`, as DataFusion builds it.
    pub(crate) fn translate(from: &[u8], to: &[u8]) -> Option<Self> {
        if !from.is_ascii() || !to.is_ascii() {
            return None;
        }
        let mut table: [u8; 128] = std::array::from_fn(|b| b as u8);
        let mut seen = [false; 128];
        for (i, &b) in from.iter().enumerate() {
            if !std::mem::replace(&mut seen[usize::from(b)], true) {
                table[usize::from(b)] = to.get(i).copied().unwrap_or(255);
            }
        }
        Some(Transform::Translate(Box::new(table)))
    }

    /// `value` transformed.
    pub(crate) fn apply(&self, value: &[u8]) -> Vec<u8> {
        match self {
            Transform::Repeat(n) => value.repeat(*n as usize),
            Transform::Reverse => {
                let mut out = Vec::with_capacity(value.len());
                let mut end = value.len();
                for at in (0..value.len()).rev() {
                    if value[at] & 0xC0 != 0x80 {
                        out.extend_from_slice(&value[at..end]);
                        end = at;
                    }
                }
                out
            }
            Transform::Overlay { prefix, end, with } => {
                let at = |k: u64| {
                    (0..value.len())
                        .filter(|&j| value[j] & 0xC0 != 0x80)
                        .nth(k as usize)
                        .unwrap_or(value.len())
                };
                [&value[..at(*prefix)], with, &value[at(*end)..]].concat()
            }
            Transform::Translate(table) => value
                .iter()
                .filter_map(|&b| match table.get(usize::from(b)) {
                    Some(255) => None,
                    Some(&to) => Some(to),
                    None => Some(b),
                })
                .collect(),
        }
    }
}

/// The largest literal count `repeat` takes on the device: the values' bytes times it
/// size the result's buffer, allocated before the rows' lengths are known (more is the
/// host's).
pub(crate) const MAX_REPEAT: u64 = 64;

/// `substr(col, start)` or `substr(col, start, count)` of a string column (`Utf8View`,
/// `Utf8`, `LargeUtf8`) with literal integers, as a projection's (string) value. A
/// negative count (DataFusion's error) and a start of `i64::MIN` (its overflow error)
/// stay on the host, which raises them. With the value's type: the column's.
pub(crate) fn substr_node(
    expr: &Arc<dyn PhysicalExpr>,
    input: &Schema,
) -> Option<(Node, DataType)> {
    let function = expr.downcast_ref::<ScalarFunctionExpr>()?;
    // `left(col, n)` for n >= 0 is `substr(col, 1, n)`; `right(col, n)` for n < 0 (all
    // but the first |n| characters) is `substr(col, |n| + 1)`; the others count from the
    // end (DataFusion's `right(col, i64::MIN)` is empty).
    if let ("left" | "right", [column, n]) = (function.name(), function.args()) {
        let (index, name) = view_column(column, input)?;
        let n = int_literal(n)?;
        let ((first, end), from_end) = match function.name() {
            "left" if n >= 0 => (substr_chars(1, Some(n)), false),
            "right" if n == i64::MIN => ((0, 0), false),
            "right" if n < 0 => (substr_chars(n.checked_neg()?.checked_add(1)?, None), false),
            "left" => ((u64::MAX, n.unsigned_abs()), true),
            _ if n == 0 => ((0, 0), false),
            _ => ((n.unsigned_abs(), 0), true),
        };
        let node = Node::Substr {
            index,
            name,
            first,
            end,
            from_end,
        };
        return Some((node, input.field(index).data_type().clone()));
    }
    // `split_part(col, delimiter, n)` and `substr_index(col, delimiter, n)` (`through`:
    // the value up to the part's end, or from its start), by one split of the value.
    if let (name @ ("split_part" | "substr_index" | "substring_index"), [column, delimiter, n]) =
        (function.name(), function.args())
    {
        let through = name != "split_part";
        let (index, name) = view_column(column, input)?;
        let delimiter = string_literal(delimiter).ok()??;
        // split_part's part 0 is DataFusion's error: the host's.
        let n = int_literal(n).filter(|n| through || *n != 0)?;
        // An empty value: substr_index's of count 0 or of an empty delimiter; else, with
        // an empty delimiter, split_part's value is its one part (parts 1 and -1).
        let whole = !through && delimiter.is_empty() && (n == 1 || n == -1);
        let node = if delimiter.is_empty() || n == 0 {
            let (first, end) = substr_chars(1, if whole { None } else { Some(0) });
            Node::Substr {
                index,
                name,
                first,
                end,
                from_end: false,
            }
        } else if delimiter.len() <= 8 {
            Node::SplitPart {
                index,
                name,
                delimiter,
                n,
                through,
            }
        } else {
            return None;
        };
        return Some((node, input.field(index).data_type().clone()));
    }
    if !matches!(function.name(), "substr" | "substring") {
        return None;
    }
    let (column, start, count) = match function.args() {
        [column, start] => (column, start, None),
        [column, start, count] => (column, start, Some(count)),
        _ => return None,
    };
    let (index, name) = view_column(column, input)?;
    let start = int_literal(start).filter(|s| *s != i64::MIN)?;
    let count = match count {
        Some(count) => Some(int_literal(count).filter(|c| *c >= 0)?),
        None => None,
    };
    let (first, end) = substr_chars(start, count);
    let node = Node::Substr {
        index,
        name,
        first,
        end,
        from_end: false,
    };
    Some((node, input.field(index).data_type().clone()))
}

/// The characters `substr(value, start, count)` takes, as DataFusion 55 computes them:
/// from `first` (0-based) to `end` (exclusive; `u64::MAX` for no count), both clamped to
/// the value where it is read. `start` is 1-based and may be 0 or negative, and the
/// count is taken from it: `substr('abc', -1, 3)` is `'a'`. `count` is at least 0 and
/// `start` more than `i64::MIN` ([`substr_node`]), so `end >= first`.
pub(crate) fn substr_chars(start: i64, count: Option<i64>) -> (u64, u64) {
    let start = start - 1;
    let first = start.max(0) as u64;
    let end = count.map_or(u64::MAX, |c| start.saturating_add(c).max(0) as u64);
    (first, end)
}

/// An integer literal (`Int64`, or `Int32`).
fn int_literal(e: &Arc<dyn PhysicalExpr>) -> Option<i64> {
    match e.downcast_ref::<Literal>()?.value() {
        ScalarValue::Int64(Some(v)) => Some(*v),
        ScalarValue::Int32(Some(v)) => Some(i64::from(*v)),
        _ => None,
    }
}

/// A column whose lanes the device does not load (a string, say), or a cast of a string
/// column between string types, as its validity.
fn validity_of(expr: &Arc<dyn PhysicalExpr>, input: &Schema) -> Option<Node> {
    // A cast between string types is null where its column is.
    if let Some((index, name)) = string_column(expr, input) {
        return Some(Node::Valid { index, name });
    }
    let column = expr.downcast_ref::<Column>()?;
    let field = input.fields().get(column.index())?;
    kind(field.data_type()).is_err().then(|| Node::Valid {
        index: column.index(),
        name: column.name().to_string(),
    })
}

/// `a IS NOT DISTINCT FROM b` as `(a IS NULL AND b IS NULL) OR (a IS NOT NULL AND b IS
/// NOT NULL AND a = b)`, always valid; `IS DISTINCT FROM` its negation.
fn distinct_node(binary: &BinaryExpr, input: &Schema) -> Result<Node, Unsupported> {
    let (a, _) = compile(binary.left(), input)?;
    let (b, _) = compile(binary.right(), input)?;
    let equal: Arc<dyn PhysicalExpr> = Arc::new(BinaryExpr::new(
        binary.left().clone(),
        Operator::Eq,
        binary.right().clone(),
    ));
    let (equal, _) = compile(&equal, input)?;
    let both_null = logical(
        op::AND,
        unary(op::IS_NULL, a.clone()),
        unary(op::IS_NULL, b.clone()),
    );
    let both_valid = logical(
        op::AND,
        unary(op::IS_NOT_NULL, a),
        unary(op::IS_NOT_NULL, b),
    );
    let same = logical(op::OR, both_null, logical(op::AND, both_valid, equal));
    Ok(match binary.op() {
        Operator::IsDistinctFrom => unary(op::NOT, same),
        _ => same,
    })
}

/// `col LIKE 'pattern'` (and `NOT LIKE`) over a string column, for a literal pattern
/// (`%`, `_` and `\` escapes, as arrow reads them); `ILIKE` by the automaton of arrow's
/// regular expression for it ([`ilike_pattern`]).
fn like_node(like: &LikeExpr, input: &Schema) -> Result<Node, Unsupported> {
    let Some((index, name)) = view_column(like.expr(), input) else {
        return Err(Unsupported(format!(
            "`{like}`: LIKE on the device takes a string column"
        )));
    };
    let pattern = match like.pattern().downcast_ref::<Literal>().map(Literal::value) {
        Some(ScalarValue::Utf8(Some(p)) | ScalarValue::Utf8View(Some(p)))
        | Some(ScalarValue::LargeUtf8(Some(p))) => {
            if like.case_insensitive() {
                // ILIKE as arrow matches it (Unicode case folding): its regular
                // expression's automaton; an ASCII pattern whose automaton is too large
                // folds ASCII values only (others are the host's).
                match RegexTable::compile(&ilike_pattern(p)) {
                    Ok(table) => {
                        return Ok(Node::StrRegex {
                            index,
                            name,
                            table: Arc::new(table),
                            negated: like.negated(),
                        })
                    }
                    Err(why) if !p.is_ascii() => {
                        return Err(Unsupported(format!("`{like}`: ILIKE: {why}")))
                    }
                    Err(_) => {}
                }
            }
            LikePattern::parse(p, like.case_insensitive())
        }
        _ => {
            return Err(Unsupported(format!(
                "`{like}`: LIKE on the device takes a literal pattern"
            )))
        }
    };
    Ok(Node::StrLike {
        index,
        name,
        pattern,
        negated: like.negated(),
    })
}

/// Whether `op` matches a regular expression: `Some(negated)`.
fn regex_operator(op: &Operator) -> Option<bool> {
    match op {
        Operator::RegexMatch | Operator::RegexIMatch => Some(false),
        Operator::RegexNotMatch | Operator::RegexNotIMatch => Some(true),
        _ => None,
    }
}

/// A string column matched against a literal regular expression with literal `flags`
/// (`(?flags)` prefixed, as arrow's `regexp_is_match` does; an empty pattern and no flag
/// match every value, as arrow's does), [`Node::StrRegex`]. `what`: the expression, for
/// the reasons.
fn regex_node(
    what: &str,
    (column, pattern, flags): (&Arc<dyn PhysicalExpr>, &Arc<dyn PhysicalExpr>, Option<&str>),
    negated: bool,
    input: &Schema,
) -> Result<Node, Unsupported> {
    let refuse = |why: &str| Unsupported(format!("`{what}`: {why}"));
    let (index, name) = string_column(column, input)
        .ok_or_else(|| refuse("a regular expression on the device matches a string column"))?;
    let pattern = string_literal(pattern)?
        .ok_or_else(|| refuse("a regular expression on the device takes a literal pattern"))?;
    let pattern = String::from_utf8(pattern).map_err(|_| refuse("a pattern not UTF-8"))?;
    let pattern = match flags {
        Some(flags) => format!("(?{flags}){pattern}"),
        None => pattern,
    };
    let table = RegexTable::compile(&pattern).map_err(|why| refuse(&why))?;
    Ok(Node::StrRegex {
        index,
        name,
        table: Arc::new(table),
        negated,
    })
}

/// `regexp_like(col, 'pattern'[, 'flags'])` ([`regex_node`]); flags with `g` are
/// DataFusion's error (the host's).
fn regexp_like_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    let what = function.to_string();
    let (column, pattern, flags) = match function.args() {
        [column, pattern] => (column, pattern, None),
        [column, pattern, flags] => {
            let flags = string_literal(flags)?.ok_or_else(|| {
                Unsupported(format!("`{what}`: flags on the device are a literal"))
            })?;
            (column, pattern, Some(flags))
        }
        _ => {
            return Err(Unsupported(format!(
                "`{what}` takes two or three arguments"
            )))
        }
    };
    let flags = match flags {
        Some(flags) => {
            let flags = String::from_utf8(flags)
                .ok()
                .filter(|f| !f.contains('g'))
                .ok_or_else(|| Unsupported(format!("`{what}`: the global flag (an error)")))?;
            Some(flags)
        }
        None => None,
    };
    regex_node(&what, (column, pattern, flags.as_deref()), false, input)
}

/// `regexp_replace(col, 'pattern', 'replacement'[, 'flags'])` with literals, the pattern
/// made as DataFusion makes it (`g` for every match, other flags prefixed as `(?flags)`):
/// for a replacement of no group reference (`$`, or DataFusion's `\1`),
/// [`Node::RegexReplace`]; else none (the host's).
fn regexp_replace_node(function: &ScalarFunctionExpr, input: &Schema) -> Option<(Node, DataType)> {
    let (column, pattern, replacement, flags) = match function.args() {
        [column, pattern, replacement] => (column, pattern, replacement, None),
        [column, pattern, replacement, flags] => (column, pattern, replacement, Some(flags)),
        _ => return None,
    };
    let out = function.data_type(input).ok()?;
    let (index, name) = string_column(column, input)?;
    let pattern = String::from_utf8(string_literal(pattern).ok()??).ok()?;
    let replacement = string_literal(replacement).ok()??;
    let group = replacement.contains(&b'$')
        || replacement
            .windows(2)
            .any(|w| w[0] == b'\\' && w[1].is_ascii_digit());
    if group {
        return None;
    }
    let flags = match flags {
        Some(flags) => Some(String::from_utf8(string_literal(flags).ok()??).ok()?),
        None => None,
    };
    let (pattern, global) = match flags.as_deref() {
        Some("g") => (pattern, true),
        Some(flags) => (
            format!("(?{}){pattern}", flags.replace('g', "")),
            flags.contains('g'),
        ),
        None => (pattern, false),
    };
    let table = RegexTable::compile(&pattern).ok()?;
    let node = Node::RegexReplace {
        index,
        name,
        table: Arc::new(table),
        replacement,
        global,
        out: out.clone(),
    };
    super::string_type(&out).then_some((node, out))
}

/// `regexp_instr(col, 'pattern'[, start[, n[, 'flags'[, 0]]]])` with literals: `n` at
/// least 1 (else DataFusion's error), the whole match (a capture group's position needs
/// the groups), as [`searched_pattern`] ([`Node::StrRegexInstr`]).
fn regexp_instr_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    let what = function.to_string();
    let args = function.args();
    if !(2..=6).contains(&args.len()) {
        return Err(Unsupported(format!("`{what}` takes two to six arguments")));
    }
    if args.get(5).is_some_and(|sub| int_literal(sub) != Some(0)) {
        return Err(Unsupported(format!(
            "`{what}`: a capture group's position has no device kernel"
        )));
    }
    let (index, name, table, skip) = searched_pattern(&what, args, args.get(4), input)?;
    let nth = match args.get(3) {
        Some(n) => int_literal(n).filter(|&v| v >= 1).ok_or_else(|| {
            Unsupported(format!(
                "`{what}`: its occurrence on the device is a literal of at least 1"
            ))
        })?,
        None => 1,
    };
    Ok(Node::StrRegexInstr {
        index,
        name,
        table,
        skip,
        nth: nth as u64,
    })
}

/// `regexp_count(col, 'pattern'[, start[, 'flags']])` with literals, as
/// [`searched_pattern`] ([`Node::StrRegexCount`]).
fn regexp_count_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    let what = function.to_string();
    let args = function.args();
    if !(2..=4).contains(&args.len()) {
        return Err(Unsupported(format!("`{what}` takes two to four arguments")));
    }
    let (index, name, table, skip) = searched_pattern(&what, args, args.get(3), input)?;
    Ok(Node::StrRegexCount {
        index,
        name,
        table,
        skip,
    })
}

/// What `regexp_count` and `regexp_instr` search, their arguments `args` (the string
/// column, a literal pattern, then an optional literal start) and `flags`: the column,
/// the pattern's automaton, and the characters the search skips (`start` at least 1, the
/// rest of the value a haystack of its own, as DataFusion slices it). Flags without `g`
/// (DataFusion's error) are prefixed as `(?flags)`. `what`: the expression, for the
/// reasons.
fn searched_pattern(
    what: &str,
    args: &[Arc<dyn PhysicalExpr>],
    flags: Option<&Arc<dyn PhysicalExpr>>,
    input: &Schema,
) -> Result<(usize, String, Arc<RegexTable>, u64), Unsupported> {
    let refuse = |why: &str| Unsupported(format!("`{what}`: {why}"));
    let (index, name) = string_column(&args[0], input)
        .ok_or_else(|| refuse("a regular expression on the device matches a string column"))?;
    let pattern = string_literal(&args[1])?
        .ok_or_else(|| refuse("a regular expression on the device takes a literal pattern"))?;
    let pattern = String::from_utf8(pattern).map_err(|_| refuse("a pattern not UTF-8"))?;
    let start = match args.get(2) {
        Some(start) => int_literal(start)
            .filter(|&s| s >= 1)
            .ok_or_else(|| refuse("its start on the device is a literal of at least 1"))?,
        None => 1,
    };
    let pattern = match flags {
        Some(flags) => {
            let flags = string_literal(flags)?
                .and_then(|f| String::from_utf8(f).ok())
                .filter(|f| !f.contains('g'))
                .ok_or_else(|| refuse("flags on the device are a literal without `g`"))?;
            if flags.is_empty() {
                pattern
            } else {
                format!("(?{flags}){pattern}")
            }
        }
        None => pattern,
    };
    let table = RegexTable::compile(&pattern).map_err(|why| refuse(&why))?;
    Ok((index, name, Arc::new(table), (start - 1) as u64))
}

/// `starts_with(col, 'x')`, `ends_with(col, 'x')` and `contains(col, 'x')` over a string
/// column: `LIKE` patterns of one literal piece, anchored at the start, the end, or
/// neither ([`Node::StrLike`]); an empty literal matches every value.
fn affix_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    let refuse = |why: &str| Unsupported(format!("`{function}`: {why}"));
    let [column, literal] = function.args() else {
        return Err(refuse("takes two arguments"));
    };
    let (index, name) = view_column(column, input)
        .ok_or_else(|| refuse("its first argument is a string column on the device"))?;
    let piece = string_literal(literal)?
        .ok_or_else(|| refuse("its second argument is a string literal on the device"))?;
    let (anchored_start, anchored_end) = match function.name() {
        "starts_with" => (true, false),
        "ends_with" => (false, true),
        _ => (false, false),
    };
    let pattern = if piece.is_empty() {
        LikePattern::literal(Vec::new(), false, false)
    } else {
        LikePattern::literal(vec![piece], anchored_start, anchored_end)
    };
    Ok(Node::StrLike {
        index,
        name,
        pattern,
        negated: false,
    })
}

/// `character_length(col)` (`length`, `char_length`), `octet_length(col)` and
/// `bit_length(col)` of a string column ([`Node::StrLength`]).
fn length_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    let [column] = function.args() else {
        return Err(Unsupported(format!("`{function}` takes one argument")));
    };
    let (index, name) = view_column(column, input).ok_or_else(|| {
        Unsupported(format!(
            "`{function}`: its argument is a string column on the device"
        ))
    })?;
    Ok(Node::StrLength {
        index,
        name,
        measure: match function.name() {
            "character_length" | "char_length" | "length" => 1,
            "ascii" => 2,
            _ => 0,
        },
        mul: if function.name() == "bit_length" {
            8
        } else {
            1
        },
    })
}

/// `floor`, `ceil`, `trunc`, `sqrt` and `round(x[, d])` (a literal `d`) of a Float64.
fn float_function_node(
    function: &ScalarFunctionExpr,
    input: &Schema,
    data_type: &DataType,
) -> Result<Node, Unsupported> {
    let refuse = |why: &str| Err(Unsupported(format!("`{function}`: {why}")));
    let (x, places) = match function.args() {
        [x] => (x, None),
        [x, d] if matches!(function.name(), "round" | "trunc") => (x, Some(d)),
        _ => return refuse("its arguments have no device kernel"),
    };
    let (node, t) = compile(x, input)?;
    if let ("round", DataType::Decimal128(_, scale), DataType::Decimal128(precision, out_scale)) =
        (function.name(), &t, data_type)
    {
        return round_decimal(node, (*scale, *precision, *out_scale), places)
            .map_err(|why| Unsupported(format!("`{function}`: {why}")));
    }
    // `trunc(x[, d])` of a decimal keeps its type: `(x / f) * f` for f = 10^(scale - d)
    // (DataFusion's `compute_truncate_decimal`; nothing where d >= scale), a truncated
    // division (op 34, unchecked) and the product (never larger than x).
    if let ("trunc", DataType::Decimal128(_, scale)) = (function.name(), &t) {
        let d = match places {
            Some(d) => match int_literal(d) {
                Some(d) => d,
                None => return refuse("the precision is not a literal"),
            },
            None => 0,
        };
        if data_type != &t {
            return refuse(&format!("{t} to {data_type}"));
        }
        let exp = i64::from(*scale).saturating_sub(d);
        if exp <= 0 {
            return Ok(node);
        }
        let Some(factor) = u32::try_from(exp).ok().and_then(pow10) else {
            return refuse("more than 18 digits truncated");
        };
        let step = |op, input| Node::Unary {
            op,
            input: Box::new(input),
            mul: factor,
            lo: i64::MIN,
            hi: i64::MAX,
            on_fail: OnFail::Error,
        };
        return Ok(step(op::CAST, step(op::DECIMAL_TO_INT, node)));
    }
    // `floor` and `ceil` of a decimal keep its type: the value to a multiple of 10^scale
    // (unchanged at scale 0), checked against its precision (DataFusion's
    // `apply_decimal_op`).
    if let ("floor" | "ceil", DataType::Decimal128(precision, scale)) = (function.name(), &t) {
        if data_type != &t || *scale < 0 {
            return refuse(&format!("{t} to {data_type}"));
        }
        if *scale == 0 {
            return Ok(node);
        }
        let (lo, hi) = precision_range(*precision);
        return Ok(Node::Unary {
            op: match function.name() {
                "floor" => op::FLOOR_DECIMAL,
                _ => op::CEIL_DECIMAL,
            },
            input: Box::new(node),
            mul: pow10(*scale as u32).ok_or_else(|| Unsupported("a scale past 18".into()))?,
            lo,
            hi,
            on_fail: OnFail::Error,
        });
    }
    if t != DataType::Float64 || *data_type != DataType::Float64 {
        return refuse(&format!("{t} has no device kernel (Float64 only)"));
    }
    let (op, mul) = match function.name() {
        "floor" => (op::FLOOR, 1),
        "ceil" => (op::CEIL, 1),
        "trunc" => (op::TRUNC, 1),
        "sqrt" => (op::SQRT, 1),
        _ => {
            let d = match places {
                Some(d) => match int_literal(d).and_then(|d| i32::try_from(d).ok()) {
                    Some(d) => d,
                    None => return refuse("the decimal places are not a literal"),
                },
                None => 0,
            };
            (op::ROUND, 10_f64.powi(d).to_bits() as i64)
        }
    };
    Ok(Node::Unary {
        op,
        input: Box::new(node),
        mul,
        lo: i64::MIN,
        hi: i64::MAX,
        on_fail: OnFail::Error,
    })
}

/// `round(x[, d])` of a decimal of `scale` (0 to 18) to a literal `d` (0 without one),
/// the result a decimal of `precision` and `out_scale` (DataFusion's: `min(scale, d)`,
/// at least 0), as DataFusion's `round_decimal` computes it: the value rounded half away
/// from zero to `d` places ([`op::DOWNSCALE`], unchanged where `d >= scale`), then, for
/// a negative `d`, times `10^-d` back to scale 0 ([`op::CAST`]), checked against the
/// result's precision (past it DataFusion fails: the host raises its error). A negative
/// `d` past the value's digits rounds every value to 0, as DataFusion's (which skips the
/// division there).
fn round_decimal(
    node: Node,
    (scale, precision, out_scale): (i8, u8, i8),
    places: Option<&Arc<dyn PhysicalExpr>>,
) -> Result<Node, String> {
    let d = match places {
        Some(d) => int_literal(d)
            .and_then(|d| i32::try_from(d).ok())
            .ok_or("the decimal places are not a literal")?,
        None => 0,
    };
    let scale = i32::from(scale);
    if scale < 0 || i32::from(out_scale) != scale.min(d.max(0)) {
        return Err(format!(
            "a result of scale {out_scale} for {d} places of scale {scale}"
        ));
    }
    if d >= scale {
        return Ok(node);
    }
    let (lo, hi) = precision_range(precision);
    let factor = pow10((scale - d) as u32).ok_or("more than 18 places rounded off")?;
    if d >= 0 {
        return Ok(Node::Unary {
            op: op::DOWNSCALE,
            input: Box::new(node),
            mul: factor,
            lo,
            hi,
            on_fail: OnFail::Error,
        });
    }
    let back = pow10(d.unsigned_abs()).ok_or("more than 18 places rounded off")?;
    Ok(Node::Unary {
        op: op::CAST,
        input: Box::new(Node::Unary {
            op: op::DOWNSCALE,
            input: Box::new(node),
            mul: factor,
            lo: i64::MIN,
            hi: i64::MAX,
            on_fail: OnFail::Error,
        }),
        mul: back,
        lo,
        hi,
        on_fail: OnFail::Error,
    })
}

/// `to_timestamp_seconds(x)` (`_millis`, `_micros`, `_nanos`) of an integer: its value as
/// a timestamp of that unit (arrow's cast, whatever the zone); `to_timestamp(x)`: its
/// seconds as nanoseconds (checked: DataFusion's cast fails past 64 bits), where the
/// result has no zone or UTC's (another zone moves a local time to UTC: the host's).
fn to_timestamp_node(
    function: &ScalarFunctionExpr,
    input: &Schema,
    data_type: &DataType,
) -> Result<Node, Unsupported> {
    let refuse = |why: &str| Unsupported(format!("`{function}`: {why}"));
    let [x] = function.args() else {
        return Err(refuse("a format has no device kernel"));
    };
    let (node, t) = compile(x, input)?;
    let DataType::Timestamp(unit, zone) = data_type else {
        return Err(refuse("not a timestamp"));
    };
    if kind(&t)? != Kind::Int {
        return Err(refuse(&format!("{t} has no device kernel (integers only)")));
    }
    if function.name() != "to_timestamp" {
        return Ok(node);
    }
    if zone
        .as_deref()
        .is_some_and(|z| fixed_offset(z, *unit) != Some(0))
    {
        return Err(refuse("a zone other than UTC"));
    }
    Ok(Node::Unary {
        op: op::CAST,
        input: Box::new(node),
        mul: units_per_day(*unit) / 86_400,
        lo: i64::MIN,
        hi: i64::MAX,
        on_fail: OnFail::Error,
    })
}

/// `strpos(col, 'needle')` (and its aliases) of a string column and a string literal.
fn strpos_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    let refuse = |why: &str| Unsupported(format!("`{function}`: {why}"));
    let [column, needle] = function.args() else {
        return Err(refuse("two arguments expected"));
    };
    let (index, name) = view_column(column, input)
        .ok_or_else(|| refuse("the first argument is not a string column"))?;
    let needle = string_literal(needle)?.ok_or_else(|| refuse("the needle is not a literal"))?;
    Ok(Node::StrPos {
        index,
        name,
        needle,
    })
}

/// `CASE [x] WHEN c THEN v ... [ELSE e] END` whose values have the result's type (cast
/// to it where DataFusion left another) and whose conditions are booleans (`x = c` with
/// a base expression).
fn case_node(case: &CaseExpr, input: &Schema, data_type: &DataType) -> Result<Node, Unsupported> {
    kind(data_type)?;
    let value = |expr: &Arc<dyn PhysicalExpr>| -> Result<Node, Unsupported> {
        let t = expr
            .data_type(input)
            .map_err(|e| Unsupported(format!("the type of `{expr}`: {e}")))?;
        if &t == data_type {
            compile(expr, input).map(|(node, _)| node)
        } else {
            cast_node(expr, data_type, input, OnFail::Error)
        }
    };
    let mut branches = Vec::with_capacity(case.when_then_expr().len());
    for (when, then) in case.when_then_expr() {
        let condition: Arc<dyn PhysicalExpr> = match case.expr() {
            Some(base) => Arc::new(BinaryExpr::new(base.clone(), Operator::Eq, when.clone())),
            None => when.clone(),
        };
        let (condition, t) = compile(&condition, input)?;
        if t != DataType::Boolean {
            return Err(Unsupported(format!("a CASE condition of {t}")));
        }
        branches.push((condition, value(then)?));
    }
    let otherwise = match case.else_expr() {
        Some(e) => value(e)?,
        None => Node::Literal(None),
    };
    Ok(Node::Case {
        branches,
        otherwise: Box::new(otherwise),
    })
}

/// `abs(x)` of an integer or decimal as `CASE WHEN x < 0 THEN -x ELSE x END` (an
/// integer's minimum overflows, as DataFusion's checked `abs` fails on it; a Float64's
/// is [`op::FABS`]), `nullif(a, b)` as `CASE WHEN a = b THEN NULL ELSE
/// a END`, and `greatest(a, b, ...)` (`least`) of 2 to 4 integers, decimals, dates or
/// timestamps as `CASE WHEN b IS NULL THEN a WHEN a >= b THEN a ELSE b END` folded over
/// the arguments, each compiled as DataFusion's own expressions.
fn as_case(
    function: &ScalarFunctionExpr,
    input: &Schema,
    data_type: &DataType,
) -> Result<Node, Unsupported> {
    let refuse = |why: String| Unsupported(format!("`{function}`: {why}"));
    let typed = |v: Result<ScalarValue, _>| -> Result<Arc<dyn PhysicalExpr>, Unsupported> {
        v.map(|v| Arc::new(Literal::new(v)) as Arc<dyn PhysicalExpr>)
            .map_err(|e: datafusion::error::DataFusionError| refuse(e.to_string()))
    };
    let case = match (function.name(), function.args()) {
        ("abs", [x]) if *data_type == DataType::Float64 => {
            let (node, _) = compile(x, input)?;
            return Ok(unary(op::FABS, node));
        }
        ("abs", [x]) => {
            if !matches!(kind(data_type)?, Kind::Int | Kind::Decimal(_)) {
                return Err(refuse(format!("abs of {data_type} has no device kernel")));
            }
            let zero = typed(ScalarValue::new_zero(data_type))?;
            let negative: Arc<dyn PhysicalExpr> =
                Arc::new(BinaryExpr::new(x.clone(), Operator::Lt, zero));
            let negated: Arc<dyn PhysicalExpr> = Arc::new(NegativeExpr::new(x.clone()));
            CaseExpr::try_new(None, vec![(negative, negated)], Some(x.clone()))
        }
        ("nullif", [a, b]) => {
            let null = typed(ScalarValue::try_from(data_type))?;
            let equal: Arc<dyn PhysicalExpr> =
                Arc::new(BinaryExpr::new(a.clone(), Operator::Eq, b.clone()));
            CaseExpr::try_new(None, vec![(equal, null)], Some(a.clone()))
        }
        ("greatest" | "least", [first, rest @ ..])
            if !rest.is_empty() && *data_type == DataType::Float64 =>
        {
            // arrow orders floats totally here (-0.0 below 0.0), not as DataFusion's
            // comparisons do (-0.0 equal to 0.0): their keys compared, in nodes.
            if rest.len() > 3 {
                return Err(refuse("more than 4 arguments".into()));
            }
            let wins = match function.name() {
                "greatest" => op::GE,
                _ => op::LE,
            };
            let (mut acc, _) = compile(first, input)?;
            for x in rest {
                let (x, _) = compile(x, input)?;
                let better = Node::Binary {
                    op: wins,
                    left: Box::new(unary(op::TOTAL_KEY, acc.clone())),
                    right: Box::new(unary(op::TOTAL_KEY, x.clone())),
                    lmul: 1,
                    rmul: 1,
                    lo: i64::MIN,
                    hi: i64::MAX,
                };
                acc = Node::Case {
                    branches: vec![(unary(op::IS_NULL, x.clone()), acc.clone()), (better, acc)],
                    otherwise: Box::new(x),
                };
            }
            return Ok(acc);
        }
        ("greatest" | "least", [first, rest @ ..]) if !rest.is_empty() => {
            if !matches!(
                kind(data_type)?,
                Kind::Int | Kind::Decimal(_) | Kind::Date | Kind::Timestamp(_)
            ) {
                return Err(refuse(format!(
                    "{} of {data_type} has no device kernel",
                    function.name()
                )));
            }
            // Each level repeats the one before three times.
            if rest.len() > 3 {
                return Err(refuse("more than 4 arguments".into()));
            }
            let wins = match function.name() {
                "greatest" => Operator::GtEq,
                _ => Operator::LtEq,
            };
            // DataFusion's: the first where the next is null or it is not past it (a
            // null first compares to null: the next), else the next (null only where
            // both are).
            let pick = |acc: &Arc<dyn PhysicalExpr>, x: &Arc<dyn PhysicalExpr>| {
                let null: Arc<dyn PhysicalExpr> = Arc::new(IsNullExpr::new(x.clone()));
                let better: Arc<dyn PhysicalExpr> =
                    Arc::new(BinaryExpr::new(acc.clone(), wins, x.clone()));
                CaseExpr::try_new(
                    None,
                    vec![(null, acc.clone()), (better, acc.clone())],
                    Some(x.clone()),
                )
            };
            let mut acc = first.clone();
            for x in &rest[..rest.len() - 1] {
                acc = Arc::new(pick(&acc, x).map_err(|e| refuse(e.to_string()))?);
            }
            pick(&acc, &rest[rest.len() - 1])
        }
        _ => return Err(refuse("unexpected arguments".into())),
    }
    .map_err(|e| refuse(e.to_string()))?;
    case_node(&case, input, data_type)
}

/// DataFusion's `gcd`, `lcm` and `factorial` of Int64s ([`op::GCD`], [`op::LCM`],
/// [`op::FACTORIAL`]; a decimal's are the host's), and of Float64s `isnan`
/// ([`op::IS_NAN`]), `iszero` (`x = 0.0`; of an integer or a decimal `x = 0`), `signum` ([`op::SIGNUM`]) and `nanvl(x, y)`
/// (`CASE WHEN isnan(x) THEN y ELSE x END`: a null `x` is null).
fn number_function_node(
    function: &ScalarFunctionExpr,
    input: &Schema,
    data_type: &DataType,
) -> Result<Node, Unsupported> {
    let name = function.name();
    let refuse = |why: String| Err(Unsupported(format!("`{function}`: {why}")));
    let args = function
        .args()
        .iter()
        .map(|a| compile(a, input))
        .collect::<Result<Vec<_>, _>>()?;
    let want = match name {
        "gcd" | "lcm" | "factorial" => DataType::Int64,
        _ => DataType::Float64,
    };
    // `iszero` of an integer or a decimal: `x = 0` of its lanes.
    if let ("iszero", [(x, t)]) = (name, args.as_slice()) {
        if matches!(kind(t), Ok(Kind::Int | Kind::Decimal(_))) {
            return Ok(Node::Binary {
                op: op::EQ,
                left: Box::new(x.clone()),
                right: Box::new(Node::Literal(Some(0))),
                lmul: 1,
                rmul: 1,
                lo: i64::MIN,
                hi: i64::MAX,
            });
        }
    }
    if let Some((_, t)) = args.iter().find(|(_, t)| *t != want) {
        return refuse(format!("{name} of {t} has no device kernel"));
    }
    let mut args = args.into_iter().map(|(node, _)| node);
    let (Some(x), y, None) = (args.next(), args.next(), args.next()) else {
        return refuse("unexpected arguments".into());
    };
    let binary = |op, x, y| Node::Binary {
        op,
        left: Box::new(x),
        right: Box::new(y),
        lmul: 1,
        rmul: 1,
        lo: i64::MIN,
        hi: i64::MAX,
    };
    Ok(match (name, y) {
        ("gcd", Some(y)) => binary(op::GCD, x, y),
        ("lcm", Some(y)) => binary(op::LCM, x, y),
        ("factorial", None) => unary(op::FACTORIAL, x),
        ("isnan", None) => unary(op::IS_NAN, x),
        ("signum", None) => unary(op::SIGNUM, x),
        // -0.0 equals 0.0 by the comparison keys; NaN equals nothing but a NaN.
        ("iszero", None) => binary(
            op::EQ,
            unary(op::FLOAT_KEY, x),
            unary(op::FLOAT_KEY, Node::Literal(Some(0))),
        ),
        ("nanvl", Some(y)) => Node::Case {
            branches: vec![(unary(op::IS_NAN, x.clone()), y)],
            otherwise: Box::new(x),
        },
        _ => return refuse("unexpected arguments".into()),
    })
    .and_then(|node| match kind(data_type)? {
        Kind::Int | Kind::Float | Kind::Bool => Ok(node),
        _ => refuse(format!("a result of {data_type}")),
    })
}

/// `find_in_set(s, list)` of a literal list of at most 16 comma-separated entries, as
/// DataFusion's (the 1-based place of the first entry equal to `s`, 0 where none, null
/// for a null `s`): `CASE WHEN s IS NULL THEN NULL WHEN s = e1 THEN 1 ... ELSE 0 END`,
/// each `=` a string comparison of the device's.
fn find_in_set_node(
    function: &ScalarFunctionExpr,
    input: &Schema,
    data_type: &DataType,
) -> Result<Node, Unsupported> {
    let refuse = |why: &str| Unsupported(format!("`{function}`: {why}"));
    let [value, list] = function.args() else {
        return Err(refuse("two arguments expected"));
    };
    let list = string_literal(list)?.ok_or_else(|| refuse("the list is not a literal"))?;
    let list = String::from_utf8(list).map_err(|_| refuse("the list is not UTF-8"))?;
    let entries: Vec<&str> = list.split(',').collect();
    if entries.len() > 16 {
        return Err(refuse("a list of more than 16 entries"));
    }
    let number = |v: usize| -> Result<Arc<dyn PhysicalExpr>, Unsupported> {
        let v = ScalarValue::Int64(Some(v as i64))
            .cast_to(data_type)
            .map_err(|e| refuse(&e.to_string()))?;
        Ok(Arc::new(Literal::new(v)))
    };
    let null = ScalarValue::try_from(data_type).map_err(|e| refuse(&e.to_string()))?;
    let text = value.data_type(input).map_err(|e| refuse(&e.to_string()))?;
    let mut branches: Vec<(Arc<dyn PhysicalExpr>, Arc<dyn PhysicalExpr>)> = vec![(
        Arc::new(IsNullExpr::new(value.clone())),
        Arc::new(Literal::new(null)),
    )];
    for (k, entry) in entries.iter().enumerate() {
        let entry = ScalarValue::Utf8(Some(entry.to_string()))
            .cast_to(&text)
            .map_err(|e| refuse(&e.to_string()))?;
        let equal = BinaryExpr::new(value.clone(), Operator::Eq, Arc::new(Literal::new(entry)));
        branches.push((Arc::new(equal), number(k + 1)?));
    }
    let case =
        CaseExpr::try_new(None, branches, Some(number(0)?)).map_err(|e| refuse(&e.to_string()))?;
    case_node(&case, input, data_type)
}

/// `date_part(part, d)` (and `EXTRACT`) of a `Date32` or of a `Timestamp` with no time
/// zone, an `Int32`, for the parts the device computes, named as DataFusion's
/// `date_part` reads them: an interval unit (`year`, `month`, `week`, `day`, and a
/// timestamp's `hour` and `minute`, with their plurals and abbreviations) or one of
/// `quarter`, `doy`, `dow`, `isodow`, `isoyear`. A timestamp's day is its count floored
/// to whole days (`mul`: its units a day). A date outside chrono's calendar is null, as
/// arrow's.
fn date_part_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    use datafusion::arrow::compute::kernels::cast_utils::IntervalUnit;
    let refuse = |why: &str| Err(Unsupported(format!("`{function}`: {why}")));
    let [part, date] = function.args() else {
        return refuse("two arguments expected");
    };
    let part = match part.downcast_ref::<Literal>().map(Literal::value) {
        Some(ScalarValue::Utf8(Some(p)) | ScalarValue::Utf8View(Some(p))) => p,
        _ => return refuse("the part is not a literal"),
    };
    // DataFusion's `part_normalization`: one pair of quotes off.
    let part = part
        .strip_prefix(['\'', '"'])
        .and_then(|p| p.strip_suffix(['\'', '"']))
        .unwrap_or(part);
    let (node, t) = compile(date, input)?;
    // `epoch`: the instant's seconds as a Float64, as DataFusion's `epoch` computes them
    // (`x as f64 / 10^k` of a timestamp whatever its zone; `x as f64 * 86400.0` of a date,
    // exact: the product is an integer below 2^53, so it is the integer's conversion).
    if part.eq_ignore_ascii_case("epoch") {
        let (node, per_second) = match &t {
            DataType::Date32 => (with_literal(op::MUL, node, 86_400, (i64::MIN, i64::MAX)), 1),
            DataType::Timestamp(unit, _) => (node, units_per_day(*unit) / 86_400),
            _ => return refuse(&format!("the epoch of {t} has no device kernel")),
        };
        return Ok(Node::Unary {
            op: op::TO_FLOAT,
            input: Box::new(node),
            mul: per_second,
            lo: i64::MIN,
            hi: i64::MAX,
            on_fail: OnFail::Error,
        });
    }
    // A timestamp's parts are those of its local time (a fixed zone's offset added).
    let (node, per_day) = match &t {
        DataType::Date32 => (node, 1),
        DataType::Timestamp(unit, zone) => (local_time(node, zone, *unit)?, units_per_day(*unit)),
        _ => return refuse(&format!("date_part of {t} has no device kernel")),
    };
    let op = match part.parse::<IntervalUnit>() {
        Ok(IntervalUnit::Year) => op::YEAR,
        Ok(IntervalUnit::Month) => op::MONTH,
        Ok(IntervalUnit::Week) => op::WEEK,
        Ok(IntervalUnit::Day) => op::DAY,
        Ok(IntervalUnit::Hour) if per_day > 1 => op::HOUR,
        Ok(IntervalUnit::Minute) if per_day > 1 => op::MINUTE,
        Ok(_) => return refuse(&format!("the part `{part}` has no device kernel")),
        Err(_) => match part.to_lowercase().as_str() {
            "qtr" | "quarter" => op::QUARTER,
            "doy" => op::DOY,
            "dow" => op::DOW,
            "isodow" => op::ISODOW,
            "isoyear" => op::ISOYEAR,
            _ => return refuse(&format!("the part `{part}` has no device kernel")),
        },
    };
    Ok(Node::Unary {
        op,
        input: Box::new(node),
        mul: per_day,
        lo: i64::MIN,
        hi: i64::MAX,
        on_fail: OnFail::Error,
    })
}

/// `date_trunc(granularity, ts)` of a timestamp: to a microsecond, millisecond, second
/// or minute of any zone, or an hour or a day of no zone, `v - v.rem_euclid(units)`
/// ([`op::TRUNC_TO`]; the value itself where the unit is as fine); to a week, month,
/// quarter or year of no zone, [`op::TRUNC_WEEK`] to [`op::TRUNC_YEAR`]. A zone's hours,
/// days and calendar are its local time's: the host's. (A date is cast to a timestamp
/// first, by DataFusion's coercion.)
fn date_trunc_node(function: &ScalarFunctionExpr, input: &Schema) -> Result<Node, Unsupported> {
    let refuse = |why: &str| Err(Unsupported(format!("`{function}`: {why}")));
    let [granularity, value] = function.args() else {
        return refuse("two arguments expected");
    };
    let granularity = match granularity.downcast_ref::<Literal>().map(Literal::value) {
        Some(ScalarValue::Utf8(Some(g)) | ScalarValue::Utf8View(Some(g)))
        | Some(ScalarValue::LargeUtf8(Some(g))) => g.to_lowercase(),
        _ => return refuse("the granularity is not a literal"),
    };
    let (node, t) = compile(value, input)?;
    let DataType::Timestamp(unit, zone) = &t else {
        return refuse(&format!("date_trunc of {t} has no device kernel"));
    };
    let unit_nanos: i64 = match unit {
        TimeUnit::Second => 1_000_000_000,
        TimeUnit::Millisecond => 1_000_000,
        TimeUnit::Microsecond => 1_000,
        TimeUnit::Nanosecond => 1,
    };
    let fine = |nanos: i64| -> Result<Node, Unsupported> {
        if nanos <= unit_nanos {
            return Ok(node.clone());
        }
        Ok(Node::Unary {
            op: op::TRUNC_TO,
            input: Box::new(node.clone()),
            mul: nanos / unit_nanos,
            lo: i64::MIN,
            hi: i64::MAX,
            on_fail: OnFail::Error,
        })
    };
    let (lo, hi) = (i64::MIN / unit_nanos, i64::MAX / unit_nanos);
    let op = match (granularity.as_str(), zone) {
        ("microsecond", _) => return fine(1_000),
        ("millisecond", _) => return fine(1_000_000),
        ("second", _) => return fine(1_000_000_000),
        ("minute", _) => return fine(60_000_000_000),
        ("hour", None) => return fine(3_600_000_000_000),
        ("day", None) => return fine(86_400_000_000_000),
        // A zone's hours and days: its local time's, truncated below.
        ("hour" | "day", Some(_)) => op::TRUNC_TO,
        ("week", _) => op::TRUNC_WEEK,
        ("month", _) => op::TRUNC_MONTH,
        ("quarter", _) => op::TRUNC_QUARTER,
        ("year", _) => op::TRUNC_YEAR,
        (g, _) => return refuse(&format!("the granularity `{g}` has no device kernel")),
    };
    let per_day = units_per_day(*unit);
    let truncate = |node: Node| {
        // TRUNC_TO's multiple (an hour or a day); the calendar ops' units a day.
        let mul = if granularity == "hour" {
            per_day / 24
        } else {
            per_day
        };
        Node::Unary {
            op,
            input: Box::new(node),
            mul,
            lo,
            hi,
            on_fail: OnFail::Error,
        }
    };
    let Some(zone) = zone else {
        return Ok(truncate(node));
    };
    // A zone whose offset changes: its local time truncated, mapped back to an instant
    // as DataFusion maps it (the value's own offset deciding a time the clocks went back
    // over); the table's years are within DataFusion's nanoseconds.
    let Some(off) = fixed_offset(zone, *unit) else {
        let table = ZoneTable::of(zone)
            .ok_or_else(|| Unsupported(format!("the zone {zone} is not one arrow knows")))?;
        if !table.changes_days_apart() {
            return refuse(&format!(
                "the zone {zone} changes its offset twice within three days: its calendar \
                 is the host's"
            ));
        }
        let local = local_time(node.clone(), &Some(zone.clone()), *unit)?;
        return Ok(Node::ZoneUtc {
            local: Box::new(truncate(local)),
            value: Some(Box::new(node)),
            zone: table,
            per_second: units_per_day(*unit) / 86_400,
            lo,
            hi,
        });
    };
    // A fixed zone's local time truncated, its offset taken off again, as DataFusion
    // does in nanoseconds (the value's nanoseconds, its local time's and the result's
    // within i64: checked, else the batch goes to the host).
    let shift = |node: Node, by: i64| with_literal(op::ADD, node, by, (lo, hi));
    Ok(shift(truncate(shift(shift(node, 0), off)), -off))
}

/// The offset of time zone `zone` from UTC in `unit`s where it never changes: arrow's
/// fixed offsets (`+HH:MM`, `+HHMM`, `+HH`, as `arrow_array::timezone` reads them) and
/// the zones of no offset (`UTC`, `Etc/UTC`, `GMT`, `Etc/GMT`); `None` for a zone whose
/// offset changes (its rules are the host's). A local time is the value plus it.
pub(crate) fn fixed_offset(zone: &str, unit: TimeUnit) -> Option<i64> {
    let per_second = units_per_day(unit) / 86_400;
    if matches!(zone, "UTC" | "Etc/UTC" | "GMT" | "Etc/GMT") {
        return Some(0);
    }
    let b = zone.as_bytes();
    let digits = match b.len() {
        6 if b[3] == b':' => [b[1], b[2], b[4], b[5]],
        5 => [b[1], b[2], b[3], b[4]],
        3 => [b[1], b[2], b'0', b'0'],
        _ => return None,
    };
    let d = digits.map(|x| x.wrapping_sub(b'0'));
    if d.iter().any(|x| *x > 9) {
        return None;
    }
    let seconds = i64::from(d[0] * 10 + d[1]) * 3600 + i64::from(d[2] * 10 + d[3]) * 60;
    // chrono's FixedOffset takes less than a day.
    if seconds >= 86_400 {
        return None;
    }
    match b[0] {
        b'+' => Some(seconds * per_second),
        b'-' => Some(-seconds * per_second),
        _ => None,
    }
}

/// The local time of timestamps of `unit` in `zone` (none: the value itself): a fixed
/// zone's offset added, checked within chrono's calendar less a day at each end
/// ([`timestamp_range`]; past it the batch goes to the host); a zone whose offset changes
/// adds its offset at each instant ([`Node::ZoneLocal`]).
fn local_time(node: Node, zone: &Option<Arc<str>>, unit: TimeUnit) -> Result<Node, Unsupported> {
    let Some(zone) = zone else {
        return Ok(node);
    };
    match fixed_offset(zone, unit) {
        Some(0) => Ok(node),
        Some(off) => Ok(with_literal(
            op::ADD,
            node,
            off,
            timestamp_range(unit, true),
        )),
        None => {
            let table = ZoneTable::of(zone)
                .ok_or_else(|| Unsupported(format!("the zone {zone} is not one arrow knows")))?;
            let (lo, hi) = timestamp_range(unit, true);
            Ok(Node::ZoneLocal {
                input: Box::new(node),
                zone: table,
                per_second: units_per_day(unit) / 86_400,
                lo,
                hi,
            })
        }
    }
}

/// `ts + interval`, `interval + ts` and `ts - interval` (and the same of a `Date32`) for
/// a literal interval, as arrow computes them (`add_month_day_nano` and its kin): the
/// value read as a chrono date-time (or date), the months added (chrono's
/// `checked_add_months`: the day clamped to the new month's last), then the days, then
/// the time, the result made a value of its type again, each step failing outside
/// chrono's calendar (or, in nanoseconds, past 64 bits); a subtraction takes each part
/// off in the same order.
///
/// On the device, for a timestamp: checked additions of the unit's counts (the input,
/// the days, the time), each against that range ([`timestamp_range`]), the months first
/// as the days they move its day by ([`op::ADD_MONTHS`] of its day, less its day, times
/// the unit's count a day), so that a batch arrow fails the device fails too (and the
/// host raises arrow's error); a step the device fails that arrow does not (an
/// intermediate past 64 bits in nanoseconds) sends the batch to the host. For a date:
/// [`op::ADD_MONTHS`] (which checks the date is in chrono's calendar, as arrow reads
/// it), then the days, then the time's whole days (truncated toward zero, as chrono
/// adds a duration to a date), each within chrono's calendar.
///
/// `Ok(None)` where `binary` is no such expression; refused for a null interval, a
/// time zone's months or days (its local calendar's), or a time finer than a
/// timestamp's unit (arrow floors it).
fn interval_arithmetic(
    binary: &BinaryExpr,
    input: &Schema,
    data_type: &DataType,
) -> Result<Option<Node>, Unsupported> {
    let (unit, zone) = match data_type {
        DataType::Timestamp(unit, zone) => (Some(*unit), zone.clone()),
        DataType::Date32 => (None, None),
        _ => return Ok(None),
    };
    let interval = |e: &Arc<dyn PhysicalExpr>| {
        e.downcast_ref::<Literal>().and_then(|l| match l.value() {
            v @ (ScalarValue::IntervalDayTime(_)
            | ScalarValue::IntervalMonthDayNano(_)
            | ScalarValue::IntervalYearMonth(_)) => Some(v.clone()),
            _ => None,
        })
    };
    let (value_expr, value, op) = match binary.op() {
        Operator::Plus => match (interval(binary.left()), interval(binary.right())) {
            (None, Some(v)) => (binary.left(), v, op::ADD),
            (Some(v), None) => (binary.right(), v, op::ADD),
            _ => return Ok(None),
        },
        Operator::Minus => match interval(binary.right()) {
            Some(v) => (binary.left(), v, op::SUB),
            None => return Ok(None),
        },
        _ => return Ok(None),
    };
    let refuse = |why: &str| Err(Unsupported(format!("`{binary}`: {why}")));
    let (months, days, nanos) = match value {
        ScalarValue::IntervalDayTime(Some(v)) => {
            (0, i64::from(v.days), i64::from(v.milliseconds) * 1_000_000)
        }
        ScalarValue::IntervalMonthDayNano(Some(v)) => {
            (i64::from(v.months), i64::from(v.days), v.nanoseconds)
        }
        ScalarValue::IntervalYearMonth(Some(v)) => (i64::from(v), 0, 0),
        _ => return refuse("a null interval has no device kernel"),
    };
    // A zone's months and days are its local calendar's: a fixed zone's days are
    // whole days of its local time (no daylight saving); another's map each step's
    // local time back to its one instant ([`changing_zone_interval`]).
    let fixed = zone
        .as_deref()
        .is_none_or(|z| unit.and_then(|u| fixed_offset(z, u)).is_some());
    // A subtraction takes each part off: the months as fewer months.
    let months = if op == op::SUB { -months } else { months };
    let (value_node, t) = compile(value_expr, input)?;
    if &t != data_type {
        return Ok(None);
    }
    if let (false, Some(unit), Some(zone)) = (fixed, unit, &zone) {
        let calendar = (months, if op == op::SUB { -days } else { days });
        return changing_zone_interval(value_node, (unit, zone), calendar, (op, nanos))
            .map(Some)
            .or_else(|why| refuse(&why.0));
    }
    let Some(unit) = unit else {
        // A date: its months (checking it is in chrono's calendar), its days, then the
        // time's whole days, truncated toward zero.
        let step = |node: Node, by: i64| with_literal(op, node, by, CHRONO_DAYS);
        let shifted = add_months_node(value_node, months);
        return Ok(Some(step(step(shifted, days), nanos / 86_400_000_000_000)));
    };
    let per_day = units_per_day(unit);
    let unit_nanos = 86_400_000_000_000 / per_day;
    if nanos % unit_nanos != 0 {
        return refuse("a time finer than the timestamp's unit (arrow floors it)");
    }
    let Some(day_units) = days.checked_mul(per_day) else {
        return refuse("more days than 64 bits of the unit hold");
    };
    let (lo, hi) = timestamp_range(unit, zone.is_some());
    let step = |op: u32, node: Node, by: i64| with_literal(op, node, by, (lo, hi));
    let mut node = step(op::ADD, value_node, 0);
    if months != 0 {
        // The days the months move the value's (local) day by, in the unit, added.
        let local = local_time(node.clone(), &zone, unit)?;
        node = plus_months(node, local, months, per_day, (lo, hi));
    }
    Ok(Some(step(
        op,
        step(op, node, day_units),
        nanos / unit_nanos,
    )))
}

/// [`interval_arithmetic`] of a timestamp in a zone whose offset changes, as arrow's
/// `add_month_day_nano` computes it through chrono: the local time plus the months (the
/// day clamped to the month's last), mapped back to its one instant (chrono's
/// `checked_add_months`: `single()`), that instant's local time plus the days, mapped
/// back likewise (`checked_add_days`), then the time (`op`: `nanos` added or taken off)
/// on the instant. A local time of two instants or none (arrow's error), as one outside
/// the zone's table, leaves the batch to the host.
fn changing_zone_interval(
    value: Node,
    (unit, zone): (TimeUnit, &str),
    (months, days): (i64, i64),
    (op, nanos): (u32, i64),
) -> Result<Node, Unsupported> {
    let table = ZoneTable::of(zone)
        .ok_or_else(|| Unsupported(format!("the zone {zone} is not one arrow knows")))?;
    if !table.changes_days_apart() {
        return Err(Unsupported(format!(
            "the zone {zone} changes its offset twice within three days: its calendar is the \
             host's"
        )));
    }
    let per_day = units_per_day(unit);
    let unit_nanos = 86_400_000_000_000 / per_day;
    if nanos % unit_nanos != 0 {
        return Err(Unsupported(
            "a time finer than the timestamp's unit (arrow floors it)".into(),
        ));
    }
    let day_units = days
        .checked_mul(per_day)
        .ok_or_else(|| Unsupported("more days than 64 bits of the unit hold".into()))?;
    let (lo, hi) = timestamp_range(unit, true);
    let zone_name = Some(Arc::<str>::from(zone));
    let back = |local: Node| Node::ZoneUtc {
        local: Box::new(local),
        value: None,
        zone: table.clone(),
        per_second: per_day / 86_400,
        lo,
        hi,
    };
    let mut node = value;
    if months != 0 {
        // The days the months move the local day by, in the unit, added to it.
        let local = local_time(node.clone(), &zone_name, unit)?;
        node = back(plus_months(local.clone(), local, months, per_day, (lo, hi)));
    }
    if days != 0 {
        let local = local_time(node, &zone_name, unit)?;
        node = back(with_literal(op::ADD, local, day_units, (lo, hi)));
    }
    Ok(with_literal(op, node, nanos / unit_nanos, (lo, hi)))
}

/// `node` plus the days `months` months move the day of `local` (`node`'s local time,
/// or `node` itself) by, in the unit (`per_day` of it a day), checked against `range`:
/// the day's `ADD_MONTHS` (chrono's `checked_add_months`, the day clamped) less the day.
fn plus_months(node: Node, local: Node, months: i64, per_day: i64, range: (i64, i64)) -> Node {
    let day = Node::Unary {
        op: op::DAYS,
        input: Box::new(local),
        mul: per_day,
        lo: i64::MIN,
        hi: i64::MAX,
        on_fail: OnFail::Error,
    };
    let moved = Node::Binary {
        op: op::SUB,
        left: Box::new(add_months_node(day.clone(), months)),
        right: Box::new(day),
        lmul: 1,
        rmul: 1,
        lo: i64::MIN,
        hi: i64::MAX,
    };
    Node::Binary {
        op: op::ADD,
        left: Box::new(node),
        right: Box::new(moved),
        lmul: 1,
        rmul: per_day,
        lo: range.0,
        hi: range.1,
    }
}

/// `node` `op` (an addition or a subtraction) the literal `by`, checked against `range`
/// (the batch fails outside it).
fn with_literal(op: u32, node: Node, by: i64, range: (i64, i64)) -> Node {
    Node::Binary {
        op,
        left: Box::new(node),
        right: Box::new(Node::Literal(Some(by))),
        lmul: 1,
        rmul: 1,
        lo: range.0,
        hi: range.1,
    }
}

/// `days` (a day count) plus `months` months ([`op::ADD_MONTHS`]), failing outside
/// chrono's calendar.
fn add_months_node(days: Node, months: i64) -> Node {
    Node::Unary {
        op: op::ADD_MONTHS,
        input: Box::new(days),
        mul: months,
        lo: CHRONO_DAYS.0,
        hi: CHRONO_DAYS.1,
        on_fail: OnFail::Error,
    }
}

/// The timestamps of `unit` that arrow reads as chrono date-times and makes again: the
/// days of chrono's calendar ([`CHRONO_DAYS`]), within 64 bits; a day less at
/// each end with a time zone (its offset moves the local time, which chrono bounds too).
fn timestamp_range(unit: TimeUnit, zoned: bool) -> (i64, i64) {
    let per_day = i128::from(units_per_day(unit));
    let margin = i128::from(zoned);
    let (first, last) = CHRONO_DAYS;
    let lo = (i128::from(first) + margin) * per_day;
    let hi = (i128::from(last) + 1 - margin) * per_day - 1;
    let clamp = |v: i128| v.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
    (clamp(lo), clamp(hi))
}

/// The first and last days (since 1970-01-01) of chrono's calendar: `NaiveDate::MIN`
/// (-262143-01-01) and `NaiveDate::MAX` (262142-12-31). Arrow's `date_part` gives null
/// outside them (its `date32_to_datetime` has no date there), and its timestamp
/// arithmetic fails there ([`timestamp_range`]).
pub(crate) const CHRONO_DAYS: (i64, i64) = (-96_465_292, 95_026_236);

/// A timestamp unit's count in a day.
pub(crate) fn units_per_day(unit: TimeUnit) -> i64 {
    86_400
        * match unit {
            TimeUnit::Second => 1,
            TimeUnit::Millisecond => 1_000,
            TimeUnit::Microsecond => 1_000_000,
            TimeUnit::Nanosecond => 1_000_000_000,
        }
}

/// SQL's `left AND right` / `left OR right` ([`op::AND`], [`op::OR`]) of two Boolean
/// nodes.
fn logical(op: u32, left: Node, right: Node) -> Node {
    Node::Binary {
        op,
        left: Box::new(left),
        right: Box::new(right),
        lmul: 1,
        rmul: 1,
        lo: i64::MIN,
        hi: i64::MAX,
    }
}

/// `input` (a Float64) as the key of a `min` or `max` ([`op::MINMAX_KEY`]).
pub(crate) fn minmax_key(input: Node) -> Node {
    unary(op::MINMAX_KEY, input)
}

fn unary(op: u32, input: Node) -> Node {
    Node::Unary {
        op,
        input: Box::new(input),
        mul: 1,
        lo: i64::MIN,
        hi: i64::MAX,
        on_fail: OnFail::Error,
    }
}

/// The lane of a scalar subquery's value (`None`: null), read now: the subquery has run
/// when the plan under its `ScalarSubqueryExec` runs.
///
/// # Errors
/// [`super::ComputeError::Input`] when it has not run, or its value is not a literal the
/// device holds; [`super::ComputeError::Overflow`] when it does not fit 64 bits.
pub(crate) fn subquery_value(
    expr: &Arc<dyn PhysicalExpr>,
) -> Result<Option<i64>, super::ComputeError> {
    use datafusion::logical_expr::ColumnarValue;
    let empty = arrow_array::RecordBatch::new_empty(Arc::new(Schema::empty()));
    let value = match expr.evaluate(&empty) {
        Ok(ColumnarValue::Scalar(value)) => value,
        Ok(ColumnarValue::Array(_)) => {
            return Err(super::ComputeError::Input(format!(
                "`{expr}`: a scalar subquery gave an array"
            )))
        }
        Err(e) => return Err(super::ComputeError::Input(format!("`{expr}`: {e}"))),
    };
    match literal_node(&value) {
        Ok(Node::Literal(v)) => Ok(v),
        Ok(_) => unreachable!("literal_node makes literals"),
        Err(Unsupported(why)) if why.contains("does not fit") => {
            Err(super::ComputeError::Overflow(format!("`{expr}`: {why}")))
        }
        Err(Unsupported(why)) => Err(super::ComputeError::Input(format!("`{expr}`: {why}"))),
    }
}

fn literal_node(value: &ScalarValue) -> Result<Node, Unsupported> {
    let v = match value {
        ScalarValue::Decimal128(v, p, s) => {
            kind(&DataType::Decimal128(*p, *s))?;
            match v {
                Some(v) => Some(i64::try_from(*v).map_err(|_| {
                    Unsupported(format!(
                        "the literal {value} does not fit the device's 64-bit lanes"
                    ))
                })?),
                None => None,
            }
        }
        ScalarValue::Int8(v) => v.map(i64::from),
        ScalarValue::Int16(v) => v.map(i64::from),
        ScalarValue::Int32(v) => v.map(i64::from),
        ScalarValue::Int64(v) => *v,
        ScalarValue::UInt8(v) => v.map(i64::from),
        ScalarValue::UInt16(v) => v.map(i64::from),
        ScalarValue::UInt32(v) => v.map(i64::from),
        ScalarValue::Date32(v) => v.map(i64::from),
        ScalarValue::TimestampSecond(v, _)
        | ScalarValue::TimestampMillisecond(v, _)
        | ScalarValue::TimestampMicrosecond(v, _)
        | ScalarValue::TimestampNanosecond(v, _) => *v,
        ScalarValue::DurationSecond(v)
        | ScalarValue::DurationMillisecond(v)
        | ScalarValue::DurationMicrosecond(v)
        | ScalarValue::DurationNanosecond(v) => *v,
        ScalarValue::Boolean(v) => v.map(i64::from),
        ScalarValue::Float64(v) => v.map(|f| f.to_bits() as i64),
        other => {
            return Err(Unsupported(format!(
                "a literal of {} has no device operator",
                other.data_type()
            )))
        }
    };
    Ok(Node::Literal(v))
}

fn binary_node(
    binary: &BinaryExpr,
    input: &Schema,
    data_type: &DataType,
) -> Result<Node, Unsupported> {
    if let Some(node) = interval_arithmetic(binary, input, data_type)? {
        return Ok(node);
    }
    let (left, lt) = compile(binary.left(), input)?;
    let (right, rt) = compile(binary.right(), input)?;
    let (lk, rk) = (kind(&lt)?, kind(&rt)?);
    let refuse = |why: &str| {
        Err(Unsupported(format!(
            "`{} {} {}` ({lt} {} {rt}): {why}",
            binary.left(),
            binary.op(),
            binary.right(),
            binary.op()
        )))
    };
    let mut op = match binary.op() {
        Operator::Plus => op::ADD,
        Operator::Minus => op::SUB,
        Operator::Multiply => op::MUL,
        Operator::Divide if (lk, rk) == (Kind::Float, Kind::Float) => op::FDIV,
        Operator::Divide => op::DIV,
        Operator::Modulo => op::REM,
        Operator::And => op::AND,
        Operator::Or => op::OR,
        Operator::BitwiseAnd => op::BIT_AND,
        Operator::BitwiseOr => op::BIT_OR,
        Operator::BitwiseXor => op::BIT_XOR,
        Operator::BitwiseShiftLeft => op::SHL,
        Operator::BitwiseShiftRight => op::SHR,
        other => match comparison_op(other) {
            Some(op) => op,
            None => return refuse(&format!("operator `{other}` has no device kernel")),
        },
    };
    let (mut lmul, mut rmul) = (1i64, 1i64);
    let (mut lo, mut hi) = (i64::MIN, i64::MAX);
    match op {
        op::AND | op::OR => {
            if lk != Kind::Bool || rk != Kind::Bool {
                return refuse("AND/OR take booleans");
            }
        }
        op::BIT_AND | op::BIT_OR | op::BIT_XOR | op::SHL | op::SHR => {
            // DataFusion coerces both operands to the result's type. An unsigned
            // type's lanes are zero-extended: `&`, `|`, `^` and a right shift keep them
            // so, a left shift is cut to the width (ops USHL, USHR); UInt64's lanes
            // would need a 65th bit and stay the host's.
            let signed = matches!(
                data_type,
                DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64
            );
            let unsigned = matches!(
                data_type,
                DataType::UInt8 | DataType::UInt16 | DataType::UInt32
            );
            if !(signed || unsigned) || &lt != data_type || &rt != data_type {
                return refuse(
                    "bitwise operators on the device take two integers of the result's type \
                     (not UInt64)",
                );
            }
            (lo, hi) = range_of(data_type);
            if unsigned {
                op = match op {
                    op::SHL => op::USHL,
                    op::SHR => op::USHR,
                    other => other,
                };
            }
        }
        op::ADD | op::SUB | op::MUL | op::FDIV if (lk, rk) == (Kind::Float, Kind::Float) => {
            if kind(data_type)? != Kind::Float {
                return refuse("float arithmetic whose result is not a Float64");
            }
            op = match op {
                op::ADD => op::FADD,
                op::SUB => op::FSUB,
                op::MUL => op::FMUL,
                _ => op::FDIV,
            };
        }
        op::ADD | op::SUB | op::MUL | op::REM => match (lk, rk, kind(data_type)?) {
            (Kind::Decimal(ls), Kind::Decimal(rs), Kind::Decimal(s)) => {
                if op == op::MUL {
                    if s as i32 != ls as i32 + rs as i32 {
                        return refuse(&format!("the product's scale is {s}, not {ls} + {rs}"));
                    }
                } else {
                    if s != ls.max(rs) {
                        return refuse(&format!("the result's scale is {s}, not max({ls}, {rs})"));
                    }
                    lmul = pow10((s - ls) as u32).expect("scales of at most 18");
                    rmul = pow10((s - rs) as u32).expect("scales of at most 18");
                }
            }
            (Kind::Int, Kind::Int, Kind::Int) => (lo, hi) = range_of(data_type),
            // arrow's checked arithmetic of the unit's counts (its overflow error where
            // 64 bits do not hold the result): a timestamp less a timestamp is their
            // duration, a timestamp plus or less a duration a timestamp, durations add.
            (Kind::Timestamp(a), Kind::Timestamp(b), Kind::Duration(c))
                if op == op::SUB && a == b && b == c => {}
            (Kind::Timestamp(a), Kind::Duration(b), Kind::Timestamp(c))
                if matches!(op, op::ADD | op::SUB) && a == b && b == c => {}
            (Kind::Duration(a), Kind::Timestamp(b), Kind::Timestamp(c))
                if op == op::ADD && a == b && b == c => {}
            (Kind::Duration(a), Kind::Duration(b), Kind::Duration(c))
                if matches!(op, op::ADD | op::SUB) && a == b && b == c => {}
            // A date less a date: the days between them, an Int64 (no overflow: two
            // 32-bit counts).
            (Kind::Date, Kind::Date, Kind::Int) if op == op::SUB => {}
            _ => {
                return refuse(
                    "arithmetic on the device takes two decimals, two integers, two \
                     Float64s, timestamps and durations of one unit, or two dates' difference",
                )
            }
        },
        op::DIV => match (lk, rk, kind(data_type)?) {
            // arrow's decimal division: the quotient's scale is the dividend's + 4, the
            // dividend scaled by 10^(4 + the divisor's scale) first.
            (Kind::Decimal(ls), Kind::Decimal(rs), Kind::Decimal(s)) => {
                if s as i32 != ls as i32 + 4 {
                    return refuse(&format!("the quotient's scale is {s}, not {ls} + 4"));
                }
                lmul = pow10(4 + rs as u32).ok_or_else(|| {
                    Unsupported(format!(
                        "`{binary}`: a divisor of scale {rs} scales the dividend past 64 bits"
                    ))
                })?;
            }
            (Kind::Int, Kind::Int, Kind::Int) => (lo, hi) = range_of(data_type),
            _ => return refuse("division on the device takes two decimals or two integers"),
        },
        _ => match (lk, rk) {
            (Kind::Decimal(ls), Kind::Decimal(rs)) => {
                let s = ls.max(rs);
                lmul = pow10((s - ls) as u32).expect("scales of at most 18");
                rmul = pow10((s - rs) as u32).expect("scales of at most 18");
            }
            (Kind::Int, Kind::Int) | (Kind::Date, Kind::Date) | (Kind::Bool, Kind::Bool) => {}
            (Kind::Timestamp(a), Kind::Timestamp(b)) if a == b => {}
            (Kind::Duration(a), Kind::Duration(b)) if a == b => {}
            (Kind::Float, Kind::Float) => {
                return Ok(Node::Binary {
                    op,
                    left: Box::new(unary(op::FLOAT_KEY, left)),
                    right: Box::new(unary(op::FLOAT_KEY, right)),
                    lmul,
                    rmul,
                    lo,
                    hi,
                })
            }
            _ => return refuse("comparisons on the device take operands of one kind"),
        },
    }
    Ok(Node::Binary {
        op,
        left: Box::new(left),
        right: Box::new(right),
        lmul,
        rmul,
        lo,
        hi,
    })
}

fn cast_node(
    expr: &Arc<dyn PhysicalExpr>,
    to: &DataType,
    input: &Schema,
    on_fail: OnFail,
) -> Result<Node, Unsupported> {
    if let Some((index, name)) = string_column(expr, input) {
        let to = match to {
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
                let (lo, hi) = range_of(to);
                Parse::Int { lo, hi }
            }
            DataType::Date32 => Parse::Date,
            DataType::Float64 => Parse::Float,
            DataType::Timestamp(unit, None) => Parse::Timestamp {
                per_second: units_per_day(*unit) / 86_400,
            },
            DataType::Decimal128(p, s) if *s >= 0 && *s as u32 <= MAX_POW10 => {
                let (lo, hi) = precision_range(*p);
                Parse::Decimal {
                    scale: *s as u8,
                    lo,
                    hi,
                }
            }
            _ => {
                return Err(Unsupported(format!(
                    "CAST(`{expr}` AS {to}) of a string: no device kernel for this cast"
                )))
            }
        };
        return Ok(Node::Parse {
            index,
            name,
            to,
            on_fail,
        });
    }
    let (node, from) = compile(expr, input)?;
    let refuse = |why: &str| {
        Err(Unsupported(format!(
            "CAST(`{expr}` AS {to}) from {from}: {why}"
        )))
    };
    if &from == to {
        return Ok(node);
    }
    let (mul, (lo, hi)) = match (kind(&from)?, kind(to)?) {
        (Kind::Int, Kind::Int) => (1, range_of(to)),
        // An integer to a Boolean: `x <> 0` of its lanes, as arrow casts.
        (Kind::Int, Kind::Bool) => {
            return Ok(Node::Binary {
                op: op::NE,
                left: Box::new(node),
                right: Box::new(Node::Literal(Some(0))),
                lmul: 1,
                rmul: 1,
                lo: i64::MIN,
                hi: i64::MAX,
            })
        }
        // A Boolean's lanes are 1 and 0, as arrow casts it to any integer.
        (Kind::Bool, Kind::Int) => (1, range_of(to)),
        // arrow's reinterpretations: an Int32 is a date's days (an Int64 through Int32,
        // checked), a date's days an Int32 or Int64; any integer is a timestamp's value
        // (through Int64), a timestamp's value an integer (through Int64, checked).
        (Kind::Int, Kind::Date) if matches!(from, DataType::Int32 | DataType::Int64) => {
            (1, range_of(&DataType::Int32))
        }
        (Kind::Date, Kind::Int) if matches!(to, DataType::Int32 | DataType::Int64) => {
            (1, (i64::MIN, i64::MAX))
        }
        (Kind::Int, Kind::Timestamp(_)) => (1, (i64::MIN, i64::MAX)),
        (Kind::Timestamp(_), Kind::Int) => (1, range_of(to)),
        // Between units: divided (truncated toward zero) or multiplied (checked), as
        // arrow's; a local time given a zone is the host's (arrow moves it to UTC).
        (Kind::Timestamp(a), Kind::Timestamp(b)) => {
            let (DataType::Timestamp(_, from_zone), DataType::Timestamp(_, to_zone)) = (&from, to)
            else {
                return refuse("not timestamps");
            };
            if from_zone.is_none() && to_zone.is_some() {
                return refuse("a local time given a zone");
            }
            let (fa, fb) = (units_per_day(a), units_per_day(b));
            if fa == fb {
                return Ok(node);
            }
            if fa > fb {
                return Ok(Node::Unary {
                    op: op::DECIMAL_TO_INT,
                    input: Box::new(node),
                    mul: fa / fb,
                    lo: i64::MIN,
                    hi: i64::MAX,
                    on_fail,
                });
            }
            (fb / fa, (i64::MIN, i64::MAX))
        }
        // A date's days times the unit's count a day (checked: arrow's cast checks
        // microseconds and nanoseconds; seconds and milliseconds cannot overflow).
        (Kind::Date, Kind::Timestamp(unit)) if matches!(to, DataType::Timestamp(_, None)) => {
            (units_per_day(unit), (i64::MIN, i64::MAX))
        }
        // A timestamp's (local) day, floored; out of chrono's calendar arrow's cast
        // fails (a TRY_CAST too), so the batch goes to the host, which raises its error.
        (Kind::Timestamp(unit), Kind::Date) => {
            let DataType::Timestamp(_, zone) = &from else {
                return refuse("not a timestamp");
            };
            return Ok(Node::Unary {
                op: op::DAYS,
                input: Box::new(local_time(node, zone, unit)?),
                mul: units_per_day(unit),
                lo: i64::MIN,
                hi: i64::MAX,
                on_fail: OnFail::Error,
            });
        }
        (Kind::Int, Kind::Decimal(s)) => {
            let DataType::Decimal128(p, _) = to else {
                return refuse("not a decimal");
            };
            (
                pow10(s as u32).expect("scale of at most 18"),
                precision_range(*p),
            )
        }
        (Kind::Decimal(fs), Kind::Decimal(ts)) if ts >= fs => {
            let DataType::Decimal128(p, _) = to else {
                return refuse("not a decimal");
            };
            (
                pow10((ts - fs) as u32).expect("scales of at most 18"),
                precision_range(*p),
            )
        }
        // To a smaller scale: rounded half away from zero; to an integer: truncated.
        (Kind::Decimal(fs), Kind::Decimal(ts)) => {
            let DataType::Decimal128(p, _) = to else {
                return refuse("not a decimal");
            };
            let (lo, hi) = precision_range(*p);
            return Ok(Node::Unary {
                op: op::DOWNSCALE,
                input: Box::new(node),
                mul: pow10((fs - ts) as u32).expect("scales of at most 18"),
                lo,
                hi,
                on_fail,
            });
        }
        (Kind::Decimal(fs), Kind::Int) => {
            let (lo, hi) = range_of(to);
            return Ok(Node::Unary {
                op: op::DECIMAL_TO_INT,
                input: Box::new(node),
                mul: pow10(fs as u32).expect("scale of at most 18"),
                lo,
                hi,
                on_fail,
            });
        }
        // To Float64: the lanes' value over 10^scale, in binary64 (as arrow's cast); a
        // Boolean's 1 or 0.
        (Kind::Int | Kind::Bool, Kind::Float) | (Kind::Decimal(_), Kind::Float) => {
            let scale = match kind(&from)? {
                Kind::Decimal(s) => s as u32,
                _ => 0,
            };
            return Ok(Node::Unary {
                op: op::TO_FLOAT,
                input: Box::new(node),
                mul: pow10(scale).expect("scales of at most 18"),
                lo: i64::MIN,
                hi: i64::MAX,
                on_fail,
            });
        }
        // From Float64: truncated to an integer, or scaled and rounded to a decimal.
        (Kind::Float, Kind::Int) => {
            let (lo, hi) = range_of(to);
            return Ok(Node::Unary {
                op: op::FLOAT_TO_INT,
                input: Box::new(node),
                mul: 1,
                lo,
                hi,
                on_fail,
            });
        }
        (Kind::Float, Kind::Decimal(s)) => {
            let DataType::Decimal128(p, _) = to else {
                return refuse("not a decimal");
            };
            // Beyond 18 digits a value may fit the decimal but not the lanes: a failed
            // cast then hands the batch to the host, which a TRY_CAST's null cannot.
            if *p > 18 && on_fail == OnFail::Null {
                return refuse("TRY_CAST to more than 18 digits has no device kernel");
            }
            return Ok(Node::Unary {
                op: op::FLOAT_TO_DECIMAL,
                input: Box::new(node),
                mul: pow10(s as u32).expect("scale of at most 18"),
                lo: precision_range(*p).0,
                hi: precision_range(*p).1,
                on_fail,
            });
        }
        _ => return refuse("no device kernel for this cast"),
    };
    Ok(Node::Unary {
        op: op::CAST,
        input: Box::new(node),
        mul,
        lo,
        hi,
        on_fail,
    })
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // (what CUDA needs to know)
impl Node {
    /// Whether evaluating it may raise an error (an overflow check).
    pub(crate) fn may_fail(&self) -> bool {
        match self {
            // An instant outside the zone's table, a local time outside chrono's calendar.
            Node::ZoneLocal { .. } | Node::ZoneUtc { .. } => true,
            Node::Column { data_type, .. } => {
                matches!(data_type, DataType::Decimal128(p, _) if *p > 18)
            }
            Node::Literal(_) | Node::Subquery(_) | Node::StrIn { .. } | Node::Valid { .. } => false,
            // The second word of a long value reads its buffer (a view outside it is
            // flagged in the error word).
            Node::StrKey { word, .. } => *word != 0,
            // A view outside its buffer (checked, flagged in the error word); a value
            // that is not ASCII (the host's).
            Node::Substr { .. }
            | Node::SplitPart { .. }
            | Node::Trim { .. }
            | Node::StrCase { .. } => true,
            // A view outside its buffer; a result past its bound (the host's) or past
            // i32 offsets.
            Node::Concat { .. }
            | Node::Replace { .. }
            | Node::RegexReplace { .. }
            | Node::Pad { .. }
            | Node::Transform { .. } => true,
            // Characters are counted in the value's bytes (a view outside its buffer is
            // flagged); bytes are the view's length.
            Node::StrLength { measure, .. } => *measure != 0,
            // A view outside its buffer (checked, flagged in the error word).
            Node::StrLike { .. }
            | Node::StrRegex { .. }
            | Node::StrRegexCount { .. }
            | Node::StrRegexInstr { .. }
            | Node::StrPos { .. } => true,
            // A value that is none of the type, or the host's (a view outside its buffer
            // is flagged too).
            Node::Parse { .. } => true,
            // A view outside its buffer; a result past its bound or past i32 offsets.
            Node::StrChoice { .. } => true,
            // A view outside its buffer.
            Node::StrCompare { .. } => true,
            // A value the host writes; a result past i32 offsets.
            Node::ToText { .. } => true,
            Node::Case {
                branches,
                otherwise,
            } => otherwise.may_fail() || branches.iter().any(|(c, v)| c.may_fail() || v.may_fail()),
            Node::Binary {
                op,
                left,
                right,
                lmul,
                rmul,
                ..
            } => {
                matches!(
                    *op,
                    op::ADD | op::SUB | op::MUL | op::DIV | op::REM | op::GCD | op::LCM
                ) || *lmul != 1
                    || *rmul != 1
                    || left.may_fail()
                    || right.may_fail()
            }
            Node::Unary {
                op, input, on_fail, ..
            } => {
                (matches!(
                    *op,
                    op::CAST
                        | op::FLOAT_TO_INT
                        | op::FLOAT_TO_DECIMAL
                        | op::DOWNSCALE
                        | op::DECIMAL_TO_INT
                        | op::FLOOR_DECIMAL
                        | op::CEIL_DECIMAL
                        | op::MINMAX_KEY
                        | op::DAYS
                        | op::SQRT
                        | op::TRUNC_WEEK
                        | op::TRUNC_MONTH
                        | op::TRUNC_QUARTER
                        | op::TRUNC_YEAR
                        | op::ADD_MONTHS
                        | op::FACTORIAL
                ) && *on_fail == OnFail::Error)
                    || input.may_fail()
            }
        }
    }

    /// Whether it may be null where its columns are not (a null literal, a safe cast).
    pub(crate) fn introduces_nulls(&self) -> bool {
        match self {
            Node::ZoneLocal { input, .. } => input.introduces_nulls(),
            Node::ZoneUtc { local, value, .. } => {
                local.introduces_nulls() || value.as_ref().is_some_and(|v| v.introduces_nulls())
            }
            Node::Column { .. }
            | Node::StrIn { .. }
            | Node::StrLike { .. }
            | Node::StrRegex { .. }
            | Node::StrRegexCount { .. }
            | Node::StrRegexInstr { .. }
            | Node::Substr { .. }
            | Node::SplitPart { .. }
            | Node::Trim { .. }
            | Node::StrCase { .. }
            | Node::Replace { .. }
            | Node::RegexReplace { .. }
            | Node::Pad { .. }
            | Node::Transform { .. }
            | Node::StrLength { .. }
            | Node::StrPos { .. }
            | Node::StrKey { .. }
            | Node::Valid { .. } => false,
            Node::Parse { on_fail, .. } => *on_fail == OnFail::Null,
            Node::StrChoice { .. } => true,
            Node::StrCompare { .. } => false,
            Node::ToText { input, .. } => input.introduces_nulls(),
            // Never null but for `||`, null where a part is.
            Node::Concat { .. } => false,
            // A row no branch takes and an ELSE that is null.
            Node::Case {
                branches,
                otherwise,
            } => otherwise.introduces_nulls() || branches.iter().any(|(_, v)| v.introduces_nulls()),
            Node::Literal(v) => v.is_none(),
            // Its value may be null (a subquery of no row).
            Node::Subquery(_) => true,
            Node::Binary { left, right, .. } => left.introduces_nulls() || right.introduces_nulls(),
            Node::Unary {
                op, input, on_fail, ..
            } => match *op {
                op::IS_NULL | op::IS_NOT_NULL => false,
                op::CAST
                | op::FLOAT_TO_INT
                | op::FLOAT_TO_DECIMAL
                | op::DOWNSCALE
                | op::DECIMAL_TO_INT => *on_fail == OnFail::Null || input.introduces_nulls(),
                // A date outside chrono's calendar (`CHRONO_DAYS`).
                part if op::DATE_PARTS.contains(&part) => true,
                _ => input.introduces_nulls(),
            },
        }
    }

    /// The columns it reads (indices in the compiled schema, with names).
    pub(crate) fn columns<'a>(&'a self, out: &mut Vec<(usize, &'a str)>) {
        match self {
            Node::Column { index, name, .. }
            | Node::StrIn { index, name, .. }
            | Node::StrLike { index, name, .. }
            | Node::StrRegex { index, name, .. }
            | Node::StrRegexCount { index, name, .. }
            | Node::StrRegexInstr { index, name, .. }
            | Node::Substr { index, name, .. }
            | Node::SplitPart { index, name, .. }
            | Node::Trim { index, name, .. }
            | Node::StrCase { index, name, .. }
            | Node::Replace { index, name, .. }
            | Node::RegexReplace { index, name, .. }
            | Node::Pad { index, name, .. }
            | Node::Transform { index, name, .. }
            | Node::StrLength { index, name, .. }
            | Node::StrPos { index, name, .. }
            | Node::StrKey { index, name, .. }
            | Node::Parse { index, name, .. }
            | Node::Valid { index, name } => {
                if !out.iter().any(|(i, _)| i == index) {
                    out.push((*index, name));
                }
            }
            Node::StrChoice { which, parts, .. } => {
                which.columns(out);
                parts_columns(parts, out);
            }
            Node::Concat { parts, .. } => parts_columns(parts, out),
            Node::StrCompare { sides, .. } => parts_columns(sides.as_slice(), out),
            Node::Literal(_) | Node::Subquery(_) => {}
            Node::Binary { left, right, .. } => {
                left.columns(out);
                right.columns(out);
            }
            Node::Unary { input, .. }
            | Node::ZoneLocal { input, .. }
            | Node::ToText { input, .. } => input.columns(out),
            Node::ZoneUtc { local, value, .. } => {
                local.columns(out);
                if let Some(value) = value {
                    value.columns(out);
                }
            }
            Node::Case {
                branches,
                otherwise,
            } => {
                for (condition, value) in branches {
                    condition.columns(out);
                    value.columns(out);
                }
                otherwise.columns(out);
            }
        }
    }
}

/// The columns string parts read ([`Node::columns`]).
fn parts_columns<'a>(parts: &'a [ConcatPart], out: &mut Vec<(usize, &'a str)>) {
    for part in parts {
        match part {
            ConcatPart::Column { index, name } => {
                if !out.iter().any(|(i, _)| i == index) {
                    out.push((*index, name));
                }
            }
            ConcatPart::Literal(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zone_tables_hold_each_change_to_its_second() {
        let ny = ZoneTable::of("America/New_York").unwrap();
        // 2024-03-10T07:00:00Z: EST to EDT; 2024-11-03T06:00:00Z back.
        for (second, offset) in [
            (1_710_053_999, -5 * 3600),
            (1_710_054_000, -4 * 3600),
            (1_730_613_599, -4 * 3600),
            (1_730_613_600, -5 * 3600),
        ] {
            assert_eq!(ny.offset_at(second), Some(offset), "{second}");
        }
        // Lord Howe: half an hour of daylight saving (2024-04-06T15:00:00Z, +11 to +10:30).
        let lh = ZoneTable::of("Australia/Lord_Howe").unwrap();
        assert_eq!(lh.offset_at(1_712_415_599), Some(11 * 3600));
        assert_eq!(lh.offset_at(1_712_415_600), Some(10 * 3600 + 1800));
        // Outside the table; a zone arrow does not know; one table per zone.
        assert_eq!(ny.offset_at(ZoneTable::START - 1), None);
        assert_eq!(ny.offset_at(ZoneTable::END), None);
        assert!(ZoneTable::of("Mars/Olympus_Mons").is_none());
        assert!(Arc::ptr_eq(
            &ny,
            &ZoneTable::of("America/New_York").unwrap()
        ));
        // Local times: the offset in the unit, within the range given.
        assert_eq!(
            ny.local(1_710_054_000_123, 1_000, (i64::MIN, i64::MAX)),
            Some(1_710_054_000_123 - 4 * 3_600_000)
        );
        assert_eq!(ny.local(1_710_054_000_123, 1_000, (0, 1_000)), None);
    }

    #[test]
    fn fixed_offsets_are_arrows_and_zones_that_change_are_not() {
        let ms = |z| fixed_offset(z, TimeUnit::Millisecond);
        assert_eq!(ms("+05:30"), Some(19_800_000));
        assert_eq!(ms("-0800"), Some(-28_800_000));
        assert_eq!(ms("+01"), Some(3_600_000));
        assert_eq!(fixed_offset("-00:30", TimeUnit::Second), Some(-1_800));
        for zero in ["UTC", "Etc/UTC", "GMT", "+00:00"] {
            assert_eq!(ms(zero), Some(0), "{zero}");
        }
        // Named zones whose offset changes, malformed offsets, a day or more.
        for not in [
            "America/New_York",
            "Europe/Paris",
            "+5:30",
            "05:30",
            "+24:00",
            "+0a:00",
        ] {
            assert_eq!(ms(not), None, "{not}");
        }
    }
}
