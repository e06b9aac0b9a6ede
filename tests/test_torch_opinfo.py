"""torch's own test inputs through cupyconv: the OpInfo samples of
``nn.functional.conv_transpose2d`` and ``conv_transpose1d`` and the ModuleInfo inputs of
``nn.ConvTranspose2d`` and ``nn.ConvTranspose1d``.

Each sample runs in its contiguous, noncontiguous and channels_last forms: the forward and
the gradients against torch, gradcheck and gradgradcheck (which also check forward-mode AD,
forward-over-reverse and batched gradients through vmap), jvp, vmap and compile.  float16,
bfloat16 and float32 are judged against a float64 truth: within twice torch's own error
plus a few roundings.  The CPU runs the float64 reference; the gpu-marked cases run the
CUDA kernels.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402

import cupyconv.torch as ct  # noqa: E402
import transform_checks as checks  # noqa: E402

# Importing torch's test internals freezes torch.backends flags (they may then only change
# inside flags() context managers); the rest of the suite sets them directly.
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
assert not torch.backends.flags_frozen()

F = torch.nn.functional
# (torch's functional, ours, OpInfo, ModuleInfo, our module)
OPS = {
    "2d": (F.conv_transpose2d, ct.conv_transpose2d, next(op for op in op_db if op.name == "nn.functional.conv_transpose2d"),
           next(m for m in module_db if m.module_cls is torch.nn.ConvTranspose2d), ct.ConvTranspose2d),
    "1d": (F.conv_transpose1d, ct.conv_transpose1d, next(op for op in op_db if op.name == "nn.functional.conv_transpose1d"),
           next(m for m in module_db if m.module_cls is torch.nn.ConvTranspose1d), ct.ConvTranspose1d),
}

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
FORMS = ["contiguous", "noncontiguous", "channels_last"]
SAMPLES = [(name, i) for name, spec in OPS.items() for i in range(len(list(spec[2].sample_inputs("cpu", torch.float64))))]
SAMPLE_IDS = [f"{name}-sample{i}" for name, i in SAMPLES]


def samples(device, op, dtype=torch.float64):
    """The OpInfo samples of ``op`` as (input, weight, bias, kwargs), the same tensors on every call."""
    torch.manual_seed(0)
    out = []
    for s in OPS[op][2].sample_inputs(device, torch.float64):
        weight = s.args[0]
        bias = s.args[1] if len(s.args) > 1 else s.kwargs.get("bias")
        kwargs = {k: v for k, v in s.kwargs.items() if k != "bias"}
        out.append((s.input, weight, bias, kwargs))
    return [tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in sample) for sample in out]


def in_form(sample, form):
    x, w, b, kwargs = sample
    if form == "noncontiguous":
        x, w, b = (None if t is None else _noncontiguous(t) for t in (x, w, b))
    elif form == "channels_last" and w.dim() == 4:  # 1-D layers have no channels_last
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    return x, w, b, kwargs


def _noncontiguous(t):
    """The same values, every other element of a doubled last axis."""
    wide = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous() or t.numel() <= 1
    return view


def leaves(x, w, b):
    return [t.detach().clone(memory_format=torch.preserve_format).requires_grad_() if t is not None else None
            for t in (x, w, b)]


def forward_and_grads(fn, x, w, b, kwargs, grad_output=None):
    x, w, b = leaves(x, w, b)
    y = fn(x, w, b, **kwargs)
    go = torch.ones_like(y) if grad_output is None else grad_output
    wanted = [t for t in (x, w, b) if t is not None]
    return (y,) + torch.autograd.grad(y, wanted, go)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op,index", SAMPLES, ids=SAMPLE_IDS)
def test_opinfo_sample_float64(device, form, op, index):
    theirs_fn, ours_fn = OPS[op][:2]
    x, w, b, kwargs = in_form(samples(device, op)[index], form)
    checks.assert_trees_close(forward_and_grads(ours_fn, x, w, b, kwargs),
                              forward_and_grads(theirs_fn, x, w, b, kwargs), "forward and grads")
    assert checks.memory_format(ours_fn(x, w, b, **kwargs)) == checks.memory_format(theirs_fn(x, w, b, **kwargs)), \
        "output memory format"

    inputs = tuple(t for t in leaves(x, w, b) if t is not None)

    def fn(*ts):
        return ours_fn(ts[0], ts[1], ts[2] if len(ts) > 2 else None, **kwargs)

    def theirs(*ts):
        return theirs_fn(ts[0], ts[1], ts[2] if len(ts) > 2 else None, **kwargs)
    # fast_mode checks the Jacobians along random directions rather than column by column
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, check_batched_grad=True,
                                    check_batched_forward_grad=True, fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, inputs, check_fwd_over_rev=True, check_batched_grad=True, fast_mode=True)

    tangents = tuple(torch.randn_like(t) for t in inputs)
    checks.assert_trees_close(torch.func.jvp(fn, tuple(t.detach() for t in inputs), tangents),
                              torch.func.jvp(theirs, tuple(t.detach() for t in inputs), tangents), "jvp")
    stacked = (torch.stack([x, 2 * x]),) + tuple(t.detach() for t in inputs[1:])
    in_dims = (0,) + (None,) * (len(inputs) - 1)
    with checks.no_fallback_warnings():
        got = torch.func.vmap(fn, in_dims=in_dims)(*stacked)
    checks.assert_trees_close(got, torch.func.vmap(theirs, in_dims=in_dims)(*stacked), "vmap")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,index", SAMPLES, ids=SAMPLE_IDS)
def test_opinfo_sample_compiled(device, op, index):
    theirs_fn, ours_fn = OPS[op][:2]
    x, w, b, kwargs = samples(device, op)[index]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b: ours_fn(x, w, b, **kwargs), backend="aot_eager", fullgraph=True)
    checks.assert_trees_close(forward_and_grads(lambda x, w, b, **_: compiled(x, w, b), x, w, b, kwargs),
                              forward_and_grads(theirs_fn, x, w, b, kwargs), "compiled forward and grads")


def judge(ours, torch_low, truth, dtype, what):
    """|ours - truth| within twice torch's own error plus a few (four) roundings of the result's scale.

    The roundings allow for a different summation order: grad_bias sums a whole output.
    """
    truth = truth.double()
    scale = truth.abs().max().item() if truth.numel() else 0.0
    err = (ours.double() - truth).abs().max().item() if truth.numel() else 0.0
    torch_err = (torch_low.double() - truth).abs().max().item() if truth.numel() else 0.0
    bound = 2 * torch_err + 4 * torch.finfo(dtype).eps * scale
    assert err <= bound, f"{what}: error {err:.3e} > 2 x torch's {torch_err:.3e} + 4 roundings ({bound:.3e})"


LOW_PRECISION = [pytest.param("cpu", torch.float32, id="cpu-float32"),
                 pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
                 pytest.param("cuda", torch.float32, id="cuda-float32", marks=pytest.mark.gpu),
                 pytest.param("cuda", torch.float16, id="cuda-float16", marks=pytest.mark.gpu),
                 pytest.param("cuda", torch.bfloat16, id="cuda-bfloat16", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op,index", SAMPLES, ids=SAMPLE_IDS)
def test_opinfo_sample_low_precision(device, dtype, form, op, index):
    theirs_fn, ours_fn = OPS[op][:2]
    x64, w64, b64, kwargs = in_form(samples(device, op)[index], form)
    go64 = torch.randn(theirs_fn(x64, w64, b64, **kwargs).shape, dtype=torch.float64, device=device)
    truth = forward_and_grads(theirs_fn, x64, w64, b64, kwargs, go64)
    low = [None if t is None else t.to(dtype) for t in (x64, w64, b64)]
    ours = forward_and_grads(ours_fn, *low, kwargs, go64.to(dtype))
    theirs = forward_and_grads(theirs_fn, *low, kwargs, go64.to(dtype))
    for what, o, t, r in zip(("output", "grad_input", "grad_weight", "grad_bias"), ours, theirs, truth):
        assert o.dtype == dtype
        judge(o, t, r, dtype, what)


MODULE_INPUTS = [(op, spec) for op, (_, _, _, info, _) in OPS.items()
                 for spec in info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True,
                                                     training=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op,spec", MODULE_INPUTS, ids=[f"{op}-input{i}" for i, (op, _) in enumerate(MODULE_INPUTS)])
def test_moduleinfo_inputs(device, form, op, spec):
    theirs_cls, ours_cls = OPS[op][3].module_cls, OPS[op][4]
    args, kwargs = spec.constructor_input.args, spec.constructor_input.kwargs
    torch.manual_seed(0)
    theirs = theirs_cls(*args, **kwargs, device=device, dtype=torch.float64)
    torch.manual_seed(0)
    ours = ours_cls(*args, **kwargs, device=device, dtype=torch.float64)
    assert repr(ours) == repr(theirs)
    checks.assert_trees_close(list(ours.state_dict().values()), list(theirs.state_dict().values()), "init")
    x = spec.forward_input.args[0].detach().to(device)
    x, _, _, _ = in_form((x, ours.weight, None, {}), form)
    if form == "channels_last" and op == "2d":
        ours.to(memory_format=torch.channels_last)
        theirs.to(memory_format=torch.channels_last)
    results = []
    for module in (ours, theirs):
        xi = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        y = module(xi)
        y.backward(torch.ones_like(y))
        results.append([y, xi.grad, module.weight.grad, module.bias.grad])
    assert checks.memory_format(results[0][0]) == checks.memory_format(results[1][0]), "output memory format"
    checks.assert_trees_close(results[0], results[1], "module forward and grads")
