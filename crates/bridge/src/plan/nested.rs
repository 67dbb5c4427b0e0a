//! Nested layouts: lists and maps (offsets rebased, the child cut to the range they
//! address), list views (offsets rebased, the child cut to the range the views address),
//! fixed-size lists, structs and unions (sparse: every child cut to the slice; dense:
//! offsets rebased per child, each child cut to the range the slice addresses).

use arrow_buffer::{ArrowNativeType, Buffer};
use arrow_data::ArrayData;
use arrow_schema::{DataType, UnionFields};
use devarrow_abi::{slice_data, Error, Result};

use super::buffers::{buffer, cut, push_validity_and_offsets, typed, validity};
use super::{plan_child, plan_node, Packer, Parts};
use crate::slicing;

/// A list or map with offsets of type `O` (`i32`, or `i64` for `LargeList`).
pub(super) fn plan_list<O: ArrowNativeType + std::ops::Sub<Output = O>>(
    data: &ArrayData,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (lo, hi) = push_validity_and_offsets::<O>(data, image, parts)?;
    let child = slice_data(&data.child_data()[0], lo, hi - lo);
    parts.children.push(plan_node(&child, image)?);
    Ok(())
}

/// A list view (`ListView`, `LargeListView`): offsets rebased for the child cut to the
/// range the views address (empty views address nothing), sizes cut to the slice.
pub(super) fn plan_list_view(
    data: &ArrayData,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    let buffers = &mut parts.buffers;
    buffers.push(validity(data, image));
    let large = matches!(data.data_type(), DataType::LargeListView(_));
    let (offsets, sizes): (Vec<i64>, Vec<i64>) = if large {
        (
            typed::<i64>(buffer(data, 0)?, start, len)?.to_vec(),
            typed::<i64>(buffer(data, 1)?, start, len)?.to_vec(),
        )
    } else {
        (
            typed::<i32>(buffer(data, 0)?, start, len)?
                .iter()
                .map(|&o| o as i64)
                .collect(),
            typed::<i32>(buffer(data, 1)?, start, len)?
                .iter()
                .map(|&s| s as i64)
                .collect(),
        )
    };
    // The child range the views address (empty views address nothing).
    let views = || offsets.iter().copied().zip(sizes.iter().copied());
    let (lo, hi) = slicing::list_view_range(views());
    let rebased: Vec<i64> = views()
        .map(|(o, s)| slicing::rebase_list_view(o, s, lo))
        .collect();
    if large {
        buffers.push(image.push(Buffer::from_vec(rebased)));
        buffers.push(image.push(cut(buffer(data, 1)?, start, len, 8)?));
    } else {
        let rebased: Vec<i32> = rebased.into_iter().map(|o| o as i32).collect();
        buffers.push(image.push(Buffer::from_vec(rebased)));
        buffers.push(image.push(cut(buffer(data, 1)?, start, len, 4)?));
    }
    let child = &data.child_data()[0];
    parts.children.push(plan_node(
        &slice_data(child, lo as usize, (hi - lo) as usize),
        image,
    )?);
    Ok(())
}

/// A fixed-size list of `size` items per list: the child cut to the slice's items.
pub(super) fn plan_fixed_size_list(
    data: &ArrayData,
    size: i32,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    parts.buffers.push(validity(data, image));
    let n = usize::try_from(size)
        .map_err(|_| Error::InvalidArgument(format!("{} has a negative size", data.data_type())))?;
    let child = slice_data(&data.child_data()[0], start * n, len * n);
    parts.children.push(plan_node(&child, image)?);
    Ok(())
}

/// A struct: every child cut to the slice.
pub(super) fn plan_struct(data: &ArrayData, image: &mut Packer, parts: &mut Parts) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    parts.buffers.push(validity(data, image));
    for child in data.child_data() {
        parts.children.push(plan_child(child, start, len, image)?);
    }
    Ok(())
}

/// A sparse union with `fields`: its type ids and every child cut to the slice (no
/// validity bitmap).
pub(super) fn plan_sparse_union(
    data: &ArrayData,
    fields: &UnionFields,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    parts
        .buffers
        .push(image.push(cut(buffer(data, 0)?, start, len, 1)?));
    debug_assert_eq!(fields.len(), data.child_data().len());
    for child in data.child_data() {
        parts
            .children
            .push(plan_node(&slice_data(child, start, len), image)?);
    }
    Ok(())
}

/// A dense union with `fields`: its type ids cut to the slice, each child cut to the
/// range the slice's items address, and the offsets rebased to those cuts (no validity
/// bitmap).
pub(super) fn plan_dense_union(
    data: &ArrayData,
    fields: &UnionFields,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    let type_ids: &[i8] = typed(buffer(data, 0)?, start, len)?;
    let offsets: &[i32] = typed(buffer(data, 1)?, start, len)?;
    // The range of each child the slice addresses.
    let field_ids: Vec<i8> = fields.iter().map(|(id, _)| id).collect();
    let child_lens: Vec<usize> = data.child_data().iter().map(|c| c.len()).collect();
    let ranges = slicing::dense_union_ranges(
        &field_ids,
        &child_lens,
        type_ids.iter().copied(),
        offsets.iter().copied(),
    )
    .map_err(Error::InvalidArgument)?;
    let bases: Vec<usize> = ranges.iter().map(|&(lo, _)| lo).collect();
    let rebased: Vec<i32> = slicing::rebase_union_offsets(
        &field_ids,
        &bases,
        type_ids.iter().copied(),
        offsets.iter().copied(),
    )
    .collect();
    parts
        .buffers
        .push(image.push(cut(buffer(data, 0)?, start, len, 1)?));
    parts.buffers.push(image.push(Buffer::from_vec(rebased)));
    for (&(lo, hi), child) in ranges.iter().zip(data.child_data()) {
        parts.children.push(plan_child(child, lo, hi - lo, image)?);
    }
    Ok(())
}
