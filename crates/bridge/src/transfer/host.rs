//! Downloads to the host: what a download moves ([`Download`]: one packed image on the
//! device and the tree that points into it), and the host side of it, rebuilding arrow-rs
//! arrays from a host copy of such an image ([`build_host_node`], [`host_batch`]).
//!
//! The copies themselves run through a transfer's staging buffers
//! ([`Transfer::to_host`](crate::Transfer::to_host)); [`pin_batch`](crate::pin_batch)
//! rebuilds a batch packed into pinned memory the same way.

use std::sync::Arc;

use arrow_array::types::{ArrowPrimitiveType, Int16Type, Int32Type, Int64Type};
use arrow_array::{make_array, Array, PrimitiveArray, RecordBatch, RecordBatchOptions};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::{DataType, SchemaRef, UnionMode};
use devarrow_abi::device::{DeviceMemory, SyncEvent};
use devarrow_abi::layout::{buffer_roles, offset_width, BufferRole};
use devarrow_abi::{Error, Result};
use rayon::prelude::*;

use crate::plan::{Node, Placement, ViewRange};
use crate::slicing;
use crate::transfer::pack::DEFAULT_PARALLEL_MIN_BYTES;

/// What [`Transfer::to_host`](crate::Transfer::to_host) downloads: one packed image on the
/// device, the tree that points into it, and the event its data is ready after.
pub(crate) struct Download {
    pub(crate) schema: SchemaRef,
    pub(crate) num_rows: usize,
    pub(crate) root: Arc<Node>,
    pub(crate) memory: Arc<dyn DeviceMemory>,
    pub(crate) event: Arc<dyn SyncEvent>,
    /// Whether the image was planned by this crate from valid arrow-rs data (a batch
    /// [`Transfer::to_device`](crate::Transfer::to_device) uploaded), so rebuilding it on
    /// the host needs no validation. `false` for foreign data.
    pub(crate) trusted: bool,
}

/// Rebuilds a record batch of `schema` and `num_rows` rows from the planned tree `root`
/// over `host`, a host copy of its image (see [`build_host_node`] for `trusted`).
pub(crate) fn host_batch(
    schema: SchemaRef,
    num_rows: usize,
    root: &Node,
    host: &Buffer,
    trusted: bool,
) -> Result<RecordBatch> {
    let options = RecordBatchOptions::new().with_row_count(Some(num_rows));
    // A root as the planner makes it from a batch (no validity, offset 0, columns of the
    // batch's length): the columns are built on their own, without the struct array over
    // them, which only costs allocations and copies of every column's `ArrayData`
    // (`RecordBatch::try_new` checks their types and lengths). Others (an imported struct
    // with an offset or nulls) go through the struct array, which applies them.
    let plain = root.offset == 0
        && root.buffers.first().is_none_or(Option::is_none)
        && root.children.iter().all(|c| c.len == num_rows)
        && root.dictionary.is_none();
    if plain && matches!(root.data_type, DataType::Struct(_)) {
        let column = |c: &Node| build_host_node(c, host, trusted).map(make_array);
        let columns = if root.children.len() > 1 && host.len() >= DEFAULT_PARALLEL_MIN_BYTES {
            root.children
                .par_iter()
                .map(column)
                .collect::<Result<Vec<_>>>()?
        } else {
            root.children
                .iter()
                .map(column)
                .collect::<Result<Vec<_>>>()?
        };
        return Ok(RecordBatch::try_new_with_options(
            schema, columns, &options,
        )?);
    }
    let data = build_host_node(root, host, trusted)?;
    // Each column sliced by the root's offset and length as an array (`slice_data`), not
    // through `StructArray::from`: for a root of an offset, arrow-rs 59 slices each
    // column's `ArrayData`, which for a struct column slices its children and keeps its
    // offset too, so its rows are read past its children's (a panic). A record batch's
    // root has no validity (an import refuses top-level nulls).
    let (offset, len) = (data.offset(), data.len());
    let columns = data
        .child_data()
        .iter()
        .map(|c| make_array(devarrow_abi::slice_data(c, offset, len)))
        .collect();
    Ok(RecordBatch::try_new_with_options(
        schema, columns, &options,
    )?)
}

/// Rebuilds arrow-rs array data from a planned tree over a host copy of its image.
///
/// `trusted`: the tree was planned by this crate from arrow-rs data that was valid (its
/// `ArrayData` invariants held), and the image is a byte-for-byte copy of what the planner
/// packed, so the arrays are built without validating them again (UTF-8, offsets: the bulk
/// of `to_host`'s host time otherwise). Foreign data is always validated in full.
pub(crate) fn build_host_node(node: &Node, host: &Buffer, trusted: bool) -> Result<ArrayData> {
    let slice = |p: &Option<Placement>| p.map(|p| host.slice_with_length(p.offset, p.len));
    let roles = buffer_roles(&node.data_type);
    let has_validity = roles.first() == Some(&BufferRole::Validity);
    let mut buffers: Vec<Buffer> = node
        .buffers
        .iter()
        .map(|p| slice(p).unwrap_or_default())
        .collect();
    let validity = if has_validity {
        slice(&node.buffers[0])
    } else {
        None
    };
    if has_validity {
        buffers.remove(0);
    }
    if matches!(node.data_type, DataType::Utf8View | DataType::BinaryView) {
        buffers.pop(); // the variadic sizes: arrow-rs keeps them as buffer lengths
    }
    // Building validates every array (UTF-8, offsets): the bulk of `to_host`'s host time
    // for string-heavy batches. Columns of a large batch are built on several threads.
    let mut children: Vec<ArrayData> =
        if node.children.len() > 1 && host.len() >= DEFAULT_PARALLEL_MIN_BYTES {
            node.children
                .par_iter()
                .map(|c| build_host_node(c, host, trusted))
                .collect::<Result<_>>()?
        } else {
            node.children
                .iter()
                .map(|c| build_host_node(c, host, trusted))
                .collect::<Result<_>>()?
        };
    if let Some(d) = &node.dictionary {
        children.push(build_host_node(d, host, trusted)?);
    }
    if let Some(base) = node.rebase {
        rebase_offsets(&node.data_type, &mut buffers, &mut children, base, node.len)?;
    }
    if !node.rebase_each.is_empty() {
        rebase_each(&node.data_type, &mut buffers, &node.rebase_each)?;
    }
    if !node.view_ranges.is_empty() {
        remap_views(&node.data_type, &mut buffers, &node.view_ranges)?;
    }
    let mut builder = ArrayData::builder(node.data_type.clone())
        .len(node.len)
        .offset(node.offset)
        .null_bit_buffer(validity)
        .buffers(buffers)
        .child_data(children)
        .align_buffers(true);
    if let Some(null_count) = node.null_count {
        builder = builder.null_count(null_count);
    }
    if trusted {
        // `trusted`: this crate planned the tree from arrow-rs data and `host` holds the
        // bytes it packed, unchanged (exported device memory is read-only to consumers).
        // Strings are UTF-8, or came from an import whose caller vouched that no code
        // reads them as `str` (`cpu::import_record_batch_trusting_utf8`), a promise that
        // covers the batch brought back.
        // SAFETY: so every invariant `build` would check held when the planner read the
        // input, and still holds.
        builder = unsafe { builder.skip_validation(true) };
    }
    // Validated unless trusted; a panic of arrow-rs on malformed (foreign) data becomes an
    // error.
    let data = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder.build()))
        .map_err(Error::from_panic)??;
    // Debug builds (the tests) check trusted trees too, so that a planner bug shows up as
    // a validation error there rather than as undefined behaviour: every invariant but
    // UTF-8 (see above), which no planner bug breaks without breaking an offset.
    if trusted && cfg!(debug_assertions) {
        devarrow_abi::cpu::validate_full_but_utf8(&data)?;
    }
    Ok(struct_at_zero(data))
}

/// `data`, but a struct of an offset made a struct of offset 0 over its children sliced
/// to its rows (`slice_data`) and its validity at them: arrow-rs 59's `make_array` of a
/// struct of an offset slices its children's `ArrayData`, which for a struct child
/// slices that child's children and keeps its offset too, so a struct in a struct of an
/// offset reads past its children's rows (a panic). Children are built first, so a struct
/// child is at offset 0 already when its parent is sliced.
fn struct_at_zero(data: ArrayData) -> ArrayData {
    if !matches!(data.data_type(), DataType::Struct(_)) || data.offset() == 0 {
        return data;
    }
    let (offset, len) = (data.offset(), data.len());
    let children = data
        .child_data()
        .iter()
        .map(|c| devarrow_abi::slice_data(c, offset, len))
        .collect();
    // SAFETY: the same struct: its type and rows, its validity as the `NullBuffer` of
    // those rows (arrow-rs keeps it at the array's offset), and each child sliced to those
    // rows; nothing else changes.
    unsafe {
        ArrayData::builder(data.data_type().clone())
            .len(len)
            .nulls(data.nulls().cloned())
            .child_data(children)
            .build_unchecked()
    }
}

/// Offsets (4 or 8 bytes each, native-endian) as `i64`s, whatever the buffer's alignment.
fn read_offsets(buffer: &Buffer, width: usize) -> impl Iterator<Item = i64> + '_ {
    buffer.as_slice().chunks_exact(width).map(move |b| {
        if width == 4 {
            i32::from_ne_bytes(b.try_into().expect("4 bytes")) as i64
        } else {
            i64::from_ne_bytes(b.try_into().expect("8 bytes"))
        }
    })
}

fn offsets_buffer(values: impl Iterator<Item = i64>, width: usize) -> Buffer {
    if width == 4 {
        // Truncation is intended: rebased 32-bit offsets wrap as the producer's would.
        Buffer::from_vec(values.map(|v| v as i32).collect::<Vec<i32>>())
    } else {
        Buffer::from_vec(values.collect::<Vec<i64>>())
    }
}

/// Applies a node's `rebase` to its buffers (validity already removed) or children:
/// offsets minus `base`; for list views, offsets minus `base` where the size is positive,
/// else 0; for run-end encoded arrays (of `len` items), the run ends minus `base`, the
/// last clamped to `len`.
fn rebase_offsets(
    data_type: &DataType,
    buffers: &mut [Buffer],
    children: &mut [ArrayData],
    base: i64,
    len: usize,
) -> Result<()> {
    let missing = || Error::InvalidArgument(format!("a {data_type} array without offsets"));
    match data_type {
        DataType::Utf8
        | DataType::Binary
        | DataType::List(_)
        | DataType::Map(_, _)
        | DataType::LargeUtf8
        | DataType::LargeBinary
        | DataType::LargeList(_) => {
            let width = offset_width(data_type);
            let offsets = buffers.first_mut().ok_or_else(missing)?;
            *offsets = offsets_buffer(
                read_offsets(offsets, width).map(|o| o.wrapping_sub(base)),
                width,
            );
        }
        DataType::ListView(_) | DataType::LargeListView(_) => {
            let width = offset_width(data_type);
            let [offsets, sizes, ..] = buffers else {
                return Err(missing());
            };
            *offsets = offsets_buffer(
                read_offsets(offsets, width)
                    .zip(read_offsets(sizes, width))
                    .map(|(o, s)| slicing::rebase_list_view(o, s, base)),
                width,
            );
        }
        DataType::RunEndEncoded(_, _) => {
            let ends = children
                .first_mut()
                .ok_or_else(|| Error::InvalidArgument(format!("a {data_type} without run ends")))?;
            let start = usize::try_from(base)
                .map_err(|_| Error::InvalidArgument(format!("run ends rebased by {base}")))?;
            *ends = rebased_run_ends(ends, start, len)?;
        }
        _ => {}
    }
    Ok(())
}

/// The run ends `ends` (an `Int16`, `Int32` or `Int64` array without nulls) of runs cut
/// for the slice of `len` items from logical item `start` (see
/// [`slicing::rebase_run_ends`]).
fn rebased_run_ends(ends: &ArrayData, start: usize, len: usize) -> Result<ArrayData> {
    fn rebased<T: ArrowPrimitiveType>(
        ends: &ArrayData,
        start: usize,
        len: usize,
    ) -> Result<ArrayData>
    where
        T::Native: TryFrom<i64> + Into<i64>,
    {
        if ends.null_count() > 0 {
            return Err(Error::InvalidArgument(format!(
                "{} run ends with {} nulls",
                T::DATA_TYPE,
                ends.null_count()
            )));
        }
        let values = PrimitiveArray::<T>::from(ends.clone());
        let rebased =
            slicing::rebase_run_ends(values.values().iter().map(|&e| e.into()), start, len)
                .map(|e| {
                    T::Native::try_from(e).map_err(|_| {
                        Error::InvalidArgument(format!(
                            "run end {e} (rebased by {start}) is out of range for {}",
                            T::DATA_TYPE
                        ))
                    })
                })
                .collect::<Result<Vec<T::Native>>>()?;
        Ok(PrimitiveArray::<T>::new(rebased.into(), None).into_data())
    }
    match ends.data_type() {
        DataType::Int16 => rebased::<Int16Type>(ends, start, len),
        DataType::Int32 => rebased::<Int32Type>(ends, start, len),
        DataType::Int64 => rebased::<Int64Type>(ends, start, len),
        other => Err(Error::InvalidArgument(format!("run ends of type {other}"))),
    }
}

/// Applies a node's `rebase_each` to its buffers (validity and variadic sizes already
/// removed): the offsets of a dense union minus the base of each item's child.
fn rebase_each(data_type: &DataType, buffers: &mut [Buffer], bases: &[usize]) -> Result<()> {
    let missing = || Error::InvalidArgument(format!("a {data_type} array without offsets"));
    if let DataType::Union(fields, UnionMode::Dense) = data_type {
        let [type_ids, offsets, ..] = buffers else {
            return Err(missing());
        };
        let field_ids: Vec<i8> = fields.iter().map(|(id, _)| id).collect();
        let rebased: Vec<i32> = slicing::rebase_union_offsets(
            &field_ids,
            bases,
            type_ids.as_slice().iter().map(|&id| id as i8),
            read_offsets(offsets, 4).map(|o| o as i32),
        )
        .collect();
        *offsets = Buffer::from_vec(rebased);
    }
    Ok(())
}

/// Applies a view array's `view_ranges` to its views (validity already removed): each
/// view that is not inline gets the packed buffer and the offset of its bytes there.
fn remap_views(data_type: &DataType, buffers: &mut [Buffer], moved: &[ViewRange]) -> Result<()> {
    let views = buffers
        .first_mut()
        .ok_or_else(|| Error::InvalidArgument(format!("a {data_type} array without views")))?;
    let mut remapped = views.as_slice().to_vec();
    slicing::remap_views(&mut remapped, moved).map_err(|message| Error::InvalidOffsets {
        path: format!("a {data_type} array"),
        message,
    })?;
    *views = Buffer::from_vec(remapped);
    Ok(())
}
