"""The direct kernels, run on the CPU through the C++ emulation, against the float64 reference.

No GPU is needed, so CI checks what the planners choose and what the kernels compute
(index arithmetic, weight staging in chunks, shared register windows, warp-staged
stores, the split-K reductions and the fp16/bf16 conversions) in every dtype.  See
``cuda_emulator``.
"""
from __future__ import annotations

import dataclasses
import random
import re

import numpy as np
import pytest

from cupyconv import reference
from cupyconv.jit import templates
from cupyconv.plans import direct, gemm, reduction
from cupyconv.core.geometry import ConvParams, geometry

import cuda_emulator
from layers import random_layer

pytestmark = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ to emulate the kernels")

# (input shape, weight shape, layer arguments): between them they reach every tiling
# branch of the direct planners.
LAYERS = {
    # the seed layer's shape in miniature: grouped, dilated, strides 2 x 3, an empty phase
    "grouped_dilated": ((2, 8, 5, 7), (8, 4, 3, 5), dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4)),
    # depthwise, every phase full, enough rows for several grad_weight chunks
    "depthwise": ((4, 4, 200, 9), (4, 1, 4, 4), dict(stride=2, padding=1, groups=4)),
    # 40 input channels staged in chunks, 6-channel output blocks, grad_output windows too wide to share
    "chunked_weights": ((1, 40, 4, 6), (40, 6, 2, 9), dict(stride=(1, 2), padding=(2, 4), dilation=(1, 3))),
    # stride 17 x 18: forward runs too long to stage, so plain stores
    "long_stride": ((2, 3, 3, 4), (3, 2, 3, 2), dict(stride=(17, 18), padding=(1, 2), output_padding=(5, 3))),
    # a warp's cells span several rows; output_padding; bias on 5 channels
    "narrow_rows": ((1, 2, 7, 3), (2, 5, 2, 3), dict(stride=(3, 2), padding=(0, 1), output_padding=(2, 1))),
}
CASES = [(name, "float64") for name in LAYERS] + [
    ("grouped_dilated", "float32"), ("chunked_weights", "float32"),
    ("grouped_dilated", "float16"), ("depthwise", "float16"),
    ("grouped_dilated", "bfloat16"), ("narrow_rows", "bfloat16"),
]
# Relative to max|reference|, as in the GPU sweep; the reference sees the same rounded inputs.
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
C_TYPE = {"float32": "float", "float64": "double", "float16": "half_t", "bfloat16": "bf16_t"}
ACC_TYPE = {"float32": "float", "float64": "double", "float16": "float", "bfloat16": "float"}
ACC_DTYPE = {"float": np.float32, "double": np.float64}


def _storage(a, dtype):
    """float64 values rounded to ``dtype``, as the kernels' buffers hold them (bfloat16 as its bits)."""
    if dtype != "bfloat16":
        return a.astype(dtype)
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _values(a, dtype):
    """The float64 values a buffer of ``dtype`` holds."""
    if dtype != "bfloat16":
        return a.astype(np.float64)
    return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _empty(shape, dtype):
    return _storage(np.full(shape, np.nan), dtype)


# A seeded sweep of small random layers on top, as the GPU sweep draws them (batched here).
RANDOM_LAYERS = {}
_rng = random.Random(20261126)
for _i in range(12):
    _l = random_layer(_rng, "float64", max_size=8)
    RANDOM_LAYERS[f"random{_i}"] = ((_l.batch or 1,) + _l.input_shape[-3:], _l.weight_shape, _l.kwargs())
LAYERS.update(RANDOM_LAYERS)
CASES += [(name, ("float64", "float32", "float16", "bfloat16")[i % 4]) for i, name in enumerate(RANDOM_LAYERS)]


def _layer(name):
    x_shape, w_shape, kwargs = LAYERS[name]
    params = ConvParams.from_args(**kwargs)
    g = geometry(x_shape, w_shape, (w_shape[1] * params.groups,), params)
    args = dict(stride=params.stride, padding=params.padding, output_padding=params.output_padding,
                groups=params.groups, dilation=params.dilation)
    return g, args


def _data(g, dtype, seed):
    """Input, weight, bias and grad_output in ``dtype``'s storage."""
    rng = np.random.default_rng(seed)
    return tuple(_storage(rng.standard_normal(shape), dtype)
                 for shape in (g.input_shape, g.weight_shape, (g.out_channels,), g.output_shape))


def _close(actual, expected, tol, what, dtype):
    scale = np.abs(expected).max()
    err = np.abs(_values(actual, dtype) - expected).max()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} * {scale:.3e}"


def _split_k(partial_plan, reduce_plan, inputs, out_shape, dtype):
    ctype, acc = C_TYPE[dtype], ACC_TYPE[dtype]
    chunks = partial_plan.grid[0]
    if reduce_plan is None:  # one chunk writes the result itself
        assert chunks == 1 and partial_plan.scratch_bytes == 0
        *_, out = cuda_emulator.run(partial_plan, list(inputs) + [_empty(out_shape, dtype)], [ctype] * (len(inputs) + 1))
        return out, chunks
    partials = np.full(chunks * int(np.prod(out_shape)), np.nan, ACC_DTYPE[acc])
    *_, partials = cuda_emulator.run(partial_plan, list(inputs) + [partials], [ctype] * len(inputs) + [acc])
    _, out = cuda_emulator.run(reduce_plan, [partials, _empty(out_shape, dtype)], [acc, ctype])
    return out, chunks


def _nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def _nchw(a):
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("name,dtype", CASES)
def test_direct_kernels_match_the_reference(name, dtype, layout):
    g, args = _layer(name)
    x, w, b, go = _data(g, dtype, seed=len(name))
    x64, w64, b64, go64 = (_values(a, dtype) for a in (x, w, b, go))
    ctype, tol = C_TYPE[dtype], TOLERANCE[dtype]
    to_layout, from_layout = (_nhwc, _nchw) if layout == "nhwc" else (np.ascontiguousarray,) * 2
    xl, gol = to_layout(x), to_layout(go)

    *_, y = cuda_emulator.run(direct.plan_forward(g, dtype, True, layout),
                              [xl, w, b, to_layout(_empty(g.output_shape, dtype))], [ctype] * 4)
    _close(from_layout(y), reference.conv_transpose2d(x64, w64, b64, **args), tol, f"{name} {layout} forward", dtype)

    want_gi, want_gw, want_gb = reference.conv_transpose2d_backward(go64, x64, w64, **args)
    *_, gi = cuda_emulator.run(direct.plan_grad_input(g, dtype, layout),
                               [gol, w, to_layout(_empty(g.input_shape, dtype))], [ctype] * 3)
    _close(from_layout(gi), want_gi, tol, f"{name} {layout} grad_input", dtype)

    gw, _ = _split_k(*direct.plan_grad_weight(g, dtype, 4, layout), (xl, gol), g.weight_shape, dtype)
    _close(gw, want_gw, tol, f"{name} {layout} grad_weight", dtype)
    gb, _ = _split_k(*reduction.plan_grad_bias(g, dtype, 4, layout), (gol,), (g.out_channels,), dtype)
    _close(gb, want_gb, tol, f"{name} {layout} grad_bias", dtype)


# A block beside the ones the tuner races: kernel rows (and NCHW output channels) that leave a remainder.
UNEVEN_GRAD_WEIGHT_BLOCKS = {"nchw": [(2, 3, 2)], "nhwc": [(2, 1, 2)]}


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_grad_weight_thread_blocks_match_the_reference(layout):
    """Every grad_weight block the tuner may race on a grouped layer, and an uneven one, gives the reference's
    gradient."""
    g, args = _layer("grouped_dilated")
    dtype = "float32"
    blocks = direct.grad_weight_blocks(g, dtype, layout)
    assert len(blocks) > 1
    x, w, b, go = _data(g, dtype, seed=7)
    want = reference.conv_transpose2d_backward(*(_values(a, dtype) for a in (go, x, w)), **args)[1]
    to_layout = _nhwc if layout == "nhwc" else np.ascontiguousarray
    for block in blocks[1:] + UNEVEN_GRAD_WEIGHT_BLOCKS[layout]:
        plans = direct.plan_grad_weight(g, dtype, 4, layout, block)
        gw, _ = _split_k(*plans, (to_layout(x), to_layout(go)), g.weight_shape, dtype)
        _close(gw, want, TOLERANCE[dtype], f"{layout} grad_weight block {block}", dtype)


# Blocks beside the ones the tuner races: input channels that leave a remainder (NCHW), and pixels a row does not
# divide.
UNEVEN_GRAD_INPUT_BLOCKS = {"nchw": [(3, 3)], "nhwc": [(1, 3)]}
# Eight input and output channels a group: both layouts race blocks of more channels and pixels, and channels_last
# fp16 reads grad_output in 16-byte runs of eight channels; dilated columns.
GRAD_INPUT_BLOCK_LAYER = ((2, 16, 5, 19), (16, 8, 3, 3), dict(stride=(2, 1), padding=1, dilation=(1, 2), groups=2))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_grad_input_thread_blocks_match_the_reference(layout, monkeypatch):
    """Every grad_input block the tuner may race on a grouped layer, and an uneven one, gives the reference's
    gradient."""
    monkeypatch.setitem(LAYERS, "grad_input_blocks", GRAD_INPUT_BLOCK_LAYER)
    g, args = _layer("grad_input_blocks")
    dtype = "float16"
    blocks = direct.grad_input_blocks(g, dtype, layout)
    assert len(blocks) > 1
    x, w, b, go = _data(g, dtype, seed=11)
    want = reference.conv_transpose2d_backward(*(_values(a, dtype) for a in (go, x, w)), **args)[0]
    to_layout, from_layout = (_nhwc, _nchw) if layout == "nhwc" else (np.ascontiguousarray,) * 2
    for block in blocks[1:] + UNEVEN_GRAD_INPUT_BLOCKS[layout]:
        plan = direct.plan_grad_input(g, dtype, layout, block)
        *_, gi = cuda_emulator.run(plan, [to_layout(go), w, to_layout(_empty(g.input_shape, dtype))], ["half_t"] * 3)
        _close(from_layout(gi), want, TOLERANCE[dtype], f"{layout} grad_input block {block}", dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_nhwc_grad_input_reads_runs_of_channels_staged_in_chunks(dtype, monkeypatch):
    """32 output channels whose 5 x 5 weights are staged a chunk at a time (fp32: 12, three runs of four; fp16: 8,
    one run of eight), read in 16-byte runs; and the same layer read a channel at a time."""
    monkeypatch.setitem(LAYERS, "runs_in_chunks", ((1, 32, 3, 4), (32, 32, 5, 5), dict(stride=2, padding=1)))
    g, args = _layer("runs_in_chunks")
    x, w, b, go = _data(g, dtype, seed=3)
    want = reference.conv_transpose2d_backward(*(_values(a, dtype) for a in (go, x, w)), **args)[0]
    for aligned in (True, False):
        plan = direct.plan_grad_input(g, dtype, "nhwc", aligned=aligned)
        constants = dict(plan.spec.constants)
        assert constants["OC_VEC"] == ((16 // np.dtype(dtype).itemsize) if aligned else 1)
        assert constants["OC_CHUNK"] < 32
        *_, gi = cuda_emulator.run(plan, [_nhwc(go), w, _nhwc(_empty(g.input_shape, dtype))], [C_TYPE[dtype]] * 3)
        _close(_nchw(gi), want, TOLERANCE[dtype], f"grad_input, runs {constants['OC_VEC']}", dtype)


def test_the_layers_reach_the_planners_branches():
    def constants(name, plan):
        g, _ = _layer(name)
        return dict(plan(g).spec.constants)

    assert constants("long_stride", lambda g: direct.plan_forward(g, "float64", True))["STAGE_STORES"] is False
    assert constants("grouped_dilated", lambda g: direct.plan_forward(g, "float64", True))["STAGE_STORES"] is True
    chunked = constants("chunked_weights", lambda g: direct.plan_forward(g, "float64", True))
    assert chunked["IC_CHUNK"] < 40 and chunked["OC_BLOCK"] == 6
    assert constants("chunked_weights", lambda g: direct.plan_grad_weight(g, "float64", 4)[0])["CELLS"] == 1
    depthwise, _ = _layer("depthwise")
    assert direct.plan_grad_weight(depthwise, "float64", 4)[0].grid[0] > 1  # several split-K chunks
    kh_blocks = {direct.plan_grad_weight(_layer(n)[0], "float64", 4)[0].grid[2] for n in LAYERS}
    assert max(kh_blocks) > 1
    # both ends of each split-K pass run here: one chunk written directly, and chunks with their reduce
    for layout in ("nchw", "nhwc"):
        for planner in (lambda g: direct.plan_grad_weight(g, "float64", 4, layout),
                        lambda g: reduction.plan_grad_bias(g, "float64", 4, layout)):
            reduces = {planner(_layer(n)[0])[1] is None for n in LAYERS}
            assert reduces == {True, False}, layout


def test_a_wrong_kernel_is_caught(monkeypatch):
    """The emulation is a real check: a kernel that drops one tap no longer matches."""
    g, args = _layer("grouped_dilated")
    x, w, b, _ = _data(g, "float64", seed=1)
    broken = cuda_emulator.respecialized(direct.plan_forward(g, "float64", True), KW=4)
    *_, y = cuda_emulator.run(broken, [x, w, b, _empty(g.output_shape, "float64")], ["double"] * 4)
    with pytest.raises(AssertionError, match="max error"):
        _close(y, reference.conv_transpose2d(x, w, b, **args), TOLERANCE["float64"], "broken forward", "float64")


def test_the_emulation_replaces_every_ptx_conversion_of_the_common_header():
    """Every conversion the emulation compiles has its C++ equivalent; those of sm_80 and later (paired and bf16
    conversions) sit behind __CUDA_ARCH__, which the emulation leaves undefined, and only the GPU tests run them."""
    header = templates.expanded("common.cuh")
    guarded = re.compile(r"#if defined\(__CUDA_ARCH__\) && __CUDA_ARCH__ >= 800\n.*?#(?:else|endif)", re.S)
    assert len(guarded.findall(header)) >= 2 and "cvt.rn.f16x2.f32" in header
    emulated = guarded.sub("", header)
    assert emulated.count("asm(") == len(cuda_emulator._PTX_EQUIVALENTS)
    assert all(ptx in emulated for ptx in cuda_emulator._PTX_EQUIVALENTS)


@pytest.mark.parametrize("name,dtype", [("depthwise", "float32"), ("grouped_dilated", "float16")])
def test_nhwc_blocks_walking_several_images(name, dtype, monkeypatch):
    """Weights staged once per channel tile serve every image a block walks (blockIdx.z < batch)."""
    monkeypatch.setattr(direct, "_BLOCKS_TO_FILL", 1)
    g, args = _layer(name)
    x, w, b, go = _data(g, dtype, seed=7)
    x64, w64, b64, go64 = (_values(a, dtype) for a in (x, w, b, go))
    ctype, tol = C_TYPE[dtype], TOLERANCE[dtype]
    fwd = direct._plan_forward_nhwc(g, dtype, True)
    gi_plan = direct._plan_grad_input_nhwc(g, dtype, *direct._grad_input_block(g, dtype, "nhwc"),
                                           direct.channel_runs(g, dtype, True))
    assert fwd.grid[2] < g.batch and gi_plan.grid[2] < g.batch
    *_, y = cuda_emulator.run(fwd, [_nhwc(x), w, b, _nhwc(_empty(g.output_shape, dtype))], [ctype] * 4)
    _close(_nchw(y), reference.conv_transpose2d(x64, w64, b64, **args), tol, f"{name} forward", dtype)
    *_, gi = cuda_emulator.run(gi_plan, [_nhwc(go), w, _nhwc(_empty(g.input_shape, dtype))], [ctype] * 3)
    want_gi = reference.conv_transpose2d_backward(go64, x64, w64, **args)[0]
    _close(_nchw(gi), want_gi, tol, f"{name} grad_input", dtype)


# (output shape N, C, H, W; layout; SM count): between them, grad_bias's 16-byte runs and single values, one chunk
# and many (the wide reduce at 256 and 1024 threads), channel tiles past 256, planes whose width is not a whole
# number of runs, and steps of a block that cross several images' planes.
GRAD_BIAS_CASES = [
    ((3, 24, 5, 9), "nhwc", 4),      # 24 channels: three 16-bit runs, six fp32, twelve fp64; 45 lanes of pixels
    ((2, 264, 7, 5), "nhwc", 4),     # a second channel tile of 8 channels
    ((270, 8, 31, 33), "nhwc", 132),  # one run of 8 channels across 256 lanes (fp16), 68 chunks
    ((2, 5, 9, 7), "nhwc", 4),       # 5 channels: one value at a time
    ((5, 3, 4, 6), "nchw", 4),       # planes of 24 values whose rows of 6 are not whole runs
    ((256, 2, 12, 12), "nchw", 132),  # 144-value planes: a block's step crosses many images; two chunks
    ((2, 4, 5, 7), "nchw", 4),       # planes of 35 values: one value at a time
]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape, layout, sm_count, aligned",
                         [case + (True,) for case in GRAD_BIAS_CASES]
                         + [case + (False,) for case in GRAD_BIAS_CASES if case[0] in ((3, 24, 5, 9), (5, 3, 4, 6))])
def test_grad_bias_sums_every_channel_in_runs_or_values(shape, layout, sm_count, aligned, dtype):
    """grad_output unaligned (an offset view, say) reads one value at a time where runs would have fit."""
    n, c, h, w = shape
    g = geometry((n, c, h, w), (c, c, 1, 1), None, ConvParams.from_args())
    partial, reduce = reduction.plan_grad_bias(g, dtype, sm_count, layout, aligned)
    constants = dict(partial.spec.constants)
    vec = 16 // {"float64": 8, "float32": 4}.get(dtype, 2)
    whole = c % vec == 0 if layout == "nhwc" else (h * w) % vec == 0
    assert constants["VEC"] == (vec if aligned and whole else 1)
    assert (reduce is None) == (partial.grid[0] == 1)
    if reduce is not None:
        assert reduce.block[0] == (1024 if partial.grid[0] > 64 else 256)
    go = _storage(np.random.default_rng(c * h).standard_normal(shape), dtype)
    gb, chunks = _split_k(partial, reduce, ((_nhwc(go) if layout == "nhwc" else go),), (c,), dtype)
    _close(gb, _values(go, dtype).sum(axis=(0, 2, 3)), TOLERANCE[dtype], f"grad_bias {shape} {layout}", dtype)


def test_grad_bias_cases_reach_every_branch():
    seen = set()
    for shape, layout, sm_count in GRAD_BIAS_CASES:
        g = geometry(shape, (shape[1], shape[1], 1, 1), None, ConvParams.from_args())
        partial, reduce = reduction.plan_grad_bias(g, "float16", sm_count, layout)
        seen.add((layout, dict(partial.spec.constants)["VEC"] > 1, None if reduce is None else reduce.block[0]))
    assert {(layout, runs) for layout, runs, _ in seen} == {(l, r) for l in ("nchw", "nhwc") for r in (True, False)}
    assert {block for *_, block in seen} == {None, 256, 1024}


TAP_MAJOR_CASES = [(64 * 48, 16, 3), (37, 9, 1), (70, 49, 2), (5, 1, 4), (1100, 9, 6), (4 * 53, 49, 5), (8, 81, 1)]


@pytest.fixture
def longer_reduce_runs(monkeypatch):
    """The reduces plan their longer runs for any grid (the emulated layers are too small to earn them)."""
    monkeypatch.setattr(reduction, "_REDUCE_BLOCKS", 0)
    plans = (reduction.plan_tap_major_reduce, reduction.plan_reduce, reduction.plan_reduce_with_bias)
    for plan in plans:
        plan.cache_clear()
    yield
    for plan in plans:
        plan.cache_clear()


# Each case in bf16 with the tile its plan takes and with the larger one, and in fp32 and fp16 on a few (each
# emulated program costs the CPU suite about a second to build).
TAP_MAJOR_RUNS = ([(case, "bfloat16", tiles) for case in TAP_MAJOR_CASES for tiles in ("planned", "large")]
                  + [(TAP_MAJOR_CASES[i], dtype, "planned") for i, dtype in ((0, "float32"), (1, "float16"),
                                                                             (4, "float32"), (5, "float16"))])


@pytest.mark.parametrize("case, dtype, tiles", TAP_MAJOR_RUNS)
def test_tap_major_reduce_adds_chunks_in_order_and_moves_taps_last(case, dtype, tiles, request):
    """grad_weight's wgmma partials are [chunk][tap][row]; the reduce writes [row][tap], the chunks added in
    order in fp32 and rounded once: 16-byte and single rows, both tile sizes, ragged row tiles, taps split over
    two and three tiles, more chunks than a thread's loads in flight, one chunk, one tap."""
    rows, taps, chunks = case
    if tiles == "large":
        request.getfixturevalue("longer_reduce_runs")
    plan = reduction.plan_tap_major_reduce(dtype, rows, taps, chunks, "int")
    if tiles == "large":
        assert dict(plan.spec.constants)["RUNS"] == 1024
    partials = np.random.default_rng(rows + taps).standard_normal((chunks, taps, rows)).astype(np.float32)
    _, out = cuda_emulator.run(plan, [partials.ravel(), _empty(rows * taps, dtype)], ["float", C_TYPE[dtype]])
    total = partials[0].copy()
    for c in range(1, chunks):
        total += partials[c]   # fp32, in chunk order, as the kernel adds them
    expected = _values(_storage(total.T.astype(np.float64), dtype), dtype).ravel()
    np.testing.assert_array_equal(_values(out, dtype), expected)


@pytest.mark.parametrize("rows, taps, chunks", TAP_MAJOR_CASES + [(1024 * 512, 16, 1), (256 * 128, 16, 9),
                                                                 (64 * 64, 16, 64), (1024 * 512, 9, 2)])
def test_tap_major_reduce_takes_the_larger_tile_where_it_leaves_enough_blocks(rows, taps, chunks):
    plan = reduction.plan_tap_major_reduce("float16", rows, taps, chunks, "int")
    constants = dict(plan.spec.constants)
    vec = constants["VEC"]
    assert vec == (4 if rows % 4 == 0 else 1) and constants["CHUNKS_AT_ONCE"] == (1 if chunks == 1 else 4)
    tap_tile, large_rows = reduction.tap_major_tile(taps, vec, 1024)
    large = -(-rows // large_rows) * -(-taps // tap_tile) >= reduction._REDUCE_BLOCKS
    assert constants["RUNS"] == (1024 if large else 256)
    tap_tile, row_tile = reduction.tap_major_tile(taps, vec, constants["RUNS"])
    assert plan.grid == (-(-rows // row_tile), -(-taps // tap_tile), 1)
    runs_a_tap = row_tile // vec
    assert tap_tile <= 32 and tap_tile * (runs_a_tap - 1) < constants["RUNS"] <= tap_tile * runs_a_tap


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("elements", [1024 * 512 * 16, 256 * 256 * 4, 256 * 256 * 4 - 4, 256 * 256 * 4 + 2, 1000])
def test_split_k_reduce_takes_runs_of_four_where_they_fill_the_blocks(elements, dtype):
    plan = reduction.plan_reduce(dtype, elements, 3, "int")
    runs = dtype != "float64" and elements % 4 == 0 and elements // 4 >= reduction._REDUCE_BLOCKS * 256
    vec = 4 if runs else 1
    assert dict(plan.spec.constants)["VEC"] == vec
    assert plan.grid == (min(-(-elements // vec // 256), 8192), 1, 1) and plan.block == (256, 1, 1)
    assert runs == (dtype != "float64" and elements in (1024 * 512 * 16, 256 * 256 * 4))


def test_tap_major_cases_reach_every_tile_shape():
    """The emulated cases take 16-byte and single-row loads, one to three tap tiles, ragged last tiles of rows
    and of taps, and one chunk, a partial set of four and several sets (the larger tiles are forced on them)."""
    seen = set()
    for rows, taps, chunks in TAP_MAJOR_CASES:
        plan = reduction.plan_tap_major_reduce("float16", rows, taps, chunks, "int")
        constants = dict(plan.spec.constants)
        tap_tile, row_tile = reduction.tap_major_tile(taps, constants["VEC"], constants["RUNS"])
        seen.update({("vec", constants["VEC"]), ("tap tiles", plan.grid[1]), ("ragged rows", rows % row_tile != 0),
                     ("ragged taps", taps % tap_tile != 0),
                     ("chunks", "one" if chunks == 1 else "under four" if chunks < 4 else "over four")})
    assert seen >= {("vec", 1), ("vec", 4), ("tap tiles", 1), ("tap tiles", 2), ("tap tiles", 3),
                    ("ragged rows", True), ("ragged taps", True), ("chunks", "one"), ("chunks", "under four"),
                    ("chunks", "over four")}


@pytest.mark.parametrize("elements, chunks, dtype", [(1000, 3, "float32"), (1000, 3, "float16"), (1000, 3, "bfloat16"),
                                                    (1000, 3, "float64"), (1001, 6, "float32"), (1001, 6, "bfloat16"),
                                                    (2052, 5, "bfloat16"), (4, 1, "float32")])
def test_split_k_reduce_adds_chunks_in_order(elements, chunks, dtype, request):
    """The reduce that finishes a split-K pass: each element's chunks added in order and rounded once, four
    elements a thread where their count is a multiple of four and they sum in fp32 (runs from every chunk in
    flight at once), else one."""
    acc = ACC_TYPE[dtype]
    request.getfixturevalue("longer_reduce_runs")
    plan = reduction.plan_reduce(dtype, elements, chunks, "int")
    assert dict(plan.spec.constants)["VEC"] == (4 if elements % 4 == 0 and acc == "float" else 1)
    partials = np.random.default_rng(elements + chunks).standard_normal((chunks, elements)).astype(ACC_DTYPE[acc])
    _, out = cuda_emulator.run(plan, [partials.ravel(), _empty(elements, dtype)], [acc, C_TYPE[dtype]])
    total = partials[0].copy()
    for c in range(1, chunks):
        total += partials[c]
    np.testing.assert_array_equal(_values(out, dtype), _values(_storage(total.astype(np.float64), dtype), dtype))


@pytest.mark.parametrize("runs", [False, True], ids=["single", "runs"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_split_gemm_reduce_adds_chunks_in_order_then_each_channels_bias(layout, dtype, runs, request):
    """The split GEMMs' partials are [chunk][destination element] in the destination's layout; the reduce adds
    the chunks in order in fp32, then the bias of the element's channel, and rounds once: one element a thread,
    or runs of four whose elements' channels differ (channels_last, five channels) or whose run crosses from one
    channel's plane to the next (NCHW, planes of 7 x 2)."""
    n, c, h, w, chunks = (4, 5, 2, 7, 3) if runs else (3, 5, 4, 7, 3)
    plane = h * w
    stride = 1 if layout == "nhwc" else plane
    if runs:
        request.getfixturevalue("longer_reduce_runs")
    plan = reduction.plan_reduce_with_bias(dtype, n * c * plane, chunks, c, stride, "int")
    assert dict(plan.spec.constants)["VEC"] == (4 if runs else 1)
    rng = np.random.default_rng(c + chunks)
    partials = rng.standard_normal((chunks, n * c * plane)).astype(np.float32)
    bias = _storage(rng.standard_normal(c), dtype)
    _, _, out = cuda_emulator.run(plan, [partials.ravel(), bias, _empty(n * c * plane, dtype)],
                                  ["float", C_TYPE[dtype], C_TYPE[dtype]])
    total = partials[0].copy()
    for k in range(1, chunks):
        total += partials[k]
    shape = (n, h, w, c) if layout == "nhwc" else (n, c, h, w)
    channel = np.indices(shape)[3 if layout == "nhwc" else 1].ravel()
    total += _values(bias, dtype).astype(np.float32)[channel]
    expected = _values(_storage(total.astype(np.float64), dtype), dtype)
    np.testing.assert_array_equal(_values(out, dtype), expected)


def _tf32_nearest_away(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 mantissa bits, fp32's exponent range) to nearest, ties away from
    zero, computed in float64 from each value's exponent: what cvt.rna.tf32.f32 gives."""
    v = values.astype(np.float64)
    out = v.copy()
    finite = np.isfinite(v) & (v != 0)
    _, exponent = np.frexp(np.abs(v[finite]))            # |v| = m * 2**exponent, m in [0.5, 1)
    ulp = np.exp2(np.maximum(exponent - 1, -126) - 10)   # subnormals keep the smallest normal's unit
    out[finite] = np.sign(v[finite]) * np.floor(np.abs(v[finite]) / ulp + 0.5) * ulp
    with np.errstate(over="ignore"):
        return out.astype(np.float32)                    # past the largest value: Inf, as the hardware rounds


def test_weight_packed_for_tf32_wgmma_is_rounded_to_nearest():
    """The wgmma kernels read TF32 operands unrounded from shared memory, so pack_weight rounds them: ties away
    from zero, subnormals, the largest finite value (to Inf), Inf and NaN among random values; only the values
    change, not where they go."""
    from cupyconv.plans import gemm

    g = geometry((1, 24, 3, 3), (24, 20, 3, 2), None, ConvParams.from_args(stride=2))
    rng = np.random.default_rng(7)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    special = np.array([1 + 2 ** -11, -(1 + 2 ** -11), 1 + 3 * 2 ** -11, 1 + 2 ** -11 - 2 ** -23, 2 ** -140,
                        -3 * 2 ** -137, np.finfo(np.float32).max, np.inf, -np.inf, np.nan], np.float32)
    w.ravel()[:special.size] = special
    bits = w.view(np.uint32)
    for mode in (0, 1):
        outs = []
        for round_tf32 in (False, True):
            plan = gemm.plan_pack_weight_padded(g, "float32", mode, 32, 32, (32, 8), round_tf32=round_tf32)
            packed = np.zeros(plan.scratch_bytes // 4, np.uint32)
            _, packed = cuda_emulator.run(plan, [bits, packed], ["unsigned int"] * 2)
            outs.append(packed.view(np.float32))
        plain, rounded = outs
        assert np.isin(special[:-1], plain).all(), "the special values are packed"
        np.testing.assert_array_equal(rounded, _tf32_nearest_away(plain))
        assert np.isinf(rounded[plain == np.finfo(np.float32).max]).all()
        assert (rounded[plain == np.float32(1 + 2 ** -11)] == np.float32(1 + 2 ** -10)).all(), "a tie, away"
    with pytest.raises(ValueError, match="float32"):
        gemm.plan_pack_weight_padded(g, "float16", 0, 32, 32, (32, 16), round_tf32=True)


def test_weight_split_for_3xtf32_wgmma_into_big_and_small_parts():
    """Strict float32's wgmma kernels read the weight as TF32 parts: each packed tile, then its residuals right
    after it.  The big part is the nearest TF32 value (truncated where that would overflow), the small one the
    rest rounded to TF32, together within 2^-21 of a normal value; Inf and NaN ride in the small part alone."""
    from cupyconv.plans import gemm

    g = geometry((1, 24, 3, 3), (24, 20, 3, 2), None, ConvParams.from_args(stride=2))
    rng = np.random.default_rng(11)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    special = np.array([1 + 2 ** -11, 1 + 2 ** -11 - 2 ** -23, -3 * 2 ** -137, np.finfo(np.float32).max, 0.0,
                        np.inf, -np.inf, np.nan], np.float32)
    w.ravel()[:special.size] = special
    tile = (32, 8)
    for mode in (0, 1):
        plain_plan = gemm.plan_pack_weight_padded(g, "float32", mode, 32, 32, tile)
        split_plan = gemm.plan_pack_weight_padded(g, "float32", mode, 32, 32, tile, split_tf32=True)
        assert split_plan.scratch_bytes == 2 * plain_plan.scratch_bytes
        _, plain = cuda_emulator.run(plain_plan, [w.view(np.uint32), np.zeros(plain_plan.scratch_bytes // 4,
                                                                             np.uint32)], ["unsigned int"] * 2)
        _, split = cuda_emulator.run(split_plan, [w.view(np.uint32), np.zeros(split_plan.scratch_bytes // 4,
                                                                             np.uint32)], ["unsigned int"] * 2)
        plain = plain.view(np.float32).reshape(-1, tile[0] * tile[1])      # one row per (n tile, chunk, tap)
        parts = split.view(np.float32).reshape(-1, 2, tile[0] * tile[1])
        big, small = parts[:, 0], parts[:, 1]
        finite = np.isfinite(plain)
        rounded = _tf32_nearest_away(plain)
        overflow = finite & ~np.isfinite(rounded)
        assert overflow.sum() == 1, "the largest float32 rounds past TF32's range"
        np.testing.assert_array_equal(big[finite & ~overflow], rounded[finite & ~overflow])
        np.testing.assert_array_equal(big[overflow], (plain[overflow].view(np.uint32) & 0xFFFFE000).view(np.float32))
        np.testing.assert_array_equal(small[finite], _tf32_nearest_away(plain[finite] - big[finite]))
        # subnormal residuals fall below TF32's smallest unit; normal values split within 2^-21
        normal = finite & (np.abs(plain) >= 2.0 ** -100)
        total = big[normal].astype(np.float64) + small[normal]
        assert (np.abs(total - plain[normal]) <= 2.0 ** -21 * np.abs(plain[normal])).all()
        assert (big[~finite] == 0).all()
        np.testing.assert_array_equal(small[~finite].view(np.uint32), plain[~finite].view(np.uint32))
    with pytest.raises(ValueError, match="tile by tile"):
        gemm.plan_pack_weight_padded(g, "float32", 0, 32, 32, split_tf32=True)
    with pytest.raises(ValueError, match="float32"):
        gemm.plan_pack_weight_padded(g, "float16", 0, 32, 32, (32, 16), split_tf32=True)


@pytest.mark.parametrize("split", [False, True], ids=["tf32", "3xtf32"])
@pytest.mark.parametrize("layout, aligned", [("nchw", True), ("nhwc", False), ("nhwc", True)],
                         ids=["nchw", "nhwc", "nhwc-aligned"])
@pytest.mark.parametrize("x_shape, w_shape, kwargs", [
    # a batch of 6 (a ragged image group), channels and pixels past whole 32-wide tiles
    ((6, 40, 5, 7), (40, 33, 4, 4), dict(stride=2, padding=1)),
    # the same in channels of whole fours
    ((6, 40, 5, 7), (40, 36, 4, 4), dict(stride=2, padding=1)),
    # one image, one pixel
    ((1, 16, 1, 1), (16, 24, 2, 2), dict(stride=2)),
])
def test_sources_packed_into_image_quads_for_tf32_grad_weight(x_shape, w_shape, kwargs, layout, aligned, split):
    """x and grad_output in one launch, each as [n / 4][pixel][channel][n % 4], rounded to TF32 as cvt.rna
    rounds, the images past the batch zero, grad_output's copy from the aligned offset the plan gives; split
    (3xTF32), each copy the big parts and then their residuals (as pack_weight splits the weight).  Aligned
    channels_last sources of whole four-channel runs take the 16-byte runs (VEC4), others the tiles."""
    from cupyconv.plans import wgmma

    g = geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))
    plan, (x_bytes, go_bytes) = wgmma.plan_to_image_quads(g, layout, split, aligned)
    vec4 = layout == "nhwc" and aligned and x_shape[1] % 4 == 0 and w_shape[1] % 4 == 0
    assert dict(plan.spec.constants)["VEC4"] is vec4
    rng = np.random.default_rng(sum(x_shape))
    x = rng.standard_normal(g.input_shape).astype(np.float32)
    go = rng.standard_normal(g.output_shape).astype(np.float32)
    x.ravel()[:4] = [1 + 2 ** -11, -(1 + 2 ** -11), np.inf, np.finfo(np.float32).max]   # ties away; Inf stays
    to_layout = _nhwc if layout == "nhwc" else np.ascontiguousarray
    scratch = np.full(plan.scratch_bytes // 4, np.nan, np.float32)   # anything the pack leaves unwritten shows
    offset = wgmma.aligned_size(x_bytes) // 4
    assert plan.scratch_bytes == offset * 4 + go_bytes
    _, _, x_quads, go_quads = cuda_emulator.run(plan, [to_layout(x), to_layout(go), scratch[:offset],
                                                       scratch[offset:]], ["float", "float", "uint4", "uint4"])
    for name, got, source in (("x", x_quads[:x_bytes // 4], x), ("grad_output", go_quads, go)):
        n, c = source.shape[:2]
        quads = -(-n // 4)
        padded = np.zeros((quads * 4,) + source.shape[1:], np.float32)
        padded[:n] = source
        want = padded.reshape(quads, 4, c, -1).transpose(0, 3, 2, 1)   # [quad][pixel][channel][image]
        if not split:
            np.testing.assert_array_equal(got.view(np.float32).reshape(want.shape), _tf32_nearest_away(want),
                                          err_msg=name)
            continue
        big, small = got.view(np.float32).reshape((2,) + want.shape)
        finite = np.isfinite(want)
        rounded = _tf32_nearest_away(want)
        fits = finite & np.isfinite(rounded)
        np.testing.assert_array_equal(big[fits], rounded[fits], err_msg=name)
        np.testing.assert_array_equal(big[finite & ~fits],
                                      (want[finite & ~fits].view(np.uint32) & 0xFFFFE000).view(np.float32))
        np.testing.assert_array_equal(small[finite], _tf32_nearest_away(want[finite] - big[finite]), err_msg=name)
        assert (big[~finite] == 0).all() and np.array_equal(small[~finite], want[~finite])


def _weight_channels_last(w):
    """A (C_in, C_out/groups, kH, kW) weight's channels_last memory: (C_in, kH, kW, C_out/groups)."""
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1))


def _direct_passes(g, dtype, layout, x, w, b, go):
    """(output, grad_input, grad_weight) of the direct kernels, in ``layout`` and the weight layout ``g`` names;
    grad_weight comes back in that layout's memory, flattened."""
    ctype = C_TYPE[dtype]
    to_layout = _nhwc if layout == "nhwc" else np.ascontiguousarray
    xl, gol = to_layout(x), to_layout(go)
    *_, y = cuda_emulator.run(direct.plan_forward(g, dtype, True, layout),
                              [xl, w, b, to_layout(_empty(g.output_shape, dtype))], [ctype] * 4)
    *_, gi = cuda_emulator.run(direct.plan_grad_input(g, dtype, layout),
                               [gol, w, to_layout(_empty(g.input_shape, dtype))], [ctype] * 3)
    gw, chunks = _split_k(*direct.plan_grad_weight(g, dtype, 4, layout), (xl, gol), g.weight_shape, dtype)
    return y, gi, gw.ravel(), chunks


@pytest.mark.parametrize("name,dtype,layout", [("grouped_dilated", "float64", "nchw"),
                                               ("chunked_weights", "float32", "nhwc"),
                                               ("narrow_rows", "bfloat16", "nhwc"), ("depthwise", "float16", "nchw")])
def test_direct_kernels_read_and_write_a_channels_last_weight_in_place(name, dtype, layout):
    """With the weight in channels_last memory (``model.to(memory_format=torch.channels_last)``), every direct
    kernel reads it and grad_weight is written in it: the same values, bit for bit, as from a contiguous weight,
    each on the reference."""
    g, args = _layer(name)
    x, w, b, go = _data(g, dtype, seed=len(name) + 1)
    y, gi, gw, _ = _direct_passes(g, dtype, layout, x, w, b, go)
    cl = g.with_weight_channels_last()
    y_cl, gi_cl, gw_cl_memory, chunks = _direct_passes(cl, dtype, layout, x, _weight_channels_last(w), b, go)
    cin, cg, kh, kw = g.weight_shape
    gw_cl = np.ascontiguousarray(gw_cl_memory.reshape(cin, kh, kw, cg).transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(y_cl, y)
    np.testing.assert_array_equal(gi_cl, gi)
    np.testing.assert_array_equal(gw_cl.ravel(), gw)
    want_gw = reference.conv_transpose2d_backward(*(_values(a, dtype) for a in (go, x, w)), **args)[1]
    _close(gw_cl, want_gw, TOLERANCE[dtype], f"{name} {layout} grad_weight", dtype)
    assert name != "depthwise" or chunks > 1, "several split-K chunks, summed in the weight's layout"


@pytest.mark.parametrize("tile", [(0, 0), (32, 8)])
@pytest.mark.parametrize("mode", [0, 1])
def test_weight_packed_from_channels_last_memory_matches_the_contiguous_pack(mode, tile):
    """Both GEMM packs (row by row, and tile by tile as the wgmma kernels read them) give the same packed bits
    from a channels_last weight as from a contiguous one: grouped, taps of a 3 x 2 kernel, padded n and k."""
    from cupyconv.plans import gemm

    g = geometry((1, 24, 3, 3), (24, 10, 3, 2), None, ConvParams.from_args(stride=2, groups=2))
    w = np.random.default_rng(3).standard_normal(g.weight_shape).astype(np.float32)
    packed = []
    for geom, memory in ((g, w), (g.with_weight_channels_last(), _weight_channels_last(w))):
        plan = gemm.plan_pack_weight_padded(geom, "float32", mode, 32, 32, tile)
        assert dict(plan.spec.constants)["WEIGHT_CL"] == geom.weight_channels_last
        _, out = cuda_emulator.run(plan, [memory.view(np.uint32), np.zeros(plan.scratch_bytes // 4, np.uint32)],
                                   ["unsigned int"] * 2)
        packed.append(out)
    np.testing.assert_array_equal(packed[1], packed[0])
    assert np.count_nonzero(packed[0]) == w.size, "every weight value packed once"


def _packed_reference(w, groups, mode, n_pad, k_pad, tile):
    """pack_weight.cu's layout written out in numpy: B[g][tap][n][k] of the weight, zero-padded, then (with a
    tile) [g][n tile][k chunk][tap][16-byte k group][n in tile][k in group]."""
    cin, cout_g, kh, kw = w.shape
    cin_g, taps = cin // groups, kh * kw
    per_group = w.reshape(groups, cin_g, cout_g, taps)                  # [g][ic][oc][tap]
    b = per_group.transpose(0, 3, 2, 1) if mode == 0 else per_group.transpose(0, 3, 1, 2)   # [g][tap][n][k]
    padded = np.zeros((groups, taps, n_pad, k_pad), w.dtype)
    padded[:, :, :b.shape[2], :b.shape[3]] = b
    tile_n, tile_k = tile
    if not tile_n:
        return padded.ravel()
    vec = 16 // w.dtype.itemsize
    t = padded.reshape(groups, taps, n_pad // tile_n, tile_n, k_pad // tile_k, tile_k // vec, vec)
    return np.ascontiguousarray(t.transpose(0, 2, 4, 1, 5, 3, 6)).ravel()


@pytest.mark.parametrize("weight_cl", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bits, kernel, pads, tile", [
    # fp32 (the TF32 and 3xTF32 GEMMs): row-major and tiled, a 3 x 2 kernel (a run of 7 slots for 6 taps)
    (np.uint32, (3, 2), (48, 32), (0, 0)), (np.uint32, (3, 2), (64, 48), (32, 8)),
    (np.uint32, (3, 2), (32, 24), (8, 24)),
    # 49 taps: the regions shrink to fit shared memory
    (np.uint32, (7, 7), (64, 32), (64, 32)), (np.uint32, (7, 7), (32, 32), (0, 0)),
    # 16-bit words, one tap
    (np.uint16, (1, 1), (256, 64), (128, 64)), (np.uint16, (4, 4), (64, 96), (0, 0)),
    (np.uint16, (4, 4), (16, 32), (16, 16)),
])
def test_weight_packs_match_the_layout_written_out(bits, kernel, pads, tile, mode, weight_cl):
    """Both packs of pack_weight.cu against the layout computed in numpy: grouped, n and k padded past the channels,
    both weight layouts; the region shapes it runs with differ per order and mode (pack_region)."""
    from cupyconv.plans import gemm

    # 16-bit words move in pairs where a channels_last weight's output-channel runs are even
    groups, cin_g, cout_g = 2, 20, 13 if bits == np.uint32 else 14
    g = geometry((1, groups * cin_g, 3, 3), (groups * cin_g, cout_g) + kernel, None,
                 ConvParams.from_args(stride=2, groups=groups))
    w = np.random.default_rng(sum(kernel) + mode).integers(1, 2 ** 15, g.weight_shape).astype(bits)
    n_pad, k_pad = pads if mode == 0 else pads[::-1]
    if tile[0]:
        n_pad, k_pad = -(-n_pad // tile[0]) * tile[0], -(-k_pad // tile[1]) * tile[1]
    dtype = "float32" if bits == np.uint32 else "float16"
    geom = g.with_weight_channels_last() if weight_cl else g
    plan = gemm.plan_pack_weight_padded(geom, dtype, mode, n_pad, k_pad, tile)
    c = dict(plan.spec.constants)
    assert c["REGION_K"] * c["REGION_N"] * ((kernel[0] * kernel[1]) | 1) * w.itemsize <= 40 * 1024
    memory = _weight_channels_last(w) if weight_cl else w
    out = np.full(plan.scratch_bytes // w.itemsize, 2 ** (8 * w.itemsize) - 1, bits)   # unwritten words show
    _, out = cuda_emulator.run(plan, [memory, out], ["unsigned int" if bits == np.uint32 else "unsigned short"] * 2)
    np.testing.assert_array_equal(out, _packed_reference(w, groups, mode, n_pad, k_pad, tile))


def _tf32_rounded(words):
    finite = (words & 0x7F800000) != 0x7F800000
    return np.where(finite, (words.astype(np.uint64) + 0x1000) & 0xFFFFE000, words).astype(np.uint32)


@pytest.mark.parametrize("words,blocks", [
    (7, None),               # only the words one by one past the last whole vector
    (4 * 1024 * 4 + 15, None),   # five blocks, the last one's vectors partly past the end, three words left over
    (4096 * 3 + 5, 2),       # fewer blocks than the words need: the loop walks the rest
])
def test_round_tf32_copy_rounds_every_word_in_place(words, blocks):
    """The rounding copy of a channels_last TF32 source, bit for bit: 16-byte vectors, the words past the last
    vector, Inf, NaN, a tie and the largest finite value (which rounds to Inf)."""
    rng = np.random.default_rng(words)
    src = rng.integers(0, 2 ** 32 - 1, size=words, dtype=np.uint64).astype(np.uint32)
    src[:4] = [0x7F800000, 0x7FC00001, 0x3F801000, 0x7F7FFFFF]
    plan = gemm.plan_round_tf32(words)
    if blocks is not None:
        plan = dataclasses.replace(plan, grid=(blocks, 1, 1))
    _, out = cuda_emulator.run(plan, [src, np.full(words, 0xAAAAAAAA, np.uint32)], ["unsigned int", "unsigned int"])
    assert out[:4].tolist() == [0x7F800000, 0x7FC00001, 0x3F802000, 0x7F800000]
    np.testing.assert_array_equal(out, _tf32_rounded(src))


@pytest.mark.parametrize("dtype,round_tf32,batch,channels,pixels", [
    ("float16", False, 2, 31, 97),     # odd channels and planes: 16-bit pairs fall back to single elements
    ("float16", False, 1, 130, 128),   # three channel tiles, two pixel tiles, pairs both ways
    ("float32", False, 2, 31, 97),
    ("float32", True, 1, 130, 65),     # rounded to TF32 on the way
])
def test_to_channels_last_moves_every_element_to_its_place(dtype, round_tf32, batch, channels, pixels):
    """The NCHW -> channels_last copy in front of the GEMMs, bit for bit: tiles cut at the channel and pixel
    edges, rows of a tile past the edge staged but never stored, and TF32 rounding by bits."""
    bits = np.uint16 if dtype == "float16" else np.uint32
    rng = np.random.default_rng(batch * 1000 + channels * 10 + pixels)
    src = rng.integers(0, np.iinfo(bits).max, size=(batch, channels, pixels), dtype=np.uint64).astype(bits)
    if round_tf32:
        src.reshape(-1)[:4] = [0x7F800000, 0x7FC00001, 0x3F801000, 0x7F7FFFFF]   # Inf, NaN, a tie, the largest
    sentinel = np.full((batch, pixels, channels), 0xAAAA, dtype=bits)
    plan = gemm.plan_to_channels_last(batch, channels, pixels, dtype, round_tf32=round_tf32)
    c_type = "unsigned short" if bits is np.uint16 else "unsigned int"
    _, out = cuda_emulator.run(plan, [src, sentinel], [c_type, c_type])
    want = src.transpose(0, 2, 1)
    if round_tf32:
        want = _tf32_rounded(want)
        assert out[0, :4, 0].tolist() == [0x7F800000, 0x7FC00001, 0x3F802000, 0x7F800000]
    np.testing.assert_array_equal(out, want)
