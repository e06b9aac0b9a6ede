"""The Hopper wgmma family (forward and grad_input) without a GPU: stride-phase taps, halos (grad_input's
split into stride-phase planes), shared memory, eligibility (sm_90 only), the tiles it offers and the
launches it plans.

The kernels themselves run in tests/test_wgmma_gpu.py and compile in tests/test_compiler.py.
"""
import math
import random

import pytest

from cupyconv import bench, engine, tuning
from cupyconv.core import device
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import gemm, launch, reduction, scatter_gemm, table, wgmma
from cupyconv.plans.launch import Recorder, cdiv, numel
from cupyconv.tuning.variants import GEMM, Variant

WGMMA = Variant("wgmma")
TEMPLATE = "conv_transpose2d_wgmma.cu"
FUNCTION = "conv_transpose2d_wgmma"
HALF = ("float16", "bfloat16")
# 16-byte aligned made-up pointers (x, weight, bias, out, grad_input, grad_weight) for the engine on a recorder
_X, _W, _B, _Y, _GX, _GW = ((i + 1) << 32 for i in range(6))


def _g(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


def _suite_layer(name, batch=None, size=None):
    """A layer of the benchmark suite as the kernels run it (a 1-D one as one input row), optionally at another
    batch and input size."""
    layer = next(layer for layer in bench.SUITE if layer.name == name)
    return _g((batch or layer.batch, layer.in_channels) + (size or layer.size),
              (layer.in_channels, layer.out_channels // layer.groups) + layer.kernel, stride=layer.stride,
              padding=layer.padding, output_padding=layer.output_padding, dilation=layer.dilation,
              groups=layer.groups)


SUITE = ("asym_kernel", "dcgan_up", "unet_up2x2", "big_square", "outpad_up3x")
DENSE = _g((2, 64, 9, 11), (64, 48, 3, 5), stride=2, padding=1)
# 16 -> 128 channels, a 2x2 kernel dilated 45 apart: the halo fits shared memory with the
# small tiles only, at the smallest channel chunk
WIDE_HALO = _g((2, 16, 40, 40), (16, 128, 2, 2), dilation=45)
# a 29 x 121 halo for an 8 x 8 patch: it fits with 32 output channels a tile, no tile of TILES
NO_TILE_FITS = _g((1, 16, 4, 4), (16, 16, 2, 2), dilation=(21, 113))


def _random_geometry(rng, in_choices=(16, 24, 40, 64, 72, 136, 200), out_choices=(16, 24, 40, 64, 72, 136, 264),
                     max_kernel=7, max_stride=4, max_dilation=3, max_size=40):
    while True:
        k = (rng.randint(1, max_kernel), rng.randint(1, max_kernel))
        s = (rng.randint(1, max_stride), rng.randint(1, max_stride))
        d = (rng.randint(1, max_dilation), rng.randint(1, max_dilation))
        p = tuple(rng.randint(0, d[a] * (k[a] - 1) + s[a]) for a in range(2))
        op = tuple(rng.randint(0, max(s[a], d[a]) - 1) for a in range(2))
        groups = rng.choice([1, 1, 2, 3])
        cin, cout = rng.choice(in_choices), rng.choice(out_choices)
        size = (rng.randint(1, max_size), rng.randint(1, max_size))
        try:
            return _g((rng.randint(1, 9), cin * groups) + size, (cin * groups, cout) + k, stride=s, padding=p,
                      output_padding=op, dilation=d, groups=groups)
        except ValueError:  # an empty output: draw again
            continue


RANDOM = [_random_geometry(random.Random(seed)) for seed in range(150)]


def _constants(plan):
    return dict(plan.spec.constants)


# ------------------------------------------------------------------------- stride phases

def _axis_offsets(kernel, stride, padding, dilation, phase):
    """Input offsets of the taps that reach output index ``stride * i + phase``, straight from the
    definition out[i * stride - padding + k * dilation] += in[i] * w[k], by search (per tap, in tap order)."""
    i = 1000
    out = stride * i + phase
    found = []
    for k in range(kernel):
        hits = [src - i for src in range(i - 200, i + 200) if src * stride - padding + k * dilation == out]
        assert len(hits) <= 1
        found += hits
    return found


@pytest.mark.parametrize("index", range(0, len(RANDOM), 10))
def test_phase_offsets_match_a_brute_force_enumeration(index):
    for g in RANDOM[index:index + 10]:
        (kh, kw), (sh, sw) = g.kernel, g.params.stride
        (ph, pw), (dh, dw) = g.params.padding, g.params.dilation
        want = [(_axis_offsets(kh, sh, ph, dh, rh), _axis_offsets(kw, sw, pw, dw, rw))
                for rh in range(sh) for rw in range(sw)]
        found = wgmma.phase_offsets(g)
        assert found == want, g
        # every tap belongs to exactly one phase
        assert sum(len(rows) * len(cols) for rows, cols in found) == kh * kw
        assert wgmma.fewest_taps(g) == min(len(r) * len(c) for r, c in found if r and c)


def test_phases_without_taps():
    # a 2 x 3 kernel at stride 3 x 4: output rows 2 mod 3 and columns 3 mod 4 get the bias alone
    g = _g((1, 16, 6, 5), (16, 32, 2, 3), stride=(3, 4))
    phases = wgmma.phase_offsets(g)
    assert len(phases) == 12
    empty = [i for i, (r, c) in enumerate(phases) if not (r and c)]
    assert empty == [3, 7, 8, 9, 10, 11]
    assert wgmma.fewest_taps(g) == 1
    # a 4 x 4 kernel at stride 4: one tap a phase, some outputs past the input (output_padding) have none in range
    g = _g((2, 64, 3, 5), (64, 48, 4, 4), stride=4, output_padding=(3, 1))
    assert all(len(r) == len(c) == 1 for r, c in wgmma.phase_offsets(g))


@pytest.mark.parametrize("tile", sorted(wgmma.TILES))
def test_halo_covers_every_taps_offsets(tile):
    t = wgmma.TILES[tile]
    for g in RANDOM:
        halo_h, halo_w = wgmma.halo_extent(g, t)
        spans = []
        for rows, cols in wgmma.phase_offsets(g):
            if rows and cols:
                # output (i, j) of the patch reads halo row i + r - min(rows) for each tap row r
                assert (t.tile_h - 1) + max(rows) - min(rows) < halo_h, g
                assert (t.tile_w - 1) + max(cols) - min(cols) < halo_w, g
                spans.append((max(rows) - min(rows), max(cols) - min(cols)))
        # and no more than the widest phase needs
        assert (halo_h, halo_w) == (t.tile_h + max(s[0] for s in spans), t.tile_w + max(s[1] for s in spans))


# ------------------------------------------------------------------------ shared memory

def test_smem_limit_leaves_room_for_the_static_tap_table():
    taps = 256   # gemm.gemm_fits allows at most 256 taps; each is 8 bytes of static shared memory
    barriers = 2 * 8 * 2 * max(wgmma.STAGE_CHOICES)   # full and empty mbarriers of each buffer, and counters
    assert wgmma.SMEM_LIMIT + 8 * taps + barriers + 64 <= 227 * 1024
    assert gemm.gemm_fits(_g((1, 16, 4, 4), (16, 16, 16, 16)), "float16")
    assert not gemm.gemm_fits(_g((1, 16, 4, 4), (16, 16, 16, 17)), "float16")


def _chunks_tried(g, dtype, pass_="forward"):
    """The channel chunks a plan tries, largest first: the full chunk, then halves rounded down to whole
    MMA steps (32 bytes of 2-byte channels), down to one step."""
    step = 32 // 2
    chunks = [wgmma.chunk_channels(g, dtype, pass_)]
    while chunks[-1] > step:
        chunks.append(max(step, chunks[-1] // 2 // step * step))
    assert all(c % step == 0 for c in chunks)
    return chunks


@pytest.mark.parametrize("dtype", HALF)
def test_planned_layers_stay_within_shared_memory(dtype):
    """Every tile either plans within SMEM_LIMIT, with the largest channel chunk and then the deepest
    weight ring that fit, or does not fit even at the smallest chunk and two weight buffers."""
    smallest = 32 // 2
    planned = 0
    for g in RANDOM[::3]:
        if not wgmma.eligible(g, dtype):
            continue
        for t in wgmma.TILES.values():
            try:
                main = wgmma.plan_forward(g, dtype, False, "nhwc", t).gemm
            except ValueError:
                assert wgmma.smem_bytes(g, dtype, t, smallest, 2) > wgmma.SMEM_LIMIT, (g, t)
                continue
            planned += 1
            c = _constants(main)
            ck, b_stages = c["CK"], c["B_STAGES"]
            # halos the copy engine lands take their padded planes, where those still fit
            assert main.smem_bytes == wgmma.smem_bytes(g, dtype, t, ck, b_stages, tma=c["TMA"]) <= wgmma.SMEM_LIMIT
            assert c["TMA"] or wgmma.smem_bytes(g, dtype, t, ck, b_stages, tma=True) > wgmma.SMEM_LIMIT \
                or wgmma.halo_tensor_map(g, dtype, t, ck, "forward") is None
            assert c["HALO_STAGES"] == wgmma.halo_stages(g, b_stages) >= 2
            assert ck % smallest == 0 and ck <= wgmma.chunk_channels(g, dtype)
            assert 2 <= b_stages <= wgmma.B_STAGES
            tried = _chunks_tried(g, dtype)
            assert ck in tried, "halved (in whole MMA steps) from the full chunk"
            for larger in tried[:tried.index(ck)]:
                assert wgmma.smem_bytes(g, dtype, t, larger, wgmma.B_STAGES) > wgmma.SMEM_LIMIT, "largest chunk"
            if b_stages < wgmma.B_STAGES:
                assert ck == smallest and wgmma.smem_bytes(g, dtype, t, ck, b_stages + 1) > wgmma.SMEM_LIMIT
            # the buffers of the descriptors' 18-bit addresses
            assert main.smem_bytes < 1 << 18
    assert planned > 100


def test_plan_forward_raises_when_no_chunk_fits():
    assert wgmma.eligible(WIDE_HALO, "float16")
    small = wgmma.plan_forward(WIDE_HALO, "float16", False, "nhwc", wgmma.TILES["8x8x64"]).gemm
    assert _constants(small)["CK"] == 16 and small.smem_bytes <= wgmma.SMEM_LIMIT
    with pytest.raises(ValueError, match="does not fit shared memory"):
        wgmma.plan_forward(WIDE_HALO, "float16", False, "nhwc", wgmma.TILES["16x16x64"])
    # a weight ring asked for is kept, or the plan refused
    with pytest.raises(ValueError, match="does not fit shared memory"):
        wgmma.plan_forward(WIDE_HALO, "float16", False, "nhwc", wgmma.TILES["8x8x64"], max(wgmma.STAGE_CHOICES))
    with pytest.raises(ValueError, match="stages"):
        wgmma.plan_forward(DENSE, "float16", False, "nhwc", None, 5)
    # a halo too wide for every tile is no layer for the family
    assert not wgmma.eligible(_g((2, 64, 40, 40), (64, 64, 2, 2), dilation=60), "float16")


@pytest.mark.parametrize("g, runs_wgmma", [(WIDE_HALO, True), (NO_TILE_FITS, False)],
                         ids=["heuristic_tile_too_big", "no_tile_fits"])
def test_the_heuristic_plans_every_eligible_layer(g, runs_wgmma):
    """Where the preferred tile's halo is too wide the heuristic takes a smaller tile that fits; where
    none fits, the family is not eligible and the GEMMs run the layer."""
    assert (table.eligible("forward", g, "float16", "nchw")[0] is wgmma.FAMILY) == runs_wgmma
    if runs_wgmma:
        tile = wgmma.forward_tile(g, "forward", "float16")
        assert wgmma.smem_bytes(g, "float16", tile, 8, 2) <= wgmma.SMEM_LIMIT
    rec = Recorder(device.ASSUMED)
    engine.forward(g, "float16", _X, _W, _B, _Y, rec, "nchw", "strict")
    functions = {plan.spec.function for _, plan in rec.launches}
    assert ("conv_transpose2d_wgmma" in functions) == runs_wgmma, functions


# --------------------------------------------------------------------------- eligibility

def test_no_wgmma_for_float64():
    assert not wgmma.eligible(DENSE, "float64")
    assert wgmma.FAMILY not in table.eligible("forward", DENSE, "float64", "nchw")


@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
def test_strict_float32_runs_as_3xtf32(pass_):
    """Strict float32 is eligible as 3xTF32 (kind 3): the weight packed as TF32 parts, an NCHW source copied
    unrounded (the kernel's producer splits the halo), tiles of at most 64 accumulators a thread, and buffers twice
    the TF32 plan's."""
    assert wgmma.eligible(DENSE, "float32", pass_, "strict")
    assert wgmma.FAMILY in table.eligible(pass_, DENSE, "float32", "nchw", precision="strict")
    plan = table.plan(pass_, Variant("wgmma"), DENSE, "float32", "nchw", "strict", pass_ == "forward")
    c = dict(plan.gemm.spec.constants)
    tile = wgmma.TILES[f"{c['TILE_IMAGES']}i" * (c["TILE_IMAGES"] > 1) + f"{c['TILE_H']}x{c['TILE_W']}x{c['BN']}"]
    assert c["MMA_KIND"] == 3 and not c["SRC_ROUNDED"] and not c["WEIGHT_DIRECT"]
    assert wgmma.grad_weight_eligible(DENSE, "float32", "strict") == (
        wgmma.split_weight_step(DENSE, wgmma.SPLIT_WEIGHT_TILES["64x64x2"]) is not None)
    assert tile == wgmma.split_tile(DENSE, pass_) and tile.accumulators <= wgmma.SPLIT_ACCUMULATORS
    pack = dict(plan.pack.spec.constants)
    assert pack["SPLIT_TF32"] and not pack["ROUND_TF32"]
    assert plan.pack.scratch_bytes == 2 * 4 * pack["GROUPS"] * pack["TAPS"] * pack["N_PAD"] * pack["K_PAD"]
    assert not dict(plan.to_channels_last.spec.constants)["ROUND_TF32"]
    assert plan.gemm.smem_bytes == wgmma.smem_bytes(DENSE, "float32", tile, c["CK"], c["B_STAGES"], pass_, parts=2)
    assert plan.gemm.smem_bytes <= wgmma.SMEM_LIMIT
    tf32 = table.plan(pass_, Variant("wgmma"), DENSE, "float32", "nchw", "tf32", pass_ == "forward")
    assert dict(tf32.gemm.spec.constants)["MMA_KIND"] == 2 and dict(tf32.pack.spec.constants)["ROUND_TF32"]
    with pytest.raises(ValueError, match="accumulators"):
        wgmma.plan_forward(DENSE, "float32", False, tile=wgmma.TILES["16x16x128"], precision="strict")


@pytest.mark.parametrize("name", SUITE)
@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
def test_strict_float32_options_plan_within_shared_memory(name, pass_):
    """Every 3xTF32 option of the dense suite layers plans: whole 128-byte chunks kept before deep weight rings
    (each step waits for its MMAs), buffers within shared memory, no tile of more than 64 accumulators."""
    g = _suite_layer(name)
    if not wgmma.eligible(g, "float32", pass_, "strict"):
        return
    opts = wgmma.options(g, pass_, "float32", "strict")
    assert opts[0] == {} and len(opts) == len({(o.get("tile"), o.get("split")) for o in opts})
    for o in opts:
        plan = wgmma.FAMILY.plan(pass_, Variant.make("wgmma", **o), g, "float32", "nhwc", "strict", True, True, 132)
        c = dict(plan.gemm.spec.constants)
        assert plan.gemm.smem_bytes <= wgmma.SMEM_LIMIT and c["MMA_KIND"] == 3
        assert c["BN"] * c["TILE_IMAGES"] * c["TILE_H"] * c["TILE_W"] // (128 * c["WARPGROUPS"]) <= 64
        if c["CK"] < 32:
            assert c["B_STAGES"] == 2, "the ring shrinks before the chunk"


@pytest.mark.parametrize("dtype", HALF)
def test_source_channels_per_group_must_be_whole_16_byte_groups_and_at_least_16(dtype):
    def layer(cin, cout, groups=1):
        return _g((2, cin, 9, 11), (cin, cout // groups, 3, 3), stride=2, padding=1, groups=groups)

    assert wgmma.eligible(layer(16, 16), dtype) and wgmma.eligible(layer(24, 40), dtype)
    assert not wgmma.eligible(layer(20, 32), dtype), "20 input channels: 40 bytes, not whole 16-byte groups"
    assert not wgmma.eligible(layer(36, 32), dtype)
    assert not wgmma.eligible(layer(8, 64), dtype), "under 16 source channels"
    # a thin destination takes the N tiles of 8 and 16 (the forward of an RGB output layer); its grad_input,
    # whose source that thin side is, stays off the kernel, and so does a grad_input into a thin input
    for cout, bn in ((8, 8), (12, 16), (3, 8), (1, 8)):
        assert wgmma.eligible(layer(64, cout), dtype) and not wgmma.eligible(layer(64, cout), dtype, "grad_input")
        assert wgmma.forward_tile(layer(64, cout), "forward", dtype).bn == bn
        assert not wgmma.eligible(layer(cout, 64), dtype, "grad_input"), "grad_input into a thin input"
    # output channels need no whole groups: the stores fall back to single elements
    assert wgmma.eligible(layer(16, 20), dtype) and wgmma.eligible(layer(32, 18), dtype)
    # per group, not in all
    assert wgmma.eligible(layer(48, 48, groups=3), dtype) and wgmma.eligible(layer(48, 48, groups=2), dtype)
    assert not wgmma.eligible(layer(40, 40, groups=2), dtype), "20 channels a group"
    assert not wgmma.eligible(layer(64, 64, groups=8), dtype), "8 channels a group"
    for g in (layer(20, 32), layer(8, 64)):
        assert wgmma.FAMILY not in table.eligible("forward", g, dtype, "nchw")


def test_thin_destinations_take_narrow_n_tiles_and_wide_patches():
    """An RGB output layer (pix2pix's 128 -> 3, DCGAN's 64 -> 3) runs its forward on 32 x 16 pixel patches of N 8,
    and races only the thin tiles, never N tiles of 32 or more that would be mostly padding; 16 channels keep the
    32-wide tile they had before the thin ones existed."""
    for x, w in (((16, 128, 128, 128), (128, 3, 4, 4)), ((128, 64, 32, 32), (64, 3, 4, 4))):
        g = _g(x, w, stride=2, padding=1)
        assert not wgmma.eligible(g, "float32", "forward", "tf32"), "thin float32 runs on mma.sync, not wgmma"
        assert table.candidates("forward", g, "float32", "nchw", "tf32")[0] == Variant("thin_mma")
        assert ({v.family for v in table.candidates("forward", g, "float32", "nchw", "tf32")}
                == {"thin_mma", "direct", "tiled"})
        for dtype in ("float16", "bfloat16", "float32"):
            assert wgmma.forward_tile(g, "forward", dtype) == wgmma.TILES["32x16x8"]
            tiles = {o.get("tile") for o in wgmma.options(g, "forward", dtype)} - {None}
            assert tiles and all(wgmma.TILES[t].bn <= 16 for t in tiles), tiles
        assert table.candidates("forward", g, "bfloat16", "nhwc")[0] == WGMMA
        assert table.candidates("forward", g, "bfloat16", "nhwc")[-1].family == "direct", "the direct kernel races"
        plan = table.plan("forward", WGMMA, g, "bfloat16", "nhwc", "strict", True)
        c = _constants(plan.gemm)
        assert (c["BN"], c["COUT_G"], c["TILE_H"], c["TILE_W"]) == (8, 3, 32, 16)
        assert dict(plan.pack.spec.constants)["N_PAD"] == 8, "the weight's N is padded to one tile"
    n16 = _g((2, 64, 20, 20), (64, 16, 3, 3), stride=2, padding=1)
    assert wgmma.forward_tile(n16, "forward", "float16").bn == 32
    assert "16x16x16" in {o.get("tile") for o in wgmma.options(n16, "forward", "float16")}
    # a grid too large along y for one N tile of 8 per group plans nothing
    many_groups = _g((1, 16 * 70000, 2, 2), (16 * 70000, 1, 1, 1), groups=70000)
    assert not wgmma.eligible(many_groups, "float16")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", SUITE)
def test_the_suite_layers_are_eligible(name, dtype):
    g = _suite_layer(name)
    assert wgmma.eligible(g, dtype)
    # unet_up2x2's output pixels each receive one tap: in NCHW the scatter GEMM runs its forward ahead of the halo
    # tiles (in channels_last they lead: NOTES v44)
    for layout in launch.LAYOUTS:
        first = scatter_gemm.FAMILY if scatter_gemm.one_tap(g) and layout == "nchw" else wgmma.FAMILY
        assert table.eligible("forward", g, dtype, layout)[0] is first
        assert table.candidates("forward", g, dtype, layout)[0] == Variant(first.name)
        assert WGMMA in table.candidates("forward", g, dtype, layout)
    # the depthwise layer of the suite is not
    assert not wgmma.eligible(_suite_layer("depthwise_up"), dtype)


@pytest.mark.parametrize("arch,runs", [("90", True), ("80", False), ("86", False), ("89", False), ("100", False),
                                       ("120", False)])
def test_only_an_sm_90_device_runs_the_family(arch, runs):
    with device.substitute(device.fake(0, name=f"Fake sm_{arch}", arch=arch)):
        dev = device.get(0)
        for layout in launch.LAYOUTS:
            names = [f.name for f in table.eligible("forward", DENSE, "float16", layout, dev)]
            assert ("wgmma" in names) == runs and "gemm" in names, names
            assert (table.candidates("forward", DENSE, "float16", layout, "strict", dev)[0] == WGMMA) == runs
            assert (wgmma.FAMILY in table.eligible("grad_input", DENSE, "float16", layout, dev)) == runs
            # grad_weight's wgmma kernel leads too (the dense layer's one stride phase has 15 taps)
            assert (wgmma.FAMILY in table.eligible("grad_weight", DENSE, "float16", layout, dev)) == runs
            assert table.eligible("grad_weight", DENSE, "float16", layout, dev)[0] is \
                (wgmma.FAMILY if runs else gemm.FAMILY)
        rec = Recorder(dev)
        engine.forward(DENSE, "float16", _X, _W, _B, _Y, rec, "nhwc", "strict")
        functions = {plan.spec.function for _, plan in rec.launches}
        assert (FUNCTION in functions) == runs and ("conv_transpose2d_igemm" in functions) != runs
        assert all(plan.spec.target == "" for _, plan in rec.launches if plan.spec.function != FUNCTION)
        rec = Recorder(dev)
        engine.grad_input(DENSE, "float16", _Y, _W, _X, rec, "nhwc", "strict")
        functions = {plan.spec.function for _, plan in rec.launches}
        assert (FUNCTION in functions) == runs and ("conv_transpose2d_igemm" in functions) != runs


def test_an_sm_90_without_wgmma_or_with_tensor_cores_off_keeps_the_gemms(monkeypatch):
    no_wgmma = device.fake(0, tensor_cores=device.MMA_SYNC)
    assert no_wgmma.arch == "90"
    assert [f.name for f in table.eligible("forward", DENSE, "float16", "nchw", no_wgmma)][:1] == ["gemm"]
    monkeypatch.setenv(gemm.TENSOR_CORES_ENV, "0")
    assert [f.name for f in table.eligible("forward", DENSE, "float16", "nchw") if f.name != "tiled"] == ["direct"]
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV)
    assert table.eligible("forward", DENSE, "float16", "nchw")[0] is wgmma.FAMILY


# ------------------------------------------------------------------------- tiles, options

def test_every_tile_fits_the_registers_and_the_warpgroups():
    assert wgmma.TILES, "no tiles"
    for name, t in wgmma.TILES.items():
        assert t.name == name
        assert t.accumulators <= 128, name
        assert t.warpgroups in (1, 2) and t.pixels % (64 * t.warpgroups) == 0, name
        # 64-pixel MMA blocks: 8 x 8 pixels, or 64 pixels of a one-row patch
        assert (t.tile_h % 8 == 0 and t.tile_w % 8 == 0) or (t.one_row and t.tile_w % 64 == 0), name
        assert t.bn in (8, 16, 32, 64, 128, 256), name
        # 64-row MMA blocks of 8 x 8 pixels, all of one image
        assert t.accumulators == t.pixels // (64 * t.warpgroups) * t.bn // 2
    assert "8x8x256" not in wgmma.TILES, "one warpgroup's 64 x 256 spilled"


def _check_options(g, pass_="forward"):
    opts = wgmma.options(g, pass_)
    assert opts[0] == {}, "the heuristic comes first"
    assert len({tuple(sorted(o.items())) for o in opts}) == len(opts), "no option twice"
    for o in opts[1:]:
        assert o and set(o) <= {"tile", "stages", "split"}, o
        if "split" in o:
            assert o == {"split": 1} and wgmma.heuristic_halo_splits(g, pass_) > 1, "one range against a split"
        if "tile" in o:
            assert wgmma.TILES[o["tile"]].accumulators <= 128
        if "stages" in o:
            assert o["stages"] in wgmma.STAGE_CHOICES and o["stages"] != wgmma.B_STAGES
    variants = wgmma.FAMILY.variants(pass_, g, "float16", "nchw", "strict")
    assert variants == [Variant.make("wgmma", **o) for o in opts] and variants[0] == WGMMA
    return [wgmma.TILES[o["tile"]] for o in opts if "tile" in o]


def test_options_list_the_heuristic_first_then_tiles_that_fit_the_layer():
    for g in RANDOM:
        if not wgmma.eligible(g, "float16"):
            continue
        sh, sw = g.params.stride
        grid_h, grid_w = cdiv(g.out_size[0], sh), cdiv(g.out_size[1], sw)
        for t in _check_options(g):
            assert t.tile_h <= 8 * cdiv(grid_h, 8) and t.tile_w <= 8 * cdiv(grid_w, 8), "no patch past the grid"
            if t.images > 1:
                assert grid_h <= t.tile_h and grid_w <= t.tile_w and g.batch >= t.images
            if t.bn > 64:
                assert g.out_per_group > t.bn // 2, "no N side twice the output channels"


# the audio rows of the benchmark suite (ConvTranspose1d as one input row) and a 2-D grid of three rows
ONE_D = ("vocoder_up8_1d", "audio_up2_1d")
THREE_ROWS = _g((2, 32, 3, 150), (32, 40, 3, 3), stride=2, padding=1, output_padding=1)


@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
def test_grids_of_few_rows_take_one_row_patches(pass_):
    """A destination grid under eight rows high fills an 8-row patch's MMA rows an eighth (a 1-D layer) to seven
    eighths: the heuristic takes one-row patches there, as wide as the 2-D tile's pixels and no wider than the
    row, and the options race one-row patches first."""
    for g in [_suite_layer(name) for name in ONE_D] + [THREE_ROWS]:
        grid_w = wgmma.dst_grid(g, pass_)[1]
        assert wgmma.rows_few(g, pass_)
        for dtype in ("float16", "bfloat16", "float32"):
            tile = wgmma.forward_tile(g, pass_, dtype)
            assert tile.one_row and tile.tile_w <= 8 * cdiv(grid_w, 8), (tile, g)
            # the N side a 2-D grid of the same channels gets, or 256 for 256 channels or more in 16 bits
            n = wgmma._channels(g, pass_)[1]
            square = geometry((2, g.in_channels, 40, 40), g.weight_shape, None, g.params)
            assert tile.bn == (256 if n >= 256 and dtype != "float32" else wgmma.forward_tile(square, pass_, dtype).bn)
        tiles = _check_options(g, pass_)
        first_2d = next((i for i, t in enumerate(tiles) if not t.one_row), len(tiles))
        assert first_2d > 0 and all(not t.one_row for t in tiles[first_2d:]), [t.name for t in tiles]
    # the vocoder's 8193-column phase grid (256 and 512 destination channels): 128 x 256 tiles, every MMA row
    # inside the grid; two taps a phase, so TF32 leads the mma.sync GEMM there (an 8-row patch had filled a
    # sixteenth of its rows)
    vocoder = _suite_layer("vocoder_up8_1d")
    tile = wgmma.forward_tile(vocoder, pass_, "float16")
    assert tile == wgmma.TILES["1x128x256"] and wgmma.tile_load(vocoder, tile, pass_)[1] > 0.99
    assert wgmma.forward_tile(vocoder, pass_, "float32") == wgmma.TILES["1x256x128"]
    assert wgmma.tf32_leads(vocoder, pass_)


def test_grids_of_eight_rows_or_more_keep_2d_patches():
    for g in [_suite_layer(name) for name in SUITE] + [r for r in RANDOM if wgmma.eligible(r, "float16")]:
        for pass_ in ("forward", "grad_input"):
            if wgmma.dst_grid(g, pass_)[0] >= 8:
                assert not wgmma.rows_few(g, pass_)
                assert not wgmma.forward_tile(g, pass_, "float16").one_row
                assert not any(wgmma.TILES[o["tile"]].one_row for o in wgmma.options(g, pass_) if "tile" in o)


def test_one_row_plan_constants():
    """A one-row patch plans TILE_H 1, its halo one phase plane row (plus the taps' span) by the patch's width
    plus theirs, and as many tiles as 256-column runs of the rows."""
    g = _suite_layer("vocoder_up8_1d", batch=2, size=(1, 1000))
    main = wgmma.plan_forward(g, "float16", True, "nchw", wgmma.TILES["1x256x128"]).gemm
    c = _constants(main)
    assert (c["TILE_H"], c["TILE_W"], c["HALO_H"], c["HALO_W"]) == (1, 256, 1, 257)
    assert main.grid[2] == 8 and main.grid[1] == 2, "eight stride phases, two N tiles of 128"
    assert main.grid[0] == min(2 * cdiv(1000, 256), 132 // 16)


def test_grad_weight_takes_one_row_steps_on_inputs_of_few_rows():
    """K steps of 1 x 64 pixels where the input is under eight rows high (a 1-D layer's one row filled an eighth
    of an 8 x 8 step), with the taps' tile as elsewhere, and only one-row options besides; 8 x 8 steps where
    the one-row halo would not fit, and on inputs of eight rows or more, whose options hold no one-row tile."""
    vocoder = _suite_layer("vocoder_up8_1d")
    assert wgmma.weight_rows_few(vocoder) and wgmma.weight_tile(vocoder) == wgmma.WEIGHT_TILES["64x128x2r1w64"]
    opts = wgmma.grad_weight_options(vocoder)[1:]
    assert opts and all(wgmma.WEIGHT_TILES[o["tile"]].one_row for o in opts), "one-row options only"
    split = wgmma.plan_grad_weight(vocoder, "float16")
    c = _constants(split.partial)
    assert (c["TILE_H"], c["TILE_W"]) == (1, 64)
    # K tiles: a 64-pixel run of the row for every image, split across blocks
    assert split.partial.scalars[-1] * split.partial.grid[2] >= 16 * cdiv(8192, 64)
    # three rows of a 3 x 3 kernel at stride 1: spans of two rows and columns, which still fit
    three = _g((4, 64, 3, 200), (64, 128, 3, 3), padding=1)
    assert wgmma.weight_rows_few(three) and wgmma.weight_tile(three).one_row
    # a dilation of 40 rows: the one-row halo's 81 rows do not fit, so 8 x 8 steps where those fit
    tall = _g((2, 64, 4, 100), (64, 64, 3, 1), dilation=(40, 1))
    assert wgmma.weight_rows_few(tall)
    row = wgmma.WEIGHT_TILES[wgmma.weight_tile(tall).name + "r1w64"]
    assert wgmma.weight_smem_bytes(tall, row, 3) > wgmma.SMEM_LIMIT and not wgmma.weight_tile(tall).one_row
    assert not any(wgmma.WEIGHT_TILES[o["tile"]].one_row for o in wgmma.grad_weight_options(tall) if o)
    for g in [_suite_layer(name) for name in SUITE] + [r for r in RANDOM if wgmma.grad_weight_eligible(r, "float16")]:
        if g.in_size[0] >= 8:
            assert not wgmma.weight_rows_few(g) and not wgmma.weight_tile(g).one_row
            assert not any(wgmma.WEIGHT_TILES[o["tile"]].one_row for o in wgmma.grad_weight_options(g) if o)


def test_suite_options():
    tiles = {name: {t.name for t in _check_options(_suite_layer(name))} for name in SUITE}
    # a small phase grid with a large batch tries several images a block; large grids do not
    assert {"4i8x8x128", "2i8x8x256"} <= tiles["dcgan_up"]
    assert not any("i" in t for t in tiles["asym_kernel"] | tiles["unet_up2x2"] | tiles["big_square"])
    assert "16x16x128" in tiles["asym_kernel"] and "16x8x256" not in tiles["asym_kernel"], "128 output channels"
    assert not any(wgmma.TILES[t].bn > 64 for t in tiles["big_square"]), "32 output channels"


def test_candidates_put_the_wgmma_heuristic_first_and_the_gemms_after():
    assert wgmma.FAMILY.passes == ("forward", "grad_input", "grad_weight")
    for name in SUITE:
        g = _suite_layer(name)
        for layout in launch.LAYOUTS:
            for pass_ in ("forward", "grad_input"):
                cands = table.candidates(pass_, g, "float16", layout)
                # a layer whose output pixels each receive one tap leads with the gather GEMM, and in NCHW with the
                # scatter GEMM (in channels_last the halo tiles lead its forward: NOTES v44); so does dcgan_up's
                # grad_input, of two taps a stride phase (overlap_leads)
                one_tap = scatter_gemm.one_tap(g)
                assert one_tap == (name == "unet_up2x2")
                scatter = (one_tap and (pass_ == "grad_input" or layout == "nchw")) or \
                    (pass_ == "grad_input" and name == "dcgan_up")
                assert cands[0] == (Variant("scatter_gemm") if scatter else WGMMA), (name, pass_)
                families = [v.family for v in cands]
                assert ("scatter_gemm" in families) == (one_tap or pass_ == "grad_input"), (name, pass_)
                order = ["scatter_gemm", "wgmma", "gemm", "direct", "tiled"] if scatter else \
                    ["wgmma", "scatter_gemm", "gemm", "direct", "tiled"]
                assert "gemm" in families and families == sorted(families, key=order.index)
                assert families.count("wgmma") <= wgmma.FAMILY.max_variants
            # grad_weight: the wgmma kernel leads where a stride phase has two taps or more, else the mma.sync
            # GEMM does and the wgmma tiles race it
            cands = table.candidates("grad_weight", g, "float16", layout)
            families = [v.family for v in cands]
            leader = "wgmma" if wgmma.weight_phases(g)[0] >= 2 else "gemm"
            assert cands[0].family == leader and {"wgmma", "gemm"} <= set(families), name
            order = [leader] + [f for f in ("wgmma", "gemm") if f != leader] + ["direct"]
            assert families == sorted(families, key=order.index)
        assert (wgmma.weight_phases(g)[0] >= 2) == (name in ("asym_kernel", "big_square", "dcgan_up")), name


@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
def test_tf32_sources_are_rounded_by_their_channels_last_copy(pass_):
    """An NCHW source's channels_last copy rounds TF32 words, so the kernel's producer hands each halo over as soon
    as it lands; a channels_last source is read in place and rounded by the producer.  3xTF32 (strict float32)
    keeps every bit, and a TF32 GEMM shares the rounded copy (it rounds its fragments the same way)."""
    g = _g((4, 64, 12, 12), (64, 48, 4, 4), stride=2, padding=1)
    plan = (wgmma.plan_forward(g, "float32", True, "nchw", precision="tf32") if pass_ == "forward"
            else wgmma.plan_grad_input(g, "float32", "nchw", precision="tf32"))
    assert dict(plan.to_channels_last.spec.constants)["ROUND_TF32"] is True
    assert dict(plan.gemm.spec.constants)["SRC_ROUNDED"] is True
    in_place = (wgmma.plan_forward(g, "float32", True, "nhwc", precision="tf32") if pass_ == "forward"
                else wgmma.plan_grad_input(g, "float32", "nhwc", precision="tf32"))
    assert in_place.to_channels_last is None and dict(in_place.gemm.spec.constants)["SRC_ROUNDED"] is False
    gemm_plan = {"forward": gemm.plan_forward_gemm(g, "float32", True, "nchw", "tf32"),
                 "grad_input": gemm.plan_grad_input_gemm(g, "float32", "nchw", "tf32")}[pass_]
    assert gemm_plan.to_channels_last is plan.to_channels_last, "one copy for both families"
    strict = {"forward": gemm.plan_forward_gemm(g, "float32", True, "nchw", "strict"),
              "grad_input": gemm.plan_grad_input_gemm(g, "float32", "nchw", "strict")}[pass_]
    assert dict(strict.to_channels_last.spec.constants)["ROUND_TF32"] is False


@pytest.mark.parametrize("pass_", ["forward", "grad_input"])
def test_a_channels_last_tf32_source_may_be_copied_rounded_first(pass_):
    """The ``copy`` option: a channels_last TF32 source is copied rounded (layout unchanged) into scratch, and the
    kernel reads the copy as it reads an NCHW source's rounding channels_last copy. Every TF32 channels_last option
    copies, the heuristic first, and in place is raced last; it applies to nothing else."""
    g = _g((4, 64, 12, 12), (64, 48, 4, 4), stride=2, padding=1)
    plan_of = wgmma.plan_forward if pass_ == "forward" else wgmma.plan_grad_input
    args = (g, "float32", True, "nhwc") if pass_ == "forward" else (g, "float32", "nhwc")
    copied = plan_of(*args, precision="tf32", copy=True)
    copy = copied.to_channels_last
    assert copy.spec.function == "round_tf32_copy"
    source = g.input_shape if pass_ == "forward" else g.output_shape
    assert copy.scalars == (math.prod(source),) and copy.scratch_bytes == 4 * math.prod(source)
    assert dict(copied.gemm.spec.constants)["SRC_ROUNDED"] is True
    in_place = plan_of(*args, precision="tf32")
    assert dict(in_place.gemm.spec.constants)["SRC_ROUNDED"] is False
    assert copied.gemm.spec != in_place.gemm.spec
    variants = wgmma.FAMILY.variants(pass_, g, "float32", "nhwc", "tf32")
    assert variants[0] == Variant.make("wgmma", copy=True) and variants[0].name == "wgmma:copy"
    assert variants[-1] == Variant.make("wgmma")
    assert all(v.kwargs.get("copy") for v in variants[:-1]) and len(variants) > 3
    assert [v.kwargs for v in variants[:-1]] == [dict(opts, copy=True)
                                                 for opts in wgmma.options(g, pass_, "float32", "tf32")]
    plan = table.plan(pass_, variants[0], g, "float32", "nhwc", "tf32", True, True)
    assert plan.to_channels_last is copy
    assert table.candidates(pass_, g, "float32", "nhwc", "tf32")[0] == variants[0] or not wgmma.tf32_leads(g, pass_)
    rec = Recorder(device.ASSUMED)
    rec.enter(pass_, variants[0])
    plan.run(rec, (1 << 32, 2 << 32, 3 << 32, 4 << 32)[:4 if pass_ == "forward" else 3])
    assert [stage for stage, _ in rec.launches][:2] == ["pack", "round_tf32_copy"]
    for dtype, layout, precision in (("float16", "nhwc", "strict"), ("float32", "nchw", "tf32"),
                                     ("float32", "nhwc", "strict")):
        assert Variant.make("wgmma", copy=True) not in wgmma.FAMILY.variants(pass_, g, dtype, layout, precision)
        with pytest.raises(ValueError, match="copy rounds a channels_last source to TF32"):
            plan_of(g, dtype, True, layout, precision=precision, copy=True) if pass_ == "forward" else \
                plan_of(g, dtype, layout, precision=precision, copy=True)


def test_tf32_leads_where_it_beat_the_gemm_on_the_h100():
    """float32 at TF32 precision: the wgmma kernel leads on the layers where it was faster than the mma.sync GEMM on
    the H100 and steps back, still racing, where it was slower (NOTES v13: the models' layers and the suite's);
    grad_input's gather GEMM leads them both where it leads in 16 bits (NOTES v46)."""
    pix2pix = _g((16, 512, 32, 32), (512, 128, 4, 4), stride=2, padding=1)
    dcgan_second = _g((128, 512, 4, 4), (512, 256, 4, 4), stride=2, padding=1)   # 4 x 4 grids: a quarter filled
    unet = _g((8, 1024, 16, 16), (1024, 512, 2, 2), stride=2)                    # one tap a stride phase
    dcgan_up = _g((64, 512, 8, 8), (512, 256, 4, 4), stride=2, padding=1)      # grad_input: 64 tiles
    expected = {(pix2pix, "forward"): True, (pix2pix, "grad_input"): True, (dcgan_second, "forward"): False,
                (dcgan_second, "grad_input"): False, (unet, "forward"): False, (unet, "grad_input"): False,
                (dcgan_up, "forward"): True, (dcgan_up, "grad_input"): False,
                (_suite_layer("asym_kernel"), "forward"): True, (_suite_layer("asym_kernel"), "grad_input"): True}
    assert wgmma.tile_load(dcgan_second, wgmma.forward_tile(dcgan_second, "forward", "float32")) == (256, 0.25)
    for (g, pass_), leads in expected.items():
        assert wgmma.tf32_leads(g, pass_) == leads, (g.input_shape, pass_)
        # ahead of both, where it takes the layer and leads: on the one-tap U-Net layer the scatter (gather) GEMM,
        # and on grad_input of the layers of two taps a phase with tiles for half the SMs the gather GEMM, in
        # fp16 and bf16 and (grad_input) TF32 alike
        for dtype, precision in (("float32", "tf32"), ("float16", "strict")):
            gathers = scatter_gemm.eligible(g, dtype, pass_, precision) and \
                scatter_gemm.FAMILY.leads(pass_, g, dtype, "nchw", precision)
            cands = table.candidates(pass_, g, dtype, "nchw", precision)
            other = "wgmma" if leads or dtype == "float16" else "gemm"
            assert cands[0].family == ("scatter_gemm" if gathers else other), (g.input_shape, pass_, dtype)
            assert {"wgmma", "gemm"} <= {v.family for v in cands} or dtype == "float16"
        assert [scatter_gemm.FAMILY.leads("grad_input", g, "float32", "nchw", "tf32")
                for g in (pix2pix, dcgan_second, unet, dcgan_up)] == [True] * 4
        strict = table.candidates(pass_, g, "float32", "nchw", "strict")
        assert strict[0].family == ("wgmma" if leads else "gemm"), "3xTF32 leads where TF32 does"


def test_every_option_of_the_suite_layers_plans():
    for name in SUITE:
        g = _suite_layer(name)
        for o in wgmma.options(g):
            for dtype in HALF:
                main = table.plan("forward", Variant.make("wgmma", **o), g, dtype, "nhwc", "strict", True).gemm
                assert main.spec.function == FUNCTION and main.smem_bytes <= wgmma.SMEM_LIMIT
                c = _constants(main)
                assert c["B_STAGES"] == o.get("stages", c["B_STAGES"]), "the weight ring asked for"
                if "tile" in o:
                    assert wgmma.HaloTile(c["TILE_IMAGES"], c["TILE_H"], c["TILE_W"], c["BN"]).name == o["tile"]


def test_wgmma_variant_names_round_trip():
    """A tuned choice is stored by name: every option must parse back to itself, and no two share a name."""
    for name in SUITE:
        variants = wgmma.FAMILY.variants("forward", _suite_layer(name), "float16", "nchw", "strict")
        assert len(variants) > 2
        for v in variants:
            assert Variant.parse(v.name) == v, v.name
        assert len({v.name for v in variants}) == len(variants)
    every = [Variant.make("wgmma", tile=t) for t in wgmma.TILES]
    every += [Variant.make("wgmma", stages=s) for s in wgmma.STAGE_CHOICES]
    every += [Variant.make("wgmma", tile=t, stages=s) for t in wgmma.TILES for s in wgmma.STAGE_CHOICES]
    assert all(Variant.parse(v.name) == v for v in every) and len({v.name for v in every}) == len(every)
    assert Variant.parse("wgmma:4i8x8x128") == Variant.make("wgmma", tile="4i8x8x128")
    copied = Variant.make("wgmma", tile="16x16x64", stages=6, split=2, copy=True)
    assert copied.name == "wgmma:16x16x64:s6:k2:copy" and Variant.parse(copied.name) == copied
    for bad in ("wgmma:copy:copy", "wgmma:copy:k2", "wgmma:copy:s6"):
        with pytest.raises(ValueError, match="not a cupyconv variant name"):
            Variant.parse(bad)


# ----------------------------------------------------------------------------- the plans

PLAN_CASES = [
    ("dense", DENSE, None),
    ("grouped_strided", _g((3, 48, 7, 9), (48, 20, 4, 3), stride=(2, 3), padding=(1, 0), groups=2, dilation=(1, 2),
                           output_padding=(1, 2)), None),
    ("empty_phases", _g((1, 16, 6, 5), (16, 136, 2, 3), stride=(3, 4)), None),
    # batch 5 on a 8 x 8 phase grid, four images a tile: the last tile holds one image
    ("multi_image", _g((5, 32, 8, 8), (32, 64, 4, 4), stride=2, padding=1), "4i8x8x64"),
    ("multi_image_big_grid", _g((5, 32, 11, 19), (32, 64, 3, 3)), "2i8x8x128"),
    ("dcgan_up", _suite_layer("dcgan_up", batch=6), None),
    ("unet_up2x2", _suite_layer("unet_up2x2", batch=2, size=(20, 24)), "8x16x256"),
    ("huge_64bit", _g((1, 16, 24000, 24000), (16, 16, 2, 2), stride=2), None),
]


@pytest.mark.parametrize("layout", launch.LAYOUTS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_shapes(case, dtype, layout):
    _, g, tile_name = case
    tile = wgmma.TILES[tile_name] if tile_name else wgmma.forward_tile(g)
    bias = dtype == "float16"
    packed = wgmma.plan_forward(g, dtype, bias, layout, wgmma.TILES[tile_name] if tile_name else None)
    main, pack = packed.gemm, packed.pack
    c = _constants(main)
    sh, sw = g.params.stride
    grid_h, grid_w = cdiv(g.out_size[0], sh), cdiv(g.out_size[1], sw)
    assert main.spec.template == TEMPLATE and main.spec.function == FUNCTION and main.spec.target == "sm_90a"
    assert (c["TILE_IMAGES"], c["TILE_H"], c["TILE_W"], c["BN"]) == (tile.images, tile.tile_h, tile.tile_w, tile.bn)
    # the consumer warpgroups that hold the accumulators, and one more that produces (copies)
    assert c["WARPGROUPS"] == tile.warpgroups and main.block == (128 * (tile.warpgroups + 1), 1, 1)
    assert c["MMA_KIND"] == {"float16": 0, "bfloat16": 1}[dtype]
    assert c["DST_CL"] == (layout == "nhwc") and c["HAS_BIAS"] == bias
    assert (c["HALO_H"], c["HALO_W"]) == wgmma.halo_extent(g, tile)
    assert c["B_STAGES"] == wgmma.B_STAGES and c["HALO_STAGES"] == wgmma.halo_stages(g, wgmma.B_STAGES)
    tiles = cdiv(g.batch, tile.images) * cdiv(grid_h, tile.tile_h) * cdiv(grid_w, tile.tile_w)
    # y: groups x N tiles; z: stride phases; x: persistent blocks walking the patches of the largest
    # (first) phase's grid, about one block per SM in all (132 on the assumed H100) and no more than patches
    split = c["SPLIT_K"]
    assert split == wgmma.halo_splits(g, dtype, tile, c["CK"], "forward", 132)
    others = g.groups * cdiv(g.out_per_group, tile.bn) * sh * sw * split
    assert main.grid == (min(tiles, max(1, 132 // others)), g.groups * cdiv(g.out_per_group, tile.bn), sh * sw * split)
    _check_split_reduce(packed, split, launch.numel(g.output_shape), g.out_channels,
                        1 if layout == "nhwc" else g.out_size[0] * g.out_size[1], dtype)
    assert main.scalars == (g.batch,) + g.in_size + g.out_size
    assert main.index_t == c["INDEX_T"] == ("long long" if max(launch.numel(g.input_shape),
                                                                launch.numel(g.output_shape)) >= 2 ** 31 else "int")
    # the weight, repacked as the kernel reads it: N padded to whole BN tiles, K to whole chunks
    p = _constants(pack)
    assert pack.spec.template == "pack_weight.cu" and pack.spec.target == ""
    assert p["MODE"] == 0 and p["TAPS"] == g.kernel[0] * g.kernel[1] and p["ELEMENT_BYTES"] == 2
    assert p["N_PAD"] % tile.bn == 0 and g.out_per_group <= p["N_PAD"] < g.out_per_group + tile.bn
    assert p["K_PAD"] % c["CK"] == 0 and g.in_per_group <= p["K_PAD"] < g.in_per_group + c["CK"]
    # ...as the kernel computes its strides: N_PAD = ceil(COUT_G / BN) * BN, K_PAD = ceil(CIN_G / CK) * CK
    assert p["N_PAD"] == cdiv(c["COUT_G"], c["BN"]) * c["BN"] and p["K_PAD"] == cdiv(c["CIN_G"], c["CK"]) * c["CK"]
    # one contiguous CK x BN tile per (n tile, chunk, tap), as the kernel's bulk copies read it
    assert (p["TILE_N"], p["TILE_K"]) == (c["BN"], c["CK"])
    assert pack.scratch_bytes == g.groups * p["TAPS"] * p["N_PAD"] * p["K_PAD"] * 2
    # an NCHW input is copied to channels_last first; a channels_last one is read in place
    if layout == "nchw":
        assert packed.to_channels_last == gemm.plan_to_channels_last(g.batch, g.in_channels,
                                                                     g.in_size[0] * g.in_size[1], dtype)
        assert dict(packed.to_channels_last.spec.constants)["ROUND_TF32"] is False and c["SRC_ROUNDED"] is False
    else:
        assert packed.to_channels_last is None
    assert packed.plans() == [p_ for p_ in (pack, packed.to_channels_last, main, packed.reduce) if p_ is not None]


def _check_split_reduce(packed, split, elements, channels, channel_stride, dtype):
    """A split plan writes fp32 partials of every destination element a range into scratch and reduces them in
    the destination's layout, adding the bias by channel; an unsplit one writes the destination itself."""
    main = packed.gemm
    if split == 1:
        assert packed.reduce is None and main.scratch_bytes == 0
        return
    assert main.scratch_bytes == split * elements * 4
    assert packed.reduce == reduction.plan_reduce_with_bias(dtype, elements, split, channels, channel_stride,
                                                            main.index_t)


def test_a_multi_image_tile_with_a_batch_it_does_not_divide():
    g = PLAN_CASES[3][1]
    assert (g.batch, cdiv(g.out_size[0], 2), cdiv(g.out_size[1], 2)) == (5, 8, 8)
    assert wgmma.forward_tile(g).images == 4 and {"tile": "4i8x8x64"} in wgmma.options(g)
    main = wgmma.plan_forward(g, "float16", True, "nchw", wgmma.TILES["4i8x8x64"]).gemm
    assert main.grid == (2, 1, 4)


def test_blocks_are_persistent_over_the_patches():
    """With more patches than SMs to spare, each block walks several: the grid follows the SM count."""
    g = _g((3, 64, 20, 20), (64, 264, 3, 3), stride=3, padding=1)   # 9 phases x 3 N tiles of 128
    tile = wgmma.forward_tile(g)
    sh, sw = g.params.stride
    patches = g.batch * cdiv(cdiv(g.out_size[0], sh), tile.tile_h) * cdiv(cdiv(g.out_size[1], sw), tile.tile_w)
    assert patches == 12
    for sm_count, blocks in ((132, 4), (27, 1), (10, 1), (2000, 12)):
        main = wgmma.plan_forward(g, "float16", True, "nhwc", None, None, sm_count).gemm
        assert main.grid == (blocks, 3, 9), sm_count
    # the pass table hands the device's SM count down
    assert table.plan("forward", WGMMA, g, "float16", "nhwc", "strict", True, True, 27).gemm.grid[0] == 1


@pytest.mark.parametrize("dtype", HALF)
def test_channels_last_with_unaligned_pointers_takes_the_gemm(dtype):
    g = _suite_layer("asym_kernel", batch=2, size=(24, 40))
    for v in wgmma.FAMILY.variants("forward", g, dtype, "nhwc", "strict"):
        plan = table.plan("forward", v, g, dtype, "nhwc", "strict", True, False)
        assert plan == gemm.plan_forward_gemm(g, dtype, True, "nhwc", aligned=False)
        assert [p.spec.template for p in plan.plans()] == ["pack_weight.cu", "conv_transpose2d_igemm.cu"]
        assert not _constants(plan.gemm)["A_VEC"]
        # aligned, or NCHW (read through its own, aligned channels_last copy): the wgmma kernel
        for layout, aligned in (("nhwc", True), ("nchw", False), ("nchw", True)):
            plan = table.plan("forward", v, g, dtype, layout, "strict", True, aligned)
            assert plan.gemm.spec.function == FUNCTION
    # and so does the engine, from the pointers it is handed
    for x, layout, function in ((_X, "nhwc", FUNCTION), (_X + 2, "nhwc", "conv_transpose2d_igemm"),
                                (_X + 2, "nchw", FUNCTION)):
        rec = Recorder(device.ASSUMED)
        engine.forward(g, dtype, x, _W, _B, _Y, rec, layout, "strict")
        assert rec.passes[-1].variant == WGMMA
        assert [plan.spec.function for stage, plan in rec.launches if stage == "main"] == [function]


@pytest.mark.parametrize("layout", launch.LAYOUTS)
def test_the_engine_launches_pack_copy_and_kernel(layout, monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    g = _suite_layer("dcgan_up", batch=6)
    rec = Recorder(device.ASSUMED)
    engine.forward(g, "bfloat16", _X, _W, _B, _Y, rec, layout, "strict")
    (forward,) = rec.passes
    assert forward.variant == WGMMA
    stages = [stage for stage, _ in forward.launches]
    assert stages == (["pack", "to_channels_last", "main"] if layout == "nchw" else ["pack", "main"])
    assert [plan for _, plan in forward.launches] == wgmma.plan_forward(g, "bfloat16", True, layout).plans()


def test_compile_ahead_lists_the_wgmma_kernels_on_sm_90_only():
    def functions(dev, layout):
        return {p.spec.function for p in table.all_plans(DENSE, "float16", True, layout, device=dev)}

    for layout in launch.LAYOUTS:
        assert FUNCTION in functions(device.ASSUMED, layout)
        assert FUNCTION not in functions(device.fake(0, arch="80"), layout)
    # channels_last lists the GEMM that runs for unaligned pointers as well
    assert "conv_transpose2d_igemm" in functions(device.ASSUMED, "nhwc")


# ---------------------------------------------------------------------------- grad_input
#
# grad_input is a strided conv2d of grad_output: grad_in row i reads grad_out rows SH*i - PH + kh*DH.
# The halo of a tile is stored as SH x SW stride-phase planes, the GEMM's N is the input channels
# per group and its K per tap grad_output's channels per group.

GRAD = "grad_input"


def _axis_halo_reads(tile_side, stride, padding, dilation, kernel, i0):
    """For the tile's destination rows i = i0 .. i0 + tile_side - 1 and every tap k: (k, plane, row in plane,
    i - i0) of the source row stride*i - padding + k*dilation, relative to the halo's origin
    stride*i0 - padding, straight from the definition."""
    origin = stride * i0 - padding
    reads = []
    for i in range(i0, i0 + tile_side):
        for k in range(kernel):
            offset = stride * i - padding + k * dilation - origin
            assert offset >= 0
            reads.append((k, offset % stride, offset // stride, i - i0))
    return reads


@pytest.mark.parametrize("tile", sorted(wgmma.TILES))
def test_grad_input_halo_covers_every_taps_source_rows_per_phase_plane(tile):
    t = wgmma.TILES[tile]
    for g in RANDOM:
        halo_h, halo_w = wgmma.halo_extent(g, t, GRAD)
        (kh, kw), (sh, sw) = g.kernel, g.params.stride
        (ph, pw), (dh, dw) = g.params.padding, g.params.dilation
        for side, s, p, d, k, extent in ((t.tile_h, sh, ph, dh, kh, halo_h), (t.tile_w, sw, pw, dw, kw, halo_w)):
            widest = 0
            for i0 in (0, side, 7 * side):   # the halo is relative to the tile's origin: any tile reads alike
                for tap, plane, row, u in _axis_halo_reads(side, s, p, d, k, i0):
                    # the kernel's tap table: plane tap*d % s, shifted by tap*d // s rows
                    assert (plane, row) == (tap * d % s, u + tap * d // s), g
                    assert 0 <= row < extent, g
                    widest = max(widest, row + 1)
            assert widest == extent, ("no more than the taps read", g)
    # one phase plane per stride phase, each of that size
    assert wgmma.phase_planes(DENSE, GRAD) == 4
    assert wgmma.phase_planes(DENSE) == wgmma.phase_planes(DENSE, "forward") == 1


def test_grad_input_pass_helpers():
    g = _g((3, 48, 7, 9), (48, 16, 4, 3), stride=(2, 3), padding=(1, 0), groups=2, dilation=(1, 2),
           output_padding=(1, 2))
    assert (g.in_per_group, g.out_per_group) == (24, 16)
    assert wgmma.phase_planes(g, GRAD) == 6
    # the destination is grad_in's own grid; the forward's is the first stride phase's
    assert wgmma.dst_grid(g, GRAD) == g.in_size
    assert wgmma.dst_grid(g) == (cdiv(g.out_size[0], 2), cdiv(g.out_size[1], 3))
    # every tap reads every destination pixel: no phases without taps
    assert wgmma.fewest_taps(g, GRAD) == 12
    assert wgmma.halo_stages(g, 4, GRAD) == max(2, min(4, cdiv(4, 12) + 1)) == 2
    # chunks of grad_output's channels per group (16 here), rounded to whole 32-byte MMA steps
    assert wgmma.chunk_channels(g, "float16", GRAD) == 16 and wgmma.chunk_channels(g, "float16") == 32
    wide = _g((2, 136, 9, 9), (136, 264, 3, 3), stride=2)
    assert wgmma.chunk_channels(wide, "float16", GRAD) == 64 and wgmma.chunk_channels(wide, "bfloat16", GRAD) == 64
    # shared memory: SH x SW planes of the per-plane halo per image, then the weight ring
    t = wgmma.TILES["16x16x64"]
    halo_h, halo_w = wgmma.halo_extent(g, t, GRAD)
    assert (halo_h, halo_w) == (16 + 3 * 1 // 2, 16 + 2 * 2 // 3)
    halo = 2 * ((t.images * 6 * halo_h * halo_w) | 1) * 16
    assert wgmma.smem_bytes(g, "float16", t, 16, 3, GRAD) == wgmma.halo_stages(g, 3, GRAD) * halo + 3 * 2 * 64 * 16
    for pass_ in ("grad_weight", "backward"):
        for helper in (wgmma.phase_planes, wgmma.dst_grid, wgmma.fewest_taps, wgmma.options):
            with pytest.raises(ValueError, match="forward and grad_input"):
                helper(g, pass_)
    with pytest.raises(ValueError, match="forward and grad_input"):
        wgmma.eligible(g, "float16", "backward")


@pytest.mark.parametrize("dtype", HALF)
def test_planned_grad_input_layers_stay_within_shared_memory(dtype):
    """As for the forward: each tile plans within SMEM_LIMIT with the largest chunk, then the deepest weight
    ring, that fit (the halo SH x SW phase planes), or does not fit at the smallest chunk and two buffers."""
    smallest = 32 // 2
    planned = refused = 0
    for g in RANDOM[1::3]:
        if not wgmma.eligible(g, dtype, GRAD):
            continue
        for t in wgmma.TILES.values():
            try:
                main = wgmma.plan_grad_input(g, dtype, "nhwc", t).gemm
            except ValueError:
                assert wgmma.smem_bytes(g, dtype, t, smallest, 2, GRAD) > wgmma.SMEM_LIMIT, (g, t)
                refused += 1
                continue
            planned += 1
            c = _constants(main)
            ck, b_stages = c["CK"], c["B_STAGES"]
            assert c["MODE"] == 1
            assert main.smem_bytes == wgmma.smem_bytes(g, dtype, t, ck, b_stages, GRAD, tma=c["TMA"]) \
                <= wgmma.SMEM_LIMIT
            assert c["HALO_STAGES"] == wgmma.halo_stages(g, b_stages, GRAD) >= 2
            assert ck % smallest == 0 and ck <= wgmma.chunk_channels(g, dtype, GRAD)
            assert 2 <= b_stages <= wgmma.B_STAGES
            tried = _chunks_tried(g, dtype, GRAD)
            assert ck in tried, "halved (in whole MMA steps) from the full chunk"
            for larger in tried[:tried.index(ck)]:
                assert wgmma.smem_bytes(g, dtype, t, larger, wgmma.B_STAGES, GRAD) > wgmma.SMEM_LIMIT, "largest chunk"
            if b_stages < wgmma.B_STAGES:
                assert ck == smallest and wgmma.smem_bytes(g, dtype, t, ck, b_stages + 1, GRAD) > wgmma.SMEM_LIMIT
            assert main.smem_bytes < 1 << 18
        # the heuristic tile is one that plans
        assert wgmma.plan_grad_input(g, dtype, "nhwc").gemm.smem_bytes <= wgmma.SMEM_LIMIT
    assert planned > 100 and refused > 0, (planned, refused)


@pytest.mark.parametrize("dtype", HALF)
def test_grad_input_eligibility_follows_grad_outputs_channels_per_group(dtype):
    """grad_input's source is grad_output: its channels per group (out_per_group) must be whole 16-byte
    groups, and both sides at least 16 channels a group."""
    def layer(cin, cout, groups=1):
        return _g((2, cin, 9, 11), (cin, cout // groups, 3, 3), stride=2, padding=1, groups=groups)

    both, forward_only, grad_only = layer(24, 40), layer(24, 20), layer(20, 32)
    assert wgmma.eligible(both, dtype) and wgmma.eligible(both, dtype, GRAD)
    # 24 in-channels and 20 out-channels a group: 40 bytes of grad_output per pixel, no whole 16-byte groups
    assert wgmma.eligible(forward_only, dtype) and not wgmma.eligible(forward_only, dtype, GRAD)
    # ...and the other way round: grad_in's 20 channels are only stored, element by element where odd
    assert not wgmma.eligible(grad_only, dtype) and wgmma.eligible(grad_only, dtype, GRAD)
    assert wgmma.eligible(layer(18, 16), dtype, GRAD) and wgmma.eligible(layer(17, 16), dtype, GRAD)
    # under 16 on either side: thin destinations are the forward's alone
    assert not wgmma.eligible(layer(8, 64), dtype, GRAD) and not wgmma.eligible(layer(64, 8), dtype, GRAD)
    assert not wgmma.eligible(layer(12, 64), dtype, GRAD)
    # per group, not in all
    assert wgmma.eligible(layer(48, 48, groups=3), dtype, GRAD)
    assert not wgmma.eligible(layer(64, 40, groups=2), dtype, GRAD), "20 grad_output channels a group"
    assert not wgmma.eligible(layer(64, 64, groups=8), dtype, GRAD), "8 channels a group"
    for layout in launch.LAYOUTS:
        for g, runs in ((both, True), (forward_only, False), (grad_only, True)):
            assert (table.eligible(GRAD, g, dtype, layout)[0] is wgmma.FAMILY) == runs, g
            assert (table.candidates(GRAD, g, dtype, layout)[0] == WGMMA) == runs
        assert table.eligible("forward", forward_only, dtype, layout)[0] is wgmma.FAMILY
        assert table.candidates(GRAD, forward_only, dtype, layout)[0] == GEMM
    assert not wgmma.eligible(both, "float64", GRAD)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", SUITE)
def test_the_suite_layers_run_grad_input_on_wgmma(name, dtype):
    g = _suite_layer(name)
    assert wgmma.eligible(g, dtype, GRAD)
    # unet_up2x2's output pixels each receive one tap, and dcgan_up's stride phases have two taps: the gather GEMM
    # runs their grad_input ahead of the halo tiles (which still race it)
    first = scatter_gemm.FAMILY if name in ("unet_up2x2", "dcgan_up") else wgmma.FAMILY
    for layout in launch.LAYOUTS:
        assert table.eligible(GRAD, g, dtype, layout)[0] is first
        assert table.candidates(GRAD, g, dtype, layout)[0] == Variant(first.name)
        assert WGMMA in table.candidates(GRAD, g, dtype, layout)
    assert not wgmma.eligible(_suite_layer("depthwise_up"), dtype, GRAD)


def test_grad_input_options():
    for g in RANDOM:
        if not wgmma.eligible(g, "float16", GRAD):
            continue
        grid_h, grid_w = g.in_size
        for t in _check_options(g, GRAD):
            assert t.tile_h <= 8 * cdiv(grid_h, 8) and t.tile_w <= 8 * cdiv(grid_w, 8), "no patch past grad_in"
            if t.images > 1:
                assert grid_h <= t.tile_h and grid_w <= t.tile_w and g.batch >= t.images
            if t.bn > 64:
                assert g.in_per_group > t.bn // 2, "no N side twice grad_in's channels"
    tiles = {name: {t.name for t in _check_options(_suite_layer(name), GRAD)} for name in SUITE}
    # grad_in's grid is the input's: dcgan_up's 8 x 8 input with a batch of 64 tries several images a block
    assert {"4i8x8x128", "2i8x8x256"} <= tiles["dcgan_up"]
    assert not any("i" in t for t in tiles["asym_kernel"] | tiles["unet_up2x2"] | tiles["big_square"])
    # asym_kernel's grad_in has 64 channels: no 128-wide N side (its forward has 128 output channels)
    assert not any(wgmma.TILES[t].bn > 64 for t in tiles["asym_kernel"])
    assert "16x16x128" in tiles["unet_up2x2"] and "16x8x256" in tiles["unet_up2x2"], "256 grad_in channels"


def test_every_grad_input_option_of_the_suite_layers_plans_or_is_no_candidate():
    """Each option plans, or (a tile whose SH x SW halo planes cannot fit: outpad_up3x's 32 x 16 patches at
    stride 3) is refused and so left out of the candidates."""
    refused = []
    for name in SUITE:
        g = _suite_layer(name)
        variants = wgmma.FAMILY.variants(GRAD, g, "float16", "nchw", "strict")
        assert all(Variant.parse(v.name) == v for v in variants) and len({v.name for v in variants}) == len(variants)
        for o in wgmma.options(g, GRAD):
            for dtype in HALF:
                v = Variant.make("wgmma", **o)
                tile = wgmma.TILES[o["tile"]] if "tile" in o else wgmma.forward_tile(g, GRAD, dtype)
                try:
                    main = table.plan(GRAD, v, g, dtype, "nhwc", "strict").gemm
                except ValueError:
                    smallest = wgmma.smem_bytes(g, dtype, tile, 16, o.get("stages", min(wgmma.STAGE_CHOICES)), GRAD)
                    assert smallest > wgmma.SMEM_LIMIT, (name, o)
                    assert all(v not in table.candidates(GRAD, g, dtype, layout) for layout in launch.LAYOUTS)
                    refused.append((name, v.name))
                    continue
                assert main.spec.function == FUNCTION and main.smem_bytes <= wgmma.SMEM_LIMIT
                c = _constants(main)
                assert c["MODE"] == 1 and not c["HAS_BIAS"] and main.grid[2] == 1
                assert c["B_STAGES"] == o.get("stages", c["B_STAGES"]), "the weight ring asked for"
                if "tile" in o:
                    assert wgmma.HaloTile(c["TILE_IMAGES"], c["TILE_H"], c["TILE_W"], c["BN"]).name == o["tile"]
    assert {name for name, _ in refused} <= {"outpad_up3x"}, refused


GRAD_PLAN_CASES = [
    ("dense", DENSE, None),
    # 24 -> 16 channels a group: K of 16 (one chunk), N of 24 in a 32-wide tile
    ("grouped_strided", _g((3, 48, 7, 9), (48, 16, 4, 3), stride=(2, 3), padding=(1, 0), groups=2, dilation=(1, 2),
                           output_padding=(1, 2)), None),
    ("stride3_k3", _g((2, 32, 10, 13), (32, 40, 3, 3), stride=3, padding=1, output_padding=2), None),
    # a 2 x 3 kernel at stride 3 x 4: twelve phase planes of the tile's own size
    ("kernel_under_stride", _g((1, 16, 6, 5), (16, 136, 2, 3), stride=(3, 4)), None),
    # batch 5 on an 8 x 8 input, four images a tile: the last tile holds one image
    ("multi_image", _g((5, 64, 8, 8), (64, 32, 4, 4), stride=2, padding=1), "4i8x8x64"),
    # 136 grad_in channels (two N tiles of 128) from 264 grad_output channels (five chunks of 64)
    ("wide_channels", _g((2, 136, 9, 9), (136, 264, 3, 3), stride=2), None),
    ("dcgan_up", _suite_layer("dcgan_up", batch=6), None),
    ("unet_up2x2", _suite_layer("unet_up2x2", batch=2, size=(20, 24)), "8x16x256"),
    ("huge_64bit", _g((1, 16, 24000, 24000), (16, 16, 2, 2), stride=2), None),
]


@pytest.mark.parametrize("layout", launch.LAYOUTS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", GRAD_PLAN_CASES, ids=[c[0] for c in GRAD_PLAN_CASES])
def test_grad_input_plan_shapes(case, dtype, layout):
    _, g, tile_name = case
    assert wgmma.eligible(g, dtype, GRAD)
    tile = wgmma.TILES[tile_name] if tile_name else wgmma.forward_tile(g, GRAD, dtype)
    packed = wgmma.plan_grad_input(g, dtype, layout, wgmma.TILES[tile_name] if tile_name else None)
    main, pack = packed.gemm, packed.pack
    c = _constants(main)
    assert main.spec.template == TEMPLATE and main.spec.function == FUNCTION and main.spec.target == "sm_90a"
    assert c["MODE"] == 1 and c["HAS_BIAS"] is False, "grad_input has no bias"
    assert (c["TILE_IMAGES"], c["TILE_H"], c["TILE_W"], c["BN"]) == (tile.images, tile.tile_h, tile.tile_w, tile.bn)
    assert c["WARPGROUPS"] == tile.warpgroups and main.block == (128 * (tile.warpgroups + 1), 1, 1)
    assert c["MMA_KIND"] == {"float16": 0, "bfloat16": 1}[dtype] and c["DST_CL"] == (layout == "nhwc")
    assert (c["HALO_H"], c["HALO_W"]) == wgmma.halo_extent(g, tile, GRAD)
    ck = c["CK"]
    assert c["B_STAGES"] == wgmma.B_STAGES and c["HALO_STAGES"] == wgmma.halo_stages(g, wgmma.B_STAGES, GRAD)
    assert main.smem_bytes == wgmma.smem_bytes(g, dtype, tile, ck, wgmma.B_STAGES, GRAD) <= wgmma.SMEM_LIMIT
    # y: groups x N tiles of grad_in's channels; z: one (no stride phases); x: persistent blocks over the
    # patches of grad_in's grid, about one block per SM in all and no more than patches
    tiles = cdiv(g.batch, tile.images) * cdiv(g.in_size[0], tile.tile_h) * cdiv(g.in_size[1], tile.tile_w)
    n_tiles = cdiv(g.in_per_group, tile.bn)
    split = c["SPLIT_K"]
    assert split == wgmma.halo_splits(g, dtype, tile, ck, GRAD, 132)
    assert main.grid == (min(tiles, max(1, 132 // (g.groups * n_tiles * split))), g.groups * n_tiles, split)
    _check_split_reduce(packed, split, launch.numel(g.input_shape), g.in_channels,
                        1 if layout == "nhwc" else g.in_size[0] * g.in_size[1], dtype)
    # the kernel's source is grad_output, its destination grad_in
    assert main.scalars == (g.batch,) + g.out_size + g.in_size
    assert main.index_t == c["INDEX_T"] == ("long long" if max(launch.numel(g.input_shape),
                                                                launch.numel(g.output_shape)) >= 2 ** 31 else "int")
    # the weight packed for grad_input (n = input channel, k = output channel), tile by tile
    p = _constants(pack)
    assert pack.spec.template == "pack_weight.cu" and pack.spec.target == ""
    assert p["MODE"] == 1 and p["TAPS"] == g.kernel[0] * g.kernel[1] and p["ELEMENT_BYTES"] == 2
    assert (p["TILE_N"], p["TILE_K"]) == (tile.bn, ck) == (c["BN"], c["CK"])
    assert p["N_PAD"] % tile.bn == 0 and g.in_per_group <= p["N_PAD"] < g.in_per_group + tile.bn
    assert p["K_PAD"] % ck == 0 and g.out_per_group <= p["K_PAD"] < g.out_per_group + ck
    # ...as the kernel computes its strides in MODE 1: N_PAD = ceil(CIN_G / BN) * BN, K_PAD = ceil(COUT_G / CK) * CK
    assert p["N_PAD"] == cdiv(c["CIN_G"], c["BN"]) * c["BN"] and p["K_PAD"] == cdiv(c["COUT_G"], ck) * ck
    assert pack.scratch_bytes == g.groups * p["TAPS"] * p["N_PAD"] * p["K_PAD"] * 2
    # an NCHW grad_output is copied to channels_last first (its channels and pixels); channels_last is read in place
    if layout == "nchw":
        assert packed.to_channels_last == gemm.plan_to_channels_last(g.batch, g.out_channels,
                                                                     g.out_size[0] * g.out_size[1], dtype)
    else:
        assert packed.to_channels_last is None
    assert packed.plans() == [p_ for p_ in (pack, packed.to_channels_last, main, packed.reduce) if p_ is not None]
    # the pass table plans the same for the heuristic variant
    if tile_name is None:
        assert table.plan(GRAD, WGMMA, g, dtype, layout, "strict") == packed


def test_grad_input_blocks_are_persistent_over_the_patches():
    g = _g((3, 264, 20, 20), (264, 64, 3, 3), stride=3, padding=1)   # 264 grad_in channels: 3 N tiles of 128
    tile = wgmma.forward_tile(g, GRAD)
    assert tile.bn == 128 and cdiv(g.in_per_group, tile.bn) == 3
    patches = g.batch * cdiv(20, tile.tile_h) * cdiv(20, tile.tile_w)
    assert patches == 12
    for sm_count, blocks in ((132, 12), (27, 9), (10, 3), (2, 1), (2000, 12)):
        main = wgmma.plan_grad_input(g, "float16", "nhwc", None, None, sm_count).gemm
        assert main.grid == (blocks, 3, 1), sm_count
    assert table.plan(GRAD, WGMMA, g, "float16", "nhwc", "strict", False, True, 10).gemm.grid == (3, 3, 1)


@pytest.mark.parametrize("dtype", HALF)
def test_the_grad_input_heuristic_falls_back_to_a_tile_that_fits(dtype):
    """Four phase planes of 16 x 16 (stride 4) or a halo 45 rows wide (dilation 45) overflow shared memory
    for the preferred 16 x 16 patch: the heuristic takes, among the fitting tiles no wider in N than the
    preferred one (all fitting tiles if there are none), the one of the most pixels, then the N side nearest
    the preferred one, and one-row patches only where no 2-D one fits (these grids have 20 and more rows); the
    layer still runs wgmma; where nothing fits, it is not eligible."""
    for g, preferred in ((_g((2, 64, 20, 20), (64, 32, 4, 4), stride=4), "16x16x64"),
                         (_g((2, 16, 40, 40), (16, 128, 2, 2), dilation=45), "16x16x32")):
        assert not wgmma._fits(g, dtype, wgmma.TILES[preferred], GRAD)
        fitting = [t for t in wgmma.TILES.values() if wgmma._fits(g, dtype, t, GRAD) and not t.one_row]
        bn = wgmma.TILES[preferred].bn
        narrow = [t for t in fitting if t.bn <= bn] or fitting
        tile = wgmma.forward_tile(g, GRAD, dtype)
        assert tile in narrow and tile.pixels == max(t.pixels for t in narrow)
        assert abs(tile.bn - bn) == min(abs(t.bn - bn) for t in narrow if t.pixels == tile.pixels)
        assert wgmma.eligible(g, dtype, GRAD) and table.eligible(GRAD, g, dtype, "nchw")[0] is wgmma.FAMILY
        main = wgmma.plan_grad_input(g, dtype, "nhwc").gemm
        assert wgmma.HaloTile(*(_constants(main)[k] for k in ("TILE_IMAGES", "TILE_H", "TILE_W", "BN"))) == tile
        assert main.smem_bytes <= wgmma.SMEM_LIMIT
        with pytest.raises(ValueError, match="does not fit shared memory"):
            wgmma.plan_grad_input(g, dtype, "nhwc", wgmma.TILES[preferred])
        rec = Recorder(device.ASSUMED)
        engine.grad_input(g, dtype, _Y, _W, _X, rec, "nchw", "strict")
        assert [plan.spec.function for stage, plan in rec.launches if stage == "main"] == [FUNCTION]
    # the forward of the stride-4 layer keeps its preferred tile: one phase plane
    g = _g((2, 64, 20, 20), (64, 32, 4, 4), stride=4)
    assert wgmma._fits(g, dtype, wgmma.forward_tile(g, "forward", dtype), "forward")
    # no tile fits at all: not eligible, forward_tile says so, and the GEMM runs grad_input
    assert not wgmma.eligible(NO_TILE_FITS, dtype, GRAD)
    with pytest.raises(ValueError, match="no wgmma tile"):
        wgmma.forward_tile(NO_TILE_FITS, GRAD, dtype)
    rec = Recorder(device.ASSUMED)
    engine.grad_input(NO_TILE_FITS, dtype, _Y, _W, _X, rec, "nchw", "strict")
    assert [plan.spec.function for stage, plan in rec.launches if stage == "main"] == ["conv_transpose2d_igemm"]


@pytest.mark.parametrize("dtype", HALF)
def test_channels_last_grad_input_with_unaligned_pointers_takes_the_gemm(dtype):
    g = _suite_layer("asym_kernel", batch=2, size=(24, 40))
    for v in wgmma.FAMILY.variants(GRAD, g, dtype, "nhwc", "strict"):
        plan = table.plan(GRAD, v, g, dtype, "nhwc", "strict", False, False)
        assert plan == gemm.plan_grad_input_gemm(g, dtype, "nhwc", aligned=False)
        assert [p.spec.function for p in plan.plans()] == ["pack_weight", "conv_transpose2d_igemm"]
        assert _constants(plan.gemm)["MODE"] == 1 and not _constants(plan.gemm)["A_VEC"]
        for layout, aligned in (("nhwc", True), ("nchw", False), ("nchw", True)):
            plan = table.plan(GRAD, v, g, dtype, layout, "strict", False, aligned)
            assert plan.gemm.spec.function == FUNCTION and _constants(plan.gemm)["MODE"] == 1
    # the engine, from the pointers it is handed: grad_output's and grad_in's
    for go, gx, layout, function in ((_Y, _X, "nhwc", FUNCTION), (_Y + 2, _X, "nhwc", "conv_transpose2d_igemm"),
                                     (_Y, _X + 2, "nhwc", "conv_transpose2d_igemm"), (_Y + 2, _X, "nchw", FUNCTION)):
        rec = Recorder(device.ASSUMED)
        engine.grad_input(g, dtype, go, _W, gx, rec, layout, "strict")
        assert rec.passes[-1].name == GRAD and rec.passes[-1].variant == WGMMA
        assert [plan.spec.function for stage, plan in rec.launches if stage == "main"] == [function]


@pytest.mark.parametrize("layout", launch.LAYOUTS)
def test_the_engine_launches_pack_copy_and_grad_input_kernel(layout, monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    # dcgan_up's 4 x 4 stride 2 at 32 images (at 6 the layer is weight-bound and the split GEMM leads:
    # test_split_gemm_leads_weight_bound_grids) of 96 input channels (from 128 the gather GEMM leads,
    # scatter_gemm.overlap_leads)
    g = _g((32, 96, 8, 8), (96, 256, 4, 4), stride=2, padding=1)
    rec = Recorder(device.ASSUMED)
    engine.grad_input(g, "bfloat16", _Y, _W, _X, rec, layout, "strict")
    (grad,) = rec.passes
    assert grad.name == GRAD and grad.variant == WGMMA
    stages = [stage for stage, _ in grad.launches]
    assert stages == (["pack", "to_channels_last", "main"] if layout == "nchw" else ["pack", "main"])
    assert [plan for _, plan in grad.launches] == wgmma.plan_grad_input(g, "bfloat16", layout).plans()
    # the backward shares the NCHW grad_output's copy with grad_weight's wgmma kernel (4x4 stride 2: four taps a
    # stride phase, so it leads)
    rec = Recorder(device.ASSUMED)
    engine.backward(g, "bfloat16", _Y, _X, _W, _GX, _GW, None, rec, layout, "strict")
    assert [(p.name, p.variant.family) for p in rec.passes] == [(GRAD, "wgmma"), ("grad_weight", "wgmma")]
    assert any(plan.spec.function == "reduce_tap_major_partials" for _, plan in rec.launches)
    copies = [plan for _, plan in rec.launches if plan.spec.function == "to_channels_last"]
    assert [p.scalars[1] for p in copies] == ([g.out_channels, g.in_channels] if layout == "nchw" else [])


def test_compile_ahead_lists_the_grad_input_kernels_on_sm_90_only():
    def modes(dev, layout):
        return {dict(p.spec.constants)["MODE"] for p in table.all_plans(DENSE, "float16", True, layout, device=dev)
                if p.spec.function == FUNCTION}

    for layout in launch.LAYOUTS:
        assert modes(device.ASSUMED, layout) == {0, 1}
        assert modes(device.fake(0, arch="80"), layout) == set()


# ------------------------------------------------------------------------ grad_weight

def test_grad_weight_groups_the_taps_of_a_stride_phase():
    # 4 x 4, stride 2, padding 1: rows 1 and 3 (shifts 0 and 1) share phase 0, rows 0 and 2 (-1 and 0) phase 1
    assert wgmma.weight_phases(_g((2, 64, 8, 8), (64, 64, 4, 4), stride=2, padding=1)) == (4, 1, 1)
    # kernel == stride: one tap a phase, no spread
    assert wgmma.weight_phases(_g((2, 64, 8, 8), (64, 64, 2, 2), stride=2)) == (1, 0, 0)
    # stride 1: one phase of every tap
    assert wgmma.weight_phases(_g((2, 64, 8, 8), (64, 64, 3, 5))) == (15, 2, 4)
    # dilation 2 at stride 2: all three rows in one phase, shifts -1, 0, 1
    assert wgmma.weight_phases(_g((2, 64, 8, 8), (64, 64, 3, 1), stride=2, padding=1, dilation=2)) == (3, 2, 0)


def test_grad_weight_heuristic_tiles_and_options():
    four = _g((2, 128, 8, 8), (128, 64, 4, 4), stride=2, padding=1)
    assert wgmma.weight_tile(four).name == "64x64x4"
    assert wgmma.weight_tile(_g((2, 64, 8, 8), (64, 64, 3, 1), stride=2, padding=1, dilation=2)).name == "64x128x2"
    assert wgmma.weight_tile(_g((2, 256, 8, 8), (256, 128, 2, 2), stride=2)).name == "128x128x1"
    options = wgmma.grad_weight_options(four)
    assert options[0] == {} and len({o.get("tile") for o in options}) == len(options)
    # no tile of four taps for a layer whose phases have one, and no 128-channel side for 64 channels or fewer
    one = _g((2, 64, 8, 8), (64, 64, 2, 2), stride=2)
    names = {o.get("tile") for o in wgmma.grad_weight_options(one)}
    assert not any(wgmma.WEIGHT_TILES[n].taps > 1 or wgmma.WEIGHT_TILES[n].bm > 64 for n in names if n)


def test_grad_weight_eligibility():
    g = _g((2, 64, 8, 8), (64, 48, 4, 4), stride=2, padding=1)
    assert wgmma.grad_weight_eligible(g, "float16") and wgmma.grad_weight_eligible(g, "bfloat16")
    assert wgmma.grad_weight_eligible(g, "float32") and wgmma.grad_weight_eligible(g, "float32", "tf32")
    assert not wgmma.grad_weight_eligible(g, "float64")
    assert not wgmma.grad_weight_eligible(_g((2, 60, 8, 8), (60, 48, 4, 4), stride=2), "float16"), "runs of 8"
    assert not wgmma.grad_weight_eligible(_g((2, 64, 8, 8), (64, 12, 4, 4), stride=2), "float16"), "16 or more"
    assert wgmma.eligible(g, "float16", "grad_weight") == wgmma.grad_weight_eligible(g, "float16")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_grad_weight_plans_a_split_k_over_pixel_tiles(layout):
    g = _g((8, 128, 32, 32), (128, 64, 4, 4), stride=2, padding=1, groups=2)
    split = wgmma.plan_grad_weight(g, "float16", 132, layout)
    tile = wgmma.weight_tile(g)
    assert (tile.bm, tile.bn, tile.taps) == (64, 64, 4)
    phase_taps = wgmma.weight_phases(g)[0]
    blocks_x, channel_tiles, splits = split.partial.grid
    assert blocks_x == 2 * 4 * cdiv(phase_taps, tile.taps) and channel_tiles == 1
    k_tiles = 8 * cdiv(32, wgmma.WEIGHT_TILE_H) * cdiv(32, 8)
    per_split = split.partial.scalars[-1]
    assert splits == cdiv(k_tiles, per_split) and splits > 1 and split.reduce is not None
    assert split.partial.scratch_bytes == splits * 128 * 64 * 16 * 4   # fp32 partials of the whole weight
    # per stage the x tile's 64 pixels and the 9 x 9 halo, a 128-byte row a pixel (one 64-channel block each),
    # in whole 1024-byte swizzle periods, and one period to align the ring
    assert split.partial.smem_bytes == (wgmma.WEIGHT_STAGES * cdiv((64 + 81) * 128, 1024) + 1) * 1024 \
        <= wgmma.SMEM_LIMIT
    assert (split.sources is not None) == (layout == "nchw"), "NCHW sources are copied to channels_last first"
    constants = dict(split.partial.spec.constants)
    assert constants["SINGLE_CHUNK"] is False and constants["TAP_CHUNKS"] == 1
    assert split.reduce.spec.function == "reduce_tap_major_partials", "the partials are tap-major"
    assert split.reduce.scalars == (128 * 64, splits) and dict(split.reduce.spec.constants)["TAPS"] == 16
    # one pixel tile of a 4x4 kernel: a single K range, whose tap-major partial still needs the reduce's transpose
    small = wgmma.plan_grad_weight(_g((1, 64, 8, 8), (64, 64, 4, 4), stride=2, padding=1), "float16", 132, "nhwc")
    assert small.partial.grid[2] == 1 and small.reduce.scalars == (64 * 64, 1)
    assert small.partial.scratch_bytes == 64 * 64 * 16 * 4
    # a single K range of a one-tap layer: both layouts agree, and it writes grad_weight itself
    one_tap = wgmma.plan_grad_weight(_g((1, 64, 8, 8), (64, 64, 1, 1), stride=2), "float16", 132, "nhwc")
    assert one_tap.partial.grid[2] == 1 and one_tap.reduce is None
    assert dict(one_tap.partial.spec.constants)["SINGLE_CHUNK"] is True and one_tap.partial.scratch_bytes == 0


def test_halos_come_through_the_copy_engine_where_the_producer_need_not_touch_them():
    """A 128-byte chunk of a channels_last source (16-bit, or TF32 words its copy rounded) lands by the copy engine
    in boxes of one phase plane: the forward's halo as it is, grad_input's walked at the stride, each plane on a
    whole swizzle period.  Sources the producer rounds or splits, and chunks that would run into the next group,
    stay on cp.async."""
    g = _g((16, 1024, 8, 8), (1024, 512, 4, 4), stride=2, padding=1)
    forward = wgmma.plan_forward(g, "bfloat16", True, layout="nhwc").gemm
    c = dict(forward.spec.constants)
    (src,) = forward.tensor_maps
    assert c["TMA"] is True and c["CK"] == 64 and src.pointer == 0
    assert (src.dims, src.strides) == ((1024, 8, 8, 16), (2048, 16384, 131072))
    assert (src.box, src.element_strides) == ((64, c["HALO_W"], c["HALO_H"], 1), (1, 1, 1, 1))
    plane = cdiv(c["HALO_H"] * c["HALO_W"] * 128, 1024) * 1024
    halos = c["HALO_STAGES"] * c["TILE_IMAGES"] * plane
    weight = c["B_STAGES"] * c["BN"] * 128
    assert forward.smem_bytes == cdiv(halos, 1024) * 1024 + weight + 1024, "padded planes and room to align"
    grad = wgmma.plan_grad_input(g, "bfloat16", layout="nhwc").gemm
    c = dict(grad.spec.constants)
    (src,) = grad.tensor_maps
    assert c["TMA"] is True and src.dims == (512, 16, 16, 16)
    assert (src.box, src.element_strides) == ((64, 2 * c["HALO_W"], 2 * c["HALO_H"], 1), (1, 2, 2, 1))
    # TF32: through the rounding channels_last copy only; 3xTF32's producer splits every halo
    assert dict(wgmma.plan_forward(g, "float32", True, layout="nchw", precision="tf32").gemm.spec.constants)["TMA"]
    for layout, precision in (("nhwc", "tf32"), ("nchw", "strict")):
        plan = wgmma.plan_forward(g, "float32", True, layout=layout, precision=precision).gemm
        assert plan.tensor_maps == () and dict(plan.spec.constants)["TMA"] is False
    # two groups of 96 input channels: the second 64-channel chunk of a group would read the next group's
    grouped = wgmma.plan_forward(_g((4, 192, 8, 8), (192, 64, 4, 4), stride=2, padding=1, groups=2), "float16",
                                 False, layout="nhwc").gemm
    assert dict(grouped.spec.constants)["CK"] == 64 and grouped.tensor_maps == ()


def test_grad_weight_tiles_come_through_the_copy_engine_where_it_takes_them():
    """pix2pix's 16 x 1024 x 8² layer: x in boxes of 64 channels x the 8 x 8 tile, grad_output in boxes of 64
    channels x the 9 x 9 halo walked at the stride; a producer warpgroup beside the consumers.  Strides past 8
    leave the tiles to cp.async."""
    g = _g((16, 1024, 8, 8), (1024, 512, 4, 4), stride=2, padding=1)
    split = wgmma.plan_grad_weight(g, "bfloat16", 132, "nhwc")
    x_map, go_map = split.partial.tensor_maps
    assert (x_map.pointer, x_map.dims, x_map.strides) == (0, (1024, 8, 8, 16), (2048, 16384, 131072))
    assert (x_map.box, x_map.element_strides) == ((64, 8, 8, 1), (1, 1, 1, 1))
    assert (go_map.pointer, go_map.dims, go_map.strides) == (1, (512, 16, 16, 16), (1024, 16384, 262144))
    assert (go_map.box, go_map.element_strides) == ((64, 18, 18, 1), (1, 2, 2, 1))
    constants = dict(split.partial.spec.constants)
    assert constants["TMA"] is True and (constants["WARPGROUPS"], constants["BN"]) == (1, 64)
    assert x_map.box_bytes + go_map.box_bytes == (64 + 81) * 128, "what the kernel expects a stage to land"
    # one consumer warpgroup and the producer, two blocks an SM; two consumers hold an SM alone
    assert split.partial.block == (256, 1, 1) and constants["MIN_BLOCKS"] == 2
    wide = wgmma.plan_grad_weight(g, "bfloat16", 132, "nhwc", wgmma.WEIGHT_TILES["128x128x1"])
    assert wide.partial.block == (384, 1, 1) and dict(wide.partial.spec.constants)["MIN_BLOCKS"] == 1
    assert [m.box for m in wide.partial.tensor_maps] == [(64, 8, 8, 1), (64, 18, 18, 1)]
    far = wgmma.plan_grad_weight(_g((2, 64, 8, 8), (64, 64, 9, 9), stride=9), "float16", 132, "nhwc")
    assert far.partial.tensor_maps == () and dict(far.partial.spec.constants)["TMA"] is False


@pytest.mark.parametrize("tf32", [False, True])
def test_grad_weight_partials_of_a_channels_last_weight_are_in_its_layout(tf32):
    """A channels_last weight's own layout keeps a warp's output channels together as tap-major does, so its
    partials are written in it: an elementwise reduce, and a single K range of many taps writes grad_weight
    itself, with no scratch and no reduce launch."""
    def plan(g):
        return wgmma.plan_grad_weight_tf32(g, 132, "nhwc") if tf32 else wgmma.plan_grad_weight(g, "float16", 132,
                                                                                                "nhwc")
    big = _g((8, 128, 32, 32), (128, 64, 4, 4), stride=2, padding=1, groups=2)
    contiguous, cl = plan(big), plan(big.with_weight_channels_last())
    assert cl.partial.grid == contiguous.partial.grid and cl.partial.scratch_bytes == contiguous.partial.scratch_bytes
    splits = cl.partial.grid[2]
    assert splits > 1 and dict(cl.partial.spec.constants)["WEIGHT_CL"] is True
    assert contiguous.reduce.spec.function == "reduce_tap_major_partials"
    assert cl.reduce.spec.function == "reduce_partials" and cl.reduce.scalars == (128 * 64 * 16, splits)
    small = _g((1, 64, 8, 8), (64, 64, 4, 4), stride=2, padding=1) if not tf32 else \
        _g((16, 64, 2, 2), (64, 48, 4, 4), stride=2, padding=1)
    one_range, one_range_cl = plan(small), plan(small.with_weight_channels_last())
    assert one_range.partial.grid[2] == one_range_cl.partial.grid[2] == 1
    assert one_range.reduce is not None and one_range.partial.scratch_bytes > 0, "tap-major: transposed"
    assert one_range_cl.reduce is None and one_range_cl.partial.scratch_bytes == 0
    assert dict(one_range_cl.partial.spec.constants)["SINGLE_CHUNK"] is True


def test_weight_packs_read_the_weight_in_its_layout():
    g = _g((2, 64, 9, 11), (64, 48, 3, 5), padding=(1, 2))
    for geom in (g, g.with_weight_channels_last()):
        # a channels_last weight packs where it cannot be read in place (here: a pointer off 16 bytes)
        forward = wgmma.plan_forward(geom, "bfloat16", True, "nhwc", weight_aligned=False)
        grad_input = wgmma.plan_grad_input(geom, "bfloat16", "nhwc", weight_aligned=False)
        for p in (forward, grad_input):
            packs = [q for q in p.plans() if q.spec.template == "pack_weight.cu"]
            assert len(packs) == 1 and dict(packs[0].spec.constants)["WEIGHT_CL"] is geom.weight_channels_last
            assert all(dict(q.spec.constants)["WEIGHT_CL"] is geom.weight_channels_last for q in p.plans()
                       if "WEIGHT_CL" in dict(q.spec.constants))


def test_grad_weight_16_row_tiles_are_offered_where_the_input_has_16_rows():
    tall = _g((2, 64, 20, 12), (64, 64, 4, 4), stride=2, padding=1)
    short = _g((2, 64, 12, 20), (64, 64, 4, 4), stride=2, padding=1)
    names = [o.get("tile") for o in wgmma.grad_weight_options(tall)]
    assert names[:2] == [None, "64x64x4r16"], "the heuristic, then its 16-row sibling"
    assert "64x64x4r16" not in [o.get("tile") for o in wgmma.grad_weight_options(short)]
    split = wgmma.plan_grad_weight(tall, "bfloat16", 132, "nhwc", wgmma.WEIGHT_TILES["64x64x4r16"])
    constants = dict(split.partial.spec.constants)
    assert constants["TILE_H"] == 16 and constants["STAGES"] == 3, "three 16-row buffers: two blocks an SM"
    assert split.partial.scalars[-1] * split.partial.grid[2] >= 2 * cdiv(20, 16) * cdiv(12, 8)
    # 128 x-tile pixels and the 17 x 9 halo a stage, a 128-byte row each, in whole 1024-byte swizzle periods,
    # and one period to align the ring
    assert split.partial.smem_bytes == (3 * cdiv((128 + 153) * 128, 1024) + 1) * 1024


@pytest.mark.parametrize("kernel, stride, padding, tap_group, counts", [
    ((4, 4), 2, 1, 4, {4}),            # every phase two rows by two columns
    ((3, 5), 1, 0, 4, {4, 3}),         # one phase of 15 taps: chunks of 4, 4, 4, 3
    ((3, 3), 2, 1, 4, {4, 2, 1}),      # phases of 4, 2, 2 and 1 taps
    ((3, 3), 2, 1, 2, {2, 1}),         # the phase of 4 in two chunks, the others one chunk each
    ((2, 2), 2, 0, 1, {1}),
    ((1, 1), 2, 0, 4, {1}),            # phases without taps hold no block
])
def test_grad_weight_block_taps_name_every_block_size(kernel, stride, padding, tap_group, counts):
    g = _g((1, 16, 8, 8), (16, 16) + kernel, stride=stride, padding=padding)
    taps = wgmma.weight_block_taps(g, tap_group)
    assert set(taps) == counts and sum(taps) == kernel[0] * kernel[1]


@pytest.mark.parametrize("kernel, stride, padding, tap_group, skips", [
    ((4, 4), 2, 1, 4, False),          # every block has four taps
    ((3, 5), 1, 0, 4, False),          # 4, 4, 4, 3: one MMA in sixteen for an absent tap
    ((5, 5), 1, 0, 4, False),          # six groups of four and one of one: 3 absent in 28
    ((3, 3), 1, 0, 4, True),           # 4, 4, 1: 3 absent in 12
    ((3, 3), 2, 1, 4, True),           # phases of 4, 2, 2 and 1 taps: 7 absent in 16
    ((3, 3), 2, 1, 1, False),          # one tap a block
])
def test_grad_weight_blocks_test_their_taps_only_where_full_groups_cost_more(kernel, stride, padding, tap_group,
                                                                             skips):
    g = _g((1, 16, 8, 8), (16, 16) + kernel, stride=stride, padding=padding)
    assert wgmma.weight_skips_absent_taps(g, tap_group) is skips
    tile = next(t for t in wgmma.WEIGHT_TILES.values() if t.taps == tap_group and not t.one_row)
    split = wgmma.plan_grad_weight(g, "float16", 132, "nhwc", tile)
    assert dict(split.partial.spec.constants)["SKIP_ABSENT_TAPS"] is skips


def test_grad_weight_offsets_hold_a_halo_origin_past_the_last_image():
    """The 16-bit kernel forms each tile's halo origin, up to a few rows past the last image, before testing its
    pixels: a grad_output that fills 32-bit offsets all but those rows takes 64-bit offsets."""
    def plan(h):   # grad_output (1, 64, 2h, 16): 2048h elements
        g = _g((1, 64, h, 8), (64, 64, 4, 4), stride=2, padding=1)
        return numel(g.output_shape), dict(wgmma.plan_grad_weight(g, "float16", 132, "nhwc").partial.spec.constants)

    elements, constants = plan(2 ** 20 - 1)
    assert 2 ** 31 - elements == 2048 and constants["INDEX_T"] == "long long"
    elements, constants = plan(2 ** 20 - 8)
    assert 2 ** 31 - elements == 16384 and constants["INDEX_T"] == "int"


def test_unaligned_channels_last_grad_weight_runs_the_gemm():
    g = _g((2, 64, 8, 8), (64, 64, 4, 4), stride=2, padding=1)
    split = wgmma.FAMILY.plan("grad_weight", Variant("wgmma"), g, "float16", "nhwc", "strict", False, False, 132)
    assert split.partial.spec.function == "conv_transpose2d_grad_weight_igemm"


# ------------------------------------------------------------------------ TF32 grad_weight

def test_tf32_grad_weight_eligibility_takes_any_channel_count_of_16_or_more():
    g = _g((2, 60, 8, 8), (60, 17, 4, 4), stride=2, padding=1)
    assert wgmma.grad_weight_eligible(g, "float32", "tf32"), "packed word by word: no 16-byte runs needed"
    assert wgmma.grad_weight_eligible(g, "float32", "strict"), "3xTF32 packs the same way"
    assert not wgmma.grad_weight_eligible(g, "float16", "tf32"), "16-bit kinds still need whole 16-byte runs"
    assert not wgmma.grad_weight_eligible(_g((2, 64, 8, 8), (64, 12, 4, 4), stride=2), "float32", "tf32")
    assert wgmma.eligible(g, "float32", "grad_weight", "tf32") and wgmma.eligible(g, "float32", "grad_weight")
    # a 9 x 9 kernel at stride 1 spreads a halo of 10 x 16 pixels a step: 64 x 64 tiles fit no three-stage ring,
    # nor 3xTF32's two-deep ring of both parts even at 4 slots a step (a halo of 9 x 12 pixels)
    wide_halo = _g((2, 64, 16, 16), (64, 64, 9, 9))
    assert not wgmma.grad_weight_eligible(wide_halo, "float32", "tf32")
    assert not wgmma.grad_weight_eligible(wide_halo, "float32", "strict")
    # a 5 x 5 one takes 4 slots a step in 3xTF32 (a halo of 5 x 8), where TF32 takes 16
    five = _g((2, 64, 16, 16), (64, 64, 5, 5))
    assert wgmma.split_weight_step(five, wgmma.SPLIT_WEIGHT_TILES["64x64x2"]) == wgmma.ImageStep(1, 4, 1)
    assert wgmma.tf32_weight_step(five) == wgmma.ImageStep(2, 8, 1)


def test_3xtf32_grad_weight_leads_where_its_halos_stay_small():
    """Strict float32's grad_weight kernel leads the GEMM on the upsampling layers whose phases' taps spread at most
    a pixel (dcgan_up, unet_up2x2, outpad_up3x), and races it from behind on stride-1 kernels (asym_kernel,
    big_square), where it measured slower; TF32's leads by its own rule."""
    for name, leads in (("dcgan_up", True), ("unet_up2x2", True), ("outpad_up3x", True), ("asym_kernel", False),
                        ("big_square", False)):
        g = _suite_layer(name)
        assert wgmma.split_weight_leads(g) == leads, name
        for layout in ("nchw", "nhwc"):
            strict = table.candidates("grad_weight", g, "float32", layout, "strict")
            assert strict[0].family == ("wgmma" if leads else "gemm") and {"wgmma", "gemm"} <= {v.family
                                                                                                 for v in strict}
            tf32 = table.candidates("grad_weight", g, "float32", layout, "tf32")
            assert (tf32[0].family == "wgmma") == (wgmma.weight_phases(g)[0] >= 2)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_3xtf32_grad_weight_plans_both_parts(layout):
    """Strict float32's grad_weight: sources packed as TF32 parts (twice the copies), a tile of at most 64
    accumulators a thread, the largest K step whose two-deep ring of both parts fits, a ring two or three deep."""
    for name in SUITE:
        g = _suite_layer(name)
        if not wgmma.grad_weight_eligible(g, "float32", "strict"):
            continue
        plan = table.plan("grad_weight", WGMMA, g, "float32", layout, "strict")
        tf32 = table.plan("grad_weight", WGMMA, g, "float32", layout, "tf32")
        c, pack = dict(plan.partial.spec.constants), dict(plan.pack.spec.constants)
        assert c["SPLIT_TF32"] and pack["SPLIT_TF32"] and not dict(tf32.partial.spec.constants)["SPLIT_TF32"]
        assert plan.copy_bytes == tuple(2 * b for b in tf32.copy_bytes)
        tile = wgmma.split_weight_tile(g)
        assert c["TAP_GROUP"] * c["BN"] // 2 <= 64 and (c["TAP_GROUP"], c["BN"]) == (tile.taps, tile.bn)
        step = wgmma.split_weight_step(g, tile)
        assert (c["TILE_H"], c["TILE_W"], c["QUADS"]) == (step.rows, step.cols, step.quads)
        assert c["STAGES"] in wgmma.SPLIT_WEIGHT_STAGE_CHOICES
        assert plan.partial.smem_bytes == wgmma.tf32_weight_smem_bytes(g, tile, c["STAGES"], 2, step)
        assert plan.partial.smem_bytes <= wgmma.SMEM_LIMIT
        for o in wgmma.tf32_weight_options(g, "strict"):
            table.plan("grad_weight", Variant.make("wgmma", **o), g, "float32", layout, "strict")
    with pytest.raises(ValueError, match="64 accumulators"):
        wgmma.plan_grad_weight_tf32(_suite_layer("dcgan_up"), 132, layout, wgmma.TF32_WEIGHT_TILES["64x64x4"],
                                    precision="strict")


@pytest.mark.parametrize("size, batch, step", [
    ((64, 64), 16, (2, 8, 1)), ((8, 8), 128, (2, 8, 1)), ((5, 5), 8, (4, 4, 1)), ((4, 4), 128, (4, 4, 1)),
    ((2, 2), 16, (2, 2, 4)), ((2, 2), 5, (2, 2, 2)), ((1, 1), 16, (1, 2, 4)), ((1, 1), 128, (1, 2, 8)),
    ((17, 2), 2, (8, 2, 1)), ((1, 40), 3, (1, 8, 1)),
])
def test_tf32_grad_weight_steps_fill_sixteen_slots_from_the_input(size, batch, step):
    """Sixteen (pixel, image group) slots a K step: the widest patch the input fills, then image groups, no more
    of them than the batch has."""
    g = _g((batch, 64) + size, (64, 64, 4, 4), stride=2, padding=1)
    assert wgmma.tf32_weight_step(g) == wgmma.ImageStep(*step)
    with pytest.raises(ValueError, match="cols even"):
        wgmma.ImageStep(2, 3, 1)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_tf32_grad_weight_plans_a_split_k_on_sources_packed_into_image_quads(layout):
    g = _g((16, 256, 32, 32), (256, 64, 4, 4), stride=2, padding=1)
    plan = wgmma.plan_grad_weight_tf32(g, 132, layout)
    tile = wgmma.tf32_weight_tile(g)
    assert tile.name == "128x64x4", "four taps a phase, more than 64 input channels"
    # one launch packs both sources: 4 image groups x 32-channel x 32-pixel tiles of each
    pack = plan.pack
    assert pack.spec.function == "to_image_quads" and dict(pack.spec.constants)["NHWC"] is (layout == "nhwc")
    assert dict(pack.spec.constants)["VEC4"] is False, "sources not known to be aligned go through the tiles"
    x_blocks = 4 * (256 // 32) * (32 * 32 // 32)
    go_blocks = 4 * (64 // 32) * (64 * 64 // 32)
    assert pack.grid == (x_blocks + go_blocks, 1, 1) and pack.block == (256, 1, 1)
    assert pack.scalars == (16, 256, 32 * 32, 64, 64 * 64, x_blocks)
    # aligned channels_last sources: a thread a run of four channels of four images
    runs = wgmma.plan_grad_weight_tf32(g, 132, layout, aligned=True).pack
    assert dict(runs.spec.constants)["VEC4"] is (layout == "nhwc")
    if layout == "nhwc":
        x_blocks, go_blocks = 4 * 32 * 32 * 256 // 4 // 256, 4 * 64 * 64 * 64 // 4 // 256
        assert runs.grid == (x_blocks + go_blocks, 1, 1) and runs.block == (256, 1, 1)
        assert runs.scalars == (16, 256, 32 * 32, 64, 64 * 64, x_blocks)
        assert runs.scratch_bytes == pack.scratch_bytes
    assert plan.copy_bytes == (16 * 256 * 32 * 32 * 4, 16 * 64 * 64 * 64 * 4)
    assert pack.scratch_bytes == sum(plan.copy_bytes), "x's copy ends 256-byte aligned"
    assert plan.plans()[0] is pack and plan.split.sources is None
    split = plan.split
    blocks_x, channel_tiles, splits = split.partial.grid
    assert blocks_x == 4 and channel_tiles == 2 * 1 and split.partial.block == (256, 1, 1)
    k_tiles = cdiv(16, 4) * cdiv(32, 2) * cdiv(32, 8)   # image groups x 2 x 8 pixel patches
    assert splits == cdiv(k_tiles, split.partial.scalars[-1]) > 1 and split.reduce is not None
    assert split.partial.scratch_bytes == splits * 256 * 64 * 16 * 4
    # three stages (four do not fit) of 16 slots of 128 channels and the 3 x 9 halo's 27 slots of 64, each slot's
    # plane padded by 16 bytes
    assert split.partial.smem_bytes == 3 * (16 * (128 * 16 + 16) + 27 * (64 * 16 + 16)) <= wgmma.SMEM_LIMIT
    constants = dict(split.partial.spec.constants)
    assert "NHWC" not in constants and constants["SCALAR_T"] == "float", "packed sources have one layout"
    assert (constants["TILE_H"], constants["TILE_W"], constants["QUADS"], constants["STAGES"]) == (2, 8, 1, 3)
    assert split.partial.spec.target == wgmma.TARGET
    assert split.reduce.spec.function == "reduce_tap_major_partials"
    other = wgmma.plan_grad_weight_tf32(g, 132, "nhwc" if layout == "nchw" else "nchw")
    assert other.partial.spec == split.partial.spec, "both layouts run one kernel"
    # one K step of a one-tap layer writes grad_weight itself
    one = wgmma.plan_grad_weight_tf32(_g((4, 64, 2, 8), (64, 64, 1, 1), stride=2), 132, layout)
    assert one.reduce is None and dict(one.partial.spec.constants)["SINGLE_CHUNK"] is True
    with pytest.raises(ValueError, match="stages must be one of"):
        wgmma.plan_grad_weight_tf32(g, 132, layout, stages=5)


def test_tf32_grad_weight_packed_offsets_widen_before_the_padded_groups_overflow():
    """Packed offsets count slots of four images, up to a step's image groups past the last: one image whose
    grad_output has 2**30 elements is one group of 2**30 slots and one past it, so it takes 64-bit offsets; at
    2**29 elements it keeps 32-bit ones."""
    wide = _g((1, 32, 128, 2 ** 16), (32, 32, 2, 2), stride=2)
    narrow = _g((1, 32, 64, 2 ** 16), (32, 32, 2, 2), stride=2)
    assert numel(wide.output_shape) == 2 ** 30 and numel(narrow.output_shape) == 2 ** 29
    assert wgmma.tf32_weight_step(wide).quads == wgmma.tf32_weight_step(narrow).quads == 1
    assert wgmma.plan_grad_weight_tf32(wide, 132, "nchw").partial.index_t == "long long"
    assert wgmma.plan_grad_weight_tf32(narrow, 132, "nchw").partial.index_t == "int"


def test_tf32_grad_weight_heuristic_falls_back_to_a_tile_that_fits():
    wide = _g((2, 256, 16, 16), (256, 64, 3, 5), padding=(1, 2))   # one phase of 15 taps, a 4 x 12 halo
    assert wgmma.tf32_weight_smem_bytes(wide, wgmma.TF32_WEIGHT_TILES["128x64x4"], 3) > wgmma.SMEM_LIMIT
    assert wgmma.tf32_weight_tile(wide).name == "64x64x4"
    assert wgmma.tf32_weight_tile(_g((2, 256, 16, 16), (256, 64, 2, 2), stride=2)).name == "128x128x1"
    assert wgmma.tf32_weight_tile(_g((2, 64, 9, 9), (64, 128, 2, 4), stride=2, padding=(0, 1))).name == "64x128x2"
    # three taps a phase spread over three rows: two-tap tiles' halos do not fit, four-tap ones (a tap idle) do
    assert wgmma.tf32_weight_tile(_g((2, 64, 9, 9), (64, 128, 3, 1), stride=2, padding=1, dilation=2)).name \
        == "64x64x4"
    options = wgmma.tf32_weight_options(wide)
    assert options[0] == {} and "128x64x4" not in {o.get("tile") for o in options}


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_tf32_grad_weight_candidates_follow_the_precision(layout):
    g = _suite_layer("dcgan_up")
    tf32 = table.candidates("grad_weight", g, "float32", layout, "tf32")
    assert tf32[0] == WGMMA and GEMM in tf32
    strict = table.candidates("grad_weight", g, "float32", layout, "strict")
    assert strict[0] == WGMMA and GEMM in strict, "3xTF32 grad_weight leads where TF32's does"
    plan = table.plan("grad_weight", WGMMA, g, "float32", layout, "tf32", aligned=False)
    assert plan.partial.spec.function == "conv_transpose2d_grad_weight_wgmma_tf32", "unaligned views are packed too"


# ------------------------------------------------------------------------ small grids

@pytest.mark.parametrize("x_shape, w_shape, forward, grad_input", [
    # pix2pix's 1024-channel layers at 2 x 2 to 8 x 8 pixels and its 512-channel one at 1 x 1, batch 16
    ((16, 1024, 2, 2), (1024, 512, 4, 4), "2i8x8x128", "8x8x128"),
    ((16, 1024, 8, 8), (1024, 512, 4, 4), "2i8x8x128", "8x8x128"),
    ((16, 512, 1, 1), (512, 512, 4, 4), "2i8x8x128", "8x8x64"),
    # DCGAN's 4 x 4 layer at batch 128, and dcgan_up's 8 x 8 one at batch 64
    ((128, 512, 4, 4), (512, 256, 4, 4), "2i8x8x256", "2i8x8x256"),
    ((64, 512, 8, 8), (512, 256, 4, 4), "2i8x8x256", "2i8x8x128"),
])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_small_grids_take_the_biggest_tile_that_fills_half_the_sms(x_shape, w_shape, forward, grad_input, dtype):
    """The tiles that measured fastest on these layers (NOTES v13): the first of 2 images x 256 or 128 channels, then
    one image x 128 or 64, that still makes a block for half of an H100's SMs."""
    g = _g(x_shape, w_shape, stride=2, padding=1)
    assert wgmma.forward_tile(g, "forward", dtype).name == forward
    assert wgmma.forward_tile(g, "grad_input", dtype).name == grad_input
    for pass_, name in (("forward", forward), ("grad_input", grad_input)):
        tiles, _ = wgmma.tile_load(g, wgmma.TILES[name], pass_)
        assert 2 * tiles >= device.ASSUMED.sm_count
    # float32 (TF32) keeps its heuristic, which wgmma.tf32_leads was fitted to
    assert wgmma.forward_tile(g, "forward", "float32").name.startswith(("4i8x8", "8x8"))


def test_small_grids_of_narrow_or_few_tiles_keep_four_images_a_tile():
    narrow = _g((128, 128, 8, 8), (128, 64, 4, 4), stride=2, padding=1)   # 64 destination channels
    assert wgmma.forward_tile(narrow, "forward", "float16").name == "4i8x8x64"
    few = _g((2, 256, 4, 4), (256, 256, 4, 4), stride=2, padding=1)       # no tile fills half the SMs
    assert wgmma.forward_tile(few, "forward", "float16").name == "8x8x128"


# ---------------------------------------------------------------- a channels_last weight read in place

@pytest.mark.parametrize("dtype", HALF)
def test_a_channels_last_16_bit_weight_is_read_in_place(dtype):
    """The forward's B (output channels contiguous per input channel and tap) as an MN-major operand in 64-channel
    column blocks, grad_input's as K-major rows: no pack, and the weight's buffers on a whole swizzle period."""
    g = _g((2, 64, 9, 11), (64, 136, 3, 5), stride=2, padding=1).with_weight_channels_last()
    for tile in ("8x8x64", "16x16x128", "8x16x256"):
        for layout in launch.LAYOUTS:
            for pass_, plan in (("forward", wgmma.plan_forward(g, dtype, True, layout, wgmma.TILES[tile])),
                                ("grad_input", wgmma.plan_grad_input(g, dtype, layout, wgmma.TILES[tile]))):
                c = _constants(plan.gemm)
                assert plan.pack is None and c["WEIGHT_DIRECT"], (tile, pass_)
                assert "pack_weight" not in [p.spec.function for p in plan.plans()]
                halos = wgmma.smem_bytes(g, dtype, wgmma.TILES[tile], c["CK"], c["B_STAGES"], pass_, tma=c["TMA"]) \
                    - c["B_STAGES"] * c["CK"] * c["BN"] * 2 - 1024 * c["TMA"]
                assert plan.gemm.smem_bytes == cdiv(halos, 1024) * 1024 + c["B_STAGES"] * c["CK"] * c["BN"] * 2 \
                    + 1024 * c["TMA"]


def test_weights_the_halo_kernels_cannot_read_in_place_are_packed():
    cl = _g((2, 64, 9, 11), (64, 136, 3, 5), stride=2, padding=1).with_weight_channels_last()
    packed = {
        "contiguous": wgmma.plan_forward(_g((2, 64, 9, 11), (64, 136, 3, 5), stride=2, padding=1), "bfloat16", True),
        "TF32": wgmma.plan_forward(cl, "float32", True, precision="tf32"),
        "TF32 grad_input": wgmma.plan_grad_input(cl, "float32", precision="tf32"),
        "unaligned pointer": wgmma.plan_forward(cl, "bfloat16", True, weight_aligned=False),
        "unaligned pointer, grad_input": wgmma.plan_grad_input(cl, "float16", weight_aligned=False),
        # 40 output channels a group: an N tile of 64 with 24 past them is fine, but 20 are no whole 16-byte runs
        "odd output channels": wgmma.plan_forward(_g((2, 64, 9, 11), (64, 20, 3, 3), stride=2)
                                                  .with_weight_channels_last(), "float16", False),
        # an N tile of 32: the forward's MN-major rows are 64 channels
        "narrow N tile": wgmma.plan_forward(cl, "float16", False, "nhwc", wgmma.TILES["16x16x32"]),
    }
    for name, plan in packed.items():
        assert plan.pack is not None and not _constants(plan.gemm)["WEIGHT_DIRECT"], name
    # grad_input's K chunk of 32 channels reads in place too, into the pack's planes
    narrow = wgmma.plan_grad_input(_g((2, 48, 9, 11), (48, 32, 3, 3), stride=2).with_weight_channels_last(),
                                   "float16")
    assert narrow.pack is None and _constants(narrow.gemm)["CK"] == 32


def test_the_family_reads_a_weight_in_place_only_where_the_engine_found_it_aligned():
    cl = _g((2, 64, 9, 11), (64, 136, 3, 5), stride=2, padding=1).with_weight_channels_last()
    for aligned in (True, False):
        plan = table.plan("forward", WGMMA, cl, "bfloat16", "nchw", "strict", True, aligned)
        assert (plan.pack is None) == aligned
    # the engine passes the weight's alignment with the activations'
    recorder = Recorder(device.fake(0, arch="90"))
    for w, packs in ((_W, False), (_W + 2, True)):
        recorder.passes.clear()
        engine.forward(cl, "bfloat16", _X, w, _B, _Y, recorder, "nhwc", "strict")
        functions = [p.spec.function for _, p in recorder.passes[0].launches]
        assert ("pack_weight" in functions) == packs, functions


# ----------------------------------------------------------------------------- split K

PIX2PIX_8 = _g((16, 1024, 8, 8), (1024, 512, 4, 4), stride=2, padding=1)   # 8 x 8 grids of 1024 channels


def test_weight_bound_grids_split_their_chunks_into_k_ranges():
    """pix2pix's 16 x 1024 x 8² layer makes 64 forward tiles (32 for grad_input) of 4 images for 132 SMs, each
    walking a K of 4096 or more alone: its TF32 passes split the input-channel chunks into ranges that fill the
    SMs, and a fixed-order reduce adds their partials and the bias."""
    g = PIX2PIX_8
    for pass_, tiles, split in (("forward", 64, 2), (GRAD, 32, 4)):
        tile = wgmma.forward_tile(g, pass_, "float32")
        assert tile.name == "4i8x8x128" and wgmma.tile_load(g, tile, pass_)[0] == tiles
        plan = (wgmma.plan_forward(g, "float32", True, "nchw", precision="tf32") if pass_ == "forward"
                else wgmma.plan_grad_input(g, "float32", "nchw", precision="tf32"))
        c = _constants(plan.gemm)
        assert c["SPLIT_K"] == split == wgmma.heuristic_halo_splits(g, pass_, "float32", "tf32")
        phases = 4 if pass_ == "forward" else 1
        assert plan.gemm.grid[2] == phases * split and plan.gemm.grid[0] * plan.gemm.grid[1] * phases * split <= 132
        assert plan.plans()[-2:] == [plan.gemm, plan.reduce]
        assert wgmma.tf32_leads(g, pass_), "split, the halo kernel leads the GEMM here"
        assert wgmma.options(g, pass_, "float32", "tf32")[:2] == [{}, {"split": 1}]
        strict_splits = wgmma.heuristic_halo_splits(g, pass_, "float32", "strict")
        assert (wgmma.options(g, pass_, "float32", "strict")[1] == {"split": 1}) == (strict_splits > 1)
        one = table.plan(pass_, Variant.make("wgmma", split=1), g, "float32", "nchw", "tf32", pass_ == "forward")
        assert _constants(one.gemm)["SPLIT_K"] == 1 and one.reduce is None and one.gemm.scratch_bytes == 0


def test_k_ranges_follow_the_idle_sms_the_chunks_and_the_weights_bytes():
    g = PIX2PIX_8
    # bf16's small-grid tile (2 images x 8 x 8 x 128) already fills the SMs; its 256-wide twin leaves half idle
    assert wgmma.heuristic_halo_splits(g, "forward", "bfloat16", "strict") == 1
    wide = wgmma.TILES["2i8x8x256"]
    assert wgmma.tile_load(g, wide)[0] == 64
    # 132 // 64 = 2 ranges; the partials (2 x 2 M fp32 outputs) no larger than the 16.8 MB bf16 weight
    assert wgmma.halo_splits(g, "bfloat16", wide, 64) == 2
    out_bytes = 4 * launch.numel(g.output_shape)
    assert numel(g.weight_shape) * 2 // out_bytes == 2
    # grad_input of 32 tiles: 132 // 32 = 4, within 8 chunks x 16 taps and the weight's bytes
    assert wgmma.halo_splits(g, "bfloat16", wide, 64, GRAD) == 4
    # ranges never empty: 5 chunks wanted 4 ways (2 tiles on 8 SMs) run as 3 ranges of 2, 2 and 1 chunks
    five = _g((1, 320, 8, 8), (320, 256, 3, 3), padding=1)
    tile = wgmma.TILES["8x8x128"]
    assert wgmma.tile_load(five, tile)[0] == 2
    assert wgmma.halo_splits(five, "float16", tile, 64, sm_count=8) == 3
    assert wgmma.halo_splits(five, "float16", tile, 64) == 5, "as many as the chunks"
    # ... and at least eight steps each: five chunks of a 2 x 2 phase of four taps split twice
    assert wgmma.halo_splits(_g((1, 320, 8, 8), (320, 256, 4, 4), stride=2, padding=1), "float16", tile, 64) == 2
    # a layer whose tiles fill the SMs, or whose outputs outweigh its weight, runs whole
    dcgan_up = _suite_layer("dcgan_up")
    assert all(wgmma.halo_splits(dcgan_up, "float16", wgmma.forward_tile(dcgan_up, p), 64, p) == 1
               for p in ("forward", GRAD))
    big_out = _g((2, 64, 8, 8), (64, 64, 4, 4), stride=2, padding=1)
    assert wgmma.halo_splits(big_out, "float16", wgmma.TILES["8x8x64"], 64) == 1
    # at least eight (chunk, tap) steps a range: one chunk of a 1 x 1 kernel never splits
    one_tap = _g((1, 64, 8, 8), (64, 4096, 1, 1))
    assert wgmma.halo_splits(one_tap, "float16", wgmma.TILES["8x8x128"], 64) == 1


@pytest.mark.parametrize("split", [0, -1, True, 2.0, "2", 17])
def test_a_split_must_be_a_positive_int_of_at_most_the_chunks(split):
    g = PIX2PIX_8   # 16 chunks of 64 channels in fp16
    with pytest.raises(ValueError, match="split"):
        wgmma.plan_forward(g, "float16", False, "nhwc", split=split)
    assert _constants(wgmma.plan_forward(g, "float16", False, "nhwc", split=16).gemm)["SPLIT_K"] == 16


def test_split_k_variants_name_and_plan():
    v = Variant.parse("wgmma:2i8x8x256:k2")
    assert v == Variant.make("wgmma", tile="2i8x8x256", split=2) and v.name == "wgmma:2i8x8x256:k2"
    plan = table.plan("forward", v, PIX2PIX_8, "bfloat16", "nhwc", "strict", True)
    c = _constants(plan.gemm)
    assert (c["TILE_IMAGES"], c["BN"], c["SPLIT_K"]) == (2, 256, 2) and plan.gemm.grid == (8, 2, 8)
    assert plan.reduce == reduction.plan_reduce_with_bias("bfloat16", launch.numel(PIX2PIX_8.output_shape), 2, 512,
                                                          1, plan.gemm.index_t)
