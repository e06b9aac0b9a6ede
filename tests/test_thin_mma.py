"""The thin-output forward's planner (no GPU): which layers it takes, what it launches, where the table puts it."""
from __future__ import annotations

import dataclasses

import pytest

from cupyconv.core.device import ASSUMED, MMA_SYNC, NO_TENSOR_CORES
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import gemm, table, thin_mma
from cupyconv.plans.sequences import OneKernel
from cupyconv.tuning import Variant


def _layer(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


PIX2PIX_RGB = _layer((16, 128, 128, 128), (128, 3, 4, 4), stride=2, padding=1)
THIN = Variant("thin_mma")


@pytest.mark.parametrize("x_shape,w_shape,kwargs,dtype,precision,eligible,why", [
    ((2, 128, 9, 7), (128, 3, 4, 4), dict(stride=2, padding=1), "float32", "tf32", True, "an RGB output layer"),
    ((2, 16, 9, 7), (16, 8, 3, 3), dict(stride=1, padding=1), "float32", "tf32", True, "8 output channels"),
    ((2, 16, 9, 7), (16, 9, 3, 3), dict(stride=1, padding=1), "float32", "tf32", False, "9 output channels"),
    ((2, 15, 9, 7), (15, 3, 4, 4), dict(stride=2), "float32", "tf32", False, "15 input channels: under a chunk"),
    ((2, 128, 9, 7), (128, 3, 4, 4), dict(stride=2), "float32", "strict", True, "strict float32: 3xTF32"),
    ((2, 128, 9, 7), (128, 3, 4, 4), dict(stride=2), "bfloat16", "strict", False, "16-bit: the wgmma thin tiles"),
    ((2, 128, 9, 7), (128, 3, 4, 4), dict(stride=2, groups=2), "float32", "tf32", False, "two groups"),
    ((2, 32, 9, 7), (32, 3, 5, 5), dict(stride=5), "float32", "tf32", False, "stride 5"),
    ((2, 32, 9, 7), (32, 3, 4, 4), dict(stride=4), "float32", "tf32", True, "stride 4"),
    ((2, 32, 9, 7), (32, 8, 4, 4), dict(stride=2), "float32", "tf32", True, "128 pairs: one-row tiles"),
    ((2, 32, 9, 7), (32, 8, 5, 5), dict(stride=2), "float32", "tf32", False, "200 pairs: past the accumulators"),
    ((2, 32, 9, 7), (32, 8, 4, 4), dict(stride=2), "float32", "strict", False, "128 pairs: past strict's"),
])
def test_eligibility(x_shape, w_shape, kwargs, dtype, precision, eligible, why):
    g = _layer(x_shape, w_shape, **kwargs)
    assert thin_mma.eligible(g, dtype, "nchw", precision) is eligible, why
    assert not thin_mma.eligible(g, dtype, "nhwc", precision)


def test_the_window_covers_every_tap_of_every_phase():
    """For each output row of a tile, every tap that feeds it reads a window row in range, and the last row is
    read (the first may not be, where a dilated tap skips it): the kernel's offsets, worked through in Python."""
    for k, s, p, d in ((4, 2, 1, 1), (3, 1, 1, 1), (3, 2, 1, 2), (5, 3, 2, 1), (2, 4, 0, 1), (4, 2, 3, 1)):
        g = _layer((1, 16, 6, 6), (16, 3, k, k), stride=s, padding=p, dilation=d)
        rows = thin_mma.tile_rows(g)
        height, _ = thin_mma.window(g, rows)
        low = (p - (k - 1) * d) // s
        seen = set()
        for r in range(s * rows):
            for kh in range(k):
                if (r + p - kh * d) % s == 0:
                    row = (r + p - kh * d) // s - low
                    assert 0 <= row < height, (k, s, p, d, r, kh)
                    seen.add(row)
        assert height - 1 in seen, (k, s, p, d)


def test_plan_launches_a_block_a_tile_and_image_within_shared_memory():
    plan = thin_mma.plan_forward(PIX2PIX_RGB, "float32", False)
    c = dict(plan.spec.constants)
    # a 10 x 18 window (180 pixels: three m16 tiles a warp) by 16 taps x 3 output channels (six n8 tiles)
    assert (c["PR"], c["MI"], c["NI"], c["HAS_BIAS"], c["MMA_KIND"]) == (8, 3, 6, False, 2)
    # tiles of 16 x 32 output pixels over 256 x 256, one grid row an image
    assert plan.grid == ((256 // 16) * (256 // 32), 16, 1) and plan.block == (128, 1, 1)
    assert plan.scalars == (128, 128, 256, 256, 256 // 32)
    # columns -1 .. 16 widened to -4 .. 19: 16-byte runs; two stages of 16 channels' 10 x 24 windows (240
    # words, padded to 264) and 48 pairs (padded to 72 words), or the 48 x (192 + 4) word result
    assert c["STAGES"] == 2 and c["VEC"] == 4
    assert plan.smem_bytes == max(2 * 16 * (264 + 72) * 4, 48 * 196 * 4) <= thin_mma.SMEM_LIMIT
    # an unaligned pointer, or rows of a width that is not a whole number of 16-byte runs: word copies
    assert dict(thin_mma.plan_forward(PIX2PIX_RGB, "float32", False, "tf32", False).spec.constants)["VEC"] == 1
    odd = _layer((2, 32, 9, 7), (32, 3, 4, 4), stride=2, padding=1)
    assert dict(thin_mma.plan_forward(odd, "float32", False).spec.constants)["VEC"] == 1
    assert thin_mma.plan_forward(_layer((2, 32, 9, 7), (32, 3, 3, 3), stride=3), "float32", True).spec.constants
    with pytest.raises(ValueError, match="thin-output forward"):
        thin_mma.plan_forward(PIX2PIX_RGB, "bfloat16", False, "strict")


def test_strict_float32_runs_3xtf32_on_tiles_of_half_the_accumulators():
    """An fp32 total beside each accumulator: pix2pix's RGB layer takes 4-row tiles, a 6 x 18 window in two m16
    tiles a warp."""
    c = dict(thin_mma.plan_forward(PIX2PIX_RGB, "float32", False, "strict").spec.constants)
    assert (c["PR"], c["MI"], c["NI"], c["MMA_KIND"]) == (4, 2, 6, 3)
    assert thin_mma.window(PIX2PIX_RGB, 4) == (6, 18)


def test_tiles_shrink_until_the_accumulators_fit():
    """Eight (tap, output channel) n8 tiles take 8-row tiles, ten 4-row tiles and sixteen one-row tiles, whose
    3 x 18 window is one m16 tile a warp."""
    g = _layer((2, 32, 9, 7), (32, 8, 4, 4), stride=2, padding=1)
    assert thin_mma.tile_rows(g) == 1 and thin_mma.mma_tiles(g, 1) == (1, 16)
    g = _layer((2, 32, 9, 7), (32, 4, 4, 4), stride=2, padding=1)
    assert thin_mma.tile_rows(g) == 8 and thin_mma.mma_tiles(g, 8) == (3, 8)
    g = _layer((2, 32, 9, 7), (32, 5, 4, 4), stride=2, padding=1)
    assert thin_mma.tile_rows(g) == 4 and thin_mma.mma_tiles(g, 4) == (2, 10)
    for rows in thin_mma.TILE_ROWS:
        mi, ni = thin_mma.mma_tiles(PIX2PIX_RGB, rows)
        height, width = thin_mma.window(PIX2PIX_RGB, rows)
        assert 64 * (mi - 1) < height * width <= 64 * mi and ni * 8 >= 48 > ni * 8 - 8


def test_the_table_puts_it_ahead_of_the_direct_and_tiled_kernels_which_race_it():
    cands = table.candidates("forward", PIX2PIX_RGB, "float32", "nchw", "tf32")
    assert cands[0] == THIN and Variant("direct") in cands and any(v.family == "tiled" for v in cands)
    assert table.candidates("forward", PIX2PIX_RGB, "float32", "nchw", "strict")[0] == THIN
    assert THIN not in table.candidates("grad_input", PIX2PIX_RGB, "float32", "nchw", "tf32")
    for arch, cores in (("80", MMA_SYNC), ("70", NO_TENSOR_CORES)):
        dev = dataclasses.replace(ASSUMED, arch=arch, tensor_cores=cores)
        first = table.candidates("forward", PIX2PIX_RGB, "float32", "nchw", "tf32", dev)[0]
        assert (first == THIN) is (cores == MMA_SYNC), arch
    plan = thin_mma.FAMILY.plan("forward", THIN, PIX2PIX_RGB, "float32", "nchw", "tf32", True, False, 132)
    assert isinstance(plan, OneKernel) and plan.main.spec.function == "conv_transpose2d_forward_thin_mma"


def test_switching_the_tensor_cores_off_leaves_the_direct_kernels(monkeypatch):
    monkeypatch.setenv(gemm.TENSOR_CORES_ENV, "0")
    assert not thin_mma.FAMILY.eligible("forward", PIX2PIX_RGB, "float32", "nchw", ASSUMED, "tf32")


# ------------------------------------------------------------------------------------------ emulation

import numpy as np  # noqa: E402

import cuda_emulator  # noqa: E402
from cupyconv import reference  # noqa: E402

emulated = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ to emulate the kernels")
TF32_EPS = 2.0 ** -10

# (input shape, weight shape, stride, padding, output_padding, dilation): small enough for one or two blocks
EMULATED_LAYERS = {
    # an RGB layer of 32 channels (two chunks) over two images, 16-byte rows; and one of odd width (word copies)
    "rgb": ((2, 32, 5, 8), (32, 3, 4, 4), (2, 2), (1, 1), (0, 0), (1, 1)),
    "rgb_odd": ((1, 48, 5, 7), (48, 3, 4, 4), (2, 2), (1, 1), (0, 0), (1, 1)),
    # stride 1, eight output channels
    "eight_s1": ((1, 16, 9, 7), (16, 8, 3, 3), (1, 1), (1, 1), (0, 0), (1, 1)),
    # asymmetric stride, padding, output padding and dilation; 40 channels (a part-empty chunk); 16-byte rows
    "asym": ((1, 40, 4, 8), (40, 5, 5, 3), (3, 2), (2, 1), (1, 0), (1, 2)),
    # stride 4 past a 2 x 2 kernel: phases with no tap, bias alone
    "gaps": ((1, 20, 3, 2), (20, 2, 2, 2), (4, 4), (0, 0), (3, 1), (1, 1)),
    # 128 (tap, output channel) pairs: one-row tiles, sixteen n8 tiles a warp
    "wide": ((1, 16, 4, 5), (16, 8, 4, 4), (2, 2), (1, 1), (0, 0), (1, 1)),
}


# per-element bounds, times the sum of the terms' magnitudes: TF32's rounding; 3xTF32's dropped residual product
# and the tensor cores' truncating sums within a chunk
BOUND = {"tf32": 2 * TF32_EPS, "strict": 1e-5}


def _emulate(name: str, weight_cl: bool, precision: str, plant_inf: bool = False):
    """Runs the kernel in the C++ emulator (``mma.sync`` as the PTX manual lays out its fragments); returns its
    output, the float64 reference and the sum of the terms' magnitudes."""
    x_shape, w_shape, stride, padding, output_padding, dilation = EMULATED_LAYERS[name]
    kwargs = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation)
    g = _layer(x_shape, w_shape, **kwargs)
    rng = np.random.default_rng(len(name))
    x, w, b = (rng.standard_normal(shape).astype(np.float32) for shape in (x_shape, w_shape, (w_shape[1],)))
    if plant_inf:
        x[0, 1, 1, 2] = np.inf
    stored_w = np.ascontiguousarray(w.transpose(0, 2, 3, 1)) if weight_cl else w
    plan = thin_mma.plan_forward(g.with_weight_channels_last(weight_cl), "float32", True, precision)
    assert dict(plan.spec.constants)["VEC"] == (4 if x_shape[-1] % 4 == 0 else 1)
    y = np.full(g.output_shape, np.nan, dtype=np.float32)
    *_, y = cuda_emulator.run(plan, [x, stored_w, b, y], ["float"] * 4)
    ref_args = dict(kwargs, groups=1)
    want = reference.conv_transpose2d(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), **ref_args)
    magnitude = reference.conv_transpose2d(np.abs(x).astype(np.float64), np.abs(w).astype(np.float64),
                                           np.abs(b).astype(np.float64), **ref_args)
    return y, want, magnitude


@emulated
@pytest.mark.parametrize("name,weight_cl,precision", [
    ("rgb", False, "tf32"), ("rgb", True, "tf32"), ("rgb_odd", False, "tf32"), ("eight_s1", False, "tf32"),
    ("asym", True, "tf32"), ("gaps", False, "tf32"), ("wide", False, "tf32"),
    ("rgb", False, "strict"), ("rgb_odd", True, "strict"), ("eight_s1", False, "strict"), ("asym", True, "strict"),
    ("gaps", False, "strict"),
])
def test_the_emulated_kernel_matches_the_float64_reference(name, weight_cl, precision):
    """Each output within the precision's bound of the sum of its terms' magnitudes."""
    y, want, magnitude = _emulate(name, weight_cl, precision)
    assert np.isfinite(y).all(), "outputs left unwritten"
    bad = np.abs(y - want) > BOUND[precision] * magnitude
    assert not bad.any(), f"{int(bad.sum())} of {y.size} outputs off; worst {np.abs(y - want).max():.3e}"


@emulated
@pytest.mark.parametrize("precision", ["tf32", "strict"])
def test_an_infinite_input_reaches_the_outputs_it_feeds_as_torch_s_does(precision):
    """One +Inf input: the outputs its taps reach are infinite with the float64 reference's signs (3xTF32's cross
    products take a non-finite big part as zero, so no Inf meets a residual and turns NaN); the rest stay finite
    and within bound."""
    y, want, magnitude = _emulate("rgb", False, precision, plant_inf=True)
    infinite = np.isinf(want)
    assert infinite.any() and not np.isnan(want).any()
    assert np.array_equal(np.isinf(y), infinite) and not np.isnan(y).any()
    assert np.array_equal(np.sign(y[infinite]), np.sign(want[infinite]))
    finite = ~infinite
    assert (np.abs(y[finite] - want[finite]) <= BOUND[precision] * magnitude[finite]).all()
