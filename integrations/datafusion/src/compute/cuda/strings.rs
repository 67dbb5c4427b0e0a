//! The string columns a projection computes on CUDA: slices (`substr`, `trim`), Unicode
//! case, `concat` and `replace`, each a new column of its type made on the device with
//! nothing read back (see each function).

use std::sync::Arc;

use arrow_schema::DataType;
use devarrow::cuda::cudarc::driver::{CudaFunction, CudaSlice};
use devarrow::cuda::{CudaArray, CudaDevice};

use super::{addr, offset_array, packed_validity, variadic_copies, view_args, Cx, A};
use crate::compute::expr::{Case, ConcatPart, Joined};
use crate::compute::host::frame_column;
use crate::error::BoxError;
use crate::frame::{DeviceFrame, FrameColumn};

/// A slice of each value of a string column (`substr`'s characters, `trim`'s value less
/// its spaces: [`Bounds`](crate::compute::expr::Bounds)), a column of its own type. Each row's
/// validity flag is packed into the bitmap (`pack_bits`).
///
/// - `Utf8View`: `view_substr` writes each row's view. A result of at most 12 bytes is
///   inline; a longer one names its value's buffer at its offset moved, the column's
///   buffers copied whole on the device, unless no result can pass 12 bytes (a `substr`
///   count of at most 3 characters).
/// - `Utf8` and `LargeUtf8`: `view_substr` (over the views made of the offsets) writes
///   each result's address and length; the lengths are scanned, and `substr_strings`
///   writes the offsets and copies the bytes. The data buffer is the column's size, which
///   no result's bytes pass in all, so no length is read back to size it (a download
///   moves only the bytes the offsets span).
pub(super) fn substr_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    column: &FrameColumn,
    name: &str,
    bounds: crate::compute::expr::Bounds,
    err: u64,
) -> Result<CudaArray, BoxError> {
    use devarrow::abi::device::DeviceKernels;

    let (first, end, mode) = bounds.kernel_args();
    let s = cx.stream;
    let n = column.len();
    let c = column.column();
    let dt = c.data_type().clone();
    let view = view_args(cx, column, name, n, err)?;
    let views = dt == DataType::Utf8View;
    let out = cx.zeros::<u128>(n)?;
    let lens = cx.zeros::<i64>(if views { 1 } else { n })?;
    let valid = cx.zeros::<u8>(n)?;
    let args = view.args.iter().copied().chain([
        A::U64(first),
        A::U64(end),
        A::U32(u32::from(!views) | mode),
        A::U64(addr(&out, s)),
        A::U64(addr(&lens, s)),
        A::U64(addr(&valid, s)),
        A::U64(err),
    ]);
    cx.launch(&cx.k.view_substr, n, &args.collect::<Vec<_>>())?;
    let validity = packed_validity(cx, &valid, n, view.has_validity)?;
    if views {
        let mut held = Vec::new();
        // At most 3 characters are at most 12 bytes: every result inline.
        let data = if bounds.may_be_long() {
            variadic_copies(cx, &c, &mut held)?
        } else {
            Vec::new()
        };
        drop((view, valid, held));
        // SAFETY: `view_substr` wrote one view per row (ordered before the export on this
        // stream) of the characters of a UTF-8 value it read in bounds (a view outside its
        // buffer fails the batch by the error word): inline, or, for more than 12 bytes
        // (only where `may_be_long`), its first 4 bytes, the buffer its value lies in, copied
        // whole into `data` at the same index, and the result's offset in it.
        return Ok(unsafe { CudaArray::from_views(dt, out, data, validity) }?);
    }
    let wide = dt == DataType::LargeUtf8;
    if n > 0 {
        let at = addr(&lens, s);
        // SAFETY: `lens` holds `n` i64s on this device, written by `view_substr` on the
        // device's stream, the stream the scan runs on (in order after it).
        unsafe { cuda.inclusive_scan_i64(at as *mut std::ffi::c_void, n as u64) }?;
    }
    // The column's data bytes (the views' one variadic buffer): every result is a range
    // of a value, the values ranges of them that do not overlap.
    let size = c.buffer(2).map_or(0, |b| b.len());
    let data = cx.zeros::<u8>(size)?;
    let data_at = addr(&data, s);
    // SAFETY: `substr_strings` writes the n + 1 offsets, 0 then the scan of the results'
    // lengths (non-decreasing, the last at most `size`, as above), and copies each
    // result's bytes (characters of a UTF-8 value, read in bounds by `view_substr`) to
    // its range.
    let array = unsafe {
        offset_array(cx, dt, (wide, n), data, validity, |out_offsets| {
            cx.launch(
                &cx.k.substr_strings,
                n,
                &[
                    A::U64(addr(&out, s)),
                    A::U64(addr(&lens, s)),
                    A::U64(n as u64),
                    A::U32(u32::from(wide)),
                    A::U64(out_offsets),
                    A::U64(data_at),
                ],
            )
        })
    };
    // An inline value's bytes are in its view (made of the offsets, for these types),
    // which `substr_strings` read: freed after it, in the stream's order.
    drop(view);
    array
}

/// `upper`, `lower` or `initcap` of each value of a string column
/// ([`Node::StrCase`](crate::compute::expr::Node::StrCase)), a column of its type, in two
/// passes of `unicode_case_views` ([`from_each_value`]): each row's length, then its
/// characters mapped as DataFusion maps them (Unicode's case mappings:
/// [`CaseTables`](crate::compute::unicase::CaseTables), uploaded once per context). No
/// character's mapping has more than three times its bytes (checked on Rust's tables by
/// their unit test), so the data's bound is three times the column's ([`value_bytes`]);
/// past it, the batch is the host's.
pub(super) fn case_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    column: &FrameColumn,
    name: &str,
    case: Case,
    err: u64,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let tables = crate::compute::unicase::CaseTables::get();
    let on_device = match cx.k.case_tables.get() {
        Some(on_device) => on_device,
        None => {
            // At least one entry each: CUDA allocates no empty buffer.
            let upload =
                |words: &[u32]| s.clone_htod(if words.is_empty() { &[0][..] } else { words });
            let made = [
                upload(&tables.upper.keys)?,
                upload(&tables.upper.maps)?,
                upload(&tables.lower.keys)?,
                upload(&tables.lower.maps)?,
                upload(&tables.alphanumeric)?,
                upload(&tables.ignorable)?,
                upload(&tables.cased)?,
            ];
            // Published once the copies are done, so that every stream of the context
            // reads them with no event (a one-time wait of this stream, at the tables'
            // first use); a thread that loses the race frees its own copies.
            s.synchronize()?;
            let _ = cx.k.case_tables.set(made);
            cx.k.case_tables.get().ok_or("the case tables")?
        }
    };
    let [ukeys, umaps, lkeys, lmaps, alnum, ignorable, cased] =
        on_device.each_ref().map(|t| addr(t, s));
    let mode = match case {
        Case::Upper => 0,
        Case::Lower => 1,
        Case::Initcap => 2,
    };
    let extra = [
        A::U64(ukeys),
        A::U64(umaps),
        A::U64(tables.upper.keys.len() as u64),
        A::U64(lkeys),
        A::U64(lmaps),
        A::U64(tables.lower.keys.len() as u64),
        A::U64(alnum),
        A::U64(tables.alphanumeric.len() as u64 / 2),
        A::U64(ignorable),
        A::U64(tables.ignorable.len() as u64 / 2),
        A::U64(cased),
        A::U64(tables.cased.len() as u64 / 2),
        A::U32(mode),
    ];
    let out = column.column().data_type().clone();
    let cap = value_bytes(column).saturating_mul(3);
    let kernel = (&cx.k.unicode_case_views, &extra[..]);
    from_each_value(cx, cuda, (column, name), kernel, (&out, cap), err)
}

/// `concat`, `||` or `concat_ws` of each row's parts ([`Node::Concat`](crate::compute::expr::Node::Concat)), a column of
/// type `out`, in two passes of `concat_views`: each row's bytes and validity, scanned
/// on the device into the offsets, then each row's bytes copied to its range.
///
/// The parts' table: a column's views where they lie (`view_args`: a `Utf8` or
/// `LargeUtf8` column's made of its offsets), a literal's one view (stride 0) over the
/// literals' bytes, uploaded once. No length is read back: the data buffer is sized by a
/// bound, each column's variadic bytes and 12 a row (its inline values), each literal's
/// bytes a row (`concat_ws`' separator, between every two parts). Views that share bytes
/// can pass it: `concat_views` then flags the batch as the host's (8 in the error word).
/// A `Utf8View` result is made of i64 offsets (`utf8_views`), its data its one buffer.
///
/// With `which` (the address of `n` i64 lanes: [`Node::StrChoice`](crate::compute::expr::Node::StrChoice)),
/// each row is its one part `which[i]` (null where that is null or `which[i]` is no
/// part), under `||`'s rule.
pub(super) fn concat_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    frame: &DeviceFrame,
    parts: &[ConcatPart],
    (joined, which): (Joined, Option<u64>),
    out: &DataType,
    err: u64,
) -> Result<CudaArray, BoxError> {
    let n = frame.num_rows();
    let table = parts_table(cx, frame, parts, err)?;
    let table_at = addr(&table.table, cx.stream);
    let separators = n.saturating_mul(parts.len().saturating_sub(2)) as u64;
    let mut cap = 0u64;
    for (p, bytes) in table.bytes.iter().enumerate() {
        cap = cap.saturating_add(match bytes {
            PartBytes::Column(all) => *all,
            PartBytes::Literal(len) => len.saturating_mul(match (joined, p) {
                (Joined::Separated, 0) => separators,
                _ => n as u64,
            }),
        });
    }
    let nullable = table.nullable;
    let wide = matches!(out, DataType::LargeUtf8 | DataType::Utf8View);
    let array = two_pass_strings(
        cx,
        cuda,
        (n, out, cap),
        (nullable && joined == Joined::NullIfAny) || which.is_some(),
        |pass, lens, valid, offsets, data| {
            let args = [
                A::U64(table_at),
                A::U32(parts.len() as u32),
                A::U32(joined as u32),
                A::U64(which.unwrap_or(0)),
                A::U64(n as u64),
            ]
            .into_iter()
            .chain(pass_args(
                pass,
                (lens, valid),
                (wide, offsets),
                (data, cap),
                err,
            ));
            cx.launch(&cx.k.concat_views, n, &args.collect::<Vec<_>>())
        },
        err,
    );
    drop(table);
    array
}

/// What a part of a [`PartsTable`] may add to a row's bytes.
enum PartBytes {
    /// A column's values ([`value_bytes`]: every row's together).
    Column(u64),
    /// A literal's length (each row's).
    Literal(u64),
}

/// String parts (columns and literals) as `concat_views` and `views_compare` read them:
/// 8 u64 words a part, the address of row 0's 16-byte view, the views' stride (16; 0 for
/// a literal, whose one view every row reads), the validity bitmap (0: none) and row 0's
/// bit in it, the variadic buffers' address and size tables and their count; then 4 words
/// a literal: its view, its buffer's address and size (the literals' bytes, uploaded
/// once). A column's views are read where they lie (`view_args`: a `Utf8` or `LargeUtf8`
/// column's made of its offsets).
struct PartsTable<'a> {
    table: CudaSlice<u64>,
    bytes: Vec<PartBytes>,
    /// Whether a column part may hold nulls.
    nullable: bool,
    _views: Vec<super::ViewArgs<'a>>,
    _literals: CudaSlice<u8>,
}

fn parts_table<'a>(
    cx: &Cx<'_>,
    frame: &'a DeviceFrame,
    parts: &[ConcatPart],
    err: u64,
) -> Result<PartsTable<'a>, BoxError> {
    let s = cx.stream;
    let n = frame.num_rows();
    let literal_bytes: Vec<u8> = parts
        .iter()
        .flat_map(|p| match p {
            ConcatPart::Literal(bytes) => bytes.as_slice(),
            ConcatPart::Column { .. } => &[],
        })
        .copied()
        .collect();
    let literals = s.clone_htod(if literal_bytes.is_empty() {
        &[0u8][..]
    } else {
        &literal_bytes
    })?;
    let literals_at = addr(&literals, s);
    let n_literals = parts
        .iter()
        .filter(|p| matches!(p, ConcatPart::Literal(_)))
        .count();
    let words = 8 * parts.len() + 4 * n_literals;
    let mut table = cx.zeros::<u64>(words)?;
    let table_at = addr(&table, s);
    let mut host = vec![0u64; words];
    let (mut extra, mut at) = (8 * parts.len(), 0usize);
    let mut views = Vec::new();
    let mut bytes_of = Vec::with_capacity(parts.len());
    let mut nullable = false;
    let arg = |a: A| match a {
        A::U64(v) => v,
        _ => unreachable!("view_args' arguments are u64 but for none"),
    };
    for (p, part) in parts.iter().enumerate() {
        let row = &mut host[8 * p..8 * p + 8];
        match part {
            ConcatPart::Column { index, name } => {
                let column = frame_column(frame, *index, name)?;
                let view = view_args(cx, column, name, n, err)?;
                let [_, bitmap, offset, _, bufs, sizes, count] = view.args;
                row[..7].copy_from_slice(&[
                    view.first_view(),
                    16,
                    arg(bitmap),
                    arg(offset),
                    arg(bufs),
                    arg(sizes),
                    arg(count),
                ]);
                bytes_of.push(PartBytes::Column(value_bytes(column)));
                nullable |= view.has_validity;
                views.push(view);
            }
            ConcatPart::Literal(bytes) => {
                let mut view = [0u8; 16];
                view[..4].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
                if bytes.len() <= 12 {
                    view[4..4 + bytes.len()].copy_from_slice(bytes);
                } else {
                    // Buffer 0 (the literals' bytes), at the literal's start.
                    view[4..8].copy_from_slice(&bytes[..4]);
                    view[12..].copy_from_slice(&(at as u32).to_le_bytes());
                }
                let here = table_at + 8 * extra as u64;
                row[..7].copy_from_slice(&[here, 0, 0, 0, here + 16, here + 24, 1]);
                host[extra] = u64::from_le_bytes(view[..8].try_into().expect("8 bytes"));
                host[extra + 1] = u64::from_le_bytes(view[8..].try_into().expect("8 bytes"));
                host[extra + 2] = literals_at;
                host[extra + 3] = literal_bytes.len() as u64;
                bytes_of.push(PartBytes::Literal(bytes.len() as u64));
                extra += 4;
                at += bytes.len();
            }
        }
    }
    s.memcpy_htod(&host, &mut table)?;
    Ok(PartsTable {
        table,
        bytes: bytes_of,
        nullable,
        _views: views,
        _literals: literals,
    })
}

/// `a <op> b` of two strings a row ([`Node::StrCompare`](crate::compute::expr::Node::StrCompare):
/// each a column or a literal), compared byte by byte as arrow compares them, into
/// `out`'s lanes (1 or 0; null where either is), by `views_compare` over a
/// [`PartsTable`] of the two.
pub(super) fn compare_strings(
    cx: &Cx<'_>,
    frame: &DeviceFrame,
    sides: &[ConcatPart; 2],
    op: u32,
    (values, valid): (u64, u64),
    err: u64,
) -> Result<(), BoxError> {
    let n = frame.num_rows();
    let table = parts_table(cx, frame, sides, err)?;
    let args = [
        A::U64(addr(&table.table, cx.stream)),
        A::U64(n as u64),
        A::U32(op),
        A::U64(values),
        A::U64(valid),
        A::U64(err),
    ];
    cx.launch(&cx.k.views_compare, n, &args)?;
    drop(table);
    Ok(())
}

/// A bound of the bytes of a string column's values: its data (an offset-based column's
/// one buffer, a view column's variadic ones, between the views and their sizes) and 12
/// a row (its inline values). Views that share bytes can pass it.
fn value_bytes(column: &FrameColumn) -> u64 {
    let c = column.column();
    let last = match c.data_type() {
        DataType::Utf8 | DataType::LargeUtf8 => 3,
        _ => c.n_buffers().saturating_sub(1),
    };
    (2..last)
        .filter_map(|b| c.buffer(b))
        .map(|b| b.len() as u64)
        .sum::<u64>()
        .saturating_add(12 * column.len() as u64)
}

/// A string column of type `out` that `kernel` makes of each value of `column`, read
/// where it lies (`view_args`), in two passes ([`two_pass_strings`], the data at most
/// `cap` bytes). The kernel's parameters: the column's view arguments, `extra`, then
/// pass, lens, valid, wide, offsets, data, cap and the error word (`replace_views`',
/// `pad_views'`).
fn from_each_value(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    (column, name): (&FrameColumn, &str),
    (kernel, extra): (&CudaFunction, &[A]),
    (out, cap): (&DataType, u64),
    err: u64,
) -> Result<CudaArray, BoxError> {
    let n = column.len();
    let view = view_args(cx, column, name, n, err)?;
    let wide = matches!(out, DataType::LargeUtf8 | DataType::Utf8View);
    let array = two_pass_strings(
        cx,
        cuda,
        (n, out, cap),
        view.has_validity,
        |pass, lens, valid, offsets, data| {
            let args = view.args.iter().chain(extra).copied().chain(pass_args(
                pass,
                (lens, valid),
                (wide, offsets),
                (data, cap),
                err,
            ));
            cx.launch(kernel, n, &args.collect::<Vec<_>>())
        },
        err,
    );
    drop(view);
    array
}

/// `replace(value, from, to)` of each value of a string column
/// ([`Node::Replace`](crate::compute::expr::Node::Replace)), a column of type `out`, in
/// two passes of `replace_views` ([`from_each_value`]): each row's length (its matches
/// counted), then its bytes with the matches replaced. The bound of the data: the
/// column's ([`value_bytes`]), times `to`'s length over `from`'s (rounded up) where `to`
/// is the longer.
pub(super) fn replace_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    (column, name): (&FrameColumn, &str),
    (from, to): (&[u8], &[u8]),
    out: &DataType,
    err: u64,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let growth = match (from.len() as u64, to.len() as u64) {
        (f, t) if f > 0 && t > f => t.div_ceil(f),
        _ => 1,
    };
    let cap = value_bytes(column).saturating_mul(growth);
    // `from` then `to`, on the device (at least one byte).
    let literals = s.clone_htod(&[from, to, &[0u8][..]].concat())?;
    let at = addr(&literals, s);
    let extra = [
        A::U64(at),
        A::U64(from.len() as u64),
        A::U64(at + from.len() as u64),
        A::U64(to.len() as u64),
    ];
    let array = from_each_value(
        cx,
        cuda,
        (column, name),
        (&cx.k.replace_views, &extra),
        (out, cap),
        err,
    );
    drop(literals);
    array
}

/// `regexp_replace(value, pattern, replacement[, flags])` of each value of a string
/// column ([`Node::RegexReplace`](crate::compute::expr::Node::RegexReplace)), a column
/// of type `out`, in two passes of `regex_replace_views` ([`from_each_value`]): each
/// row's length, then its bytes with the matches (the first, or every one with
/// `global`) replaced. The pattern's automaton ([`RegexTable`](crate::compute::automaton::RegexTable))
/// is the context's copy ([`Cx::regex_tables`]); the replacement is uploaded with the
/// launch. The data's bound: where the pattern matches no empty string, a match has at
/// least one byte, so the column's bytes times the replacement's length (at least once);
/// else a replacement may also come before each byte and at each value's end, so the
/// column's bytes times one more than the replacement's length, and a replacement a row.
pub(super) fn regex_replace_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    (column, name): (&FrameColumn, &str),
    (table, replacement, global): (&crate::compute::automaton::RegexTable, &[u8], bool),
    out: &DataType,
    err: u64,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let rlen = replacement.len() as u64;
    let cap = if table.matches_empty {
        value_bytes(column)
            .saturating_mul(rlen + 1)
            .saturating_add((column.len() as u64).saturating_mul(rlen))
    } else {
        value_bytes(column).saturating_mul(rlen.max(1))
    };
    let tables = (
        cx.regex_tables(table)?,
        s.clone_htod(&[replacement, &[0u8][..]].concat())?,
    );
    let extra = [
        A::U64(addr(&tables.0.classes, s)),
        A::U64(addr(&tables.0.next, s)),
        A::U64(addr(&tables.0.kinds, s)),
        A::U64(addr(&tables.0.anchored, s)),
        A::U32(table.stride),
        A::U64(addr(&tables.1, s)),
        A::U64(replacement.len() as u64),
        A::U32(u32::from(global)),
    ];
    let array = from_each_value(
        cx,
        cuda,
        (column, name),
        (&cx.k.regex_replace_views, &extra),
        (out, cap),
        err,
    );
    drop(tables);
    array
}

/// A string column of `n` rows of type `out` written in two passes of a kernel
/// (`launch(pass, lens, valid, offsets, data)`): pass 0 writes each row's length and
/// validity flag, which are scanned on the device (inclusive) into the offsets; pass 1
/// checks the total against `cap` (over it: 8 in the error word, the host's; past i32
/// for `Utf8`: 1) and writes the n + 1 offsets (i64 for `LargeUtf8` and `Utf8View`)
/// and each row's bytes into a data buffer of `cap` bytes. A `Utf8View` result is made
/// of the offsets by `utf8_views`, the data its one buffer. The validity flags are
/// packed where `nullable`. Nothing is read back.
///
/// The kernel must write valid UTF-8 at each row's range, and the offsets as above.
fn two_pass_strings(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    (n, out, cap): (usize, &DataType, u64),
    nullable: bool,
    launch: impl Fn(u32, u64, u64, u64, u64) -> Result<(), BoxError>,
    err: u64,
) -> Result<CudaArray, BoxError> {
    use devarrow::abi::device::DeviceKernels;

    let s = cx.stream;
    let lens = cx.zeros::<i64>(n)?;
    let valid = cx.zeros::<u8>(n)?;
    let (lens_at, valid_at) = (addr(&lens, s), addr(&valid, s));
    launch(0, lens_at, valid_at, 0, 0)?;
    // SAFETY: `lens` holds `n` i64s on this device, written by pass 0 on the device's
    // stream, the stream the scan runs on (in order after it).
    unsafe { cuda.inclusive_scan_i64(lens_at as *mut std::ffi::c_void, n as u64) }?;
    let validity = packed_validity(cx, &valid, n, nullable)?;
    let data = cx.zeros::<u8>(usize::try_from(cap).map_err(|_| "a bound past usize")?)?;
    let data_at = addr(&data, s);
    if *out == DataType::Utf8View {
        let offsets = cx.zeros::<i64>(n + 1)?;
        launch(1, lens_at, valid_at, addr(&offsets, s), data_at)?;
        let made = cx.zeros::<u128>(n)?;
        cx.launch(
            &cx.k.utf8_views,
            n,
            &[
                A::U64(addr(&offsets, s)),
                A::U32(1),
                A::U64(data_at),
                A::U64(data.len() as u64),
                A::U64(0),
                A::U64(n as u64),
                A::U64(addr(&made, s)),
                A::U64(err),
            ],
        )?;
        drop((lens, valid, offsets));
        // SAFETY: `utf8_views` wrote one view per row (ordered before the export on this
        // stream) of the offsets pass 1 wrote over `data` (a total past the buffer, or
        // offsets outside it, fail the batch by the error word): inline, or buffer 0,
        // `data`, at the row's start; the bytes UTF-8, as the kernel promises.
        return Ok(unsafe { CudaArray::from_views(out.clone(), made, vec![data], validity) }?);
    }
    let wide = *out == DataType::LargeUtf8;
    // SAFETY: pass 1 writes the n + 1 offsets, 0 then the scan of the rows' lengths
    // (non-decreasing; a total past `data`'s size, or past i32 for `Utf8`, fails the
    // batch by the error word and writes nothing), and each row's UTF-8 bytes to its
    // range.
    let array = unsafe {
        offset_array(cx, out.clone(), (wide, n), data, validity, |offsets| {
            launch(1, lens_at, valid_at, offsets, data_at)
        })
    };
    drop((lens, valid));
    array
}

/// `lpad` (`rpad` with `right`) of each value of a string column to `target` characters
/// with `fill` ([`Node::Pad`](crate::compute::expr::Node::Pad)), a column of type `out`,
/// in two passes of `pad_views` ([`from_each_value`]): each row's length (its characters
/// counted up to `target`), then its kept bytes and its padding. The padding (the fill
/// repeated to `target` characters) and its byte offsets are uploaded once. The data's
/// bound is exact: a row has at most `target` characters of the value (4 bytes each at
/// most) and the whole padding.
pub(super) fn pad_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    (column, name): (&FrameColumn, &str),
    (target, fill, right): (u64, &[u8], bool),
    out: &DataType,
    err: u64,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let (padding, offsets) = crate::compute::expr::padding(fill, target);
    let cap =
        (column.len() as u64).saturating_mul((padding.len() as u64).saturating_add(4 * target));
    let pad = s.clone_htod(&[padding.as_slice(), &[0u8][..]].concat())?;
    let pad_offsets = s.clone_htod(&offsets)?;
    let extra = [
        A::U64(addr(&pad, s)),
        A::U64(addr(&pad_offsets, s)),
        A::U64(target),
        A::U32(u32::from(right)),
    ];
    let array = from_each_value(
        cx,
        cuda,
        (column, name),
        (&cx.k.pad_views, &extra),
        (out, cap),
        err,
    );
    drop((pad, pad_offsets));
    array
}

/// `reverse`, `repeat`, `translate` or `overlay` of each value of a string column
/// ([`Node::Transform`](crate::compute::expr::Node::Transform)), a column of type
/// `out`, in two passes of `view_transform` ([`from_each_value`]); `translate`'s table
/// and `overlay`'s literal uploaded once. The data's bound: the values' bytes
/// ([`value_bytes`]), times the count for `repeat`, twice them and the literal a row
/// for `overlay`.
pub(super) fn transform_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    (column, name): (&FrameColumn, &str),
    op: &crate::compute::expr::Transform,
    out: &DataType,
    err: u64,
) -> Result<CudaArray, BoxError> {
    use crate::compute::expr::Transform;
    let s = cx.stream;
    let bytes = value_bytes(column);
    let (count, mode, table, end, cap) = match op {
        Transform::Reverse => (1, 0, None, 0, bytes),
        Transform::Repeat(n) => (*n, 1, None, 0, bytes.saturating_mul(*n)),
        Transform::Translate(table) => (1, 2, Some(s.clone_htod(table.as_slice())?), 0, bytes),
        // A row's prefix and suffix may overlap (a negative count): twice its bytes.
        Transform::Overlay { prefix, end, with } => {
            let len = u32::try_from(with.len())
                .ok()
                .filter(|l| *l < 1 << 24)
                .ok_or("an overlay's literal past 16 MiB")?;
            let with_bytes = (column.len() as u64).saturating_mul(u64::from(len));
            let table = s.clone_htod(&[with.as_slice(), &[0u8][..]].concat())?;
            let cap = bytes.saturating_mul(2).saturating_add(with_bytes);
            (*prefix, 3 | len << 8, Some(table), *end, cap)
        }
    };
    let extra = [
        A::U64(count),
        A::U32(mode),
        A::U64(table.as_ref().map_or(0, |t| addr(t, s))),
        A::U64(end),
    ];
    let array = from_each_value(
        cx,
        cuda,
        (column, name),
        (&cx.k.view_transform, &extra),
        (out, cap),
        err,
    );
    drop(table);
    array
}

/// `n` lanes written as strings (`CAST(x AS <string type>)`,
/// [`Node::ToText`](crate::compute::expr::Node::ToText)), a column of type `out`, in two
/// passes of `lanes_to_text` ([`two_pass_strings`]): each row's length, then its bytes,
/// as arrow's cast writes them ([`Text::write`](crate::compute::convert::Text::write)). A
/// value arrow writes otherwise sets 8 in the error word (the batch is the host's). The
/// data's bound: [`Text::max_bytes`](crate::compute::convert::Text::max_bytes) a row. The
/// validity flags are packed where `nullable`.
pub(super) fn text_column(
    cx: &Cx<'_>,
    cuda: &Arc<CudaDevice>,
    (lanes, n, nullable): (&super::Lanes, usize, bool),
    text: crate::compute::convert::Text,
    out: &DataType,
    err: u64,
) -> Result<CudaArray, BoxError> {
    let s = cx.stream;
    let (kind, scale, precision, suffix) = text.kernel_args();
    let cap = (n as u64).saturating_mul(text.max_bytes());
    let wide = matches!(out, DataType::LargeUtf8 | DataType::Utf8View);
    two_pass_strings(
        cx,
        cuda,
        (n, out, cap),
        nullable,
        |pass, lens, valid, offsets, data| {
            let args = [
                A::U64(addr(&lanes.values, s)),
                A::U64(addr(&lanes.valid, s)),
                A::U64(n as u64),
                A::U32(kind),
                A::U32(scale),
                A::U32(precision),
                A::U64(suffix),
            ]
            .into_iter()
            .chain(pass_args(
                pass,
                (lens, valid),
                (wide, offsets),
                (data, cap),
                err,
            ));
            cx.launch(&cx.k.lanes_to_text, n, &args.collect::<Vec<_>>())
        },
        err,
    )
}

/// The arguments a two-pass string kernel ends with ([`two_pass_strings`]): the pass,
/// the rows' lengths and validity flags, whether the offsets are i64 and where they go,
/// the data and its bound, and the error word.
fn pass_args(
    pass: u32,
    (lens, valid): (u64, u64),
    (wide, offsets): (bool, u64),
    (data, cap): (u64, u64),
    err: u64,
) -> [A; 8] {
    [
        A::U32(pass),
        A::U64(lens),
        A::U64(valid),
        A::U32(u32::from(wide)),
        A::U64(offsets),
        A::U64(data),
        A::U64(cap),
        A::U64(err),
    ]
}
