//! How many bytes of Arrow buffers a set of batches holds in memory, each allocation
//! counted once.
//!
//! `RecordBatch::get_array_memory_size` counts every buffer of every array at the
//! capacity of its allocation. That is right for batches built column by column, but an
//! Arrow IPC reader slices all the buffers of a record batch out of one message body, so
//! there it counts the whole body once per buffer: 16 to 130 times the file's size.
//! [`arrow_bytes`] walks every buffer (validity, offsets, values, view data, children and
//! dictionaries) and counts each underlying allocation once, at its capacity.

use std::collections::HashMap;

use arrow_array::{Array, RecordBatch};
use arrow_buffer::Buffer;
use arrow_data::ArrayData;

/// The distinct allocations behind some Arrow buffers: start address to capacity.
#[derive(Debug, Default, Clone)]
pub struct Allocations(HashMap<usize, usize>);

impl Allocations {
    /// No allocations yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the allocation behind `buffer` (nothing if it is already there).
    pub fn add_buffer(&mut self, buffer: &Buffer) {
        if buffer.capacity() > 0 {
            self.0
                .entry(buffer.data_ptr().as_ptr() as usize)
                .or_insert(buffer.capacity());
        }
    }

    /// Adds every buffer of `data`, its children and its dictionary.
    pub fn add_array(&mut self, data: &ArrayData) {
        for_each_buffer(data, &mut |buffer| self.add_buffer(buffer));
    }

    /// Adds every column of `batch`.
    pub fn add_batch(&mut self, batch: &RecordBatch) {
        for column in batch.columns() {
            self.add_array(&column.to_data());
        }
    }

    /// The number of distinct allocations.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Their bytes, each allocation once.
    pub fn bytes(&self) -> usize {
        self.0.values().sum()
    }
}

/// Calls `f` with every buffer of `data` (validity, offsets, values, view data), then of
/// its children and its dictionary (both child data), in that order.
pub fn for_each_buffer(data: &ArrayData, f: &mut impl FnMut(&Buffer)) {
    if let Some(nulls) = data.nulls() {
        f(nulls.buffer());
    }
    data.buffers().iter().for_each(&mut *f);
    for child in data.child_data() {
        for_each_buffer(child, f);
    }
}

/// Bytes of host memory the Arrow buffers of `batches` hold, every allocation counted
/// once (at its capacity) however many buffers, columns or batches share it.
pub fn arrow_bytes(batches: &[RecordBatch]) -> usize {
    let mut allocations = Allocations::new();
    for batch in batches {
        allocations.add_batch(batch);
    }
    allocations.bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use arrow_array::types::Int32Type;
    use arrow_array::{
        ArrayRef, DictionaryArray, Int32Array, ListArray, StringArray, StringViewArray,
    };
    use arrow_buffer::{NullBuffer, ScalarBuffer};

    #[test]
    fn columns_sharing_one_buffer_count_it_once() {
        // One allocation of 4096 bytes, cut into two columns of 512 values each.
        let shared = Buffer::from_vec(vec![7i32; 1024]);
        assert_eq!(shared.capacity(), 4096);
        let a = Int32Array::new(ScalarBuffer::new(shared.clone(), 0, 512), None);
        let b = Int32Array::new(ScalarBuffer::new(shared.clone(), 512, 512), None);
        let batch = RecordBatch::try_from_iter([
            ("a", Arc::new(a) as ArrayRef),
            ("b", Arc::new(b) as ArrayRef),
        ])
        .unwrap();
        assert_eq!(arrow_bytes(std::slice::from_ref(&batch)), 4096);
        // get_array_memory_size counts it once per column.
        assert!(batch.get_array_memory_size() >= 2 * 4096);
        // The same batch twice, or sliced, is still the same memory.
        assert_eq!(arrow_bytes(&[batch.clone(), batch.slice(10, 20)]), 4096);
    }

    #[test]
    fn every_kind_of_buffer_is_counted() {
        let values = Int32Array::new(
            ScalarBuffer::from(vec![1i32; 256]),
            Some(NullBuffer::from(vec![true; 256])),
        );
        let strings = StringArray::from(vec!["a"; 100]);
        let views = StringViewArray::from_iter_values(
            (0..10).map(|i| format!("longer than twelve bytes {i}")),
        );
        let dictionary: DictionaryArray<Int32Type> = vec!["x", "y", "x"].into_iter().collect();
        let list = ListArray::from_iter_primitive::<Int32Type, _, _>([Some(vec![Some(1)])]);
        let columns: [ArrayRef; 5] = [
            Arc::new(values),
            Arc::new(strings),
            Arc::new(views),
            Arc::new(dictionary),
            Arc::new(list),
        ];
        for column in columns {
            let data = column.to_data();
            let mut allocations = Allocations::new();
            allocations.add_array(&data);
            // Built column by column, nothing is shared: the two counts agree on the
            // buffers (get_array_memory_size also counts the structs around them).
            assert!(allocations.bytes() > 0, "{:?}", column.data_type());
            assert!(
                allocations.bytes() <= column.get_array_memory_size(),
                "{:?}",
                column.data_type()
            );
            assert!(
                column.get_array_memory_size() - allocations.bytes() < 1024,
                "{:?}: {} vs {}",
                column.data_type(),
                column.get_array_memory_size(),
                allocations.bytes()
            );
        }
        assert!(Allocations::new().is_empty());
        assert_eq!(arrow_bytes(&[]), 0);
    }
}
