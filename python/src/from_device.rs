//! `devarrow.from_device` and `devarrow.from_device_batches`: Arrow device data (devarrow's
//! own `DeviceBatch`es, or any producer's) downloaded to pyarrow.

use std::sync::Arc;

use arrow_array::RecordBatch;
use devarrow::abi::ArrowDeviceType;
use devarrow::bridge::DeviceBatch;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::batch::PyDeviceBatch;
use crate::capsule;
use crate::errors::IntoPy;
use crate::host::{batch_to_pyarrow, device_stream_to_pyarrow, download, import_host_batch};
use crate::opened;

/// Downloads Arrow device data to pyarrow.
///
/// ``obj`` with ``__arrow_c_device_array__`` (a devarrow ``DeviceBatch``, a pyarrow
/// ``RecordBatch``, a nanoarrow device array, ...) gives a ``pyarrow.RecordBatch``;
/// with ``__arrow_c_device_stream__`` a ``pyarrow.RecordBatchReader`` that downloads
/// batch by batch. The import is zero-copy and waits on the producer's ``sync_event``
/// (on the GPU: devarrow's stream waits on it); CPU data is not copied at all, device
/// data is copied once, to host memory. The GIL is released while data moves.
#[pyfunction]
pub fn from_device<'py>(py: Python<'py>, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(own) = obj.cast::<PyDeviceBatch>() {
        let own = own.get();
        if own.inner.selected.device.device_type() != ArrowDeviceType::CPU {
            // devarrow's own batch: downloaded as the batch it is (its tree planned by
            // devarrow), not exported and imported as a foreign array
            let batch = download(py, &own.inner, &own.batch)?;
            return batch_to_pyarrow(py, &batch);
        }
    }
    if obj.hasattr("__arrow_c_device_array__")? {
        let pair = obj.call_method1("__arrow_c_device_array__", (py.None(),))?;
        let (schema, array): (Bound<'_, PyAny>, Bound<'_, PyAny>) = pair.extract()?;
        let schema = capsule::take_schema(&schema)?;
        let array = capsule::take_device_array(&array)?;
        let batch = if array.device_type() == ArrowDeviceType::CPU {
            // host data is handed to pyarrow as it is: checked as an upload is
            py.detach(move || import_host_batch(array, &schema, false))
                .py()?
        } else {
            let inner = opened::for_arrays(array.device_type(), array.device_id())?;
            let device = inner.selected.device.clone();
            py.detach(move || {
                let batch = DeviceBatch::import_with_ffi_schema(device, array, &schema)?;
                inner.transfer().to_host(&batch)
            })
            .py()?
        };
        return batch_to_pyarrow(py, &batch);
    }
    if obj.hasattr("__arrow_c_device_stream__")? {
        let capsule = obj.call_method1("__arrow_c_device_stream__", (py.None(),))?;
        let stream = capsule::take_device_stream(&capsule)?;
        return device_stream_to_pyarrow(py, stream);
    }
    Err(PyTypeError::new_err(format!(
        "from_device takes an object with __arrow_c_device_array__ or \
         __arrow_c_device_stream__; got {}",
        obj.get_type().name()?
    )))
}

/// Downloads many device batches in one call: a list of ``pyarrow.RecordBatch``, in
/// order.
///
/// ``batches`` is an iterable of objects with ``__arrow_c_device_array__`` (devarrow's
/// ``DeviceBatch``es, or any producer's). Consecutive batches of one device move as one
/// pipeline (devarrow's ``Transfer::to_host_batches``: every copy enqueued, one wait for
/// all of them, into pinned host memory while its pool lasts), the fastest way to bring
/// a table back; ``from_device`` of each in turn waits for each. Host (CPU) arrays are
/// not copied. The GIL is released while data moves.
#[pyfunction]
pub fn from_device_batches<'py>(
    py: Python<'py>,
    batches: &Bound<'py, PyAny>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    /// A batch on the host, or one on a device (with the transfer that downloads it).
    enum Item {
        Host(RecordBatch),
        Device(DeviceBatch, Arc<opened::DeviceInner>),
    }
    let mut items = Vec::new();
    let iter = batches.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "from_device_batches takes an iterable of objects with              __arrow_c_device_array__; got {}",
            batches
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    for obj in iter {
        let obj = obj?;
        if let Ok(own) = obj.cast::<PyDeviceBatch>() {
            let own = own.get();
            if own.inner.selected.device.device_type() == ArrowDeviceType::CPU {
                // the CPU device's memory is host memory: handed over zero-copy, as
                // `from_device` hands it (through its export)
                let (array, schema) = own.batch.export().py()?;
                let batch = py
                    .detach(move || import_host_batch(array, &schema, false))
                    .py()?;
                items.push(Item::Host(batch));
            } else {
                items.push(Item::Device(own.batch.clone(), own.inner.clone()));
            }
            continue;
        }
        if !obj.hasattr("__arrow_c_device_array__")? {
            return Err(PyTypeError::new_err(format!(
                "from_device_batches: item {} has no __arrow_c_device_array__ (got {})",
                items.len(),
                obj.get_type().name()?
            )));
        }
        let pair = obj.call_method1("__arrow_c_device_array__", (py.None(),))?;
        let (schema, array): (Bound<'_, PyAny>, Bound<'_, PyAny>) = pair.extract()?;
        let schema = capsule::take_schema(&schema)?;
        let array = capsule::take_device_array(&array)?;
        if array.device_type() == ArrowDeviceType::CPU {
            let batch = py
                .detach(move || import_host_batch(array, &schema, false))
                .py()?;
            items.push(Item::Host(batch));
        } else {
            let inner = opened::for_arrays(array.device_type(), array.device_id())?;
            let device = inner.selected.device.clone();
            let batch = py
                .detach(move || DeviceBatch::import_with_ffi_schema(device, array, &schema))
                .py()?;
            items.push(Item::Device(batch, inner));
        }
    }
    let host = py
        .detach(move || {
            let mut host = Vec::with_capacity(items.len());
            let mut items = items.into_iter().peekable();
            while let Some(item) = items.next() {
                match item {
                    Item::Host(batch) => host.push(batch),
                    Item::Device(batch, inner) => {
                        // this batch and the following ones of the same device: one call
                        let mut run = vec![batch];
                        while let Some(Item::Device(_, next)) = items.peek() {
                            if !Arc::ptr_eq(next, &inner) {
                                break;
                            }
                            let Some(Item::Device(batch, _)) = items.next() else {
                                unreachable!("peeked a device batch")
                            };
                            run.push(batch);
                        }
                        host.extend(inner.transfer().to_host_batches(&run)?);
                    }
                }
            }
            Ok::<_, devarrow::abi::Error>(host)
        })
        .py()?;
    host.iter().map(|b| batch_to_pyarrow(py, b)).collect()
}
