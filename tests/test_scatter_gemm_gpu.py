"""The scatter and gather GEMMs (a layer's taps as one wgmma GEMM) on an sm_90 GPU, against float64: the scatter
forward of layers whose output pixels each receive one tap, and the gather grad_input of those and of layers whose
taps overlap, leave gaps or are dilated apart.

Each case pins its pass to a ``scatter_gemm`` variant and checks, through ``launch.watch()``, that
``conv_transpose2d_scatter_gemm`` (or ``conv_transpose2d_gather_gemm``) ran and nothing it did not plan; the
checks are test_wgmma_gpu's: finite outputs (free blocks of the output's size are NaN-filled first), every
element within a bound of float64, and no worse than twice torch's own error on the same inputs.  Skipped (with
the reason) on GPUs other than sm_90.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv.torch as ct  # noqa: E402
from cupyconv.core import device as core_device  # noqa: E402
from cupyconv.jit import compiler  # noqa: E402
from cupyconv import tuning  # noqa: E402
from cupyconv.plans import launch, scatter_gemm, table  # noqa: E402
from cupyconv.tuning import Variant  # noqa: E402

from layers import Layer  # noqa: E402
from test_wgmma_gpu import (GRAD, NAMES, SHORT, Case, _compare, _compare_grad_input, _data,  # noqa: E402
                            _grad_data, _grad_inputs, _inputs, _one_element_off, _run_grad, _run_ours)

FUNCTION = "conv_transpose2d_scatter_gemm"
GATHER_FUNCTION = "conv_transpose2d_gather_gemm"
SCATTER = Variant("scatter_gemm")


@pytest.fixture(scope="module")
def hopper():
    dev = core_device.get(torch.cuda.current_device())
    if dev.arch != "90":
        pytest.skip(f"the scatter GEMM is sm_90a code, for sm_90 GPUs only; this GPU ({dev.name}) is sm_{dev.arch}")
    return dev


# (batch, C_in, C_out, kernel, stride, padding, output_padding, bias, size)
LAYERS = {
    # U-Net's upsampling at small channel counts: 7 x 9 input pixels, so the last pixel tile is mostly empty
    "k2s2": Layer(3, 64, 48, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, True, (7, 9), ""),
    # 136 input channels: a last step of 8 channels; 4 x 72 = 288 columns: a last column tile of 32
    "k2s2_wide": Layer(2, 136, 72, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, False, (5, 11), ""),
    # asymmetric kernel == stride, a cropped border and output padding inside it
    "k2x3_s2x3_crop": Layer(2, 32, 40, (2, 3), (2, 3), (1, 1), (1, 0), (1, 1), 1, True, (6, 5), ""),
    "k3s3_p1_op1": Layer(2, 48, 16, (3, 3), (3, 3), (1, 1), (1, 1), (1, 1), 1, True, (4, 7), ""),
    # one input pixel: pix2pix's innermost layer (its taps cropped to a 2 x 2 output), a generator's first layer
    "one_pixel_k4s2p1": Layer(5, 128, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (1, 1), ""),
    "one_pixel_k4s1": Layer(7, 64, 32, (4, 4), (1, 1), (0, 0), (0, 0), (1, 1), 1, False, (1, 1), ""),
    # a 1 x 1 kernel (a pointwise layer), stride 1
    "pointwise": Layer(2, 40, 24, (1, 1), (1, 1), (0, 0), (0, 0), (1, 1), 1, True, (9, 13), ""),
}
COMBOS = [(torch.float16, False, False), (torch.bfloat16, True, True), (torch.float16, True, False),
          (torch.bfloat16, False, True)]   # (dtype, x channels_last, weight channels_last)
CASES = [pytest.param(Case(layer, dtype, cl, SCATTER, weight_channels_last=wcl),
                      id=f"{name}-{SHORT[dtype]}-{'nhwc' if cl else 'nchw'}-{'wcl' if wcl else 'w'}")
         for name, layer in LAYERS.items() for dtype, cl, wcl in COMBOS]

# Every tile, on a layer whose pixels and columns both end mid-tile.
TILE_LAYER = Layer(3, 72, 40, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, True, (7, 9), "")
TILE_CASES = [pytest.param(Case(TILE_LAYER, dtype, dtype == torch.bfloat16, Variant.make("scatter_gemm", tile=name),
                                weight_channels_last=True), id=f"{name}-{SHORT[dtype]}")
              for name in scatter_gemm.TILES for dtype in (torch.float16, torch.bfloat16)]

# Persistent blocks walking several tiles each, both consumers in turn, with more steps a tile (1024 input
# channels: 16) than the ring has buffers.
DEEP = Layer(4, 1024, 64, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, True, (96, 96), "")
DEEP_CASES = [pytest.param(Case(DEEP, dtype, True, Variant.make("scatter_gemm", tile=tile), weight_channels_last=True),
                           id=f"{tile}-{SHORT[dtype]}")
              for tile, dtype in (("128x128", torch.float16), ("64x256", torch.bfloat16))]

UNBATCHED = replace(LAYERS["k2s2"], batch=None)
# enough tiles for the family to lead untuned (ScatterGemmFamily.leads)
LEADING = Layer(8, 64, 48, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, True, (48, 64), "")


# grad_input's A lands as copy-engine boxes where output channels come in 64s (a step within one tap): a 9-column
# grid (tiles past its edge), and a cropped stride 3 with output padding
GRAD_BOX_LAYERS = {
    "k2s2_box": Layer(3, 64, 64, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, False, (7, 9), ""),
    "k3s3_p1_op1_box": Layer(2, 48, 128, (3, 3), (3, 3), (1, 1), (1, 1), (1, 1), 1, False, (5, 6), ""),
}
GRAD_CASES = [pytest.param(replace(p.values[0], pass_=GRAD), id=p.id) for p in CASES] + \
    [pytest.param(Case(layer, dtype, cl, SCATTER, pass_=GRAD, weight_channels_last=wcl),
                  id=f"{name}-{SHORT[dtype]}-{'nhwc' if cl else 'nchw'}-{'wcl' if wcl else 'w'}")
     for name, layer in GRAD_BOX_LAYERS.items() for dtype, cl, wcl in COMBOS]
GRAD_TILE_CASES = [pytest.param(replace(p.values[0], pass_=GRAD), id=p.id) for p in TILE_CASES]
# grad_input's K is (tap, output channel): 160 output channels of 4 taps make 10 steps a tile (gathered rows),
# 192 make 12 (copy-engine boxes), more than the ring holds, and 576 tiles of 128 x 128 (1152 of 64 x 128) walk
# both consumers through several each
GRAD_DEEP = Layer(8, 64, 160, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, False, (96, 96), "")
# Layers whose taps overlap, leave gaps or are dilated apart: grad_input only, its K every tap
OVERLAPPING_LAYERS = {
    # DCGAN's and pix2pix's 4 x 4 stride 2, cropped: grad_output by copy-engine boxes (64 output channels), and
    # gathered rows with landing masks (48: steps cross taps)
    "k4s2p1_box": Layer(2, 64, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (5, 7), ""),
    "k4s2p1_rows": Layer(2, 64, 48, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (5, 7), ""),
    # an asymmetric 3 x 5 kernel at stride (2, 1) with output padding, nothing cropped
    "k3x5_s2x1_op": Layer(2, 32, 64, (3, 5), (2, 1), (0, 0), (1, 0), (1, 1), 1, False, (6, 5), ""),
    # an uncropped 3 x 3 stride 2 of 136 input channels (a last input channel tile of 8)
    "k3s2": Layer(3, 136, 64, (3, 3), (2, 2), (0, 0), (0, 0), (1, 1), 1, False, (4, 6), ""),
    # a cropped 3 x 3 stride 1 of 40 output channels
    "k3s1_p1": Layer(2, 72, 40, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), 1, False, (9, 7), ""),
    # a dilated 3 x 3, cropped, by boxes; gaps between taps (2 x 3 at stride 3 x 2) dilated along one axis, rows
    "k3d2_p2_box": Layer(2, 32, 64, (3, 3), (1, 1), (2, 2), (0, 0), (2, 2), 1, False, (7, 8), ""),
    "k2x3_s3x2_d1x2_rows": Layer(2, 32, 24, (2, 3), (3, 2), (1, 1), (2, 1), (1, 2), 1, False, (4, 5), ""),
}
OVERLAPPING_CASES = [pytest.param(Case(layer, dtype, cl, SCATTER, pass_=GRAD, weight_channels_last=wcl),
                                  id=f"{name}-{SHORT[dtype]}-{'nhwc' if cl else 'nchw'}-{'wcl' if wcl else 'w'}")
                     for name, layer in OVERLAPPING_LAYERS.items() for dtype, cl, wcl in COMBOS]
# grad_input of float32 at torch's default TF32 precision: one tap a pixel and overlapping taps, copy-engine boxes
# and gathered rows, cropped and dilated, both layouts and weight layouts, every tile, and 24 steps a tile (192 output channels of 4 taps, 32 columns a step) lapping the ring
TF32_LAYERS = {name: replace(layer, bias=False) for name, layer in (
    ("k2s2", LAYERS["k2s2"]), ("k3s3_p1_op1_box", GRAD_BOX_LAYERS["k3s3_p1_op1_box"]),
    ("k4s2p1_box", OVERLAPPING_LAYERS["k4s2p1_box"]), ("k4s2p1_rows", OVERLAPPING_LAYERS["k4s2p1_rows"]),
    ("k3d2_p2_box", OVERLAPPING_LAYERS["k3d2_p2_box"]),
    ("k2x3_s3x2_d1x2_rows", OVERLAPPING_LAYERS["k2x3_s3x2_d1x2_rows"]))}
TF32_CASES = [pytest.param(Case(layer, torch.float32, cl, SCATTER, pass_=GRAD, weight_channels_last=wcl),
                           id=f"{name}-{'nhwc' if cl else 'nchw'}-{'wcl' if wcl else 'w'}")
              for name, layer in TF32_LAYERS.items() for _, cl, wcl in COMBOS]
TF32_CASES += [pytest.param(Case(replace(TILE_LAYER, bias=False), torch.float32, i % 2 == 0,
                                 Variant.make("scatter_gemm", tile=name), pass_=GRAD, weight_channels_last=i % 2 == 1),
                            id=f"tile-{name}") for i, name in enumerate(scatter_gemm.TILES)]
TF32_CASES += [pytest.param(Case(replace(GRAD_DEEP, out_channels=192), torch.float32, True,
                                 Variant.make("scatter_gemm", tile="128x128"), pass_=GRAD, weight_channels_last=True),
                            id="deep-128x128-192")]
# the same read in place from a channels_last grad_output, the consumers rounding A in registers: every channels_last
# TF32 case above, with the same tile (pinned)
IN_PLACE_CASES = [pytest.param(replace(p.values[0], variant=Variant.make("scatter_gemm", inplace=True,
                                                                         **p.values[0].variant.kwargs)),
                               id=f"{p.id}-inplace")
                  for p in TF32_CASES if p.values[0].layout == "nhwc"]
# enough tiles, input channels and few enough taps a phase for the gather to lead grad_input untuned; and 40 tiles
# of 128 pixels, which it runs as 80 of 64 (scatter_gemm.heuristic_tile)
OVERLAP_LEADING = Layer(16, 128, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (32, 32), "")
FEW_TILES_LEADING = replace(OVERLAP_LEADING, batch=5)
GRAD_DEEP_CASES = [pytest.param(Case(replace(GRAD_DEEP, out_channels=cout), dtype, cl,
                                     Variant.make("scatter_gemm", tile=tile), pass_=GRAD, weight_channels_last=cl),
                                id=f"{tile}-{SHORT[dtype]}-{cout}")
                   for tile, dtype, cl, cout in (("128x128", torch.float16, True, 160),
                                                 ("64x128", torch.bfloat16, False, 160),
                                                 ("128x128", torch.bfloat16, True, 192),
                                                 ("64x128", torch.float16, False, 192))]


@pytest.fixture(scope="module", autouse=True)
def precompiled(hopper):
    """Build every case's kernels side by side rather than one by one at each first call."""
    cases = [p.values[0] for p in CASES + TILE_CASES + DEEP_CASES + GRAD_CASES + GRAD_TILE_CASES + GRAD_DEEP_CASES
             + OVERLAPPING_CASES + TF32_CASES + IN_PLACE_CASES]
    specs = [p.spec for case in cases for p in case.plan(hopper).plans()]
    compiler.compile_many(specs, hopper.index, workers=16)


def _check(case: Case, hopper, seed=0):
    assert scatter_gemm.eligible(case.geometry, {torch.float16: "float16", torch.bfloat16: "bfloat16"}[case.dtype])
    x, w, b = _inputs(case, *_data(case.layer, case.dtype, seed))
    y, seen = _run_ours(case, x, w, b, expect_function=FUNCTION)
    assert {p for _, p in seen} == set(case.plan(hopper).plans()), "the pinned variant launched other kernels"
    _compare(case, y, x, w, b)
    return y


@pytest.mark.parametrize("case", CASES)
def test_one_tap_layers_match_float64(case, hopper):
    _check(case, hopper)


@pytest.mark.parametrize("case", TILE_CASES)
def test_every_tile(case, hopper):
    _check(case, hopper)


@pytest.mark.parametrize("case", DEEP_CASES)
def test_blocks_walk_many_tiles_in_turn(case, hopper):
    plan = case.plan(hopper).gemm
    tiles = scatter_gemm.tile_count(case.geometry, scatter_gemm.TILES[case.variant.kwargs["tile"]])
    assert tiles >= 4 * plan.grid[0], "each consumer warpgroup takes two tiles or more"
    assert dict(plan.spec.constants)["STAGES"] < 16, "a tile's steps lap the ring"
    _check(case, hopper)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unbatched_input(dtype, hopper):
    y = _check(Case(UNBATCHED, dtype, False, SCATTER, weight_channels_last=True), hopper)
    assert y.dim() == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_channels_last_input_runs_the_gemm(dtype, hopper):
    """An input view starting one element off a 16-byte boundary cannot feed the copies: the pinned variant plans
    the mma.sync GEMM instead, which gives the right answer."""
    case = Case(LAYERS["k2s2"], dtype, True, SCATTER, weight_channels_last=True)
    x, w, b = _inputs(case, *_data(case.layer, dtype, 1))
    y, seen = _run_ours(case, _one_element_off(x), w, b, expect_function="conv_transpose2d_igemm")
    assert FUNCTION not in {plan.spec.function for _, plan in seen}
    assert {p for _, p in seen} == set(case.plan(hopper, aligned=False).plans())
    _compare(case, y, x, w, b)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_the_heuristic_forward_on_sm_90(channels_last, hopper, monkeypatch):
    """Untuned, a U-Net upsampling layer's forward runs the scatter GEMM in NCHW and the halo-tile wgmma kernel in
    channels_last (NOTES v44)."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    try:
        case = Case(LEADING, torch.bfloat16, channels_last, SCATTER, weight_channels_last=channels_last)
        leading, function = (Variant("wgmma"), "conv_transpose2d_wgmma") if channels_last else (SCATTER, FUNCTION)
        assert table.candidates("forward", case.geometry, "bfloat16", case.layout, "strict", hopper)[0] == leading
        x, w, b = _inputs(case, *_data(case.layer, torch.bfloat16, 2))
        x.requires_grad_()
        y, seen = _run_ours(case, x, w, b, expect_function=function, pin=False)
        _compare(case, y.detach(), x.detach(), w, b)
    finally:
        tuning.clear()


# ------------------------------------------------------------------------ grad_input: the gather GEMM

def _check_grad_input(case: Case, hopper, seed=0):
    assert scatter_gemm.eligible(case.geometry, NAMES[case.dtype], GRAD, case.precision)
    x, w, go = _grad_inputs(case, *_grad_data(case.layer, case.dtype, seed))
    gi, seen = _run_grad(case, go, x, w, expect_function=GATHER_FUNCTION)
    assert {p for _, p in seen} == set(case.plan(hopper).plans()), "the pinned variant launched other kernels"
    _compare_grad_input(case, gi, go, x, w)
    return gi


@pytest.mark.parametrize("case", GRAD_CASES)
def test_grad_input_of_one_tap_layers_matches_float64(case, hopper):
    _check_grad_input(case, hopper, seed=10)


@pytest.mark.parametrize("case", OVERLAPPING_CASES)
def test_grad_input_of_overlapping_and_dilated_taps_matches_float64(case, hopper):
    assert not scatter_gemm.one_tap(case.geometry)
    constants = dict(case.plan(hopper).gemm.spec.constants)
    assert constants["A_BOXES"] is (case.layer.out_channels % 64 == 0)
    _check_grad_input(case, hopper, seed=15)


@pytest.mark.parametrize("case", TF32_CASES)
def test_tf32_grad_input_matches_float64(case, hopper):
    """float32 at torch's default TF32 precision: both operands reach the kernel rounded to TF32 by a copy (the
    tensor cores would truncate them), and grad_input is within twice TF32's unit of float64 and no worse than
    twice torch's error (at least that of an exact sum of TF32-rounded products)."""
    assert torch.backends.cudnn.allow_tf32 and case.precision == "tf32"
    packed = case.plan(hopper)
    assert dict(packed.gemm.spec.constants)["MMA_KIND"] == 2, "TF32 MMAs"
    for copy in (packed.pack, packed.to_channels_last):
        assert copy is not None and (copy.spec.function == "round_tf32_copy"
                                     or dict(copy.spec.constants)["ROUND_TF32"]), "each operand copied rounded"
    _check_grad_input(case, hopper, seed=17)


@pytest.mark.parametrize("case", IN_PLACE_CASES)
def test_tf32_grad_input_reading_grad_output_in_place_matches_the_rounding_copy(case, hopper):
    """Read in place, a channels_last grad_output is rounded in the consumers' registers as the rounding copy
    rounds it, in the same order of K: grad_input is bit for bit the copy's, and within float64's bounds."""
    packed = case.plan(hopper)
    assert packed.to_channels_last is None and dict(packed.gemm.spec.constants)["A_IN_PLACE"]
    gi = _check_grad_input(case, hopper, seed=17)
    copied = replace(case, variant=Variant.make("scatter_gemm", **{k: v for k, v in case.variant.kwargs.items()
                                                                    if k != "inplace"}))
    x, w, go = _grad_inputs(copied, *_grad_data(copied.layer, copied.dtype, 17))
    reference, _ = _run_grad(copied, go, x, w, expect_function=GATHER_FUNCTION)
    assert torch.equal(gi, reference)


@pytest.mark.parametrize("case", GRAD_TILE_CASES)
def test_every_grad_input_tile(case, hopper):
    _check_grad_input(case, hopper, seed=11)


@pytest.mark.parametrize("case", GRAD_DEEP_CASES)
def test_grad_input_blocks_walk_many_tiles_in_turn(case, hopper):
    plan = case.plan(hopper).gemm
    tiles = scatter_gemm.tile_count(case.geometry, scatter_gemm.TILES[case.variant.kwargs["tile"]], GRAD)
    assert tiles >= 4 * plan.grid[0], "each consumer warpgroup takes two tiles or more"
    constants = dict(plan.spec.constants)
    assert constants["STAGES"] < 4 * case.layer.out_channels // 64, "a tile's steps lap the ring"
    assert constants["A_BOXES"] is (case.layer.out_channels % 64 == 0)
    _check_grad_input(case, hopper, seed=12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_grad_input_of_an_unbatched_input(dtype, hopper):
    gi = _check_grad_input(Case(UNBATCHED, dtype, False, SCATTER, pass_=GRAD, weight_channels_last=True), hopper)
    assert gi.dim() == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_grad_output_runs_the_gemm(dtype, hopper):
    """A channels_last grad_output starting one element off a 16-byte boundary cannot feed the copies: the pinned
    variant plans the mma.sync GEMM instead."""
    case = Case(replace(LAYERS["k2s2"], bias=False), dtype, True, SCATTER, pass_=GRAD, weight_channels_last=True)
    x, w, go = _grad_inputs(case, *_grad_data(case.layer, dtype, 13))
    gi, seen = _run_grad(case, _one_element_off(go), x, w, expect_function="conv_transpose2d_igemm")
    assert GATHER_FUNCTION not in {plan.spec.function for _, plan in seen}
    assert {p for _, p in seen} == set(case.plan(hopper, aligned=False).plans())
    _compare_grad_input(case, gi, go, x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "tf32"])
@pytest.mark.parametrize("layer", [LEADING, OVERLAP_LEADING, FEW_TILES_LEADING],
                         ids=["one_tap", "overlapping", "few_tiles"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_autograd_runs_the_gather_gemm_untuned_on_sm_90(channels_last, layer, dtype, hopper, monkeypatch):
    """Untuned, the backward of a U-Net upsampling layer and of 4 x 4 stride-2 layers of 128 input channels (one
    on 64-pixel tiles: under half a wave of 128-pixel ones) takes grad_input through the gather GEMM in bf16 and
    at torch's default TF32 (a channels_last grad_output read in place, on its in-place tile), and x.grad matches
    float64."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    try:
        case = Case(replace(layer, bias=False), dtype, channels_last, SCATTER, pass_=GRAD,
                    weight_channels_last=channels_last)
        name = NAMES[dtype]
        in_place = scatter_gemm.reads_in_place(GRAD, name, case.layout)
        tile = scatter_gemm.in_place_tile(case.geometry) if in_place else scatter_gemm.heuristic_tile(case.geometry,
                                                                                                      GRAD)
        heuristic = Variant.make("scatter_gemm", tile=tile.name, inplace=True) if in_place else SCATTER
        assert table.candidates(GRAD, case.geometry, name, case.layout, case.precision, hopper)[0] == heuristic
        few = scatter_gemm.heuristic_tile(case.geometry, GRAD) == scatter_gemm.FEW_TILES
        assert few is (layer is FEW_TILES_LEADING)
        x, w, go = _grad_inputs(case, *_grad_data(case.layer, dtype, 14))
        x.requires_grad_()
        y = ct.conv_transpose2d(x, w, None, **case.layer.kwargs())
        with launch.watch() as seen:
            y.backward(go)
            torch.cuda.synchronize()
        gathers = [plan for stage, plan in seen if stage == "main" and plan.spec.function == GATHER_FUNCTION]
        assert gathers, [plan.spec.function for _, plan in seen]
        ran = {tuple(dict(plan.spec.constants)[k] for k in ("MB", "BN", "A_IN_PLACE")) for plan in gathers}
        assert ran == {(tile.mb, tile.bn, in_place)}
        assert tuning.chosen(GRAD, case.geometry, name, case.layout, case.precision, hopper.index) == heuristic
        _compare_grad_input(case, x.grad, go, x.detach(), w)
    finally:
        tuning.clear()
