"""A column handed to PyTorch and CuPy through DLPack, on a real GPU.

Skips, saying why, without a GPU (the emulated driver is not one for them: their own
CUDA runtime cannot use its memory) or without torch / cupy; with
``DEVARROW_REQUIRE_GPU=1`` a missing GPU fails instead.
"""

import os

import numpy as np
import pyarrow as pa
import pytest

import devarrow


def real_gpu():
    dev = devarrow.device("auto")
    emulated = "emulated" in dev.name  # devarrow-emu (tests/cuda-emu)
    if dev.kind == "cuda" and not emulated:
        return dev
    why = "the emulated driver (torch and cupy need a real GPU)" if emulated else dev.reason
    if os.environ.get("DEVARROW_REQUIRE_GPU") == "1" and not emulated:
        pytest.fail(f"DEVARROW_REQUIRE_GPU=1 but no GPU: {why}")
    print(f"skipping: no GPU: {why}")
    pytest.skip(f"no GPU: {why}")


def batch():
    return pa.record_batch({
        "f32": pa.array(np.arange(100_000, dtype=np.float32) / 3),
        "i64": pa.array(np.arange(100_000, dtype=np.int64) * 7),
    })


def test_torch_from_dlpack():
    dev = real_gpu()
    torch = pytest.importorskip("torch", reason="torch is not installed")
    b = batch()
    on_device = dev.to_device(b)
    for name in ["f32", "i64"]:
        t = torch.from_dlpack(on_device.column(name))
        assert t.is_cuda and t.shape == (b.num_rows,)
        np.testing.assert_array_equal(t.cpu().numpy(), b.column(name).to_numpy())


def test_cupy_from_dlpack():
    dev = real_gpu()
    cupy = pytest.importorskip("cupy", reason="cupy is not installed")
    b = batch()
    on_device = dev.to_device(b)
    for name in ["f32", "i64"]:
        a = cupy.from_dlpack(on_device.column(name))
        np.testing.assert_array_equal(cupy.asnumpy(a), b.column(name).to_numpy())
        c = cupy.asarray(on_device.column(name))  # __cuda_array_interface__
        np.testing.assert_array_equal(cupy.asnumpy(c), b.column(name).to_numpy())
