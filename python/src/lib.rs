//! `devarrow._devarrow`: the Python bindings of devarrow (PyO3, abi3), re-exported by
//! the `devarrow` Python package (`python/devarrow/__init__.py`).
//!
//! They wrap devarrow's public Rust API only: `select_device` (`device.rs`), the
//! bridge's `Transfer`, `DeviceBatch` export/import and upload streams (`batch.rs`,
//! `stream.rs`, `host.rs`), over the Arrow PyCapsule interface (`capsule.rs`) and
//! DLPack (`dlpack.rs`); errors become typed exceptions (`errors.rs`). Every transfer
//! runs with the GIL released. Every C struct handed to Python is released exactly once,
//! by its consumer or by its capsule's destructor, and no callback unwinds into C.

use pyo3::prelude::*;

mod batch;
mod capsule;
mod device;
mod dlpack;
mod errors;
mod from_device;
mod host;
mod opened;
mod stream;

/// Counts of the Arrow PyCapsules devarrow made in this process: ``(created,
/// destroyed after a consumer took the struct, destroyed releasing the struct)``. For
/// tests: once every capsule is gone, ``created == consumed + released``.
#[pyfunction]
fn _capsule_counts() -> (u64, u64, u64) {
    capsule::counts()
}

/// devarrow's extension module: Arrow data on a GPU and back. Use it through the
/// ``devarrow`` package, which re-exports it and documents the round trip
/// (``Device.to_device``, ``devarrow.from_device``) and the DLPack hand-off
/// (``DeviceBatch.column(...).__dlpack__``).
#[pymodule]
fn _devarrow(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(device::device, m)?)?;
    m.add_function(wrap_pyfunction!(from_device::from_device, m)?)?;
    m.add_function(wrap_pyfunction!(from_device::from_device_batches, m)?)?;
    m.add_function(wrap_pyfunction!(_capsule_counts, m)?)?;
    m.add_class::<device::PyDevice>()?;
    m.add_class::<batch::PyDeviceBatch>()?;
    m.add_class::<batch::PyDeviceColumn>()?;
    m.add_class::<batch::PyDeviceBitmap>()?;
    m.add_class::<stream::PyDeviceStream>()?;
    m.add("DevarrowError", py.get_type::<errors::DevarrowError>())?;
    m.add("ReleasedError", py.get_type::<errors::ReleasedError>())?;
    m.add(
        "DeviceMismatchError",
        py.get_type::<errors::DeviceMismatchError>(),
    )?;
    m.add(
        "UnsupportedDeviceError",
        py.get_type::<errors::UnsupportedDeviceError>(),
    )?;
    m.add(
        "DeviceUnavailableError",
        py.get_type::<errors::DeviceUnavailableError>(),
    )?;
    m.add(
        "UnsupportedTypeError",
        py.get_type::<errors::UnsupportedTypeError>(),
    )?;
    m.add(
        "SchemaMismatchError",
        py.get_type::<errors::SchemaMismatchError>(),
    )?;
    m.add(
        "InvalidArrayError",
        py.get_type::<errors::InvalidArrayError>(),
    )?;
    m.add("DeviceError", py.get_type::<errors::DeviceError>())?;
    m.add("DLPACK_VERSION", dlpack::VERSION)?;
    m.add("GIT_COMMIT", devarrow::GIT_COMMIT)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
