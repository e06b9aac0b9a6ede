"""Checks of cupyconv.torch under torch's transforms, shared by the CPU and the GPU test files.

Each check runs cupyconv and ``torch.nn.functional.conv_transpose2d`` through the same
transform and compares them; the float64 results must agree to rounding.
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.autograd.forward_ad as fwAD

import cupyconv.torch as ct

F = torch.nn.functional

# (weight shape, keyword arguments, input shape): asymmetric, strided, padded, grouped, dilated,
# output-padded, unbatched
LAYERS = [
    ((4, 3, 3, 2), dict(stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2, dilation=(1, 2)), (2, 4, 5, 6)),
    ((3, 2, 2, 3), dict(stride=2), (1, 3, 4, 3)),
    ((2, 2, 3, 3), dict(stride=(1, 3), padding=(2, 1), output_padding=(0, 2), dilation=2), (2, 3, 4)),
    ((4, 1, 3, 3), dict(groups=4, stride=2, padding=1, output_padding=1), (2, 4, 3, 5)),
]
LAYER_IDS = ["grouped_dilated", "plain_stride2", "unbatched", "depthwise"]


def bias_channels(weight_shape, kwargs):
    return weight_shape[1] * kwargs.get("groups", 1)


def tensors(layer, device, dtype=torch.float64, seed=0, bias=True):
    """x, w, b and tangents dx, dw, db for ``layer``."""
    w_shape, kwargs, x_shape = layer
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    x, w = rand(*x_shape), rand(*w_shape)
    b = rand(bias_channels(w_shape, kwargs)) if bias else None
    return (x, w, b), (rand(*x_shape), rand(*w_shape), None if b is None else rand(*b.shape))


def functions(layer):
    """(ours, torch's): scalar functions of (x, w, b) with a nonlinearity after the layer."""
    kwargs = layer[1]

    def ours(x, w, b):
        return ct.conv_transpose2d(x, w, b, **kwargs).sin().sum()

    def theirs(x, w, b):
        return F.conv_transpose2d(x, w, b, **kwargs).sin().sum()
    return ours, theirs


def assert_trees_close(actual, expected, what, rtol=1e-9, atol=1e-9):
    a = torch.utils._pytree.tree_leaves(actual)
    e = torch.utils._pytree.tree_leaves(expected)
    assert len(a) == len(e), f"{what}: {len(a)} results, torch gives {len(e)}"
    for i, (p, q) in enumerate(zip(a, e)):
        assert p is not None, f"{what}: result {i} is None"
        assert p.shape == q.shape, f"{what}: result {i} has shape {tuple(p.shape)}, torch {tuple(q.shape)}"
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{what}: result {i}: {m}")


def dual_tangent(fn, primals, tangents):
    """The output tangent of ``fn`` under torch.autograd.forward_ad."""
    with fwAD.dual_level():
        duals = [p if t is None else fwAD.make_dual(p, t) for p, t in zip(primals, tangents)]
        out = fn(*duals)
        return [fwAD.unpack_dual(o).tangent for o in (out if isinstance(out, tuple) else (out,))]


@contextlib.contextmanager
def no_fallback_warnings():
    """Fails on torch's "no batching rule, falling back to a loop" warning (our vmap rule must run)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batching rule.*")
        warnings.filterwarnings("error", message=".*fall(ing)? ?back.*")
        yield


def check_forward_ad(layer, device, tangent_mask):
    """Eager forward_ad and torch.func.jvp, with tangents on the inputs ``tangent_mask`` picks."""
    (x, w, b), (dx, dw, db) = tensors(layer, device)
    tangents = [t if keep else None for t, keep in zip((dx, dw, db), tangent_mask)]
    kwargs = layer[1]

    def ours(x, w, b):
        return ct.conv_transpose2d(x, w, b, **kwargs)

    def theirs(x, w, b):
        return F.conv_transpose2d(x, w, b, **kwargs)
    got = dual_tangent(ours, (x, w, b), tangents)
    want = dual_tangent(theirs, (x, w, b), tangents)
    assert_trees_close(got, want, f"forward_ad tangent {tangent_mask}")
    zeros = [torch.zeros_like(p) if t is None else t for p, t in zip((x, w, b), tangents)]
    assert_trees_close(torch.func.jvp(ours, (x, w, b), tuple(zeros)),
                       torch.func.jvp(theirs, (x, w, b), tuple(zeros)), f"torch.func.jvp {tangent_mask}")


def check_higher_order(layer, device):
    """jacfwd, jacrev of jacfwd (hessian), forward-over-reverse in torch.func and in eager autograd."""
    (x, w, b), (dx, dw, db) = tensors(layer, device)
    ours, theirs = functions(layer)
    small_w = w[..., :2, :1].contiguous()
    for name, fn in (
            ("jacfwd", lambda f: torch.func.jacfwd(f, argnums=(0, 1, 2))(x, w, b)),
            ("jacrev", lambda f: torch.func.jacrev(f, argnums=(0, 1, 2))(x, w, b)),
            ("hessian", lambda f: torch.func.hessian(f, argnums=1)(x, small_w, b)),
            ("jvp of grad", lambda f: torch.func.jvp(torch.func.grad(f, argnums=(0, 1, 2)), (x, w, b),
                                                     (dx, dw, db)))):
        assert_trees_close(fn(ours), fn(theirs), name)

    def eager_forward_over_reverse(f):
        with fwAD.dual_level():
            xd = fwAD.make_dual(x.clone().requires_grad_(), dx)
            wd = fwAD.make_dual(w.clone().requires_grad_(), dw)
            grads = torch.autograd.grad(f(xd, wd, b), (xd, wd), create_graph=True)
            return [fwAD.unpack_dual(g).tangent for g in grads]
    assert_trees_close(eager_forward_over_reverse(ours), eager_forward_over_reverse(theirs),
                       "eager forward-over-reverse")


def check_backward_tangents(layer, device):
    """Forward-mode AD through conv_transpose2d_backward: its tangent is torch's vjp's tangent."""
    (x, w, b), (dx, dw, _) = tensors(layer, device)
    kwargs = layer[1]
    go = F.conv_transpose2d(x, w, **kwargs).sin()
    dgo = go.cos()
    params = [kwargs.get(k, d) for k, d in (("stride", 1), ("padding", 0), ("output_padding", 0),
                                            ("groups", 1), ("dilation", 1))]

    def ours(go, x, w):
        return ct.conv_transpose2d_backward(go, x, w, *params)

    def theirs(go, x, w):
        _, vjp = torch.func.vjp(lambda x, w, b: F.conv_transpose2d(x, w, b, **kwargs), x, w,
                                torch.zeros(go.shape[-3], dtype=go.dtype, device=go.device))
        return vjp(go)
    assert_trees_close(torch.func.jvp(ours, (go, x, w), (dgo, dx, dw)),
                       torch.func.jvp(theirs, (go, x, w), (dgo, dx, dw)), "jvp of the backward")


def check_vmap(layer, device, in_dims, batch=3):
    """vmap over any of x, w, b (in_dims as in torch.func.vmap), forward and per-sample gradients."""
    (x, w, b), _ = tensors(layer, device)
    gen = torch.Generator(device="cpu").manual_seed(7)
    batched = []
    for t, d in zip((x, w, b), in_dims):
        if d is None:
            batched.append(t)
            continue
        stack = torch.randn((batch,) + tuple(t.shape), generator=gen, dtype=t.dtype).to(t.device)
        batched.append(stack.movedim(0, d))
    ours, theirs = functions(layer)
    with no_fallback_warnings():
        got = torch.func.vmap(ours, in_dims=in_dims)(*batched)
        got_grads = torch.func.vmap(torch.func.grad(ours, argnums=(0, 1, 2)), in_dims=in_dims)(*batched)
    assert_trees_close(got, torch.func.vmap(theirs, in_dims=in_dims)(*batched), f"vmap {in_dims}")
    assert_trees_close(got_grads, torch.func.vmap(torch.func.grad(theirs, argnums=(0, 1, 2)), in_dims=in_dims)(*batched),
                       f"vmap of grad {in_dims}")


def memory_format(t):
    if t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous():
        return "channels_last"
    return "contiguous" if t.is_contiguous() else f"strides {t.stride()}"


def channels_last(t):
    """``t`` in channels_last memory; an unbatched (C, H, W) tensor in that of its batch of one."""
    if t.dim() == 3:
        return t.unsqueeze(0).contiguous(memory_format=torch.channels_last)[0]
    return t.contiguous(memory_format=torch.channels_last)


def check_memory_formats(device, dtype, x_channels_last, w_channels_last, layer=LAYERS[0]):
    """Output, grad_input and grad_weight take torch's memory format (and its values)."""
    (x, w, b), _ = tensors(layer, device, dtype)
    if x_channels_last:
        x = channels_last(x)
    if w_channels_last:
        w = w.contiguous(memory_format=torch.channels_last)
    results = {}
    for name, fn in (("ours", ct.conv_transpose2d), ("torch", F.conv_transpose2d)):
        xr, wr, br = (t.detach().clone(memory_format=torch.preserve_format).requires_grad_() for t in (x, w, b))
        y = fn(xr, wr, br, **layer[1])
        grads = torch.autograd.grad(y, (xr, wr, br), torch.ones_like(y))
        results[name] = (y,) + grads
    for what, ours, theirs in zip(("output", "grad_input", "grad_weight", "grad_bias"), results["ours"],
                                  results["torch"]):
        assert memory_format(ours) == memory_format(theirs), \
            f"{what}: {memory_format(ours)}, torch gives {memory_format(theirs)}"
        reference = theirs if dtype == torch.float64 else None
        if reference is not None:
            torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-9, msg=lambda m: f"{what}: {m}")
