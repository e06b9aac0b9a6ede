"""cupyconv.torch under torch's transforms on CPU tensors (the float64 reference): forward-mode
AD, torch.func, vmap, compile, the operators called directly, and torch's memory formats.

tests/test_torch_transforms_gpu.py runs the same checks on the CUDA kernels.
"""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
import torch.autograd.forward_ad as fwAD  # noqa: E402

import cupyconv.torch as ct  # noqa: E402
import transform_checks as checks  # noqa: E402

F = torch.nn.functional
OPS = torch.ops.cupyconv
CPU = torch.device("cpu")


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
@pytest.mark.parametrize("tangent_mask", [(True, True, True), (True, False, False), (False, True, False),
                                          (False, False, True)], ids=["all", "input", "weight", "bias"])
def test_forward_ad_matches_torch(layer, tangent_mask):
    checks.check_forward_ad(layer, CPU, tangent_mask)


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
def test_higher_order_derivatives_match_torch(layer):
    checks.check_higher_order(layer, CPU)


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
def test_backward_tangents_match_torch(layer):
    checks.check_backward_tangents(layer, CPU)


VMAP_DIMS = [(0, None, None), (None, 0, None), (None, None, 0), (0, 0, 0), (1, None, None), (0, 2, None)]


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
@pytest.mark.parametrize("in_dims", VMAP_DIMS, ids=lambda d: "-".join(map(str, d)))
def test_vmap_matches_torch_without_fallback(layer, in_dims):
    checks.check_vmap(layer, CPU, in_dims)


@pytest.mark.parametrize("in_dims", [(0, None, None), (0, 0, None)], ids=["activations", "weights"])
def test_vmap_is_one_call_not_a_loop(monkeypatch, in_dims):
    calls = []
    real = ct._forward_impl
    monkeypatch.setattr(ct, "_forward_impl", lambda *a: calls.append(a[0].shape) or real(*a))
    layer = checks.LAYERS[0]
    (x, w, b), _ = checks.tensors(layer, CPU)
    stacked = [torch.stack([t, 2 * t]) if d == 0 else t for t, d in zip((x, w, b), in_dims)]
    with checks.no_fallback_warnings():
        torch.func.vmap(lambda x, w, b: ct.conv_transpose2d(x, w, b, **layer[1]), in_dims=in_dims)(*stacked)
    assert len(calls) == 1, f"vmap over 2 samples ran the layer {len(calls)} times"
    folded = (2 * x.shape[0],) + x.shape[1:] if in_dims[1] is None else (x.shape[0], 2 * x.shape[1]) + x.shape[2:]
    assert calls[0] == folded


def test_forward_ad_without_dual_inputs_gives_no_tangent():
    (x, w, b), _ = checks.tensors(checks.LAYERS[1], CPU)
    with fwAD.dual_level():
        y = ct.conv_transpose2d(x, w, b, stride=2)
        assert fwAD.unpack_dual(y).tangent is None
    torch.testing.assert_close(y, F.conv_transpose2d(x, w, b, stride=2))


def test_module_under_forward_ad_and_jvp():
    torch.manual_seed(0)
    ref = torch.nn.ConvTranspose2d(4, 6, (3, 2), (2, 1), 1, dtype=torch.float64)
    ours = ct.convert(torch.nn.ConvTranspose2d(4, 6, (3, 2), (2, 1), 1, dtype=torch.float64))
    ours.load_state_dict(ref.state_dict())
    x, dx = torch.randn(2, 4, 5, 5, dtype=torch.float64), torch.randn(2, 4, 5, 5, dtype=torch.float64)
    params = dict(ref.named_parameters())
    tangents = {k: torch.randn_like(v) for k, v in params.items()}

    def run(module):
        return torch.func.jvp(lambda p, x: torch.func.functional_call(module, p, (x,)), (params, x), (tangents, dx))
    checks.assert_trees_close(run(ours), run(ref), "module jvp over parameters and input")


# --------------------------------------------------------------------- the operators directly

def _op_args(layer):
    kwargs = layer[1]
    pair = ct._pair
    return ([*pair(kwargs.get("stride", 1))], [*pair(kwargs.get("padding", 0))],
            [*pair(kwargs.get("output_padding", 0))], kwargs.get("groups", 1), [*pair(kwargs.get("dilation", 1))])


def test_operator_forward_ad_gives_torch_tangent():
    layer = checks.LAYERS[0]
    (x, w, b), tangents = checks.tensors(layer, CPU)
    args = _op_args(layer)
    got = checks.dual_tangent(lambda x, w, b: OPS.conv_transpose2d(x, w, b, *args), (x, w, b), tangents)
    want = checks.dual_tangent(lambda x, w, b: F.conv_transpose2d(x, w, b, **layer[1]), (x, w, b), tangents)
    checks.assert_trees_close(got, want, "operator forward_ad")
    go = F.conv_transpose2d(x, w, **layer[1])
    got = checks.dual_tangent(lambda go, x, w: OPS.conv_transpose2d_backward(go, x, w, *args, [True, True, True]),
                              (go, x, w), (go.cos(), tangents[0], tangents[1]))
    want = checks.dual_tangent(lambda go, x, w: ct.conv_transpose2d_backward(go, x, w, *args),
                               (go, x, w), (go.cos(), tangents[0], tangents[1]))
    checks.assert_trees_close(got, want, "backward operator forward_ad")


@pytest.mark.parametrize("transform", ["jvp", "grad"])
def test_operator_inside_func_transforms_raises(transform):
    layer = checks.LAYERS[1]
    (x, w, b), (dx, dw, db) = checks.tensors(layer, CPU)
    args = _op_args(layer)

    def f(x):
        return OPS.conv_transpose2d(x, w, b, *args).sum()
    with pytest.raises(NotImplementedError, match="cupyconv.torch.conv_transpose2d"):
        if transform == "jvp":
            torch.func.jvp(f, (x,), (dx,))
        else:
            torch.func.grad(f)(x)


def test_operator_vmap_rules():
    layer = checks.LAYERS[0]
    (x, w, b), _ = checks.tensors(layer, CPU)
    args = _op_args(layer)
    xs, ws = torch.stack([x, -x]), torch.stack([w, 2 * w])
    with checks.no_fallback_warnings():
        got = torch.func.vmap(lambda x, w: OPS.conv_transpose2d(x, w, b, *args))(xs, ws)
        go = torch.ones_like(got)
        grads = torch.func.vmap(lambda go, x, w: OPS.conv_transpose2d_backward(go, x, w, *args, [True, True, True]))(
            go, xs, ws)
    want = torch.stack([F.conv_transpose2d(xi, wi, b, **layer[1]) for xi, wi in zip(xs, ws)])
    checks.assert_trees_close(got, want, "operator vmap")
    want_grads = [torch.stack(g) for g in zip(*(ct.conv_transpose2d_backward(gi, xi, wi, *args)
                                                for gi, xi, wi in zip(go, xs, ws)))]
    checks.assert_trees_close(list(grads), want_grads, "backward operator vmap")


# ------------------------------------------------------------------------------- compile

def test_compile_forward_ad_and_jvp_match_torch():
    layer = checks.LAYERS[0]
    (x, w, b), (dx, dw, db) = checks.tensors(layer, CPU)
    ours, theirs = checks.functions(layer)
    compiled = torch.compile(ours, backend="aot_eager")
    checks.assert_trees_close(checks.dual_tangent(compiled, (x, w, b), (dx, dw, db)),
                              checks.dual_tangent(theirs, (x, w, b), (dx, dw, db)), "compiled forward_ad")
    jvp = torch.compile(lambda *a: torch.func.jvp(ours, a[:3], a[3:]), backend="aot_eager")
    checks.assert_trees_close(jvp(x, w, b, dx, dw, db), torch.func.jvp(theirs, (x, w, b), (dx, dw, db)),
                              "compiled torch.func.jvp")


def test_compile_fullgraph_jvp_is_an_error_not_a_zero():
    layer = checks.LAYERS[1]
    (x, w, b), (dx, dw, db) = checks.tensors(layer, CPU)
    ours, _ = checks.functions(layer)
    jvp = torch.compile(lambda *a: torch.func.jvp(ours, a[:3], a[3:]), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="disable"):
        jvp(x, w, b, dx, dw, db)


# ------------------------------------------------------------------------- memory formats

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_cl,w_cl", list(itertools.product((False, True), repeat=2)),
                         ids=["x_w", "x_wCL", "xCL_w", "xCL_wCL"])
@pytest.mark.parametrize("layer", [checks.LAYERS[0], checks.LAYERS[2]], ids=["batched", "unbatched"])
def test_memory_formats_match_torch(dtype, x_cl, w_cl, layer):
    checks.check_memory_formats(CPU, dtype, x_cl, w_cl, layer)
