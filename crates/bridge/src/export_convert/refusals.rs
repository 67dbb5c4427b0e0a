//! What libcudf refuses (`ExportOptions::refuse_outside_libcudf`): the types and shapes
//! its `from_arrow_device` does not take, refused at export with
//! [`Error::NotConvertible`] (the column's path, its type and what to do instead) rather
//! than left for libcudf to fail on or, worse, to read wrongly.

use arrow_schema::DataType;
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::{Converter, DIALECT};

/// Refuses a batch libcudf cannot take as a table: a root struct with nulls of its own,
/// or more rows than `cudf::size_type` indexes.
pub(super) fn check_libcudf_root(root: &ArrayNode) -> Result<()> {
    let root_has_nulls = root.buffers.first().is_some_and(|b| !b.is_null()) && root.null_count != 0;
    if root_has_nulls {
        return Err(Error::NotConvertible {
            path: "(root)".into(),
            data_type: "Struct".into(),
            dialect: DIALECT,
            reason: "a record batch whose root struct has nulls of its own: a cudf table \
                     has no row validity, and libcudf would drop it silently"
                .into(),
        });
    }
    if root.length > i32::MAX as i64 {
        return Err(Error::NotConvertible {
            path: "(root)".into(),
            data_type: "Struct".into(),
            dialect: DIALECT,
            reason: format!(
                "{} rows, more than cudf::size_type indexes (i32::MAX): export slices of \
                 the batch (zero-copy) instead",
                root.length
            ),
        });
    }
    Ok(())
}

impl Converter<'_> {
    /// The [`Error::NotConvertible`] of the column at `path`, of type `data_type`, saying
    /// why (`reason`) and what to do instead.
    pub(super) fn refuse(
        &self,
        path: &str,
        data_type: &DataType,
        reason: impl Into<String>,
    ) -> Error {
        Error::NotConvertible {
            path: path.into(),
            data_type: data_type.to_string(),
            dialect: DIALECT,
            reason: reason.into(),
        }
    }

    /// Refuses what libcudf's `from_arrow_device` refuses (docs/libcudf.md).
    pub(super) fn check_libcudf_type(
        &self,
        path: &str,
        data_type: &DataType,
        node: &ArrayNode,
    ) -> Result<()> {
        use DataType::*;
        if node.length > i32::MAX as i64 {
            return Err(self.refuse(path, data_type, "more rows than cudf::size_type indexes"));
        }
        let reason = match data_type {
            Null | Boolean | Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64
            | Float32 | Float64 | Decimal32(..) | Decimal64(..) | Decimal128(..) | Date32
            | Timestamp(..) | Duration(..) | Utf8 | LargeUtf8 | List(_) | Struct(_) => {
                return Ok(())
            }
            Dictionary(key, _) if key.is_signed_integer() => return Ok(()),
            Dictionary(..) => "unsigned dictionary indices (set signed_dictionary_indices)",
            Utf8View | BinaryView => "view types (set views_to_offsets)",
            ListView(_) | LargeListView(_) | LargeList(_) | FixedSizeList(..) | Map(..) => {
                "only int32 lists (set lists_to_list32)"
            }
            Binary | LargeBinary | FixedSizeBinary(_) => {
                "libcudf has no binary type: cast the column to Utf8 if its bytes are strings"
            }
            Float16 => "libcudf has no half-precision type: cast to Float32",
            Decimal256(..) => "libcudf has no 256-bit decimal: cast to Decimal128",
            Date64 => "libcudf refuses date64: cast to Timestamp(Millisecond)",
            Time32(_) | Time64(_) => "libcudf refuses time types: cast to Duration",
            Interval(_) => "libcudf has no interval type",
            Union(..) => "libcudf has no union type",
            RunEndEncoded(..) => "libcudf has no run-end encoding: decode it first",
        };
        Err(self.refuse(path, data_type, reason))
    }
}
