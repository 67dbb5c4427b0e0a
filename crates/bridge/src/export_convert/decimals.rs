//! Wider decimals (`ExportOptions::widen_small_decimals`): `Decimal32` and `Decimal64`
//! values widened to `Decimal128`'s 16 bytes, which libcudf reads.

use arrow_schema::DataType;
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::Converter;

impl Converter<'_> {
    /// A `Decimal32`/`Decimal64` column of `data_type` as `Decimal128` (same precision and
    /// scale), its values widened by [`Converter::widen_decimals`].
    pub(super) fn widen_decimal_column(
        &mut self,
        path: &str,
        data_type: &DataType,
        node: &mut ArrayNode,
    ) -> Result<DataType> {
        let (p, s, width) = match *data_type {
            DataType::Decimal32(p, s) => (p, s, 4),
            DataType::Decimal64(p, s) => (p, s, 8),
            _ => return Ok(data_type.clone()),
        };
        self.widen_decimals(path, data_type, width, node)?;
        Ok(DataType::Decimal128(p, s))
    }

    /// `Decimal32`/`Decimal64` values widened to 16 bytes.
    fn widen_decimals(
        &mut self,
        path: &str,
        data_type: &DataType,
        width: u64,
        node: &mut ArrayNode,
    ) -> Result<()> {
        let rows = node.offset as u64 + node.length as u64;
        if node.buffers.len() != 2 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed decimal array"
            )));
        }
        let wide = self.allocate(16 * rows)?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the batch's `rows` values of `width` bytes to as many 16-byte ones.
        unsafe { kernels.widen_decimals(node.buffers[1], width, rows, wide)? };
        node.buffers[1] = wide;
        Ok(())
    }
}
