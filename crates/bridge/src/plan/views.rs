//! View types (`Utf8View`, `BinaryView`): the views cut to the slice and the variadic
//! buffers they point into, whole, or compacted into one new buffer when the slice uses
//! little of them (see the [module documentation](super)).

use arrow_array::cast::AsArray;
use arrow_array::types::ByteViewType;
use arrow_array::{make_array, Array, GenericByteViewArray};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::DataType;
use devarrow_abi::device::BUFFER_ALIGNMENT;
use devarrow_abi::{Error, Result};

use super::buffers::{cut, nulls, validity};
use super::{leaf, Node, Packer, Parts};

/// A view array's node ([`plan_view_data`]'s for `Utf8View` and `BinaryView`): compacted first
/// when its views use little of its variadic buffers ([`compacted_views`]).
pub(super) fn plan_views<T: ByteViewType + ?Sized>(
    array: &GenericByteViewArray<T>,
    image: &mut Packer,
) -> Node {
    if let Some(compacted) = compacted_views(array) {
        return plan_views(&compacted, image);
    }
    let mut buffers = Vec::with_capacity(3 + array.data_buffers().len());
    buffers.push(nulls(array.nulls(), image));
    buffers.push(image.push(array.views().inner().clone()));
    for b in array.data_buffers().iter() {
        buffers.push(image.push(b.clone()));
    }
    let sizes: Vec<i64> = array
        .data_buffers()
        .iter()
        .map(|b| b.len() as i64)
        .collect();
    buffers.push(image.push(Buffer::from_vec(sizes)));
    leaf(array, buffers)
}

/// A view array's buffers from its `ArrayData`: validity, views, the variadic buffers and
/// their sizes; compacted first when its views use little of its variadic buffers
/// ([`compact_views`]).
pub(super) fn plan_view_data(
    data: &ArrayData,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    // A slice whose views use little of the variadic buffers moves a compacted copy of
    // what they use instead (views rewritten, offset 0).
    let compacted = compact_views(data);
    let data = compacted.as_ref().unwrap_or(data);
    let (start, len) = (data.offset(), data.len());
    let [views, variadic @ ..] = data.buffers() else {
        return Err(Error::InvalidArgument(format!(
            "{} array has no views buffer",
            data.data_type()
        )));
    };
    let buffers = &mut parts.buffers;
    buffers.push(validity(data, image));
    buffers.push(image.push(cut(views, start, len, 16)?));
    for b in variadic {
        buffers.push(image.push(b.clone()));
    }
    let sizes: Vec<i64> = variadic.iter().map(|b| b.len() as i64).collect();
    buffers.push(image.push(Buffer::from_vec(sizes)));
    Ok(())
}

/// For a slice of a view array (`Utf8View`, `BinaryView`) whose views reference less than
/// half of what its variadic buffers would cost to move ([`buffers_cost`]): a copy with
/// only the referenced bytes, in one new buffer, and its views rewritten (arrow-rs's
/// `gc`), so that the bytes moved are proportional to the slice, however many buffers
/// the array has. `None` when the buffers are used as they are (most of their bytes are
/// referenced, so rewriting would cost more than it saves).
fn compact_views(data: &ArrayData) -> Option<ArrayData> {
    // Without variadic buffers (every value inline) there is nothing to compact.
    let [views, variadic @ ..] = data.buffers() else {
        return None;
    };
    let views = views
        .as_slice()
        .get(16 * data.offset()..16 * (data.offset() + data.len()))?;
    // Decided before the array is rebuilt as a typed one (a clone of every buffer).
    if !compaction_pays(views, variadic) {
        return None;
    }
    let array = make_array(data.clone());
    match data.data_type() {
        DataType::Utf8View => Some(array.as_string_view_opt()?.gc().into_data()),
        DataType::BinaryView => Some(array.as_binary_view_opt()?.gc().into_data()),
        _ => None,
    }
}

/// [`compact_views`] of a typed view array.
fn compacted_views<T: ByteViewType + ?Sized>(
    array: &GenericByteViewArray<T>,
) -> Option<GenericByteViewArray<T>> {
    let views = array.views().inner().as_slice();
    compaction_pays(views, array.data_buffers()).then(|| array.gc())
}

/// What the variadic buffers `variadic` cost to move as they are: their bytes, each
/// placed at a 64-byte boundary of the image, and their sizes (8 bytes each). Many small
/// buffers (a column built with small blocks, or concatenated from many batches) cost
/// several times their bytes.
fn buffers_cost(variadic: &[Buffer]) -> usize {
    variadic.iter().fold(0usize, |total, b| {
        let placed = b.len().checked_next_multiple_of(BUFFER_ALIGNMENT);
        total.saturating_add(placed.unwrap_or(usize::MAX).saturating_add(8))
    })
}

/// Whether compacting the 16-byte `views` over `variadic` saves more than it costs: the
/// one buffer of what they reference costs under half of what the buffers cost to move
/// as they are (never for a compacted array: its one buffer is that buffer).
fn compaction_pays(views: &[u8], variadic: &[Buffer]) -> bool {
    if variadic.iter().all(|b| b.is_empty()) {
        return false;
    }
    let cost = buffers_cost(variadic);
    let compacted = |used: usize| {
        let placed = used.checked_next_multiple_of(BUFFER_ALIGNMENT);
        placed
            .unwrap_or(usize::MAX)
            .saturating_add(8)
            .saturating_mul(2)
    };
    // Most view arrays use most of their buffers: decide that from a sample of the views
    // (a full scan costs more than the array's DMA), and scan in full only when the sample
    // says compacting may pay off; then count exactly, once per view as `gc` copies.
    if compacted(estimated_view_bytes(views)) >= cost {
        return false;
    }
    compacted(view_bytes(views)) < cost
}

/// The variadic bytes the 16-byte `views` reference: the lengths of the views that are
/// not inline, as `gc` copies them.
fn view_bytes(views: &[u8]) -> usize {
    (0..views.len() / 16).map(|i| outline_len(views, i)).sum()
}

/// The length of view `i` of `views` when it is not inline (longer than 12 bytes, a
/// little-endian `u32` first), else 0.
fn outline_len(views: &[u8], i: usize) -> usize {
    let len = views
        .get(16 * i..16 * i + 4)
        .map_or(0, |l| u32::from_le_bytes([l[0], l[1], l[2], l[3]]) as usize);
    if len > 12 {
        len
    } else {
        0
    }
}

/// Views sampled by [`estimated_view_bytes`]: every view of arrays up to this long. The
/// estimate only decides whether to count exactly: a few dozen views tell a slice that
/// uses little of its buffers from one that uses most. Each sampled view of a batch
/// not in cache is a cache miss: 256 samples per column were a third of the time of
/// planning a `lineitem` batch of 1,024 rows (8.5 µs against 5.5 µs with 64).
const VIEW_SAMPLE: usize = 64;

/// An estimate of the variadic bytes the 16-byte `views` reference (the lengths of the
/// views that are not inline, as `gc` counts them): exact up to [`VIEW_SAMPLE`] views,
/// else extrapolated from that many evenly spaced ones.
fn estimated_view_bytes(views: &[u8]) -> usize {
    let n = views.len() / 16;
    if n <= VIEW_SAMPLE {
        return view_bytes(views);
    }
    let step = n / VIEW_SAMPLE;
    let sampled: usize = (0..VIEW_SAMPLE).map(|k| outline_len(views, k * step)).sum();
    sampled.saturating_mul(step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::StringViewArray;

    fn views_of(array: &StringViewArray) -> &[u8] {
        array.views().inner().as_slice()
    }

    #[test]
    // 100 000 formatted strings (2 MB) built and measured: far too slow under Miri.
    #[cfg_attr(miri, ignore)]
    fn view_bytes_are_exact_for_short_arrays_and_estimated_for_long_ones() {
        let short = StringViewArray::from(vec!["inline", "a string of twenty-one", "", "x"]);
        assert_eq!(estimated_view_bytes(views_of(&short)), 22);
        let values: Vec<String> = (0..100_000).map(|i| format!("{i:0>20}")).collect();
        let long = StringViewArray::from_iter_values(&values);
        assert_eq!(long.total_buffer_bytes_used(), 2_000_000);
        let estimate = estimated_view_bytes(views_of(&long));
        assert!(
            (1_900_000..=2_000_000).contains(&estimate),
            "estimate {estimate}"
        );
        // a slice of the long array: its views are all sampled
        let slice = long.slice(10, VIEW_SAMPLE);
        assert_eq!(estimated_view_bytes(views_of(&slice)), 20 * VIEW_SAMPLE);
    }

    #[test]
    fn compaction_pays_for_little_of_big_buffers_or_for_many_small_ones() {
        use arrow_array::builder::StringViewBuilder;
        let values: Vec<String> = (0..1_000).map(|i| format!("{i:0>20}")).collect();
        let big = StringViewArray::from_iter_values(&values);
        let pays = |a: &StringViewArray| compaction_pays(views_of(a), a.data_buffers());
        // One buffer: a slice of a tenth compacts, the whole array does not.
        assert!(pays(&big.slice(100, 100)));
        assert!(!pays(&big));
        // A buffer per value: each costs 64 bytes and its size for 20, so even the whole
        // array compacts (into one buffer)...
        let mut builder = StringViewBuilder::new().with_fixed_block_size(16);
        values.iter().for_each(|v| builder.append_value(v));
        let small_blocks = builder.finish();
        assert_eq!(small_blocks.data_buffers().len(), 1_000);
        assert!(pays(&small_blocks));
        // ...and a compacted array never compacts again, however small its one buffer.
        for array in [small_blocks.gc(), big.slice(5, 1).gc(), big.gc()] {
            assert!(!pays(&array));
        }
        // Nothing to compact without variadic bytes.
        assert!(!pays(&StringViewArray::from(vec!["inline", "x"])));
    }
}
