//! [`DeviceFrame`]: a batch inside a device region, as device operators hand it to each
//! other: columns on one device, each a column of a [`DeviceBatch`] it shares with other
//! frames ([`FrameColumn`]), and an optional pending row selection.
//!
//! A frame is zero-copy to project (it picks columns), to extend (a computed column is a
//! one-column batch of its own) and to filter (a filter sets [`DeviceFrame::selection`]
//! instead of moving rows: the operators after it honour the selection, and the region's
//! unload applies it last, compacting the kept rows on the device first where it can,
//! `compute::compact`). Only [`DeviceFrame::download`] moves bytes to the host, once per
//! distinct batch the frame's columns come from.

use std::fmt;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, UInt8Array};
use arrow_schema::{DataType, Field, FieldRef, SchemaRef};
use datafusion::arrow::compute::filter_record_batch;
use devarrow::abi::device::Device;
use devarrow::bridge::{DeviceBatch, DeviceColumn, Transfer};

use crate::error::{BoxError, DeviceExecError};

/// One column of a device batch, shared: the batch stays alive while any frame uses one
/// of its columns.
#[derive(Clone)]
pub struct FrameColumn {
    batch: Arc<DeviceBatch>,
    index: usize,
    field: FieldRef,
}

impl fmt::Debug for FrameColumn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrameColumn")
            .field("field", &self.field)
            .field("rows", &self.batch.num_rows())
            .finish()
    }
}

impl FrameColumn {
    /// Column `index` of `batch`.
    ///
    /// # Errors
    /// [`DeviceExecError::Frame`] when the batch has no such column.
    pub fn new(batch: Arc<DeviceBatch>, index: usize) -> Result<Self, DeviceExecError> {
        if index >= batch.schema().fields().len() {
            return Err(DeviceExecError::Frame(format!(
                "column {index} of a batch of {} columns",
                batch.schema().fields().len()
            )));
        }
        let field = batch.schema().fields()[index].clone();
        Ok(Self {
            batch,
            index,
            field,
        })
    }

    /// The only column of a one-column batch (a computed column).
    ///
    /// # Errors
    /// [`DeviceExecError::Frame`] when the batch has not exactly one column.
    pub fn single(batch: DeviceBatch) -> Result<Self, DeviceExecError> {
        if batch.schema().fields().len() != 1 {
            return Err(DeviceExecError::Frame(format!(
                "a computed column's batch has {} columns, not 1",
                batch.schema().fields().len()
            )));
        }
        let field = batch.schema().fields()[0].clone();
        Ok(Self {
            batch: Arc::new(batch),
            index: 0,
            field,
        })
    }

    /// The column, borrowed from its batch.
    pub fn column(&self) -> DeviceColumn<'_> {
        self.batch
            .column(self.index)
            .expect("the index was checked against the batch's schema")
    }

    /// The batch the column belongs to.
    pub fn batch(&self) -> &Arc<DeviceBatch> {
        &self.batch
    }

    /// The column's index in its batch.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The column's field in its batch.
    pub fn field(&self) -> &Field {
        &self.field
    }

    /// The column's type.
    pub fn data_type(&self) -> &DataType {
        self.field().data_type()
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.batch.num_rows()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device the column is on.
    pub fn device(&self) -> &Arc<dyn Device> {
        self.batch.device()
    }
}

/// A batch inside a device region: see the [module](self).
#[derive(Clone)]
pub struct DeviceFrame {
    schema: SchemaRef,
    columns: Vec<FrameColumn>,
    num_rows: usize,
    selection: Option<FrameColumn>,
}

impl fmt::Debug for DeviceFrame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceFrame")
            .field("schema", &self.schema.to_string())
            .field("num_rows", &self.num_rows)
            .field("selection", &self.selection.is_some())
            .finish()
    }
}

impl DeviceFrame {
    /// Every column of `batch`, no selection.
    pub fn from_batch(batch: DeviceBatch) -> Self {
        let schema = batch.schema();
        let num_rows = batch.num_rows();
        let batch = Arc::new(batch);
        let columns = (0..schema.fields().len())
            .map(|index| FrameColumn {
                batch: batch.clone(),
                index,
                field: schema.fields()[index].clone(),
            })
            .collect();
        Self {
            schema,
            columns,
            num_rows,
            selection: None,
        }
    }

    /// A frame of `schema` made of `columns` (one per field, of its type, `num_rows`
    /// rows each, all on one device) and an optional selection (a `UInt8` column of
    /// `num_rows` rows: a row is selected where it is not 0 and not null).
    ///
    /// # Errors
    /// [`DeviceExecError::Frame`] when a column does not fit its field, the rows or the
    /// device of the others.
    pub fn try_new(
        schema: SchemaRef,
        columns: Vec<FrameColumn>,
        num_rows: usize,
        selection: Option<FrameColumn>,
    ) -> Result<Self, DeviceExecError> {
        let bad = |why: String| Err(DeviceExecError::Frame(why));
        if columns.len() != schema.fields().len() {
            return bad(format!(
                "{} columns for a schema of {} fields",
                columns.len(),
                schema.fields().len()
            ));
        }
        for (column, field) in columns.iter().zip(schema.fields()) {
            if column.data_type() != field.data_type() {
                return bad(format!(
                    "column `{}` is {}, the schema says {}",
                    field.name(),
                    column.data_type(),
                    field.data_type()
                ));
            }
        }
        for column in columns.iter().chain(&selection) {
            if column.len() != num_rows {
                return bad(format!(
                    "a column of {} rows in a frame of {num_rows}",
                    column.len()
                ));
            }
        }
        if let Some(first) = columns.first().or(selection.as_ref()) {
            let device = (first.device().device_type(), first.device().device_id());
            if columns
                .iter()
                .chain(&selection)
                .any(|c| (c.device().device_type(), c.device().device_id()) != device)
            {
                return bad("columns on different devices".into());
            }
        }
        if let Some(selection) = &selection {
            if selection.data_type() != &DataType::UInt8 {
                return bad(format!(
                    "a selection is UInt8, not {}",
                    selection.data_type()
                ));
            }
        }
        Ok(Self {
            schema,
            columns,
            num_rows,
            selection,
        })
    }

    /// The frame's schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Its columns, one per field.
    pub fn columns(&self) -> &[FrameColumn] {
        &self.columns
    }

    /// Column `i`.
    pub fn column(&self, i: usize) -> Option<&FrameColumn> {
        self.columns.get(i)
    }

    /// The column named `name`.
    pub fn column_by_name(&self, name: &str) -> Option<&FrameColumn> {
        self.schema
            .index_of(name)
            .ok()
            .and_then(|i| self.columns.get(i))
    }

    /// Rows, selected or not.
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// The pending selection (`UInt8`: a row is selected where it is not 0 and not
    /// null), if a filter set one.
    pub fn selection(&self) -> Option<&FrameColumn> {
        self.selection.as_ref()
    }

    /// This frame with `selection` as its pending selection (a filter combines it with
    /// the one before, so it replaces it here).
    ///
    /// # Errors
    /// [`DeviceExecError::Frame`] when it is not a `UInt8` column of the frame's rows.
    pub fn with_selection(self, selection: FrameColumn) -> Result<Self, DeviceExecError> {
        Self::try_new(self.schema, self.columns, self.num_rows, Some(selection))
    }

    /// The columns at `indices`, zero-copy, the selection kept.
    ///
    /// # Errors
    /// [`DeviceExecError::Frame`] for an index out of range.
    pub fn project(&self, indices: &[usize]) -> Result<Self, DeviceExecError> {
        let schema = self
            .schema
            .project(indices)
            .map_err(|e| DeviceExecError::Frame(e.to_string()))?;
        let columns = indices.iter().map(|&i| self.columns[i].clone()).collect();
        Self::try_new(
            Arc::new(schema),
            columns,
            self.num_rows,
            self.selection.clone(),
        )
    }

    /// The device memory of the batches the frame's columns come from (each counted
    /// once).
    pub fn device_bytes(&self) -> usize {
        self.distinct_batches()
            .iter()
            .map(|b| b.device_bytes())
            .sum()
    }

    /// The device (of its first column; `None` for a frame of no column).
    pub fn device(&self) -> Option<&Arc<dyn Device>> {
        self.columns
            .first()
            .or(self.selection.as_ref())
            .map(|c| c.device())
    }

    fn distinct_batches(&self) -> Vec<&Arc<DeviceBatch>> {
        let mut batches: Vec<&Arc<DeviceBatch>> = Vec::new();
        for column in self.columns.iter().chain(&self.selection) {
            if !batches.iter().any(|b| Arc::ptr_eq(b, &column.batch)) {
                batches.push(&column.batch);
            }
        }
        batches
    }

    /// The frame on the host: each distinct batch its columns come from downloaded once
    /// by `transfer`, the columns picked, then the selection applied.
    ///
    /// # Errors
    /// devarrow's download errors; [`DeviceExecError::Frame`] when the downloaded
    /// columns do not make a batch of the frame's schema.
    pub fn download(&self, transfer: &mut Transfer) -> Result<RecordBatch, BoxError> {
        let batches = self.distinct_batches();
        let mut hosts: Vec<RecordBatch> = Vec::with_capacity(batches.len());
        for batch in &batches {
            hosts.push(transfer.to_host(batch)?);
        }
        let host_column = |column: &FrameColumn| -> ArrayRef {
            let at = batches
                .iter()
                .position(|b| Arc::ptr_eq(b, &column.batch))
                .expect("every column's batch is among the distinct batches");
            hosts[at].column(column.index).clone()
        };
        let columns: Vec<ArrayRef> = self.columns.iter().map(host_column).collect();
        let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(self.num_rows));
        let batch = RecordBatch::try_new_with_options(self.schema.clone(), columns, &options)
            .map_err(|e| DeviceExecError::Frame(e.to_string()))?;
        let Some(selection) = &self.selection else {
            return Ok(batch);
        };
        let mask = host_column(selection);
        let mask = mask
            .as_any()
            .downcast_ref::<UInt8Array>()
            .ok_or("a selection is UInt8")?;
        let mask: BooleanArray = mask.iter().map(|v| Some(v.unwrap_or(0) != 0)).collect();
        Ok(filter_record_batch(&batch, &mask)?)
    }
}

/// The bytes `batch` holds in its arrays' used ranges (what an upload moves).
pub(crate) fn batch_bytes(batch: &RecordBatch) -> usize {
    batch
        .columns()
        .iter()
        .map(|c| {
            let data = c.to_data();
            data.get_slice_memory_size()
                .unwrap_or_else(|_| c.get_array_memory_size())
        })
        .sum()
}

/// The schema of `fields`, no metadata.
pub(crate) fn schema_of(fields: Vec<Field>) -> SchemaRef {
    Arc::new(arrow_schema::Schema::new(fields))
}
