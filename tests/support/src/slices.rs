//! Large columns of every layout a slice has to cut (variable-length data, views, lists
//! of strings, maps, unions, run-end encoded arrays, dictionaries, structs), with nulls,
//! for the tests that a small slice of one moves only its bytes, and for the slice matrix
//! (`cargo run -p devarrow-bridge --example slice_matrix`), which prints the bytes moved
//! per type.
//!
//! Every column is valid, deterministic, and has nulls at the top level (where the type
//! has a validity bitmap) and in its children.

use std::sync::Arc;

use arrow_array::builder::{
    BinaryViewBuilder, FixedSizeListBuilder, GenericListBuilder, Int32Builder, ListBuilder,
    MapBuilder, StringBuilder, StringViewBuilder,
};
use arrow_array::types::Int32Type;
use arrow_array::*;
use arrow_buffer::{BooleanBuffer, NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::{DataType, Field, UnionFields};
use devarrow_abi::{cpu, DeviceArray};

/// Where [`columns`]' tests and the slice matrix cut their slices: a few rows from the
/// middle, at an offset that is not a multiple of 8 (bitmaps start mid-byte).
pub const SLICE_OFFSET: usize = 50_003;
/// The rows of those slices.
pub const SLICE_LEN: usize = 1_000;
/// The rows of the columns those slices come from.
pub const ROWS: usize = 100_000;

fn valid(i: usize) -> bool {
    i % 7 != 3
}

/// A string of a few bytes, or (most rows) longer than 12 bytes, so that view types keep
/// most values out of line.
fn text(i: usize) -> String {
    if i.is_multiple_of(5) {
        format!("s{}", i % 100)
    } else {
        format!("a string longer than twelve bytes, row {i}")
    }
}

/// A validity bitmap for `rows` rows whose `NullBuffer` starts `shift` bits into its
/// buffer (so it has an offset of its own, unlike the data it goes with).
fn shifted_nulls(rows: usize, shift: usize) -> NullBuffer {
    let bits = BooleanBuffer::from_iter((0..rows + shift).map(|i| i < shift || valid(i - shift)));
    NullBuffer::new(bits.slice(shift, rows))
}

/// The columns, named by their type, each of `rows` rows (at least 8; the view columns
/// of [`large_view_columns`] but the built ones too from 100 rows).
pub fn columns(rows: usize) -> Vec<(&'static str, ArrayRef)> {
    let mut cols: Vec<(&'static str, ArrayRef)> = Vec::new();
    cols.push((
        "int64",
        Arc::new(Int64Array::from_iter(
            (0..rows).map(|i| valid(i).then_some(i as i64)),
        )),
    ));
    // A NullBuffer with an offset of its own (5 bits), over values with none.
    cols.push((
        "int32, nulls at another offset",
        Arc::new(Int32Array::new(
            ScalarBuffer::from_iter((0..rows).map(|i| i as i32)),
            Some(shifted_nulls(rows, 5)),
        )),
    ));
    cols.push((
        "utf8",
        Arc::new(StringArray::from_iter(
            (0..rows).map(|i| valid(i).then(|| text(i))),
        )),
    ));
    let strings = StringArray::from_iter_values((0..rows).map(text));
    let (offsets, values, _) = strings.into_parts();
    cols.push((
        "utf8, nulls at another offset",
        Arc::new(StringArray::new(
            offsets,
            values,
            Some(shifted_nulls(rows, 3)),
        )),
    ));
    let mut views = StringViewBuilder::new();
    let mut binary_views = BinaryViewBuilder::new();
    for i in 0..rows {
        let value = valid(i).then(|| text(i));
        views.append_option(value.as_deref());
        binary_views.append_option(value.as_deref().map(str::as_bytes));
    }
    cols.push(("utf8_view", Arc::new(views.finish())));
    cols.push(("binary_view", Arc::new(binary_views.finish())));
    cols.push((
        "list<int32>",
        Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
            (0..rows).map(|i| {
                valid(i).then(|| {
                    (0..i % 5)
                        .map(|j| (j != 2).then_some((i + j) as i32))
                        .collect::<Vec<_>>()
                })
            }),
        )),
    ));
    let mut lists = ListBuilder::new(StringBuilder::new());
    let mut large_lists = GenericListBuilder::<i64, _>::new(StringBuilder::new());
    let mut nested = ListBuilder::new(ListBuilder::new(StringBuilder::new()));
    for i in 0..rows {
        for j in 0..i % 4 {
            let value = (j != 1).then(|| text(i + j));
            lists.values().append_option(value.as_deref());
            large_lists.values().append_option(value.as_deref());
            let inner = nested.values();
            for k in 0..(i + j) % 3 {
                inner.values().append_option((k != 1).then(|| text(i + k)));
            }
            inner.append(j != 2);
        }
        lists.append(valid(i));
        large_lists.append(valid(i));
        nested.append(valid(i));
    }
    cols.push(("list<utf8>", Arc::new(lists.finish())));
    cols.push(("large_list<utf8>", Arc::new(large_lists.finish())));
    cols.push(("list<list<utf8>>", Arc::new(nested.finish())));
    let mut fixed = FixedSizeListBuilder::new(StringBuilder::new(), 3);
    for i in 0..rows {
        for j in 0..3 {
            let value = (j != 1 || i % 2 == 0).then(|| text(i + j));
            fixed.values().append_option(value.as_deref());
        }
        fixed.append(valid(i));
    }
    cols.push(("fixed_size_list<utf8, 3>", Arc::new(fixed.finish())));
    let mut map = MapBuilder::new(None, StringBuilder::new(), Int32Builder::new());
    for i in 0..rows {
        for j in 0..i % 3 {
            map.keys().append_value(text(i + j));
            map.values()
                .append_option((j != 1).then_some((i + j) as i32));
        }
        map.append(valid(i)).expect("map entry");
    }
    cols.push(("map<utf8, int32>", Arc::new(map.finish())));
    let strings = StringArray::from_iter((0..rows).map(|i| (i % 4 != 1).then(|| text(i))));
    let ints = Int32Array::from_iter((0..rows).map(|i| (i % 3 != 1).then_some(i as i32)));
    cols.push((
        "struct<int32, utf8>",
        Arc::new(StructArray::new(
            vec![
                Field::new("i", DataType::Int32, true),
                Field::new("s", DataType::Utf8, true),
            ]
            .into(),
            vec![Arc::new(ints.clone()), Arc::new(strings.clone())],
            Some(NullBuffer::from_iter((0..rows).map(valid))),
        )),
    ));
    // A list view over the strings in reverse order (offsets decrease), empty and null
    // views pointing nowhere in particular.
    let sizes: Vec<i32> = (0..rows).map(|i| (i % 3) as i32).collect();
    let offsets: Vec<i32> = (0..rows)
        .map(|i| (rows - 1 - i).saturating_sub(2) as i32)
        .collect();
    cols.push((
        "list_view<utf8>",
        Arc::new(ListViewArray::new(
            Arc::new(Field::new("item", DataType::Utf8, true)),
            ScalarBuffer::from(offsets),
            ScalarBuffer::from(sizes),
            Arc::new(strings.clone()),
            Some(NullBuffer::from_iter((0..rows).map(valid))),
        )),
    ));
    let fields = UnionFields::try_new(
        vec![3, 8],
        vec![
            Field::new("i", DataType::Int32, true),
            Field::new("s", DataType::Utf8, true),
        ],
    )
    .expect("union fields");
    let type_id = |i: usize| if i.is_multiple_of(3) { 3i8 } else { 8 };
    cols.push((
        "sparse_union<int32, utf8>",
        Arc::new(
            UnionArray::try_new(
                fields.clone(),
                ScalarBuffer::from_iter((0..rows).map(type_id)),
                None,
                vec![Arc::new(ints.clone()), Arc::new(strings.clone())],
            )
            .expect("sparse union"),
        ),
    ));
    let mut counts = [0i32; 2];
    let dense_offsets: Vec<i32> = (0..rows)
        .map(|i| {
            let child = usize::from(type_id(i) == 8);
            counts[child] += 1;
            counts[child] - 1
        })
        .collect();
    cols.push((
        "dense_union<int32, utf8>",
        Arc::new(
            UnionArray::try_new(
                fields,
                ScalarBuffer::from_iter((0..rows).map(type_id)),
                Some(ScalarBuffer::from(dense_offsets)),
                vec![
                    Arc::new(ints.slice(0, counts[0] as usize)),
                    Arc::new(strings.slice(0, counts[1] as usize)),
                ],
            )
            .expect("dense union"),
        ),
    ));
    // Runs of 1 to 4 rows.
    let mut ends = Vec::new();
    let mut end = 0;
    while end < rows {
        end = (end + 1 + ends.len() % 4).min(rows);
        ends.push(end as i32);
    }
    let values = StringArray::from_iter((0..ends.len()).map(|r| (r % 5 != 2).then(|| text(r))));
    cols.push((
        "run_end_encoded<int32, utf8>",
        Arc::new(
            RunArray::<Int32Type>::try_new(&Int32Array::from(ends), &values)
                .expect("run-end encoded"),
        ),
    ));
    let words = StringArray::from_iter_values((0..1000).map(text));
    cols.push((
        "dictionary<int32, utf8>",
        Arc::new(
            DictionaryArray::<Int32Type>::try_new(
                Int32Array::from_iter((0..rows).map(|i| valid(i).then_some((i % 1000) as i32))),
                Arc::new(words),
            )
            .expect("dictionary"),
        ),
    ));
    let list_of_strings: OffsetBuffer<i32> = OffsetBuffer::from_lengths((0..rows).map(|i| i % 3));
    // The sum of the lengths (`OffsetBuffer::last` is the last offset on arrow-rs 60, the
    // slice's `Option<&i32>` on 59).
    let items: usize = (0..rows).map(|i| i % 3).sum();
    let mut views = StringViewBuilder::new();
    for i in 0..rows {
        views.append_option(valid(i).then(|| text(i)).as_deref());
    }
    cols.push((
        "struct<list<utf8>, utf8_view>",
        Arc::new(StructArray::new(
            vec![
                Field::new_list("l", Field::new("item", DataType::Utf8, true), true),
                Field::new("v", DataType::Utf8View, true),
            ]
            .into(),
            vec![
                Arc::new(ListArray::new(
                    Arc::new(Field::new("item", DataType::Utf8, true)),
                    list_of_strings,
                    Arc::new(StringArray::from_iter(
                        (0..items).map(|i| (i % 6 != 0).then(|| text(i))),
                    )),
                    Some(NullBuffer::from_iter((0..rows).map(|i| i % 4 != 0))),
                )),
                Arc::new(views.finish()),
            ],
            Some(NullBuffer::from_iter((0..rows).map(valid))),
        )),
    ));
    // Views as filters, takes and concatenations leave them: many ranges of bytes per
    // buffer, in several buffers (the built ones are `utf8_view` and `binary_view` above).
    if rows >= 100 {
        cols.extend(
            large_view_columns(rows)
                .into_iter()
                .filter(|(name, _)| !name.ends_with("built")),
        );
    }
    cols
}

/// A record batch of one column `name`.
pub fn batch_of(name: &str, column: ArrayRef) -> RecordBatch {
    RecordBatch::try_from_iter([(name, column)]).expect("one column")
}

/// Exports `batch` through the C data interface (devarrow's CPU export: arrow-rs's
/// `FFI_ArrowArray`) as its slice of `len` rows from `offset`, cut at the C level: every
/// column keeps all its buffers and children and gets the slice as its own `offset` and
/// `length` (its null count unknown, -1, unless it has no nulls at all), as a producer that slices an array without
/// touching its children (Arrow C++) exports it. arrow-rs's own slices push the cut into
/// the children of structs, fixed-size lists and sparse unions instead.
pub fn export_c_slice(
    batch: &RecordBatch,
    offset: usize,
    len: usize,
) -> (DeviceArray, FFI_ArrowSchema) {
    assert!(
        offset + len <= batch.num_rows(),
        "the slice lies in the batch"
    );
    let (array, schema) = cpu::export_record_batch(batch).expect("a CPU export");
    let mut raw = array.into_raw();
    raw.array.length = len as i64;
    for i in 0..raw.array.n_children as usize {
        // SAFETY: `i < n_children`, and arrow-rs's export fills `children` with valid
        // pointers to child structs it owns until the release.
        let column = unsafe { &mut **raw.array.children.add(i) };
        column.offset += offset as i64;
        column.length = len as i64;
        if column.null_count != 0 {
            column.null_count = -1;
        }
    }
    // SAFETY: `raw` came from a DeviceArray; every column still addresses items inside
    // `0..batch.num_rows()` of its own buffers and children (`offset + len` is at most
    // that), so its buffers cover what it addresses.
    let array = unsafe { DeviceArray::try_new(raw) }.expect("a valid array");
    (array, schema)
}

/// View columns (`Utf8View`, `BinaryView`) of `rows` rows (at least 100) as producers
/// make them, for slices of large view arrays:
///
/// - as arrow-rs's builders make them at their default block sizes (blocks growing from
///   8 KiB to 2 MiB: a million rows fill about 30 variadic buffers; Arrow C++'s and
///   pyarrow's builders also fill their blocks in order), most values out of line
///   (longer than 12 bytes), some inline, some null: a slice's views reach a contiguous
///   run of bytes of one or two buffers;
/// - filtered (one row in 23 kept, as arrow-rs's, Arrow C++'s and pyarrow's `filter`
///   do: the views are copied, the buffers shared): a slice's views reach bytes spread
///   over 23 times their length;
/// - taken in a scattered order (a permutation, as `take` and `sort` make it): a slice's
///   views reach bytes all over every buffer;
/// - concatenated from two arrays (their buffers appended): a slice's views reach
///   buffers of both.
pub fn large_view_columns(rows: usize) -> Vec<(&'static str, ArrayRef)> {
    assert!(rows >= 100, "enough rows to filter and concatenate");
    let mut views = StringViewBuilder::new();
    let mut binary_views = BinaryViewBuilder::new();
    for i in 0..rows {
        let value = valid(i).then(|| text(i));
        views.append_option(value.as_deref());
        binary_views.append_option(value.as_deref().map(str::as_bytes));
    }
    let views = views.finish();
    let binary_views = binary_views.finish();
    // Filtered: rows 0, 23, 46, ... of a column 23 times as long (wrapping around).
    let filtered: Vec<usize> = (0..rows).map(|i| (i * 23) % rows).collect();
    // Scattered: a permutation (7 919 is prime, coprime with any `rows` it does not
    // divide; a multiple of it would repeat rows, still valid).
    let scattered: Vec<usize> = (0..rows).map(|i| (i * 7_919) % rows).collect();
    let half = rows / 2;
    vec![
        ("utf8_view, built", Arc::new(views.clone()) as ArrayRef),
        ("binary_view, built", Arc::new(binary_views.clone())),
        (
            "utf8_view, filtered",
            Arc::new(pick_views(&views, &filtered)),
        ),
        (
            "binary_view, filtered",
            Arc::new(pick_views(&binary_views, &filtered)),
        ),
        (
            "utf8_view, scattered",
            Arc::new(pick_views(&views, &scattered)),
        ),
        (
            "binary_view, scattered",
            Arc::new(pick_views(&binary_views, &scattered)),
        ),
        (
            "utf8_view, concatenated",
            Arc::new(concat_views(
                &views.slice(0, half),
                &views.slice(half / 2, rows - half),
            )),
        ),
    ]
}

/// A value of 4 to 40 bytes for row `i`: about a fifth inline (at most 12 bytes), the
/// rest out of line, as short strings are.
pub fn varied_text(i: usize) -> String {
    let len = 4 + (i.wrapping_mul(2_654_435_761) >> 5) % 37;
    let mut s = format!("{i}:");
    while s.len() < len {
        s.push((b'a' + (s.len() % 26) as u8) as char);
    }
    s.truncate(len);
    s
}

/// The variadic bytes a view array's valid views reference (those longer than 12 bytes),
/// plus its views (16 bytes a row): what any copy of it must move at the least.
pub fn logical_view_bytes(array: &dyn Array) -> u64 {
    let views = array.to_data().buffers()[0].typed_data::<u128>()
        [array.offset()..array.offset() + array.len()]
        .to_vec();
    let outline: u64 = views
        .iter()
        .enumerate()
        .filter(|&(i, &v)| array.is_valid(i) && (v as u32) > 12)
        .map(|(_, &v)| (v as u32) as u64)
        .sum();
    16 * array.len() as u64 + outline
}

/// View columns of `rows` rows with very many small variadic buffers, as producers make
/// them: arrow-rs's builders with a fixed block size of 16 to 200 bytes (a buffer per few
/// values), such a column taken in a random order (`take`: the views copied, scattered
/// over every buffer, the buffers shared), and the concatenation of many small batches
/// (`concat`: the buffers of every batch appended). Every one has nulls.
pub fn many_block_view_columns(rows: usize) -> Vec<(String, ArrayRef)> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;

    let value = |i: usize| (i % 7 != 3).then(|| varied_text(i));
    let mut columns: Vec<(String, ArrayRef)> = Vec::new();
    for block in [16, 64, 200] {
        let mut b = StringViewBuilder::new().with_fixed_block_size(block);
        for i in 0..rows {
            b.append_option(value(i));
        }
        columns.push((
            format!("utf8_view, blocks of {block}"),
            Arc::new(b.finish()),
        ));
    }
    for block in [40, 128] {
        let mut b = BinaryViewBuilder::new().with_fixed_block_size(block);
        for i in 0..rows {
            b.append_option(value(i).map(String::into_bytes));
        }
        columns.push((
            format!("binary_view, blocks of {block}"),
            Arc::new(b.finish()),
        ));
    }
    let mut order: Vec<u32> = (0..rows as u32).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(32));
    let taken = arrow_select::take::take(&columns[1].1, &UInt32Array::from(order), None)
        .expect("rows of the column");
    columns.push(("utf8_view, blocks of 64, taken at random".into(), taken));
    // A thousand rows per batch in a column of a million (a batch of ten at least).
    let batch = (rows / 1_000).max(10);
    let pieces: Vec<ArrayRef> = (0..rows.div_ceil(batch))
        .map(|k| {
            let mut b = BinaryViewBuilder::new();
            for i in k * batch..((k + 1) * batch).min(rows) {
                b.append_option(value(i).map(String::into_bytes));
            }
            Arc::new(b.finish()) as ArrayRef
        })
        .collect();
    let pieces: Vec<&dyn Array> = pieces.iter().map(|p| p.as_ref()).collect();
    let concatenated = arrow_select::concat::concat(&pieces).expect("arrays of one type");
    columns.push((
        format!("binary_view, concat of {} batches", pieces.len()),
        concatenated,
    ));
    columns
}

/// The variadic buffers of a view column.
pub fn data_buffers(column: &dyn Array) -> usize {
    column.to_data().buffers().len() - 1
}

/// The rows `rows` of `array`, its views copied and its buffers shared (as `take` and
/// `filter` make a view array).
fn pick_views<T: arrow_array::types::ByteViewType + ?Sized>(
    array: &GenericByteViewArray<T>,
    rows: &[usize],
) -> GenericByteViewArray<T> {
    let views: Vec<u128> = rows.iter().map(|&i| array.views()[i]).collect();
    let nulls = array
        .nulls()
        .map(|n| NullBuffer::from_iter(rows.iter().map(|&i| n.is_valid(i))));
    GenericByteViewArray::try_new(views.into(), array.data_buffers().to_vec(), nulls)
        .expect("views of the array's own buffers")
}

/// `a` then `b`, the buffers of `b` appended after those of `a` and its views moved to
/// them (as `concat` makes a view array).
fn concat_views<T: arrow_array::types::ByteViewType + ?Sized>(
    a: &GenericByteViewArray<T>,
    b: &GenericByteViewArray<T>,
) -> GenericByteViewArray<T> {
    let shift = a.data_buffers().len() as u128;
    let moved = b.views().iter().map(|&v| {
        if (v as u32) > 12 {
            // The buffer index is bits 64..96 of a view that is not inline.
            v + (shift << 64)
        } else {
            v
        }
    });
    let views: Vec<u128> = a.views().iter().copied().chain(moved).collect();
    let nulls = NullBuffer::from_iter(
        (0..a.len())
            .map(|i| a.is_valid(i))
            .chain((0..b.len()).map(|i| b.is_valid(i))),
    );
    let buffers: Vec<arrow_buffer::Buffer> = a
        .data_buffers()
        .iter()
        .chain(b.data_buffers().iter())
        .cloned()
        .collect();
    GenericByteViewArray::try_new(views.into(), buffers, Some(nulls))
        .expect("views of the concatenated buffers")
}

/// The types with offsets whose zero-length arrays may come with a NULL offsets buffer
/// (nanoarrow's CUDA copy of a 0-row column), each as an empty array: Utf8, Binary, their
/// Large forms, List, LargeList and Map.
pub fn empty_offset_arrays() -> Vec<arrow_data::ArrayData> {
    let int_item = Arc::new(Field::new("item", DataType::Int32, true));
    let entries = Arc::new(Field::new(
        "entries",
        DataType::Struct(arrow_schema::Fields::from(vec![
            Field::new("keys", DataType::Utf8, false),
            Field::new("values", DataType::Int32, true),
        ])),
        false,
    ));
    [
        DataType::Utf8,
        DataType::Binary,
        DataType::LargeUtf8,
        DataType::LargeBinary,
        DataType::List(int_item.clone()),
        DataType::LargeList(int_item),
        DataType::Map(entries, false),
    ]
    .iter()
    .map(arrow_data::ArrayData::new_empty)
    .collect()
}

/// NULLs the offsets (and, for strings and binaries, the data) of `array`, as nanoarrow
/// leaves a zero-length one.
///
/// # Safety
/// `array` must be one of arrow-rs's exports (a writable pointer array) of one of
/// [`empty_offset_arrays`]' types: two buffer slots at least, three for strings and
/// binaries.
pub unsafe fn null_offsets(array: &mut devarrow_abi::ArrowArray) {
    // SAFETY: the caller's guarantee: two buffer slots at least, three for strings.
    unsafe {
        *array.buffers.add(1) = std::ptr::null();
        if array.n_buffers == 3 {
            *array.buffers.add(2) = std::ptr::null();
        }
    }
}
