"""1-D transposed convolution through every face: NumPy/CuPy arrays, the torch functional, the
drop-in ``ConvTranspose1d`` and ``convert``.  CPU cases run the float64 reference; the
gpu-marked cases run the 2-D kernels on one-row layers.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402

F = torch.nn.functional
nn = torch.nn

# (C_in, C_out, kernel, stride, padding, output_padding, groups, dilation, bias, input shape)
LAYERS = [
    (4, 6, 5, 3, 1, 2, 2, 2, True, (2, 4, 9)),
    (3, 2, 4, 2, 1, 0, 1, 1, False, (1, 3, 16)),
    (6, 6, 3, 1, 0, 0, 6, 3, True, (2, 6, 7)),         # depthwise, dilated
    (8, 4, 16, 8, 4, 0, 1, 1, True, (2, 8, 12)),        # vocoder-style upsampler
    (5, 3, 2, 2, 0, 1, 1, 1, True, (5, 6)),             # unbatched
]
LAYER_IDS = ["grouped_dilated", "no_bias", "depthwise", "vocoder", "unbatched"]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def kwargs_of(layer):
    _, _, _, s, p, op, g, d, _, _ = layer
    return dict(stride=s, padding=p, output_padding=op, groups=g, dilation=d)


def tensors(layer, device, dtype=torch.float64, seed=0):
    c_in, c_out, k, _, _, _, g, _, bias, shape = layer
    gen = torch.Generator().manual_seed(seed)

    def rand(*s):
        return torch.randn(s, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    return rand(*shape), rand(c_in, c_out // g, k), (rand(c_out) if bias else None)


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_numpy_face_matches_torch(layer):
    x, w, b = tensors(layer, "cpu")
    kw = kwargs_of(layer)
    xn, wn, bn = (None if t is None else t.numpy() for t in (x, w, b))
    y = cupyconv.conv_transpose1d(xn, wn, bn, **kw)
    np.testing.assert_allclose(y, F.conv_transpose1d(x, w, b, **kw).numpy(), rtol=1e-12, atol=1e-12)
    go = np.random.default_rng(0).standard_normal(y.shape)
    grads = cupyconv.conv_transpose1d_backward(go, xn, wn, **kw)
    xr, wr, br = (None if t is None else t.clone().requires_grad_() for t in (x, w, b))
    F.conv_transpose1d(xr, wr, br, **kw).backward(torch.from_numpy(go))
    for got, want in zip(grads, (xr.grad, wr.grad, None if br is None else br.grad)):
        if want is not None:
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_torch_functional_and_backward_match_torch(device, layer):
    kw = kwargs_of(layer)
    x, w, b = (None if t is None else t.requires_grad_() for t in tensors(layer, device))
    ours, theirs = ct.conv_transpose1d(x, w, b, **kw), F.conv_transpose1d(x, w, b, **kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)
    assert ours.stride() == theirs.stride()
    go = torch.randn_like(theirs)
    wanted = [t for t in (x, w, b) if t is not None]
    torch.testing.assert_close(torch.autograd.grad(ours, wanted, go),
                               torch.autograd.grad(theirs, wanted, go, retain_graph=True), rtol=1e-10, atol=1e-10)
    gi, gw, gb = ct.conv_transpose1d_backward(go, x.detach(), w.detach(), **kw)
    want = torch.autograd.grad(theirs, (x, w), go)
    torch.testing.assert_close((gi, gw), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gb, go.sum(dim=tuple(i for i in range(go.dim()) if i != go.dim() - 2)))
    inputs = tuple(wanted)
    assert torch.autograd.gradcheck(lambda *a: ct.conv_transpose1d(*a, **kw), inputs, check_forward_ad=True,
                                    check_batched_grad=True, fast_mode=True)
    assert torch.autograd.gradgradcheck(lambda *a: ct.conv_transpose1d(*a, **kw), inputs, fast_mode=True)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_input_memory_format_matches_torch(device):
    layer = LAYERS[0]
    kw = kwargs_of(layer)
    x, w, b = tensors(layer, device)
    x = x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    ours, theirs = ct.conv_transpose1d(x, w, b, **kw), F.conv_transpose1d(x, w, b, **kw)
    assert ours.stride() == theirs.stride()
    go = torch.randn_like(theirs)
    assert torch.autograd.grad(ours, x, go)[0].stride() == torch.autograd.grad(theirs, x, go)[0].stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.gpu
def test_low_precision_on_gpu_within_twice_torch_error(dtype):
    layer = LAYERS[3]
    kw = kwargs_of(layer)
    x, w, b = tensors(layer, "cuda")
    truth = F.conv_transpose1d(x, w, b, **kw)
    low = [t.to(dtype) for t in (x, w, b)]
    ours, theirs = ct.conv_transpose1d(*low, **kw), F.conv_transpose1d(*low, **kw)
    err, torch_err = ((r.double() - truth).abs().max().item() for r in (ours, theirs))
    assert ours.dtype == dtype
    assert err <= 2 * torch_err + 4 * torch.finfo(dtype).eps * truth.abs().max().item()


def test_module_equals_torch_in_signature_state_init_and_repr():
    assert inspect.signature(ct.ConvTranspose1d.__init__) == inspect.signature(nn.ConvTranspose1d.__init__)
    # torch's functional is a builtin without a signature; its documented one:
    assert list(inspect.signature(ct.conv_transpose1d).parameters) == [
        "input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation"]
    torch.manual_seed(0)
    theirs = nn.ConvTranspose1d(4, 6, 5, 3, 1, 2, 2, True, 2, dtype=torch.float64)
    torch.manual_seed(0)
    ours = ct.ConvTranspose1d(4, 6, 5, 3, 1, 2, 2, True, 2, dtype=torch.float64)
    assert repr(ours) == repr(theirs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for k in theirs.state_dict():
        assert torch.equal(ours.state_dict()[k], theirs.state_dict()[k])
    x = torch.randn(2, 4, 9, dtype=torch.float64)
    for size in ([33], [31], torch.tensor([32])):
        torch.testing.assert_close(ours(x, output_size=size), theirs(x, output_size=size))
    with pytest.raises(ValueError, match="zeros"):
        ct.ConvTranspose1d(4, 6, 3, padding_mode="reflect")(x)


def test_convert_replaces_1d_and_2d_modules_keeping_parameters():
    model = nn.Sequential(nn.ConvTranspose1d(4, 6, 4, 2, 1), nn.ReLU(), nn.Unflatten(1, (6, 1)),
                          nn.ConvTranspose2d(6, 2, 3))
    before = [id(p) for p in model.parameters()]
    x = torch.randn(2, 4, 5)
    want = model(x)
    ct.convert(model)
    assert isinstance(model[0], ct.ConvTranspose1d) and isinstance(model[3], ct.ConvTranspose2d)
    assert [id(p) for p in model.parameters()] == before
    torch.testing.assert_close(model(x), want)


@pytest.mark.parametrize("call", [
    lambda x, w: ct.conv_transpose1d(x, w, stride=(1, 2)),
    lambda x, w: ct.conv_transpose1d(x[None], w),
    lambda x, w: ct.conv_transpose1d(x, w[..., None]),
    lambda x, w: cupyconv.conv_transpose1d(x.numpy(), w.numpy(), padding=(1, 1)),
    lambda x, w: cupyconv.conv_transpose1d(x.numpy()[None], w.numpy()),
], ids=["stride_pair", "input_4d", "weight_4d", "numpy_padding_pair", "numpy_input_4d"])
def test_bad_1d_arguments_are_value_errors(call):
    x, w, _ = tensors(LAYERS[1], "cpu")
    with pytest.raises(ValueError, match="1-D|3-D|one int"):
        call(x, w)


def test_bad_1d_argument_types_are_type_errors():
    x, w, _ = tensors(LAYERS[1], "cpu")
    with pytest.raises(TypeError, match="stride"):
        ct.conv_transpose1d(x, w, stride=2.0)
    with pytest.raises(TypeError, match="input"):
        cupyconv.conv_transpose1d([1.0, 2.0], w.numpy())
