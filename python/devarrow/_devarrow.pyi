"""Type stubs of devarrow's extension module (``devarrow._devarrow``)."""

from typing import Any, Iterable, Iterator, Optional, Tuple, Union

import pyarrow

DLPACK_VERSION: Tuple[int, int]
GIT_COMMIT: str
__version__: str

class DevarrowError(Exception):
    """The base class of every error devarrow raises."""

class ReleasedError(DevarrowError):
    """A C struct (a capsule's) was already released or consumed, or a DeviceStream was
    handed to a consumer."""

class DeviceMismatchError(DevarrowError):
    """The data lives on another device of the same type."""

class UnsupportedDeviceError(DevarrowError):
    """The data lives on a device type this call does not accept."""

class DeviceUnavailableError(DevarrowError):
    """The device asked for does not open; the message says why."""

class UnsupportedTypeError(DevarrowError):
    """The operation does not support the data's type (e.g. DLPack of strings)."""

class SchemaMismatchError(DevarrowError):
    """A requested_schema devarrow cannot honour (it does not cast)."""

class InvalidArrayError(DevarrowError):
    """A foreign array or schema is malformed."""

class DeviceError(DevarrowError):
    """The device failed (a CUDA error, out of memory, a failed copy)."""

def device(spec: str = "auto") -> Device:
    """Opens ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""

def from_device(obj: Any) -> Union[pyarrow.RecordBatch, pyarrow.RecordBatchReader]:
    """Downloads an ``__arrow_c_device_array__`` (to a RecordBatch) or an
    ``__arrow_c_device_stream__`` (to a RecordBatchReader) to host memory."""

def from_device_batches(batches: Iterable[Any]) -> list[pyarrow.RecordBatch]:
    """Downloads many ``__arrow_c_device_array__`` objects in one call, in order."""

def _capsule_counts() -> Tuple[int, int, int]: ...

class Device:
    @property
    def id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def cuda_summary(self) -> str: ...
    def memory_in_use(self) -> Optional[int]: ...
    def to_device(
        self, obj: Any, *, read_ahead: int = 2, validate: bool = False
    ) -> Union[DeviceBatch, DeviceStream]:
        """A DeviceBatch for ``__arrow_c_array__``, a DeviceStream for
        ``__arrow_c_stream__``."""
    def to_device_batches(self, batches: Any, *, validate: bool = False) -> list[DeviceBatch]:
        """Uploads an iterable of record batches (or a whole ``__arrow_c_stream__``)
        in one pipelined call, in order."""
    def transfer_stats(self, *, reset: bool = False) -> dict[str, Any]:
        """What this device's transfers did: ``pinned_downloads``,
        ``pageable_downloads``, ``host_memory_note``, and per direction (``to_device``,
        ``to_host``) the host seconds of each stage, ``batches`` and ``bytes``."""

class DeviceBatch:
    @property
    def num_rows(self) -> int: ...
    @property
    def num_columns(self) -> int: ...
    @property
    def column_names(self) -> list[str]: ...
    @property
    def device(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def schema(self) -> pyarrow.Schema: ...
    def __arrow_c_schema__(self) -> object: ...
    def __arrow_c_device_array__(
        self, requested_schema: Optional[object] = None, **kwargs: Any
    ) -> Tuple[object, object]: ...
    def for_libcudf(self, *, widen_small_decimals: bool = False) -> DeviceBatch:
        """The batch in libcudf's dialect (what ``cudf::from_arrow_device`` views
        zero-copy), converted on the device."""
    def synchronize(self) -> None:
        """Blocks until the batch's data is on its device (the GIL released)."""
    def to_host(self) -> pyarrow.RecordBatch: ...
    def to_pyarrow(self) -> pyarrow.RecordBatch: ...
    def column(self, key: Union[int, str]) -> DeviceColumn: ...
    def __len__(self) -> int: ...

class _DLPack:
    """(Typing only) the DLPack protocol of DeviceColumn and DeviceBitmap."""

    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> object: ...

class DeviceColumn(_DLPack):
    @property
    def name(self) -> str: ...
    @property
    def arrow_type(self) -> str: ...
    @property
    def null_count(self) -> Optional[int]: ...
    @property
    def device(self) -> str: ...
    @property
    def validity(self) -> Optional[DeviceBitmap]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

class DeviceBitmap(_DLPack):
    @property
    def bit_offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    def __len__(self) -> int: ...

class DeviceStream:
    @property
    def schema(self) -> pyarrow.Schema: ...
    @property
    def device(self) -> str: ...
    def __arrow_c_schema__(self) -> object: ...
    def __arrow_c_device_stream__(
        self, requested_schema: Optional[object] = None, **kwargs: Any
    ) -> object: ...
    def to_host(self) -> pyarrow.RecordBatchReader: ...
    def __iter__(self) -> Iterator[DeviceBatch]: ...
    def __next__(self) -> DeviceBatch: ...
