"""The array API's dtype handling and backend selection (CPU)."""
import sys

import numpy as np
import pytest

import cupyconv
from cupyconv import reference
from cupyconv.core import device


def test_backend_can_be_forced_to_the_reference(monkeypatch):
    monkeypatch.setenv("CUPYCONV_BACKEND", "numpy")
    assert cupyconv.backend() == "numpy"
    monkeypatch.setenv("CUPYCONV_BACKEND", "tpu")
    with pytest.raises(ValueError, match="CUPYCONV_BACKEND"):
        cupyconv.backend()


@pytest.fixture
def gpu_check_redone():
    """gpu_present() is cached per process; these tests change what it would find, on a GPU machine too."""
    device.gpu_present.cache_clear()
    yield
    device.gpu_present.cache_clear()


def test_forcing_cupy_without_cupy_says_how_to_install_it(monkeypatch, gpu_check_redone):
    monkeypatch.setitem(sys.modules, "cupy", None)   # "import cupy" fails as if it were not installed
    monkeypatch.setenv("CUPYCONV_BACKEND", "cupy")
    with pytest.raises(RuntimeError, match="CuPy is not installed") as info:
        cupyconv.backend()
    assert "pip install cupy-cuda12x" in str(info.value) and "[cuda12]" in str(info.value)
    x, w = np.ones((1, 2, 3, 3), np.float32), np.ones((2, 1, 2, 2), np.float32)
    with pytest.raises(RuntimeError, match="CuPy is not installed"):
        cupyconv.conv_transpose2d(x, w)
    # explain() reports the backend as unavailable rather than failing
    assert "CuPy is not installed" in cupyconv.explain(x.shape, w.shape).backend
    monkeypatch.delenv("CUPYCONV_BACKEND")
    assert cupyconv.backend() == "numpy"


def test_forcing_cupy_with_a_broken_cupy_passes_the_import_error_on(monkeypatch, gpu_check_redone):
    import builtins

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("libcudart.so.12: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setattr(builtins, "__import__", broken)
    monkeypatch.setenv("CUPYCONV_BACKEND", "cupy")
    with pytest.raises(RuntimeError, match="CuPy could not be imported: libcudart"):
        cupyconv.backend()


def test_numpy_bfloat16_arrays(monkeypatch):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    monkeypatch.setenv("CUPYCONV_BACKEND", "numpy")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 4, 5, 3)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((4, 3, 2, 3)).astype(ml_dtypes.bfloat16)
    y = cupyconv.conv_transpose2d(x, w, None, stride=(2, 1), groups=2, output_padding=(1, 0))
    assert y.dtype == x.dtype
    ref = reference.conv_transpose2d(x, w, None, (2, 1), (0, 0), (1, 0), 2, (1, 1))
    assert np.abs(y.astype(np.float64) - ref).max() <= 1e-2 * np.abs(ref).max()
    gi, gw, gb = cupyconv.conv_transpose2d_backward(y, x, w, stride=(2, 1), groups=2, output_padding=(1, 0))
    assert gi.dtype == gw.dtype == gb.dtype == x.dtype


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_reference_backend_rounds_to_the_input_dtype(monkeypatch, dtype):
    monkeypatch.setenv("CUPYCONV_BACKEND", "numpy")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 4, 4)).astype(dtype)
    w = rng.standard_normal((2, 2, 3, 3)).astype(dtype)
    b = rng.standard_normal(2).astype(dtype)
    y = cupyconv.conv_transpose2d(x, w, b, padding=1)
    expected = reference.conv_transpose2d(x, w, b, (1, 1), (1, 1), (0, 0), 1, (1, 1)).astype(dtype)
    assert y.dtype == dtype and np.array_equal(y, expected)
