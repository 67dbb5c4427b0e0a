//! One buffer of a node cut to the node's slice, zero-copy where it can be: fixed-width
//! values cut to the slice, validity bitmaps realigned to bit 0, offsets rebased to start
//! at 0; what every layout family of the planner is made of.

use arrow_buffer::{ArrowNativeType, Buffer, NullBuffer};
use arrow_data::ArrayData;
use devarrow_abi::{Error, Result};

use super::{Packer, Parts, Placement};

/// Buffer `i` of `data`: an error, not a panic, when the array has fewer.
pub(super) fn buffer(data: &ArrayData, i: usize) -> Result<&Buffer> {
    data.buffers().get(i).ok_or_else(|| {
        Error::InvalidArgument(format!("{} array has no buffer {i}", data.data_type()))
    })
}

/// The `len` items of type `T` starting at item `start` of `buffer`.
pub(super) fn typed<T: ArrowNativeType>(buffer: &Buffer, start: usize, len: usize) -> Result<&[T]> {
    let all: &[T] = buffer.typed_data();
    all.get(start..start + len).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "buffer of {} bytes is too short for {len} items at {start}",
            buffer.len()
        ))
    })
}

/// The `len` items of `width` bytes starting at item `start`, zero-copy.
pub(super) fn cut(buffer: &Buffer, start: usize, len: usize, width: usize) -> Result<Buffer> {
    let (from, bytes) = (start * width, len * width);
    if from + bytes > buffer.len() {
        return Err(Error::InvalidArgument(format!(
            "buffer of {} bytes is too short for bytes {from}..{}",
            buffer.len(),
            from + bytes
        )));
    }
    Ok(buffer.slice_with_length(from, bytes))
}

/// Offsets `[start, start + len]` rebased to start at 0: zero-copy when they already do.
pub(super) fn rebase<O: ArrowNativeType + std::ops::Sub<Output = O>>(
    buffer: &Buffer,
    start: usize,
    len: usize,
) -> Result<(Buffer, usize, usize)> {
    let offsets: &[O] = typed(buffer, start, len + 1)?;
    let first = offsets[0];
    let (lo, hi) = (first.as_usize(), offsets[len].as_usize());
    if hi < lo {
        return Err(Error::InvalidArgument("offsets decrease".into()));
    }
    let rebased = if lo == 0 {
        cut(buffer, start, len + 1, std::mem::size_of::<O>())?
    } else {
        Buffer::from_vec(offsets.iter().map(|&o| o - first).collect::<Vec<O>>())
    };
    Ok((rebased, lo, hi))
}

/// The first two buffers of an array with offsets of type `O` (strings, binaries, lists,
/// maps), pushed onto `parts`: its validity, and its offsets rebased to start at 0. The
/// range `lo..hi` they addressed in the data or the child.
pub(super) fn push_validity_and_offsets<O: ArrowNativeType + std::ops::Sub<Output = O>>(
    data: &ArrayData,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<(usize, usize)> {
    parts.buffers.push(validity(data, image));
    let (offsets, lo, hi) = rebase::<O>(buffer(data, 0)?, data.offset(), data.len())?;
    parts.buffers.push(image.push(offsets));
    Ok((lo, hi))
}

/// The validity bitmap of `data`, realigned to bit 0: none without a null.
pub(super) fn validity(data: &ArrayData, image: &mut Packer) -> Option<Placement> {
    nulls(data.nulls(), image)
}

/// The validity bitmap of an array with these nulls: none without a null.
pub(super) fn nulls(nulls: Option<&NullBuffer>, image: &mut Packer) -> Option<Placement> {
    let nulls = nulls.filter(|n| n.null_count() > 0)?;
    // `NullBuffer` carries its own offset: realign to bit 0 (zero-copy when byte-aligned).
    image.push(nulls.inner().sliced())
}
