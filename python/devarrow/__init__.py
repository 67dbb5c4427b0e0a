"""devarrow: Arrow data on a GPU and back, from Python.

The Python face of devarrow (https://github.com/devarrow/devarrow), the Apache Arrow C
Device Data Interface on CUDA in Rust:

- :func:`device` opens a device (``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``) and
  says why it chose it;
- :meth:`Device.to_device` uploads anything with ``__arrow_c_array__`` (a record batch
  of pyarrow, polars, nanoarrow, ...) as a :class:`DeviceBatch`, and anything with
  ``__arrow_c_stream__`` (a table, a reader) as a :class:`DeviceStream` that uploads
  ahead of its consumer; :meth:`Device.to_device_batches` uploads many batches in one
  call, pipelined (the fastest way to move a table);
- a :class:`DeviceBatch` is an Arrow device array (``__arrow_c_device_array__``) and
  its fixed-width columns are DLPack tensors (:meth:`DeviceBatch.column`);
- :func:`from_device` downloads anything with ``__arrow_c_device_array__`` or
  ``__arrow_c_device_stream__`` to pyarrow; :func:`from_device_batches` downloads many
  in one call.

Errors are :class:`DevarrowError` subclasses. The GIL is released while data moves.
"""

from ._devarrow import (
    DLPACK_VERSION,
    GIT_COMMIT,
    Device,
    DeviceBatch,
    DeviceBitmap,
    DeviceColumn,
    DeviceError,
    DeviceMismatchError,
    DeviceStream,
    DeviceUnavailableError,
    DevarrowError,
    InvalidArrayError,
    ReleasedError,
    SchemaMismatchError,
    UnsupportedDeviceError,
    UnsupportedTypeError,
    __version__,
    device,
    from_device,
    from_device_batches,
)

__all__ = [
    "DLPACK_VERSION",
    "GIT_COMMIT",
    "Device",
    "DeviceBatch",
    "DeviceBitmap",
    "DeviceColumn",
    "DeviceError",
    "DeviceMismatchError",
    "DeviceStream",
    "DeviceUnavailableError",
    "DevarrowError",
    "InvalidArrayError",
    "ReleasedError",
    "SchemaMismatchError",
    "UnsupportedDeviceError",
    "UnsupportedTypeError",
    "__version__",
    "device",
    "from_device",
    "from_device_batches",
]
