//! Encoded layouts: dictionaries (the keys cut to the slice, the dictionary whole, since
//! every slice shares it) and run-end encoded arrays (the runs covering the slice, their
//! ends rebased to it).

use arrow_array::cast::AsArray;
use arrow_array::types::{Int16Type, Int32Type, Int64Type};
use arrow_array::{make_array, Array};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;
use arrow_schema::DataType;
use devarrow_abi::{slice_data, Error, Result};

use super::buffers::{buffer, cut, validity};
use super::{plan_node, Node, Packer, Parts};
use crate::slicing;

/// A dictionary-encoded array with keys of type `key`: the keys cut to the slice, the
/// dictionary planned whole.
pub(super) fn plan_dictionary(
    data: &ArrayData,
    key: &DataType,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    parts.buffers.push(validity(data, image));
    let width = key.primitive_width().expect("dictionary keys are integers");
    parts
        .buffers
        .push(image.push(cut(buffer(data, 0)?, start, len, width)?));
    // The dictionary is shared by every slice of the array: it travels whole.
    parts.dictionary = Some(Box::new(plan_node(&data.child_data()[0], image)?));
    Ok(())
}

/// A run-end encoded array (no buffers of its own): the run ends of the runs that cover
/// the slice, rebased to it (the last one clamped to its length), and the values of those
/// runs.
pub(super) fn plan_run_end_encoded(
    data: &ArrayData,
    image: &mut Packer,
    parts: &mut Parts,
) -> Result<()> {
    let (start, len) = (data.offset(), data.len());
    let run_ends = make_array(data.child_data()[0].clone());
    let ends: Vec<i64> = match run_ends.data_type() {
        DataType::Int16 => run_ends
            .as_primitive::<Int16Type>()
            .values()
            .iter()
            .map(|&e| e as i64)
            .collect(),
        DataType::Int32 => run_ends
            .as_primitive::<Int32Type>()
            .values()
            .iter()
            .map(|&e| e as i64)
            .collect(),
        DataType::Int64 => run_ends.as_primitive::<Int64Type>().values().to_vec(),
        other => return Err(Error::InvalidArgument(format!("run ends of type {other}"))),
    };
    // Physical runs first..last cover logical start..start + len.
    let (first, last) = slicing::covering_runs(&ends, start, len);
    let new_ends: Vec<i64> =
        slicing::rebase_run_ends(ends[first..last].iter().copied(), start, len).collect();
    let runs = new_ends.len();
    let ends_buffer = match run_ends.data_type() {
        DataType::Int16 => Buffer::from_vec(new_ends.iter().map(|&e| e as i16).collect::<Vec<_>>()),
        DataType::Int32 => Buffer::from_vec(new_ends.iter().map(|&e| e as i32).collect::<Vec<_>>()),
        _ => Buffer::from_vec(new_ends),
    };
    parts.children.push(Node {
        data_type: run_ends.data_type().clone(),
        len: runs,
        null_count: Some(0),
        offset: 0,
        rebase: None,
        rebase_each: Vec::new(),
        view_ranges: Vec::new(),
        buffers: vec![None, image.push(ends_buffer)],
        children: vec![],
        dictionary: None,
    });
    parts.children.push(plan_node(
        &slice_data(&data.child_data()[1], first, runs),
        image,
    )?);
    Ok(())
}
