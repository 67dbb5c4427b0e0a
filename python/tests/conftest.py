"""Shared fixtures: the devices to test on, and the batches of every type.

CUDA tests run when ``devarrow.device("auto")`` opens a CUDA device (a GPU, or the
emulated driver of ``tests/cuda-emu`` first on ``LD_LIBRARY_PATH``, as
``.ci/emulated-gpu --python`` arranges); otherwise they skip, saying why, unless
``DEVARROW_REQUIRE_GPU=1``, which makes them fail.
"""

import datetime
import decimal
import gc
import os

import pyarrow as pa
import pytest

import devarrow


def cuda_device():
    """The CUDA device, or None (skip) / a failure (DEVARROW_REQUIRE_GPU=1)."""
    dev = devarrow.device("auto")
    if dev.kind == "cuda":
        return dev
    if os.environ.get("DEVARROW_REQUIRE_GPU") == "1":
        pytest.fail(f"DEVARROW_REQUIRE_GPU=1 but no CUDA device: {dev.reason}")
    pytest.skip(f"no CUDA device: {dev.reason}")


@pytest.fixture(params=["cpu", "cuda"])
def dev(request):
    """Each device: the CPU device, and CUDA when there is one."""
    if request.param == "cpu":
        return devarrow.device("cpu")
    return cuda_device()


@pytest.fixture
def cuda():
    return cuda_device()


N = 37


def every_type_table():
    """A table of every type the Rust round-trip tests cover
    (tests/support/src/sample.rs), with nulls, as pyarrow builds them."""
    ints = [None if i % 5 == 0 else i - 7 for i in range(N)]
    nn = list(range(N))
    strs = [None if i % 4 == 0 else "s" * (i % 6) + str(i) for i in range(N)]
    cols = {
        "null": pa.nulls(N),
        "bool": pa.array([None if i % 3 == 0 else i % 2 == 0 for i in range(N)]),
    }
    for t in ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]:
        signed = not t.startswith("u")
        cols[t] = pa.array([v if v is None else (v if signed else v + 7) for v in ints], type=t)
    cols["float16"] = pa.array([None if v is None else float(v) for v in ints], type=pa.float32()).cast(pa.float16())
    cols["float32"] = pa.array([None if v is None else v / 2 for v in ints], type=pa.float32())
    cols["float64"] = pa.array([i * 0.25 for i in nn], type=pa.float64())
    cols["decimal32"] = pa.array([None if v is None else decimal.Decimal(v) / 4 for v in ints], type=pa.decimal32(9, 2))
    cols["decimal64"] = pa.array([None if v is None else decimal.Decimal(v) / 8 for v in ints], type=pa.decimal64(18, 3))
    cols["decimal128"] = pa.array([None if v is None else decimal.Decimal(v) for v in ints], type=pa.decimal128(38, 10))
    cols["decimal256"] = pa.array([None if v is None else decimal.Decimal(v) for v in ints], type=pa.decimal256(76, 20))
    cols["date32"] = pa.array([None if v is None else datetime.date(2020, 1, 1) + datetime.timedelta(days=v) for v in ints], type=pa.date32())
    cols["date64"] = pa.array(nn, type=pa.int64()).cast(pa.date64()) if False else pa.array([datetime.date(2021, 1, 1 + i % 28) for i in nn], type=pa.date64())
    cols["time32s"] = pa.array(ints, type=pa.int32()).cast(pa.time32("s"))
    cols["time32ms"] = pa.array(ints, type=pa.int32()).cast(pa.time32("ms"))
    cols["time64us"] = pa.array(ints, type=pa.int64()).cast(pa.time64("us"))
    cols["time64ns"] = pa.array(ints, type=pa.int64()).cast(pa.time64("ns"))
    cols["timestamp"] = pa.array(ints, type=pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    cols["duration"] = pa.array(ints, type=pa.int64()).cast(pa.duration("ms"))
    cols["interval_mdn"] = pa.array([None if v is None else pa.MonthDayNano([v, v, v]) for v in ints], type=pa.month_day_nano_interval())
    cols["binary"] = pa.array([None if s is None else s.encode() for s in strs], type=pa.binary())
    cols["large_binary"] = pa.array([None if s is None else s.encode() for s in strs], type=pa.large_binary())
    cols["utf8"] = pa.array(strs, type=pa.string())
    cols["large_utf8"] = pa.array(strs, type=pa.large_string())
    cols["binary_view"] = pa.array([None if s is None else (s * 5).encode() for s in strs], type=pa.binary_view())
    cols["utf8_view"] = pa.array([None if s is None else s * 5 for s in strs], type=pa.string_view())
    cols["fixed_size_binary"] = pa.array([None if v is None else bytes([v % 256] * 3) for v in ints], type=pa.binary(3))
    cols["list"] = pa.array([None if v is None else list(range(v % 4)) for v in ints], type=pa.list_(pa.int32()))
    cols["large_list"] = pa.array([None if v is None else [str(x) for x in range(v % 3)] for v in ints], type=pa.large_list(pa.string()))
    cols["fixed_size_list"] = pa.array([None if v is None else [v, -v] for v in ints], type=pa.list_(pa.int16(), 2))
    cols["list_view"] = pa.array([None if v is None else list(range(v % 4)) for v in ints], type=pa.list_view(pa.int32()))
    cols["large_list_view"] = pa.array([None if v is None else [str(v)] for v in ints], type=pa.large_list_view(pa.string()))
    cols["struct"] = pa.array([None if v is None else {"a": v, "b": str(v)} for v in ints], type=pa.struct([("a", pa.int32()), ("b", pa.string())]))
    cols["map"] = pa.array([None if v is None else [(str(v), v)] for v in ints], type=pa.map_(pa.string(), pa.int64()))
    cols["sparse_union"] = pa.UnionArray.from_sparse(
        pa.array([i % 2 for i in nn], type=pa.int8()),
        [pa.array(nn, type=pa.int32()), pa.array([str(i) for i in nn])],
    )
    cols["dense_union"] = pa.UnionArray.from_dense(
        pa.array([i % 2 for i in nn], type=pa.int8()),
        pa.array([i // 2 for i in nn], type=pa.int32()),
        [pa.array(range(N), type=pa.int32()), pa.array([str(i) for i in range(N)])],
    )
    cols["dictionary"] = pa.array(strs).dictionary_encode()
    cols["run_end"] = pa.RunEndEncodedArray.from_arrays(
        pa.array([3 * (i + 1) for i in range(N // 3)] + [N], type=pa.int32()),
        pa.array([None if i % 4 == 0 else i for i in range(N // 3 + 1)], type=pa.int64()),
    )
    schema_meta = {b"source": b"devarrow python tests"}
    return pa.table(cols).replace_schema_metadata(schema_meta)


@pytest.fixture(scope="session")
def table():
    return every_type_table()


@pytest.fixture
def batch(table):
    return table.combine_chunks().to_batches()[0]


@pytest.fixture
def capsules_released():
    """Checks, at the end of a test, that every capsule devarrow made was destroyed and
    that each struct was released once (by its consumer or by the capsule)."""
    gc.collect()
    before = devarrow._devarrow._capsule_counts()
    yield
    gc.collect()
    created, consumed, released = devarrow._devarrow._capsule_counts()
    made = created - before[0]
    gone = (consumed - before[1]) + (released - before[2])
    assert made == gone, f"{made} capsules made, {gone} destroyed"
