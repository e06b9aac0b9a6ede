"""The tiled forward family: its planner, its place in the pass table, and its kernel run on the CPU through the
C++ emulation against the float64 reference (every candidate tile, every dtype, aligned and unaligned stores)."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest

from cupyconv import reference
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import table, tiled
from cupyconv.tuning.variants import Variant

import cuda_emulator
from layers import random_layer
from test_kernels_emulated import C_TYPE, TOLERANCE, _data, _empty, _values

GROUPED_DILATED = geometry((16, 32, 128, 256), (32, 16, 3, 5), None, ConvParams.from_args((2, 3), (1, 2), 0, 4, (2, 1)))
DEPTHWISE_UP = geometry((16, 128, 64, 64), (128, 1, 4, 4), (128,), ConvParams.from_args(2, 1, 0, 128, 1))
ONE_D_DEPTHWISE = geometry((4, 16, 1, 2048), (16, 1, 1, 4), None, ConvParams.from_args((1, 2), (0, 1), 0, 16, 1))

# (input shape, weight shape, layer arguments): small layers for the emulation
LAYERS = {
    # the grouped_dilated bench layer in miniature: stride 2 x 3, an empty row phase, outputs 2 wide per store
    "grouped_dilated": ((2, 8, 5, 7), (8, 4, 3, 5), dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4)),
    # depthwise 4x4 stride 2: output rows of 16, whole 16-byte stores in 16-bit types and a partial last tile
    "depthwise": ((2, 3, 9, 8), (3, 1, 4, 4), dict(stride=2, padding=1, groups=3)),
    # padding past a stride period, output_padding, 5 output channels (a partial channel block)
    "padded": ((1, 2, 6, 5), (2, 5, 3, 2), dict(stride=(2, 1), padding=(3, 1), output_padding=(1, 0))),
    # a stride larger than the dilated kernel: most tile rows and columns hold the bias alone
    "sparse": ((2, 3, 3, 4), (3, 2, 2, 3), dict(stride=(5, 4), padding=(1, 2), output_padding=(2, 1))),
    # a 1-D depthwise layer: tiles one row high and many columns wide, the last one partial
    "one_d": ((2, 4, 1, 37), (4, 1, 1, 4), dict(stride=(1, 2), padding=(0, 1), groups=4)),
    # eight input channels a group, for blocks that stage them in chunks
    "wide_groups": ((3, 16, 5, 7), (16, 3, 3, 5), dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=2)),
}
_rng = random.Random(20261127)
for _i in range(5):
    _l = random_layer(_rng, "float64", max_kernel=5, max_size=9)
    LAYERS[f"random{_i}"] = ((_l.batch or 1,) + _l.input_shape[-3:], _l.weight_shape, _l.kwargs())
DTYPES = ("float64", "float32", "float16", "bfloat16")
# every dtype on the named layers, two a random one
CASES = [(name, dtype) for i, name in enumerate(LAYERS) for j, dtype in enumerate(DTYPES)
         if not name.startswith("random") or (i + j) % 2 == 0]


def _layer(name):
    x_shape, w_shape, kwargs = LAYERS[name]
    params = ConvParams.from_args(**kwargs)
    args = dict(stride=params.stride, padding=params.padding, output_padding=params.output_padding,
                groups=params.groups, dilation=params.dilation)
    return geometry(x_shape, w_shape, (w_shape[1] * params.groups,), params), args


def _geometry(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


# ------------------------------------------------------------------------------------------ planner

def test_tile_names_round_trip_through_the_tuners_variant_names():
    for tile in tiled.tiles(GROUPED_DILATED, "float16") + tiled.tiles(DEPTHWISE_UP, "float32"):
        name = tiled.tile_name(tile)
        assert tiled.parse_tile(name) == tile
        variant = Variant.parse(f"tiled:{name}")
        assert variant.kwargs["tile"] == name and Variant.parse(variant.name) == variant
    for bad in ("8x8", "8x8x1", "8x8x1r2", "axbxcbd"):
        with pytest.raises(ValueError):
            tiled.parse_tile(bad)


def test_stores_are_as_wide_as_every_output_row_allows():
    assert tiled.store_vector(DEPTHWISE_UP, "float16") == 8         # rows of 128: 16-byte stores
    assert tiled.store_vector(DEPTHWISE_UP, "float32") == 4
    assert tiled.store_vector(DEPTHWISE_UP, "float64") == 2
    assert tiled.store_vector(GROUPED_DILATED, "float16") == 2      # rows of 766 start 4-byte aligned at best
    assert tiled.store_vector(DEPTHWISE_UP, "float16", aligned=False) == 1
    odd = _geometry((1, 2, 4, 4), (2, 2, 2, 2), stride=1)           # 5 wide
    assert tiled.store_vector(odd, "float16") == 1


def test_candidates_leave_the_image_size_out():
    """A stored choice serves a bucket of batch and image sizes: every size must offer the same tiles."""
    for x_shape in ((2, 32, 9, 11), (4, 32, 15, 12), (1, 32, 16, 16), (3, 32, 7, 5)):
        g = _geometry(x_shape, (32, 48, 3, 3), stride=2, padding=1)
        assert tiled.tiles(g, "float16") == tiled.tiles(_geometry((2, 32, 9, 11), (32, 48, 3, 3), stride=2,
                                                                   padding=1), "float16")


def test_kernels_leave_the_image_size_out():
    """A new image size compiles nothing: the patch, the chunk and every other constant of each candidate's
    kernel are the same for every size (where the output rows allow the same store width, and the input's rows
    the same 16-bit pairs: every width here is even)."""
    layers = {"depthwise_up": ((128, 1, 4, 4), dict(stride=2, padding=1, groups=128), (64, 64), (17, 32), (33, 40)),
              "grouped_dilated": ((32, 16, 3, 5), dict(stride=(2, 3), padding=(1, 2), groups=4, dilation=(2, 1)),
                                  (128, 256), (31, 100), (9, 14))}
    for w_shape, kwargs, *sizes in layers.values():
        for dtype in ("float16", "float32"):
            geometries = [_geometry((2, w_shape[0]) + size, w_shape, **kwargs) for size in sizes]
            for tile in tiled.tiles(geometries[0], dtype):
                specs = {tiled.plan_forward(g, dtype, True, tile).spec for g in geometries}
                assert len(specs) == 1, (tile, dtype)


def test_heuristic_tiles_span_whole_stride_periods_and_fit_the_budgets():
    assert tiled.heuristic_tile(DEPTHWISE_UP, "float16")[:3] == (8, 8, 1)
    assert tiled.heuristic_tile(GROUPED_DILATED, "float16")[:3] == (2, 6, 8)
    for g in (GROUPED_DILATED, DEPTHWISE_UP) + tuple(_layer(n)[0] for n in LAYERS):
        for dtype in ("float64", "float32", "float16", "bfloat16"):
            for rows, cols, channels, blocks in tiled.tiles(g, dtype):
                assert rows % g.params.stride[0] == 0 and cols % g.params.stride[1] == 0
                assert 1 <= channels <= g.out_per_group and 1 <= blocks <= 8
                assert tiled.accumulator_registers(g, dtype, (rows, cols, channels)) <= 128


def test_a_one_row_input_takes_tiles_of_its_output_rows_only():
    """A 1-D layer's single output row: taller tiles would compute rows that are never stored, so the rows stop at
    the output's height and the columns grow instead."""
    for dtype in ("float16", "float32"):
        for rows, cols, _, _ in tiled.tiles(ONE_D_DEPTHWISE, dtype):
            assert rows == 1 and cols >= 16
    tall = _geometry((1, 16, 2, 2048), (16, 1, 1, 4), stride=(1, 2), padding=(0, 1), groups=16)
    assert tiled.heuristic_tile(tall, "float16")[0] == 8


def test_an_empty_phase_holds_no_live_accumulators():
    # grouped_dilated: dilation 2 = stride 2 along h, so one row in two gets no tap
    assert tiled.live_accumulators(GROUPED_DILATED, (2, 6, 8)) == 6 * 8
    assert tiled.live_accumulators(DEPTHWISE_UP, (8, 8, 1)) == 64


def test_the_family_runs_nchw_forwards_of_thin_layers_and_leads_there():
    for g in (GROUPED_DILATED, DEPTHWISE_UP):
        fams = [f.name for f in table.eligible("forward", g, "float16", "nchw")]
        assert fams.index("tiled") < fams.index("direct")
        cands = table.candidates("forward", g, "float16", "nchw")
        assert cands[0].family == "tiled" and Variant("direct") in cands
        assert "tiled" not in [f.name for f in table.eligible("forward", g, "float16", "nhwc")]
        for pass_ in ("grad_input", "grad_weight"):
            assert "tiled" not in [f.name for f in table.eligible(pass_, g, "float16", "nchw")]
    # wider groups: the direct kernels' heuristic stays ahead, the tiles race it
    wide = _geometry((2, 48, 8, 8), (48, 48, 3, 3), padding=1)
    cands = table.candidates("forward", wide, "float64", "nchw")
    assert cands[0] == Variant("direct") and any(v.family == "tiled" for v in cands)
    # too many taps to unroll, or weights past shared memory: not eligible
    assert not tiled.eligible(_geometry((1, 2, 8, 8), (2, 2, 7, 7), stride=1), "float32")
    assert not tiled.eligible(_geometry((1, 512, 4, 4), (512, 8, 3, 3), stride=1), "float64")


def test_plans_name_their_tile_in_the_kernels_constants():
    plan = tiled.plan_forward(DEPTHWISE_UP, "float16", True, (4, 8, 1, 4))
    c = dict(plan.spec.constants)
    assert (c["TILE_R"], c["TILE_V"], c["OCB"], c["MIN_BLOCKS"], c["VEC"], c["HAS_BIAS"]) == (4, 8, 1, 4, 8, True)
    # 32 x 16 tiles of a 128 x 128 plane: patches of 16 x 8 tiles, 4 to a plane, walked by 4 blocks an SM holds
    assert (c["TX"], c["TY"]) == (16, 8) and plan.block == (128, 1, 1)
    assert plan.scalars[-3:] == (1, 4, 16 * 128 * 4) and plan.grid == (132 * 4, 1, 1)
    assert tiled.plan_forward(DEPTHWISE_UP, "float16", True, (4, 8, 1, 4), sm_count=2).grid == (8, 1, 1)
    assert dict(tiled.plan_forward(DEPTHWISE_UP, "float16", True, (4, 8, 1, 4), aligned=False)
                .spec.constants)["VEC"] == 1
    with pytest.raises(ValueError, match="tile"):
        tiled.plan_forward(DEPTHWISE_UP, "float16", True, (3, 8, 1, 4))   # not a whole stride period


# ------------------------------------------------------------------------------------------ emulation

emulated = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ to emulate the kernels")


@emulated
@pytest.mark.parametrize("name,dtype", CASES)
def test_every_tile_matches_the_reference(name, dtype):
    g, kwargs = _layer(name)
    if not tiled.eligible(g, dtype):
        pytest.skip("not a tiled layer")
    x, w, b, _ = _data(g, dtype, seed=len(name))
    want = reference.conv_transpose2d(*(_values(a, dtype) for a in (x, w, b)), **kwargs)
    plans = [tiled.plan_forward(g, dtype, True, t) for t in tiled.tiles(g, dtype)]
    plans.append(tiled.plan_forward(g, dtype, True, aligned=False))   # element stores
    for plan in plans:
        *_, y = cuda_emulator.run(plan, [x, w, b, _empty(g.output_shape, dtype)], [C_TYPE[dtype]] * 4)
        err = np.abs(_values(y, dtype) - want).max()
        tile = {k: v for k, v in plan.spec.constants if k in ("TILE_R", "TILE_V", "OCB", "VEC")}
        assert err <= TOLERANCE[dtype] * np.abs(want).max(), (name, dtype, tile, err)


@emulated
def test_the_cases_reach_partial_tiles_partial_channel_blocks_and_every_store_width():
    widths, partial_cols, partial_channels = set(), False, False
    for name, dtype in CASES:
        g, _ = _layer(name)
        for t in tiled.tiles(g, dtype) if tiled.eligible(g, dtype) else ():
            widths.add(dict(tiled.plan_forward(g, dtype, True, t).spec.constants)["VEC"])
            partial_cols |= g.out_size[1] % t[1] != 0
            partial_channels |= g.out_per_group % t[2] != 0
    assert {1, 2, 4, 8} <= widths and partial_cols and partial_channels


@emulated
@pytest.mark.parametrize("ic_chunk", [None, 3])
def test_blocks_walk_runs_of_patches_channel_blocks_images_and_chunks(ic_chunk):
    """With a grid of a few blocks, each walks a long run of patches across output-channel blocks and images,
    holding the next step's window (and weights, where the channel block changes) while it computes; staged
    three input channels at a time, the group's eight take two whole chunks and a partial one."""
    g, kwargs = _layer("wide_groups")
    x, w, b, _ = _data(g, "float32", seed=4)
    plan = tiled.plan_forward(g, "float32", True, (2, 6, 2, 2), sm_count=1)
    blocks_w, blocks_h, items = plan.scalars[-3:]
    assert items > 4 * plan.grid[0] and g.groups * 2 <= items // (blocks_w * blocks_h)
    if ic_chunk:
        assert g.in_per_group % ic_chunk
        plan = cuda_emulator.respecialized(plan, IC_CHUNK=ic_chunk)
    *_, y = cuda_emulator.run(plan, [x, w, b, _empty(g.output_shape, "float32")], ["float"] * 4)
    want = reference.conv_transpose2d(*(_values(a, "float32") for a in (x, w, b)), **kwargs)
    assert np.abs(_values(y, "float32") - want).max() <= TOLERANCE["float32"] * np.abs(want).max()


def test_16_bit_windows_load_in_pairs_where_rows_start_aligned():
    """Two 16-bit cells a load where the input's width is even and its pointer aligned; a held pair takes one
    register, so a chunk stages up to twice the channels.  Odd widths, unaligned inputs and wider types load a
    cell at a time."""
    even = _geometry((2, 32, 16, 20), (32, 16, 3, 5), stride=(2, 3), padding=(1, 2), groups=4, dilation=(2, 1))
    odd = _geometry((2, 32, 16, 21), (32, 16, 3, 5), stride=(2, 3), padding=(1, 2), groups=4, dilation=(2, 1))
    constants = lambda g, dtype, **kw: dict(tiled.plan_forward(g, dtype, False, **kw).spec.constants)
    assert constants(even, "float16")["PAIRS"] and constants(even, "bfloat16")["PAIRS"]
    assert not constants(odd, "float16")["PAIRS"] and not constants(even, "float16", aligned=False)["PAIRS"]
    assert not constants(even, "float32")["PAIRS"]
    assert constants(even, "float16")["IC_CHUNK"] >= constants(odd, "float16")["IC_CHUNK"]
    assert any(constants(g, "float16", tile=t)["IC_CHUNK"] > constants(g, "float16", tile=t, aligned=False)["IC_CHUNK"]
               for g in (even, GROUPED_DILATED) for t in tiled.tiles(g, "float16"))


@emulated
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pairs_stage_partial_chunks_and_windows_that_start_on_odd_columns(dtype):
    """Pairs of 16-bit cells over eight channels a group staged three at a time (a partial last chunk), for
    windows that start on an even and on an odd input column."""
    shifts = set()
    for pad_w in (1, 2):
        kwargs = dict(stride=(2, 3), padding=(1, pad_w), output_padding=(0, 0), groups=2, dilation=(2, 1))
        g = geometry((3, 16, 5, 8), (16, 3, 3, 5), (6,), ConvParams.from_args(**kwargs))
        x, w, b, _ = _data(g, dtype, seed=6)
        want = reference.conv_transpose2d(*(_values(a, dtype) for a in (x, w, b)), **kwargs)
        plan = cuda_emulator.respecialized(tiled.plan_forward(g, dtype, True, (2, 6, 2, 2), sm_count=1), IC_CHUNK=3)
        assert dict(plan.spec.constants)["PAIRS"]
        shifts.add(tiled._window(g, dtype, (2, 6, 2, 2))[3] % 2)
        *_, y = cuda_emulator.run(plan, [x, w, b, _empty(g.output_shape, dtype)], [C_TYPE[dtype]] * 4)
        assert np.abs(_values(y, dtype) - want).max() <= TOLERANCE[dtype] * np.abs(want).max(), pad_w
    assert shifts == {0, 1}


@emulated
def test_a_one_row_input_of_even_width_loads_pairs_across_its_patch():
    """A 1-D layer's patch is one row of 128 tiles: its pairs start on even columns there too."""
    kwargs = dict(stride=(1, 2), padding=(0, 1), output_padding=(0, 0), groups=4, dilation=(1, 1))
    g = geometry((2, 4, 1, 38), (4, 1, 1, 4), (4,), ConvParams.from_args(**kwargs))
    x, w, b, _ = _data(g, "float16", seed=5)
    want = reference.conv_transpose2d(*(_values(a, "float16") for a in (x, w, b)), **kwargs)
    for tile in tiled.tiles(g, "float16"):
        plan = tiled.plan_forward(g, "float16", True, tile, sm_count=1)
        assert dict(plan.spec.constants)["PAIRS"] and plan.block == (128, 1, 1)
        *_, y = cuda_emulator.run(plan, [x, w, b, _empty(g.output_shape, "float16")], ["half_t"] * 4)
        assert np.abs(_values(y, "float16") - want).max() <= TOLERANCE["float16"] * np.abs(want).max(), tile


@emulated
def test_a_wrong_phase_is_caught():
    """The emulation is a real check: a kernel that takes its column phases one column off no longer matches."""
    g, kwargs = _layer("depthwise")
    x, w, b, _ = _data(g, "float64", seed=1)
    broken = cuda_emulator.respecialized(tiled.plan_forward(g, "float64", True), PW=2)
    *_, y = cuda_emulator.run(broken, [x, w, b, _empty(g.output_shape, "float64")], ["double"] * 4)
    want = reference.conv_transpose2d(x, w, b, **kwargs)
    assert np.abs(y - want).max() > 1e-3 * np.abs(want).max()


# ------------------------------------------------------------------------------------------ registers

# the bench's two bandwidth layers, and wider groups where the tiles race the direct forward
SPILL_LAYERS = {"grouped_dilated": GROUPED_DILATED, "depthwise_up": DEPTHWISE_UP,
                "thin": _geometry((2, 32, 9, 11), (32, 48, 3, 3), stride=2, padding=1),
                "depthwise_1d": ONE_D_DEPTHWISE}
SPILL_CASES = [(name, dtype, tiled.tile_name(t)) for name, g in SPILL_LAYERS.items()
               for dtype in ("float16", "float32", "float64") for t in tiled.tiles(g, dtype)]


@pytest.mark.parametrize("name,dtype,tile", SPILL_CASES)
def test_every_candidate_tile_builds_without_spilling(name, dtype, tile):
    from test_compiler import _ptxas_log

    spec = tiled.plan_forward(SPILL_LAYERS[name], dtype, name == "depthwise_up", tiled.parse_tile(tile)).spec
    log = _ptxas_log(spec, ("-arch=sm_90",))
    assert "for 'sm_90'" in log, log
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found and found.groups() == ("0", "0", "0"), log
