//! Views to offsets (`ExportOptions::views_to_offsets`): a `Utf8View` or `BinaryView`
//! column becomes `Utf8`/`Binary` (or their large types, when its bytes reach 2^31): the
//! views' sizes scanned into offsets, their bytes gathered into one data buffer.

use arrow_schema::DataType;
use devarrow_abi::device::{RowIntegers, Validity};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::{at, at_mut, Converter};

impl Converter<'_> {
    /// The type a view column of `data_type` becomes, its `node` converted by
    /// [`Converter::views`].
    pub(super) fn views_to_offsets(
        &mut self,
        path: &str,
        data_type: &DataType,
        node: &mut ArrayNode,
    ) -> Result<DataType> {
        let large = self.views(path, data_type, node)?;
        Ok(match (data_type, large) {
            (DataType::Utf8View, false) => DataType::Utf8,
            (DataType::Utf8View, true) => DataType::LargeUtf8,
            (_, false) => DataType::Binary,
            (_, true) => DataType::LargeBinary,
        })
    }

    /// `Utf8View` / `BinaryView` to offsets and one data buffer; whether the offsets are
    /// `int64` (the bytes reach 2^31).
    fn views(&mut self, path: &str, data_type: &DataType, node: &mut ArrayNode) -> Result<bool> {
        let (n, offset) = (node.length as u64, node.offset as u64);
        let rows = offset + n;
        if node.buffers.len() < 3 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a view array with {} buffers",
                node.buffers.len()
            )));
        }
        let validity = Validity::new(node.buffers[0], offset);
        let views = at(node.buffers[1], 16 * offset);
        let variadic: Vec<u64> = node.buffers[2..node.buffers.len() - 1]
            .iter()
            .map(|&b| b as u64)
            .collect();
        let table = if variadic.is_empty() {
            std::ptr::null_mut()
        } else {
            let table = self.allocate(8 * variadic.len() as u64)?;
            // SAFETY: `table` holds the 8 bytes per address just allocated; `variadic`
            // outlives the copy (the readback below waits for it).
            unsafe {
                self.device
                    .copy_to_device(variadic.as_ptr().cast(), table, 8 * variadic.len())?
            };
            table
        };
        let offsets = self.allocate(8 * (rows + 1))?;
        let kernels = self.kernels(path, data_type)?;
        // `offsets` holds rows + 1 int64s; the first `offset` are zeroed (2 int32s
        // each), then rows offset.. get the sizes of the n views (16 bytes each from
        // the array's offset, in the batch's buffer, as is the validity), and the scan
        // runs over all of them.
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels.fill_offsets_i32(offsets, 2 * offset, 0)?;
            kernels.row_sizes(
                RowIntegers {
                    address: views,
                    stride: 16,
                    wide: false,
                },
                validity,
                n,
                at_mut(offsets, 8 * offset),
            )?;
            kernels.inclusive_scan_i64(offsets, rows + 1)?;
        }
        let total = self.read_i64s(&[at(offsets, 8 * rows)])?[0];
        drop(variadic); // copied: the readback waited
        let total = u64::try_from(total).map_err(|_| {
            self.refuse(
                path,
                data_type,
                format!("its views add up to {total} bytes"),
            )
        })?;
        let data = self.allocate(total)?;
        let large = total > i32::MAX as u64;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the views and validity as above; `table` holds the variadic buffers'
        // addresses (the views' buffer indices were checked at import or written by
        // devarrow's own upload); `offsets` the scan; `data` its `total` bytes.
        unsafe {
            kernels.gather_view_bytes(views, validity, n, table, at(offsets, 8 * offset), data)?
        };
        let offsets = if large {
            offsets
        } else {
            let narrow = self.allocate(4 * (rows + 1))?;
            let kernels = self.kernels(path, data_type)?;
            // SAFETY: rows + 1 int64s to as many int32s, each fitting (at most `total`).
            unsafe { kernels.narrow_i64_to_i32(offsets, rows + 1, narrow)? };
            narrow
        };
        node.buffers = vec![node.buffers[0], offsets, data];
        node.children.clear();
        Ok(large)
    }
}
