"""The NumPy/CuPy array API, in ``torch.nn.functional``'s argument order.

CuPy arrays stay on their device and run on CuPy's current stream with no host
synchronisation.  NumPy arrays run on the GPU when there is one and on the float64
reference otherwise; :func:`backend` says which.  Every argument is checked before any
compile or launch.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from . import engine, reference
from .core.arrays import common_placement
from .core.device import gpu_present
from .core import complex_parts, one_d
from .core.geometry import ConvParams, Geometry, geometry, output_mask as _output_mask
from .plans.launch import Launcher, cupy_allocator

BACKEND_ENV = "CUPYCONV_BACKEND"


def backend() -> str:
    """Where NumPy inputs are computed: ``"cupy"`` (a CUDA GPU) or ``"numpy"`` (the float64 reference).

    Set ``CUPYCONV_BACKEND=numpy`` to force the reference even when a GPU is present, and
    ``CUPYCONV_BACKEND=cupy`` to make a missing CuPy or GPU a RuntimeError instead of a fallback.
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced not in ("", "numpy", "cupy"):
        raise ValueError(f"{BACKEND_ENV} must be 'numpy' or 'cupy', got {forced!r}")
    if forced == "numpy":
        return "numpy"
    if forced == "cupy" and not gpu_present():
        _require_cupy()
        raise RuntimeError(f"{BACKEND_ENV}=cupy but no CUDA GPU is usable through CuPy")
    return "cupy" if gpu_present() else "numpy"


def _require_cupy() -> None:
    """A missing CuPy, told apart from a missing GPU: the fix is an install, not a driver."""
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "cupy":
            raise RuntimeError(
                f"{BACKEND_ENV}=cupy but CuPy is not installed. Install the CuPy for your CUDA version, e.g. "
                f"pip install cupy-cuda12x (CUDA 12) or cupy-cuda13x (CUDA 13); from a cupyconv checkout, "
                f"pip install \".[cuda12]\" or CUPYCONV_CUDA=12 bash scripts/setup.sh. Or unset {BACKEND_ENV} "
                f"to run NumPy inputs on the float64 NumPy reference.") from None
        raise RuntimeError(f"{BACKEND_ENV}=cupy but CuPy could not be imported: {exc}") from exc


# ---------------------------------------------------------------------------- GPU path

def _storage(array):
    """CuPy has no bfloat16: carry such arrays as their uint16 bits."""
    return array.view("uint16") if str(array.dtype) == "bfloat16" else array


def _upload(array, cupy):
    if array is None:
        return None
    return cupy.ascontiguousarray(cupy.asarray(_storage(array)))


def _gpu_forward(g: Geometry, dtype: str, device: int, x, weight, bias):
    import cupy

    with cupy.cuda.Device(device):
        x, weight, bias = (_upload(a, cupy) for a in (x, weight, bias))
        out = cupy.empty(g.output_shape, dtype=x.dtype)
        launcher = Launcher(device, cupy.cuda.get_current_stream().ptr, cupy_allocator())
        engine.forward(g, dtype, x.data.ptr, weight.data.ptr, None if bias is None else bias.data.ptr,
                       out.data.ptr, launcher)
    return out


def _gpu_backward(g: Geometry, dtype: str, device: int, grad_out, x, weight, mask):
    import cupy

    with cupy.cuda.Device(device):
        grad_out, x, weight = (_upload(a, cupy) for a in (grad_out, x, weight))
        gi = cupy.empty(g.input_shape, dtype=x.dtype) if mask[0] else None
        gw = cupy.empty(g.weight_shape, dtype=x.dtype) if mask[1] else None
        gb = cupy.empty((g.out_channels,), dtype=x.dtype) if mask[2] else None
        launcher = Launcher(device, cupy.cuda.get_current_stream().ptr, cupy_allocator())
        engine.backward(g, dtype, grad_out.data.ptr, x.data.ptr, weight.data.ptr,
                        *(None if a is None else a.data.ptr for a in (gi, gw, gb)), launcher)
    return gi, gw, gb


def _download(array, like):
    if array is None:
        return None
    host = array.get()
    return host.view(like.dtype) if host.dtype != like.dtype else host


def _rounded(result, like):
    """The float64 reference's result in ``like``'s dtype."""
    # A value beyond a 16-bit dtype's range rounds to +-inf, as the kernels' stores and torch
    # round it; that is the result, so NumPy's "overflow encountered in cast" is not news.
    with np.errstate(over="ignore"):
        return result.astype(like.dtype)


# ----------------------------------------------------------------------------- the API

def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """2-D transposed convolution of NumPy or CuPy arrays, with PyTorch's semantics.

    ``input`` is (N, C_in, H, W) or unbatched (C_in, H, W); ``weight`` is
    (C_in, C_out // groups, kH, kW); ``bias`` is (C_out,) or None.  ``stride``,
    ``padding``, ``output_padding`` and ``dilation`` are ints or pairs of ints.
    Returns an array of the input's type, dtype and device, of shape
    (N, C_out, H_out, W_out) with H_out = (H-1)*stride - 2*padding + dilation*(kH-1)
    + output_padding + 1, or without N for unbatched input.
    """
    params = ConvParams.from_args(stride, padding, output_padding, groups, dilation)
    if _complex(input):
        return _complex_forward(input, weight, bias, params)
    kind, device, dtype = common_placement([("input", input), ("weight", weight), ("bias", bias)])
    g = geometry(input.shape, weight.shape, None if bias is None else bias.shape, params)
    x = input if g.batched else input[None]
    if kind == "cupy":
        out = _gpu_forward(g, dtype, device, x, weight, bias)
        return out.reshape(g.user_shape(g.output_shape))
    if backend() == "cupy":
        out = _download(_gpu_forward(g, dtype, 0, x, weight, bias), input)
    else:
        out = _rounded(reference.conv_transpose2d(x, weight, bias, params.stride, params.padding,
                                                  params.output_padding, params.groups, params.dilation), input)
    return out.reshape(g.user_shape(g.output_shape))


def conv_transpose2d_backward(grad_output, input, weight, stride=1, padding=0, output_padding=0, groups=1,
                              dilation=1, output_mask: Sequence[bool] = (True, True, True)):
    """Gradients of :func:`conv_transpose2d` with respect to input, weight and bias.

    Returns ``(grad_input, grad_weight, grad_bias)``; an entry is None where
    ``output_mask`` is False.  grad_bias is ``grad_output.sum((0, 2, 3))``, whether or
    not the forward had a bias.  grad_weight and grad_bias are bitwise reproducible.
    """
    mask = _output_mask(output_mask)
    params = ConvParams.from_args(stride, padding, output_padding, groups, dilation)
    if _complex(input):
        return _complex_backward(grad_output, input, weight, params, mask)
    kind, device, dtype = common_placement([("grad_output", grad_output), ("input", input), ("weight", weight)])
    g = geometry(input.shape, weight.shape, None, params)
    expected = g.user_shape(g.output_shape)
    if tuple(grad_output.shape) != expected:
        raise ValueError(f"grad_output must have the output's shape {expected}, got {tuple(grad_output.shape)}")
    x = input if g.batched else input[None]
    go = grad_output if g.batched else grad_output[None]
    if kind == "cupy":
        gi, gw, gb = _gpu_backward(g, dtype, device, go, x, weight, mask)
    elif backend() == "cupy":
        gi, gw, gb = (_download(a, input) for a in _gpu_backward(g, dtype, 0, go, x, weight, mask))
    else:
        results = reference.conv_transpose2d_backward(go, x, weight, params.stride, params.padding,
                                                      params.output_padding, params.groups, params.dilation,
                                                      mask)
        gi, gw, gb = (None if r is None else _rounded(r, input) for r in results)
    if gi is not None:
        gi = gi.reshape(g.user_shape(g.input_shape))
    return gi, gw, gb


# ---------------------------------------------------------------------- complex arrays
#
# Three real layers per complex one (core/complex_parts.py), on the arrays' real and
# imaginary parts (views), assembled into an array of the inputs' complex dtype.

_COMPLEX = ("complex64", "complex128")


def _complex(array) -> bool:
    return str(getattr(array, "dtype", "")) in _COMPLEX


def _check_complex(named):
    """Every array complex, of one dtype, on one device: the real parts then pass the usual checks."""
    first = None
    for name, array in named:
        if array is None:
            continue
        dtype = str(getattr(array, "dtype", ""))
        if first is None:
            first = (name, dtype)
        elif dtype != first[1]:
            raise TypeError(f"all arrays must have the same dtype: {first[0]} is {first[1]} but {name} is {dtype}")
    common_placement([(name, None if a is None else a.real) for name, a in named])


def _assemble(re, im, like):
    out = re.astype(like.dtype)
    out.imag = im
    return out


def _complex_forward(input, weight, bias, params: ConvParams):
    _check_complex((("input", input), ("weight", weight), ("bias", bias)))
    geometry(input.shape, weight.shape, None if bias is None else bias.shape, params)
    args = (params.stride, params.padding, params.output_padding, params.groups, params.dilation)
    re, im = complex_parts.forward(lambda a, c: conv_transpose2d(a, c, None, *args), input.real, input.imag,
                                   weight.real, weight.imag)
    if bias is not None:
        re, im = re + bias.real[:, None, None], im + bias.imag[:, None, None]
    return _assemble(re, im, input)


def _complex_backward(grad_output, input, weight, params: ConvParams, mask):
    _check_complex((("grad_output", grad_output), ("input", input), ("weight", weight)))
    args = (params.stride, params.padding, params.output_padding, params.groups, params.dilation)
    x_re, w_re = input.real, weight.real

    def part(which, go, x, w):
        only = tuple(i == which for i in range(3))
        return conv_transpose2d_backward(go, x, w, *args, output_mask=only)[which]
    gi = gw = gb = None
    if mask[0]:
        gi = _assemble(*complex_parts.grad_input(lambda g, c: part(0, g, x_re, c), grad_output.real,
                                                 grad_output.imag, weight.real, weight.imag), input)
    if mask[1]:
        gw = _assemble(*complex_parts.grad_weight(lambda a, g: part(1, g, a, w_re), input.real, input.imag,
                                                  grad_output.real, grad_output.imag), input)
    if mask[2]:
        gb = _assemble(part(2, grad_output.real, x_re, w_re), part(2, grad_output.imag, x_re, w_re), input)
    return gi, gw, gb


def _shape(array, name):
    shape = getattr(array, "shape", None)
    if shape is None or not hasattr(array, "reshape"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(array).__name__}")
    return tuple(shape)


def _one_row(array):
    """(..., L) as (..., 1, L): a view for NumPy and CuPy arrays alike."""
    return array.reshape(array.shape[:-1] + (1, array.shape[-1]))


def _drop_row(array):
    return None if array is None else array.reshape(array.shape[:-2] + (array.shape[-1],))


def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """1-D transposed convolution of NumPy or CuPy arrays, with PyTorch's semantics.

    ``input`` is (N, C_in, L) or unbatched (C_in, L); ``weight`` is (C_in, C_out // groups, k);
    ``bias`` is (C_out,) or None; the other arguments are ints (or one-element sequences).
    It runs on the 2-D kernels as a one-row layer.
    """
    s, p, op, d = one_d.params_2d(stride, padding, output_padding, dilation)
    one_d.check_ranks(_shape(input, "input"), _shape(weight, "weight"))
    return _drop_row(conv_transpose2d(_one_row(input), _one_row(weight), bias, s, p, op, groups, d))


def conv_transpose1d_backward(grad_output, input, weight, stride=1, padding=0, output_padding=0, groups=1,
                              dilation=1, output_mask: Sequence[bool] = (True, True, True)):
    """Gradients of :func:`conv_transpose1d`: ``(grad_input, grad_weight, grad_bias)``, None where masked."""
    s, p, op, d = one_d.params_2d(stride, padding, output_padding, dilation)
    input_shape = _shape(input, "input")
    one_d.check_ranks(input_shape, _shape(weight, "weight"))
    if len(_shape(grad_output, "grad_output")) != len(input_shape):
        raise ValueError(f"grad_output must have the output's rank {len(input_shape)}, got shape "
                         f"{tuple(grad_output.shape)}")
    gi, gw, gb = conv_transpose2d_backward(_one_row(grad_output), _one_row(input), _one_row(weight), s, p, op,
                                           groups, d, output_mask)
    return _drop_row(gi), _drop_row(gw), gb
