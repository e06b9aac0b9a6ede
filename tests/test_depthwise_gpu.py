"""The depthwise family (channels_last, one input and one output channel a group) on a GPU, against float64.

Each case pins the pass to the ``depthwise`` family and checks, through ``launch.watch()``, that its kernel ran;
the destination must be finite (free blocks of its size are NaN-filled first).  fp16 and bf16: every element within
twice the dtype's epsilon of the sum of its terms' magnitudes, and no worse than twice torch's own error; float32
(computed in fp32 whatever torch's TF32 switch says) within 1e-5 of float64.  (CUDA float64 runs NCHW, as torch's own
float64 convolution answers, so the family does not take it.)
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv.torch as ct  # noqa: E402
from cupyconv import tuning  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.plans import depthwise, launch, table  # noqa: E402
from cupyconv.tuning import Variant  # noqa: E402

from layers import Layer  # noqa: E402
from test_expanded_taps_gpu import _check_near_float64  # noqa: E402
from test_gemm_gpu import _data  # noqa: E402

FUNCTION = "conv_transpose2d_depthwise_nhwc"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _depthwise(batch, channels, kernel, stride, padding, output_padding, dilation, bias, size):
    return Layer(batch, channels, channels, kernel, stride, padding, output_padding, dilation, channels, bias, size,
                 "")


LAYERS = {
    # depthwise_up in small: 64 channels (eight 16-bit runs), odd sizes, bias
    "up": _depthwise(2, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), True, (9, 11)),
    # asymmetric kernel, stride, padding, output padding and dilation; 24 channels (three 16-bit runs, six fp32)
    "asym": _depthwise(2, 24, (5, 3), (3, 2), (2, 1), (1, 0), (1, 2), True, (7, 5)),
    # stride 1, three images, no bias
    "k3s1": _depthwise(3, 32, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), False, (10, 10)),
    # stride 4 past a 2 x 2 kernel: phases no tap feeds hold the bias alone; batch 1
    "gaps": _depthwise(1, 16, (2, 2), (4, 4), (0, 0), (3, 1), (1, 1), True, (6, 5)),
    # five channels: a channel a thread
    "odd_channels": _depthwise(2, 5, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), True, (8, 8)),
    # 512 channels: more than one block of channel runs
    "wide": _depthwise(2, 512, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), True, (4, 4)),
    # a 7 x 7 kernel: grad_input walks its rows one at a time
    "k7": _depthwise(1, 64, (7, 7), (1, 1), (3, 3), (0, 0), (1, 1), True, (9, 9)),
    # one image, a row of one pixel
    "batch1_row": _depthwise(1, 32, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), True, (1, 9)),
}


def _geometry(layer: Layer):
    return geometry(layer.input_shape, layer.weight_shape, None, ConvParams.from_args(**layer.kwargs()))


def _channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def _unaligned(t):
    """``t``'s values in the same layout, one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.as_strided(t.shape, t.stride()).copy_(t)


def _grad_input(x, w, go, layer: Layer):
    x = x.detach().requires_grad_()
    F.conv_transpose2d(x, w, None, **layer.kwargs()).backward(go)
    return x.grad


def _check(layer: Layer, dtype_name: str, pass_: str, seed: int, variant: Variant = Variant("depthwise"),
           unaligned: bool = False) -> None:
    dtype = DTYPES[dtype_name]
    g = _geometry(layer)
    assert depthwise.eligible(g, dtype_name, "nhwc")
    x64, w64, b64, go64 = _data(layer, seed)
    x, go = _channels_last(x64.to(dtype)), _channels_last(go64.to(dtype))
    w = w64.to(dtype)
    b = None if b64 is None else b64.to(dtype)
    if unaligned:
        x, go = _unaligned(x), _unaligned(go)
    shape = (x64 if pass_ == "grad_input" else go64).shape
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for _ in range(3)]
    del blocks
    with tuning.pinned({pass_: variant}), launch.watch() as seen:
        if pass_ == "forward":
            ours = ct.conv_transpose2d(x, w, b, **layer.kwargs())
            theirs = F.conv_transpose2d(x, w, b, **layer.kwargs())
            ref = F.conv_transpose2d(x64, w64, b64, **layer.kwargs())
            magnitude = F.conv_transpose2d(x64.abs(), w64.abs(), None if b64 is None else b64.abs(),
                                           **layer.kwargs())
        else:
            ours = ct.conv_transpose2d_backward(go, x, w, **layer.kwargs(), output_mask=(True, False, False))[0]
            theirs = _grad_input(x, w, go, layer)
            ref = _grad_input(x64, w64, go64, layer)
            magnitude = _grad_input(x64.abs(), w64.abs(), go64.abs(), layer)
        torch.cuda.synchronize()
    ran = [plan for stage, plan in seen if plan.spec.function == FUNCTION]
    assert ran, f"the depthwise kernel did not run: {[p.spec.function for _, p in seen]}"
    constants = dict(ran[0].spec.constants)
    assert constants["MODE"] == (0 if pass_ == "forward" else 1)
    if unaligned or layer.in_channels % (8 // x.element_size()):
        assert constants["VEC"] == 1, "a channel a thread: no whole runs"
    planned = set(table.plan(pass_, variant, g, dtype_name, "nhwc", "strict", b is not None and pass_ == "forward",
                             not unaligned).plans())
    assert planned <= set(ran)
    assert ours.stride() == theirs.stride(), "torch's memory format"
    _check_near_float64(ours, theirs, ref, magnitude, dtype, pass_)


@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(LAYERS))
def test_depthwise_matches_float64(name, dtype, pass_):
    _check(LAYERS[name], dtype, pass_, list(LAYERS).index(name))


@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_every_candidate_patch(dtype, pass_):
    layer = LAYERS["up"]
    variants = [v for v in table.candidates(pass_, _geometry(layer), dtype, "nhwc") if v.family == "depthwise"]
    assert len(variants) >= 1
    for i, variant in enumerate(variants):
        _check(layer, dtype, pass_, 20 + i, variant)


@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_unaligned_tensors_take_a_channel_a_thread(dtype, pass_):
    _check(LAYERS["up"], dtype, pass_, 31, unaligned=True)


def test_a_tuned_training_step_matches_torch():
    """Unpinned, under autograd: the tuner races the family against the direct kernels, and the step's gradients
    (grad_weight and grad_bias on the direct kernels) match torch's within twice its error."""
    layer = LAYERS["up"]
    x64, w64, b64, go64 = _data(layer, 40)
    results = []
    for fn in (ct.conv_transpose2d, F.conv_transpose2d):
        x = _channels_last(x64.half()).requires_grad_()
        w = w64.half().requires_grad_()
        b = b64.half().requires_grad_()
        for _ in range(3):   # the first calls time the candidates
            x.grad = w.grad = b.grad = None
            y = fn(x, w, b, **layer.kwargs())
            y.backward(_channels_last(go64.half()))
        results.append((y, x.grad, w.grad, b.grad))
    ref_x = x64.clone().requires_grad_()
    ref_w, ref_b = w64.clone().requires_grad_(), b64.clone().requires_grad_()
    ref_y = F.conv_transpose2d(ref_x, ref_w, ref_b, **layer.kwargs())
    ref_y.backward(go64)
    for what, ours, theirs, ref in zip(("output", "grad_input", "grad_weight", "grad_bias"), results[0], results[1],
                                       (ref_y, ref_x.grad, ref_w.grad, ref_b.grad)):
        err = float((ours.double() - ref).norm() / ref.norm())
        torch_err = float((theirs.double() - ref).norm() / ref.norm())
        assert err <= 2 * torch_err + 1e-6, f"{what}: {err:.3e} against torch's {torch_err:.3e}"
