"""The expanded-taps gradients (layers with few output channels, grad_output expanded by taps into mma.sync GEMMs)
on a GPU, against float64.

Each case pins grad_input and grad_weight to the ``expanded_taps`` family and checks, through ``launch.watch()``,
that its kernels ran; both gradients must be finite (free blocks of their size are NaN-filled first), every element
within twice the dtype's epsilon of the sum of its terms' magnitudes, and no worse than twice torch's own error on
the same inputs.  Needs an sm_80 or newer GPU.
"""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv.torch as ct  # noqa: E402
from cupyconv import tuning  # noqa: E402
from cupyconv.core import device as core_device  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.plans import expanded_taps, launch, table  # noqa: E402
from cupyconv.tuning import Variant  # noqa: E402

from layers import Layer  # noqa: E402
from test_gemm_gpu import _data  # noqa: E402
from test_wgmma_gpu import _one_element_off  # noqa: E402

EXPANDED = Variant("expanded_taps")
FUNCTIONS = {"grad_input": "conv_transpose2d_grad_input_expanded_taps",
             "grad_weight": "conv_transpose2d_grad_weight_expanded_taps"}
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.fixture(scope="module")
def ampere_or_newer():
    dev = core_device.get(torch.cuda.current_device())
    if dev.capability < (8, 0):
        pytest.skip(f"these kernels need mma.sync (sm_80 or newer); this GPU ({dev.name}) is sm_{dev.arch}")
    return dev


# (batch, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups, bias, size)
LAYERS = {
    # an RGB generator's last layer (pix2pix, DCGAN) at small sizes; odd grids end mid-tile
    "rgb_k4s2p1": Layer(2, 128, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (13, 17), ""),
    "rgb64_k4s2p1": Layer(3, 64, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (9, 8), ""),
    # one output channel (a mask head), 32 input channels: narrow channel blocks
    "mask_k4s2p1": Layer(2, 32, 1, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (11, 7), ""),
    # asymmetric kernel, stride, padding and output padding, dilated rows: taps missing at every border
    "asym_dilated": Layer(2, 24, 5, (3, 5), (2, 3), (1, 2), (1, 0), (2, 1), 1, True, (7, 9), ""),
    # 7 channels x 16 taps = 112 expanded columns: 64-channel weight blocks; 256 input channels: several blocks
    "wide_k4s2": Layer(2, 256, 7, (4, 4), (2, 2), (0, 0), (1, 1), (1, 1), 1, False, (6, 5), ""),
    # 40 input channels: the last channel block part empty; stride 1, a 3 x 3 kernel, padding 1
    "k3s1p1": Layer(3, 40, 6, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), 1, True, (10, 12), ""),
    # a 1 x 1 kernel: 3 expanded columns of 16
    "pointwise": Layer(2, 48, 3, (1, 1), (1, 1), (0, 0), (0, 0), (1, 1), 1, True, (5, 9), ""),
    # batch 1, 136 input channels (a partial 128-channel block), stride 3 with gaps between taps
    "batch1_k2s3": Layer(1, 136, 2, (2, 2), (3, 3), (0, 0), (2, 2), (1, 1), 1, True, (8, 6), ""),
}
CASES = [pytest.param(name, dtype, weight_cl, id=f"{name}-{SHORT[dtype]}-{'wcl' if weight_cl else 'w'}")
         for i, name in enumerate(LAYERS) for dtype in (torch.float16, torch.bfloat16)
         for weight_cl in ((i + (dtype == torch.bfloat16)) % 2 == 0,)]


def _geometry(layer: Layer, weight_cl: bool):
    """The layer as a call runs it: a weight whose strides are channels_last and not also contiguous (one output
    channel and a channels_last weight are both) is read in place."""
    w = torch.empty(layer.weight_shape, device="meta")
    w = w.contiguous(memory_format=torch.channels_last) if weight_cl else w
    return geometry(layer.input_shape, layer.weight_shape, None,
                    ConvParams.from_args(**layer.kwargs())).with_weight_channels_last(ct._is_channels_last(w))


def _grads(fn, x, w, b, go, layer):
    """(grad_input, grad_weight) of ``fn`` on these tensors as they are (dtype and memory format)."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    fn(x, w, b, **layer.kwargs()).backward(go)
    return x.grad, w.grad


def _arranged(t, dtype, channels_last=True):
    t = t.to(dtype)
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t


def _run_ours(x, w, b, go, layer, pin=True):
    """Our (grad_input, grad_weight), with the (stage, plan) launches of the call."""
    for shape in (x.shape, w.shape):
        blocks = [torch.full(shape, float("nan"), dtype=x.dtype, device="cuda") for _ in range(3)]
        del blocks
    pins = tuning.pinned({"grad_input": EXPANDED, "grad_weight": EXPANDED}) if pin else contextlib.nullcontext()
    with pins, launch.watch() as seen:
        grads = _grads(ct.conv_transpose2d, x, w, b, go, layer)
        torch.cuda.synchronize()
    return grads, seen


def _check_near_float64(ours, theirs, ref, magnitude, dtype, what):
    assert ours.dtype == dtype and ours.shape == ref.shape, what
    finite = torch.isfinite(ours)
    assert bool(finite.all()), f"{what}: {int((~finite).sum())} of {ours.numel()} values not finite (unwritten?)"
    bad = (ours.double() - ref).abs() > 2 * torch.finfo(dtype).eps * magnitude
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {ours.numel()} values off"

    def rel(t):
        return float(torch.linalg.vector_norm(t.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))

    assert rel(ours) <= 2 * rel(theirs) + 1e-6, f"{what}: error {rel(ours):.3e} vs torch's {rel(theirs):.3e}"


def _check(layer: Layer, dtype, weight_cl: bool, seed=0, x_view=None, pin=True, expect=tuple(FUNCTIONS.values())):
    x64, w64, b64, go64 = _data(layer, seed)
    x, go = _arranged(x64, dtype), _arranged(go64, dtype)
    w = _arranged(w64, dtype, weight_cl)
    b = None if b64 is None else b64.to(dtype)
    (gi, gw), seen = _run_ours(x if x_view is None else x_view(x), w, b, go, layer, pin)
    functions = {plan.spec.function for _, plan in seen}
    for function in expect:
        assert function in functions, f"{function} did not run: {sorted(functions)}"
    ref = _grads(F.conv_transpose2d, x64, w64, None, go64, layer)
    magnitude = _grads(F.conv_transpose2d, x64.abs(), w64.abs(), None, go64.abs(), layer)
    theirs = _grads(F.conv_transpose2d, x, w, b, go, layer)
    if x.dim() == 4:
        assert gi.is_contiguous(memory_format=torch.channels_last)
    for what, o, t, r, m in zip(("grad_input", "grad_weight"), (gi, gw), theirs, ref, magnitude):
        _check_near_float64(o, t, r, m, dtype, what)
    return gi, gw, seen


@pytest.mark.parametrize("name,dtype,weight_cl", CASES)
def test_thin_layers_match_float64(name, dtype, weight_cl, ampere_or_newer):
    layer = LAYERS[name]
    g = _geometry(layer, weight_cl)
    assert expanded_taps.eligible(g, NAMES[dtype], "nhwc")
    _, _, seen = _check(layer, dtype, weight_cl, seed=list(LAYERS).index(name))
    planned = set()
    for pass_ in FUNCTIONS:
        planned |= set(table.plan(pass_, EXPANDED, g, NAMES[dtype], "nhwc", "strict", False, True,
                                  ampere_or_newer.sm_count).plans())
    assert planned <= {plan for _, plan in seen}, "the pinned family's planned launches did not all run"


def test_grad_weight_splits_and_is_bitwise_reproducible(ampere_or_newer):
    """Many pixel ranges (a wide reduce of their partials) give the same bits on every run."""
    layer = Layer(8, 128, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (32, 40), "")
    partial, reduce = expanded_taps.plan_grad_weight(_geometry(layer, False), "bfloat16", ampere_or_newer.sm_count)
    assert partial.grid[0] > 1 and reduce is not None and reduce.spec.function == "reduce_partials_wide"
    first = _check(layer, torch.bfloat16, False, seed=3)[1]
    x64, w64, _, go64 = _data(layer, 3)
    for _ in range(2):
        (_, again), _ = _run_ours(_arranged(x64, torch.bfloat16), w64.to(torch.bfloat16),
                                  None, _arranged(go64, torch.bfloat16), layer)
        assert torch.equal(again, first)


def test_unbatched_input(ampere_or_newer):
    """A (C, H, W) input runs as a batch of one; its layout follows the channels_last weight."""
    layer = Layer(None, 64, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (9, 11), "")
    x64, w64, b64, go64 = _data(layer, 4)
    w = w64.to(torch.float16).contiguous(memory_format=torch.channels_last)
    assert ct._layout_for(x64.to(torch.float16), w) == "nhwc"
    gi, _, _ = _check(layer, torch.float16, True, seed=4)
    assert gi.dim() == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_input_runs_the_direct_kernels(dtype, ampere_or_newer):
    """A channels_last x one element off a 16-byte boundary cannot feed the 16-byte copies: the pinned family plans
    the direct grad_weight kernel instead, which gives the right answer."""
    layer = LAYERS["rgb64_k4s2p1"]
    _, _, seen = _check(layer, dtype, False, seed=5, x_view=_one_element_off,
                        expect=("conv_transpose2d_grad_weight_nhwc_partial",))
    assert FUNCTIONS["grad_weight"] not in {plan.spec.function for _, plan in seen}


def test_the_heuristic_runs_the_family(ampere_or_newer, monkeypatch):
    """Untuned, an RGB output layer's gradients run the expanded-taps kernels."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    try:
        layer = LAYERS["rgb_k4s2p1"]
        g = _geometry(layer, False)
        for pass_ in FUNCTIONS:
            assert table.candidates(pass_, g, "bfloat16", "nhwc", "strict", ampere_or_newer)[0] == EXPANDED
        _check(layer, torch.bfloat16, False, seed=6, pin=False)
    finally:
        tuning.clear()
