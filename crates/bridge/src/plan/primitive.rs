//! Booleans and fixed-width values (integers, floats, decimals, dates, times, timestamps,
//! durations, intervals, fixed-size binaries): a validity bitmap and one values buffer,
//! both cut to the slice (boolean values realigned to bit 0 like bitmaps).

use arrow_data::ArrayData;
use arrow_schema::DataType;
use devarrow_abi::{Error, Result};

use super::buffers::{buffer, cut, validity};
use super::{Packer, Parts};

/// A boolean array: its validity and its values, both bitmaps, realigned to bit 0.
pub(super) fn plan_boolean(data: &ArrayData, image: &mut Packer, parts: &mut Parts) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    parts.buffers.push(validity(data, image));
    parts
        .buffers
        .push(image.push(buffer(data, 0)?.bit_slice(start, len)));
    Ok(())
}

/// An array of fixed-width values: its values cut to the slice. Any type that is not
/// fixed-width (and not planned by another family) is unsupported.
pub(super) fn plan_fixed_width(
    data: &ArrayData,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let dt = data.data_type();
    let width = dt
        .primitive_width()
        .or(match dt {
            DataType::FixedSizeBinary(n) => usize::try_from(*n).ok(),
            _ => None,
        })
        .ok_or_else(|| Error::InvalidArgument(format!("unsupported data type {dt}")))?;
    parts.buffers.push(validity(data, image));
    let values = cut(buffer(data, 0)?, data.offset(), data.len(), width)?;
    parts.buffers.push(image.push(values));
    Ok(())
}
