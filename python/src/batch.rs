//! `DeviceBatch` (a record batch on a device), its columns (`DeviceColumn`, DLPack and
//! `__cuda_array_interface__`) and their validity bitmaps (`DeviceBitmap`).

use std::sync::Arc;

use arrow_schema::{DataType, IntervalUnit};
use devarrow::abi::ArrowDeviceType;
use devarrow::bridge::{DeviceBatch, ExportOptions};
use devarrow::cuda::cudarc::driver::sys;
use devarrow::cuda::CudaError;
use pyo3::exceptions::{
    PyAttributeError, PyBufferError, PyIndexError, PyKeyError, PyNotImplementedError, PyTypeError,
    PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::dlpack::{self, DLDataType, DLDevice, View};
use crate::errors::{DeviceError, IntoPy, SchemaMismatchError, UnsupportedTypeError};
use crate::opened::DeviceInner;
use crate::{capsule, host};

/// Refuses keyword arguments of the PyCapsule protocol this version does not know
/// (the protocol asks for `NotImplementedError` when one is not None).
pub fn check_kwargs(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    if let Some(kwargs) = kwargs {
        for (key, value) in kwargs.iter() {
            if !value.is_none() {
                return Err(PyNotImplementedError::new_err(format!(
                    "devarrow does not support the keyword {key}"
                )));
            }
        }
    }
    Ok(())
}

/// Refuses a requested schema other than the data's own (devarrow does not cast).
pub fn check_requested(
    requested: Option<&Bound<'_, PyAny>>,
    schema: &arrow_schema::Schema,
) -> PyResult<()> {
    let Some(requested) = requested.filter(|r| !r.is_none()) else {
        return Ok(());
    };
    let wanted = capsule::read_schema(requested)?;
    if wanted.fields() == schema.fields() {
        return Ok(());
    }
    Err(SchemaMismatchError::new_err(format!(
        "devarrow cannot honour the requested schema: it exports the data as it is, \
         without casting (requested {wanted:?}, data {schema:?})"
    )))
}

/// A record batch resident on a device: made by ``Device.to_device`` or by iterating a
/// ``DeviceStream``.
///
/// It speaks the Arrow PyCapsule device interface (``__arrow_c_device_array__``, so
/// pyarrow, nanoarrow and ``devarrow.from_device`` read it zero-copy), and its columns
/// speak DLPack (``column(i).__dlpack__``).
#[pyclass(name = "DeviceBatch", module = "devarrow", frozen)]
#[derive(Debug)]
pub struct PyDeviceBatch {
    pub batch: DeviceBatch,
    pub inner: Arc<DeviceInner>,
}

impl PyDeviceBatch {
    pub fn new(batch: DeviceBatch, inner: Arc<DeviceInner>) -> Self {
        Self { batch, inner }
    }
}

#[pymethods]
impl PyDeviceBatch {
    /// The number of rows.
    #[getter]
    fn num_rows(&self) -> usize {
        self.batch.num_rows()
    }

    /// The number of columns.
    #[getter]
    fn num_columns(&self) -> usize {
        self.batch.schema().fields().len()
    }

    /// The column names, in order.
    #[getter]
    fn column_names(&self) -> Vec<String> {
        self.batch
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect()
    }

    /// The device's id (``"cpu"``, ``"cuda:0"``).
    #[getter]
    fn device(&self) -> &str {
        self.inner.id()
    }

    /// Bytes of device memory the batch occupies.
    #[getter]
    fn nbytes(&self) -> usize {
        self.batch.device_bytes()
    }

    /// The schema as a ``pyarrow.Schema`` (needs pyarrow).
    #[getter]
    fn schema<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        host::schema_to_pyarrow(py, &self.batch.schema())
    }

    /// The schema as an ``arrow_schema`` PyCapsule.
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        host::schema_capsule(py, &self.batch.schema())
    }

    /// Exports the batch as an ``(arrow_schema, arrow_device_array)`` pair of
    /// PyCapsules, zero-copy; the array's ``sync_event`` marks when its data is ready.
    /// ``requested_schema`` may be None or the batch's own schema (devarrow does not
    /// cast); another raises :class:`SchemaMismatchError`.
    #[pyo3(signature = (requested_schema = None, **kwargs))]
    fn __arrow_c_device_array__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<&Bound<'py, PyAny>>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        check_kwargs(kwargs)?;
        check_requested(requested_schema, &self.batch.schema())?;
        let (array, schema) = self.batch.export().py()?;
        let schema = capsule::new(py, schema)?;
        let array = capsule::new(py, capsule::RawDeviceArray(array.into_raw()))?;
        PyTuple::new(py, [schema, array])
    }

    /// The batch in libcudf's dialect, which ``cudf::from_arrow_device`` (pylibcudf's
    /// ``from_arrow``) views zero-copy: string views become strings, list views, large,
    /// fixed-size lists and maps become lists with int32 offsets, unsigned dictionary
    /// indices signed ones, null counts exact; converted **on the device** (kernels on
    /// its stream, the GIL released), columns that need nothing kept as they are.
    /// ``widen_small_decimals=True`` also widens decimal32/64 to decimal128 (libcudf
    /// before 25.02). Raises :class:`UnsupportedTypeError` naming a column libcudf would
    /// refuse (binary, float16, intervals, unions, ...).
    #[pyo3(signature = (*, widen_small_decimals = false))]
    fn for_libcudf(&self, py: Python<'_>, widen_small_decimals: bool) -> PyResult<PyDeviceBatch> {
        let batch = self.batch.clone();
        let device = self.inner.selected.device.clone();
        let converted = py
            .detach(move || {
                let options =
                    ExportOptions::for_libcudf().widen_small_decimals(widen_small_decimals);
                let (array, schema) = batch.export_with(options)?;
                DeviceBatch::import_with_ffi_schema(device, array, &schema)
            })
            .py()?;
        Ok(PyDeviceBatch::new(converted, self.inner.clone()))
    }

    /// Blocks until the batch's data is on its device (its sync event has completed),
    /// with the GIL released: what timing an upload needs, and what host code that reads
    /// the device's memory by other means than a stream needs first. Consumers on a
    /// stream need not call it (``__dlpack__(stream=...)`` and the exported
    /// ``sync_event`` order their work after the data, without blocking the host).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let event = self.batch.event().clone();
        py.detach(move || event.wait_host()).py()
    }

    /// Downloads the batch to host memory: a ``pyarrow.RecordBatch`` (waits for the
    /// batch's data; the GIL is released meanwhile).
    fn to_host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let batch = host::download(py, &self.inner, &self.batch)?;
        host::batch_to_pyarrow(py, &batch)
    }

    /// The same as :meth:`to_host`.
    fn to_pyarrow<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.to_host(py)
    }

    /// A column, by index or by name.
    fn column(&self, key: &Bound<'_, PyAny>) -> PyResult<PyDeviceColumn> {
        let schema = self.batch.schema();
        let index = if let Ok(i) = key.extract::<isize>() {
            let n = schema.fields().len() as isize;
            let j = if i < 0 { i + n } else { i };
            if !(0..n).contains(&j) {
                return Err(PyIndexError::new_err(format!(
                    "column {i} out of range: the batch has {n} columns"
                )));
            }
            j as usize
        } else if let Ok(name) = key.extract::<String>() {
            schema
                .index_of(&name)
                .map_err(|_| PyKeyError::new_err(format!("no column named {name:?}")))?
        } else {
            return Err(PyTypeError::new_err("column() takes an int or a str"));
        };
        Ok(PyDeviceColumn {
            batch: self.batch.clone(),
            inner: self.inner.clone(),
            index,
        })
    }

    fn __len__(&self) -> usize {
        self.batch.num_rows()
    }

    fn __repr__(&self) -> String {
        format!(
            "devarrow.DeviceBatch({} rows, {} columns {:?}, on {})",
            self.batch.num_rows(),
            self.batch.schema().fields().len(),
            self.column_names(),
            self.inner.id()
        )
    }
}

/// The DLPack data type of a fixed-width column, or why it has none.
fn dl_dtype(data_type: &DataType) -> Result<DLDataType, String> {
    use DataType::*;
    let (code, bits) = match data_type {
        Int8 => (dlpack::DL_INT, 8),
        Int16 => (dlpack::DL_INT, 16),
        Int32 | Date32 | Time32(_) | Interval(IntervalUnit::YearMonth) => (dlpack::DL_INT, 32),
        Int64 | Date64 | Time64(_) | Timestamp(..) | Duration(_) => (dlpack::DL_INT, 64),
        UInt8 => (dlpack::DL_UINT, 8),
        UInt16 => (dlpack::DL_UINT, 16),
        UInt32 => (dlpack::DL_UINT, 32),
        UInt64 => (dlpack::DL_UINT, 64),
        Float16 => (dlpack::DL_FLOAT, 16),
        Float32 => (dlpack::DL_FLOAT, 32),
        Float64 => (dlpack::DL_FLOAT, 64),
        Boolean => return Err("booleans are bit-packed in Arrow".into()),
        other if other.is_nested() => return Err("it is nested".into()),
        Dictionary(..) => return Err("it is dictionary-encoded".into()),
        other if other.primitive_width().is_none() => {
            return Err("it is not fixed-width (variable-length or without a layout)".into())
        }
        _ => return Err(
            "it has no DLPack data type (decimals, intervals of several fields, fixed-size binary)"
                .into(),
        ),
    };
    Ok(DLDataType {
        code,
        bits,
        lanes: 1,
    })
}

/// The DLPack device of a batch's buffers.
fn dl_device(device_type: ArrowDeviceType, device_id: i64) -> DLDevice {
    DLDevice {
        device_type: device_type.0,
        device_id: if device_type == ArrowDeviceType::CPU {
            0
        } else {
            device_id as i32
        },
    }
}

/// DLPack's `stream` argument on CUDA: makes the consumer's stream wait (on the GPU) on
/// the batch's event. -1: no synchronization. None: the calling thread's per-thread
/// default stream (`CU_STREAM_PER_THREAD`), not the legacy default stream DLPack names
/// for None: a command on the legacy default stream waits for every blocking stream of
/// the device and makes them all wait for it (an implicit synchronization of other
/// libraries' work). A consumer on the legacy default stream is ordered all the same:
/// the per-thread default stream is a blocking stream, which the legacy default stream
/// waits for before its next command. A consumer on any other stream passes its handle,
/// as DLPack asks; 1 still names the legacy default stream.
///
/// Any other positive value is handed to `cuStreamWaitEvent` as the consumer's
/// `CUstream`, which nothing can validate: NVIDIA's driver dereferences stream handles,
/// so a value that is not a live stream (a garbage integer, a destroyed stream) crashes
/// the process, as it would in any CUDA library (DLPack makes it the consumer's
/// contract). What devarrow refuses is what it can tell without the driver: 0
/// (ambiguous) and negative values other than -1.
fn sync_stream(inner: &DeviceInner, batch: &DeviceBatch, stream: Option<i64>) -> PyResult<()> {
    let Some(cuda) = inner.selected.cuda.as_ref() else {
        return Ok(()); // the CPU device: data is ready when the batch exists
    };
    let handle = match stream {
        // CU_STREAM_PER_THREAD (see above), not CU_STREAM_LEGACY.
        None => 2,
        Some(-1) => return Ok(()),
        Some(0) => {
            return Err(PyValueError::new_err(
                "stream=0 is ambiguous in DLPack: pass 1 (the legacy default stream), 2 \
                 (the per-thread default stream) or a stream's handle",
            ))
        }
        Some(s) if s < 0 => {
            return Err(PyValueError::new_err(format!("invalid stream {s}")));
        }
        Some(s) => s as usize,
    };
    // The stream handle is the consumer's contract under DLPack: devarrow cannot check it
    // and the driver does not validate it.
    // SAFETY: the handle is the consumer's live stream of the device's context; a CUDA
    // batch's sync event pointer is NULL or a `CUevent*` to its live event (`batch`).
    unsafe { cuda.make_raw_stream_wait(handle as sys::CUstream, batch.event().as_ref()) }.map_err(
        |e| match e {
            CudaError::Driver {
                call: "cuStreamWaitEvent",
                ..
            } => DeviceError::new_err(format!(
                "making the consumer's stream {handle:#x} wait on the batch's event: {e}"
            )),
            // binding the device's context first
            e => crate::errors::to_py(e.into()),
        },
    )
}

/// The DLPack protocol over a view: `__dlpack__`'s arguments checked, the consumer's
/// stream synchronized, and the capsule.
#[allow(clippy::too_many_arguments)]
fn dlpack_capsule<'py>(
    py: Python<'py>,
    inner: &DeviceInner,
    view: View,
    stream: Option<i64>,
    max_version: Option<(u32, u32)>,
    dl_device: Option<(i32, i32)>,
    copy: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    if let Some((t, id)) = dl_device {
        if (t, id) != (view.device.device_type, view.device.device_id) {
            return Err(PyBufferError::new_err(format!(
                "devarrow exports on its own device ({}, {}) only, not ({t}, {id})",
                view.device.device_type, view.device.device_id
            )));
        }
    }
    if copy == Some(true) {
        return Err(PyBufferError::new_err(
            "copy=True is not supported: devarrow exports its buffers zero-copy (download \
             with to_host() for a copy)",
        ));
    }
    let batch = view.batch.clone();
    py.detach(|| sync_stream(inner, &batch, stream))?;
    let versioned = max_version.is_some_and(|(major, _)| major >= 1);
    dlpack::capsule(py, view, versioned)
}

/// One column of a :class:`DeviceBatch`, on the device.
///
/// Fixed-width columns without nulls (integers, floats, dates, times, timestamps,
/// durations) speak DLPack (``numpy.from_dlpack``, ``torch.from_dlpack``,
/// ``cupy.from_dlpack``) and, on CUDA, ``__cuda_array_interface__``, zero-copy: the
/// tensor keeps the batch's memory alive. Other columns raise
/// :class:`UnsupportedTypeError` naming why. The validity bitmap is ``validity``.
#[pyclass(name = "DeviceColumn", module = "devarrow", frozen)]
#[derive(Debug)]
pub struct PyDeviceColumn {
    batch: DeviceBatch,
    inner: Arc<DeviceInner>,
    index: usize,
}

impl PyDeviceColumn {
    fn field(&self) -> arrow_schema::FieldRef {
        self.batch.schema().fields()[self.index].clone()
    }

    /// The values as a one-dimensional view, or why not.
    fn values_view(&self) -> PyResult<View> {
        let column = self
            .batch
            .column(self.index)
            .ok_or_else(|| PyIndexError::new_err("no such column"))?;
        let field = self.field();
        let dtype = dl_dtype(column.data_type()).map_err(|why| {
            UnsupportedTypeError::new_err(format!(
                "column {:?} ({}) has no DLPack form: {why}; DLPack covers fixed-width \
                 columns without nulls",
                field.name(),
                column.data_type()
            ))
        })?;
        match column.null_count() {
            Some(0) => {}
            found => {
                let what = found.map_or("may have nulls".to_string(), |n| format!("has {n} nulls"));
                return Err(UnsupportedTypeError::new_err(format!(
                    "column {:?} {what}: DLPack has no validity (read the bitmap from \
                     column.validity and the values with a fill of your own after to_host())",
                    field.name()
                )));
            }
        }
        let width = dtype.bits as usize / 8;
        let address = match column.values() {
            Some(values) => values.address() + (column.offset() * width) as u64,
            None if column.is_empty() => 0,
            None => {
                return Err(UnsupportedTypeError::new_err(format!(
                    "column {:?} has no values buffer",
                    field.name()
                )))
            }
        };
        Ok(View {
            batch: self.batch.clone(),
            address,
            len: column.len(),
            dtype,
            device: dl_device(column.device_type(), column.device_id()),
        })
    }

    fn device_pair(&self) -> (i32, i32) {
        let (t, id) = self
            .batch
            .column(self.index)
            .map(|c| (c.device_type(), c.device_id()))
            .unwrap_or((ArrowDeviceType::CPU, 0));
        let d = dl_device(t, id);
        (d.device_type, d.device_id)
    }
}

fn typestr(dtype: DLDataType) -> String {
    let kind = match dtype.code {
        dlpack::DL_INT => 'i',
        dlpack::DL_UINT => 'u',
        _ => 'f',
    };
    format!("<{kind}{}", dtype.bits / 8)
}

#[pymethods]
impl PyDeviceColumn {
    /// The column's name.
    #[getter]
    fn name(&self) -> String {
        self.field().name().clone()
    }

    /// The Arrow data type, as arrow-rs writes it (``Int64``, ``Utf8``, ...).
    #[getter]
    fn arrow_type(&self) -> String {
        self.field().data_type().to_string()
    }

    /// The number of nulls (None when devarrow cannot tell without reading the bitmap).
    #[getter]
    fn null_count(&self) -> Option<usize> {
        self.batch.column(self.index).and_then(|c| c.null_count())
    }

    /// The device's id (``"cpu"``, ``"cuda:0"``).
    #[getter]
    fn device(&self) -> &str {
        self.inner.id()
    }

    fn __len__(&self) -> usize {
        self.batch.column(self.index).map_or(0, |c| c.len())
    }

    /// The validity bitmap as a :class:`DeviceBitmap` (DLPack-able ``uint8`` bytes), or
    /// None when the column has no bitmap (no nulls).
    #[getter]
    fn validity(&self) -> Option<PyDeviceBitmap> {
        let column = self.batch.column(self.index)?;
        let buffer = column.validity()?;
        let offset = column.offset();
        let bit_offset = offset % 8;
        Some(PyDeviceBitmap {
            view: View {
                batch: self.batch.clone(),
                address: buffer.address() + (offset / 8) as u64,
                len: (bit_offset + column.len()).div_ceil(8),
                dtype: DLDataType {
                    code: dlpack::DL_UINT,
                    bits: 8,
                    lanes: 1,
                },
                device: dl_device(column.device_type(), column.device_id()),
            },
            inner: self.inner.clone(),
            bit_offset,
            length: column.len(),
        })
    }

    /// ``(device_type, device_id)`` per DLPack (``kDLCPU`` = 1, ``kDLCUDA`` = 2, ...).
    fn __dlpack_device__(&self) -> (i32, i32) {
        self.device_pair()
    }

    /// A DLPack capsule of the values (``dltensor_versioned`` when ``max_version`` is at
    /// least ``(1, 0)``, else ``dltensor``), zero-copy. On CUDA the consumer's ``stream``
    /// waits on the batch's event (None: the calling thread's per-thread default stream,
    /// which the legacy default stream waits for too, rather than a command on the legacy
    /// default stream, which would synchronize the device; 1: the legacy default stream;
    /// -1: no wait).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let view = self.values_view()?;
        dlpack_capsule(py, &self.inner, view, stream, max_version, dl_device, copy)
    }

    /// The CUDA Array Interface (version 3) of the values, on CUDA only; its ``stream``
    /// is devarrow's stream, on which the data is ready.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let Some(cuda) = self.inner.selected.cuda.as_ref() else {
            return Err(PyAttributeError::new_err(
                "__cuda_array_interface__: the column is not on a CUDA device",
            ));
        };
        let view = self.values_view()?;
        let dict = PyDict::new(py);
        dict.set_item("shape", (view.len,))?;
        dict.set_item("typestr", typestr(view.dtype))?;
        dict.set_item("data", (view.address, false))?;
        dict.set_item("strides", py.None())?;
        dict.set_item("version", 3)?;
        dict.set_item("stream", cuda.stream().cu_stream() as usize)?;
        Ok(dict)
    }

    fn __repr__(&self) -> String {
        format!(
            "devarrow.DeviceColumn({:?}: {}, {} rows, on {})",
            self.name(),
            self.arrow_type(),
            self.__len__(),
            self.inner.id()
        )
    }
}

/// The validity bitmap of a :class:`DeviceColumn`, on the device: DLPack-able as
/// ``uint8`` bytes (LSB first, Arrow's order); row ``i`` is bit ``bit_offset + i``.
#[pyclass(name = "DeviceBitmap", module = "devarrow", frozen)]
#[derive(Debug)]
pub struct PyDeviceBitmap {
    view: View,
    inner: Arc<DeviceInner>,
    bit_offset: usize,
    length: usize,
}

#[pymethods]
impl PyDeviceBitmap {
    /// The bit of row 0 in the first byte.
    #[getter]
    fn bit_offset(&self) -> usize {
        self.bit_offset
    }

    /// Rows (bits) covered.
    #[getter]
    fn length(&self) -> usize {
        self.length
    }

    /// Bytes of the DLPack tensor.
    fn __len__(&self) -> usize {
        self.view.len
    }

    /// ``(device_type, device_id)`` per DLPack.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (self.view.device.device_type, self.view.device.device_id)
    }

    /// A DLPack capsule of the bitmap's bytes (see :meth:`DeviceColumn.__dlpack__`).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let view = self.view.clone();
        dlpack_capsule(py, &self.inner, view, stream, max_version, dl_device, copy)
    }

    fn __repr__(&self) -> String {
        format!(
            "devarrow.DeviceBitmap({} rows from bit {}, {} bytes)",
            self.length, self.bit_offset, self.view.len
        )
    }
}
