"""The expanded-taps gradients (layers with few output channels, grad_output expanded by taps into mma.sync GEMMs)
on a GPU, against float64.

Each case pins grad_input and grad_weight to the ``expanded_taps`` family and checks, through ``launch.watch()``,
that its kernels ran; both gradients must be finite (free blocks of their size are NaN-filled first), every element
within twice the dtype's epsilon of the sum of its terms' magnitudes, and no worse than twice torch's own error on
the same inputs.  Channels_last in fp16 and bf16; NCHW in fp16, bf16 and float32: TF32 where allowed (each element
within twice TF32's epsilon of that sum; torch's error taken as at least that of an exact product of TF32-rounded
operands, since cuDNN answers these layers without TF32), 3xTF32 where not (within 1e-5 of float64, as strict
float32 is held elsewhere).  Needs an sm_80 or newer GPU.
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

from layers import Layer, grad_weight_geometry  # noqa: E402
from test_gemm_gpu import _data  # noqa: E402
from test_wgmma_gpu import _one_element_off  # noqa: E402
from tf32 import round_tf32  # noqa: E402

EXPANDED = Variant("expanded_taps")
FUNCTIONS = {"grad_input": "conv_transpose2d_grad_input_expanded_taps",
             "grad_weight": "conv_transpose2d_grad_weight_expanded_taps"}
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
TF32_EPS = 2.0 ** -10   # a float32 operand rounded to TF32's 10 stored bits


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

# NCHW (a contiguous weight: a channels_last one makes the call channels_last): images of whole 16-byte runs of
# pixels, so that pixel tiles (32 or 64 pixels) run across image borders and end mid-tile
NCHW_LAYERS = {
    # an RGB output layer, 120 pixels an image, three images
    "rgb_k4s2p1": Layer(3, 128, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (12, 10), ""),
    # asymmetric kernel, stride, padding and output padding, dilated rows (80 columns: not strict float32)
    "asym_dilated": Layer(2, 24, 5, (3, 5), (2, 3), (1, 2), (1, 0), (2, 1), 1, True, (8, 9), ""),
    # 4 output channels x 16 taps = 64 columns, float32's most; 256 input channels
    "four_k4s2": Layer(2, 256, 4, (4, 4), (2, 2), (0, 0), (1, 1), (1, 1), 1, False, (6, 4), ""),
    # one output channel over 32 input channels
    "mask_k4s2p1": Layer(2, 32, 1, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (4, 6), ""),
    # batch 1, 136 input channels (a partial channel block), stride 3
    "batch1_k2s3": Layer(1, 136, 2, (2, 2), (3, 3), (0, 0), (2, 2), (1, 1), 1, True, (8, 6), ""),
}
NCHW_CASES = [pytest.param(name, dtype, allow_tf32,
                           id=f"nchw-{name}-{SHORT[dtype]}" + ("-tf32" if allow_tf32 and dtype == torch.float32
                                                                else ""))
              for name in NCHW_LAYERS
              for dtype in (torch.float32, torch.float16, torch.bfloat16)
              for allow_tf32 in ((True,) if dtype != torch.float32 or name == "asym_dilated" else (True, False))]


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


def _check_near_float64(ours, theirs, ref, magnitude, dtype, what, tf32_floor=None):
    """``tf32_floor``: for float32, the gradient computed exactly from TF32-rounded operands where TF32 is allowed
    (None where it is not: strict float32)."""
    assert ours.dtype == dtype and ours.shape == ref.shape, what
    finite = torch.isfinite(ours)
    assert bool(finite.all()), f"{what}: {int((~finite).sum())} of {ours.numel()} values not finite (unwritten?)"

    def rel(t):
        return float(torch.linalg.vector_norm(t.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))

    if dtype == torch.float32 and tf32_floor is None:
        assert rel(ours) <= 1e-5, f"{what}: strict float32 error {rel(ours):.3e}"
        return
    eps = TF32_EPS if dtype == torch.float32 else torch.finfo(dtype).eps
    bad = (ours.double() - ref).abs() > 2 * eps * magnitude
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {ours.numel()} values off"
    torch_error = max(rel(theirs), 0.0 if tf32_floor is None else rel(tf32_floor))
    assert rel(ours) <= 2 * torch_error + 1e-6, f"{what}: error {rel(ours):.3e} vs torch's {torch_error:.3e}"


def _check(layer: Layer, dtype, weight_cl: bool, seed=0, x_view=None, pin=True, expect=tuple(FUNCTIONS.values()),
           channels_last=True):
    x64, w64, b64, go64 = _data(layer, seed)
    x, go = _arranged(x64, dtype, channels_last), _arranged(go64, dtype, channels_last)
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
        assert gi.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    floors = (None, None)
    if dtype == torch.float32 and torch.backends.cudnn.allow_tf32:
        floors = _grads(F.conv_transpose2d, round_tf32(x64), round_tf32(w64), None, round_tf32(go64), layer)
    for what, o, t, r, m, f in zip(("grad_input", "grad_weight"), (gi, gw), theirs, ref, magnitude, floors):
        _check_near_float64(o, t, r, m, dtype, what, f)
    return gi, gw, seen


@pytest.mark.parametrize("name,dtype,weight_cl", CASES)
def test_thin_layers_match_float64(name, dtype, weight_cl, ampere_or_newer):
    layer = LAYERS[name]
    g = _geometry(layer, weight_cl)
    assert expanded_taps.eligible(g, NAMES[dtype], "nhwc")
    _, _, seen = _check(layer, dtype, weight_cl, seed=list(LAYERS).index(name))
    planned = set()
    for pass_ in FUNCTIONS:
        pass_g = grad_weight_geometry(layer, g) if pass_ == "grad_weight" else g
        planned |= set(table.plan(pass_, EXPANDED, pass_g, NAMES[dtype], "nhwc", "strict", False, True,
                                  ampere_or_newer.sm_count).plans())
    assert planned <= {plan for _, plan in seen}, "the pinned family's planned launches did not all run"


@pytest.mark.parametrize("name,dtype,allow_tf32", NCHW_CASES)
def test_nchw_thin_layers_match_float64(name, dtype, allow_tf32, ampere_or_newer):
    """NCHW activations read and written in place: each channel's pixels a run of x's and grad_input's tiles;
    float32 as TF32 or, with TF32 off, 3xTF32."""
    layer = NCHW_LAYERS[name]
    g = _geometry(layer, False)
    precision = "strict" if dtype != torch.float32 or not allow_tf32 else "tf32"
    assert expanded_taps.eligible(g, NAMES[dtype], "nchw", precision)
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    try:
        _, _, seen = _check(layer, dtype, False, seed=list(NCHW_LAYERS).index(name), channels_last=False)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    planned = set()
    for pass_ in FUNCTIONS:
        planned |= set(table.plan(pass_, EXPANDED, g, NAMES[dtype], "nchw", precision, False, True,
                                  ampere_or_newer.sm_count).plans())
    assert planned <= {plan for _, plan in seen}, "the pinned family's planned launches did not all run"


def test_nchw_float32_untuned_runs_the_family(ampere_or_newer, monkeypatch):
    """A float32 model's RGB layer, untuned: its gradients run the family, as TF32 or 3xTF32."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    saved = torch.backends.cudnn.allow_tf32
    try:
        for allow_tf32 in (True, False):
            torch.backends.cudnn.allow_tf32 = allow_tf32
            _check(NCHW_LAYERS["rgb_k4s2p1"], torch.float32, False, seed=7, pin=False, channels_last=False)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
        tuning.clear()


def test_nchw_images_of_partial_runs_are_left_to_the_direct_kernels(ampere_or_newer):
    """An image of 15 x 9 pixels is not whole 16-byte runs: the family does not take it."""
    g = _geometry(Layer(2, 64, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (15, 9), ""), False)
    for dtype in ("float32", "bfloat16"):
        assert not expanded_taps.eligible(g, dtype, "nchw", "tf32")
        assert EXPANDED not in table.candidates("grad_input", g, dtype, "nchw", "tf32", ampere_or_newer)


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
