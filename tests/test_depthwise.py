"""The depthwise family (no GPU): which layers it takes, what it plans, and its kernel run by the C++ emulator
against the float64 reference in fp16, bf16 and float32, both passes, runs of channels and single channels."""
from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator
from cupyconv import reference
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import depthwise, table
from cupyconv.plans.sequences import OneKernel
from cupyconv.tuning import Variant
from test_kernels_emulated import C_TYPE, _empty, _storage, _values


def _layer(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


DEPTHWISE_UP = _layer((16, 128, 64, 64), (128, 1, 4, 4), stride=2, padding=1, groups=128)


@pytest.mark.parametrize("x_shape,w_shape,kwargs,layout,eligible,why", [
    ((2, 128, 9, 7), (128, 1, 4, 4), dict(stride=2, padding=1, groups=128), "nhwc", True, "depthwise_up"),
    ((2, 128, 9, 7), (128, 1, 4, 4), dict(stride=2, padding=1, groups=128), "nchw", False, "NCHW: the tiled family"),
    ((2, 5, 9, 7), (5, 1, 3, 3), dict(groups=5), "nhwc", True, "five channels: single-channel runs"),
    ((2, 128, 9, 7), (128, 2, 4, 4), dict(stride=2, groups=128), "nhwc", False, "two output channels a group"),
    ((2, 128, 9, 7), (128, 1, 4, 4), dict(stride=2, groups=64), "nhwc", False, "two input channels a group"),
    ((2, 8, 9, 7), (8, 1, 8, 8), dict(groups=8), "nhwc", True, "64 taps"),
    ((2, 8, 9, 7), (8, 1, 9, 8), dict(groups=8), "nhwc", False, "72 taps: past MAX_TAPS"),
])
def test_eligibility(x_shape, w_shape, kwargs, layout, eligible, why):
    assert depthwise.eligible(_layer(x_shape, w_shape, **kwargs), "float16", layout) is eligible, why


def test_float64_and_nchw_stay_with_the_other_families():
    assert not depthwise.eligible(DEPTHWISE_UP, "float64", "nhwc")   # CUDA float64 runs NCHW
    with pytest.raises(ValueError, match="channels_last"):
        depthwise.FAMILY.plan("forward", Variant("depthwise"), DEPTHWISE_UP, "float16", "nchw", "strict", False, True,
                              132)


def test_the_table_puts_it_ahead_of_the_direct_kernels_which_race_it():
    for dtype in ("float16", "bfloat16", "float32"):
        for pass_ in ("forward", "grad_input"):
            names = [v.name for v in table.candidates(pass_, DEPTHWISE_UP, dtype, "nhwc", "tf32")]
            assert names[0] == "depthwise" and names[-1] == "direct", (dtype, pass_, names)
        assert [v.family for v in table.candidates("grad_weight", DEPTHWISE_UP, dtype, "nhwc")] == ["direct"]
        assert "depthwise" not in [v.family for v in table.candidates("forward", DEPTHWISE_UP, dtype, "nchw")]


@pytest.mark.parametrize("dtype,aligned,vec", [("float16", True, 4), ("bfloat16", True, 4), ("float32", True, 2),
                                               ("float16", False, 1)])
def test_the_forward_takes_8_byte_runs_of_channels_where_they_allow(dtype, aligned, vec):
    plan = depthwise.plan(DEPTHWISE_UP, dtype, "forward", True, aligned)
    constants = dict(plan.spec.constants)
    assert constants["VEC"] == vec
    assert plan.block[0] == constants["CV_BLOCK"] * constants["TILES_BLOCK"] <= depthwise.THREADS
    assert constants["ROWS"] % 2 == 0 and constants["COLS"] % 2 == 0   # whole stride periods
    assert depthwise.registers(DEPTHWISE_UP, dtype, constants["ROWS"], constants["COLS"], vec) \
        <= depthwise.register_budget(constants["MIN_BLOCKS"])
    # every (patch, channel run) gets a thread
    runs = 128 // vec
    tiles = 16 * (128 // constants["ROWS"]) * (128 // constants["COLS"])
    assert plan.grid[0] * constants["TILES_BLOCK"] >= tiles and plan.grid[1] * constants["CV_BLOCK"] >= runs
    odd = _layer((2, 5, 9, 7), (5, 1, 4, 4), stride=2, padding=1, groups=5)
    assert dict(depthwise.plan(odd, dtype, "forward").spec.constants)["VEC"] == 1   # 5 channels: no whole runs


def test_the_window_covers_every_fed_tap():
    """The planner's window (what the kernel's ``reach`` works out) spans every source offset a fed tap reads, and
    its first and last rows are read."""
    for k, s, p, d in ((4, 2, 1, 1), (3, 1, 1, 1), (3, 2, 1, 2), (5, 3, 2, 1), (2, 4, 0, 1), (4, 2, 3, 1)):
        g = _layer((1, 8, 6, 6), (8, 1, k, k), stride=s, padding=p, dilation=d, groups=8)
        for rows in (s, 2 * s):
            height, _ = depthwise.window(g, rows, s)
            offsets = {(a + p - kh * d) // s for a in range(rows) for kh in range(k) if (a + p - kh * d) % s == 0}
            assert max(offsets) - min(offsets) + 1 == height, (k, s, p, d, rows)


def test_forward_patches_are_whole_stride_periods():
    with pytest.raises(ValueError, match="stride periods"):
        depthwise.plan(DEPTHWISE_UP, "float16", "forward", tile=(3, 2, 8, 2))
    with pytest.raises(ValueError, match="8- or 16-byte run"):
        depthwise.plan(DEPTHWISE_UP, "float16", "forward", tile=(2, 2, 2, 2))
    plan = depthwise.FAMILY.plan("forward", Variant.parse("depthwise:2x4x2b3"), DEPTHWISE_UP, "float32", "nhwc",
                                 "strict", False, True, 132)
    assert isinstance(plan, OneKernel)
    constants = dict(plan.main.spec.constants)
    assert tuple(constants[k] for k in ("ROWS", "COLS", "VEC", "MIN_BLOCKS", "CV_BLOCK")) == (2, 4, 2, 3, 32)
    unaligned = depthwise.FAMILY.plan("forward", Variant.parse("depthwise:2x4x2b3"), DEPTHWISE_UP, "float32", "nhwc",
                                      "strict", False, False, 132)
    assert dict(unaligned.main.spec.constants)["VEC"] == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
def test_tiles_fit_their_register_budget_and_name_themselves(dtype, pass_):
    found = depthwise.tiles(DEPTHWISE_UP, dtype, pass_)
    assert len(set(found)) == len(found) >= 2
    item = {"float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    assert {vec * item for _, _, vec, _ in found} == {16, 8}
    for tile in found:
        rows, cols, vec, blocks = tile
        assert depthwise.registers(DEPTHWISE_UP, dtype, rows, cols, vec, pass_) <= depthwise.register_budget(blocks)
        assert depthwise.parse_tile(depthwise.tile_name(tile)) == tile
        assert Variant.parse("depthwise:" + depthwise.tile_name(tile)).kwargs["tile"] == depthwise.tile_name(tile)


def test_one_kernel_serves_both_weight_layouts():
    """A weight of one output channel a group lies the same in either layout."""
    plans = {depthwise.plan(DEPTHWISE_UP.with_weight_channels_last(cl), "float16", "forward").spec for cl in (0, 1)}
    assert len(plans) == 1 and not dict(plans.pop().constants)["WEIGHT_CL"]


def test_large_kernels_take_fewer_channel_runs_a_block():
    g = _layer((1, 512, 8, 8), (512, 1, 8, 8), groups=512)
    constants = dict(depthwise.plan(g, "float32", "grad_input", tile=(1, 1, 4, 2)).spec.constants)
    taps, acc_bytes = 64, 4
    assert taps * constants["CV_BLOCK"] * constants["VEC"] * acc_bytes <= depthwise.WEIGHT_SMEM


# ------------------------------------------------------------------------------------------ emulation

emulated = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ to emulate the kernels")
# per-element bounds, times the sum of the terms' magnitudes: fp32 sums (and a 16-bit result's rounding)
BOUND = {"float32": 2.0 ** -20, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
C_NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}

# (input shape, kernel, stride, padding, output_padding, dilation)
EMULATED_LAYERS = {
    # depthwise_up in small: 16 channels (two 16-bit runs), patches past the image edges
    "up": ((2, 16, 5, 6), (4, 4), (2, 2), (1, 1), (0, 0), (1, 1)),
    # asymmetric kernel, stride, padding, output padding and dilation; 12 channels (three fp32 runs)
    "asym": ((1, 12, 4, 7), (3, 5), (3, 2), (2, 1), (1, 0), (1, 2)),
    # five channels: a channel a thread
    "odd": ((2, 5, 3, 4), (3, 3), (1, 1), (1, 1), (0, 0), (1, 1)),
    # stride 4 past a 2 x 2 kernel: phases that no tap feeds hold the bias alone
    "gaps": ((1, 8, 3, 2), (2, 2), (4, 4), (0, 0), (3, 1), (1, 1)),
}


def _emulate(name: str, dtype: str, pass_: str, aligned: bool = True, weight_cl: bool = False, run8: bool = False,
             **wrong):
    """The kernel's destination in the emulator and the float64 reference and magnitudes; ``wrong``: kernel constants
    changed from the plan's (a deliberately wrong kernel)."""
    x_shape, kernel, stride, padding, output_padding, dilation = EMULATED_LAYERS[name]
    channels = x_shape[1]
    kwargs = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
                  groups=channels)
    g = _layer(x_shape, (channels, 1) + kernel, **kwargs).with_weight_channels_last(weight_cl)
    rng = np.random.default_rng(len(name) + len(dtype))
    x, w, b, go = (_storage(rng.standard_normal(shape), dtype)
                   for shape in (x_shape, g.weight_shape, (channels,), g.output_shape))
    to_nhwc = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1))   # noqa: E731
    stored_w = np.ascontiguousarray(w.transpose(0, 2, 3, 1)) if weight_cl else w
    tile = None
    if run8:   # the 8-byte runs' tile, which the heuristic does not take first
        tile = next(t for t in depthwise.tiles(g, dtype, pass_) if t[2] * np.dtype(C_NUMPY[dtype]).itemsize == 8)
    plan = depthwise.plan(g, dtype, pass_, pass_ == "forward", aligned, tile)
    if wrong:
        plan = cuda_emulator.respecialized(plan, **wrong)
    c_type = C_TYPE[dtype]
    ref_args = dict(kwargs, groups=channels)
    x64, w64, b64, go64 = (_values(a, dtype) for a in (x, w, b, go))
    if pass_ == "forward":
        out = to_nhwc(_empty(g.output_shape, dtype))
        *_, out = cuda_emulator.run(plan, [to_nhwc(x), stored_w, b, out], [c_type] * 4)
        want = reference.conv_transpose2d(x64, w64, b64, **ref_args)
        magnitude = reference.conv_transpose2d(np.abs(x64), np.abs(w64), np.abs(b64), **ref_args)
    else:
        out = to_nhwc(_empty(g.input_shape, dtype))
        *_, out = cuda_emulator.run(plan, [to_nhwc(go), stored_w, out], [c_type] * 3)
        want = reference.conv_transpose2d_backward(go64, x64, w64, **ref_args)[0]
        magnitude = reference.conv_transpose2d_backward(np.abs(go64), np.abs(x64), np.abs(w64), **ref_args)[0]
    return _values(out, dtype).transpose(0, 3, 1, 2), want, magnitude, plan


@emulated
@pytest.mark.parametrize("name,dtype,pass_,aligned,weight_cl,run8", [
    ("up", "float16", "forward", True, False, False), ("up", "bfloat16", "grad_input", True, True, False),
    ("up", "float32", "forward", False, False, False), ("asym", "float32", "forward", True, True, False),
    ("asym", "float32", "grad_input", True, False, False), ("asym", "float16", "forward", True, False, False),
    ("odd", "bfloat16", "forward", True, False, False), ("odd", "float16", "grad_input", True, False, False),
    ("gaps", "float16", "forward", True, False, False), ("gaps", "float32", "grad_input", True, False, False),
    ("up", "float16", "forward", True, False, True), ("up", "bfloat16", "grad_input", True, False, True),
    ("asym", "float32", "forward", True, False, True),
])
def test_the_emulated_kernel_matches_the_float64_reference(name, dtype, pass_, aligned, weight_cl, run8):
    """Every destination value written, each within the dtype's bound of the sum of its terms' magnitudes; 16- and
    8-byte channel runs."""
    ours, want, magnitude, plan = _emulate(name, dtype, pass_, aligned, weight_cl, run8)
    assert np.isfinite(ours).all(), "values left unwritten"
    bad = np.abs(ours - want) > BOUND[dtype] * np.maximum(magnitude, 1e-30)
    assert not bad.any(), f"{int(bad.sum())} of {ours.size} off; worst {np.abs(ours - want).max():.3e} ({plan.spec})"


@emulated
def test_a_wrong_tap_offset_shows():
    """The comparison can fail: the same kernel with its padding one off gives wrong values."""
    ours, want, magnitude, _ = _emulate("up", "float32", "forward", PH=0)
    assert (np.abs(ours - want) > BOUND["float32"] * magnitude).any()
