//! Views to offsets (`ExportOptions::views_to_offsets`): a `Utf8View` or `BinaryView`
//! column becomes `Utf8`/`Binary` (or their large types, when its bytes reach 2^31): the
//! views' sizes scanned into offsets, their bytes gathered into one data buffer.

use arrow_schema::DataType;
use devarrow_abi::device::{RowIntegers, Validity};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::{at, at_mut, Converter, Read, Step};

impl<'a> Converter<'a> {
    /// The type a view column of `data_type` becomes, and its `node` converted by
    /// [`Converter::views`].
    pub(super) fn views_to_offsets(
        &mut self,
        path: &str,
        data_type: &DataType,
        node: ArrayNode,
    ) -> Result<Step<'a, (DataType, ArrayNode)>> {
        let data_type_of = data_type.clone();
        Ok(self
            .views(path, data_type, node)?
            .map(move |(large, node)| {
                let new_type = match (data_type_of, large) {
                    (DataType::Utf8View, false) => DataType::Utf8,
                    (DataType::Utf8View, true) => DataType::LargeUtf8,
                    (_, false) => DataType::Binary,
                    (_, true) => DataType::LargeBinary,
                };
                (new_type, node)
            }))
    }

    /// `Utf8View` / `BinaryView` to offsets and one data buffer; whether the offsets are
    /// `int64` (the bytes reach 2^31). The views' sizes are scanned into offsets, whose
    /// last (the total bytes) is read back in the next round, which sizes the data.
    fn views(
        &mut self,
        path: &str,
        data_type: &DataType,
        mut node: ArrayNode,
    ) -> Result<Step<'a, (bool, ArrayNode)>> {
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
        let variadic: Vec<u8> = node.buffers[2..node.buffers.len() - 1]
            .iter()
            .flat_map(|&b| (b as u64).to_ne_bytes())
            .collect();
        let table = if variadic.is_empty() {
            std::ptr::null_mut()
        } else {
            let table = self.allocate(variadic.len() as u64)?;
            // SAFETY: `table` holds the 8 bytes per address just allocated.
            unsafe { self.copy_bytes_to_device(variadic, table)? };
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
        let (path, data_type) = (path.to_string(), data_type.clone());
        Ok(Step::read(
            vec![Read::i64(at(offsets, 8 * rows))],
            move |converter, values| {
                let total = values[0];
                let total = u64::try_from(total).map_err(|_| {
                    converter.refuse(
                        &path,
                        &data_type,
                        format!("its views add up to {total} bytes"),
                    )
                })?;
                let data = converter.allocate(total)?;
                let large = total > i32::MAX as u64;
                let narrow = if large {
                    None
                } else {
                    Some(converter.allocate(4 * (rows + 1))?)
                };
                let kernels = converter.kernels(&path, &data_type)?;
                // The views and validity as above; `table` holds the variadic buffers'
                // addresses (the views' buffer indices were checked at import or written
                // by devarrow's own upload); `offsets` the scan; `data` its `total` bytes;
                // narrowed, `narrow` the rows + 1 int32s (the first `offset` zeroed here,
                // the others written with the bytes), each fitting (at most `total`).
                // SAFETY: the ranges just described.
                unsafe {
                    let from = at(offsets, 8 * offset);
                    match narrow {
                        Some(narrow) => {
                            kernels.fill_offsets_i32(narrow, offset, 0)?;
                            let to = at_mut(narrow, 4 * offset);
                            kernels.gather_view_bytes_narrowed(
                                views, validity, n, table, from, data, to,
                            )?
                        }
                        None => kernels.gather_view_bytes(views, validity, n, table, from, data)?,
                    }
                };
                let offsets = narrow.unwrap_or(offsets);
                node.buffers = vec![node.buffers[0], offsets, data];
                node.children.clear();
                Ok(Step::Done((large, node)))
            },
        ))
    }
}
