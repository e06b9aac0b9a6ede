"""cupyconv.torch under torch's transforms on CUDA tensors: the checks of
tests/test_torch_transforms.py on the kernels, plus float16, bfloat16 and float32 tangents
judged against a float64 truth, and torch's memory formats for every dtype.
"""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv.torch as ct  # noqa: E402
import transform_checks as checks  # noqa: E402

F = torch.nn.functional
CUDA = torch.device("cuda")


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
@pytest.mark.parametrize("tangent_mask", [(True, True, True), (True, False, False), (False, True, False),
                                          (False, False, True)], ids=["all", "input", "weight", "bias"])
def test_forward_ad_matches_torch(layer, tangent_mask):
    checks.check_forward_ad(layer, CUDA, tangent_mask)


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
def test_higher_order_derivatives_match_torch(layer):
    checks.check_higher_order(layer, CUDA)


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
def test_backward_tangents_match_torch(layer):
    checks.check_backward_tangents(layer, CUDA)


@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
@pytest.mark.parametrize("in_dims", [(0, None, None), (None, 0, None), (0, 0, 0), (1, None, 0)],
                         ids=lambda d: "-".join(map(str, d)))
def test_vmap_matches_torch_without_fallback(layer, in_dims):
    checks.check_vmap(layer, CUDA, in_dims)


def test_vmap_is_one_launch_sequence_not_a_loop(monkeypatch):
    calls = []
    real = ct._cuda_forward
    monkeypatch.setattr(ct, "_cuda_forward", lambda x, *a: calls.append(x.shape) or real(x, *a))
    layer = checks.LAYERS[0]
    (x, w, b), _ = checks.tensors(layer, CUDA)
    with checks.no_fallback_warnings():
        torch.func.vmap(lambda w: ct.conv_transpose2d(x, w, b, **layer[1]))(torch.stack([w, -w, 2 * w]))
    assert calls == [(x.shape[0], 3 * x.shape[1]) + x.shape[2:]], calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_cl,w_cl", list(itertools.product((False, True), repeat=2)),
                         ids=["x_w", "x_wCL", "xCL_w", "xCL_wCL"])
@pytest.mark.parametrize("layer", [checks.LAYERS[0], checks.LAYERS[2]], ids=["batched", "unbatched"])
def test_memory_formats_match_torch(dtype, x_cl, w_cl, layer):
    checks.check_memory_formats(CUDA, dtype, x_cl, w_cl, layer)


def _judge(ours, theirs, truth, dtype, what):
    err = (ours.double() - truth).abs().max().item()
    torch_err = (theirs.double() - truth).abs().max().item()
    bound = 2 * torch_err + 2 * torch.finfo(dtype).eps * truth.abs().max().item()
    assert err <= bound, f"{what}: error {err:.3e} > 2 x torch's {torch_err:.3e} + 2 roundings = {bound:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", checks.LAYERS, ids=checks.LAYER_IDS)
def test_low_precision_tangents_within_twice_torch_error(dtype, layer):
    (x, w, b), (dx, dw, db) = checks.tensors(layer, CUDA)
    kwargs = layer[1]

    def run(fn, *ts):
        return torch.func.jvp(lambda x, w, b: fn(x, w, b, **kwargs), ts[:3], ts[3:])
    truth = run(F.conv_transpose2d, x, w, b, dx, dw, db)
    low = [t.to(dtype) for t in (x, w, b, dx, dw, db)]
    ours, theirs = run(ct.conv_transpose2d, *low), run(F.conv_transpose2d, *low)
    for what, o, t, r in zip(("output", "tangent"), ours, theirs, truth):
        assert o.dtype == dtype
        _judge(o, t, r, dtype, what)
