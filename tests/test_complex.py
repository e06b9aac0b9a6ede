"""complex64 and complex128 through every face, on the real kernels (three real layers per
complex one): forward and backward against torch, torch's complex autograd conventions
(gradcheck, gradgradcheck, forward AD, vmap), memory formats and errors.  complex64 is
judged against a complex128 truth, within twice torch's own error plus a few roundings.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402
import transform_checks as checks  # noqa: E402

F = torch.nn.functional
DTYPES = [torch.complex64, torch.complex128]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
# (weight shape, keyword arguments, input shape)
LAYERS = [
    ((4, 3, 3, 2), dict(stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2, dilation=(1, 2)), (2, 4, 5, 6)),
    ((3, 4, 4, 4), dict(stride=2, padding=1), (1, 3, 6, 5)),
    ((5, 2, 2, 3), dict(stride=(1, 2)), (5, 4, 4)),  # unbatched
]
LAYER_IDS = ["grouped_dilated", "dcgan_like", "unbatched"]


def tensors(layer, device, dtype, seed=0):
    w_shape, kwargs, x_shape = layer
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.complex128).to(device=device, dtype=dtype)
    return rand(*x_shape), rand(*w_shape), rand(w_shape[1] * kwargs.get("groups", 1))


def judge(ours, theirs, truth, what):
    """complex64 against complex128: within twice torch's error plus four roundings of the scale."""
    truth = truth.to(torch.complex128)
    err = (ours.to(torch.complex128) - truth).abs().max().item()
    torch_err = (theirs.to(torch.complex128) - truth).abs().max().item()
    bound = 2 * torch_err + 4 * torch.finfo(torch.float32).eps * truth.abs().max().item()
    assert err <= bound, f"{what}: error {err:.3e} > 2 x torch's {torch_err:.3e} + 4 roundings ({bound:.3e})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_torch_forward_and_grads_match_torch(device, dtype, layer):
    kwargs = layer[1]
    x, w, b = tensors(layer, device, dtype)
    go = torch.randn(F.conv_transpose2d(x, w, b, **kwargs).shape, dtype=dtype, device=device)

    def run(fn, *ts):
        ts = [t.detach().clone().requires_grad_() for t in ts]
        y = fn(*ts, **kwargs)
        return (y,) + torch.autograd.grad(y, ts, go.to(y.dtype))
    ours, theirs = run(ct.conv_transpose2d, x, w, b), run(F.conv_transpose2d, x, w, b)
    direct = ct.conv_transpose2d_backward(go, x, w, **kwargs)
    for what, o, t in zip(("output", "grad_input", "grad_weight", "grad_bias"), ours, theirs):
        assert o.dtype == dtype and o.shape == t.shape
    if dtype == torch.complex128:
        checks.assert_trees_close(ours, theirs, "complex128 forward and grads")
        checks.assert_trees_close(direct, theirs[1:], "complex128 conv_transpose2d_backward")
        return
    truth = run(F.conv_transpose2d, *(t.to(torch.complex128) for t in (x, w, b)))
    for what, o, t, r in zip(("output", "grad_input", "grad_weight", "grad_bias"), ours, theirs, truth):
        judge(o, t, r, what)
    for what, o, t, r in zip(("backward grad_input", "grad_weight", "grad_bias"), direct, theirs[1:], truth[1:]):
        judge(o, t, r, what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_complex_autograd_conventions(device, layer):
    kwargs = layer[1]
    inputs = tuple(t.requires_grad_() for t in tensors(layer, device, torch.complex128))

    def fn(*ts):
        return ct.conv_transpose2d(*ts, **kwargs)
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_batched_grad=True,
                                    check_batched_forward_grad=True, fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True, fast_mode=True)
    primals = tuple(t.detach() for t in inputs)
    tangents = tuple(torch.randn_like(t) for t in primals)
    checks.assert_trees_close(torch.func.jvp(fn, primals, tangents),
                              torch.func.jvp(lambda *ts: F.conv_transpose2d(*ts, **kwargs), primals, tangents),
                              "complex jvp")
    stacked = torch.stack([primals[0], 1j * primals[0]])
    with checks.no_fallback_warnings():
        got = torch.func.vmap(fn, in_dims=(0, None, None))(stacked, *primals[1:])
    checks.assert_trees_close(got, torch.func.vmap(lambda *ts: F.conv_transpose2d(*ts, **kwargs),
                                                   in_dims=(0, None, None))(stacked, *primals[1:]), "complex vmap")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("x_cl,w_cl", list(itertools.product((False, True), repeat=2)),
                         ids=["x_w", "x_wCL", "xCL_w", "xCL_wCL"])
def test_complex_memory_formats_match_torch(device, x_cl, w_cl):
    layer = LAYERS[1]
    x, w, b = tensors(layer, device, torch.complex64)
    if x_cl:
        x = x.contiguous(memory_format=torch.channels_last)
    if w_cl:
        w = w.contiguous(memory_format=torch.channels_last)
    results = {}
    for name, fn in (("ours", ct.conv_transpose2d), ("torch", F.conv_transpose2d)):
        xr, wr = (t.detach().clone(memory_format=torch.preserve_format).requires_grad_() for t in (x, w))
        y = fn(xr, wr, b, **layer[1])
        results[name] = (y,) + torch.autograd.grad(y, (xr, wr), torch.ones_like(y))
    for what, o, t in zip(("output", "grad_input", "grad_weight"), results["ours"], results["torch"]):
        assert checks.memory_format(o) == checks.memory_format(t), what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_module_and_1d_with_complex_parameters(device, dtype):
    torch.manual_seed(0)
    theirs = torch.nn.ConvTranspose1d(4, 6, 5, 3, 1, 2, 2, device=device, dtype=dtype)
    ours = ct.convert(torch.nn.ConvTranspose1d(4, 6, 5, 3, 1, 2, 2, device=device, dtype=dtype))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4, 9, dtype=dtype, device=device)
    rtol = 1e-10 if dtype == torch.complex128 else 1e-4
    torch.testing.assert_close(ours(x), theirs(x), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128], ids=["complex64", "complex128"])
@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_numpy_face(dtype, layer):
    kwargs = layer[1]
    x, w, b = (t.numpy().astype(dtype) for t in tensors(layer, "cpu", torch.complex128))
    y = cupyconv.conv_transpose2d(x, w, b, **kwargs)
    assert y.dtype == dtype
    go = (np.random.default_rng(1).standard_normal(y.shape) * (1 + 1j)).astype(dtype)
    grads = cupyconv.conv_transpose2d_backward(go, x, w, **kwargs)
    xt, wt, bt = (torch.from_numpy(a.astype(np.complex128)).requires_grad_() for a in (x, w, b))
    want_y = F.conv_transpose2d(xt, wt, bt, **kwargs)
    want = (want_y,) + torch.autograd.grad(want_y, (xt, wt, bt), torch.from_numpy(go.astype(np.complex128)))
    rtol = 1e-12 if dtype == np.complex128 else 1e-5
    for got, ref in zip((y,) + tuple(grads), want):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, ref.detach().numpy(), rtol=rtol, atol=rtol * np.abs(ref.detach().numpy()).max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_cupy_face(dtype):
    cupy = pytest.importorskip("cupy")
    layer = LAYERS[0]
    kwargs = layer[1]
    x, w, b = (t.numpy().astype(dtype) for t in tensors(layer, "cpu", torch.complex128))
    y = cupyconv.conv_transpose2d(*(cupy.asarray(a) for a in (x, w, b)), **kwargs)
    assert isinstance(y, cupy.ndarray) and str(y.dtype) == dtype
    gi, gw, gb = cupyconv.conv_transpose2d_backward(cupy.asarray(y), *(cupy.asarray(a) for a in (x, w)), **kwargs)
    ref = F.conv_transpose2d(*(torch.from_numpy(a.astype(np.complex128)) for a in (x, w, b)), **kwargs).numpy()
    rtol = 1e-10 if dtype == "complex128" else 1e-4
    np.testing.assert_allclose(y.get(), ref, rtol=rtol, atol=rtol * np.abs(ref).max())
    assert all(isinstance(g, cupy.ndarray) and str(g.dtype) == dtype for g in (gi, gw, gb))


def test_mixed_real_and_complex_are_type_errors():
    x, w, b = tensors(LAYERS[1], "cpu", torch.complex64)
    with pytest.raises(TypeError, match="same dtype"):
        ct.conv_transpose2d(x, w.real, b)
    with pytest.raises(TypeError, match="same dtype"):
        ct.conv_transpose2d(x, w, b.to(torch.complex128))
    with pytest.raises(TypeError, match="same dtype"):
        cupyconv.conv_transpose2d(x.numpy(), w.real.numpy())
    with pytest.raises(ValueError, match="bias"):
        ct.conv_transpose2d(x, w, b[:1])
    with pytest.raises(ValueError, match="bias"):
        cupyconv.conv_transpose2d(x.numpy(), w.numpy(), b[:1].numpy())
