"""cupyconv.torch on CPU tensors: the module, the functional, the custom ops and their autograd.

CPU tensors run on the float64 NumPy reference, so everything here runs in CI without a GPU.
"""
from __future__ import annotations

import copy
import inspect
import itertools
import shutil
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402

OPS = torch.ops.cupyconv

# (C_in, C_out, kernel, stride, padding, output_padding, groups, dilation, bias, input shape)
LAYERS = [
    (3, 4, 3, 1, 0, 0, 1, 1, True, (2, 3, 5, 4)),
    (4, 6, (3, 2), (2, 1), (1, 0), (1, 0), 2, (1, 2), True, (2, 4, 4, 5)),
    (2, 3, 4, 2, 1, 1, 1, 1, False, (1, 2, 3, 3)),
    (4, 4, (2, 3), (3, 2), (0, 1), (2, 1), 4, 1, True, (2, 4, 3, 2)),        # depthwise, output_padding
    (3, 2, (1, 3), 1, 0, (1, 1), 1, (2, 3), True, (2, 3, 4, 4)),             # op < dilation, stride 1
    (2, 4, 3, (1, 2), (2, 1), 0, 2, 2, False, (2, 3, 3)),                    # unbatched
    (5, 3, (5, 1), (2, 3), (3, 0), (1, 2), 1, (2, 1), True, (5, 2, 4)),       # unbatched, op per axis
]
LAYER_IDS = [f"layer{i}" for i in range(len(LAYERS))]


def make_pair(layer, dtype=torch.float64, seed=0):
    c_in, c_out, k, s, p, op, g, d, bias, _ = layer
    torch.manual_seed(seed)
    ref = nn.ConvTranspose2d(c_in, c_out, k, s, p, op, g, bias, d, dtype=dtype)
    torch.manual_seed(seed)
    ours = ct.ConvTranspose2d(c_in, c_out, k, s, p, op, g, bias, d, dtype=dtype)
    return ref, ours


def functional_kwargs(layer):
    _, _, _, s, p, op, g, d, _, _ = layer
    return dict(stride=s, padding=p, output_padding=op, groups=g, dilation=d)


def randn(shape, dtype=torch.float64, requires_grad=False, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(requires_grad)


def assert_close(actual, expected, rtol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if expected.numel() == 0:
        return
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rtol * max(scale, 1e-30), f"{what}: max error {err:.3e} > {rtol:g} * max|ref| {scale:.3e}"


# ----------------------------------------------------------------------- the module

def test_constructor_signature_equals_torch():
    assert inspect.signature(ct.ConvTranspose2d) == inspect.signature(nn.ConvTranspose2d)
    assert inspect.signature(ct.ConvTranspose2d.__init__) == inspect.signature(nn.ConvTranspose2d.__init__)
    assert list(inspect.signature(ct.ConvTranspose2d.forward).parameters) == \
        list(inspect.signature(nn.ConvTranspose2d.forward).parameters)
    assert issubclass(ct.ConvTranspose2d, nn.ConvTranspose2d)


def test_functional_signature_equals_torch():
    ours = inspect.signature(ct.conv_transpose2d)
    assert list(ours.parameters) == ["input", "weight", "bias", "stride", "padding", "output_padding", "groups",
                                     "dilation"]
    assert [p.default for p in ours.parameters.values()][2:] == [None, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_state_dict_init_and_repr_equal_torch(layer):
    ref, ours = make_pair(layer, dtype=torch.float32, seed=1234)
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert list(sd_ref) == list(sd_ours)
    for key in sd_ref:
        assert sd_ref[key].shape == sd_ours[key].shape, key
        assert sd_ref[key].dtype == sd_ours[key].dtype, key
        assert torch.equal(sd_ref[key], sd_ours[key]), f"{key}: different init under the same seed"
    assert repr(ours) == repr(ref)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert (ours.bias is None) == (not layer[8])
    # state_dicts load across the two classes
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())


def test_bias_false():
    ref, ours = make_pair((3, 5, 3, 2, 1, 1, 1, 1, False, None))
    assert ours.bias is None and "bias" not in ours.state_dict()
    x = randn((2, 3, 4, 4))
    assert_close(ours(x), ref(x), 1e-12, "bias=False forward")


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_module_forward_and_grads_match_torch(layer):
    ref, ours = make_pair(layer)
    x_ref = randn(layer[-1], requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    y_ref, y = ref(x_ref), ours(x)
    assert y.grad_fn is not None
    assert_close(y, y_ref, 1e-12, "output")
    go = randn(y_ref.shape, seed=5)
    y_ref.backward(go)
    y.backward(go)
    assert_close(x.grad, x_ref.grad, 1e-12, "grad_input")
    assert_close(ours.weight.grad, ref.weight.grad, 1e-12, "grad_weight")
    if ref.bias is not None:
        assert_close(ours.bias.grad, ref.bias.grad, 1e-12, "grad_bias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lower_precision_dtypes_on_cpu(dtype):
    layer = LAYERS[1]
    ref, ours = make_pair(layer, dtype=torch.float64)
    ours = ours.to(dtype)
    x = randn(layer[-1], dtype=dtype)
    y = ours(x)
    assert y.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    # the weights were rounded to dtype too: compare against float64 math on the rounded values
    want = F.conv_transpose2d(x.double(), ours.weight.double(), ours.bias.double(), **functional_kwargs(layer))
    assert_close(y.double(), want, tol, f"{dtype} output")


@pytest.mark.parametrize("output_size", [None, (9, 11), [2, 6, 10, 12], (10, 11), torch.Size([9, 12])])
def test_forward_output_size_matches_torch(output_size):
    layer = (4, 6, 3, 2, 1, 0, 2, 1, True, (2, 4, 5, 6))
    ref, ours = make_pair(layer)
    x = randn(layer[-1])
    y, want = ours(x, output_size=output_size), ref(x, output_size=output_size)
    assert_close(y, want, 1e-12, f"output_size={output_size}")
    # unbatched input takes (H, W) or (C, H, W)
    unbatched = output_size if output_size is None or len(output_size) == 2 else (6,) + tuple(output_size[-2:])
    assert_close(ours(x[0], output_size=unbatched), ref(x[0], output_size=unbatched), 1e-12, "unbatched")


def test_forward_bad_output_size_raises_like_torch():
    layer = (4, 6, 3, 2, 1, 0, 2, 1, True, (2, 4, 5, 6))
    ref, ours = make_pair(layer)
    x = randn(layer[-1])
    for bad in [(20, 20), (1, 2, 3)]:
        with pytest.raises(ValueError):
            ref(x, output_size=bad)
        with pytest.raises(ValueError):
            ours(x, output_size=bad)


def test_padding_mode_other_than_zeros_is_value_error():
    with pytest.raises(ValueError):
        nn.ConvTranspose2d(2, 2, 3, padding_mode="reflect")
    with pytest.raises(ValueError):
        ct.ConvTranspose2d(2, 2, 3, padding_mode="reflect")
    m = ct.ConvTranspose2d(2, 2, 3)
    m.padding_mode = "circular"
    with pytest.raises(ValueError, match="zeros"):
        m(torch.randn(1, 2, 4, 4))


def test_channels_last_in_gives_channels_last_out():
    layer = LAYERS[1]
    ref, ours = make_pair(layer)
    x = randn(layer[-1]).contiguous(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    y = ours(x)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    assert_close(y, ref(x), 1e-12, "channels_last output")
    # channels_last weights (model.to(memory_format=channels_last)) work too
    ours = ours.to(memory_format=torch.channels_last)
    assert_close(ours(x.contiguous()), ref(x.contiguous()), 1e-12, "channels_last weight")


def test_non_contiguous_inputs():
    layer = LAYERS[1]
    kw = functional_kwargs(layer)
    x = randn((2, 4, 8, 5))[:, :, ::2, :]
    w = randn((4, 3, 2, 3, 2), seed=2)[..., 0].transpose(2, 3).contiguous().transpose(2, 3)
    b = randn((12,), seed=3)[::2]
    assert not (x.is_contiguous() or w.is_contiguous() or b.is_contiguous())
    assert_close(ct.conv_transpose2d(x, w, b, **kw), F.conv_transpose2d(x, w, b, **kw), 1e-12, "strided")


def test_empty_batch():
    m = ct.ConvTranspose2d(3, 2, 3, stride=2).double()
    x = torch.zeros((0, 3, 4, 4), dtype=torch.float64, requires_grad=True)
    y = m(x)
    assert y.shape == (0, 2, 9, 9)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(m.weight.grad, torch.zeros_like(m.weight))
    assert torch.equal(m.bias.grad, torch.zeros_like(m.bias))


def test_no_grad_gives_no_graph():
    m = ct.ConvTranspose2d(3, 2, 3).double()
    with torch.no_grad():
        y = m(randn((1, 3, 4, 4)))
    assert y.grad_fn is None and not y.requires_grad
    with torch.inference_mode():
        assert m(randn((1, 3, 4, 4))).grad_fn is None


# --------------------------------------------------------------------------- convert

class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.ConvTranspose2d(8, 6, 4, 2, 1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
            nn.ConvTranspose2d(6, 4, (3, 2), (2, 1), (1, 0), (1, 0), groups=2, dilation=(1, 2)), nn.ReLU())
        self.extra = nn.ModuleList([nn.Conv2d(4, 4, 1), nn.ConvTranspose2d(4, 3, 3, padding=1)])

    def forward(self, x):
        x = self.body(x)
        x = self.extra[0](x)
        return torch.tanh(self.extra[1](x))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.ConvTranspose2d(16, 8, 4, 1, 0)
        self.inner = Inner()

    def forward(self, z):
        return self.inner(F.relu(self.head(z)))


def _conv_ts(model):
    return [m for m in model.modules() if isinstance(m, nn.ConvTranspose2d)]


def test_convert_nested_model():
    torch.manual_seed(0)
    model = Outer().double()
    original = copy.deepcopy(model)
    params = {name: p for name, p in model.named_parameters()}
    model.eval()
    model.inner.train()          # mixed training modes are kept module by module
    original.eval()
    original.inner.train()
    z = randn((3, 16, 1, 1))
    result = ct.convert(model)
    assert result is model
    convs = _conv_ts(model)
    assert len(convs) == 4 and all(type(m) is ct.ConvTranspose2d for m in convs)
    assert not any(type(m) is nn.ConvTranspose2d for m in model.modules())
    for name, p in model.named_parameters():
        assert p is params[name], f"{name} is a new Parameter object"
    for a, b in zip(model.modules(), original.modules()):
        assert a.training == b.training
    assert list(model.state_dict()) == list(original.state_dict())
    assert model.head.weight.device == original.head.weight.device
    assert model.head.weight.dtype == torch.float64
    y, want = model(z), original(z)
    assert torch.equal(y, want) or (y - want).abs().max() <= 1e-12 * want.abs().max()
    # converting again changes nothing
    assert ct.convert(model) is model and _conv_ts(model) == convs


def test_building_or_converting_modules_starts_nvrtc_in_the_background(monkeypatch):
    """A cupyconv module built, or a model converted, starts NVRTC's one-off start-up (compiler.warm_up) so the
    first call need not pay it; a model with nothing to convert starts nothing."""
    from cupyconv.jit import compiler

    started = []
    monkeypatch.setattr(compiler, "warm_up", lambda: started.append(1))
    ct.ConvTranspose2d(2, 3, 3)
    ct.ConvTranspose1d(2, 3, 3)
    assert len(started) == 2
    ct.convert(nn.Sequential(nn.Linear(2, 2)))
    assert len(started) == 2
    ct.convert(nn.Sequential(nn.ConvTranspose2d(2, 3, 3), nn.ConvTranspose1d(3, 2, 2)))
    assert len(started) == 4


def test_convert_root_shared_and_subclass():
    root = nn.ConvTranspose2d(2, 3, 3)
    converted = ct.convert(root)
    assert type(converted) is ct.ConvTranspose2d and converted.weight is root.weight
    assert ct.convert(converted) is converted

    class MyConvT(nn.ConvTranspose2d):
        pass

    shared = nn.ConvTranspose2d(3, 3, 1)
    model = nn.Sequential(MyConvT(2, 3, 3), shared, nn.ReLU(), shared)
    ct.convert(model)
    assert type(model[0]) is ct.ConvTranspose2d
    assert type(model[1]) is ct.ConvTranspose2d and model[1] is model[3], "a shared module must stay shared"
    x = randn((1, 2, 4, 4), dtype=torch.float32)
    assert model(x).shape == (1, 3, 6, 6)


def test_convert_leaves_parametrized_and_lazy_modules_alone():
    param = torch.nn.utils.parametrizations.weight_norm(nn.ConvTranspose2d(2, 3, 3))
    lazy = nn.LazyConvTranspose2d(3, 3)
    model = nn.Sequential(param, lazy)
    ct.convert(model)
    assert model[0] is param and model[1] is lazy
    x = randn((1, 2, 4, 4), dtype=torch.float32)
    assert model(x).shape == (1, 3, 8, 8)


def test_convert_keeps_optimizer_working():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(3, 2, 3, stride=2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ct.convert(model)
    before = model[0].weight.detach().clone()
    model(randn((1, 3, 3, 3))).sum().backward()
    opt.step()
    assert not torch.equal(before, model[0].weight), "the optimiser no longer holds the module's parameters"


# ------------------------------------------------------------------- autograd, gradcheck

@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
def test_gradcheck_functional(layer):
    c_in, c_out, k, s, p, op, g, d, bias, shape = layer
    kh, kw = (k, k) if isinstance(k, int) else k
    x = randn(shape, requires_grad=True, seed=1)
    w = randn((c_in, c_out // g, kh, kw), requires_grad=True, seed=2)
    b = randn((c_out,), requires_grad=True, seed=3) if bias else None
    kwargs = functional_kwargs(layer)
    inputs = (x, w) if b is None else (x, w, b)

    def fn(*args):
        return ct.conv_transpose2d(*args, **kwargs)

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("layer", [LAYERS[1], LAYERS[2], LAYERS[5]], ids=["batched", "no_bias", "unbatched"])
def test_gradcheck_module_and_op(layer):
    _, ours = make_pair(layer)
    x = randn(layer[-1], requires_grad=True)
    names = [n for n, _ in ours.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for _, p in ours.named_parameters())

    def through_module(x, *ps):
        return torch.func.functional_call(ours, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradcheck(through_module, (x,) + params)
    s, p, op, d = ([*ct._pair(v)] for v in (layer[3], layer[4], layer[5], layer[7]))

    def through_op(x, w, *b):
        return OPS.conv_transpose2d(x, w, b[0] if b else None, s, p, op, layer[6], d)

    assert torch.autograd.gradcheck(through_op, (x,) + params)


@pytest.mark.parametrize("layer", [LAYERS[1], LAYERS[3], LAYERS[6]], ids=["grouped", "depthwise", "unbatched"])
def test_double_backward(layer):
    c_in, c_out, k, s, p, op, g, d, bias, shape = layer
    kh, kw = (k, k) if isinstance(k, int) else k
    x = randn(shape, requires_grad=True, seed=1)
    w = randn((c_in, c_out // g, kh, kw), requires_grad=True, seed=2)
    b = randn((c_out,), requires_grad=True, seed=3)
    kwargs = functional_kwargs(layer)
    assert torch.autograd.gradgradcheck(lambda *a: ct.conv_transpose2d(*a, **kwargs), (x, w, b))
    params = [list(ct._pair(kwargs[n])) for n in ("stride", "padding", "output_padding")]
    dil = list(ct._pair(kwargs["dilation"]))
    assert torch.autograd.gradgradcheck(lambda *a: OPS.conv_transpose2d(*a, *params, g, dil), (x, w, b))


def test_backward_function_and_output_mask():
    layer = LAYERS[1]
    kw = functional_kwargs(layer)
    x = randn(layer[-1], requires_grad=True)
    w = randn((4, 3, 3, 2), requires_grad=True, seed=2)
    y = F.conv_transpose2d(x, w, None, **kw)
    go = randn(y.shape, seed=4)
    want = torch.autograd.grad(y, (x, w), go)
    gi, gw, gb = ct.conv_transpose2d_backward(go, x.detach(), w.detach(), **kw)
    assert_close(gi, want[0], 1e-12, "grad_input")
    assert_close(gw, want[1], 1e-12, "grad_weight")
    assert_close(gb, go.sum((0, 2, 3)), 1e-12, "grad_bias")
    gi, gw, gb = ct.conv_transpose2d_backward(go, x.detach(), w.detach(), **kw, output_mask=(False, True, False))
    assert gi is None and gb is None and gw is not None
    s, p, op, d = ([*ct._pair(kw[n])] for n in ("stride", "padding", "output_padding", "dilation"))
    out = OPS.conv_transpose2d_backward(go, x.detach(), w.detach(), s, p, op, kw["groups"], d, [True, False, True])
    assert out[1] is None and out[0] is not None and out[2] is not None
    assert_close(out[0], want[0], 1e-12, "op grad_input")


def _count_backward_masks(monkeypatch):
    seen = []
    real = ct._backward_impl

    def spy(go, x, w, *rest):
        seen.append(tuple(bool(m) for m in rest[-1]))
        return real(go, x, w, *rest)

    monkeypatch.setattr(ct, "_backward_impl", spy)
    return seen


@pytest.mark.parametrize("path", ["functional", "op"])
@pytest.mark.parametrize("wants", [(True, False, False), (False, True, False), (False, False, True),
                                   (True, True, True), (False, True, True)])
def test_needs_input_grad_is_respected(monkeypatch, path, wants):
    seen = _count_backward_masks(monkeypatch)
    x = randn((2, 4, 3, 3)).requires_grad_(wants[0])
    w = randn((4, 3, 3, 3), seed=2).requires_grad_(wants[1])
    b = randn((3,), seed=3).requires_grad_(wants[2])
    if path == "functional":
        y = ct.conv_transpose2d(x, w, b, stride=2)
    else:
        y = OPS.conv_transpose2d(x, w, b, [2, 2], [0, 0], [0, 0], 1, [1, 1])
    y.sum().backward()
    assert seen == [wants], f"backward ran with output_mask {seen}, wanted {[wants]}"
    for t, wanted in zip((x, w, b), wants):
        assert (t.grad is not None) == wanted


def test_no_bias_never_computes_grad_bias(monkeypatch):
    seen = _count_backward_masks(monkeypatch)
    x = randn((2, 4, 3, 3), requires_grad=True)
    w = randn((4, 3, 3, 3), seed=2, requires_grad=True)
    ct.conv_transpose2d(x, w, None).sum().backward()
    assert seen == [(True, True, False)]


def test_fast_path_and_op_are_identical():
    layer = LAYERS[3]
    kw = functional_kwargs(layer)
    x = randn(layer[-1], requires_grad=True)
    w = randn((4, 1, 2, 3), seed=2, requires_grad=True)
    b = randn((4,), seed=3, requires_grad=True)
    y1 = ct.conv_transpose2d(x, w, b, **kw)
    g1 = torch.autograd.grad(y1.sum(), (x, w, b))
    s, p, op, d = ([*ct._pair(kw[n])] for n in ("stride", "padding", "output_padding", "dilation"))
    y2 = OPS.conv_transpose2d(x, w, b, s, p, op, kw["groups"], d)
    g2 = torch.autograd.grad(y2.sum(), (x, w, b))
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, c) for a, c in zip(g1, g2))


# --------------------------------------------------------------------------- opcheck

def _op_args(layer, bias=True, channels_last=False, requires_grad=True):
    c_in, c_out, k, s, p, op, g, d, _, shape = layer
    kh, kw = (k, k) if isinstance(k, int) else k
    x = randn(shape, requires_grad=requires_grad)
    if channels_last:
        x = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(requires_grad)
    w = randn((c_in, c_out // g, kh, kw), seed=2, requires_grad=requires_grad)
    b = randn((c_out,), seed=3, requires_grad=requires_grad) if bias else None
    params = [list(ct._pair(v)) for v in (s, p, op)] + [g, list(ct._pair(d))]
    return x, w, b, params


@pytest.mark.parametrize("case", ["bias", "no_bias", "unbatched", "channels_last"])
def test_opcheck_forward(case):
    layer = LAYERS[5] if case == "unbatched" else LAYERS[1]
    x, w, b, params = _op_args(layer, bias=case != "no_bias", channels_last=case == "channels_last")
    torch.library.opcheck(OPS.conv_transpose2d.default, (x, w, b, *params))


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True],
                                  [False, False, False]])
@pytest.mark.parametrize("unbatched", [False, True])
def test_opcheck_backward(mask, unbatched):
    layer = LAYERS[5] if unbatched else LAYERS[1]
    x, w, _, params = _op_args(layer)
    y = F.conv_transpose2d(x.detach(), w.detach(), None, *params[:3], params[3], params[4])
    go = randn(y.shape, seed=9, requires_grad=True)
    torch.library.opcheck(OPS.conv_transpose2d_backward.default, (go, x, w, *params, mask))


def test_opcheck_channels_last_backward():
    x, w, _, params = _op_args(LAYERS[1], channels_last=True)
    y = F.conv_transpose2d(x.detach(), w.detach(), None, *params[:3], params[3], params[4])
    go = randn(y.shape, seed=9).contiguous(memory_format=torch.channels_last).requires_grad_()
    torch.library.opcheck(OPS.conv_transpose2d_backward.default, (go, x, w, *params, [True, True, True]))


# ----------------------------------------------------------------------------- errors

def test_mixed_devices_are_value_errors_naming_the_arguments():
    x = randn((1, 2, 3, 3))
    w = randn((2, 2, 3, 3))
    with pytest.raises(ValueError, match="input.*cpu.*weight.*meta"):
        ct.conv_transpose2d(x, w.to("meta"))
    with pytest.raises(ValueError, match="input.*cpu.*bias.*meta"):
        ct.conv_transpose2d(x, w, torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="input.*meta.*weight.*cpu"):
        OPS.conv_transpose2d(x.to("meta"), w, None, [1, 1], [0, 0], [0, 0], 1, [1, 1])
    with pytest.raises(ValueError, match="grad_output.*meta.*input.*cpu"):
        ct.conv_transpose2d_backward(torch.zeros(1, 2, 5, 5, device="meta"), x, w)


def test_dtype_errors_are_type_errors():
    x = randn((1, 2, 3, 3))
    w = randn((2, 2, 3, 3))
    with pytest.raises(TypeError, match="input.*int32"):
        ct.conv_transpose2d(x.int(), w.int())
    with pytest.raises(TypeError, match="weight.*complex"):
        ct.conv_transpose2d(x, w.to(torch.complex64))
    with pytest.raises(TypeError, match="same dtype"):
        ct.conv_transpose2d(x.float(), w)
    with pytest.raises(TypeError, match="same dtype"):
        OPS.conv_transpose2d(x, w, torch.zeros(2, dtype=torch.float16), [1, 1], [0, 0], [0, 0], 1, [1, 1])
    with pytest.raises(TypeError, match="torch.Tensor"):
        ct.conv_transpose2d(x.numpy(), w)


def test_bad_arguments_are_rejected_before_running():
    x = randn((1, 4, 3, 3))
    w = randn((4, 2, 3, 3))
    with pytest.raises(ValueError, match="output_padding"):
        ct.conv_transpose2d(x, w, stride=2, output_padding=2)
    with pytest.raises(ValueError, match="groups"):
        ct.conv_transpose2d(x, w, groups=3)
    with pytest.raises(ValueError, match="input channels"):
        ct.conv_transpose2d(randn((1, 3, 3, 3)), w)
    with pytest.raises(ValueError, match="bias"):
        ct.conv_transpose2d(x, w, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="stride"):
        ct.conv_transpose2d(x, w, stride=1.5)
    with pytest.raises(ValueError, match="input must be 3-D"):
        ct.conv_transpose2d(randn((4, 3)), w)
    with pytest.raises(ValueError, match="grad_output"):
        ct.conv_transpose2d_backward(randn((1, 2, 4, 4)), x, w)


# ---------------------------------------------------------------------------- autocast

@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_autocast_cpu_matches_nn_dtype(dtype):
    layer = LAYERS[1]
    ref, ours = make_pair(layer, dtype=torch.float32)
    x = randn(layer[-1], dtype=torch.float32)
    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.autocast("cpu", **kwargs):
        want = ref(x)
        got = ours(x)
        s, p, op, d = ([*ct._pair(v)] for v in (layer[3], layer[4], layer[5], layer[7]))
        via_op = OPS.conv_transpose2d(x, ours.weight, ours.bias, s, p, op, layer[6], d)
        float64 = copy.deepcopy(ours).double()(x.double())
    assert got.dtype == want.dtype == via_op.dtype, (got.dtype, want.dtype, via_op.dtype)
    assert float64.dtype == torch.float64          # autocast leaves float64 alone, as in torch
    assert_close(got.float(), want.float(), 2e-2, "autocast output")
    got.float().sum().backward()                   # gradients flow back through the cast
    assert ours.weight.grad is not None and ours.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------------- torch.compile

class TinyGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = ct.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.b = ct.ConvTranspose2d(6, 2, (2, 3), stride=(1, 2), bias=False, groups=2)

    def forward(self, x):
        return torch.tanh(self.b(F.relu(self.bn(self.a(x)))))


def _compiled_matches_eager(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGenerator().double()
    x = randn((2, 4, 5, 5), requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y = compiled(x)
    y.square().sum().backward()
    got = (y.detach(), x.grad.clone(), model.a.weight.grad.clone(), model.b.weight.grad.clone())
    model.zero_grad()
    x.grad = None
    y = model(x)
    y.square().sum().backward()
    want = (y.detach(), x.grad, model.a.weight.grad, model.b.weight.grad)
    for name, a, e in zip(("output", "grad_input", "grad a.weight", "grad b.weight"), got, want):
        assert_close(a, e, 1e-10, f"{backend} {name}")


def test_compile_fullgraph_aot_eager():
    """Dynamo + AOTAutograd trace through the custom ops with no graph break (fullgraph=True)."""
    _compiled_matches_eager("aot_eager")


def test_compile_fullgraph_inductor():
    if shutil.which("gcc") is None and shutil.which("cc") is None and shutil.which("clang") is None:
        pytest.skip("inductor needs a C++ compiler")
    try:
        import torch._inductor  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"inductor unavailable: {exc}")
    _compiled_matches_eager("inductor")


def test_compile_dynamic_shapes_no_recompile_per_size():
    torch._dynamo.reset()
    m = ct.ConvTranspose2d(3, 2, 3, stride=2).double()
    compiled = torch.compile(m, fullgraph=True, dynamic=True, backend="aot_eager")
    for size in ((4, 5), (6, 7), (9, 3)):
        x = randn((2, 3) + size)
        assert_close(compiled(x), m(x), 1e-12, f"dynamic {size}")


# ------------------------------------------------------------------------ package hygiene

def test_importing_cupyconv_torch_does_not_break_the_package():
    """design.md's naming trap: cupyconv.torch must not shadow anything the package needs."""
    assert sys.modules["cupyconv.torch"] is ct
    assert cupyconv.torch is ct
    x = np.random.default_rng(0).standard_normal((1, 2, 3, 3))
    w = np.random.default_rng(1).standard_normal((2, 2, 2, 2))
    y = cupyconv.conv_transpose2d(x, w, None, stride=2)
    assert isinstance(y, np.ndarray) and y.shape == (1, 2, 6, 6)


def test_importing_cupyconv_torch_without_torch_names_the_install():
    import subprocess

    code = "import sys; sys.modules['torch'] = None; import cupyconv.torch"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and 'pip install "cupyconv[torch]"' in last, done.stderr


def test_tf32_hook_reads_cudnn_flag():
    old = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = False
        assert ct.tf32_allowed() is False
        torch.backends.cudnn.allow_tf32 = True
        assert ct.tf32_allowed() is True
    finally:
        torch.backends.cudnn.allow_tf32 = old


# ------------------------------------------------- the CUDA glue, with the engine replaced

class _EngineCalls:
    """Stands in for cupyconv.engine under cupyconv.torch's CUDA glue: notes each call's geometry, layout and
    pointers, and launches nothing."""

    def __init__(self):
        self.calls = []
        self.pointers = []   # each call's tensor pointers, in the engine's argument order
        self.grad_weight_channels_last = []   # each call's grad_weight layout argument

    def forward(self, g, dt, x, w, b, out, launcher, layout, precision, mask=None, grad_weight_channels_last=None):
        self.calls.append(("forward", g, layout, w))
        self.pointers.append((x, w, b, out))
        self.grad_weight_channels_last.append(grad_weight_channels_last)

    def backward(self, g, dt, go, x, w, gi, gw, gb, launcher, layout, precision, grad_weight_channels_last=None):
        self.calls.append(("backward", g, layout, w))
        self.pointers.append((go, x, w, gi, gw, gb))
        self.grad_weight_channels_last.append(grad_weight_channels_last)


@pytest.fixture
def cuda_glue(monkeypatch):
    """cupyconv.torch's CUDA functions run on CPU tensors, with the engine, device switches and streams faked."""
    calls = _EngineCalls()
    monkeypatch.setattr(ct, "_engine", calls)
    monkeypatch.setattr(ct, "_enter_device", lambda index: index)
    monkeypatch.setattr(ct, "_raw_stream", lambda index: 0, raising=False)
    monkeypatch.setattr(ct, "_Launcher", lambda *args: None)
    return calls


def _glue_call(x, w, mask):
    """The forward and a backward of ``mask`` through the CUDA glue (the engine faked); returns grad_weight."""
    entry = _as_if_on_cuda(ct._forward_entry(x, w, None, 2, 1, 1, 1, 1))
    ct._cuda_forward(x, w, None, entry)
    go = torch.randn(entry.out_shape, dtype=x.dtype)
    return ct._cuda_backward(go, x, w, mask, _as_if_on_cuda(ct._backward_entry(go, x, w, 2, 1, 1, 1, 1, mask)))[1]


def _as_if_on_cuda(entry):
    """A copy of a CPU configuration's entry that the CUDA glue takes for one on device 0."""
    entry = copy.copy(entry)
    entry.index = 0
    return entry


@pytest.mark.parametrize("mask", [(True, True, False), (False, True, False)])
@pytest.mark.parametrize("x_cl,w_cl", [(True, True), (True, False), (False, True), (False, False)])
def test_the_weight_is_handed_to_the_kernels_in_its_own_layout(cuda_glue, x_cl, w_cl, mask):
    """A channels_last weight goes to the engine as it is (its own pointer, and a geometry naming its layout),
    and so does a contiguous one; grad_weight comes back in torch's memory format either way, written so by the
    kernels (the engine is told where that differs from the weight's), with no copy after them."""
    x = torch.randn(2, 8, 5, 6)
    w = torch.randn(8, 4, 3, 3)
    if x_cl:
        x = x.contiguous(memory_format=torch.channels_last)
    if w_cl:
        w = w.contiguous(memory_format=torch.channels_last)
    gw = _glue_call(x, w, mask)
    assert [c[0] for c in cuda_glue.calls] == ["forward", "backward"]
    for kind, g, layout, pointer in cuda_glue.calls:
        assert g.weight_channels_last is w_cl, kind
        assert pointer == w.data_ptr(), f"{kind}: the weight was copied"
        assert layout == ct._layout_for(x, w)
    torch_format = x_cl or w_cl   # torch's convolution: channels_last when the input or the weight is
    assert gw.is_contiguous(memory_format=torch.channels_last if torch_format else torch.contiguous_format)
    assert gw.is_contiguous() != (torch_format and gw.shape[1] > 1)
    told = None if torch_format == w_cl else torch_format
    assert cuda_glue.grad_weight_channels_last == [told, told]
    assert gw.data_ptr() == cuda_glue.pointers[-1][4], "grad_weight was copied after the kernels"


@pytest.mark.parametrize("w_shape", [(8, 4, 1, 1), (8, 1, 3, 3)], ids=["1x1", "one-output-channel"])
def test_a_weight_alike_in_both_formats_keeps_its_own_layout(cuda_glue, w_shape):
    """A weight whose contiguous and channels_last memory are one (a 1 x 1 kernel, one output channel a group):
    grad_weight beside a channels_last input is already in torch's format, so the engine is told nothing."""
    x = torch.randn(2, 8, 5, 6).contiguous(memory_format=torch.channels_last)
    gw = _glue_call(x, torch.randn(w_shape), (True, True, False))
    assert cuda_glue.grad_weight_channels_last == [None, None]
    assert [g.weight_channels_last for _, g, _, _ in cuda_glue.calls] == [False, False]
    assert gw.is_contiguous(memory_format=torch.channels_last) and gw.data_ptr() == cuda_glue.pointers[-1][4]


def _strided(t, kind):
    """``t``'s values as a contiguous, a channels_last or a non-dense (every other element) tensor."""
    if kind == "contiguous":
        return t.contiguous()
    if kind == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def test_a_configuration_cached_for_one_layout_still_copies_another(cuda_glue):
    """The per-configuration entries decide once which inputs the kernels can read in place; tensors of the
    same shapes in other memory (channels_last, or not dense) get entries of their own, copies where the
    kernels need them, and outputs in torch's memory format."""
    base_x, base_w, base_b = torch.randn(2, 8, 5, 6), torch.randn(8, 4, 3, 3), torch.randn(4)
    for kinds in itertools.product(("contiguous", "channels_last", "strided"), repeat=2):
        x, w = _strided(base_x, kinds[0]), _strided(base_w, kinds[1])
        b = _strided(base_b.reshape(1, 1, 1, 4), "strided").reshape(4) if kinds[0] == "strided" else base_b
        entry = _as_if_on_cuda(ct._forward_entry(x, w, b, 2, 1, 1, 1, 1))
        out = ct._cuda_forward(x, w, b, entry)
        x_ptr, w_ptr, b_ptr, out_ptr = cuda_glue.pointers[-1]
        layout = ct._layout_for(x, w)
        assert (x_ptr == x.data_ptr()) == (x.is_contiguous(memory_format=torch.channels_last if layout == "nhwc"
                                                           else torch.contiguous_format)), kinds
        assert (w_ptr == w.data_ptr()) == (kinds[1] != "strided"), kinds
        assert (b_ptr == b.data_ptr()) == b.is_contiguous(), kinds
        assert out_ptr == out.data_ptr()
        expected = torch.nn.functional.conv_transpose2d(x, w, b, 2, 1, 1)
        assert out.shape == expected.shape and out.stride() == expected.stride(), kinds

        go = _strided(torch.randn(out.shape), "strided")
        mask = (True, True, True)
        gi, gw, gb = ct._cuda_backward(go, x, w, mask, _as_if_on_cuda(ct._backward_entry(go, x, w, 2, 1, 1, 1, 1,
                                                                                          mask)))
        go_ptr, x_ptr, w_ptr = cuda_glue.pointers[-1][:3]
        assert go_ptr != go.data_ptr(), "a grad_output that is not dense is copied"
        assert (w_ptr == w.data_ptr()) == (kinds[1] != "strided"), kinds
        x_in_layout = kinds[0] == ("channels_last" if layout == "nhwc" else "contiguous")
        assert (x_ptr == x.data_ptr()) == x_in_layout, kinds
        torch_gi, torch_gw, torch_gb = torch.ops.aten.convolution_backward(
            go, x, w, [4], [2, 2], [1, 1], [1, 1], True, [1, 1], 1, list(mask))
        for ours, theirs in ((gi, torch_gi), (gw, torch_gw), (gb, torch_gb)):
            assert ours.shape == theirs.shape and ours.stride() == theirs.stride(), kinds


def test_grad_weight_written_channels_last_is_made_contiguous_where_torch_keeps_it_so(cuda_glue, monkeypatch):
    """Where torch's grad_weight is contiguous beside a channels_last weight (float64 on CUDA, an unbatched
    channels_last input), the kernels still write the weight's layout and the glue converts."""
    monkeypatch.setattr(ct, "_grad_weight_channels_last", lambda x, w: False)
    monkeypatch.setattr(ct, "_backward_cache", {})   # entries keep the format they were made with
    x = torch.randn(2, 8, 5, 6).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    gw = _glue_call(x, w, (True, True, False))
    assert cuda_glue.calls[-1][1].weight_channels_last
    assert gw.is_contiguous()
