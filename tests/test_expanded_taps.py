"""The expanded-taps planner (no GPU): which layers it takes, what it launches, and where the table puts it."""
from __future__ import annotations

import dataclasses

import pytest

from cupyconv.core.device import ASSUMED, MMA_SYNC, NO_TENSOR_CORES
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import direct, expanded_taps, gemm, table
from cupyconv.plans.sequences import OneKernel, SplitK
from cupyconv.tuning import Variant


def _layer(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


PIX2PIX_RGB = _layer((16, 128, 128, 128), (128, 3, 4, 4), stride=2, padding=1)
DCGAN_RGB = _layer((128, 64, 32, 32), (64, 3, 4, 4), stride=2, padding=1)
EXPANDED = Variant("expanded_taps")


def test_expanded_columns_pad_taps_times_channels_to_whole_k16_steps():
    assert expanded_taps.expanded_columns(PIX2PIX_RGB) == 48
    assert expanded_taps.expanded_columns(_layer((2, 8, 5, 5), (8, 1, 1, 1))) == 16
    assert expanded_taps.expanded_columns(_layer((2, 8, 5, 5), (8, 7, 4, 4))) == 112


@pytest.mark.parametrize("w_shape,kwargs,eligible,why", [
    ((128, 3, 4, 4), dict(stride=2, padding=1), True, "an RGB output layer"),
    ((128, 15, 2, 2), dict(stride=2), True, "15 output channels"),
    ((128, 16, 2, 2), dict(stride=2), False, "16 output channels: the GEMM families' layer"),
    ((128, 9, 4, 4), dict(stride=2), False, "144 expanded columns"),
    ((128, 8, 3, 5), dict(stride=2), False, "prefetch: 2 runs of 40 values a thread"),
    ((128, 3, 4, 4), dict(stride=2, groups=2), False, "two groups"),
    ((100, 3, 4, 4), dict(stride=2), False, "100 input channels: no 16-byte runs"),
])
def test_eligibility(w_shape, kwargs, eligible, why):
    g = _layer((2, w_shape[0], 9, 7), w_shape, **kwargs)
    assert expanded_taps.eligible(g, "bfloat16", "nhwc") is eligible, why
    if eligible:
        assert expanded_taps.prefetched_values(g) <= expanded_taps.MAX_PREFETCHED
        assert direct.fits(g, "bfloat16", "nhwc"), "an unaligned call needs the direct kernels"


def test_16_bit_in_both_layouts_and_float32_in_nchw():
    for dtype, layout, precision in (("float16", "nhwc", "strict"), ("bfloat16", "nchw", "strict"),
                                     ("float32", "nchw", "tf32"), ("float32", "nchw", "strict")):
        assert expanded_taps.eligible(PIX2PIX_RGB, dtype, layout, precision), (dtype, layout)
    # channels_last float32 tiles would need 32-bit transposed fragment loads
    for dtype, layout in (("float32", "nhwc"), ("float64", "nchw"), ("float64", "nhwc")):
        assert not expanded_taps.eligible(PIX2PIX_RGB, dtype, layout, "tf32"), (dtype, layout)


@pytest.mark.parametrize("size,dtype,eligible", [
    ((9, 8), "bfloat16", True), ((9, 8), "float32", True), ((5, 4), "bfloat16", False), ((5, 4), "float32", True),
    ((7, 7), "float32", False), ((1, 16), "float16", True),
])
def test_nchw_needs_images_of_whole_16_byte_runs_of_pixels(size, dtype, eligible):
    """A 16-byte copy or store of an NCHW tile holds 8 16-bit or 4 float32 pixels of one image; the input
    channels need no such runs there."""
    g = _layer((2, 100) + size, (100, 3, 4, 4), stride=2, padding=1)
    assert expanded_taps.eligible(g, dtype, "nchw", "tf32") is eligible


def test_nchw_plans_read_channel_runs_of_pixels_and_keep_the_ring_within_shared_memory():
    """grad_weight's K tile is 128 bytes of each channel's pixels (64 16-bit, 32 float32): a ring stage holds
    (channels + 48 columns) rows of 128 + 16 bytes, four stages.  grad_input's tiles: the weight's channel block and
    G's pixels, rows of 48 columns, and the output's channel rows, each row 16 bytes longer.  float32 multiplies as
    TF32 (kind 2) where allowed, else as 3xTF32 (kind 3), which holds three forms of each fragment and a second
    set of accumulators: 64 channels a grad_weight block, 64 channels by 32 pixels a grad_input tile."""
    for dtype, precision, kind, itemsize, bm, tp_weight, bn, tp_input in (
            ("float32", "tf32", 2, 4, 128, 32, 128, 64), ("float32", "strict", 3, 4, 64, 32, 64, 32),
            ("bfloat16", "strict", 1, 2, 128, 64, 128, 64)):
        partial, reduce = expanded_taps.plan_grad_weight(PIX2PIX_RGB, dtype, 132, None, "nchw", precision)
        c = dict(partial.spec.constants)
        assert (c["NCHW"], c["MMA_KIND"], c["TP"], c["BM"], c["STAGES"]) == (True, kind, tp_weight, bm, 4)
        assert partial.smem_bytes == 4 * (bm + 48) * (128 + 16) <= expanded_taps.SMEM_LIMIT
        assert partial.grid[1] == 128 // bm and reduce is not None
        gi = expanded_taps.plan_grad_input(PIX2PIX_RGB, dtype, 132, "nchw", precision)
        c = dict(gi.spec.constants)
        assert (c["NCHW"], c["MMA_KIND"], c["TP"], c["BN"]) == (True, kind, tp_input, bn)
        assert gi.grid[1] == 128 // bn
        assert gi.smem_bytes == (bn + tp_input) * (48 * itemsize + 16) + bn * (tp_input * itemsize + 16)
    nhwc = dict(expanded_taps.plan_grad_input(PIX2PIX_RGB, "bfloat16", 132).spec.constants)
    assert nhwc["NCHW"] is False


def test_nchw_needs_eight_input_channels():
    """Fewer input channels would leave grad_weight's M tiles and grad_input's N tiles mostly empty."""
    for channels, eligible in ((1, False), (7, False), (8, True), (9, True)):
        g = _layer((1, channels, 16, 16), (channels, 2, 2, 2), stride=2)
        assert expanded_taps.eligible(g, "float32", "nchw", "tf32") is eligible, channels


def test_strict_float32_takes_up_to_64_expanded_columns():
    four = _layer((2, 128, 8, 8), (128, 4, 4, 4), stride=2, padding=1)
    five = _layer((2, 128, 8, 8), (128, 5, 4, 4), stride=2, padding=1)
    assert expanded_taps.eligible(four, "float32", "nchw", "strict")
    assert not expanded_taps.eligible(five, "float32", "nchw", "strict")
    assert expanded_taps.eligible(five, "float32", "nchw", "tf32") and expanded_taps.eligible(five, "bfloat16", "nchw")


def test_grad_weight_plan_fills_the_gpu_and_reduces_in_a_wide_fixed_order():
    partial, reduce = expanded_taps.plan_grad_weight(PIX2PIX_RGB, "bfloat16", 132)
    constants = dict(partial.spec.constants)
    assert constants["BM"] == 128 and constants["TP"] == expanded_taps.TILE_PIXELS and constants["STAGES"] == 4
    assert constants["SINGLE_CHUNK"] is False and constants["MMA_KIND"] == 1
    pixels = 16 * 128 * 128
    tiles = pixels // 64
    chunks, channel_blocks = partial.grid[:2]
    assert channel_blocks == 1 and partial.block == (128, 1, 1)
    per_chunk = partial.scalars[-1]
    assert partial.scalars == (pixels, 128, 128, 256, 256, per_chunk)
    assert (chunks - 1) * per_chunk < tiles <= chunks * per_chunk, "the ranges cover every tile once"
    assert chunks >= 132, "at least a block an SM"
    assert partial.smem_bytes * 2 <= expanded_taps.SMEM_PER_SM, "two blocks an SM"
    weight_elems = 128 * 3 * 16
    assert partial.scratch_bytes == chunks * weight_elems * 4
    assert reduce.spec.function == "reduce_partials_wide" and reduce.scalars == (weight_elems, chunks)
    assert reduce.grid == (weight_elems // 32, 1, 1)


def test_a_small_grad_weight_runs_one_range_and_writes_the_weight():
    g = _layer((1, 64, 4, 4), (64, 3, 4, 4), stride=2, padding=1)
    partial, reduce = expanded_taps.plan_grad_weight(g, "float16", 132)
    assert reduce is None and partial.grid[0] == 1 and partial.scratch_bytes == 0
    assert dict(partial.spec.constants)["SINGLE_CHUNK"] is True


def test_channel_blocks_follow_the_input_channels_and_accumulators():
    wide = _layer((2, 256, 6, 5), (256, 7, 4, 4), stride=2)   # 112 columns: 64-channel blocks
    assert expanded_taps.weight_block_channels(wide) == 64
    assert expanded_taps.plan_grad_weight(wide, "bfloat16", 132)[0].grid[1] == 4
    assert expanded_taps.weight_block_channels(DCGAN_RGB) == 64
    assert expanded_taps.input_block_channels(DCGAN_RGB) == 64
    assert expanded_taps.input_block_channels(_layer((2, 136, 6, 5), (136, 2, 2, 2), stride=3)) == 128
    assert expanded_taps.input_block_channels(_layer((2, 24, 6, 5), (24, 5, 3, 5), stride=2)) == 32


@pytest.mark.parametrize("stages", expanded_taps.STAGE_CHOICES)
def test_every_ring_depth_plans_within_shared_memory(stages):
    partial, _ = expanded_taps.plan_grad_weight(PIX2PIX_RGB, "bfloat16", 132, stages)
    assert dict(partial.spec.constants)["STAGES"] == stages
    assert partial.smem_bytes == expanded_taps.weight_smem_bytes(PIX2PIX_RGB, "bfloat16", "nhwc", stages) \
        <= expanded_taps.SMEM_LIMIT
    with pytest.raises(ValueError, match="stages"):
        expanded_taps.plan_grad_weight(PIX2PIX_RGB, "bfloat16", 132, 6)


@pytest.mark.parametrize("w_shape", [(128, 4, 4, 4), (64, 8, 4, 4), (256, 7, 4, 4), (128, 3, 4, 4), (32, 1, 4, 4)])
def test_the_ring_fits_the_least_shared_memory_of_the_gpus_it_runs_on(w_shape):
    """sm_86 and sm_89 let a block opt in to 99 KB: a ring too deep for that is one stage shallower, and three
    stages always fit (the widest blocks: 128 channels with 64 columns, 64 channels with 128)."""
    g = _layer((2, w_shape[0], 9, 7), w_shape, stride=2, padding=1)
    assert expanded_taps.eligible(g, "float16", "nhwc")
    assert 3 in expanded_taps.weight_stage_choices(g)
    stages = expanded_taps.weight_stages(g)
    partial, _ = expanded_taps.plan_grad_weight(g, "float16", 132)
    assert dict(partial.spec.constants)["STAGES"] == stages
    assert partial.smem_bytes <= expanded_taps.SMEM_LIMIT
    if stages < expanded_taps.STAGES:
        assert expanded_taps.weight_smem_bytes(g, "float16", "nhwc", expanded_taps.STAGES) > expanded_taps.SMEM_LIMIT
    assert expanded_taps.plan_grad_input(g, "float16", 132).smem_bytes <= expanded_taps.SMEM_LIMIT
    assert (stages == 3) is (w_shape[:2] in ((128, 4), (64, 8)))


def test_grad_input_plan_walks_pixel_tiles_with_persistent_blocks():
    plan = expanded_taps.plan_grad_input(PIX2PIX_RGB, "bfloat16", 132)
    tiles = 16 * 128 * 128 // 64
    assert plan.grid[1] == 1 and 132 <= plan.grid[0] < tiles
    assert plan.grid[0] <= 132 * expanded_taps.MAX_BLOCKS_PER_SM
    assert plan.scalars == (16 * 128 * 128, 128, 128, 256, 256)
    assert dict(plan.spec.constants)["BN"] == 128
    assert plan.smem_bytes == expanded_taps.input_smem_bytes(PIX2PIX_RGB) < 48 * 1024


def test_planning_an_ineligible_layer_raises():
    with pytest.raises(ValueError, match="fewer than 16 output channels"):
        expanded_taps.plan_grad_weight(_layer((2, 64, 5, 5), (64, 32, 4, 4)), "float16", 132)
    with pytest.raises(ValueError, match="fewer than 16 output channels"):
        expanded_taps.plan_grad_input(PIX2PIX_RGB, "float32", 132)


def test_the_table_leads_its_passes_with_it_on_tensor_core_gpus():
    for pass_ in ("grad_input", "grad_weight"):
        cands = table.candidates(pass_, PIX2PIX_RGB, "bfloat16", "nhwc")
        assert cands[0] == EXPANDED and Variant("direct") in cands, pass_
    weight = table.candidates("grad_weight", PIX2PIX_RGB, "bfloat16", "nhwc")
    assert {v.kwargs.get("stages") for v in weight if v.family == "expanded_taps"} == {None, 3}
    assert EXPANDED not in table.candidates("forward", PIX2PIX_RGB, "bfloat16", "nhwc")
    for dtype, precision in (("bfloat16", "strict"), ("float32", "tf32"), ("float32", "strict")):
        assert table.candidates("grad_weight", PIX2PIX_RGB, dtype, "nchw", precision)[0] == EXPANDED, dtype
    assert EXPANDED not in table.candidates("grad_weight", PIX2PIX_RGB, "float32", "nhwc", "tf32")
    for arch, cores in (("80", MMA_SYNC), ("70", NO_TENSOR_CORES)):
        dev = dataclasses.replace(ASSUMED, arch=arch, tensor_cores=cores)
        first = table.candidates("grad_input", PIX2PIX_RGB, "bfloat16", "nhwc", "strict", dev)[0]
        assert (first == EXPANDED) is (cores == MMA_SYNC), arch


def test_switching_the_tensor_cores_off_leaves_the_direct_kernels(monkeypatch):
    monkeypatch.setenv(gemm.TENSOR_CORES_ENV, "0")
    assert not expanded_taps.FAMILY.eligible("grad_input", PIX2PIX_RGB, "bfloat16", "nhwc", ASSUMED)


def test_plans_per_pass_and_unaligned_fallback():
    family = expanded_taps.FAMILY
    gi = family.plan("grad_input", EXPANDED, PIX2PIX_RGB, "bfloat16", "nhwc", "strict", False, True, 132)
    assert isinstance(gi, OneKernel) and gi.main.spec.function == "conv_transpose2d_grad_input_expanded_taps"
    gw = family.plan("grad_weight", Variant.make("expanded_taps", stages=3), PIX2PIX_RGB, "bfloat16", "nhwc",
                     "strict", False, True, 132)
    assert isinstance(gw, SplitK) and dict(gw.partial.spec.constants)["STAGES"] == 3
    for pass_, function in (("grad_input", "conv_transpose2d_grad_input_nhwc"),
                            ("grad_weight", "conv_transpose2d_grad_weight_nhwc_partial")):
        unaligned = family.plan(pass_, EXPANDED, PIX2PIX_RGB, "bfloat16", "nhwc", "strict", False, False, 132)
        assert function in {p.spec.function for p in unaligned.plans()}, pass_


# ------------------------------------------------------------------------------------------ emulation

import numpy as np  # noqa: E402

import cuda_emulator  # noqa: E402
from cupyconv import reference  # noqa: E402
from test_kernels_emulated import C_TYPE, _storage, _values  # noqa: E402

emulated = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ to emulate the kernels")
# per-element bounds, times the sum of the terms' magnitudes: TF32's rounding, 3xTF32's dropped residual product,
# and a 16-bit result's rounding
EMULATED_BOUND = {("float32", "tf32"): 2 * 2.0 ** -10, ("float32", "strict"): 1e-5, ("bfloat16", "strict"): 2 ** -6,
                  ("float16", "strict"): 2 ** -9}


@emulated
@pytest.mark.parametrize("dtype,layout,precision", [("float32", "nchw", "tf32"), ("float32", "nchw", "strict"),
                                                    ("bfloat16", "nchw", "strict"), ("float16", "nhwc", "strict")])
def test_the_emulated_kernels_match_the_float64_reference(dtype, layout, precision):
    """Both gradients run by the C++ emulator (``mma.sync``, ``ldmatrix`` plain and transposed, as the PTX manual
    lays out their fragments) on a 40-channel RGB layer of two images whose pixel tiles cross the image border:
    every value within the dtype's bound of the sum of its terms' magnitudes.  grad_weight's pixel ranges write
    float32 partials, added here in order (the reduce kernel is tested on its own)."""
    g = _layer((2, 40, 5, 8), (40, 3, 4, 4), stride=2, padding=1)
    kwargs = dict(stride=(2, 2), padding=(1, 1), output_padding=(0, 0), groups=1, dilation=(1, 1))
    rng = np.random.default_rng(11)
    x, w, go = (_storage(rng.standard_normal(shape), dtype) for shape in (g.input_shape, g.weight_shape,
                                                                          g.output_shape))
    nhwc = layout == "nhwc"
    arranged = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))) if nhwc else (lambda a: a)
    gi_plan = expanded_taps.plan_grad_input(g, dtype, 132, layout, precision)
    gw_plan, reduce = expanded_taps.plan_grad_weight(g, dtype, 132, None, layout, precision)
    ranges = gw_plan.grid[0]
    assert ranges > 1 and reduce is not None
    c_type = C_TYPE[dtype]
    *_, gi = cuda_emulator.run(gi_plan, [arranged(go), w, arranged(_storage(np.full(g.input_shape, np.nan), dtype))],
                               [c_type] * 3)
    *_, partials = cuda_emulator.run(gw_plan, [arranged(x), arranged(go),
                                               np.full((ranges,) + g.weight_shape, np.nan, np.float32)],
                                     [c_type, c_type, "float"])
    gw = _storage(partials.astype(np.float64).sum(axis=0), dtype)
    if nhwc:
        gi = gi.transpose(0, 3, 1, 2)
    x64, w64, go64 = (_values(a, dtype) for a in (x, w, go))
    want = reference.conv_transpose2d_backward(go64, x64, w64, **kwargs)[:2]
    magnitude = reference.conv_transpose2d_backward(np.abs(go64), np.abs(x64), np.abs(w64), **kwargs)[:2]
    for what, ours, ref, mag in zip(("grad_input", "grad_weight"), (gi, gw), want, magnitude):
        ours = _values(ours, dtype)
        assert np.isfinite(ours).all(), f"{what}: values left unwritten"
        bad = np.abs(ours - ref) > EMULATED_BOUND[dtype, precision] * mag
        assert not bad.any(), f"{what}: {int(bad.sum())} of {ours.size} off; worst {np.abs(ours - ref).max():.3e}"
