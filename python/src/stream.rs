//! `DeviceStream`: a table or reader uploading to a device ahead of its consumer
//! (devarrow's `Uploader`), iterated as `DeviceBatch`es or handed over as an
//! `ArrowDeviceArrayStream`.

use std::sync::{Arc, Mutex, PoisonError};

use arrow_schema::SchemaRef;
use devarrow::abi::stream::export_stream;
use devarrow::bridge::Uploader;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::batch::{check_kwargs, check_requested, PyDeviceBatch};
use crate::capsule;
use crate::errors::{IntoPy, ReleasedError};
use crate::host;
use crate::opened::DeviceInner;

/// Batches of a table or reader, uploaded to a device on a background thread at most
/// ``read_ahead`` batches ahead of the consumer (back-pressure beyond that).
///
/// Iterate it for :class:`DeviceBatch` es, or hand it to a consumer of the Arrow
/// PyCapsule device stream interface (``__arrow_c_device_stream__``; the stream is then
/// consumed: later use raises :class:`ReleasedError`).
#[pyclass(name = "DeviceStream", module = "devarrow", frozen)]
#[derive(Debug)]
pub struct PyDeviceStream {
    uploader: Mutex<Option<Uploader>>,
    schema: SchemaRef,
    inner: Arc<DeviceInner>,
}

impl PyDeviceStream {
    pub fn new(uploader: Uploader, inner: Arc<DeviceInner>) -> Self {
        Self {
            schema: uploader.schema(),
            uploader: Mutex::new(Some(uploader)),
            inner,
        }
    }

    fn take(&self) -> Option<Uploader> {
        self.uploader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl Drop for PyDeviceStream {
    fn drop(&mut self) {
        // Stopping the background thread waits for it, and it may be in the source's
        // `get_next`, which for a Python-backed reader needs the GIL: wait without it.
        if let Some(uploader) = self.take() {
            Python::attach(|py| py.detach(move || drop(uploader)));
        }
    }
}

fn consumed() -> PyErr {
    ReleasedError::new_err("this DeviceStream was handed to a consumer (__arrow_c_device_stream__)")
}

#[pymethods]
impl PyDeviceStream {
    /// The schema as a ``pyarrow.Schema`` (needs pyarrow).
    #[getter]
    fn schema<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        host::schema_to_pyarrow(py, &self.schema)
    }

    /// The schema as an ``arrow_schema`` PyCapsule.
    fn __arrow_c_schema__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        host::schema_capsule(py, &self.schema)
    }

    /// The device's id (``"cpu"``, ``"cuda:0"``).
    #[getter]
    fn device(&self) -> &str {
        self.inner.id()
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next uploaded batch (waits for its upload to be enqueued, without the GIL).
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<PyDeviceBatch>> {
        let next = py.detach(|| {
            let mut guard = self.uploader.lock().unwrap_or_else(PoisonError::into_inner);
            guard.as_mut().map(|u| u.next_batch())
        });
        match next {
            None => Err(consumed()),
            Some(result) => Ok(result
                .py()?
                .map(|batch| PyDeviceBatch::new(batch, self.inner.clone()))),
        }
    }

    /// Hands the stream over as an ``arrow_device_array_stream`` PyCapsule (an
    /// ``ArrowDeviceArrayStream`` of the device's type; each array's ``sync_event``
    /// marks its upload). ``requested_schema`` may be None or the stream's own schema.
    #[pyo3(signature = (requested_schema = None, **kwargs))]
    fn __arrow_c_device_stream__<'py>(
        &self,
        py: Python<'py>,
        requested_schema: Option<&Bound<'py, PyAny>>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        check_kwargs(kwargs)?;
        check_requested(requested_schema, &self.schema)?;
        let uploader = self.take().ok_or_else(consumed)?;
        let stream = export_stream(uploader);
        capsule::new(py, capsule::RawDeviceStream(stream.into_raw()))
    }

    /// Downloads every remaining batch: a ``pyarrow.RecordBatchReader`` (consumes the
    /// stream).
    fn to_host<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let uploader = self.take().ok_or_else(consumed)?;
        host::device_stream_to_pyarrow(py, export_stream(uploader))
    }

    fn __repr__(&self) -> String {
        let state = if self
            .uploader
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
        {
            "open"
        } else {
            "consumed"
        };
        format!(
            "devarrow.DeviceStream({} columns, on {}, {state})",
            self.schema.fields().len(),
            self.inner.id()
        )
    }
}
