//! Strings and binaries with offsets (`Utf8`, `Binary`, `LargeUtf8`, `LargeBinary`): the
//! offsets rebased to start at 0 and the bytes cut to the range they address.

use arrow_buffer::ArrowNativeType;
use arrow_data::ArrayData;
use devarrow_abi::Result;

use super::buffers::{buffer, cut, push_validity_and_offsets};
use super::{Packer, Parts};

/// A string or binary array with offsets of type `O` (`i32`, or `i64` for the `Large`
/// types).
pub(super) fn plan_bytes<O: ArrowNativeType + std::ops::Sub<Output = O>>(
    data: &ArrayData,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (lo, hi) = push_validity_and_offsets::<O>(data, image, parts)?;
    parts
        .buffers
        .push(image.push(cut(buffer(data, 1)?, lo, hi - lo, 1)?));
    Ok(())
}
