"""The thin-output forward (NCHW float32 on mma.sync as TF32, or 3xTF32 for strict float32, few output channels)
on a GPU, against float64.

Each case pins the forward to the ``thin_mma`` family and checks, through ``launch.watch()``, that its kernel ran;
the output must be finite (free blocks of its size are NaN-filled first).  TF32: every element within twice TF32's
epsilon of the sum of its terms' magnitudes, and no worse than twice torch's own error, taken as at least that of
an exact product of TF32-rounded operands (cuDNN answers these layers without TF32).  Strict float32: every element
within 1e-5 of the sum of its terms' magnitudes, and the whole within 1e-5 of float64.  Needs an sm_80 or newer
GPU.
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
from cupyconv.core import device as core_device  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.plans import launch, table, thin_mma  # noqa: E402
from cupyconv.tuning import Variant  # noqa: E402

from layers import Layer  # noqa: E402
from test_gemm_gpu import _data  # noqa: E402
from test_expanded_taps_gpu import _check_near_float64  # noqa: E402
from tf32 import round_tf32, tf32_allowed  # noqa: E402

THIN = Variant("thin_mma")
FUNCTION = "conv_transpose2d_forward_thin_mma"


@pytest.fixture(scope="module")
def ampere_or_newer():
    dev = core_device.get(torch.cuda.current_device())
    if dev.capability < (8, 0):
        pytest.skip(f"this kernel needs mma.sync (sm_80 or newer); this GPU ({dev.name}) is sm_{dev.arch}")
    return dev


# (batch, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups, bias, size)
LAYERS = {
    # an RGB output layer; three images
    "rgb_k4s2p1": Layer(3, 128, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (12, 10), ""),
    # rows of whole 16-byte runs: the window and the weights land in 16-byte copies
    "rgb_runs": Layer(2, 64, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (10, 16), ""),
    # odd sizes: the last tiles part outside the output in both directions; no bias
    "rgb_odd": Layer(2, 64, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (13, 17), ""),
    # stride 1 (one phase, 8-row tiles), 8 output channels: the whole n8 tile
    "k3s1p1_eight": Layer(2, 16, 8, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), 1, True, (9, 7), ""),
    # asymmetric stride, padding, output padding and dilation; 40 input channels: a part-empty chunk
    "asym": Layer(2, 40, 5, (5, 3), (3, 2), (2, 1), (1, 0), (1, 2), 1, True, (7, 5), ""),
    # stride 4 past a 2 x 2 kernel: phases with no tap (bias alone); 136 input channels; batch 1
    "k2s4_gaps": Layer(1, 136, 2, (2, 2), (4, 4), (0, 0), (3, 1), (1, 1), 1, True, (6, 5), ""),
    # 8 output channels at 4 x 4: 128 (tap, output channel) pairs, one-row tiles
    "eight_k4s2": Layer(2, 48, 8, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (7, 9), ""),
    # one output channel (a mask head)
    "mask": Layer(2, 32, 1, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (11, 7), ""),
    # unbatched
    "unbatched": Layer(None, 64, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (9, 11), ""),
}


def _geometry(layer: Layer):
    return geometry(layer.input_shape, layer.weight_shape, None, ConvParams.from_args(**layer.kwargs()))


def _rel(t, ref):
    return float(torch.linalg.vector_norm(t.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))


def _check(layer: Layer, seed: int, sm_count: int, precision: str = "tf32", unaligned: bool = False) -> None:
    """Runs the pinned forward and holds it to float64; ``unaligned``: x one element past a 16-byte boundary."""
    g = _geometry(layer)
    assert thin_mma.eligible(g, "float32", "nchw", precision)
    x64, w64, b64, _ = _data(layer, seed)
    x, w = x64.float(), w64.float()
    if unaligned:
        x = torch.empty(x.numel() + 1, device="cuda")[1:].view(x.shape).copy_(x)
    b = None if b64 is None else b64.float()
    blocks = [torch.full(F.conv_transpose2d(x64, w64, None, **layer.kwargs()).shape, float("nan"), device="cuda")
              for _ in range(3)]
    del blocks
    with tf32_allowed(precision == "tf32"), tuning.pinned({"forward": THIN}), launch.watch() as seen:
        ours = ct.conv_transpose2d(x, w, b, **layer.kwargs())
        torch.cuda.synchronize()
        theirs = F.conv_transpose2d(x, w, b, **layer.kwargs())
    ran = [plan for _, plan in seen if plan.spec.function == FUNCTION]
    assert ran, "the thin-output kernel did not run"
    whole_runs = not unaligned and g.in_size[1] % 4 == 0
    constants = dict(ran[0].spec.constants)
    assert (constants["VEC"], constants["MMA_KIND"]) == (4 if whole_runs else 1, thin_mma.MMA_KINDS[precision])
    planned = set(table.plan("forward", THIN, g, "float32", "nchw", precision, b is not None, not unaligned,
                             sm_count).plans())
    assert planned <= {plan for _, plan in seen}
    ref = F.conv_transpose2d(x64, w64, b64, **layer.kwargs())
    magnitude = F.conv_transpose2d(x64.abs(), w64.abs(), None if b64 is None else b64.abs(), **layer.kwargs())
    assert ours.is_contiguous()
    rounded = F.conv_transpose2d(round_tf32(x), round_tf32(w), b64, **layer.kwargs()) if precision == "tf32" else None
    _check_near_float64(ours, theirs, ref, magnitude, torch.float32, "forward", rounded)
    if precision == "strict":
        bad = (ours.double() - ref).abs() > 1e-5 * magnitude
        assert not bool(bad.any()), f"{int(bad.sum())} of {ours.numel()} values off"


# the layers whose (tap, output channel) pairs fit 3xTF32's accumulators (not eight_k4s2's 128)
STRICT_LAYERS = ("rgb_k4s2p1", "rgb_runs", "rgb_odd", "k3s1p1_eight", "asym", "k2s4_gaps", "unbatched")


@pytest.mark.parametrize("name,precision", [(name, "tf32") for name in LAYERS]
                         + [(name, "strict") for name in STRICT_LAYERS])
def test_thin_forward_matches_float64(name, precision, ampere_or_newer):
    _check(LAYERS[name], list(LAYERS).index(name), ampere_or_newer.sm_count, precision)


@pytest.mark.parametrize("precision", ["tf32", "strict"])
def test_unaligned_activations_take_word_copies(precision, ampere_or_newer):
    _check(LAYERS["rgb_runs"], 11, ampere_or_newer.sm_count, precision, unaligned=True)


def test_untuned_calls_run_the_family_as_tf32_or_3xtf32(ampere_or_newer, monkeypatch):
    """torch's TF32 switch picks the kernel's precision: both run the thin-output kernel untuned (it leads the
    table), each within its bound of float64."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    layer = LAYERS["rgb_k4s2p1"]
    x64, w64, b64, _ = _data(layer, 9)
    try:
        for allow_tf32 in (True, False):
            with tf32_allowed(allow_tf32), launch.watch() as seen:
                ours = ct.conv_transpose2d(x64.float(), w64.float(), b64.float(), **layer.kwargs())
                torch.cuda.synchronize()
            kinds = {dict(plan.spec.constants)["MMA_KIND"] for _, plan in seen if plan.spec.function == FUNCTION}
            assert kinds == {thin_mma.MMA_KINDS["tf32" if allow_tf32 else "strict"]}, kinds
            ref = F.conv_transpose2d(x64, w64, b64, **layer.kwargs())
            assert _rel(ours, ref) < (2e-3 if allow_tf32 else 1e-5)
    finally:
        tuning.clear()
