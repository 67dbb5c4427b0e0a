//! Host data to Python: arrow-rs batches and readers as pyarrow objects (through the
//! PyCapsule interface), host imports, and the downloads `from_device.rs` makes.

use std::sync::Arc;

use arrow_array::ffi_stream::FFI_ArrowArrayStream;
use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::ffi::FFI_ArrowSchema;
use arrow_schema::Schema;
use devarrow::abi::cpu;
use devarrow::bridge::{DeviceBatch, DeviceStreamReader, TransferOptions};
use pyo3::prelude::*;

use crate::capsule;
use crate::errors::IntoPy;
use crate::opened;

fn pyarrow(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("pyarrow").map_err(|e| {
        pyo3::exceptions::PyImportError::new_err(format!(
            "this needs pyarrow (pip install pyarrow): {e}"
        ))
    })
}

/// An `arrow_schema` capsule of `schema`.
pub fn schema_capsule<'py>(py: Python<'py>, schema: &Schema) -> PyResult<Bound<'py, PyAny>> {
    let ffi = FFI_ArrowSchema::try_from(schema).map_err(|e| crate::errors::to_py(e.into()))?;
    capsule::new(py, ffi)
}

/// `schema` as a `pyarrow.Schema`.
pub fn schema_to_pyarrow<'py>(py: Python<'py>, schema: &Schema) -> PyResult<Bound<'py, PyAny>> {
    let capsule = schema_capsule(py, schema)?;
    pyarrow(py)?
        .getattr("Schema")?
        .call_method1("_import_from_c_capsule", (capsule,))
}

/// `batch` as a `pyarrow.RecordBatch`, zero-copy.
pub fn batch_to_pyarrow<'py>(py: Python<'py>, batch: &RecordBatch) -> PyResult<Bound<'py, PyAny>> {
    let pa = pyarrow(py)?;
    let (array, schema) = cpu::export_record_batch(batch).py()?;
    let (array, ..) = array.into_ffi();
    let schema = capsule::new(py, schema)?;
    let array = capsule::new(py, array)?;
    pa.getattr("RecordBatch")?
        .call_method1("_import_from_c_capsule", (schema, array))
}

/// `reader` as a `pyarrow.RecordBatchReader` (pulled by pyarrow, batch by batch).
pub fn reader_to_pyarrow(
    py: Python<'_>,
    reader: Box<dyn RecordBatchReader + Send>,
) -> PyResult<Bound<'_, PyAny>> {
    let pa = pyarrow(py)?;
    let stream = capsule::new(py, FFI_ArrowArrayStream::new(reader))?;
    pa.getattr("RecordBatchReader")?
        .call_method1("_import_from_c_capsule", (stream,))
}

/// A host (CPU) record batch imported zero-copy: structure, offsets, views, dictionary
/// keys and union type ids checked (a typed error when malformed), and the UTF-8 of its
/// strings when `validate` (`cpu::import_record_batch`), else not
/// (`cpu::import_record_batch_trusting_utf8`).
pub fn import_host_batch(
    array: devarrow::abi::DeviceArray,
    schema: &FFI_ArrowSchema,
    validate: bool,
) -> devarrow::abi::Result<RecordBatch> {
    if validate {
        return cpu::import_record_batch(array, schema);
    }
    // Batches are packed and copied to a device as bytes, exported to C and DLPack
    // consumers, and handed to pyarrow, which trusts its producers' UTF-8 as arrow-rs's
    // `from_ffi` does (and as the stream uploads, read by arrow-rs's reader, already do).
    // SAFETY: so nothing in this extension reads a batch's strings as `str`.
    unsafe { cpu::import_record_batch_trusting_utf8(array, schema) }
}

/// A device batch downloaded to the host (waiting for its event), on `inner`'s transfer.
pub fn download(
    py: Python<'_>,
    inner: &Arc<opened::DeviceInner>,
    batch: &DeviceBatch,
) -> PyResult<RecordBatch> {
    py.detach(|| inner.transfer().to_host(batch)).py()
}

/// A C device stream downloaded batch by batch: a `pyarrow.RecordBatchReader`.
pub fn device_stream_to_pyarrow(
    py: Python<'_>,
    stream: devarrow::abi::DeviceArrayStream,
) -> PyResult<Bound<'_, PyAny>> {
    {
        // A stream names its device type only; CUDA streams are read on device 0's
        // context (arrays of another device are refused by the import, typed).
        let inner = opened::for_arrays(stream.device_type(), 0)?;
        let device = inner.selected.device.clone();
        let reader = py
            .detach(|| DeviceStreamReader::try_new(stream, device))
            .py()?
            .into_host(TransferOptions::default());
        reader_to_pyarrow(py, Box::new(reader))
    }
}
