"""Checks the float64 NumPy reference against PyTorch's CPU conv_transpose2d and autograd."""

import random
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import cupyconv  # noqa: E402
from cupyconv import reference  # noqa: E402

RTOL = 1e-10

# The reference is the CPU backend: whatever NumPy warns about in it, a user sees.  Every
# test here fails on a RuntimeWarning, and the tests at the end aim at the cases that warned.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _case(n, c_in, c_out, hw, k, stride=(1, 1), padding=(0, 0), output_padding=(0, 0),
          dilation=(1, 1), groups=1, bias=True):
    return dict(n=n, c_in=c_in, c_out=c_out, hw=tuple(hw), k=tuple(k), stride=tuple(stride),
                padding=tuple(padding), output_padding=tuple(output_padding),
                dilation=tuple(dilation), groups=groups, bias=bias)


def _out_hw(c):
    return tuple(reference.output_size(c["hw"][i], c["k"][i], c["stride"][i], c["padding"][i],
                                       c["output_padding"][i], c["dilation"][i])
                 for i in range(2))


def _random_cases(count, seed=20240611):
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        kind = rng.choice(["g1", "g1", "g2", "g4", "dw"])
        if kind == "dw":
            c_in = rng.randint(1, 4)
            groups, c_out = c_in, c_in * rng.randint(1, 2)
        else:
            groups = {"g1": 1, "g2": 2, "g4": 4}[kind]
            c_in = groups * rng.randint(1, 8 // groups)
            c_out = groups * rng.randint(1, 8 // groups)
        k = (rng.randint(1, 7), rng.randint(1, 7))
        stride = (rng.randint(1, 4), rng.randint(1, 4))
        dilation = (rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2, 3]))
        padding = tuple(0 if rng.random() < 0.3 else rng.randint(0, dilation[i] * (k[i] - 1))
                        for i in range(2))
        output_padding = tuple(rng.randint(0, max(stride[i], dilation[i]) - 1)
                               for i in range(2))
        hw = (rng.randint(1, 12), rng.randint(1, 12))
        n = rng.choice([0, 1, 1, 2, 3])
        c = _case(n, c_in, c_out, hw, k, stride, padding, output_padding, dilation, groups,
                  bias=rng.random() < 0.6)
        try:
            _out_hw(c)
        except ValueError:  # the output would be empty: not a layer
            continue
        cases.append(c)
    return cases


EDGE_CASES = [
    _case(1, 1, 1, (1, 1), (1, 1)),                                    # the trivial layer
    _case(2, 3, 4, (1, 1), (7, 5), padding=(3, 0)),                    # 1x1 input, big kernel
    _case(1, 2, 3, (5, 7), (3, 5), stride=(2, 3), padding=(0, 2)),     # padding on W only
    _case(1, 2, 3, (5, 7), (5, 3), stride=(3, 1), padding=(4, 0)),     # padding == d*(k-1)
    _case(2, 2, 2, (5, 7), (2, 3), stride=(3, 4), output_padding=(2, 3)),  # op > padding
    _case(1, 2, 2, (4, 3), (3, 2), stride=(1, 1), dilation=(3, 2),
          output_padding=(2, 1)),                                      # op < dilation only
    _case(2, 4, 8, (6, 5), (3, 3), stride=(2, 2), padding=(1, 1), groups=4),  # depthwise x2
    _case(0, 4, 6, (5, 7), (3, 4), stride=(2, 1), groups=2),           # empty batch
    _case(0, 3, 3, (1, 1), (2, 2), groups=3, bias=False),              # empty depthwise
    _case(1, 3, 2, (4, 4), (1, 1), stride=(4, 4), output_padding=(3, 3)),  # gaps between pixels
    _case(1, 2, 2, (3, 3), (2, 2), stride=(4, 3), dilation=(3, 3),
          padding=(3, 1), output_padding=(3, 2)),                      # op up to max(s,d)-1
    _case(2, 8, 8, (24, 20), (3, 5), stride=(2, 1), padding=(1, 2),
          output_padding=(1, 0), dilation=(1, 2), groups=2),           # moderately sized
]

CASES = _random_cases(130) + EDGE_CASES


def _case_id(c):
    return ("n{n}_c{c_in}-{c_out}_g{groups}_{hw[0]}x{hw[1]}_k{k[0]}x{k[1]}_s{stride[0]}{stride[1]}"
            "_p{padding[0]}{padding[1]}_op{output_padding[0]}{output_padding[1]}"
            "_d{dilation[0]}{dilation[1]}_{b}").format(b="b" if c["bias"] else "nb", **c)


def _params(c):
    return (c["stride"], c["padding"], c["output_padding"], c["groups"], c["dilation"])


def _make_inputs(c, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((c["n"], c["c_in"]) + c["hw"])
    w = rng.standard_normal((c["c_in"], c["c_out"] // c["groups"]) + c["k"])
    b = rng.standard_normal(c["c_out"]) if c["bias"] else None
    return x, w, b, rng


def _assert_close(ref, expected):
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else expected
    assert ref.dtype == np.float64
    assert ref.shape == expected.shape
    if expected.size == 0:
        return
    err = np.max(np.abs(ref - expected))
    scale = max(1.0, float(np.max(np.abs(expected))))
    assert err <= RTOL * scale, f"max abs error {err:.3e} vs scale {scale:.3e}"


def _torch_forward_backward(c, x, w, b, rng):
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    bt = torch.tensor(b, requires_grad=True) if b is not None else None
    stride, padding, output_padding, groups, dilation = _params(c)
    yt = F.conv_transpose2d(xt, wt, bt, stride=stride, padding=padding,
                            output_padding=output_padding, groups=groups, dilation=dilation)
    gy = rng.standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(gy))
    gb = bt.grad if bt is not None else torch.tensor(gy.sum(axis=(0, 2, 3)))
    return yt, gy, xt.grad, wt.grad, gb


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_torch(c):
    x, w, b, rng = _make_inputs(c, seed=zlib.crc32(_case_id(c).encode()))
    yt, gy, gx_t, gw_t, gb_t = _torch_forward_backward(c, x, w, b, rng)

    y = reference.conv_transpose2d(x, w, b, *_params(c))
    _assert_close(y, yt)

    gx, gw, gb = reference.conv_transpose2d_backward(gy, x, w, *_params(c))
    _assert_close(gx, gx_t)
    _assert_close(gw, gw_t)
    _assert_close(gb, gb_t)


def test_case_list_covers_the_brief():
    assert len(CASES) >= 120
    assert any(c["k"][0] != c["k"][1] for c in CASES)
    assert any(c["stride"][0] != c["stride"][1] for c in CASES)
    assert any((c["padding"][0] == 0) != (c["padding"][1] == 0) for c in CASES)
    assert any(c["output_padding"] != (0, 0) for c in CASES)
    assert any(max(c["dilation"]) == 3 for c in CASES)
    assert {1, 2, 4} <= {c["groups"] for c in CASES}
    assert any(c["groups"] == c["c_in"] > 1 and c["c_out"] > c["c_in"] for c in CASES)
    assert any(c["n"] == 0 for c in CASES) and any(c["n"] == 1 for c in CASES)
    assert any(not c["bias"] for c in CASES) and any(c["bias"] for c in CASES)


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False),
                                  (False, False, True), (False, False, False)])
def test_output_mask(mask):
    c = EDGE_CASES[2]
    x, w, b, rng = _make_inputs(c, seed=7)
    _, gy, gx_t, gw_t, gb_t = _torch_forward_backward(c, x, w, b, rng)
    got = reference.conv_transpose2d_backward(gy, x, w, *_params(c), output_mask=mask)
    for want, g, expected in zip(mask, got, (gx_t, gw_t, gb_t)):
        if want:
            _assert_close(g, expected)
        else:
            assert g is None


def test_empty_batch_gives_zero_param_grads():
    c = _case(0, 4, 6, (5, 7), (3, 4), stride=(2, 1), groups=2)
    x, w, b, rng = _make_inputs(c, seed=3)
    y = reference.conv_transpose2d(x, w, b, *_params(c))
    assert y.shape == (0, 6) + _out_hw(c)
    gy = rng.standard_normal(y.shape)
    gx, gw, gb = reference.conv_transpose2d_backward(gy, x, w, *_params(c))
    assert gx.shape == x.shape
    assert gw.shape == w.shape and not gw.any()
    assert gb.shape == (6,) and not gb.any()


SHAPE_CASES = CASES[:40] + EDGE_CASES


@pytest.mark.parametrize("c", SHAPE_CASES, ids=[_case_id(c) for c in SHAPE_CASES])
def test_output_size_matches_torch_shape(c):
    x = torch.zeros((1, c["c_in"]) + c["hw"], dtype=torch.float64)
    w = torch.zeros((c["c_in"], c["c_out"] // c["groups"]) + c["k"], dtype=torch.float64)
    stride, padding, output_padding, groups, dilation = _params(c)
    y = F.conv_transpose2d(x, w, stride=stride, padding=padding,
                           output_padding=output_padding, groups=groups, dilation=dilation)
    assert tuple(y.shape[2:]) == _out_hw(c)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_inputs_are_computed_in_float64(dtype):
    c = _case(2, 4, 6, (5, 7), (3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2),
              dilation=(2, 1), groups=2)
    x, w, b, rng = _make_inputs(c, seed=11)
    x, w, b = x.astype(dtype), w.astype(dtype), b.astype(dtype)
    gy = rng.standard_normal((c["n"], c["c_out"]) + _out_hw(c)).astype(dtype)
    # The oracle is torch in float64 on the rounded values, which float64 holds exactly;
    # a float32/float16 computation would miss the 1e-10 tolerance by orders of magnitude.
    xt, wt, bt = (torch.tensor(a.astype(np.float64), requires_grad=True) for a in (x, w, b))
    yt = F.conv_transpose2d(xt, wt, bt, *_params(c))
    yt.backward(torch.tensor(gy.astype(np.float64)))

    y = reference.conv_transpose2d(x, w, b, *_params(c))
    gx, gw, gb = reference.conv_transpose2d_backward(gy, x, w, *_params(c))
    for got, expected in zip((y, gx, gw, gb), (yt, xt.grad, wt.grad, bt.grad)):
        _assert_close(got, expected)  # also asserts the float64 result dtype


# ------------------------------------------------------------------------ no warnings

def _planted(shape, seed, value=None):
    a = np.random.default_rng(seed).standard_normal(shape)   # both signs, so an Inf weight sums to inf - inf
    if value is not None:
        a[(0,) * len(shape)] = value
    return a


@pytest.mark.parametrize("where", ["x", "weight", "bias", "grad_output"])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_non_finite_inputs_give_torchs_result_without_a_warning(where, value):
    c = _case(2, 4, 6, (5, 6), (3, 2), stride=(2, 1), padding=(1, 0), groups=2)
    x = _planted((2, 4, 5, 6), 1, value if where == "x" else None)
    w = _planted((4, 3, 3, 2), 2, value if where == "weight" else None)
    b = _planted((6,), 3, value if where == "bias" else None)
    y = reference.conv_transpose2d(x, w, b, *_params(c))
    go = _planted(y.shape, 4, value if where == "grad_output" else None)
    grads = reference.conv_transpose2d_backward(go, x, w, *_params(c))
    xt, wt, bt = (torch.from_numpy(a).requires_grad_() for a in (x, w, b))
    yt = F.conv_transpose2d(xt, wt, bt, stride=(2, 1), padding=(1, 0), groups=2)
    yt.backward(torch.from_numpy(go))
    for got, want in zip((y,) + grads, (yt, xt.grad, wt.grad, bt.grad)):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=RTOL, atol=1e-12)   # NaN and Inf where torch has them


def test_finite_inputs_that_overflow_still_warn():
    """Only non-finite inputs silence NumPy: a NaN made from finite numbers would be a fault worth hearing of."""
    x = np.array([1e300, -1e300]).reshape(1, 2, 1, 1)
    w = np.full((2, 1, 1, 1), 1e300)
    with pytest.warns(RuntimeWarning):
        reference.conv_transpose2d(x, w, None, (1, 1), (0, 0), (0, 0), 1, (1, 1))


def test_rounding_to_float16_gives_inf_without_a_warning(monkeypatch):
    monkeypatch.setenv("CUPYCONV_BACKEND", "numpy")
    x = np.full((1, 2, 3, 3), 60000, np.float16)
    w = np.full((2, 1, 2, 2), 2, np.float16)
    y = cupyconv.conv_transpose2d(x, w)
    assert y.dtype == np.float16 and np.isposinf(y).all()
    gi, gw, gb = cupyconv.conv_transpose2d_backward(np.ones_like(y), x, w)
    assert np.isposinf(gw).all() and np.isfinite(gi).all() and np.isfinite(gb).all()


@pytest.mark.parametrize("n, hw", [(0, (5, 6)), (0, (0, 6)), (1, (1, 1))])
def test_empty_and_tiny_inputs_without_a_warning(n, hw):
    c = _case(n, 4, 6, hw, (3, 2), stride=(2, 2), groups=2)
    x, w, b = _planted((n, 4) + hw, 1), _planted((4, 3, 3, 2), 2), _planted((6,), 3)
    y = reference.conv_transpose2d(x, w, b, *_params(c))
    gx, gw, gb = reference.conv_transpose2d_backward(np.ones(y.shape), x, w, *_params(c))
    assert gx.shape == x.shape and not np.isnan(y).any()
    if n == 0:
        assert not gw.any() and not gb.any()
