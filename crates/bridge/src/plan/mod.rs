//! Planning a transfer: which bytes of an arrow-rs array a device copy of it needs.
//!
//! The planner walks the array tree once and produces, for every buffer of the C data
//! interface layout, the exact bytes the *slice* needs, placed at 64-byte aligned offsets
//! of one packed image. Slices move only their bytes: fixed-width values are cut to the
//! slice, bitmaps are realigned to bit 0, offsets are rebased to start at 0 and their
//! children cut to the range they address (lists, list views, dense unions, run-end
//! encoded arrays), and every node of the result has offset 0.
//!
//! The variadic buffers of view types (`Utf8View`, `BinaryView`) are referenced by the
//! views wherever they point: they travel whole, unless the slice's views reference less
//! than half of what they cost to move (their bytes, each buffer placed at a 64-byte
//! boundary with its 8-byte size: many small buffers cost several times their bytes);
//! then the referenced bytes are compacted into one new buffer and the views rewritten
//! (arrow-rs's `gc`), so that what a view slice moves stays proportional to the slice
//! too, however many buffers its column has. (Only dictionaries, shared by every slice,
//! travel whole.)
//!
//! Buffers are referenced, not copied, when they can be used as they are (zero-copy
//! `Buffer` slices); only rebased offsets, realigned bitmaps and compacted views are
//! computed on the host.
//!
//! The planner is split by layout family, one file each, as the C data interface lays
//! the families out: `primitive.rs` (booleans and fixed-width values), `bytes.rs`
//! (strings and binaries with offsets), `views.rs` (view types, and when to compact
//! them), `nested.rs` (lists, list views, fixed-size lists, structs, unions) and
//! `encoded.rs` (dictionaries, run-end encoded arrays), over `buffers.rs` (one buffer cut
//! to a slice: values, bitmaps, offsets). This file holds the plan's types and
//! [`plan_array`] / [`plan_batch`], which send each node to its family. A new layout is a
//! new arm of `plan_node` and a function in its family's file.

use arrow_array::cast::AsArray;
use arrow_array::{downcast_primitive_array, Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::{DataType, UnionMode};
use devarrow_abi::device::BUFFER_ALIGNMENT;
use devarrow_abi::{slice_data, Result};

mod buffers;
mod bytes;
mod encoded;
mod nested;
mod primitive;
mod views;

use buffers::nulls;
use views::plan_views;

/// A buffer of a planned node: where its bytes lie in the packed image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Byte offset in the packed image (a multiple of 64).
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// One array of the planned tree, with buffers in C data interface order (`None`: a NULL
/// buffer, e.g. the validity bitmap of an array without nulls).
///
/// The planner produces nodes with offset 0, exact null counts and offsets that start at
/// 0. An imported batch packed for download on the device (where only whole bytes can be
/// copied, and no offset rewritten) may need the last fields: a small `offset` (bitmaps
/// are cut at a byte boundary), a `rebase` of its offsets or run ends, `rebase_each` of
/// its dense union offsets, `view_ranges` of its views, and an unknown null count.
#[derive(Debug, Clone)]
pub struct Node {
    /// The array's type.
    pub data_type: DataType,
    /// The array's length.
    pub len: usize,
    /// The array's null count (`None`: unknown, counted from the validity bitmap when the
    /// array is rebuilt on the host).
    pub null_count: Option<usize>,
    /// The array's logical offset into its buffers and children, as in the C data
    /// interface (0 from the planner).
    pub offset: usize,
    /// For arrays with offsets (strings, binaries, lists, maps) and list views: a value
    /// subtracted from every offset when the array is rebuilt on the host (list views
    /// also get offset 0 for their empty views); for run-end encoded arrays, from every
    /// run end (the last one then clamped to `len`); `None` from the planner.
    pub rebase: Option<i64>,
    /// For dense unions, one value per child, subtracted from the offsets of the items of
    /// that child: the children were cut to start there. Applied when the array is
    /// rebuilt on the host; empty (nothing to subtract) from the planner.
    pub rebase_each: Vec<usize>,
    /// For view types imported and packed on the device: the byte ranges the moved
    /// views reach in the foreign variadic buffers, packed one after another into the
    /// node's variadic buffers (as few as their offsets allow, whatever the number of
    /// foreign buffers), sorted by foreign buffer and position there; the views are
    /// remapped to them when the array is rebuilt on the host. Empty (nothing to remap)
    /// from the planner.
    pub view_ranges: Vec<ViewRange>,
    /// The buffers, in the order of the C data interface.
    pub buffers: Vec<Option<Placement>>,
    /// The children.
    pub children: Vec<Node>,
    /// The dictionary of a dictionary-encoded array.
    pub dictionary: Option<Box<Node>>,
}

#[doc(inline)]
pub use crate::slicing::ViewRange;

/// A packed image: the segments to copy and where.
#[derive(Debug, Default)]
pub struct Packer {
    /// `(bytes, offset in the image)`, in image order.
    pub segments: Vec<(Buffer, usize)>,
    /// The image size in bytes.
    pub total: usize,
}

impl Packer {
    fn push(&mut self, bytes: Buffer) -> Option<Placement> {
        let len = bytes.len();
        let offset = self.total.next_multiple_of(BUFFER_ALIGNMENT);
        self.total = offset + len;
        if len > 0 {
            self.segments.push((bytes, offset));
        }
        Some(Placement { offset, len })
    }

    /// Bytes that will actually be copied (the image minus alignment padding).
    pub fn payload_bytes(&self) -> usize {
        self.segments.iter().map(|(b, _)| b.len()).sum()
    }
}

/// A planned transfer: the packed image and the tree that points into it.
#[derive(Debug)]
pub struct Plan {
    /// The bytes to copy.
    pub image: Packer,
    /// The array tree.
    pub root: Node,
}

/// Plans the transfer of `data` (any type; sliced or not).
pub fn plan_array(data: &ArrayData) -> Result<Plan> {
    let mut image = Packer::default();
    let root = plan_node(data, &mut image)?;
    Ok(Plan { image, root })
}

/// Plans the transfer of a record batch: the same plan as [`plan_array`] of the batch as
/// a struct array (`StructArray::from(batch).into_data()`), without building that array
/// first (a few microseconds per batch, which counts for batches of a few thousand rows).
pub fn plan_batch(batch: &RecordBatch) -> Result<Plan> {
    let mut image = Packer {
        // About two buffers per column; more for nested types, grown as needed.
        segments: Vec::with_capacity(2 * batch.num_columns() + 4),
        total: 0,
    };
    // A struct array made from a batch has no validity bitmap (a NULL buffer).
    let buffers = vec![None];
    let children = batch
        .columns()
        .iter()
        .map(|column| plan_column(column.as_ref(), &mut image))
        .collect::<Result<Vec<_>>>()?;
    let root = Parts {
        buffers,
        children,
        dictionary: None,
    }
    .into_node(
        DataType::Struct(batch.schema_ref().fields().clone()),
        batch.num_rows(),
        0,
    );
    Ok(Plan { image, root })
}

/// Plans one column of a batch as [`plan_node`] plans its `ArrayData`: primitive and view
/// columns straight from the typed array, the others through their `ArrayData`. Building
/// an `ArrayData` per column (its type cloned, its buffers listed, every one of them
/// counted and uncounted) was half of planning a batch of 1,024 `lineitem` rows.
fn plan_column(column: &dyn Array, image: &mut Packer) -> Result<Node> {
    downcast_primitive_array!(
        column => {
            let validity = nulls(column.nulls(), image);
            let values = image.push(column.values().inner().clone());
            Ok(leaf(column, vec![validity, values]))
        },
        DataType::Utf8View => Ok(plan_views(column.as_string_view(), image)),
        DataType::BinaryView => Ok(plan_views(column.as_binary_view(), image)),
        _ => plan_node(&column.to_data(), image),
    )
}

/// The node of a column with no children, no dictionary and `buffers`.
fn leaf(column: &dyn Array, buffers: Vec<Option<Placement>>) -> Node {
    Node {
        data_type: column.data_type().clone(),
        len: column.len(),
        null_count: Some(column.null_count()),
        offset: 0,
        rebase: None,
        rebase_each: Vec::new(),
        view_ranges: Vec::new(),
        buffers,
        children: Vec::new(),
        dictionary: None,
    }
}

/// Plans `child` cut to `start..start + len` (zero-copy: no new `ArrayData` when the cut
/// is the whole child).
fn plan_child(child: &ArrayData, start: usize, len: usize, image: &mut Packer) -> Result<Node> {
    if start == 0 && len == child.len() {
        plan_node(child, image)
    } else {
        plan_node(&slice_data(child, start, len), image)
    }
}

/// What a layout family plans of a node besides its type, length and null count: its
/// buffers (in the order of the C data interface), children and dictionary.
struct Parts {
    buffers: Vec<Option<Placement>>,
    children: Vec<Node>,
    dictionary: Option<Box<Node>>,
}

impl Parts {
    /// The planned node of these parts: offset 0, an exact null count, nothing to rebase
    /// or remap.
    fn into_node(self, data_type: DataType, len: usize, null_count: usize) -> Node {
        Node {
            data_type,
            len,
            null_count: Some(null_count),
            offset: 0,
            rebase: None,
            rebase_each: Vec::new(),
            view_ranges: Vec::new(),
            buffers: self.buffers,
            children: self.children,
            dictionary: self.dictionary,
        }
    }
}

/// Plans the node of `data` (any type; sliced or not): the family of its layout plans its
/// buffers, children and dictionary; the node gets offset 0 and an exact null count.
fn plan_node(data: &ArrayData, image: &mut Packer) -> Result<Node> {
    let mut parts = Parts {
        // Most arrays have two or three buffers.
        buffers: Vec::with_capacity(3),
        children: Vec::new(),
        dictionary: None,
    };
    let p = &mut parts;
    match data.data_type() {
        DataType::Null => {}
        DataType::Boolean => primitive::plan_boolean(data, image, p)?,
        DataType::Utf8 | DataType::Binary => bytes::plan_bytes::<i32>(data, image, p)?,
        DataType::LargeUtf8 | DataType::LargeBinary => bytes::plan_bytes::<i64>(data, image, p)?,
        DataType::Utf8View | DataType::BinaryView => views::plan_view_data(data, image, p)?,
        DataType::List(_) | DataType::Map(_, _) => nested::plan_list::<i32>(data, image, p)?,
        DataType::LargeList(_) => nested::plan_list::<i64>(data, image, p)?,
        DataType::ListView(_) | DataType::LargeListView(_) => {
            nested::plan_list_view(data, image, p)?
        }
        DataType::FixedSizeList(_, n) => nested::plan_fixed_size_list(data, *n, image, p)?,
        DataType::Struct(_) => nested::plan_struct(data, image, p)?,
        DataType::Union(fields, UnionMode::Sparse) => {
            nested::plan_sparse_union(data, fields, image, p)?
        }
        DataType::Union(fields, UnionMode::Dense) => {
            nested::plan_dense_union(data, fields, image, p)?
        }
        DataType::Dictionary(key, _) => encoded::plan_dictionary(data, key, image, p)?,
        DataType::RunEndEncoded(_, _) => encoded::plan_run_end_encoded(data, image, p)?,
        _ => primitive::plan_fixed_width(data, image, p)?,
    }
    let data_type = data.data_type().clone();
    let len = data.len();
    // A null array is all nulls without a bitmap: arrow-rs counts none, the C data
    // interface (and arrow-rs's own FFI export) says `length`.
    let null_count = if data_type == DataType::Null {
        len
    } else {
        data.null_count()
    };
    Ok(parts.into_node(data_type, len, null_count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_plans_as_its_struct_array() {
        use arrow_array::{Int32Array, StringArray, StructArray};
        use std::sync::Arc;
        let batch = RecordBatch::try_from_iter([
            (
                "a",
                Arc::new(Int32Array::from(vec![Some(1), None, Some(3), Some(4)])) as _,
            ),
            (
                "s",
                Arc::new(StringArray::from(vec!["x", "yy", "zzz", ""])) as _,
            ),
        ])
        .unwrap();
        let every = devarrow_testing::sample::every_type_batch();
        let sliced = devarrow_testing::sample::sliced_every_type_batch();
        for batch in [
            batch.clone(),
            batch.slice(1, 2),
            batch.slice(4, 0),
            every.clone(),
            every.slice(1, every.num_rows() - 2),
            sliced,
        ] {
            let by_array = plan_array(&StructArray::from(batch.clone()).into_data()).unwrap();
            let by_batch = plan_batch(&batch).unwrap();
            assert_eq!(
                format!("{:?}", by_batch.root),
                format!("{:?}", by_array.root)
            );
            assert_eq!(by_batch.image.total, by_array.image.total);
            let segments = |p: &Plan| -> Vec<(Vec<u8>, usize)> {
                p.image
                    .segments
                    .iter()
                    .map(|(b, at)| (b.as_slice().to_vec(), *at))
                    .collect()
            };
            assert_eq!(segments(&by_batch), segments(&by_array));
        }
    }
}
