"""pyarrow <-> devarrow interoperability over the Arrow C Device Data Interface.

Drives ``libdevarrow_interop.so`` (tests/interop) through cffi:

* arrays, Rust -> Python -> Rust: devarrow exports the "every type" sample batches
  (``devarrow_interop::sample``) as ``ArrowDeviceArray``; pyarrow imports them with
  ``RecordBatch._import_from_c_device`` (and ``_import_from_c_device_capsule``), they are
  compared with the same batches received through arrow-rs's plain C stream, exported
  back with ``_export_to_c_device`` (and ``__arrow_c_device_array__``), and Rust compares
  them with its own batches.
* arrays, Python -> Rust -> Python: pyarrow builds its own every-type batch; Rust imports
  it with devarrow (validated), exports it again with devarrow, and Python compares.
* device streams, Rust -> Python: devarrow's ``ArrowDeviceArrayStream`` is consumed by
  calling its callbacks through cffi (pyarrow 26 has no device stream API), each array
  imported with ``_import_from_c_device``, compared with arrow-rs's plain C stream of the
  same batches (``RecordBatchReader._import_from_c``). Errors: code and message.
* device streams, Python -> Rust: an ``ArrowDeviceArrayStream`` implemented with cffi
  callbacks (``get_next`` calls ``batch._export_to_c_device``) is read by devarrow's
  ``DeviceArrayStreamReader``: compared by Rust with its samples, echoed back through
  arrow-rs's plain C stream, and relayed lazily as a devarrow device stream.

Comparisons are value by value: schema (with schema and field metadata), then each
column's type, null count and values (``to_pylist``; nanosecond temporals as int64 since
``to_pylist`` needs pandas for them; month and day-time intervals, which pyarrow 26 has
no Python array class for, read raw from the C struct), and ``RecordBatch.equals``.

Run: ``python test_pyarrow_interop.py path/to/libdevarrow_interop.so``, or with pytest and
``DEVARROW_INTEROP_LIB`` set.
"""

import ctypes
import decimal
import math
import os
import re
import sys
import traceback
import uuid

import cffi
import pyarrow as pa
import pyarrow.cffi

ARROW_DEVICE_CPU = 1
EIO = 5
EINVAL = 22

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "..", "include", "arrow_c_device.h")


def _header_struct(name):
    """The declaration of ``struct name`` from include/arrow_c_device.h, comments removed."""
    with open(HEADER) as f:
        text = f.read()
    m = re.search(rf"^struct {name} \{{.*?^\}};", text, re.DOTALL | re.MULTILINE)
    assert m, f"struct {name} not found in {HEADER}"
    return re.sub(r"//[^\n]*", "", m.group(0))


ffi = cffi.FFI()
# ArrowSchema, ArrowArray, ArrowArrayStream, ArrowDeviceType and ArrowDeviceArray come from
# pyarrow; pyarrow.cffi does not declare ArrowDeviceArrayStream: take it from our header.
ffi.include(pyarrow.cffi.ffi)
assert "ArrowDeviceArrayStream" not in pyarrow.cffi.c_source
ffi.cdef(_header_struct("ArrowDeviceArrayStream"))
ffi.cdef(
    """
    const char* devarrow_interop_last_error(void);
    int devarrow_interop_sample_count(void);
    int devarrow_interop_export_sample(int which, struct ArrowDeviceArray* out,
                                      struct ArrowSchema* out_schema);
    int devarrow_interop_check_sample(int which, struct ArrowDeviceArray* array,
                                     struct ArrowSchema* schema);
    int devarrow_interop_echo_device_array(struct ArrowDeviceArray* array,
                                          struct ArrowSchema* schema,
                                          struct ArrowDeviceArray* out,
                                          struct ArrowSchema* out_schema);
    int devarrow_interop_export_device_stream(struct ArrowDeviceArrayStream* out);
    int devarrow_interop_export_failing_device_stream(struct ArrowDeviceArrayStream* out,
                                                     int fail_at);
    int devarrow_interop_export_c_stream(struct ArrowArrayStream* out);
    int devarrow_interop_echo_device_stream(struct ArrowDeviceArrayStream* stream,
                                           struct ArrowArrayStream* out);
    int devarrow_interop_relay_device_stream(struct ArrowDeviceArrayStream* stream,
                                            struct ArrowDeviceArrayStream* out);
    int devarrow_interop_check_device_stream(struct ArrowDeviceArrayStream* stream);
    """
)

_lib = None


def lib():
    global _lib
    if _lib is None:
        path = os.environ.get("DEVARROW_INTEROP_LIB")
        assert path, "set DEVARROW_INTEROP_LIB to the path of libdevarrow_interop.so"
        _lib = ffi.dlopen(path)
    return _lib


def ptr(cdata):
    return int(ffi.cast("uintptr_t", cdata))


class InteropError(Exception):
    def __init__(self, code, message):
        super().__init__("code %d: %s" % (code, message))
        self.code = code
        self.message = message


def check(rc):
    if rc != 0:
        raise InteropError(rc, ffi.string(lib().devarrow_interop_last_error()).decode())


# --------------------------------------------------------------------------------------
# Comparison, value by value.
# --------------------------------------------------------------------------------------

NS_TEMPORAL = (pa.types.is_timestamp, pa.types.is_time64, pa.types.is_duration)


def _no_python_array_class(t):
    # pyarrow 26 has no Array subclass for month_interval (type id 21) and
    # day_time_interval (22): RecordBatch.column() raises KeyError for them.
    return str(t) in ("month_interval", "day_time_interval")


def _raw_interval_values(batch, i):
    """Values of interval column ``i`` read from the C struct (pyarrow cannot wrap it)."""
    t = batch.schema.field(i).type
    c_array = ffi.new("struct ArrowArray*")
    c_schema = ffi.new("struct ArrowSchema*")
    batch.select([i])._export_to_c(ptr(c_array), ptr(c_schema))
    try:
        child = c_array.children[0]
        assert child.n_buffers == 2
        off = c_array.offset + child.offset
        ints = ffi.cast("int32_t*", child.buffers[1])
        bits = ffi.cast("uint8_t*", child.buffers[0])
        width = 1 if ffi.string(c_schema.children[0].format) == b"tiM" else 2
        assert ffi.string(c_schema.children[0].format) in (b"tiM", b"tiD"), t
        out = []
        for r in range(batch.num_rows):
            k = off + r
            if bits != ffi.NULL and not (bits[k // 8] >> (k % 8)) & 1:
                out.append(None)
            else:
                out.append(tuple(ints[k * width + j] for j in range(width)))
        return out
    finally:
        c_array.release(c_array)
        c_schema.release(c_schema)


def column_values(batch, i):
    """Python values of column ``i``."""
    t = batch.schema.field(i).type
    if _no_python_array_class(t):
        return _raw_interval_values(batch, i)
    col = batch.column(i)
    if any(p(t) for p in NS_TEMPORAL) and t.unit == "ns":
        col = col.cast(pa.int64())
    return col.to_pylist()


def _is_nan(v):
    return isinstance(v, float) and math.isnan(v)


def assert_batches_equal(expected, actual, label):
    es, as_ = expected.schema, actual.schema
    assert as_.metadata == es.metadata, (
        f"{label}: schema metadata {as_.metadata!r} != {es.metadata!r}"
    )
    assert len(as_) == len(es), "%s: %d columns, expected %d" % (label, len(as_), len(es))
    assert actual.num_rows == expected.num_rows, "%s: %d rows, expected %d" % (
        label,
        actual.num_rows,
        expected.num_rows,
    )
    for i, (ef, af) in enumerate(zip(es, as_)):
        where = "%s: column %d %r" % (label, i, ef.name)
        assert af.equals(ef, check_metadata=True), (
            f"{where}: field {af!r} != {ef!r} (metadata {af.metadata!r}, {ef.metadata!r})"
        )
        assert af.type == ef.type, f"{where}: type {af.type} != {ef.type}"
        ev, av = column_values(expected, i), column_values(actual, i)
        assert len(av) == expected.num_rows, where
        for r, (e, a) in enumerate(zip(ev, av)):
            assert a == e or (_is_nan(a) and _is_nan(e)), "%s row %d: %r != %r" % (where, r, a, e)
        if not _no_python_array_class(af.type):
            assert actual.column(i).null_count == expected.column(i).null_count, where
            assert actual.column(i).equals(expected.column(i)), where
    assert as_.equals(es, check_metadata=True), label
    assert actual.equals(expected, check_metadata=True), label


# --------------------------------------------------------------------------------------
# Helpers over the C structs.
# --------------------------------------------------------------------------------------


def check_cpu_device_array(c_array, label):
    assert c_array.array.release != ffi.NULL, label
    assert c_array.device_type == ARROW_DEVICE_CPU, (label, c_array.device_type)
    assert c_array.device_id == -1, (label, c_array.device_id)
    assert c_array.sync_event == ffi.NULL, label
    assert list(c_array.reserved) == [0, 0, 0], label


def rust_sample(which):
    """Sample ``which`` exported by devarrow, imported by pyarrow."""
    c_array = ffi.new("struct ArrowDeviceArray*")
    c_schema = ffi.new("struct ArrowSchema*")
    check(lib().devarrow_interop_export_sample(which, c_array, c_schema))
    check_cpu_device_array(c_array, "sample %d" % which)
    batch = pa.RecordBatch._import_from_c_device(ptr(c_array), ptr(c_schema))
    assert c_array.array.release == ffi.NULL, "pyarrow moved the array"
    assert c_schema.release == ffi.NULL, "pyarrow moved the schema"
    batch.validate(full=True)
    return batch


def reference_batches():
    """The samples through arrow-rs's plain C stream: (schema, batches)."""
    c_stream = ffi.new("struct ArrowArrayStream*")
    check(lib().devarrow_interop_export_c_stream(c_stream))
    reader = pa.RecordBatchReader._import_from_c(ptr(c_stream))
    batches = list(reader)
    for b in batches:
        b.validate(full=True)
    return reader.schema, batches


def echo_through_rust(batch):
    """pyarrow -> devarrow import -> devarrow export -> pyarrow."""
    c_in = ffi.new("struct ArrowDeviceArray*")
    c_in_schema = ffi.new("struct ArrowSchema*")
    batch._export_to_c_device(ptr(c_in), ptr(c_in_schema))
    check_cpu_device_array(c_in, "pyarrow export")
    c_out = ffi.new("struct ArrowDeviceArray*")
    c_out_schema = ffi.new("struct ArrowSchema*")
    check(lib().devarrow_interop_echo_device_array(c_in, c_in_schema, c_out, c_out_schema))
    assert c_in.array.release == ffi.NULL and c_in_schema.release == ffi.NULL, "moved in"
    check_cpu_device_array(c_out, "devarrow echo")
    out = pa.RecordBatch._import_from_c_device(ptr(c_out), ptr(c_out_schema))
    out.validate(full=True)
    return out


# PyCapsule helpers for the __arrow_c_device_array__ protocol.
_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype = ctypes.c_void_p
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
SCHEMA_CAPSULE = b"arrow_schema"
DEVICE_ARRAY_CAPSULE = b"arrow_device_array"


# --------------------------------------------------------------------------------------
# pyarrow's own every-type batch (built independently of the Rust one).
# --------------------------------------------------------------------------------------

VALID = [True, False, True, True, False, True]
ROWS = len(VALID)
STRINGS = [
    "",
    "null-slot",
    "short",
    "a string longer than twelve bytes",
    "x",
    "héllo wörld, ünïcode and more than 12 bytes",
]


def opt(values):
    return [v if ok else None for v, ok in zip(values, VALID)]


def null_mask():
    return pa.array([not v for v in VALID])


def pyarrow_every_type_batch():
    """One column of (nearly) every type, built by pyarrow.

    Not here: month_interval and day_time_interval, which pyarrow 26 cannot build (no
    type factory and no Python array class); they cross in the Rust-built batch instead.
    """
    fields, arrays = [], []

    def add(name, array, nullable=True, metadata=None):
        fields.append(pa.field(name, array.type, nullable, metadata))
        arrays.append(array)

    add("null", pa.nulls(ROWS))
    add("bool", pa.array(opt([True, True, False, True, False, False])))
    for name, t, lo, hi in [
        ("int8", pa.int8(), -(2**7), 2**7 - 1),
        ("int16", pa.int16(), -(2**15), 2**15 - 1),
        ("int32", pa.int32(), -(2**31), 2**31 - 1),
        ("int64", pa.int64(), -(2**63), 2**63 - 1),
        ("uint8", pa.uint8(), 0, 2**8 - 1),
        ("uint16", pa.uint16(), 0, 2**16 - 1),
        ("uint32", pa.uint32(), 0, 2**32 - 1),
        ("uint64", pa.uint64(), 0, 2**64 - 1),
    ]:
        add(name, pa.array(opt([lo, 0, 1, hi, 7, 42]), t))
    floats = [-1.5, 0.0, 0.25, float("inf"), 2.0, -65504.0]
    add("float16", pa.array(opt(floats), pa.float16()))
    add("float32", pa.array(opt(floats), pa.float32()))
    add("float64", pa.array([-1.5, 5e-324, 1e300, float("-inf"), 0.1, -0.0]), nullable=False)
    d = [-123456789, 0, 1, 999999999, -1, 42]
    add("decimal32", pa.array(opt([decimal.Decimal(v).scaleb(-2) for v in d]), pa.decimal32(9, 2)))
    add("decimal64", pa.array(opt([decimal.Decimal(v).scaleb(6) for v in d]), pa.decimal64(18, 3)))
    add(
        "decimal128",
        pa.array(opt([decimal.Decimal(v).scaleb(15) for v in d]), pa.decimal128(38, 10)),
    )
    add(
        "decimal256",
        pa.array(opt([decimal.Decimal(v).scaleb(37) for v in d]), pa.decimal256(76, 20)),
    )
    days = [-719162, 0, 1, 19000, 2932896, 20000]
    add("date32", pa.array(opt(days), pa.date32()))
    add("date64", pa.array(opt([x * 86400000 for x in days]), pa.date64()))
    secs = [0, 1, 3599, 43200, 86399, 12345]
    add("time32s", pa.array(opt(secs), pa.time32("s")))
    add("time32ms", pa.array(opt([s * 1000 + 7 for s in secs]), pa.time32("ms")))
    add("time64us", pa.array(opt([s * 10**6 + 7 for s in secs]), pa.time64("us")))
    add("time64ns", pa.array(opt([s * 10**9 + 7 for s in secs]), pa.time64("ns")))
    ts = [-86400, 0, 1, 1700000000, 4102444800, 951782400]
    for name, unit, tz, mul in [
        ("timestamp_s", "s", None, 1),
        ("timestamp_ms_utc", "ms", "UTC", 10**3),
        ("timestamp_us_offset", "us", "+05:30", 10**6),
        ("timestamp_ns_named_tz", "ns", "America/New_York", 10**9),
        ("timestamp_ns", "ns", None, 10**9),
    ]:
        add(name, pa.array(opt([t * mul + 3 for t in ts]), pa.timestamp(unit, tz)))
    for unit in ["s", "ms", "us", "ns"]:
        add(
            "duration_" + unit,
            pa.array(opt([-5, 0, 1, 9223372036, 123, -86400]), pa.duration(unit)),
        )
    add(
        "interval_month_day_nano",
        pa.array(
            opt(
                [
                    (-1, -2, -3),
                    (0, 0, 0),
                    (1, 2, 3),
                    (12, 31, 86400 * 10**9),
                    (4, 5, 6),
                    (-(2**31), 2**31 - 1, 2**63 - 1),
                ]
            ),
            pa.month_day_nano_interval(),
        ),
    )
    strings = opt(STRINGS)
    blobs = [None if s is None else s.encode() for s in strings]
    add("binary", pa.array(blobs, pa.binary()))
    add("large_binary", pa.array(blobs, pa.large_binary()))
    add(
        "utf8",
        pa.array(strings, pa.string()),
        metadata={
            "comment": "plain field metadata",
            "ARROW:extension:name": "devarrow.custom",
            "ARROW:extension:metadata": '{"version":1}',
        },
    )
    add("large_utf8", pa.array(strings, pa.large_string()))
    # Two chunks concatenated: the view arrays get two variadic data buffers.
    binary_view = pa.concat_arrays(
        [pa.array(blobs[:3], pa.binary_view()), pa.array(blobs[3:], pa.binary_view())]
    )
    string_view = pa.concat_arrays(
        [pa.array(strings[:3], pa.string_view()), pa.array(strings[3:], pa.string_view())]
    )
    assert len(string_view.buffers()) >= 4, "validity, views and two variadic buffers"
    add("binary_view", binary_view)
    add("utf8_view", string_view)
    add(
        "fixed_size_binary",
        pa.array(opt([b"abc", b"def", b"\0\1\2", b"\xff" * 3, b"xyz", b"123"]), pa.binary(3)),
    )
    add(
        "uuid",
        pa.array(opt([uuid.UUID(int=i * 0x0101010101010101) for i in range(ROWS)]), pa.uuid()),
    )
    add("list", pa.array(opt([[1, 2], [], [], [3, None, 4], [], [5]]), pa.list_(pa.int32())))
    add(
        "large_list",
        pa.array(
            opt([["a"], [], ["bb", None], [], [], ["a rather long string value", "", "z"]]),
            pa.large_list(pa.string()),
        ),
    )
    add(
        "fixed_size_list",
        pa.array(
            opt([[1, 2], [0, 0], [None, 4], [5, 6], [0, 0], [-7, None]]), pa.list_(pa.int16(), 2)
        ),
    )
    add(
        "list_view",
        pa.ListViewArray.from_arrays(
            pa.array([3, 0, 0, 1, 0, 4], pa.int32()),
            pa.array([2, 0, 0, 3, 0, 1], pa.int32()),
            pa.array([10, 11, None, 13, 14], pa.int32()),
            mask=null_mask(),
        ),
    )
    add(
        "large_list_view",
        pa.LargeListViewArray.from_arrays(
            pa.array([2, 0, 0, 0, 0, 1], pa.int64()),
            pa.array([1, 0, 3, 2, 0, 2], pa.int64()),
            pa.array(["p", None, "a view element over twelve bytes"]),
            mask=null_mask(),
        ),
    )
    add(
        "struct",
        pa.StructArray.from_arrays(
            [
                pa.array([1, None, None, 4, 5, 6], pa.int32()),
                pa.array(["x", "", "z", "w", "", "a longer struct field"]),
            ],
            fields=[pa.field("a", pa.int32()), pa.field("b", pa.string(), nullable=False)],
            mask=null_mask(),
        ),
    )
    add(
        "map",
        pa.array(
            opt(
                [
                    [("a", 1), ("b", None)],
                    [],
                    [],
                    [("k", -1)],
                    [],
                    [("x", 7), ("y", 8), ("zz", None)],
                ]
            ),
            pa.map_(pa.string(), pa.int32()),
        ),
    )
    union_children = [
        pa.array([1, None, None, None, None, 6], pa.int32()),
        pa.array([None, "two", None, None, "a sparse union string", None]),
    ]
    add(
        "sparse_union",
        pa.UnionArray.from_sparse(
            pa.array([5, 7, 5, 7, 7, 5], pa.int8()), union_children, ["i", "s"], [5, 7]
        ),
        nullable=False,
    )
    add(
        "dense_union",
        pa.UnionArray.from_dense(
            pa.array([7, 5, 5, 7, 5, 7], pa.int8()),
            pa.array([0, 0, 1, 1, 2, 2], pa.int32()),
            [pa.array([10, None, 30], pa.int32()), pa.array(["d", None, "dense!"])],
            ["i", "s"],
            [5, 7],
        ),
        nullable=False,
    )
    words = pa.array(["red", "green", "a long dictionary word"])
    keys = [0, 1, 2, 2, 0, 1]
    for t in [
        pa.int8(),
        pa.uint8(),
        pa.int16(),
        pa.uint16(),
        pa.int32(),
        pa.uint32(),
        pa.int64(),
        pa.uint64(),
    ]:
        add("dict_" + str(t), pa.DictionaryArray.from_arrays(pa.array(opt(keys), t), words))
    add(
        "dict_ordered",
        pa.DictionaryArray.from_arrays(
            pa.array([2, 1, 0, 0, 1, 2], pa.int32()), pa.array(["low", "mid", "high"]), ordered=True
        ),
        nullable=False,
    )
    add(
        "dict_nested_values",
        pa.DictionaryArray.from_arrays(
            pa.array(opt([0, 2, 1, 1, 0, 0]), pa.int16()),
            pa.array([[1, 2], [], None], pa.list_(pa.int64())),
        ),
    )
    add(
        "list_of_dict",
        pa.ListArray.from_arrays(
            pa.array([0, 2, 2, 3, 6, 6, 7], pa.int32()),
            pa.DictionaryArray.from_arrays(
                pa.array([0, 1, 0, 2, 2, 3, 1], pa.int8()),
                pa.array(["a", "b", "c", "a dictionary value inside a list"]),
            ),
            mask=null_mask(),
        ),
    )
    add(
        "run_end_encoded",
        pa.RunEndEncodedArray.from_arrays(
            pa.array([2, 3, 6], pa.int32()), pa.array(["run", None, "a long run-end encoded value"])
        ),
    )
    add(
        "run_end_encoded_i16",
        pa.RunEndEncodedArray.from_arrays(
            pa.array([1, 4, 5, 6], pa.int16()), pa.array([1.0, -2.5, None, 4.0])
        ),
    )
    schema = pa.schema(
        fields, metadata={"producer": "pyarrow", "description": "every type, from Python"}
    )
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
    batch.validate(full=True)
    return batch


def pyarrow_samples():
    """pyarrow's batch, a slice of it (pyarrow keeps nonzero offsets in every column) and
    an empty slice at the end (offset 6, length 0)."""
    batch = pyarrow_every_type_batch()
    return [batch, batch.slice(1, 4), batch.slice(ROWS, 0)]


# --------------------------------------------------------------------------------------
# A Python ArrowDeviceArrayStream producer (cffi callbacks) and a consumer.
# --------------------------------------------------------------------------------------

_LIVE_PRODUCERS = set()


class PyDeviceStream:
    """An ArrowDeviceArrayStream over pyarrow batches; ``get_next`` fails with EIO instead
    of producing batch ``fail_at``."""

    def __init__(self, schema, batches, fail_at=None):
        self.schema = schema
        self.batches = list(batches)
        self.fail_at = fail_at
        self.next = 0
        self.released = 0
        self.error = ffi.new("char[]", b"")
        self.callback_errors = []
        self.handle = ffi.new_handle(self)

    def export(self, out):
        out.device_type = ARROW_DEVICE_CPU
        out.get_schema = _py_get_schema
        out.get_next = _py_get_next
        out.get_last_error = _py_get_last_error
        out.release = _py_release
        out.private_data = self.handle
        _LIVE_PRODUCERS.add(self)

    def fail(self, message):
        self.error = ffi.new("char[]", message.encode())
        return EIO


def _producer(stream):
    return ffi.from_handle(stream.private_data)


def _on_callback_error(exc_type, exc_value, tb):
    # cffi returns the `error` value given to ffi.callback; keep the traceback visible.
    traceback.print_exception(exc_type, exc_value, tb)


@ffi.callback(
    "int(struct ArrowDeviceArrayStream*, struct ArrowSchema*)",
    error=EIO,
    onerror=_on_callback_error,
)
def _py_get_schema(stream, out):
    p = _producer(stream)
    p.schema._export_to_c(ptr(out))
    return 0


@ffi.callback(
    "int(struct ArrowDeviceArrayStream*, struct ArrowDeviceArray*)",
    error=EIO,
    onerror=_on_callback_error,
)
def _py_get_next(stream, out):
    p = _producer(stream)
    if p.fail_at is not None and p.next == p.fail_at:
        return p.fail("python producer failed on purpose at batch %d" % p.next)
    if p.next >= len(p.batches):
        ffi.memmove(
            out, bytes(ffi.sizeof("struct ArrowDeviceArray")), ffi.sizeof("struct ArrowDeviceArray")
        )
        out.device_type = ARROW_DEVICE_CPU
        return 0
    p.batches[p.next]._export_to_c_device(ptr(out))
    p.next += 1
    return 0


@ffi.callback(
    "const char*(struct ArrowDeviceArrayStream*)", error=ffi.NULL, onerror=_on_callback_error
)
def _py_get_last_error(stream):
    return _producer(stream).error


@ffi.callback("void(struct ArrowDeviceArrayStream*)", onerror=_on_callback_error)
def _py_release(stream):
    p = _producer(stream)
    p.released += 1
    stream.release = ffi.NULL
    stream.private_data = ffi.NULL
    _LIVE_PRODUCERS.discard(p)


class StreamError(Exception):
    def __init__(self, op, code, message):
        super().__init__("%s failed with code %d: %s" % (op, code, message))
        self.code = code
        self.message = message


def consume_device_stream(stream, fail_ok=False):
    """Reads a CPU ArrowDeviceArrayStream through its callbacks with pyarrow, releases it.

    Returns (schema, batches), or (schema, batches, StreamError) when ``fail_ok``."""
    assert stream.release != ffi.NULL, "the stream is released"
    assert stream.device_type == ARROW_DEVICE_CPU, stream.device_type

    def error(op, code):
        msg = stream.get_last_error(stream)
        return StreamError(op, code, "" if msg == ffi.NULL else ffi.string(msg).decode())

    batches = []
    try:
        c_schema = ffi.new("struct ArrowSchema*")
        rc = stream.get_schema(stream, c_schema)
        if rc:
            raise error("get_schema", rc)
        schema = pa.Schema._import_from_c(ptr(c_schema))
        while True:
            c_array = ffi.new("struct ArrowDeviceArray*")
            rc = stream.get_next(stream, c_array)
            if rc:
                assert c_array.array.release == ffi.NULL, "an array after an error"
                e = error("get_next", rc)
                if fail_ok:
                    return schema, batches, e
                raise e
            if c_array.array.release == ffi.NULL:
                break
            check_cpu_device_array(c_array, "batch %d" % len(batches))
            batch = pa.RecordBatch._import_from_c_device(ptr(c_array), schema)
            assert c_array.array.release == ffi.NULL, "pyarrow moved the array"
            batch.validate(full=True)
            batches.append(batch)
    finally:
        stream.release(stream)
        assert stream.release == ffi.NULL, "release marks the stream released"
    assert not fail_ok, "the stream did not fail"
    return schema, batches


# --------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------


def test_rust_arrays_to_pyarrow_and_back():
    schema, reference = reference_batches()
    n = lib().devarrow_interop_sample_count()
    assert n == len(reference) == 3
    for which in range(n):
        label = "sample %d" % which
        batch = rust_sample(which)
        assert batch.schema.equals(schema, check_metadata=True), label
        # The same data through devarrow's device array and arrow-rs's plain C stream.
        assert_batches_equal(reference[which], batch, label)
        # Back to Rust, which compares with its own batch.
        c_array = ffi.new("struct ArrowDeviceArray*")
        c_schema = ffi.new("struct ArrowSchema*")
        batch._export_to_c_device(ptr(c_array), ptr(c_schema))
        check_cpu_device_array(c_array, label)
        check(lib().devarrow_interop_check_sample(which, c_array, c_schema))
        assert c_array.array.release == ffi.NULL and c_schema.release == ffi.NULL
    # The extension types: arrow.uuid is recognized, devarrow.custom kept as metadata.
    batch = rust_sample(0)
    assert batch.schema.field("uuid").type == pa.uuid()
    md = batch.schema.field("utf8").metadata
    assert md[b"ARROW:extension:name"] == b"devarrow.custom", md
    assert batch.schema.metadata[b"producer"] == b"devarrow-interop"
    # The sliced sample arrives with nonzero offsets.
    c_array = ffi.new("struct ArrowDeviceArray*")
    c_schema = ffi.new("struct ArrowSchema*")
    check(lib().devarrow_interop_export_sample(1, c_array, c_schema))
    offsets = [c_array.array.children[i].offset for i in range(c_array.array.n_children)]
    assert sum(1 for o in offsets if o == 1) >= len(offsets) - 1, offsets
    c_array.array.release(ffi.addressof(c_array, "array"))
    c_schema.release(c_schema)


def test_rust_arrays_through_capsules():
    """The same round trip through the PyCapsule protocol."""
    _, reference = reference_batches()
    for which in range(lib().devarrow_interop_sample_count()):
        c_array = ffi.new("struct ArrowDeviceArray*")
        c_schema = ffi.new("struct ArrowSchema*")
        check(lib().devarrow_interop_export_sample(which, c_array, c_schema))
        # Capsules without a destructor: pyarrow moves the structs out at once, and the
        # cffi storage outlives the call.
        schema_capsule = _capsule_new(ptr(c_schema), SCHEMA_CAPSULE, None)
        array_capsule = _capsule_new(ptr(c_array), DEVICE_ARRAY_CAPSULE, None)
        batch = pa.RecordBatch._import_from_c_device_capsule(schema_capsule, array_capsule)
        assert c_array.array.release == ffi.NULL and c_schema.release == ffi.NULL
        assert_batches_equal(reference[which], batch, "capsule sample %d" % which)
        # Back through __arrow_c_device_array__: Rust moves the structs out of the
        # capsules, whose destructors then find them released.
        schema_capsule, array_capsule = batch.__arrow_c_device_array__()
        s = ffi.cast("struct ArrowSchema*", _capsule_get(schema_capsule, SCHEMA_CAPSULE))
        a = ffi.cast("struct ArrowDeviceArray*", _capsule_get(array_capsule, DEVICE_ARRAY_CAPSULE))
        check(lib().devarrow_interop_check_sample(which, a, s))
        assert a.array.release == ffi.NULL and s.release == ffi.NULL
        del schema_capsule, array_capsule


def test_pyarrow_arrays_to_rust_and_back():
    for i, batch in enumerate(pyarrow_samples()):
        label = "pyarrow sample %d" % i
        assert_batches_equal(batch, echo_through_rust(batch), label)
        # And through the capsule protocol.
        schema_capsule, array_capsule = batch.__arrow_c_device_array__()
        s = ffi.cast("struct ArrowSchema*", _capsule_get(schema_capsule, SCHEMA_CAPSULE))
        a = ffi.cast("struct ArrowDeviceArray*", _capsule_get(array_capsule, DEVICE_ARRAY_CAPSULE))
        out = ffi.new("struct ArrowDeviceArray*")
        out_schema = ffi.new("struct ArrowSchema*")
        check(lib().devarrow_interop_echo_device_array(a, s, out, out_schema))
        back = pa.RecordBatch._import_from_c_device(ptr(out), ptr(out_schema))
        assert_batches_equal(batch, back, label + " (capsules)")
    # Single arrays too (not only record batches): each column on its own.
    batch = pyarrow_samples()[1]
    for i, field in enumerate(batch.schema):
        array = batch.column(i)
        c_in = ffi.new("struct ArrowDeviceArray*")
        c_in_schema = ffi.new("struct ArrowSchema*")
        array._export_to_c_device(ptr(c_in), ptr(c_in_schema))
        c_out = ffi.new("struct ArrowDeviceArray*")
        c_out_schema = ffi.new("struct ArrowSchema*")
        check(lib().devarrow_interop_echo_device_array(c_in, c_in_schema, c_out, c_out_schema))
        back = pa.Array._import_from_c_device(ptr(c_out), ptr(c_out_schema))
        assert back.type == array.type, (field.name, back.type, array.type)
        assert back.equals(array), field.name


def test_comparison_detects_differences():
    """assert_batches_equal is not vacuous: it catches a changed value in a column pyarrow
    can convert, in a raw-read interval column, and changed metadata."""
    batch = rust_sample(0)
    names = batch.schema.names

    def replaced(name, array):
        return batch.set_column(names.index(name), batch.schema.field(name), array)

    def must_differ(other, what):
        try:
            assert_batches_equal(batch, other, what)
        except AssertionError:
            return
        raise AssertionError("no difference found: " + what)

    must_differ(replaced("large_utf8", pa.array(["a"] * ROWS, pa.large_string())), "utf8 value")
    must_differ(replaced("uuid", pa.array([uuid.UUID(int=9)] * ROWS, pa.uuid())), "uuid value")
    # Rows 0 and 1 swapped; in particular in the raw-read year-month interval column.
    i = names.index("interval_year_month")
    swapped = pa.concat_batches([batch.slice(1, 1), batch.slice(0, 1), batch.slice(2)])
    must_differ(swapped, "row order")
    must_differ(batch.replace_schema_metadata({"producer": "other"}), "schema metadata")
    field = batch.schema.field("utf8").with_metadata({"comment": "other"})
    must_differ(
        batch.set_column(names.index("utf8"), field, batch.column("utf8")), "field metadata"
    )
    assert _raw_interval_values(batch, i) != _raw_interval_values(swapped, i)


def test_rust_rejects_wrong_data():
    """devarrow's comparison and validation do fail: a different batch is reported."""
    batch = rust_sample(0)
    wrong = batch.set_column(2, "int8", pa.array([1, 2, 3, 4, 5, 6], pa.int8()))
    c_array = ffi.new("struct ArrowDeviceArray*")
    c_schema = ffi.new("struct ArrowSchema*")
    wrong._export_to_c_device(ptr(c_array), ptr(c_schema))
    try:
        check(lib().devarrow_interop_check_sample(0, c_array, c_schema))
    except InteropError as e:
        assert e.code == EINVAL and "int8" in e.message, e
    else:
        raise AssertionError("a different batch compared equal")
    assert c_array.array.release == ffi.NULL, "moved in even on failure"


def test_rust_device_stream_to_pyarrow():
    ref_schema, reference = reference_batches()
    c_stream = ffi.new("struct ArrowDeviceArrayStream*")
    check(lib().devarrow_interop_export_device_stream(c_stream))
    schema, batches = consume_device_stream(c_stream)
    assert schema.equals(ref_schema, check_metadata=True)
    assert len(batches) == len(reference) == 3
    for i, (e, a) in enumerate(zip(reference, batches)):
        assert_batches_equal(e, a, "device stream batch %d" % i)
    # An error in the middle: code and message through get_last_error.
    c_stream = ffi.new("struct ArrowDeviceArrayStream*")
    check(lib().devarrow_interop_export_failing_device_stream(c_stream, 1))
    _, batches, err = consume_device_stream(c_stream, fail_ok=True)
    assert len(batches) == 1
    assert_batches_equal(reference[0], batches[0], "batch before the error")
    assert err.code == EIO and "on purpose" in err.message, err


def test_pyarrow_device_stream_to_rust():
    ref_schema, reference = reference_batches()
    # Rust compares what a Python producer sends with its own samples.
    producer = PyDeviceStream(ref_schema, reference)
    c_stream = ffi.new("struct ArrowDeviceArrayStream*")
    producer.export(c_stream)
    check(lib().devarrow_interop_check_device_stream(c_stream))
    assert c_stream.release == ffi.NULL, "moved into Rust"
    assert producer.released == 1 and producer.next == len(reference)

    # Rust reads pyarrow's own batches and echoes them through arrow-rs's C stream.
    samples = pyarrow_samples()
    producer = PyDeviceStream(samples[0].schema, samples)
    c_stream = ffi.new("struct ArrowDeviceArrayStream*")
    producer.export(c_stream)
    out = ffi.new("struct ArrowArrayStream*")
    check(lib().devarrow_interop_echo_device_stream(c_stream, out))
    assert producer.released == 1
    reader = pa.RecordBatchReader._import_from_c(ptr(out))
    assert reader.schema.equals(samples[0].schema, check_metadata=True)
    echoed = list(reader)
    assert len(echoed) == len(samples)
    for i, (e, a) in enumerate(zip(samples, echoed)):
        assert_batches_equal(e, a, "echoed stream batch %d" % i)

    # Relayed lazily: Python producer -> devarrow reader -> devarrow producer -> Python.
    producer = PyDeviceStream(samples[0].schema, samples)
    c_stream = ffi.new("struct ArrowDeviceArrayStream*")
    producer.export(c_stream)
    relayed = ffi.new("struct ArrowDeviceArrayStream*")
    check(lib().devarrow_interop_relay_device_stream(c_stream, relayed))
    assert producer.next == 0, "nothing pulled yet"
    schema, batches = consume_device_stream(relayed)
    assert producer.released == 1, "releasing the relay releases the source"
    assert schema.equals(samples[0].schema, check_metadata=True)
    assert len(batches) == len(samples)
    for i, (e, a) in enumerate(zip(samples, batches)):
        assert_batches_equal(e, a, "relayed stream batch %d" % i)


def test_pyarrow_device_stream_errors_reach_rust():
    samples = pyarrow_samples()
    producer = PyDeviceStream(samples[0].schema, samples, fail_at=1)
    c_stream = ffi.new("struct ArrowDeviceArrayStream*")
    producer.export(c_stream)
    out = ffi.new("struct ArrowArrayStream*")
    try:
        check(lib().devarrow_interop_echo_device_stream(c_stream, out))
    except InteropError as e:
        assert e.code == EIO and "python producer failed on purpose at batch 1" in e.message, e
    else:
        raise AssertionError("the producer's error was lost")
    assert producer.released == 1 and out.release == ffi.NULL

    producer = PyDeviceStream(samples[0].schema, samples, fail_at=1)
    c_stream = ffi.new("struct ArrowDeviceArrayStream*")
    producer.export(c_stream)
    relayed = ffi.new("struct ArrowDeviceArrayStream*")
    check(lib().devarrow_interop_relay_device_stream(c_stream, relayed))
    _, batches, err = consume_device_stream(relayed, fail_ok=True)
    assert len(batches) == 1 and err.code == EIO, err
    assert "python producer failed on purpose at batch 1" in err.message, err
    assert producer.released == 1


def main(argv):
    if len(argv) > 1:
        os.environ["DEVARROW_INTEROP_LIB"] = argv[1]
    print("pyarrow {}, library {}".format(pa.__version__, os.environ.get("DEVARROW_INTEROP_LIB")))
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_") and callable(f)]
    failed = 0
    for name, test in tests:
        try:
            test()
        except Exception:
            failed += 1
            print(f"FAIL {name}")
            traceback.print_exc()
        else:
            print(f"ok   {name}")
    assert not _LIVE_PRODUCERS, "Python producers never released: %d" % len(_LIVE_PRODUCERS)
    print("%d passed, %d failed" % (len(tests) - failed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
