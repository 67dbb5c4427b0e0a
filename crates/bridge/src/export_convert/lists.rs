//! Lists to `int32` lists (`ExportOptions::lists_to_list32`): list views (their child
//! gathered into list order when the views are not in order, `gather.rs`),
//! large lists (offsets narrowed), fixed-size lists (offsets made) and maps (a list of
//! their entries, in the walk).

use std::ffi::c_void;

use arrow_schema::{DataType, FieldRef};
use devarrow_abi::device::{RowIntegers, Validity};
use devarrow_abi::export_tree::ArrayNode;
use devarrow_abi::{Error, Result};

use super::gather::Gather;
use super::{at, at_mut, Converter, Read, Step};

/// A list view column between its rounds (see [`Converter::list_views`]).
struct ListViews {
    path: String,
    data_type: DataType,
    child_field: FieldRef,
    node: ArrayNode,
    /// `offset + length` of the node.
    rows: u64,
    validity: Validity,
    view_offsets: RowIntegers,
    sizes: RowIntegers,
}

impl ListViews {
    fn n(&self) -> u64 {
        self.node.length as u64
    }
    fn offset(&self) -> u64 {
        self.node.offset as u64
    }
}

impl<'a> Converter<'a> {
    /// List views (`int32` or `int64` offsets and sizes) to a list with `int32` offsets,
    /// gathering the child when the views are not in order; the new child field. Rounds:
    /// the first row's offset; the last new offset and whether the views are in order;
    /// out of order, the values gathered (and what gathering the child reads); then the
    /// child's own.
    pub(super) fn list_views(
        &mut self,
        path: &str,
        data_type: &DataType,
        child_field: &FieldRef,
        large: bool,
        node: ArrayNode,
    ) -> Result<Step<'a, (FieldRef, ArrayNode)>> {
        let width = if large { 8 } else { 4 };
        let (n, offset) = (node.length as u64, node.offset as u64);
        if node.buffers.len() != 3 || node.children.len() != 1 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed list view array"
            )));
        }
        let lists = ListViews {
            path: path.to_string(),
            data_type: data_type.clone(),
            child_field: child_field.clone(),
            rows: offset + n,
            validity: Validity::new(node.buffers[0], offset),
            view_offsets: RowIntegers {
                address: at(node.buffers[1], width * offset),
                stride: width,
                wide: large,
            },
            sizes: RowIntegers {
                address: at(node.buffers[2], width * offset),
                stride: width,
                wide: large,
            },
            node,
        };
        // The first row's offset: the list's offsets start there, so that views already
        // in order keep their child as it is.
        if n == 0 {
            return self.list_view_offsets(lists, 0);
        }
        let first = Read {
            address: lists.view_offsets.address,
            width,
        };
        Ok(Step::read(vec![first], move |converter, values| {
            converter.list_view_offsets(lists, values[0].max(0))
        }))
    }

    /// The list's offsets from the views' sizes, starting at `base`, and whether they
    /// differ from the views' offsets (read back in the next round).
    fn list_view_offsets(
        &mut self,
        lists: ListViews,
        base: i64,
    ) -> Result<Step<'a, (FieldRef, ArrayNode)>> {
        let (n, offset, rows) = (lists.n(), lists.offset(), lists.rows);
        let offsets = self.allocate(8 * (rows + 1))?;
        let mismatch = self.allocate(8)?; // read back as an int64 below
        let kernels = self.kernels(&lists.path, &lists.data_type)?;
        // `offsets` holds rows + 1 int64s (the first `offset` zeroed, then the sizes of
        // the n rows, their first slot overwritten with `base`, in order on the
        // stream), `mismatch` 8 bytes (zeroed); the sizes, offsets and validity are the
        // batch's buffers from the array's offset.
        // SAFETY: the ranges just described, for every call of the block.
        unsafe {
            kernels.fill_offsets_i32(offsets, 2 * offset, 0)?;
            kernels.fill_offsets_i32(mismatch, 2, 0)?;
            kernels.row_sizes(lists.sizes, lists.validity, n, at_mut(offsets, 8 * offset))?;
            self.copy_bytes_to_device(base.to_le_bytes().to_vec(), at_mut(offsets, 8 * offset))?;
            kernels.inclusive_scan_i64(offsets, rows + 1)?;
            kernels.compare_list_offsets(
                lists.view_offsets,
                n,
                at(offsets, 8 * offset),
                mismatch,
            )?;
        }
        let reads = vec![Read::i64(at(offsets, 8 * rows)), Read::i64(mismatch)];
        Ok(Step::read(reads, move |converter, values| {
            let [last, differs] = values[..] else {
                unreachable!("two values read")
            };
            converter.list_view_child(lists, offsets, last, differs & 0xffff_ffff != 0)
        }))
    }

    /// The list's `int32` offsets and its child: kept as it is when the views are in
    /// order (`!differs`), else gathered into list order; then converted as any child.
    fn list_view_child(
        &mut self,
        mut lists: ListViews,
        offsets: *mut c_void,
        last: i64,
        differs: bool,
    ) -> Result<Step<'a, (FieldRef, ArrayNode)>> {
        let (n, offset, rows) = (lists.n(), lists.offset(), lists.rows);
        let (path, data_type) = (lists.path.clone(), lists.data_type.clone());
        if last > i32::MAX as i64 {
            return Err(self.refuse(
                &path,
                &data_type,
                format!("its lists reach child index {last}, past int32 offsets: export slices of the batch"),
            ));
        }
        let child = lists.node.children.pop().expect("one child");
        let child_field = lists.child_field.clone();
        let child_path = format!("{path}.{}", child_field.name());
        let list_offsets = self.allocate(4 * (rows + 1))?;
        let finish = move |(child_field, child): (FieldRef, ArrayNode)| {
            let mut node = lists.node;
            node.buffers = vec![node.buffers[0], list_offsets];
            node.children = vec![child];
            (child_field, node)
        };
        if !differs {
            let kernels = self.kernels(&path, &data_type)?;
            // SAFETY: rows + 1 int64s, each at most `last`, to as many int32s.
            unsafe { kernels.narrow_i64_to_i32(offsets, rows + 1, list_offsets)? };
            return Ok(self.array(&child_path, &child_field, child)?.map(finish));
        }
        // Out of order: gather the child's values into list order, from offset 0.
        let kernels = self.kernels(&path, &data_type)?;
        // SAFETY: as above; the sizes are scanned again from 0 over the same slots.
        unsafe {
            kernels.fill_offsets_i32(offsets, 2 * (offset + 1), 0)?;
            kernels.row_sizes(lists.sizes, lists.validity, n, at_mut(offsets, 8 * offset))?;
            kernels.inclusive_scan_i64(offsets, rows + 1)?;
            kernels.narrow_i64_to_i32(offsets, rows + 1, list_offsets)?;
        }
        let view_offsets = lists.view_offsets;
        Ok(Step::read(
            vec![Read::i64(at(offsets, 8 * rows))],
            move |converter, values| {
                let rows_gathered = Gather {
                    view_offsets,
                    n,
                    new_offsets: at(offsets, 8 * offset),
                    total: values[0].max(0) as u64,
                };
                let child_type = child_field.data_type().clone();
                let gathered =
                    converter.gather(&child_path, &child_type, child, 0, rows_gathered)?;
                // then converted as any child (a gathered view child becomes offsets, say)
                Ok(gathered
                    .and_then(converter, move |converter, gathered| {
                        converter.array(&child_path, &child_field, gathered)
                    })?
                    .map(finish))
            },
        ))
    }

    /// `LargeList` offsets narrowed to `int32`, once the last offset (read back in the
    /// next round) is known to fit.
    pub(super) fn large_list(
        &mut self,
        path: &str,
        data_type: &DataType,
        node: ArrayNode,
    ) -> Result<Step<'a, ArrayNode>> {
        let rows = node.offset as u64 + node.length as u64;
        if node.buffers.len() != 2 {
            return Err(Error::InvalidArgument(format!(
                "{path}: a malformed large list array"
            )));
        }
        let last = Read::i64(at(node.buffers[1], 8 * rows));
        let (path, data_type) = (path.to_string(), data_type.clone());
        Ok(Step::read(vec![last], move |converter, values| {
            let last = values[0];
            if !(0..=i32::MAX as i64).contains(&last) {
                return Err(converter.refuse(
                    &path,
                    &data_type,
                    format!(
                        "its last offset {last} does not fit int32 offsets: export slices of the batch"
                    ),
                ));
            }
            let mut node = node;
            let narrow = converter.allocate(4 * (rows + 1))?;
            let kernels = converter.kernels(&path, &data_type)?;
            // SAFETY: the batch's rows + 1 int64 offsets (every one at most the last,
            // which fits) to as many int32s in new memory.
            unsafe { kernels.narrow_i64_to_i32(node.buffers[1], rows + 1, narrow)? };
            node.buffers[1] = narrow;
            Ok(Step::Done(node))
        }))
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
