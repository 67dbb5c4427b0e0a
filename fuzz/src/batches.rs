//! The record batches the stream targets pass around.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::{ArrayRef, Int32Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

/// `{id: int32 not null, name: utf8}` with metadata.
pub fn schema() -> SchemaRef {
    Arc::new(
        Schema::new(vec![
            Field::new("id", DataType::Int32, false),
            Field::new("name", DataType::Utf8, true),
        ])
        .with_metadata(HashMap::from([("origin".to_string(), "fuzz".to_string())])),
    )
}

/// Batch `i` of [`schema`]: `i % 5` rows (0 rows included).
pub fn batch(i: u8) -> RecordBatch {
    let n = (i % 5) as i32;
    let ids: ArrayRef = Arc::new(Int32Array::from_iter_values(
        (0..n).map(|k| i as i32 * 10 + k),
    ));
    let names: ArrayRef = Arc::new(StringArray::from_iter(
        (0..n).map(|k| (k % 2 == 0).then(|| format!("row {i}.{k}"))),
    ));
    RecordBatch::try_new(schema(), vec![ids, names]).unwrap()
}

/// A batch of another schema (`{x: int64}`).
pub fn other_batch() -> RecordBatch {
    RecordBatch::try_new(
        Arc::new(Schema::new(vec![Field::new("x", DataType::Int64, false)])),
        vec![Arc::new(arrow_array::Int64Array::from(vec![1, 2]))],
    )
    .unwrap()
}
