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

The round trip, and a column handed on through DLPack::

    import devarrow, numpy as np, pyarrow as pa

    dev = devarrow.device("auto")            # CUDA device 0 when one opens, else the CPU
    batch = pa.record_batch({"x": pa.array([1, 2, 3], pa.int64()), "s": ["a", None, "c"]})

    on_device = dev.to_device(batch)         # a DeviceBatch: the batch in dev's memory
    back = devarrow.from_device(on_device)   # a pyarrow.RecordBatch in host memory again
    assert back.equals(batch)

    x = on_device.column("x")                # a DeviceColumn (by name or index), zero-copy
    if dev.kind == "cpu":
        np.from_dlpack(x)                    # array([1, 2, 3])
    else:                                    # on CUDA, a GPU library takes it, its stream
        import torch                         # made to wait on the batch's event:
        torch.from_dlpack(x)                 # (or cupy.from_dlpack(x))

Many batches move faster in one call each way: ``dev.to_device_batches(batches)`` and
``devarrow.from_device_batches(on_device)``. A column's validity bitmap, when it has
one, is ``column.validity`` (a :class:`DeviceBitmap`, DLPack too). Only columns of
fixed-width numbers (integers, floats, dates, times, timestamps, durations) are DLPack
tensors: ``__dlpack__`` of any other column (strings, booleans, nested types,
dictionaries, decimals) raises :class:`UnsupportedTypeError` saying why.
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
