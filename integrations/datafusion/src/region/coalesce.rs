//! Coalescing a partition's small batches into one upload, without a host copy of its
//! own.
//!
//! A region's load gathers DataFusion's batches (8,192 rows by default) up to
//! `devarrow.batch_bytes` before one upload. Concatenating them on the host first
//! (`concat_batches`) costs a copy of every byte on the load thread, into memory fresh
//! from the allocator, before the upload packs the same bytes again into staging. Here
//! the columns whose concatenation is a plain placement of their bytes are written once,
//! on every core, straight into the device's staging memory
//! ([`pinned_gather`]: pinned on CUDA), laid out as the upload's image lays them out, so
//! the upload copies them directly (one DMA, no staging copy): the gather is the one host
//! copy a staged upload makes anyway. The other columns are concatenated by arrow as
//! before and staged by the upload.
//!
//! A column is placed so when every batch's array of it has no nulls and is fixed-width
//! (integers, floats, decimals, dates, times, timestamps, durations, intervals) or a
//! string or binary view array whose views all hold their bytes inline (no data buffer:
//! TPC-H's flags and short codes). Nulls (a bitmap concatenated at bit offsets), offsets
//! (rebased), views into data buffers (re-indexed), booleans and nested types go to
//! arrow's `concat`.

use arrow_array::{make_array, ArrayRef, RecordBatch, RecordBatchOptions};
use arrow_buffer::Buffer;
use arrow_schema::{DataType, SchemaRef};
use datafusion::arrow::array::ArrayData;
use datafusion::arrow::compute::concat;
use devarrow::abi::device::Device;
use devarrow::abi::Error;
use devarrow::bridge::pinned::pinned_gather;

/// Where each placed column starts in the gathered memory: every column 64-byte aligned,
/// as devarrow's device images (and arrow's own buffers) are.
const ALIGN: usize = 64;

/// The bytes per row of `arrays`' column when it can be placed (see the module docs).
fn placed_width(arrays: &[&ArrayRef]) -> Option<usize> {
    let data_type = arrays.first()?.data_type();
    let views = matches!(data_type, DataType::Utf8View | DataType::BinaryView);
    let width = if views {
        16
    } else {
        data_type.primitive_width()?
    };
    let placeable = arrays.iter().all(|array| {
        let data = array.to_data();
        array.null_count() == 0 && data.buffers().len() == 1 && data.child_data().is_empty()
    });
    placeable.then_some(width)
}

/// The concatenation of `batches` (all of `schema`), its placeable columns gathered into
/// `device`'s staging memory (see the module docs), the others concatenated by arrow.
///
/// # Errors
/// arrow's errors (`concat`, a batch of another schema) and the device's allocation
/// errors.
pub(crate) fn coalesce(
    device: &dyn Device,
    schema: &SchemaRef,
    batches: &[RecordBatch],
) -> devarrow::abi::Result<RecordBatch> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    let columns = schema.fields().len();
    // Each placed column: its index, width and offset in the gathered memory.
    let mut placed: Vec<(usize, usize, usize)> = Vec::new();
    let mut total = 0usize;
    let arrays_of = |c: usize| -> Vec<&ArrayRef> { batches.iter().map(|b| b.column(c)).collect() };
    for c in 0..columns {
        if let Some(width) = placed_width(&arrays_of(c)) {
            placed.push((c, width, total));
            total = (total + rows * width).next_multiple_of(ALIGN);
        }
    }
    let mut parts: Vec<(Buffer, usize)> = Vec::new();
    for &(c, width, at) in &placed {
        let mut row = 0;
        for batch in batches {
            let data = batch.column(c).to_data();
            let bytes =
                data.buffers()[0].slice_with_length(data.offset() * width, data.len() * width);
            parts.push((bytes, at + row * width));
            row += data.len();
        }
    }
    let gathered = if placed.is_empty() {
        None
    } else {
        Some(pinned_gather(device, total, &parts)?)
    };
    let mut out: Vec<Option<ArrayRef>> = vec![None; columns];
    if let Some(gathered) = &gathered {
        for &(c, width, at) in &placed {
            let builder = ArrayData::builder(schema.field(c).data_type().clone())
                .len(rows)
                .add_buffer(gathered.slice_with_length(at, rows * width));
            // SAFETY: the column's arrays were valid arrays of this type with no nulls,
            // one buffer each (fixed-width values, or views whose bytes are all inline),
            // and their used bytes were placed end to end, `rows * width` bytes in all:
            // a valid array of `rows` rows with no nulls, whose views (if any) still hold
            // their bytes inline and reference no data buffer.
            let data = unsafe { builder.build_unchecked() };
            out[c] = Some(make_array(data));
        }
    }
    for (c, column) in out.iter_mut().enumerate() {
        if column.is_none() {
            let arrays: Vec<&dyn arrow_array::Array> =
                arrays_of(c).into_iter().map(|a| a.as_ref()).collect();
            *column = Some(concat(&arrays).map_err(Error::Arrow)?);
        }
    }
    let columns: Vec<ArrayRef> = out
        .into_iter()
        .map(|c| c.expect("every column built"))
        .collect();
    let options = RecordBatchOptions::new().with_row_count(Some(rows));
    RecordBatch::try_new_with_options(schema.clone(), columns, &options).map_err(Error::Arrow)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use arrow_array::{
        BooleanArray, Date32Array, Decimal128Array, Int64Array, StringArray, StringViewArray,
    };
    use arrow_schema::{Field, Schema};
    use datafusion::arrow::compute::concat_batches;
    use devarrow::abi::device::CpuDevice;

    fn batch(schema: &SchemaRef, start: i64, n: usize, with_nulls: bool) -> RecordBatch {
        let ids: Vec<i64> = (start..start + n as i64).collect();
        let flags: Vec<&str> = ids
            .iter()
            .map(|i| ["A", "N", "R"][*i as usize % 3])
            .collect();
        let long: Vec<String> = ids
            .iter()
            .map(|i| format!("a string longer than twelve bytes {i}"))
            .collect();
        let nullable = Int64Array::from_iter(
            ids.iter()
                .map(|i| (!with_nulls || i % 5 != 0).then_some(*i)),
        );
        let columns: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from(ids.clone())),
            Arc::new(
                Decimal128Array::from_iter_values(ids.iter().map(|i| *i as i128 * 100))
                    .with_precision_and_scale(15, 2)
                    .unwrap(),
            ),
            Arc::new(Date32Array::from_iter_values(ids.iter().map(|i| *i as i32))),
            Arc::new(StringViewArray::from_iter_values(flags)),
            Arc::new(StringViewArray::from_iter_values(long.iter())),
            Arc::new(StringArray::from_iter_values(long.iter())),
            Arc::new(BooleanArray::from_iter(
                ids.iter().map(|i| Some(i % 2 == 0)),
            )),
            Arc::new(nullable),
        ];
        RecordBatch::try_new(schema.clone(), columns).unwrap()
    }

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("price", DataType::Decimal128(15, 2), false),
            Field::new("date", DataType::Date32, false),
            Field::new("flag", DataType::Utf8View, false),
            Field::new("comment", DataType::Utf8View, false),
            Field::new("text", DataType::Utf8, false),
            Field::new("even", DataType::Boolean, false),
            Field::new("maybe", DataType::Int64, true),
        ]))
    }

    #[test]
    fn equals_arrow_concat_and_places_the_fixed_width_columns() {
        let schema = schema();
        let device = CpuDevice::new();
        // Batches of odd sizes, slices among them (offsets into their buffers), nulls in
        // one batch only.
        let batches = vec![
            batch(&schema, 0, 1000, false),
            batch(&schema, 1000, 8192, true).slice(3, 5000),
            batch(&schema, 9000, 7, false),
            batch(&schema, 10_000, 3333, false).slice(1, 3332),
        ];
        let got = coalesce(&device, &schema, &batches).unwrap();
        let want = concat_batches(&schema, &batches).unwrap();
        assert_eq!(got, want);
        let pinned = |c: usize| {
            let data = got.column(c).to_data();
            let b = &data.buffers()[0];
            device.is_pinned(b.as_ptr(), b.len())
        };
        // id, price, date and the inline flags are placed; the long views, the strings,
        // the booleans and the column with nulls are arrow's concatenation.
        assert_eq!(
            (0..8).map(pinned).collect::<Vec<_>>(),
            [true, true, true, true, false, false, false, false]
        );
        for c in 0..4 {
            assert_eq!(
                got.column(c).to_data().buffers()[0].as_ptr() as usize % ALIGN,
                0
            );
        }
    }

    #[test]
    fn one_batch_and_no_placeable_column() {
        let schema = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, true)]));
        let strings: ArrayRef = Arc::new(StringArray::from(vec![Some("x"), None]));
        let one = RecordBatch::try_new(schema.clone(), vec![strings]).unwrap();
        let device = CpuDevice::new();
        let got = coalesce(&device, &schema, &[one.clone(), one.clone()]).unwrap();
        assert_eq!(got, concat_batches(&schema, &[one.clone(), one]).unwrap());
    }
}
