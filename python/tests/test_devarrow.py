"""The devarrow Python package on the CPU device and (when one opens, e.g. the emulated
driver) on CUDA: uploads, downloads, the Arrow PyCapsule device interface with pyarrow
and nanoarrow, DLPack with NumPy, streams, errors and the release of every capsule."""

import concurrent.futures
import ctypes
import gc

import nanoarrow.device
import numpy as np
import pyarrow as pa
import pytest

import devarrow

FIXED_WIDTH = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float32", "float64"]


def slices(n):
    return [(0, n), (5, 20), (n - 1, 1), (3, 0), (0, 0)]


# --------------------------------------------------------------------------- devices

def test_device_says_what_it_opened_and_why():
    cpu = devarrow.device("cpu")
    assert (cpu.id, cpu.kind, cpu.reason) == ("cpu", "cpu", "as asked")
    auto = devarrow.device()
    assert auto.kind in ("cpu", "cuda")
    assert auto.reason.startswith("auto:"), auto.reason
    if auto.kind == "cpu":
        assert "CPU device" in auto.reason
    assert "devarrow.Device" in repr(auto)


def test_a_bad_device_spec_is_a_value_error():
    with pytest.raises(ValueError, match="cuda:N"):
        devarrow.device("gpu")


def test_device_strings_share_the_commands_grammar():
    # Case and surrounding spaces do not matter, as in `devarrow --device`.
    assert devarrow.device(" CPU ").kind == "cpu"
    # A Device is one device: lists and cuda:all (the command's) are refused.
    for several in ("cuda:0,1", "cuda:all"):
        with pytest.raises(ValueError, match="names several devices"):
            devarrow.device(several)
    with pytest.raises(ValueError, match="`x` is not a device number"):
        devarrow.device("cuda:x")


def test_a_missing_cuda_device_is_a_typed_error():
    with pytest.raises(devarrow.DeviceUnavailableError, match="cuda:4096"):
        devarrow.device("cuda:4096")
    assert issubclass(devarrow.DeviceUnavailableError, devarrow.DevarrowError)


# --------------------------------------------------------------------------- round trips

def test_every_type_round_trips(dev, batch, capsules_released):
    on_device = dev.to_device(batch)
    assert isinstance(on_device, devarrow.DeviceBatch)
    assert on_device.num_rows == batch.num_rows == len(on_device)
    assert on_device.device == dev.id
    assert on_device.schema == batch.schema
    assert on_device.column_names == batch.schema.names
    back = on_device.to_host()
    assert back.equals(batch)
    assert back.schema.metadata == batch.schema.metadata
    assert on_device.to_pyarrow().equals(batch)


@pytest.mark.parametrize("offset,length", slices(37))
def test_slices_round_trip(dev, batch, offset, length, capsules_released):
    part = batch.slice(offset, length)
    on_device = dev.to_device(part)
    assert on_device.num_rows == length
    assert on_device.to_host().equals(part)
    assert devarrow.from_device(on_device).equals(part)


def test_from_device_reads_devarrow_pyarrow_and_nanoarrow(dev, batch, capsules_released):
    on_device = dev.to_device(batch)
    assert devarrow.from_device(on_device).equals(batch)
    # pyarrow's own device array (CPU)
    assert devarrow.from_device(batch).equals(batch)
    # nanoarrow's device array: its view of devarrow's export, read back. Not the view
    # types: nanoarrow 0.9's re-export of a device array with variadic buffers crashes
    # (whoever produced it, pyarrow too).
    no_views = batch.drop_columns(["binary_view", "utf8_view"])
    na_array = nanoarrow.device.c_device_array(dev.to_device(no_views))
    assert na_array.device_type_id == (1 if dev.kind == "cpu" else 2)
    assert devarrow.from_device(na_array).equals(no_views)


def test_pyarrow_consumes_the_device_array_on_the_cpu(batch, capsules_released):
    on_device = devarrow.device("cpu").to_device(batch)
    assert pa.record_batch(on_device).equals(batch)
    schema, array = on_device.__arrow_c_device_array__()
    assert pa.RecordBatch._import_from_c_device_capsule(schema, array).equals(batch)


def test_nanoarrow_consumes_the_device_array(dev, batch, capsules_released):
    on_device = dev.to_device(batch)
    na_array = nanoarrow.device.c_device_array(on_device)
    assert na_array.device_id == (0 if dev.kind == "cuda" else -1)
    assert na_array.array.length == batch.num_rows
    assert na_array.schema.n_children == batch.num_columns


def test_for_libcudf_converts_on_the_device(dev, capsules_released):
    n = 100
    strings = [None if i % 5 == 0 else ("s%d" % i) * (i % 4) for i in range(n)]
    lists = [None if i % 7 == 0 else list(range(i % 4)) for i in range(n)]
    batch = pa.record_batch({
        "view": pa.array(strings, pa.string_view()),
        "list_view": pa.array(lists, pa.list_view(pa.int32())),
        "large_list": pa.array(lists, pa.large_list(pa.int64())),
        "fixed": pa.array([[i, i + 1] for i in range(n)], pa.list_(pa.int16(), 2)),
        "int": pa.array(range(n), pa.int64()),
    })
    on_device = dev.to_device(batch)
    converted = on_device.for_libcudf()
    assert isinstance(converted, devarrow.DeviceBatch)
    assert converted.schema.types == [pa.string(), pa.list_(pa.int32()), pa.list_(pa.int64()),
                                      pa.list_(pa.int16()), pa.int64()]
    back = converted.to_host()
    back.validate(full=True)
    for name in batch.schema.names:
        assert back.column(name).to_pylist() == batch.column(name).to_pylist(), name
    # pyarrow reads the converted device array like any other
    assert devarrow.from_device(converted).equals(back)


def test_for_libcudf_refuses_what_libcudf_refuses(dev):
    batch = pa.record_batch({"h": pa.array(np.ones(4, dtype=np.float16))})
    with pytest.raises(devarrow.UnsupportedTypeError, match="h: .*Float32"):
        dev.to_device(batch).for_libcudf()


def test_requested_schema(dev, batch, capsules_released):
    on_device = dev.to_device(batch)
    same = batch.schema.__arrow_c_schema__()
    schema, array = on_device.__arrow_c_device_array__(same)
    del schema, array
    other = pa.schema([("x", pa.int64())]).__arrow_c_schema__()
    with pytest.raises(devarrow.SchemaMismatchError, match="requested schema"):
        on_device.__arrow_c_device_array__(other)
    with pytest.raises(NotImplementedError):
        on_device.__arrow_c_device_array__(None, future_option=True)
    on_device.__arrow_c_device_array__(None, future_option=None)


def test_to_device_refuses_what_is_not_a_batch_or_a_stream(dev):
    with pytest.raises(TypeError, match="__arrow_c_array__"):
        dev.to_device([1, 2, 3])
    with pytest.raises(devarrow.UnsupportedTypeError, match="record batch"):
        dev.to_device(pa.array([1, 2, 3]))


# --------------------------------------------------------------------------- streams

def test_a_table_uploads_as_a_stream(dev, table, capsules_released):
    chunked = pa.Table.from_batches(table.combine_chunks().to_batches(max_chunksize=10))
    stream = dev.to_device(chunked, read_ahead=1)
    assert isinstance(stream, devarrow.DeviceStream)
    assert stream.schema == table.schema
    batches = list(stream)
    assert [b.num_rows for b in batches] == [10, 10, 10, 7]
    assert pa.Table.from_batches([b.to_host() for b in batches]).equals(chunked)


def test_a_stream_downloads_as_a_reader(dev, table, capsules_released):
    reader = pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=8))
    stream = dev.to_device(reader)
    back = devarrow.from_device(stream)
    assert isinstance(back, pa.RecordBatchReader)
    assert back.read_all().equals(table)
    with pytest.raises(devarrow.ReleasedError, match="consumer"):
        next(iter(stream))
    with pytest.raises(devarrow.ReleasedError):
        stream.__arrow_c_device_stream__()


def test_a_stream_to_host_and_to_pyarrow(dev, table, capsules_released):
    # (pyarrow 26 imports no device stream: devarrow's reader is the consumer here)
    assert dev.to_device(table).to_host().read_all().equals(table)


def test_a_stream_dropped_early_stops(dev, table, capsules_released):
    stream = dev.to_device(pa.Table.from_batches(table.to_batches(max_chunksize=4)))
    first = next(iter(stream))
    assert first.num_rows == 4
    del stream
    gc.collect()
    assert first.to_host().equals(table.slice(0, 4).combine_chunks().to_batches()[0])
    # an exported stream no consumer takes is released by its capsule
    capsule = dev.to_device(table).__arrow_c_device_stream__()
    del capsule


def test_many_batches_move_in_one_call_each_way(dev, table, capsules_released):
    batches = table.combine_chunks().to_batches(max_chunksize=10)
    on_device = dev.to_device_batches(batches)
    assert [b.num_rows for b in on_device] == [10, 10, 10, 7]
    assert all(isinstance(b, devarrow.DeviceBatch) and b.device == dev.id for b in on_device)
    back = devarrow.from_device_batches(on_device)
    assert all(isinstance(b, pa.RecordBatch) for b in back)
    assert pa.Table.from_batches(back).equals(pa.Table.from_batches(batches))
    # a table (__arrow_c_stream__) up, foreign device arrays and host arrays down
    assert pa.Table.from_batches(
        devarrow.from_device_batches(dev.to_device_batches(table))).equals(table)
    mixed = devarrow.from_device_batches([on_device[0], batches[1], on_device[2]])
    assert [b.equals(batches[i]) for i, b in enumerate(mixed)] == [True, True, True]
    assert dev.to_device_batches([]) == [] and devarrow.from_device_batches([]) == []


def test_downloads_beyond_the_devices_reserve_land_in_pinned_memory(dev, capsules_released):
    # A CUDA device reserves 128 MiB of pinned memory at open, and its transfer's staging
    # takes 64 MiB of it: 96 MB of downloads land in pinned memory only because opening
    # the device also made room for the transfer's download pool (Transfer::prepare).
    import numpy as np
    batches = [pa.record_batch({"x": pa.array(np.arange(4_000_000, dtype=np.int64) + i)})
               for i in range(3)]
    on_device = dev.to_device_batches(batches)
    for b in on_device:
        b.synchronize()  # returns once the upload is complete; no download
    before = dev.transfer_stats(reset=True)
    assert set(before) == {"pinned_downloads", "pageable_downloads", "host_memory_note",
                           "to_device", "to_host"}
    if dev.kind == "cuda":
        assert before["to_device"]["bytes"] >= 96_000_000
    back = devarrow.from_device_batches(on_device)
    assert [b.equals(batches[i]) for i, b in enumerate(back)] == [True] * 3
    stats = dev.transfer_stats()
    if dev.kind == "cuda":
        assert (stats["pinned_downloads"], stats["pageable_downloads"]) == (3, 0), \
            stats["host_memory_note"]
        assert stats["to_host"]["batches"] == 3
    del back, on_device


def test_many_batches_refuse_what_is_not_a_batch(dev, batch):
    with pytest.raises(TypeError, match="item 1 has no __arrow_c_array__"):
        dev.to_device_batches([batch, 3])
    with pytest.raises(TypeError, match="iterable"):
        dev.to_device_batches(3)
    with pytest.raises(TypeError, match="item 0 has no __arrow_c_device_array__"):
        devarrow.from_device_batches(["no"])


def test_strings_are_checked_for_utf8_on_request_and_structure_always(dev, capsules_released):
    def strings(offsets, data):
        arr = pa.Array.from_buffers(pa.string(), len(offsets) - 1,
                                    [None, pa.py_buffer(np.array(offsets, np.int32).tobytes()),
                                     pa.py_buffer(data)])
        return pa.RecordBatch.from_arrays([arr], ["s"])

    not_utf8 = strings([0, 2, 3], b"\xff\xfea")
    for up in (lambda b, **kw: dev.to_device(b, **kw),
               lambda b, **kw: dev.to_device_batches([b], **kw)[0]):
        # moved as bytes, as pyarrow trusts its producers
        back = devarrow.from_device(up(not_utf8))
        assert back.column(0).buffers()[2].to_pybytes()[:3] == b"\xff\xfea"
        with pytest.raises(devarrow.InvalidArrayError, match="(?i)utf-?8"):
            up(not_utf8, validate=True)
        # decreasing offsets are refused either way: they would read outside the data
        with pytest.raises(devarrow.InvalidArrayError, match="offsets decrease"):
            up(strings([0, 3, 2], b"abc"))


# --------------------------------------------------------------------------- DLPack

@pytest.mark.parametrize("offset,length", slices(37))
def test_numpy_reads_fixed_width_columns(batch, offset, length, capsules_released):
    part = batch.slice(offset, length)
    on_device = devarrow.device("cpu").to_device(part)
    for name in FIXED_WIDTH + ["float64"]:
        col = on_device.column(name)
        expected = part.column(name)
        if expected.null_count:
            with pytest.raises(devarrow.UnsupportedTypeError, match="nulls"):
                np.from_dlpack(col)
            continue
        got = np.from_dlpack(col)
        assert got.dtype == np.dtype(name)
        np.testing.assert_array_equal(got, expected.to_numpy())


def test_temporal_and_float16_columns_are_their_integers_and_halves(capsules_released):
    part = pa.record_batch({
        "date32": pa.array(range(5), type=pa.int32()).cast(pa.date32()),
        "ts": pa.array(range(5), type=pa.int64()).cast(pa.timestamp("ns")),
        "f16": pa.array(np.arange(5, dtype=np.float16)),
    })
    on_device = devarrow.device("cpu").to_device(part)
    np.testing.assert_array_equal(np.from_dlpack(on_device.column("date32")), np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(np.from_dlpack(on_device.column("ts")), np.arange(5))
    np.testing.assert_array_equal(np.from_dlpack(on_device.column("f16")), np.arange(5, dtype=np.float16))


@pytest.mark.parametrize("name,why", [
    ("utf8", "not fixed-width"), ("bool", "bit-packed"), ("list", "nested"),
    ("dictionary", "dictionary"), ("decimal128", "no DLPack data type"),
])
def test_other_columns_say_why_they_have_no_dlpack(dev, batch, name, why):
    col = dev.to_device(batch).column(name)
    with pytest.raises(devarrow.UnsupportedTypeError, match=why):
        col.__dlpack__()


def test_validity_bitmaps(batch, capsules_released):
    for offset, length in [(0, 37), (3, 20), (9, 5)]:
        part = batch.slice(offset, length)
        col = devarrow.device("cpu").to_device(part).column("int32")
        bitmap = col.validity
        assert bitmap is not None and bitmap.length == length
        bits = np.unpackbits(np.from_dlpack(bitmap), bitorder="little")
        valid = bits[bitmap.bit_offset:bitmap.bit_offset + length].astype(bool)
        expected = part.column("int32").is_valid().to_numpy(zero_copy_only=False)
        np.testing.assert_array_equal(valid, expected)
    assert devarrow.device("cpu").to_device(batch).column("float64").validity is None


def test_dlpack_arguments_and_capsule_names(dev, batch, capsules_released):
    col = dev.to_device(batch).column("float64")
    expected_device = (1, 0) if dev.kind == "cpu" else (2, 0)
    assert col.__dlpack_device__() == expected_device
    assert '"dltensor"' in repr(col.__dlpack__())
    assert '"dltensor_versioned"' in repr(col.__dlpack__(max_version=(1, 0)))
    assert '"dltensor"' in repr(col.__dlpack__(max_version=(0, 8)))
    with pytest.raises(BufferError):
        col.__dlpack__(dl_device=(13, 7))
    with pytest.raises(BufferError):
        col.__dlpack__(copy=True)
    col.__dlpack__(dl_device=expected_device, copy=False)


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


def read_versioned(capsule):
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return DLManagedTensorVersioned.from_address(get(capsule, b"dltensor_versioned"))


def test_the_versioned_tensor_is_what_dlpack_says(dev, batch, capsules_released):
    on_device = dev.to_device(batch.slice(2, 30))
    capsule = on_device.column("float64").__dlpack__(max_version=(1, 1), stream=-1)
    t = read_versioned(capsule)
    assert (t.major, t.minor) == devarrow.DLPACK_VERSION
    assert (t.dl_tensor.device_type, t.dl_tensor.ndim) == (1 if dev.kind == "cpu" else 2, 1)
    assert (t.dl_tensor.code, t.dl_tensor.bits, t.dl_tensor.lanes) == (2, 64, 1)


    assert (t.dl_tensor.shape[0], t.dl_tensor.strides[0]) == (30, 1)
    del t, capsule  # never consumed: the capsule calls the deleter


def test_unconsumed_tensors_free_the_batch(cuda, batch):
    gc.collect()
    before = cuda.memory_in_use()
    on_device = cuda.to_device(batch)
    assert cuda.memory_in_use() > before
    capsules = [on_device.column("float64").__dlpack__(max_version=v) for v in [None, (1, 0)]]
    arrays = on_device.__arrow_c_device_array__()
    del on_device
    gc.collect()
    assert cuda.memory_in_use() > before  # the capsules keep it
    del capsules, arrays
    gc.collect()
    assert cuda.memory_in_use() == before


# --------------------------------------------------------------------------- CUDA

def test_cuda_stream_semantics(cuda, batch):
    col = cuda.to_device(batch).column("float64")
    # None: the per-thread default stream waits on devarrow's event (the legacy default
    # stream waits for it in turn), with no implicit synchronization of the device.
    col.__dlpack__(stream=None)
    col.__dlpack__(stream=1)  # the legacy default stream: an implicit synchronization
    col.__dlpack__(stream=2)
    col.__dlpack__(stream=-1)  # no synchronization
    with pytest.raises(ValueError, match="ambiguous"):
        col.__dlpack__(stream=0)
    with pytest.raises(ValueError, match="invalid stream"):
        col.__dlpack__(stream=-2)
    # A stream handle that is not a live stream cannot be checked by anyone: NVIDIA's
    # driver dereferences it and the interpreter dies (SIGSEGV); the emulator aborts.


def test_cuda_array_interface(dev, batch):
    col = dev.to_device(batch).column("float64")
    if dev.kind == "cpu":
        assert not hasattr(col, "__cuda_array_interface__")
        return
    cai = col.__cuda_array_interface__
    assert cai["version"] == 3 and cai["shape"] == (batch.num_rows,)
    assert cai["typestr"] == "<f8" and cai["strides"] is None
    assert cai["data"][0] != 0 and cai["stream"] is not None


# --------------------------------------------------------------------------- errors, capsules

class Capsules:
    """An object handing out the same capsules every time (the second use finds them
    consumed)."""

    def __init__(self, obj):
        self.pair = obj.__arrow_c_array__()

    def __arrow_c_array__(self, requested_schema=None):
        return self.pair


def test_a_consumed_capsule_is_a_released_error(batch):
    source = Capsules(batch)
    devarrow.device("cpu").to_device(source)
    with pytest.raises(devarrow.ReleasedError, match="released"):
        devarrow.device("cpu").to_device(source)
    assert issubclass(devarrow.ReleasedError, devarrow.DevarrowError)


def test_foreign_capsules_are_released_once(batch):
    pool = pa.default_memory_pool()
    gc.collect()
    base = pool.bytes_allocated()
    copy = pa.concat_batches([batch, batch])  # pyarrow memory of its own
    assert pool.bytes_allocated() > base
    for dev_id in ["cpu"]:
        on_device = devarrow.device(dev_id).to_device(Capsules(copy))
        del on_device
    del copy
    gc.collect()
    assert pool.bytes_allocated() == base


def test_capsules_are_released_whether_or_not_consumed(dev, batch, capsules_released):
    on_device = dev.to_device(batch)
    created = devarrow._devarrow._capsule_counts()[0]
    for _ in range(3):
        on_device.__arrow_c_device_array__()  # dropped at once
        on_device.__arrow_c_schema__()
    if dev.kind == "cpu":
        pa.record_batch(on_device)  # consumed
    assert devarrow._devarrow._capsule_counts()[0] > created


def test_the_exception_hierarchy():
    for e in [devarrow.ReleasedError, devarrow.DeviceMismatchError, devarrow.UnsupportedTypeError,
              devarrow.UnsupportedDeviceError, devarrow.SchemaMismatchError,
              devarrow.InvalidArrayError, devarrow.DeviceError, devarrow.DeviceUnavailableError]:
        assert issubclass(e, devarrow.DevarrowError)
        assert e.__module__ == "devarrow"


def test_transfers_run_in_threads(dev, batch):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: dev.to_device(batch).to_host(), range(8)))
    assert all(r.equals(batch) for r in results)


def test_columns_by_index_and_name(dev, batch):
    on_device = dev.to_device(batch)
    assert on_device.column(0).name == batch.schema.names[0]
    assert on_device.column(-1).name == batch.schema.names[-1]
    assert on_device.column("utf8").arrow_type == "Utf8"
    assert len(on_device.column("utf8")) == batch.num_rows
    with pytest.raises(IndexError):
        on_device.column(999)
    with pytest.raises(KeyError):
        on_device.column("nope")
