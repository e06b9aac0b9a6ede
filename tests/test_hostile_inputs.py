"""Hostile inputs through every API: the NumPy and CuPy arrays API, torch's functional and the module.

Each row of the tables below is one call: a base layer with some arguments replaced.  Every
API must either behave as torch does (same output shape, values, NaN and Inf positions,
gradients), or raise a ValueError or TypeError whose message names the bad argument, and
nothing may bring the process down.  A separate test runs each row through torch itself,
so the table cannot drift from what torch does: where cupyconv deliberately differs (it
rejects what torch quietly accepts, like a float32 bias on float64 input), the row says so.

The CPU tests run the NumPy reference path and torch's CPU tensors; the ``gpu`` tests run
the same rows on CuPy arrays and CUDA tensors (NaN/Inf only where torch's result does not
depend on how the convolution is computed: in the input for the forward pass and in
grad_output for the backward), plus NaN/Inf on the tensor-core kernels in every dtype.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Optional, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------- table rows

@dataclass(frozen=True)
class A:
    """An array argument, made for whichever API runs the row."""

    shape: Tuple[int, ...]
    dtype: str = "float64"
    seed: int = 0
    plant: Optional[float] = None      # NaN or +-Inf written at one interior element
    device: str = "same"               # "other": another device than the rest
    view: str = "contiguous"           # "sliced", "channels_last", "transposed", "expanded"


@dataclass(frozen=True)
class Foreign:
    """An array of the other library: a torch tensor for the array API, a NumPy array for torch."""

    shape: Tuple[int, ...]


GO = object()  # grad_output of the shape the row's forward produces


@dataclass(frozen=True)
class Ok:
    """Must work and agree with torch."""


@dataclass(frozen=True)
class Raises:
    types: Tuple[type, ...]
    name: str                          # a regex the message must match

    def __init__(self, types, name):
        object.__setattr__(self, "types", types if isinstance(types, tuple) else (types,))
        object.__setattr__(self, "name", name)


OK = Ok()


@dataclass(frozen=True)
class Row:
    id: str
    args: Tuple[Tuple[str, object], ...]
    expect: object
    torch_differs: str = ""   # why torch's own outcome differs from ``expect`` (checked)
    torch_check: bool = True  # False: running torch itself on this row is unsafe (huge allocation)
    gpu: bool = True          # False: torch's result depends on how the convolution is computed

    @property
    def kwargs(self) -> dict:
        return dict(self.args)


X, W, B = A((2, 4, 5, 6)), A((4, 3, 3, 2), seed=1), A((3,), seed=2)
FWD_BASE = dict(input=X, weight=W, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1)
BWD_BASE = dict(grad_output=GO, input=X, weight=W, stride=1, padding=0, output_padding=0, groups=1, dilation=1,
                output_mask=(True, True, True))


def fwd(id, expect=OK, **overrides):
    extra = {k: overrides.pop(k) for k in ("torch_differs", "torch_check", "gpu") if k in overrides}
    return Row(id, tuple(dict(FWD_BASE, **overrides).items()), expect, **extra)


def bwd(id, expect=OK, **overrides):
    extra = {k: overrides.pop(k) for k in ("torch_differs", "torch_check", "gpu") if k in overrides}
    return Row(id, tuple(dict(BWD_BASE, **overrides).items()), expect, **extra)


def R(types, name):
    return Raises(types, name)


VE, TE = ValueError, TypeError
INT_PARAMS = ("stride", "padding", "output_padding", "dilation")

FORWARD_ROWS = [
    fwd("valid"),
    fwd("valid_bias", bias=B),
    fwd("asymmetric_everything", input=A((3, 6, 4, 7)), weight=A((6, 2, 2, 3), seed=1), bias=A((6,), seed=2),
        stride=(2, 3), padding=(1, 0), output_padding=(1, 2), groups=3, dilation=(2, 1)),
    fwd("unbatched", input=A((4, 5, 6)), bias=B),
    fwd("output_padding_below_dilation", output_padding=1, dilation=2),
    fwd("numpy_integers", stride=np.int64(2), padding=(np.int32(1), 0), groups=np.int64(1)),
    fwd("list_and_one_element_params", stride=[2], padding=[1, 0], dilation=[1]),
    # ranks
    *[fwd(f"input_rank_{len(s)}", R(VE, "input"), input=A(s)) for s in [(), (5,), (4, 5), (1, 2, 4, 5, 6)]],
    *[fwd(f"weight_rank_{len(s)}", R(VE, "weight"), weight=A(s)) for s in [(4, 3), (4, 3, 3), (4, 3, 3, 2, 1)]],
    fwd("bias_rank_0", R(VE, "bias"), bias=A(())),
    fwd("bias_rank_2", R(VE, "bias"), bias=A((1, 3))),
    # shapes
    fwd("channel_mismatch", R(VE, "weight"), weight=A((5, 3, 3, 2))),
    fwd("channel_mismatch_unbatched", R(VE, "weight"), input=A((3, 5, 6))),
    fwd("groups_not_dividing", R(VE, "groups"), groups=3),
    fwd("groups_above_channels", R(VE, "groups"), groups=8),
    fwd("bias_length", R(VE, "bias"), bias=A((4,))),
    fwd("bias_length_with_groups", R(VE, "bias"), bias=B, groups=2),
    fwd("non_positive_output", R(VE, "padding"), input=A((2, 4, 1, 1)), weight=A((4, 3, 1, 1)), padding=1),
    # empty and zero-size
    fwd("empty_batch", input=A((0, 4, 5, 6)), bias=B),
    fwd("empty_batch_zero_height", input=A((0, 4, 0, 6)), bias=B),
    fwd("empty_batch_zero_height_and_width", input=A((0, 4, 0, 0))),
    fwd("empty_batch_zero_output_height", input=A((0, 4, 0, 6)), padding=1),
    fwd("empty_batch_negative_output", R(VE, "padding"), input=A((0, 4, 0, 6)), padding=2),
    fwd("empty_batch_no_channels", R(VE, "input"), input=A((0, 0, 5, 6)), weight=A((0, 3, 3, 2))),
    fwd("no_channels", R(VE, "input"), input=A((2, 0, 5, 6)), weight=A((0, 3, 3, 2))),
    fwd("no_channels_unbatched", R(VE, "input"), input=A((0, 5, 6)), weight=A((0, 3, 3, 2))),
    fwd("zero_height", R(VE, "input"), input=A((2, 4, 0, 6))),
    fwd("zero_width", R(VE, "input"), input=A((2, 4, 5, 0))),
    fwd("zero_height_unbatched", R(VE, "input"), input=A((4, 0, 6))),
    *[fwd(f"weight_zero_dim_{d}", R(VE, "weight"), weight=A(shape)) for d, shape in
      ((1, (4, 0, 3, 2)), (2, (4, 3, 0, 2)), (3, (4, 3, 3, 0)))],
    # out-of-range integers
    *[fwd(f"{name}_{value}", R(VE, name), **{name: value}) for name, value in
      [("stride", 0), ("stride", -1), ("stride", (1, 0)), ("padding", -1), ("padding", (0, -3)), ("dilation", 0),
       ("dilation", (1, -2)), ("output_padding", -1), ("groups", 0), ("groups", -2)]],
    fwd("output_padding_not_below_stride_or_dilation", R(VE, "output_padding"), output_padding=1),
    fwd("output_padding_per_axis", R(VE, "output_padding"), output_padding=(0, 2), stride=(1, 2)),
    *[fwd(f"{name}_2pow{p}", R(VE, name), torch_check=p < 40 or name != "padding", **{name: 2 ** p})
      for name in ("stride", "padding", "dilation", "groups") for p in (31, 63, 64, 100)],
    fwd("output_padding_2pow31", R(VE, "output_padding"), output_padding=2 ** 31, stride=2 ** 31),
    fwd("dilation_times_kernel_past_int32", R(VE, "dilation"), dilation=2 ** 30, torch_check=False),
    # bools, floats and other objects where ints belong
    *[fwd(f"{name}_{label}", R(TE, name), **{name: value})
      for name in INT_PARAMS
      for label, value in [("bool", True), ("float", 1.0), ("str", "1"), ("none", None), ("npfloat", np.float64(1.0)),
                           ("decimal", Decimal(1)), ("float_in_pair", (1, 1.5)), ("nested", [[1, 1]]),
                           ("ndarray", np.array([1, 1])), ("set", {1})]],
    *[fwd(f"{name}_{len(value)}_values", R(VE, name), **{name: value})
      for name in INT_PARAMS for value in [(), (1, 1, 1)]],
    *[fwd(f"groups_{label}", R(TE, "groups"), **{"groups": value})
      for label, value in [("bool", True), ("float", 1.0), ("str", "1"), ("none", None), ("tuple", (1,)),
                           ("npfloat", np.float32(1))]],
    fwd("stride_bool_in_pair", R(TE, "stride"), stride=(1, True), torch_differs="torch takes a bool inside a pair"),
    fwd("stride_tensor", R(TE, "stride"), stride=torch.tensor(2), torch_differs="torch takes 0-d integer tensors"),
    fwd("groups_tensor", R(TE, "groups"), groups=torch.tensor(1), torch_differs="torch takes 0-d integer tensors"),
    # dtypes
    *[fwd(f"input_{dt}", R(TE, "input"), input=A((2, 4, 5, 6), dt), weight=A((4, 3, 3, 2), dt, seed=1),
          torch_differs="torch's CPU kernel also takes int64" if dt == "int64" else "")
      for dt in ("int32", "int64", "bool", "uint8")],
    fwd("complex_input_real_weight", R(TE, "weight"), input=A((2, 4, 5, 6), "complex128"),
        weight=A((4, 3, 3, 2), "float64", seed=1)),
    fwd("mixed_input_weight", R(TE, "weight"), input=A((2, 4, 5, 6), "float32")),
    fwd("bias_float32", R(TE, "bias"), bias=A((3,), "float32"), torch_differs="torch casts a bias of another dtype"),
    fwd("bias_int", R(TE, "bias"), bias=A((3,), "int64"), torch_differs="torch casts a bias of another dtype"),
    *[fwd(f"all_{dt}", input=A((2, 4, 5, 6), dt), weight=A((4, 3, 3, 2), dt, seed=1), bias=A((3,), dt, seed=2))
      for dt in ("float32", "float16", "bfloat16")],
    # devices
    *[fwd(f"{name}_elsewhere", R(VE, "weight" if name == "input" else name),
          torch_differs="torch lets meta tensors (the other device on the CPU) mix with CPU ones",
          **{name: replace(FWD_BASE[name] or B, device="other")}) for name in ("input", "weight", "bias")],
    # not arrays at all
    *[fwd(f"input_{label}", R(TE, "input"), input=value)
      for label, value in [("list", [[1.0]]), ("tuple", (1.0,)), ("float", 1.0), ("str", "x"), ("none", None)]],
    *[fwd(f"weight_{label}", R(TE, "weight"), weight=value) for label, value in [("list", [[1.0]]), ("none", None)]],
    *[fwd(f"bias_{label}", R(TE, "bias"), bias=value) for label, value in [("list", [1.0, 2.0, 3.0]), ("float", 1.0)]],
    fwd("input_of_the_other_library", R(TE, "input"), input=Foreign((2, 4, 5, 6))),
    fwd("weight_of_the_other_library", R(TE, "weight"), weight=Foreign((4, 3, 3, 2))),
    # memory layouts and views
    fwd("input_strided", input=A((2, 4, 5, 6), view="sliced"), bias=B),
    fwd("input_channels_last", input=A((2, 4, 5, 6), view="channels_last")),
    fwd("input_broadcast", input=A((2, 4, 5, 6), view="expanded")),
    fwd("weight_transposed", weight=A((4, 3, 3, 2), seed=1, view="transposed")),
    fwd("bias_strided", bias=A((3,), seed=2, view="sliced")),
    # NaN and Inf
    *[fwd(f"input_{label}", input=A((2, 4, 5, 6), plant=v), bias=B)
      for label, v in [("nan", NAN), ("inf", INF), ("minus_inf", -INF)]],
    fwd("input_inf_float16", input=A((2, 4, 5, 6), "float16", plant=INF), weight=A((4, 3, 3, 2), "float16", seed=1)),
    # on the GPU a weight tap of an empty input position may be multiplied by a zero (0 * inf)
    # or skipped; torch's result depends on the algorithm there
    *[fwd(f"weight_{label}", weight=A((4, 3, 3, 2), seed=1, plant=v), gpu=False)
      for label, v in [("nan", NAN), ("inf", INF)]],
    fwd("bias_nan", bias=A((3,), seed=2, plant=NAN)),
]

BACKWARD_ROWS = [
    bwd("valid"),
    bwd("unbatched", grad_output=GO, input=A((4, 5, 6))),
    bwd("asymmetric_everything", input=A((3, 6, 4, 7)), weight=A((6, 2, 2, 3), seed=1), stride=(2, 3),
        padding=(1, 0), output_padding=(1, 2), groups=3, dilation=(2, 1)),
    bwd("only_weight", output_mask=(False, True, False)),
    bwd("numpy_bools_mask", output_mask=[np.True_, False, np.bool_(True)]),
    bwd("nothing", output_mask=(False, False, False)),
    bwd("empty_batch", input=A((0, 4, 5, 6))),
    bwd("empty_batch_zero_height", input=A((0, 4, 0, 6))),
    *[bwd(f"grad_output_shape_{i}", R(VE, "grad_output"), grad_output=A(s, seed=3))
      for i, s in enumerate([(2, 3, 7, 6), (2, 4, 7, 7), (1, 3, 7, 7), (3, 7, 7), (2, 3, 7, 7, 1), (2, 3, 9, 9)])],
    bwd("grad_output_batched_for_unbatched_input", R(VE, "grad_output"), input=A((4, 5, 6)),
        grad_output=A((1, 3, 7, 7), seed=3)),
    *[bwd(f"grad_output_{dt}", R(TE, "grad_output"), grad_output=A((2, 3, 7, 7), dt, seed=3),
          torch_differs="autograd casts a gradient to its output's dtype") for dt in ("float32", "int64")],
    bwd("grad_output_elsewhere", R(VE, "grad_output"), grad_output=A((2, 3, 7, 7), seed=3, device="other")),
    bwd("grad_output_list", R(TE, "grad_output"), grad_output=[[1.0]]),
    bwd("grad_output_none", R(TE, "grad_output"), grad_output=None),
    bwd("input_none", R(TE, "input"), input=None),
    bwd("weight_mismatch", R(VE, "weight"), weight=A((5, 3, 3, 2), seed=1)),
    bwd("zero_height", R(VE, "input"), input=A((2, 4, 0, 6))),
    # one check on every path: the wrong type is a TypeError, the wrong length a ValueError
    *[bwd(f"mask_{label}", R(exc, "output_mask"), output_mask=value)
      for label, value, exc in [("two", (True, True), VE), ("four", [True] * 4, VE), ("ints", (1, 1, 1), TE),
                                ("none", None, TE), ("str", "TTT", TE), ("nested", ((True,), True, True), TE)]],
    *[bwd(f"{name}_{label}", R(exc, name), **{name: value}) for name, label, value, exc in
      [("stride", "float", 2.0, TE), ("stride", "zero", 0, VE), ("groups", "bool", True, TE),
       ("dilation", "big", 2 ** 40, VE), ("output_padding", "too_large", 1, VE), ("padding", "negative", -1, VE)]],
    bwd("grad_output_nan", grad_output=A((2, 3, 7, 7), seed=3, plant=NAN)),
    bwd("grad_output_inf", grad_output=A((2, 3, 7, 7), seed=3, plant=INF)),
    bwd("grad_output_minus_inf", grad_output=A((2, 3, 7, 7), seed=3, plant=-INF)),
    bwd("grad_output_strided", grad_output=A((2, 3, 7, 7), seed=3, view="sliced")),
    bwd("grad_output_broadcast", grad_output=A((2, 3, 7, 7), seed=3, view="expanded")),
    bwd("input_channels_last", input=A((2, 4, 5, 6), view="channels_last")),
    # a NaN in the input meets zero padding in grad_weight (0 * nan) or is skipped, by algorithm
    bwd("input_nan", input=A((2, 4, 5, 6), plant=NAN), gpu=False),
    bwd("weight_inf", weight=A((4, 3, 3, 2), seed=1, plant=INF), gpu=False),
]


# ------------------------------------------------------------------- making the arguments

def _numpy_dtype(name):
    if name == "bfloat16":
        return pytest.importorskip("ml_dtypes").bfloat16
    return np.dtype(name)


def _host_values(a: A) -> np.ndarray:
    rng = np.random.default_rng(a.seed)
    values = rng.standard_normal(a.shape)
    if a.plant is not None and values.size:
        values[tuple(s // 2 for s in a.shape)] = a.plant
    if a.view == "expanded" and values.ndim:
        values = np.broadcast_to(values[:1], a.shape).copy()
    return values


def _np_view(values: np.ndarray, kind: str, xp=np):
    if kind == "sliced" and values.ndim:
        buf = xp.zeros(values.shape[:-1] + (2 * values.shape[-1],), dtype=values.dtype)
        buf[..., ::2] = values
        return buf[..., ::2]
    if kind == "channels_last" and values.ndim == 4:
        return xp.ascontiguousarray(values.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    if kind == "transposed" and values.ndim >= 2:
        return xp.ascontiguousarray(xp.swapaxes(values, -1, -2)).swapaxes(-1, -2)
    if kind == "expanded" and values.ndim:
        return xp.broadcast_to(values[:1], values.shape)
    return values


def _torch_view(t, kind: str):
    if kind == "sliced" and t.dim():
        buf = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
        buf[..., ::2] = t
        return buf[..., ::2]
    if kind == "channels_last" and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "expanded" and t.dim():
        return t[:1].expand(t.shape)
    return t


BACKENDS = {
    # name: (library, device, the other device)
    "numpy": ("numpy", None, None),        # forced onto the float64 reference
    "numpy_gpu": ("numpy", None, "cupy"),  # NumPy arrays computed on the GPU
    "torch": ("torch", "cpu", "meta"),
    "cupy": ("cupy", None, "numpy"),
    "torch_cuda": ("torch", "cuda", "cpu"),
}


def make(value, backend: str):
    """The argument ``value`` (a table entry) as the API of ``backend`` takes it."""
    lib, device, other = BACKENDS[backend]
    if isinstance(value, Foreign):
        values = np.zeros(value.shape)
        return torch.from_numpy(values) if lib != "torch" else values
    if not isinstance(value, A):
        return value
    values = _host_values(value)
    if value.device == "other":
        if other is None:
            pytest.skip("needs a second device: the GPU set covers it")
        if other == "numpy":
            return values.astype(_numpy_dtype(value.dtype))
        if other == "cupy":
            lib = "cupy"
        else:
            lib, device = "torch", other
    if lib == "numpy":
        return _np_view(values.astype(_numpy_dtype(value.dtype)), value.view)
    if lib == "cupy":
        import cupy

        if value.dtype == "bfloat16":
            pytest.skip("CuPy has no bfloat16")
        return _np_view(cupy.asarray(values.astype(value.dtype)), value.view, cupy)
    t = torch.from_numpy(values).to(getattr(torch, value.dtype))
    return _torch_view(t.to(device), value.view)


def to_torch64(arr):
    """Any backend's array as a CPU float64 tensor (for the reference)."""
    if isinstance(arr, torch.Tensor):
        return arr.detach().cpu().double()
    if type(arr).__module__.startswith("cupy"):
        import cupy

        arr = cupy.asnumpy(arr)
    return torch.from_numpy(np.asarray(arr).astype(np.float64))


def _go_shape(kwargs) -> tuple:
    x, w = kwargs["input"], kwargs["weight"]
    params = {k: kwargs[k] for k in ("stride", "padding", "output_padding", "groups", "dilation")}
    xs = x.shape if isinstance(x, A) else (2, 4, 5, 6)
    ws = w.shape if isinstance(w, A) else (4, 3, 3, 2)
    try:
        y = F.conv_transpose2d(torch.zeros(xs, device="meta"), torch.zeros(ws, device="meta"), None, **params)
        return tuple(y.shape)
    except Exception:
        return (2, 3, 7, 7)


def build(row: Row, backend: str) -> dict:
    kwargs = row.kwargs
    if kwargs.get("grad_output") is GO:
        kwargs["grad_output"] = A(_go_shape(kwargs), kwargs["input"].dtype if isinstance(kwargs["input"], A)
                                  else "float64", seed=3)
    return {k: make(v, backend) for k, v in kwargs.items()}


# ------------------------------------------------------------------------------ calling

PARAMS = ("stride", "padding", "output_padding", "groups", "dilation")


def call_forward(backend: str, args: dict, module: bool = False):
    params = {k: args[k] for k in PARAMS}
    if not backend.startswith("torch"):
        return cupyconv.conv_transpose2d(args["input"], args["weight"], args["bias"], **params)
    return ct.conv_transpose2d(args["input"], args["weight"], args["bias"], **params)


def call_backward(backend: str, args: dict):
    params = {k: args[k] for k in PARAMS}
    fn = ct.conv_transpose2d_backward if backend.startswith("torch") else cupyconv.conv_transpose2d_backward
    return fn(args["grad_output"], args["input"], args["weight"], output_mask=args["output_mask"], **params)


def _tolerance(dtype_name: str) -> float:
    return {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}[dtype_name]


def _dtype_name(arr) -> str:
    return str(arr.dtype).replace("torch.", "")


def assert_like_torch(got, want: torch.Tensor, like, what: str, tol: Optional[float] = None):
    """``got`` (any backend) equals torch's float64 ``want``: type, device, dtype, shape, NaN/Inf, values."""
    assert got is not None, f"{what}: missing"
    assert type(got) is type(like) or (isinstance(got, torch.Tensor) and isinstance(like, torch.Tensor)), \
        f"{what}: {type(got).__name__} for {type(like).__name__} input"
    if isinstance(got, torch.Tensor):
        assert got.device == like.device, f"{what}: on {got.device}"
    elif hasattr(got, "device") and hasattr(like, "device"):
        assert got.device == like.device, f"{what}: on {got.device}"
    assert _dtype_name(got) == _dtype_name(like), f"{what}: dtype {got.dtype}"
    g = to_torch64(got)
    assert tuple(g.shape) == tuple(want.shape), f"{what}: shape {tuple(g.shape)} != {tuple(want.shape)}"
    for check in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(check(g), check(want)), f"{what}: {check.__name__} differs from torch"
    finite = torch.isfinite(want)
    if finite.any():
        scale = want[finite].abs().max().clamp_min(1e-30)
        err = float((g[finite] - want[finite]).abs().max() / scale)
        assert err <= (tol or _tolerance(_dtype_name(like))), f"{what}: relative error {err:.2e}"


def _reference_forward(args: dict):
    x, w = to_torch64(args["input"]), to_torch64(args["weight"])
    b = None if args["bias"] is None else to_torch64(args["bias"])
    params = {k: (v if not isinstance(v, np.integer) else int(v)) for k, v in args.items() if k in PARAMS}
    return F.conv_transpose2d(x, w, b, **params)


def _reference_backward(args: dict):
    x = to_torch64(args["input"]).requires_grad_()
    w = to_torch64(args["weight"]).requires_grad_()
    go = to_torch64(args["grad_output"])
    params = {k: v for k, v in args.items() if k in PARAMS}
    y = F.conv_transpose2d(x, w, None, **params)
    y.backward(go)
    gb = go.sum(dim=tuple(d for d in range(go.dim()) if d != go.dim() - 3))
    mask = [bool(m) for m in args["output_mask"]]
    return tuple(g if m else None for g, m in zip((x.grad, w.grad, gb), mask))


def check_raises(expect: Raises, fn):
    with pytest.raises(Exception) as info:
        fn()
    assert isinstance(info.value, expect.types), \
        f"raised {type(info.value).__name__}: {info.value}; wanted {'/'.join(t.__name__ for t in expect.types)}"
    assert re.search(expect.name, str(info.value)), f"the message does not name {expect.name!r}: {info.value}"


def run_forward_row(row: Row, backend: str):
    args = build(row, backend)
    if isinstance(row.expect, Raises):
        check_raises(row.expect, lambda: call_forward(backend, args))
        return
    got = call_forward(backend, args)
    assert_like_torch(got, _reference_forward(args), args["input"], f"{row.id} output")
    planted = any(isinstance(v, A) and v.plant is not None for v in row.kwargs.values())
    if backend.startswith("torch") and not planted:
        # through autograd too: the gradients as torch computes them
        x = args["input"].detach().requires_grad_()
        w = args["weight"].detach().requires_grad_()
        b = None if args["bias"] is None else args["bias"].detach().requires_grad_()
        params = {k: args[k] for k in PARAMS}
        y = ct.conv_transpose2d(x, w, b, **params)
        go = torch.ones_like(y)
        y.backward(go)
        xr, wr = to_torch64(x).requires_grad_(), to_torch64(w).requires_grad_()
        br = None if b is None else to_torch64(b).requires_grad_()
        yr = F.conv_transpose2d(xr, wr, br, **{k: int(v) if isinstance(v, np.integer) else v
                                               for k, v in params.items()})
        yr.backward(torch.ones_like(yr))
        assert_like_torch(x.grad, xr.grad, x, f"{row.id} autograd grad_input")
        assert_like_torch(w.grad, wr.grad, w, f"{row.id} autograd grad_weight")
        if b is not None:
            assert_like_torch(b.grad, br.grad, b, f"{row.id} autograd grad_bias")


def run_backward_row(row: Row, backend: str):
    args = build(row, backend)
    if isinstance(row.expect, Raises):
        check_raises(row.expect, lambda: call_backward(backend, args))
        return
    got = call_backward(backend, args)
    assert isinstance(got, tuple) and len(got) == 3
    want = _reference_backward(args)
    likes = (args["input"], args["weight"], args["input"])
    for name, g, wnt, like in zip(("grad_input", "grad_weight", "grad_bias"), got, want, likes):
        if wnt is None:
            assert g is None, f"{row.id}: {name} computed although output_mask left it out"
        else:
            assert_like_torch(g, wnt, like, f"{row.id} {name}")


# --------------------------------------------------------------- the table against torch

def _torch_outcome(row: Row, backward: bool):
    args = build(row, "torch")
    try:
        if backward:
            params = {k: args[k] for k in PARAMS}
            x = args["input"].detach().requires_grad_() if isinstance(args["input"], torch.Tensor) else args["input"]
            w = args["weight"].detach().requires_grad_() if isinstance(args["weight"], torch.Tensor) \
                else args["weight"]
            y = F.conv_transpose2d(x, w, None, **params)
            mask = args["output_mask"]
            if not (isinstance(mask, (list, tuple)) and len(mask) == 3
                    and all(isinstance(m, (bool, np.bool_)) for m in mask)):
                raise TypeError("output_mask")  # torch's own backward has no output_mask argument
            y.backward(args["grad_output"])
        else:
            F.conv_transpose2d(args["input"], args["weight"], args["bias"], **{k: args[k] for k in PARAMS})
        return None
    except Exception as exc:
        return exc


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_table_rows_match_torch(backward):
    """Where a row expects an error torch raises one too, and where it expects a result torch gives one."""
    problems = []
    for row in BACKWARD_ROWS if backward else FORWARD_ROWS:
        if not row.torch_check:
            continue
        if any(isinstance(v, A) and v.dtype == "bfloat16" for v in row.kwargs.values()) and "ml_dtypes" not in \
                sys.modules:
            pytest.importorskip("ml_dtypes")
        outcome = _torch_outcome(row, backward)
        torch_raises = outcome is not None
        we_raise = isinstance(row.expect, Raises)
        if torch_raises != we_raise and not row.torch_differs:
            problems.append(f"{row.id}: torch {'raises ' + repr(outcome) if torch_raises else 'accepts it'}")
        if row.torch_differs and torch_raises == we_raise:
            problems.append(f"{row.id}: marked as differing from torch ({row.torch_differs}), but it does not")
    assert not problems, "\n".join(problems)


def test_rows_have_unique_ids():
    for rows in (FORWARD_ROWS, BACKWARD_ROWS):
        ids = [r.id for r in rows]
        assert len(ids) == len(set(ids))


# ------------------------------------------------------------------------ the CPU set

def _ids(rows):
    return [r.id for r in rows]


@pytest.fixture
def reference_backend(monkeypatch):
    """NumPy arrays on the float64 reference even where a GPU is present (the GPU set covers that)."""
    monkeypatch.setenv(cupyconv.functional.BACKEND_ENV, "numpy")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("row", FORWARD_ROWS, ids=_ids(FORWARD_ROWS))
def test_forward(row, backend, reference_backend):
    run_forward_row(row, backend)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("row", BACKWARD_ROWS, ids=_ids(BACKWARD_ROWS))
def test_backward(row, backend, reference_backend):
    run_backward_row(row, backend)


@pytest.mark.parametrize("params, bad", [
    (dict(stride=2), dict(stride=2.0)),
    (dict(stride=(2, 1)), dict(stride=(2.0, 1))),
    (dict(groups=1), dict(groups=True)),
    (dict(padding=1), dict(padding=True)),
    (dict(dilation=(1, 1)), dict(dilation=(1, np.float64(1.0)))),
    (dict(output_padding=0), dict(output_padding=Decimal(0))),
], ids=["stride_float", "stride_float_in_pair", "groups_bool", "padding_bool", "dilation_npfloat", "op_decimal"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_valid_call_does_not_let_an_equal_float_or_bool_through(params, bad, device):
    """2.0 == 2 and True == 1, with equal hashes: the per-configuration cache must not skip validation."""
    x = torch.randn(1, 4, 5, 6, dtype=torch.float64, device=device)
    w = torch.randn(4, 3, 3, 2, dtype=torch.float64, device=device)
    y = ct.conv_transpose2d(x, w, None, **params)
    go = torch.randn(y.shape, dtype=torch.float64, device=device)
    ct.conv_transpose2d_backward(go, x, w, **params)
    name = next(iter(bad))
    with pytest.raises(TypeError, match=name):
        ct.conv_transpose2d(x, w, None, **bad)
    with pytest.raises(TypeError, match=name):
        ct.conv_transpose2d_backward(go, x, w, **bad)
    with pytest.raises(TypeError, match=name):
        ct.conv_transpose2d(x.requires_grad_(), w, None, **bad)


@pytest.mark.parametrize("make_tensor", [
    lambda t: t.to_sparse(),
    lambda t: torch.nested.nested_tensor([t[0]]),
], ids=["sparse", "nested"])
@pytest.mark.parametrize("name", ["input", "weight"])
def test_non_dense_tensors_are_type_errors(make_tensor, name):
    args = dict(input=torch.randn(2, 4, 5, 6, dtype=torch.float64), weight=torch.randn(4, 3, 3, 2, dtype=torch.float64))
    try:
        args[name] = make_tensor(args[name])
    except Exception:
        pytest.skip("this torch cannot make such a tensor")
    with pytest.raises(TypeError, match=name):
        ct.conv_transpose2d(args["input"], args["weight"])


def test_meta_tensors_give_meta_results_as_in_torch():
    x = torch.empty(2, 4, 5, 6, device="meta", dtype=torch.float64)
    w = torch.empty(4, 3, 3, 2, device="meta", dtype=torch.float64)
    assert torch.ops.cupyconv.conv_transpose2d(x, w, None, [1, 1], [0, 0], [0, 0], 1, [1, 1]).shape == (2, 3, 7, 7)
    y = ct.conv_transpose2d(x, w)
    assert y.device.type == "meta" and y.shape == F.conv_transpose2d(x, w).shape


# ------------------------------------------------------------------------- the module

@dataclass(frozen=True)
class ModuleRow:
    id: str
    ctor: Tuple[Tuple[str, object], ...] = ()        # ConvTranspose2d(4, 3, 3, **ctor)
    attrs: Tuple[Tuple[str, object], ...] = ()       # set on the module after construction
    input: object = A((2, 4, 5, 6))
    output_size: object = None
    expect: object = OK                              # OK, Raises, or SAME: exactly torch's exception


SAME = "same as torch"

MODULE_ROWS = [
    ModuleRow("valid"),
    ModuleRow("no_bias", ctor=(("bias", False),)),
    ModuleRow("strided", ctor=(("stride", 2), ("padding", 1), ("output_padding", 1), ("dilation", (1, 2)))),
    ModuleRow("grouped", ctor=(("groups", 2),), input=A((2, 4, 5, 6))),
    ModuleRow("unbatched", input=A((4, 5, 6))),
    ModuleRow("empty_batch", input=A((0, 4, 5, 6))),
    ModuleRow("empty_batch_zero_size", input=A((0, 4, 0, 6))),
    ModuleRow("input_nan", input=A((2, 4, 5, 6), plant=NAN)),
    ModuleRow("input_inf", input=A((2, 4, 5, 6), plant=INF)),
    ModuleRow("input_strided", input=A((2, 4, 5, 6), view="sliced")),
    ModuleRow("input_channels_last", input=A((2, 4, 5, 6), view="channels_last")),
    ModuleRow("output_size", ctor=(("stride", 2),), output_size=(12, 14)),
    ModuleRow("output_size_4", ctor=(("stride", 2),), output_size=[2, 3, 11, 13]),
    ModuleRow("output_size_tensor", ctor=(("stride", 2),), output_size="tensor:12,14"),
    ModuleRow("output_size_ndarray", ctor=(("stride", 2),), output_size=np.array([12, 14])),
    ModuleRow("output_size_out_of_range", ctor=(("stride", 2),), output_size=(40, 40), expect=SAME),
    ModuleRow("output_size_length", ctor=(("stride", 2),), output_size=(12,), expect=SAME),
    ModuleRow("output_size_none_entry", ctor=(("stride", 2),), output_size=(None, 12), expect=SAME),
    ModuleRow("output_size_float", ctor=(("stride", 2),), output_size=(12.0, 14), expect=R(TE, "output_padding")),
    ModuleRow("input_rank_2", input=A((5, 6)), expect=R(VE, "input")),
    ModuleRow("input_rank_5", input=A((1, 2, 4, 5, 6)), expect=R(VE, "input")),
    ModuleRow("input_channels", input=A((2, 5, 5, 6)), expect=R(VE, "input")),
    ModuleRow("input_int", input=A((2, 4, 5, 6), "int64"), expect=R(TE, "input")),
    ModuleRow("input_float32", input=A((2, 4, 5, 6), "float32"), expect=R(TE, "input")),
    ModuleRow("input_elsewhere", input=A((2, 4, 5, 6), device="other"), expect=R(VE, "input")),
    ModuleRow("input_of_the_other_library", input=Foreign((2, 4, 5, 6)), expect=R(TE, "input")),
    ModuleRow("input_of_the_other_library_output_size", input=Foreign((2, 4, 5, 6)), output_size=(7, 7),
              expect=R(TE, "input")),
    ModuleRow("input_zero_height", input=A((2, 4, 0, 6)), expect=R(VE, "input")),
    ModuleRow("stride_zero", ctor=(("stride", 0),), expect=R(VE, "stride")),
    ModuleRow("stride_float", ctor=(("stride", 1.5),), expect=R(TE, "stride")),
    ModuleRow("stride_huge", ctor=(("stride", 2 ** 31),), expect=R(VE, "stride")),
    ModuleRow("padding_negative", ctor=(("padding", -1),), expect=R(VE, "padding")),
    ModuleRow("padding_same", ctor=(("padding", "same"),), expect=R((TE, VE), "padding")),
    ModuleRow("dilation_zero", ctor=(("dilation", 0),), expect=R(VE, "dilation")),
    ModuleRow("output_padding_too_large", ctor=(("output_padding", 2),), expect=R(VE, "output_padding")),
    ModuleRow("kernel_size_zero", ctor=(("kernel_size", 0),), expect=R(VE, "weight")),
    ModuleRow("groups_zero", ctor=(("groups", 0),), expect=SAME),
    ModuleRow("groups_not_dividing", ctor=(("groups", 3),), expect=SAME),
    ModuleRow("padding_mode", ctor=(("padding_mode", "reflect"),), expect=SAME),
    ModuleRow("padding_mode_set_later", attrs=(("padding_mode", "circular"),), expect=R(VE, "zeros")),
    ModuleRow("stride_set_later", attrs=(("stride", (0, 1)),), expect=R(VE, "stride")),
    ModuleRow("groups_set_later", attrs=(("groups", 2.0),), expect=R(TE, "groups")),
]


def _module(cls, row: ModuleRow, device):
    kwargs = dict(in_channels=4, out_channels=3 if dict(row.ctor).get("groups", 1) != 2 else 4, kernel_size=3)
    kwargs.update(row.ctor)
    torch.manual_seed(0)
    m = cls(**kwargs).double().to(device)
    for k, v in row.attrs:
        setattr(m, k, v)
    return m


def _output_size(value, device):
    if isinstance(value, str) and value.startswith("tensor:"):
        return torch.tensor([int(v) for v in value[7:].split(",")], device=device)
    return value


def run_module_row(row: ModuleRow, backend: str):
    device = BACKENDS[backend][1]
    try:
        ref = _module(torch.nn.ConvTranspose2d, row, "cpu")
        ref_error = None
    except Exception as exc:
        ref, ref_error = None, exc
    if ref_error is not None:
        # torch's constructor said no: ours is torch's constructor
        with pytest.raises(type(ref_error)) as info:
            _module(ct.ConvTranspose2d, row, device)
        assert str(info.value) == str(ref_error)
        assert row.expect == SAME
        return
    ours = _module(ct.ConvTranspose2d, row, device)
    x = make(row.input, backend)
    size = _output_size(row.output_size, device)

    def forward():
        return ours(x, output_size=size) if size is not None else ours(x)

    if row.expect == SAME:
        with pytest.raises(Exception) as theirs:
            ref(to_torch64(x) if isinstance(x, torch.Tensor) else x,
                **({"output_size": _output_size(row.output_size, "cpu")} if size is not None else {}))
        with pytest.raises(type(theirs.value)) as info:
            forward()
        assert str(info.value) == str(theirs.value)
        return
    if isinstance(row.expect, Raises):
        check_raises(row.expect, forward)
        return
    y = forward()
    want = ref(to_torch64(x), **({"output_size": _output_size(row.output_size, "cpu")} if size is not None else {}))
    assert_like_torch(y, want.detach(), x, f"{row.id} module output")
    if x.numel() and not (isinstance(row.input, A) and row.input.plant is not None):
        y.sum().backward()
        want.sum().backward()
        assert_like_torch(ours.weight.grad, ref.weight.grad, ours.weight, f"{row.id} weight grad")


@pytest.mark.parametrize("row", MODULE_ROWS, ids=[r.id for r in MODULE_ROWS])
def test_module(row):
    run_module_row(row, "torch")


# ----------------------------------------------------------------------------- the GPU set

def _gpu_rows(rows):
    return [r for r in rows if r.gpu]


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch_cuda", "numpy_gpu"])
@pytest.mark.parametrize("row", _gpu_rows(FORWARD_ROWS), ids=_ids(_gpu_rows(FORWARD_ROWS)))
def test_forward_gpu(row, backend):
    _cuda()
    if backend == "numpy_gpu":
        assert cupyconv.backend() == "cupy"
    run_forward_row(row, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch_cuda", "numpy_gpu"])
@pytest.mark.parametrize("row", _gpu_rows(BACKWARD_ROWS), ids=_ids(_gpu_rows(BACKWARD_ROWS)))
def test_backward_gpu(row, backend):
    _cuda()
    run_backward_row(row, backend)


@pytest.mark.gpu
@pytest.mark.parametrize("row", MODULE_ROWS, ids=[r.id for r in MODULE_ROWS])
def test_module_gpu(row):
    _cuda()
    run_module_row(row, "torch_cuda")


# Layers for NaN/Inf on each kind of kernel: thin (direct) and wide enough for the tensor cores.
NONFINITE_LAYERS = {
    "direct": ((2, 4, 5, 6), (4, 3, 3, 2), dict(stride=(2, 1), padding=(1, 0), groups=2, dilation=(1, 2))),
    "tensor_cores": ((2, 16, 5, 4), (16, 16, 3, 3), dict(stride=2, padding=1, output_padding=1)),
}
NONFINITE_MODES = {  # name: (dtype, TF32 allowed)
    "float64": (torch.float64, False), "float32": (torch.float32, False), "tf32": (torch.float32, True),
    "float16": (torch.float16, False), "bfloat16": (torch.bfloat16, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "minus_inf"])
@pytest.mark.parametrize("mode", list(NONFINITE_MODES))
@pytest.mark.parametrize("layer", list(NONFINITE_LAYERS))
@pytest.mark.parametrize("where", ["input", "grad_output"])
def test_nonfinite_values_propagate_as_in_torch_gpu(where, layer, mode, value, request, monkeypatch):
    """One NaN or Inf in the input (forward) or in grad_output (backward), on every kernel and dtype."""
    _cuda()
    from cupyconv import tuning
    from cupyconv.core.geometry import ConvParams, geometry
    from layers import uses_gemm

    # the tuner's default kernels, not whichever a timing run happens to pick
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")

    dtype, tf32 = NONFINITE_MODES[mode]
    xs, ws, kw = NONFINITE_LAYERS[layer]
    g = geometry(xs, ws, None, ConvParams.from_args(**kw))
    gemm = uses_gemm(g, str(dtype).replace("torch.", ""), 0)
    if dtype == torch.float64 and layer == "tensor_cores":
        pytest.skip("float64 always runs on the direct kernels")
    assert gemm == (layer == "tensor_cores")
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(xs)
        w = rng.standard_normal(ws)
        y_shape = tuple(F.conv_transpose2d(torch.zeros(xs, device="meta"), torch.zeros(ws, device="meta"), **kw).shape)
        go = rng.standard_normal(y_shape)
        target = x if where == "input" else go
        target[tuple(s // 2 for s in target.shape)] = value
        xt, wt, got_ = (torch.from_numpy(a).to(dtype).cuda() for a in (x, w, go))
        x64, w64, go64 = (t.cpu().double() for t in (xt, wt, got_))
        tol = 5e-3 if tf32 else None  # TF32 products carry 10 mantissa bits
        if where == "input":
            y = ct.conv_transpose2d(xt, wt, **kw)
            assert_like_torch(y, F.conv_transpose2d(x64, w64, **kw), xt, f"{layer} {mode} output", tol)
        else:
            gi, gw, gb = ct.conv_transpose2d_backward(got_, xt, wt, **kw)
            x64.requires_grad_()
            w64.requires_grad_()
            F.conv_transpose2d(x64, w64, **kw).backward(go64)
            assert_like_torch(gi, x64.grad, xt, f"{layer} {mode} grad_input", tol)
            assert_like_torch(gw, w64.grad, wt, f"{layer} {mode} grad_weight", tol)
            assert_like_torch(gb, go64.sum((0, 2, 3)), xt, f"{layer} {mode} grad_bias", tol)
        torch.cuda.synchronize()
    finally:
        torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.gpu
def test_gpu_is_healthy_after_the_hostile_inputs():
    """Nothing above left the device in an error state: a plain call still works and synchronises."""
    _cuda()
    x = torch.randn(2, 4, 5, 6, device="cuda")
    w = torch.randn(4, 3, 3, 2, device="cuda")
    y = ct.conv_transpose2d(x, w, stride=2)
    torch.cuda.synchronize()
    want = F.conv_transpose2d(x.double().cpu(), w.double().cpu(), stride=2)
    assert float((y.double().cpu() - want).abs().max()) <= 1e-5 * float(want.abs().max())
