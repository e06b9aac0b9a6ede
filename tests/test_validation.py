"""Argument checking of the public NumPy API: every bad argument is a ValueError or TypeError that
names the argument, raised before anything is computed; and a few valid calls, checked against torch."""
from __future__ import annotations

import re

import numpy as np
import pytest

import cupyconv
from cupyconv import engine, functional, reference

RNG = np.random.default_rng(1234)


def _x(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


X = _x(2, 4, 5, 5)          # N=2, C_in=4
W = _x(4, 3, 3, 3)          # C_out/groups=3, 3x3
B = _x(3)
GO = _x(2, 3, 7, 7)         # the output's shape with the defaults


@pytest.fixture
def no_compute(monkeypatch):
    """Every way of computing a result records the call and fails; the test asserts none happened."""
    calls = []

    def forbid(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called for an invalid argument")
        return fn

    for mod, names in ((reference, ("conv_transpose2d", "conv_transpose2d_backward")),
                       (engine, ("forward", "grad_input", "grad_weight", "grad_bias")),
                       (functional, ("_gpu_forward", "_gpu_backward"))):
        for name in names:
            monkeypatch.setattr(mod, name, forbid(f"{mod.__name__}.{name}"))
    yield calls
    assert calls == []


def _fwd(**overrides):
    args = dict(input=X, weight=W, bias=None)
    args.update(overrides)
    return cupyconv.conv_transpose2d(**args)


def _bwd(**overrides):
    args = dict(grad_output=GO, input=X, weight=W)
    args.update(overrides)
    return cupyconv.conv_transpose2d_backward(**args)


def _check(call, exc, name, **overrides):
    with pytest.raises(exc, match=re.escape(name)):
        call(**overrides)


def test_reference_backend_here():
    # These tests exercise the host path; without a GPU it is the float64 reference.
    assert cupyconv.backend() in ("numpy", "cupy")


# ------------------------------------------------------------------------------- ranks

@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("shape", [(4, 5), (1, 2, 4, 5, 5), (5,), ()])
def test_input_rank(no_compute, call, shape):
    _check(call, ValueError, "input", input=_x(*shape))


@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("shape", [(4, 3, 3), (4, 3), (4, 3, 3, 3, 1)])
def test_weight_rank(no_compute, call, shape):
    _check(call, ValueError, "weight", weight=_x(*shape))


# ---------------------------------------------------------------------- channels, groups

@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
def test_channel_mismatch(no_compute, call):
    with pytest.raises(ValueError, match=r"weight.*input|input.*weight"):
        call(weight=_x(5, 3, 3, 3))
    with pytest.raises(ValueError, match=r"weight.*input|input.*weight"):
        call(weight=_x(2, 3, 3, 3))


def test_channel_mismatch_unbatched(no_compute):
    with pytest.raises(ValueError, match=r"weight.*input"):
        _fwd(input=_x(3, 5, 5))


@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
def test_groups_not_dividing_channels(no_compute, call):
    _check(call, ValueError, "groups", groups=3)
    _check(call, ValueError, "groups", groups=8)


@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("groups", [0, -1, -4])
def test_groups_not_positive(no_compute, call, groups):
    _check(call, ValueError, "groups", groups=groups)


# ------------------------------------------------------------------ int-or-pair arguments

@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("name, value", [
    ("stride", 0), ("stride", (1, 0)), ("stride", -2),
    ("dilation", 0), ("dilation", (0, 1)), ("dilation", -1),
    ("padding", -1), ("padding", (0, -2)),
    ("output_padding", -1), ("output_padding", (-1, 0)),
])
def test_out_of_range_values(no_compute, call, name, value):
    _check(call, ValueError, name, **{name: value})


@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("kwargs", [
    dict(output_padding=1),                                    # stride 1, dilation 1
    dict(output_padding=2, stride=2),
    dict(output_padding=2, stride=2, dilation=2),
    dict(output_padding=(0, 1), stride=(2, 1)),                # per axis
    dict(output_padding=(2, 0), stride=(2, 3), dilation=(2, 1)),
    dict(output_padding=3, stride=2, dilation=3),
])
def test_output_padding_too_large(no_compute, call, kwargs):
    _check(call, ValueError, "output_padding", **kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(output_padding=1, stride=1, dilation=2),
    dict(output_padding=(2, 1), stride=1, dilation=(3, 2)),
    dict(output_padding=(1, 0), stride=(1, 1), dilation=(2, 1)),
    dict(output_padding=(2, 1), stride=(1, 2), dilation=(3, 1)),
])
def test_output_padding_below_dilation_is_accepted(kwargs):
    torch = pytest.importorskip("torch")
    x, w, b = _x(2, 4, 5, 4), _x(4, 3, 3, 2), _x(3)
    y = cupyconv.conv_transpose2d(x, w, b, **kwargs)
    ref = torch.nn.functional.conv_transpose2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b),
                                               **kwargs).numpy()
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    go = _x(*ref.shape)
    gi, gw, gb = cupyconv.conv_transpose2d_backward(go, x, w, **kwargs)
    assert gi.shape == x.shape and gw.shape == w.shape and gb.shape == (3,)


@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("name, value, exc", [
    ("stride", True, TypeError), ("stride", (1, True), TypeError), ("stride", 1.0, TypeError),
    ("stride", "1", TypeError), ("stride", None, TypeError), ("stride", (1, 1, 1), ValueError),
    ("padding", 1.0, TypeError), ("padding", (0, 1.0), TypeError), ("padding", False, TypeError),
    ("padding", (0, 0, 0), ValueError),
    ("output_padding", 0.0, TypeError), ("output_padding", (True, 0), TypeError),
    ("output_padding", [0, 0, 0], ValueError),
    ("dilation", 1.0, TypeError), ("dilation", True, TypeError), ("dilation", (), ValueError),
    ("groups", 2.0, TypeError), ("groups", 1.0, TypeError), ("groups", True, TypeError),
    ("groups", (1,), TypeError), ("groups", None, TypeError), ("groups", "1", TypeError),
])
def test_wrong_argument_types(no_compute, call, name, value, exc):
    _check(call, exc, name, **{name: value})


def test_numpy_integers_are_accepted():
    y = _fwd(stride=np.int64(2), padding=(np.int32(1), 0), groups=np.int64(1), dilation=[np.uint8(1)])
    assert y.shape == (2, 3, 9, 11)


# ------------------------------------------------------------------------- output size

@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("kwargs", [
    dict(input=_x(1, 4, 1, 1), weight=_x(4, 3, 1, 1), padding=1),
    dict(input=_x(1, 4, 2, 2), weight=_x(4, 3, 1, 1), padding=(1, 0)),
    dict(input=_x(1, 4, 3, 3), weight=_x(4, 3, 2, 2), padding=(0, 5)),
])
def test_non_positive_output_size(no_compute, call, kwargs):
    if call is _bwd:
        kwargs = dict(kwargs, grad_output=_x(1, 3, 1, 1))
    with pytest.raises(ValueError, match="padding") as info:
        call(**kwargs)
    assert "output size" in str(info.value)


# ------------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex128, np.uint8])
def test_non_float_input(no_compute, dtype):
    _check(_fwd, TypeError, "input", input=X.astype(dtype))
    _check(_bwd, TypeError, "input", input=X.astype(dtype), grad_output=GO.astype(np.float64))


def test_non_float_weight_bias_grad_output(no_compute):
    _check(_fwd, TypeError, "weight", weight=W.astype(np.int32))
    _check(_fwd, TypeError, "bias", bias=B.astype(np.int64))
    _check(_bwd, TypeError, "grad_output", grad_output=GO.astype(np.int32))
    _check(_bwd, TypeError, "weight", weight=W.astype(np.int32))


@pytest.mark.parametrize("overrides, names", [
    (dict(input=X.astype(np.float32)), ("input", "weight")),
    (dict(weight=W.astype(np.float32)), ("input", "weight")),
    (dict(input=X.astype(np.float16), weight=W.astype(np.float16), bias=B), ("bias",)),
    (dict(bias=B.astype(np.float32)), ("bias",)),
])
def test_mixed_dtypes_forward(no_compute, overrides, names):
    with pytest.raises(TypeError) as info:
        _fwd(**overrides)
    for name in names:
        assert name in str(info.value)
    assert "dtype" in str(info.value)


@pytest.mark.parametrize("overrides, name", [
    (dict(grad_output=GO.astype(np.float32)), "grad_output"),
    (dict(input=X.astype(np.float32)), "input"),
    (dict(weight=W.astype(np.float16)), "weight"),
])
def test_mixed_dtypes_backward(no_compute, overrides, name):
    _check(_bwd, TypeError, name, **overrides)


# ----------------------------------------------------------------- not NumPy arrays at all

@pytest.mark.parametrize("name", ["input", "weight", "bias"])
@pytest.mark.parametrize("make", [lambda a: a.tolist(), lambda a: tuple(a.tolist()), lambda a: 1.0,
                                  lambda a: "x", lambda a: np.float64(1.0), lambda a: memoryview(a)],
                         ids=["list", "tuple", "float", "str", "npscalar", "memoryview"])
def test_forward_non_arrays(no_compute, name, make):
    value = make({"input": X, "weight": W, "bias": B}[name])
    _check(_fwd, TypeError, name, **{name: value})


@pytest.mark.parametrize("name", ["grad_output", "input", "weight"])
def test_backward_non_arrays(no_compute, name):
    value = {"grad_output": GO, "input": X, "weight": W}[name].tolist()
    _check(_bwd, TypeError, name, **{name: value})


@pytest.mark.parametrize("name", ["input", "weight", "bias"])
def test_forward_torch_tensor(no_compute, name):
    torch = pytest.importorskip("torch")
    value = torch.from_numpy({"input": X, "weight": W, "bias": B}[name])
    with pytest.raises(TypeError, match=re.escape(name)) as info:
        _fwd(**{name: value})
    assert "cupyconv.torch" in str(info.value)


@pytest.mark.parametrize("name", ["grad_output", "input", "weight"])
def test_backward_torch_tensor(no_compute, name):
    torch = pytest.importorskip("torch")
    value = torch.from_numpy({"grad_output": GO, "input": X, "weight": W}[name])
    with pytest.raises(TypeError, match=re.escape(name)) as info:
        _bwd(**{name: value})
    assert "cupyconv.torch" in str(info.value)


def test_all_torch_tensors(no_compute):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="cupyconv.torch"):
        cupyconv.conv_transpose2d(torch.from_numpy(X), torch.from_numpy(W))


@pytest.mark.parametrize("name", ["input", "weight"])
def test_forward_none_array(no_compute, name):
    _check(_fwd, TypeError, name, **{name: None})


@pytest.mark.parametrize("name", ["grad_output", "input", "weight"])
def test_backward_none_array(no_compute, name):
    _check(_bwd, TypeError, name, **{name: None})


# --------------------------------------------------------------------------------- bias

@pytest.mark.parametrize("shape", [(2,), (4,), (6,), (1, 3), (3, 1), (), (0,)])
def test_bias_shape(no_compute, shape):
    _check(_fwd, ValueError, "bias", bias=_x(*shape))


def test_bias_shape_with_groups(no_compute):
    # C_out = 3 * groups = 6; a bias of C_out/groups is wrong.
    _check(_fwd, ValueError, "bias", bias=_x(3), groups=2)


# ------------------------------------------------------------------------- zero sizes

@pytest.mark.parametrize("call", [_fwd, _bwd], ids=["forward", "backward"])
@pytest.mark.parametrize("overrides, name", [
    (dict(input=_x(2, 0, 5, 5), weight=_x(0, 3, 3, 3)), "input"),
    (dict(input=_x(2, 4, 0, 5)), "input"),
    (dict(input=_x(2, 4, 5, 0)), "input"),
    (dict(input=_x(4, 0, 5)), "input"),
    (dict(weight=_x(4, 0, 3, 3)), "weight"),
    (dict(weight=_x(4, 3, 0, 3)), "weight"),
    (dict(weight=_x(4, 3, 3, 0)), "weight"),
])
def test_zero_sizes(no_compute, call, overrides, name):
    _check(call, ValueError, name, **overrides)


# --------------------------------------------------------------------- backward specifics

@pytest.mark.parametrize("shape", [(2, 3, 7, 6), (2, 3, 6, 7), (2, 4, 7, 7), (1, 3, 7, 7), (3, 7, 7),
                                   (2, 3, 7, 7, 1), (2, 3, 9, 9)])
def test_grad_output_shape(no_compute, shape):
    _check(_bwd, ValueError, "grad_output", grad_output=_x(*shape))


def test_grad_output_shape_unbatched(no_compute):
    # unbatched input wants an unbatched grad_output
    _check(_bwd, ValueError, "grad_output", input=_x(4, 5, 5), grad_output=_x(1, 3, 7, 7))
    _check(_bwd, ValueError, "grad_output", input=_x(1, 4, 5, 5), grad_output=_x(3, 7, 7))


def test_grad_output_shape_follows_parameters(no_compute):
    # stride 2 makes the output 11x11: the default-shaped grad_output no longer fits.
    _check(_bwd, ValueError, "grad_output", stride=2)


@pytest.mark.parametrize("mask", [(1, 1, 1), (True, 0, True), (None, True, True), ("yes", True, True),
                                  True, None, "TTT", 7, ((True,), True, True)])
def test_output_mask_of_other_types(no_compute, mask):
    _check(_bwd, TypeError, "output_mask", output_mask=mask)


@pytest.mark.parametrize("mask", [(True, True), (True, True, True, True), (), [True]])
def test_output_mask_of_other_lengths(no_compute, mask):
    _check(_bwd, ValueError, "output_mask", output_mask=mask)


def test_good_output_masks():
    gi, gw, gb = _bwd(output_mask=[np.bool_(True), False, np.True_])
    assert gi.shape == X.shape and gw is None and gb.shape == (3,)
    assert _bwd(output_mask=(False, False, False)) == (None, None, None)


# ------------------------------------------------------------------------ valid calls

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes_round_trip(dtype):
    x, w, b = X.astype(dtype), W.astype(dtype), B.astype(dtype)
    y = cupyconv.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1)
    assert type(y) is np.ndarray
    assert y.dtype == dtype
    assert y.shape == (2, 3, 10, 10)
    ref = cupyconv.conv_transpose2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), stride=2,
                                    padding=1, output_padding=1)
    tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(y.astype(np.float64), ref, rtol=tol, atol=tol * 10)
    go = _x(*y.shape).astype(dtype)
    grads = cupyconv.conv_transpose2d_backward(go, x, w, stride=2, padding=1, output_padding=1)
    for grad, shape in zip(grads, (x.shape, w.shape, (3,))):
        assert type(grad) is np.ndarray and grad.dtype == dtype and grad.shape == shape


def test_unbatched_gives_unbatched_output():
    x = _x(4, 5, 6)
    kwargs = dict(stride=(2, 1), padding=(1, 0), groups=2, dilation=(1, 2))
    w = _x(4, 2, 3, 2)
    b = _x(4)
    y = cupyconv.conv_transpose2d(x, w, b, **kwargs)
    assert y.shape == (4, 9, 8)
    np.testing.assert_array_equal(y, cupyconv.conv_transpose2d(x[None], w, b, **kwargs)[0])
    go = _x(*y.shape)
    gi, gw, gb = cupyconv.conv_transpose2d_backward(go, x, w, **kwargs)
    assert gi.shape == x.shape and gw.shape == w.shape and gb.shape == (4,)
    gi4, gw4, gb4 = cupyconv.conv_transpose2d_backward(go[None], x[None], w, **kwargs)
    np.testing.assert_array_equal(gi, gi4[0])
    np.testing.assert_array_equal(gw, gw4)
    np.testing.assert_array_equal(gb, gb4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_batch(dtype):
    x = np.zeros((0, 4, 5, 5), dtype=dtype)
    w, b = W.astype(dtype), B.astype(dtype)
    y = cupyconv.conv_transpose2d(x, w, b, stride=2)
    assert type(y) is np.ndarray and y.dtype == dtype and y.shape == (0, 3, 11, 11)
    gi, gw, gb = cupyconv.conv_transpose2d_backward(np.zeros((0, 3, 11, 11), dtype=dtype), x, w, stride=2)
    assert gi.shape == (0, 4, 5, 5)
    assert gw.shape == w.shape and not gw.any()
    assert gb.shape == (3,) and not gb.any()


LAYERS = [
    dict(x=(2, 4, 5, 6), w=(4, 3, 3, 2), bias=True,
         kw=dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2), groups=1, dilation=(1, 2))),
    dict(x=(3, 6, 4, 3), w=(6, 2, 2, 3), bias=False,
         kw=dict(stride=1, padding=(0, 1), output_padding=(1, 0), groups=3, dilation=(2, 1))),
    dict(x=(4, 5, 7), w=(4, 1, 3, 3), bias=True,
         kw=dict(stride=2, padding=2, output_padding=1, groups=4, dilation=2)),
]


def _torch_layer(layer):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(_x(*layer["x"])).requires_grad_()
    w = torch.from_numpy(_x(*layer["w"])).requires_grad_()
    c_out = layer["w"][1] * layer["kw"]["groups"]
    b = torch.from_numpy(_x(c_out)).requires_grad_() if layer["bias"] else None
    y = torch.nn.functional.conv_transpose2d(x, w, b, **layer["kw"])
    go = torch.from_numpy(_x(*y.shape))
    y.backward(go)
    return x, w, b, y, go, c_out


def _close(actual, expected):
    expected = expected.detach().numpy()
    assert type(actual) is np.ndarray and actual.dtype == np.float64
    assert actual.shape == expected.shape
    scale = max(np.abs(expected).max(), 1e-300)
    assert np.abs(actual - expected).max() <= 1e-10 * scale


@pytest.mark.parametrize("layer", LAYERS, ids=["asym", "groups-dilation", "depthwise-unbatched"])
def test_forward_and_backward_match_torch(layer):
    x, w, b, y, go, c_out = _torch_layer(layer)
    xn, wn, gon = x.detach().numpy(), w.detach().numpy(), go.numpy()
    bn = None if b is None else b.detach().numpy()
    _close(cupyconv.conv_transpose2d(xn, wn, bn, **layer["kw"]), y)
    gi, gw, gb = cupyconv.conv_transpose2d_backward(gon, xn, wn, **layer["kw"])
    _close(gi, x.grad)
    _close(gw, w.grad)
    assert gb.shape == (c_out,)
    expected_gb = go.sum((0, 2, 3)) if go.dim() == 4 else go.sum((1, 2))
    _close(gb, expected_gb if b is None else b.grad)


@pytest.mark.parametrize("layer", LAYERS[:2], ids=["asym", "groups-dilation"])
def test_backward_weight_only(layer):
    x, w, b, y, go, c_out = _torch_layer(layer)
    result = cupyconv.conv_transpose2d_backward(go.numpy(), x.detach().numpy(), w.detach().numpy(),
                                                output_mask=(False, True, False), **layer["kw"])
    assert isinstance(result, tuple) and len(result) == 3
    gi, gw, gb = result
    assert gi is None and gb is None
    _close(gw, w.grad)


def test_no_compute_fixture_catches_computation(no_compute):
    """The guard used above really intercepts the computation of a valid call."""
    with pytest.raises(AssertionError, match="was called"):
        _fwd()
    with pytest.raises(AssertionError, match="was called"):
        _bwd()
    assert len(no_compute) == 2
    no_compute.clear()
