//! Lists to `int32` lists (`ExportOptions::lists_to_list32`): list views (their child
//! gathered into list order when the views are not in order, [`Converter::gather`]),
//! large lists (offsets narrowed), fixed-size lists (offsets made) and maps (a list of
//! their entries, in the walk).

use std::ffi::c_void;

use arrow_schema::{DataType, FieldRef};
use devarrow_abi::device::{RowIntegers, Validity};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::{at, at_mut, Converter, DIALECT};

/// The rows of list views whose child is gathered into list order.
struct Gather {
    /// The views' offsets (from the list's first row).
    view_offsets: RowIntegers,
    /// The rows.
    n: u64,
    /// The rows' new offsets (`n + 1` `int64`s, non-decreasing, null rows empty).
    new_offsets: *const c_void,
    /// The values gathered (the last new offset).
    total: u64,
}

impl Converter<'_> {
    /// List views (`int32` or `int64` offsets and sizes) to a list with `int32` offsets,
    /// gathering the child when the views are not in order; the new child field.
    pub(super) fn list_views(
        &mut self,
        path: &str,
        data_type: &DataType,
        child_field: &FieldRef,
        large: bool,
        node: &mut ArrayNode,
    ) -> Result<FieldRef> {
        let width = if large { 8 } else { 4 };
        let (n, offset) = (node.length as u64, node.offset as u64);
        let rows = offset + n;
        if node.buffers.len() != 3 || node.children.len() != 1 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed list view array"
            )));
        }
        let validity = Validity::new(node.buffers[0], offset);
        let view_offsets = RowIntegers {
            address: at(node.buffers[1], width * offset),
            stride: width,
            wide: large,
        };
        let sizes = RowIntegers {
            address: at(node.buffers[2], width * offset),
            stride: width,
            wide: large,
        };
        // The first row's offset: the list's offsets start there, so that views already
        // in order keep their child as it is.
        let base = if n == 0 {
            0
        } else {
            self.read_int(view_offsets.address, width)?.max(0)
        };
        let offsets = self.allocate(8 * (rows + 1))?;
        let mismatch = self.allocate(8)?; // read back as an int64 below
        let base_bytes = base.to_le_bytes();
        let kernels = self.kernels(path, data_type)?;
        // `offsets` holds rows + 1 int64s (the first `offset` zeroed, then the sizes of
        // the n rows, their first slot overwritten with `base`, in order on the
        // stream), `mismatch` 8 bytes (zeroed); the sizes, offsets and validity are the
        // batch's buffers from the array's offset; `base_bytes` outlives the copy (the
        // readback below waits).
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels.fill_offsets_i32(offsets, 2 * offset, 0)?;
            kernels.fill_offsets_i32(mismatch, 2, 0)?;
            kernels.row_sizes(sizes, validity, n, at_mut(offsets, 8 * offset))?;
            self.device
                .copy_to_device(base_bytes.as_ptr(), at_mut(offsets, 8 * offset), 8)?;
            kernels.inclusive_scan_i64(offsets, rows + 1)?;
            kernels.compare_list_offsets(view_offsets, n, at(offsets, 8 * offset), mismatch)?;
        }
        let [last, differs] = self.read_i64s(&[at(offsets, 8 * rows), mismatch])?[..] else {
            unreachable!("two values read")
        };
        let differs = differs & 0xffff_ffff != 0;
        if last > i32::MAX as i64 {
            return Err(self.refuse(
                path,
                data_type,
                format!("its lists reach child index {last}, past int32 offsets: export slices of the batch"),
            ));
        }
        let child = node.children.pop().expect("one child");
        let child_path = format!("{path}.{}", child_field.name());
        let list_offsets = self.allocate(4 * (rows + 1))?;
        let (child_field, child) = if !differs {
            let kernels = self.kernels(path, data_type)?;
            // SAFETY: rows + 1 int64s, each at most `last`, to as many int32s.
            unsafe { kernels.narrow_i64_to_i32(offsets, rows + 1, list_offsets)? };
            self.array(&child_path, child_field, child)?
        } else {
            // Out of order: gather the child's values into list order, from offset 0.
            let kernels = self.kernels(path, data_type)?;
            // SAFETY: as above; the sizes are scanned again from 0 over the same slots.
            unsafe {
                kernels.fill_offsets_i32(offsets, 2 * (offset + 1), 0)?;
                kernels.row_sizes(sizes, validity, n, at_mut(offsets, 8 * offset))?;
                kernels.inclusive_scan_i64(offsets, rows + 1)?;
                kernels.narrow_i64_to_i32(offsets, rows + 1, list_offsets)?;
            }
            let total = self.read_i64s(&[at(offsets, 8 * rows)])?[0].max(0) as u64;
            let rows_gathered = Gather {
                view_offsets,
                n,
                new_offsets: at(offsets, 8 * offset),
                total,
            };
            let gathered = self.gather(
                &child_path,
                child_field.data_type(),
                child,
                0,
                &rows_gathered,
            )?;
            // then converted as any child (a gathered view child becomes offsets, say)
            self.array(&child_path, child_field, gathered)?
        };
        node.buffers = vec![node.buffers[0], list_offsets];
        node.children = vec![child];
        Ok(child_field)
    }

    /// A child of list views put in list order: the values the views of `rows` reach,
    /// one after another (`rows.total` of them, offset 0), for fixed-width, boolean,
    /// string and binary (offsets or views) children and structs of them; their validity
    /// gathered too. `extra` is added to every child index (a struct's offset, for its
    /// fields). Other children are [`Error::NotConvertible`].
    fn gather(
        &mut self,
        path: &str,
        data_type: &DataType,
        mut child: ArrayNode,
        extra: u64,
        rows: &Gather,
    ) -> Result<ArrayNode> {
        let base = extra + child.offset as u64;
        let total = rows.total;
        let words = total.div_ceil(32);
        let cannot = |what: &str| Error::NotConvertible {
            path: path.into(),
            data_type: data_type.to_string(),
            dialect: DIALECT,
            reason: format!(
                "the list views over it are not in order, and {what} (fixed-width, boolean, \
                 string and binary children, and structs of them, are gathered)"
            ),
        };
        let has_validity = !matches!(
            data_type,
            DataType::Null | DataType::Union(..) | DataType::RunEndEncoded(..)
        );
        let validity = match child.buffers.first() {
            Some(&bits) if has_validity && !bits.is_null() => {
                let out = self.allocate(4 * words)?;
                let kernels = self.kernels(path, data_type)?;
                // SAFETY: the child's bitmap covers every index the valid views reach
                // (checked at import, or written by devarrow's upload); `out` holds
                // `words` words.
                unsafe {
                    kernels.gather_list_bits(
                        bits,
                        base,
                        rows.view_offsets,
                        rows.n,
                        rows.new_offsets,
                        out,
                    )?
                };
                out.cast_const()
            }
            _ => std::ptr::null(),
        };
        let value_width = match data_type {
            DataType::Boolean => Some(0),
            DataType::Utf8View | DataType::BinaryView => Some(16),
            dt if dt.is_primitive() => dt.primitive_width().map(|w| w as u64),
            DataType::FixedSizeBinary(w) => Some(*w as u64),
            _ => None,
        };
        let buffers = match (data_type, value_width) {
            (DataType::Struct(fields), _) => {
                let children = std::mem::take(&mut child.children);
                for (field, c) in fields.iter().zip(children) {
                    let c = self.gather(
                        &format!("{path}.{}", field.name()),
                        field.data_type(),
                        c,
                        base,
                        rows,
                    )?;
                    child.children.push(c);
                }
                vec![validity]
            }
            (_, Some(0)) => {
                let out = self.allocate(4 * words)?;
                let kernels = self.kernels(path, data_type)?;
                // SAFETY: as for the validity, the values' bits.
                unsafe {
                    kernels.gather_list_bits(
                        child.buffers[1],
                        base,
                        rows.view_offsets,
                        rows.n,
                        rows.new_offsets,
                        out,
                    )?
                };
                vec![validity, out]
            }
            (_, Some(width)) => {
                let out = self.allocate(width * total)?;
                let kernels = self.kernels(path, data_type)?;
                // SAFETY: the child's values cover every index the valid views reach;
                // `out` holds `total` values.
                unsafe {
                    kernels.gather_list_values(
                        child.buffers[1],
                        width,
                        base,
                        rows.view_offsets,
                        rows.n,
                        rows.new_offsets,
                        out,
                    )?
                };
                // views keep their variadic buffers (and their sizes) as they are
                let mut buffers = vec![validity, out];
                buffers.extend_from_slice(&child.buffers[2..]);
                buffers
            }
            (
                DataType::Utf8 | DataType::Binary | DataType::LargeUtf8 | DataType::LargeBinary,
                _,
            ) => {
                let (data, offsets) =
                    self.gather_strings(path, data_type, &child, base, rows, validity)?;
                vec![validity, offsets, data]
            }
            _ => {
                return Err(cannot(&format!(
                    "gathering a {data_type} on the device is not supported"
                )))
            }
        };
        child.buffers = buffers;
        child.length = total as i64;
        child.offset = 0;
        child.null_count = if validity.is_null() { 0 } else { -1 };
        Ok(child)
    }

    /// The strings (or binaries) of a child with offsets at the indices list views reach,
    /// in list order: their views (`DeviceKernels::offsets_to_views` over an index map,
    /// itself a gather of `0, 1, 2, ...`), then the bytes gathered as a view column's are.
    /// Gives the new data and offsets (`int32` for `Utf8`/`Binary`, `int64` for the large
    /// types).
    fn gather_strings(
        &mut self,
        path: &str,
        data_type: &DataType,
        child: &ArrayNode,
        base: u64,
        rows: &Gather,
        validity: *const c_void,
    ) -> Result<(*mut c_void, *mut c_void)> {
        let large = matches!(data_type, DataType::LargeUtf8 | DataType::LargeBinary);
        let width = if large { 8 } else { 4 };
        // the physical indices of the child's values: every index gathered is below it
        let reach = child.offset as u64 + child.length as u64;
        let end = self.read_int(at(child.buffers[1], width * reach), width)?;
        if reach > i32::MAX as u64 || end > u32::MAX as i64 {
            return Err(self.refuse(
                path,
                data_type,
                "the list views over it are not in order, and it is too large to gather \
                 (2^31 values or 4 GiB): export slices of the batch",
            ));
        }
        let total = rows.total;
        let iota = self.allocate(4 * reach)?;
        let indices = self.allocate(4 * total)?;
        let views = self.allocate(16 * total)?;
        let offsets = self.allocate(8 * (total + 1))?;
        let table = self.allocate(8)?;
        let data_address = (child.buffers[2] as u64).to_le_bytes();
        let kernels = self.kernels(path, data_type)?;
        // `iota` holds `reach` int32s, `indices` one per gathered value, `views` 16
        // bytes each, `offsets` total + 1 int64s, `table` the data's address (copied
        // from `data_address`, alive until the readback below waits); the child's
        // offsets cover every index below `reach` and its data their bytes.
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels.fill_offsets_i32(iota, reach, 1)?;
            kernels.gather_list_values(
                iota,
                4,
                base,
                rows.view_offsets,
                rows.n,
                rows.new_offsets,
                indices,
            )?;
            let child_offsets = RowIntegers {
                address: child.buffers[1],
                stride: width,
                wide: large,
            };
            kernels.offsets_to_views(child_offsets, child.buffers[2], indices, total, views)?;
            let sizes = RowIntegers {
                address: views,
                stride: 16,
                wide: false,
            };
            kernels.row_sizes(sizes, Validity::new(validity, 0), total, offsets)?;
            kernels.inclusive_scan_i64(offsets, total + 1)?;
            self.device
                .copy_to_device(data_address.as_ptr(), table, 8)?;
        }
        let bytes = self.read_i64s(&[at(offsets, 8 * total)])?[0].max(0) as u64;
        if !large && bytes > i32::MAX as u64 {
            return Err(self.refuse(
                path,
                data_type,
                "gathered, its values pass int32 offsets: export slices of the batch",
            ));
        }
        let data = self.allocate(bytes)?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the views made above (one variadic buffer, the child's data, its address
        // in `table`), `offsets` their scan, `data` its `bytes`.
        unsafe {
            kernels.gather_view_bytes(
                views,
                Validity::new(validity, 0),
                total,
                table,
                offsets,
                data,
            )?
        };
        if large {
            return Ok((data, offsets));
        }
        let narrow = self.allocate(4 * (total + 1))?;
        // SAFETY: total + 1 int64s, each at most `bytes` (which fits), to as many int32s.
        unsafe { kernels.narrow_i64_to_i32(offsets, total + 1, narrow)? };
        Ok((data, narrow))
    }

    /// `LargeList` offsets narrowed to `int32`.
    pub(super) fn large_list(
        &mut self,
        path: &str,
        data_type: &DataType,
        node: &mut ArrayNode,
    ) -> Result<()> {
        let rows = node.offset as u64 + node.length as u64;
        if node.buffers.len() != 2 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed large list array"
            )));
        }
        let last = self.read_int(at(node.buffers[1], 8 * rows), 8)?;
        if !(0..=i32::MAX as i64).contains(&last) {
            return Err(self.refuse(
                path,
                data_type,
                format!(
                    "its last offset {last} does not fit int32 offsets: export slices of the batch"
                ),
            ));
        }
        let narrow = self.allocate(4 * (rows + 1))?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: the batch's rows + 1 int64 offsets (every one at most the last, which
        // fits) to as many int32s in new memory.
        unsafe { kernels.narrow_i64_to_i32(node.buffers[1], rows + 1, narrow)? };
        node.buffers[1] = narrow;
        Ok(())
    }

    /// `FixedSizeList(size)` gets offsets `i × size`.
    pub(super) fn fixed_size_list(
        &mut self,
        path: &str,
        data_type: &DataType,
        size: i32,
        node: &mut ArrayNode,
    ) -> Result<()> {
        let rows = node.offset as u64 + node.length as u64;
        if rows.saturating_mul(size.max(0) as u64) > i32::MAX as u64 {
            return Err(self.refuse(
                path,
                data_type,
                "its values reach past int32 offsets: export slices of the batch",
            ));
        }
        let offsets = self.allocate(4 * (rows + 1))?;
        let kernels = self.kernels(path, data_type)?;
        // SAFETY: rows + 1 int32s of new memory.
        unsafe { kernels.fill_offsets_i32(offsets, rows + 1, size as u32)? };
        node.buffers = vec![
            node.buffers.first().copied().unwrap_or(std::ptr::null()),
            offsets,
        ];
        Ok(())
    }
}
