//! `devarrow.device(...)`: a device opened by devarrow's `select_device`, with the
//! reason it was chosen, and the uploads to it (`Device.to_device`).

use std::sync::Arc;

use arrow_array::{RecordBatch, RecordBatchReader};
use arrow_schema::ffi::FFI_ArrowSchema;
use devarrow::abi::{ArrowDeviceType, DeviceArray};
use devarrow::bridge::{StageTimes, StreamOptions, Uploader};
use devarrow::DeviceRequest;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::batch::PyDeviceBatch;
use crate::capsule;
use crate::errors::{IntoPy, UnsupportedTypeError};
use crate::opened::{open, DeviceInner};
use crate::stream::PyDeviceStream;

/// One device in devarrow's grammar of device strings (`DeviceRequest`'s `FromStr`, see
/// `devarrow::DeviceSpec`); a list or `cuda:all` is refused: a `Device` is one device.
fn parse(spec: &str) -> PyResult<DeviceRequest> {
    spec.parse()
        .map_err(|e| PyValueError::new_err(format!("device {spec:?}: {e}")))
}

/// A device devarrow moves Arrow data to: the CPU device or a CUDA GPU.
///
/// Made by :func:`devarrow.device`. ``id`` names it (``"cpu"``, ``"cuda:0"``) and
/// ``reason`` says why it was chosen.
#[pyclass(name = "Device", module = "devarrow", frozen)]
#[derive(Debug)]
pub struct PyDevice {
    pub inner: Arc<DeviceInner>,
    reason: String,
}

/// Opens a device: ``"auto"`` (CUDA device 0 when it opens, else the CPU device, saying
/// why), ``"cpu"``, ``"cuda"`` (device 0) or ``"cuda:N"``, in any case, spaces around
/// ignored (the grammar of the ``devarrow`` command's ``--device``). A list
/// (``"cuda:0,1"``) or ``"cuda:all"`` names several devices and raises ``ValueError``:
/// open each device on its own. Any other string raises ``ValueError`` saying what is
/// accepted. An explicit CUDA device that does not open raises
/// :class:`DeviceUnavailableError` with the reason.
#[pyfunction]
#[pyo3(signature = (spec = "auto"))]
pub fn device(py: Python<'_>, spec: &str) -> PyResult<PyDevice> {
    let request = parse(spec)?;
    let (inner, reason) = py.detach(|| open(request))?;
    Ok(PyDevice { inner, reason })
}

/// The C structs of a record batch (an object with ``__arrow_c_array__``), taken from
/// its capsules (with the GIL); [`import_host_batch`](crate::host::import_host_batch)
/// imports them (without).
fn take_record_batch(obj: &Bound<'_, PyAny>) -> PyResult<(DeviceArray, FFI_ArrowSchema)> {
    let pair = obj.call_method1("__arrow_c_array__", (obj.py().None(),))?;
    let (schema, array): (Bound<'_, PyAny>, Bound<'_, PyAny>) = pair.extract()?;
    let schema = capsule::take_schema(&schema)?;
    let array = capsule::take_array(&array)?;
    if schema.format() != "+s" {
        return Err(UnsupportedTypeError::new_err(format!(
            "to_device takes a record batch (a struct array), got an array of format {:?}; \
             wrap it in a RecordBatch or a Table",
            schema.format()
        )));
    }
    // SAFETY: the array comes from an `arrow_array` capsule of a producer of the C data
    // interface (host memory, no event), as DeviceArray::from_ffi requires for the CPU.
    let array =
        unsafe { DeviceArray::from_ffi(array, ArrowDeviceType::CPU, 0, std::ptr::null_mut()) }
            .py()?;
    Ok((array, schema))
}

/// Imports taken record batches, in order, on rayon's global pool: the checks read
/// every offset (and, when `validate`, every string), so a table's batches are checked in
/// parallel.
fn import_host_batches(
    taken: Vec<(DeviceArray, FFI_ArrowSchema)>,
    validate: bool,
) -> devarrow::abi::Result<Vec<RecordBatch>> {
    use rayon::prelude::*;
    if taken.len() <= 1 {
        return taken
            .into_iter()
            .map(|(array, schema)| crate::host::import_host_batch(array, &schema, validate))
            .collect();
    }
    // On rayon's global pool (where the upload then packs), in order; an import catches
    // arrow-rs's panics itself (`cpu`). Starting a thread per call cost more than a
    // small batch's import.
    taken
        .into_par_iter()
        .map(|(array, schema)| crate::host::import_host_batch(array, &schema, validate))
        .collect()
}

/// A `Send` wrapper of a foreign C stream reader.
struct SendReader(arrow_array::ffi_stream::RecordBatchStreamReader);

impl Iterator for SendReader {
    type Item = Result<RecordBatch, arrow_schema::ArrowError>;
    fn next(&mut self) -> Option<Self::Item> {
        self.0.next()
    }
}

impl RecordBatchReader for SendReader {
    fn schema(&self) -> arrow_schema::SchemaRef {
        self.0.schema()
    }
}

#[pymethods]
impl PyDevice {
    /// ``"cpu"`` or ``"cuda:N"``.
    #[getter]
    fn id(&self) -> &str {
        self.inner.id()
    }

    /// ``"cpu"`` or ``"cuda"``.
    #[getter]
    fn kind(&self) -> &str {
        if self.inner.selected.cuda.is_some() {
            "cuda"
        } else {
            "cpu"
        }
    }

    /// The GPU's name, or ``"CPU device"``.
    #[getter]
    fn name(&self) -> &str {
        &self.inner.selected.name
    }

    /// Why this device: ``"as asked"``, or for ``"auto"`` what opened or why it fell
    /// back to the CPU device (no driver, no device, ...).
    #[getter]
    fn reason(&self) -> &str {
        &self.reason
    }

    /// The machine's CUDA devices in one line, or why there are none.
    #[getter]
    fn cuda_summary(&self) -> String {
        match &self.inner.selected.cuda_summary {
            Ok(s) => s.clone(),
            Err(why) => format!("no CUDA device: {why}"),
        }
    }

    /// Bytes of CUDA device memory devarrow's live buffers hold on this device (its exact
    /// count); ``None`` on the CPU device.
    fn memory_in_use(&self) -> Option<u64> {
        self.inner
            .selected
            .cuda
            .as_ref()
            .map(|cuda| devarrow::cuda::memory_stats(cuda.primary_context().id()).live_bytes)
    }

    /// What this device's transfers did since the device was opened (or since the last
    /// call with ``reset=True``): a dict of ``pinned_downloads`` and
    /// ``pageable_downloads`` (batches brought back, by where they landed: pinned memory
    /// the device copies into directly, or pageable memory through staging),
    /// ``host_memory_note`` (why downloads landed in pageable memory, or None), and
    /// ``to_device`` / ``to_host``: the host seconds of each stage, with ``batches`` and
    /// ``bytes``.
    #[pyo3(signature = (*, reset = false))]
    fn transfer_stats<'py>(&self, py: Python<'py>, reset: bool) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.inner.clone();
        let (stats, note) = py.detach(move || {
            let mut transfer = inner.transfer();
            let stats = if reset {
                transfer.take_stats()
            } else {
                transfer.stats()
            };
            (stats, transfer.host_memory_note().map(str::to_string))
        });
        let stages = |times: StageTimes| -> PyResult<Bound<'py, PyDict>> {
            let dict = PyDict::new(py);
            for (name, time) in times.stages() {
                dict.set_item(name, time.as_secs_f64())?;
            }
            dict.set_item("batches", times.batches)?;
            dict.set_item("bytes", times.bytes)?;
            Ok(dict)
        };
        let dict = PyDict::new(py);
        dict.set_item("pinned_downloads", stats.pinned_downloads)?;
        dict.set_item("pageable_downloads", stats.pageable_downloads)?;
        dict.set_item("host_memory_note", note)?;
        dict.set_item("to_device", stages(stats.to_device)?)?;
        dict.set_item("to_host", stages(stats.to_host)?)?;
        Ok(dict)
    }

    /// Uploads Arrow data to this device.
    ///
    /// ``obj`` with ``__arrow_c_array__`` (a record batch: pyarrow, polars, nanoarrow,
    /// ...) gives a :class:`DeviceBatch`; with ``__arrow_c_stream__`` (a table, a
    /// reader) a :class:`DeviceStream` that uploads ``read_ahead`` batches ahead of its
    /// consumer on a background thread. The GIL is released while data moves.
    ///
    /// A record batch is checked before it moves (its structure, offsets, views,
    /// dictionary keys: a malformed one raises :class:`InvalidArrayError`), but not that
    /// its strings are UTF-8, as pyarrow trusts its producers; ``validate=True`` checks
    /// that too (it reads every string, most of an import's cost).
    #[pyo3(signature = (obj, *, read_ahead = 2, validate = false))]
    fn to_device(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        read_ahead: usize,
        validate: bool,
    ) -> PyResult<Py<PyAny>> {
        if obj.hasattr("__arrow_c_array__")? {
            let (array, schema) = take_record_batch(obj)?;
            let batch = py
                .detach(move || crate::host::import_host_batch(array, &schema, validate))
                .py()?;
            let inner = self.inner.clone();
            let on_device = py.detach(|| inner.transfer().to_device(&batch)).py()?;
            let batch = PyDeviceBatch::new(on_device, self.inner.clone());
            return Ok(Py::new(py, batch)?.into_any());
        }
        if obj.hasattr("__arrow_c_stream__")? {
            let stream = obj.call_method1("__arrow_c_stream__", (py.None(),))?;
            let reader = capsule::take_stream(&stream)?;
            let reader = Box::new(SendReader(reader));
            let options = StreamOptions::default().with_read_ahead(read_ahead);
            let device = self.inner.selected.device.clone();
            let uploader = py
                .detach(|| Uploader::spawn(reader, device, options))
                .py()?;
            let stream = PyDeviceStream::new(uploader, self.inner.clone());
            return Ok(Py::new(py, stream)?.into_any());
        }
        Err(PyTypeError::new_err(format!(
            "to_device takes an object with __arrow_c_array__ (a record batch) or \
             __arrow_c_stream__ (a table, a reader); got {}",
            obj.get_type().name()?
        )))
    }

    /// Uploads many record batches in one call: a list of :class:`DeviceBatch`, in order.
    ///
    /// ``batches`` is an iterable of objects with ``__arrow_c_array__`` (record batches),
    /// or one object with ``__arrow_c_stream__`` (a table, a reader), read to its end.
    /// The batches move as one pipeline (devarrow's ``Transfer::to_device_batches``:
    /// packing on worker threads overlaps the copies, no wait between batches), the
    /// fastest way to move a table; ``to_device`` of each batch in turn waits for
    /// nothing either, but packs and copies one batch at a time. The GIL is released
    /// while data moves. ``validate`` as for ``to_device``.
    #[pyo3(signature = (batches, *, validate = false))]
    fn to_device_batches(
        &self,
        py: Python<'_>,
        batches: &Bound<'_, PyAny>,
        validate: bool,
    ) -> PyResult<Vec<PyDeviceBatch>> {
        let host: Vec<RecordBatch> = if batches.hasattr("__arrow_c_stream__")? {
            let stream = batches.call_method1("__arrow_c_stream__", (py.None(),))?;
            let reader = capsule::take_stream(&stream)?;
            py.detach(move || reader.collect::<Result<Vec<_>, _>>())
                .map_err(|e| crate::errors::to_py(e.into()))?
        } else {
            let mut taken = Vec::new();
            for item in batches.try_iter().map_err(|_| {
                PyTypeError::new_err(format!(
                    "to_device_batches takes an iterable of record batches \
                     (__arrow_c_array__) or an object with __arrow_c_stream__; got {}",
                    batches
                        .get_type()
                        .name()
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                ))
            })? {
                let item = item?;
                if !item.hasattr("__arrow_c_array__")? {
                    return Err(PyTypeError::new_err(format!(
                        "to_device_batches: item {} has no __arrow_c_array__ (got {})",
                        taken.len(),
                        item.get_type().name()?
                    )));
                }
                taken.push(take_record_batch(&item)?);
            }
            py.detach(move || import_host_batches(taken, validate))
                .py()?
        };
        let inner = self.inner.clone();
        let on_device = py
            .detach(|| inner.transfer().to_device_batches(&host))
            .py()?;
        Ok(on_device
            .into_iter()
            .map(|b| PyDeviceBatch::new(b, self.inner.clone()))
            .collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "devarrow.Device({:?}, name={:?}, reason={:?})",
            self.inner.id(),
            self.inner.selected.name,
            self.reason
        )
    }
}
