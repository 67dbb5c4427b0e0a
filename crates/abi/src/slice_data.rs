//! Slicing an `ArrayData` the same way on every arrow-rs version devarrow accepts
//! ([`slice_data`]).

use arrow_array::{make_array, Array};
use arrow_data::ArrayData;
use arrow_schema::DataType;

/// `data` cut to `len` items from `offset`, zero-copy: arrow-rs's `ArrayData::slice`,
/// except for structs, which are sliced as arrays (`StructArray::slice`).
///
/// Why: arrow-rs 59's `ArrayData::slice` of a struct slices the children **and** keeps
/// the cumulative offset on the struct, so anything that applies the struct's offset to
/// its children (devarrow's planning, arrow-rs's own `StructArray::from`) counts it twice
/// and reads past the children's ends. arrow-rs 60 moves the offset to the children and
/// resets the struct's to 0. A struct sliced as an array comes out as on 60 on both: offset
/// 0, the children cut.
///
/// # Panics
/// As `ArrayData::slice`: if `offset + len` overflows or exceeds `data.len()`.
pub fn slice_data(data: &ArrayData, offset: usize, len: usize) -> ArrayData {
    match data.data_type() {
        DataType::Struct(_) => make_array(data.clone()).slice(offset, len).into_data(),
        _ => data.slice(offset, len),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int32Array, StructArray};
    use arrow_schema::Field;

    use super::*;

    #[test]
    fn a_struct_in_a_struct_slices_once() {
        let inner = StructArray::from(vec![(
            Arc::new(Field::new("x", DataType::Int32, false)),
            Arc::new(Int32Array::from_iter_values(0..10)) as ArrayRef,
        )]);
        let outer = StructArray::from(vec![(
            Arc::new(Field::new("s", inner.data_type().clone(), false)),
            Arc::new(inner) as ArrayRef,
        )]);
        let data = outer.into_data();
        let once = slice_data(&data, 2, 6);
        let twice = slice_data(&slice_data(&once.child_data()[0], 1, 4), 1, 2);
        let values = StructArray::from(twice);
        let x = values
            .column(0)
            .as_any()
            .downcast_ref::<Int32Array>()
            .unwrap();
        assert_eq!(x.values().to_vec(), vec![4, 5]);
    }
}
