"""Autotuning without a GPU: variants, the pass table's candidates, keys, the choices file and the decisions.

Timing itself needs a GPU (tests/test_tuning_gpu.py); here ``decide._measure`` is replaced
by a fake that returns chosen times, and the engine runs on a :class:`Recorder` of a fake
device, so everything around the timing is checked on the CPU.  The ``fresh`` fixture also
takes every candidate as built; the background builds have tests of their own.
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

import cupyconv
from cupyconv import engine, tuning
from cupyconv.core import device
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import direct, gemm, grouped_mma, launch, scatter_gemm, table, tiled, wgmma
from cupyconv.plans.launch import Recorder
from cupyconv.tuning import decide, explicit, store
from cupyconv.tuning.variants import DIRECT, GEMM, Variant

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES_BUILT = decide._candidates_built


def _g(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


THIN = _g((2, 32, 9, 11), (32, 48, 3, 3), stride=2, padding=1)          # GEMM-eligible, under 64 channels
WIDE = _g((4, 128, 8, 8), (128, 96, 4, 4), stride=2, padding=1)        # GEMM-eligible, wide
N16 = _g((3, 64, 16, 16), (64, 16, 3, 3))                               # GEMM N = 16 in the forward
DEPTHWISE = _g((2, 16, 8, 8), (16, 1, 4, 4), stride=2, padding=1, groups=16)
ONE_ROW = _g((1, 16, 3, 66), (16, 256, 3, 4), stride=2, padding=1)     # one-row wgmma tiles and K steps
GPU_NAME, ARCH = "Fake GPU 80GB", "90"
# The device every decision here is made for, and a second one of the same kind.
DEV = device.fake(0, name=GPU_NAME, arch=ARCH)
DEV1 = device.fake(1, name=GPU_NAME, arch=ARCH)
PRE_AMPERE = device.fake(0, name="Fake Turing", arch="75")
TUNED = explicit.TUNED_PASSES
# The heuristic of the forward and grad_input for THIN, WIDE and N16 in float16 on an sm_90 device (DEV,
# and the assumed H100): Hopper's wgmma kernels; grad_weight runs the mma.sync GEMM.
WGMMA = Variant("wgmma")
# 16-byte aligned made-up pointers for the engine's passes (aligned channels_last activations)
_X, _W, _B, _Y, _GX, _GW = ((i + 1) << 32 for i in range(6))


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Autotuning on, an empty cache directory, no stream under capture, and no choice remembered."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV, raising=False)
    monkeypatch.setattr(decide, "_capturing", lambda stream_ptr: False)
    monkeypatch.setattr(decide, "_candidates_built", lambda key, cands, plans, device: True)
    tuning.clear()
    yield tmp_path / "cache"
    tuning.clear()


class FakeTimer:
    """Stands in for ``decide._measure``: times by variant name, and counts calls."""

    def __init__(self, times=None, default=1.0):
        self.times = times or {}
        self.default = default
        self.calls = []
        self.devices = []

    def __call__(self, cands, run, plans, device, stream_ptr, repeat):
        self.calls.append([v.name for v in cands])
        self.devices.append(device)
        return {v: self.times.get(v.name, self.default) for v in cands if self.times.get(v.name, 0) is not None}


class TimingRecorder(Recorder):
    """A recorder the tuner may time on (``decide._measure`` is faked, so nothing is launched)."""

    timing = True


def _cands(pass_="forward", g=THIN, dtype="float16", layout="nchw", precision="strict", dev=DEV):
    return table.candidates(pass_, g, dtype, layout, precision, dev)


def _choose(pass_="forward", g=THIN, dtype="float16", layout="nchw", precision="strict", dev=DEV, timing=True):
    runs = []
    cands = _cands(pass_, g, dtype, layout, precision, dev)
    v = decide.choose(pass_, g, dtype, layout, precision, dev, 0, cands, runs.append,
                      lambda v: table.plan(pass_, v, g, dtype, layout, precision).plans(), timing=timing)
    return v, runs


def _plans(pass_, v, g=THIN, dtype="float16", layout="nchw", precision="strict", has_bias=False, dev=DEV):
    return table.plan(pass_, v, g, dtype, layout, precision, has_bias, True, dev.sm_count).plans()


def _run_engine(launcher, pass_, g=THIN, dtype="float16", layout="nchw", precision="strict"):
    """One pass through the engine on ``launcher``; returns what it recorded for the pass."""
    if pass_ == "forward":
        engine.forward(g, dtype, _X, _W, _B, _Y, launcher, layout, precision)
    elif pass_ == "grad_input":
        engine.grad_input(g, dtype, _Y, _W, _GX, launcher, layout, precision)
    else:
        engine.grad_weight(g, dtype, _X, _Y, _GW, launcher, layout, precision)
    recorded = launcher.passes[-1]
    assert recorded.name == pass_
    return recorded


def _entries(cache_dir):
    data = json.loads((cache_dir / tuning.CACHE_FILE).read_text())
    assert data["format"] == tuning.FILE_FORMAT
    return data["entries"]


def _key(pass_="forward", g=THIN, dtype="float16", layout="nchw", precision="strict"):
    return tuning.make_key(pass_, g, dtype, layout, precision, GPU_NAME, ARCH)


# ------------------------------------------------------------------------------ variants

def test_variant_names_round_trip():
    names = set()
    for g in (THIN, WIDE, N16, DEPTHWISE, ONE_ROW):
        for dtype, precision in (("float16", "strict"), ("float32", "tf32"), ("float32", "strict")):
            for pass_ in table.PASSES:
                for layout in launch.LAYOUTS:
                    for v in table.candidates(pass_, g, dtype, layout, precision):
                        assert Variant.parse(v.name) == v
                        assert hash(Variant.parse(v.name)) == hash(v)
                        names.add(v.name)
    # a stored choice of a one-row grad_weight step must load in the next process, not be re-tuned
    assert "wgmma:64x128x2r1w64" in names and "wgmma:1x64x64" in names
    assert Variant.parse("direct") == DIRECT == Variant.make("direct") and DIRECT.name == "direct"
    assert Variant.parse("gemm") == GEMM and GEMM.family == "gemm" and GEMM.kwargs == {}
    v = Variant.parse("gemm:128x64:s3")
    assert v == Variant.make("gemm", stages=3, tile="128x64") and v.kwargs == {"tile": "128x64", "stages": 3}
    assert v.name == "gemm:128x64:s3" and Variant.parse("gemm:s2").kwargs == {"stages": 2}
    # a source copied first or read in place, last, one or the other
    for name, opts in (("wgmma:s6:copy", {"stages": 6, "copy": True}),
                       ("scatter_gemm:64x256:inplace", {"tile": "64x256", "inplace": True}),
                       ("scatter_gemm:inplace", {"inplace": True})):
        assert Variant.parse(name).kwargs == opts and Variant.make(name.split(":")[0], **opts).name == name
    for bad in ("", "gemm:64x64:64x64", "gemm:sx", "gemm:s2:s3", "gemm:s3:64x64", "gemm:", "Gemm", "gemm:64x64:s2:s3",
                ":64x64", "gemm:64x", "scatter_gemm:inplace:copy", "scatter_gemm:copy:inplace",
                "scatter_gemm:inplace:64x256", "wgmma:copy:s6", "scatter_gemm:inplace:inplace"):
        with pytest.raises(ValueError):
            Variant.parse(bad)


def test_well_formed_names_of_no_family_or_tile_are_no_candidate():
    """Variant.parse only checks the form (the tuner knows no family); the pass table rejects the rest."""
    every = {v for g in (THIN, WIDE, N16, DEPTHWISE) for p in table.PASSES for layout in launch.LAYOUTS
             for v in table.candidates(p, g, "float16", layout)}
    for name in ("gemm:7x7", "cudnn", "direct:64x64"):
        v = Variant.parse(name)
        assert v not in every
    with pytest.raises(KeyError):
        table.plan("forward", Variant.parse("cudnn"), THIN, "float16")
    with pytest.raises(KeyError):
        table.plan("forward", Variant.parse("gemm:7x7"), THIN, "float16")


# ------------------------------------------------------------------------------ the key

def test_key_names_version_code_gpu_arch_pass_layer_dtype_layout_and_precision():
    key = tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH)
    parts = key.split("|")
    assert parts[:4] == [cupyconv.__version__, tuning.code_hash(), GPU_NAME, "sm_90"]
    assert parts[4] == "grad_input"
    assert parts[-3:] == ["float32", "nhwc", "tf32"]
    assert "cin=32,cout=48,k=3x3,s=2x2,p=1x1,op=0x0,d=1x1,groups=1" in key
    variations = [
        tuning.make_key("forward", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float16", "nhwc", "strict", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nchw", "tf32", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "strict", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", "Other GPU", ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, "80"),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH, version="0.0.1"),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH, code="0123"),
        tuning.make_key("grad_input", _g((2, 32, 9, 11), (32, 48, 3, 3), stride=2), "float32", "nhwc", "tf32",
                        GPU_NAME, ARCH),
    ]
    assert len(set(variations + [key])) == len(variations) + 1


def test_key_buckets_batch_and_spatial_size_to_powers_of_two():
    def key(batch, h, w):
        return tuning.config_key("forward", _g((batch, 32, h, w), (32, 48, 3, 3)), "float16", "nchw", "strict")

    assert key(5, 100, 60) == key(8, 128, 64) == key(7, 65, 33)
    assert key(8, 128, 64) != key(9, 128, 64)
    assert key(8, 128, 64) != key(8, 129, 64)
    assert key(1, 1, 1) != key(2, 1, 1)
    # precision is one entry for the dtypes it does not apply to
    g = _g((2, 32, 9, 11), (32, 48, 3, 3))
    assert tuning.config_key("forward", g, "float16", "nchw", "strict") == \
        tuning.config_key("forward", g, "float16", "nchw", "tf32")
    assert tuning.config_key("forward", g, "float32", "nchw", "strict") != \
        tuning.config_key("forward", g, "float32", "nchw", "tf32")


def test_code_hash_is_stable_and_short():
    assert tuning.code_hash() == tuning.code_hash()
    assert len(tuning.code_hash()) == 12 and "|" not in tuning.code_hash()


# ----------------------------------------------------------------------- candidates

def _tile(v, pass_="forward"):
    """The tile a variant names (a gemm Tile, a wgmma HaloTile or WeightTile), or None for the planner's own."""
    name = v.kwargs.get("tile")
    if name is None:
        return None
    if v.family == "tiled":
        return tiled.parse_tile(name)
    if v.family == "wgmma":
        return (wgmma.WEIGHT_TILES if pass_ == "grad_weight" else wgmma.TILES)[name]
    return gemm.TILES[name]


def _untiled(cands):
    """The candidates but the tiled family's, which add themselves to any NCHW forward of a thin layer."""
    return tuple(v for v in cands if v.family != "tiled")


@pytest.mark.parametrize("pass_", TUNED)
@pytest.mark.parametrize("case", [("float16", "strict"), ("bfloat16", "strict"), ("float32", "tf32"),
                                  ("float32", "strict")], ids=["fp16", "bf16", "tf32", "fp32_strict"])
def test_candidates_plan_distinct_launches_heuristic_first(pass_, case):
    dtype, precision = case
    for g in (THIN, WIDE, N16):
        for layout in launch.LAYOUTS:
            cands = table.candidates(pass_, g, dtype, layout, precision)
            assert isinstance(cands, tuple)
            # on the assumed H100 the fp16/bf16 passes run Hopper's wgmma kernels, ahead of the GEMMs (these
            # layers have whole 16-byte channel groups on both sides, and stride phases of several taps, where
            # grad_weight's wgmma kernels lead too); float32 runs every pass on them, as TF32 or 3xTF32
            assert wgmma.weight_phases(g)[0] >= 2
            hopper = True
            assert hopper == wgmma.eligible(g, dtype, pass_, precision)
            # the float32 forward and grad_input lead on layers with tiles for half the SMs (these small ones have
            # fewer), else race the GEMM; TF32 grad_weight leads as the 16-bit one does, 3xTF32's where its halos
            # stay small
            if dtype == "float32" and pass_ == "grad_weight" and precision == "strict":
                leads = wgmma.split_weight_leads(g)
            else:
                leads = dtype != "float32" or pass_ == "grad_weight" or wgmma.tf32_leads(g, pass_)
            assert cands[0] == (WGMMA if leads else GEMM), \
                "the heuristic must come first: it is the fallback and tie-breaker"
            assert len(cands) == len(set(cands))
            assert sum(v.family == "gemm" for v in cands) <= gemm.FAMILY.max_variants == 7
            assert (sum(v.family == "wgmma" for v in cands) >= 1) == hopper
            assert sum(v.family == "wgmma" for v in cands) <= wgmma.FAMILY.max_variants
            # the NCHW forward of a layer under 64 channels on a side races the tiled kernels too, and a 16-bit or
            # TF32 grad_input the gather GEMM (these layers' taps overlap: it leads none of them)
            assert set(v.family for v in cands) <= {"wgmma", "gemm", "direct", "tiled", "scatter_gemm"}
            assert cands.count(DIRECT) <= 1
            gathers = pass_ == "grad_input" and (dtype != "float32" or precision == "tf32")
            assert any(v.family == "scatter_gemm" for v in cands) == gathers
            assert sum(v.family == "scatter_gemm" for v in cands) <= scatter_gemm.FAMILY.max_variants
            tiles = g is not WIDE and pass_ == "forward" and layout == "nchw"
            assert any(v.family == "tiled" for v in cands) == tiles
            identities = set()
            for v in cands:
                plans = table.plan(pass_, v, g, dtype, layout, precision).plans()
                assert plans and all(isinstance(p, launch.Plan) for p in plans)
                identities.add(tuple(plans))
            assert len(identities) == len(cands), "two candidates launch the same kernels"


def test_candidates_list_variants_that_plan_alike_once():
    # 18 input channels: 36-byte float16 rows split into no 16-byte vectors, so the forward GEMM
    # gathers elements and always double-buffers: every pipeline depth plans the heuristic's launches
    g = _g((2, 18, 9, 11), (18, 48, 3, 3), stride=2, padding=1)
    depths = [opts for opts in gemm.options("forward", g, "float16", "strict") if "stages" in opts]
    assert depths, "the GEMM family offers other pipeline depths"
    heuristic = tuple(_plans("forward", GEMM, g))
    for opts in depths:
        assert tuple(_plans("forward", Variant.make("gemm", **opts), g)) == heuristic
    cands = table.candidates("forward", g, "float16", "nchw", "strict")
    assert cands[0] == GEMM and not [v for v in cands if "stages" in v.kwargs]
    # ...whereas every option that plans differently stays a candidate (up to the family's cap)
    distinct = {tuple(_plans("forward", Variant.make("gemm", **o), g))
                for o in gemm.options("forward", g, "float16", "strict")}
    assert len([v for v in cands if v.family == "gemm"]) == min(len(distinct), gemm.FAMILY.max_variants)
    # a tile equal to the planner's own default is the heuristic again, and is not listed twice
    default = gemm.plan_forward_gemm(g, "float16", False, "nhwc").gemm.spec.constants
    default_tile = f"{dict(default)['BM']}x{dict(default)['BN']}"
    assert {"tile": default_tile} in gemm.options("forward", g, "float16", "strict")
    assert Variant.make("gemm", tile=default_tile) not in table.candidates("forward", g, "float16", "nhwc")


def test_every_gemm_option_plans():
    """The GEMM family hands its options straight to its planners: none may be refused (the pass table
    would silently drop a variant whose planner takes no such option)."""
    for g in (THIN, WIDE, N16):
        for pass_ in TUNED:
            for dtype, precision in (("float16", "strict"), ("float32", "tf32"), ("float32", "strict")):
                for opts in gemm.options(pass_, g, dtype, precision):
                    for layout in launch.LAYOUTS:
                        assert _plans(pass_, Variant.make("gemm", **opts), g, dtype, layout, precision)


def test_tile_sides_fit_the_gemm():
    # forward GEMM N is C_out per group = 16: no tile wider than 32 along N
    for v in table.candidates("forward", N16, "float16", "nhwc", "strict"):
        if v.family != "gemm":
            continue
        plan = table.plan("forward", v, N16, "float16", "nhwc", "strict")
        assert dict(plan.gemm.spec.constants)["BN"] == 32
    # ...but grad_input's N is C_in per group = 64, where 128-wide tiles are pointless too (the mma.sync
    # GEMM's tiles and the wgmma kernel's alike)
    gi = table.candidates("grad_input", N16, "float16", "nhwc", "strict")
    assert {"wgmma", "gemm"} <= {v.family for v in gi}
    for v in gi:
        assert _tile(v) is None or _tile(v).bn in (32, 64), v.name
        if v.family == "wgmma":
            plan = table.plan("grad_input", v, N16, "float16", "nhwc", "strict")
            assert dict(plan.gemm.spec.constants)["BN"] in (32, 64), v.name
    # grad_weight's tile covers C_in x C_out per group: 64 x 16 (the wgmma kernel's narrowest is 64 x 64)
    for v in table.candidates("grad_weight", N16, "float16", "nhwc", "strict"):
        tile = _tile(v, "grad_weight")
        assert tile is None or (tile.bm in (32, 64) and tile.bn == (64 if v.family == "wgmma" else 32)), v.name
    # a wide layer tries the 128-wide tiles
    names = {v.name for v in table.candidates("forward", WIDE, "float16", "nhwc", "strict")}
    assert {"gemm:64x64", "gemm:64x128"} & names or "gemm:128x64" in names
    assert len(table.candidates("forward", WIDE, "float16", "nhwc", "strict")) >= 3


def test_strict_float32_never_tries_tiles_over_64x64():
    for g in (THIN, WIDE, N16):
        for pass_ in TUNED:
            for v in table.candidates(pass_, g, "float32", "nhwc", "strict"):
                if v.family != "gemm":
                    continue
                plans = table.plan(pass_, v, g, "float32", "nhwc", "strict").plans()
                gemm_plan = [p for p in plans if "igemm" in p.spec.template][0]
                constants = dict(gemm_plan.spec.constants)
                assert constants["BM"] * constants["BN"] <= 64 * 64, v.name
    # TF32 has no such cap
    wide_tf32 = [v for v in table.candidates("forward", WIDE, "float32", "nhwc", "tf32") if v.family == "gemm"]
    assert any(_tile(v) is not None and _tile(v).bm * _tile(v).bn > 64 * 64 for v in wide_tf32)


def test_direct_kernels_are_a_candidate_for_thin_layers_only():
    for pass_ in TUNED:
        for layout in ("nchw", "nhwc"):
            cands = table.candidates(pass_, THIN, "float16", layout, "strict")
            assert [v for v in cands if v.family != "tiled"][-1] == DIRECT
        assert DIRECT not in table.candidates(pass_, WIDE, "float16", "nchw", "strict")
        # layers the tensor cores cannot run have the CUDA-core kernels only: the direct ones, and for an NCHW
        # forward the tiled ones, ahead on depthwise layers and behind on wider groups
        depthwise = table.candidates(pass_, DEPTHWISE, "float16", "nchw", "strict")
        thin64 = table.candidates(pass_, THIN, "float64", "nchw", "strict")
        if pass_ == "forward":
            assert depthwise[-1] == DIRECT and len(depthwise) > 1 and {v.family for v in depthwise[:-1]} == {"tiled"}
            assert thin64[0] == DIRECT and len(thin64) > 1 and {v.family for v in thin64[1:]} == {"tiled"}
        else:
            # the direct kernels' own thread blocks (grad_input's half-pixel block on depthwise NCHW layers)
            assert depthwise[0] == DIRECT and {v.family for v in depthwise} == {"direct"}
            assert thin64 == (DIRECT,)
        # ...and so has a device without tensor cores the kernels can use
        assert _untiled(table.candidates(pass_, THIN, "float16", "nchw", "strict", PRE_AMPERE)) == (DIRECT,)
        assert table.candidates(pass_, WIDE, "float16", "nhwc", "strict", PRE_AMPERE) == (DIRECT,)


@pytest.mark.parametrize("pass_", TUNED)
def test_direct_kernels_race_below_64_channels_per_group(pass_):
    limit = direct.RACE_BELOW_CHANNELS
    assert limit == 64

    def layer(cin, cout, groups=1):
        return _g((2, cin, 9, 11), (cin, cout // groups, 3, 3), stride=2, padding=1, groups=groups)

    for g, races in ((layer(limit, limit), False), (layer(limit, limit - 1), True), (layer(limit - 1, limit), True),
                     (layer(2 * limit, 2 * limit), False), (layer(2 * limit, 2 * limit, groups=2), False),
                     (layer(2 * limit, 2 * limit, groups=4), True)):
        assert direct.FAMILY.races(pass_, g, "float16") == races
        # the forward and grad_input of whole 16-byte groups of source channels (the input's for the forward,
        # grad_output's for grad_input) run Hopper's wgmma kernels first (the assumed H100)
        # (grad_weight's needs whole runs on both sides; it leads too, this 3x3 stride-2 layer's phases having
        # up to four taps)
        hopper = wgmma.eligible(g, "float16", pass_)
        source = {"forward": (g.in_per_group,), "grad_input": (g.out_per_group,)}.get(
            pass_, (g.in_per_group, g.out_per_group))
        assert hopper == all(c % 8 == 0 for c in source)
        first = hopper
        for layout in launch.LAYOUTS:
            cands = table.candidates(pass_, g, "float16", layout, "strict")
            assert cands[0] == (WGMMA if first else GEMM) and (DIRECT in cands) == races, \
                (g.in_per_group, g.out_per_group)
            assert GEMM in cands
            tiles = pass_ == "forward" and layout == "nchw" and tiled.eligible(g, "float16")
            fits = {"forward": grouped_mma.forward_fits, "grad_input": grouped_mma.grad_input_fits}.get(
                pass_, grouped_mma.shape_fits)
            grouped_mma_runs = fits(g, "float16")
            behind = pass_ == "forward" and layout == "nchw"   # the NCHW forward steps back behind the next
            # the gather GEMM takes grad_input of whole 16-byte runs on both sides, stepping back behind the
            # halo tiles on these small layers
            gathers = scatter_gemm.eligible(g, "float16", pass_) and pass_ == "grad_input"
            assert [f.name for f in table.eligible(pass_, g, "float16", layout)] == \
                ["wgmma"] * first + ["scatter_gemm"] * gathers + ["gemm"] + ["wgmma"] * (hopper and not first) \
                + ["grouped_mma"] * (grouped_mma_runs and not behind) + ["direct"] \
                + ["grouped_mma"] * (grouped_mma_runs and behind) + ["tiled"] * tiles
            # the grouped mma kernel can run it, but only races where the GEMMs cannot
            assert not any(v.family == "grouped_mma" for v in cands)


@pytest.mark.parametrize("pass_", TUNED)
def test_pipeline_depths_are_tried_for_every_gemm_pass(pass_):
    cands = table.candidates(pass_, WIDE, "float16", "nhwc", "strict")
    # (the wgmma forward's depths are those of its weight ring: tests/test_wgmma.py)
    staged = [v for v in cands if "stages" in v.kwargs and v.family == "gemm"]
    assert [v.kwargs["stages"] for v in staged] == [s for s in gemm.STAGE_CHOICES if s != gemm.DEFAULT_STAGES]
    assert staged, "every GEMM planner takes a pipeline depth"
    for v in staged:
        plans = table.plan(pass_, v, WIDE, "float16", "nhwc", "strict").plans()
        assert any(dict(p.spec.constants).get("STAGES") == v.kwargs["stages"] for p in plans)
    heuristic = table.plan(pass_, GEMM, WIDE, "float16", "nhwc", "strict").plans()
    assert any(dict(p.spec.constants).get("STAGES") == gemm.DEFAULT_STAGES for p in heuristic)


def test_only_the_tuned_passes_have_a_choice():
    assert set(TUNED) < set(table.PASSES)
    for pass_ in set(table.PASSES) - set(TUNED):
        for g in (THIN, WIDE, N16, DEPTHWISE):
            for layout in launch.LAYOUTS:
                assert len(table.candidates(pass_, g, "float16", layout)) == 1, pass_
    for pass_ in TUNED:
        assert len(table.candidates(pass_, THIN, "float16")) > 1


def test_tensor_cores_off_forces_direct(fresh, monkeypatch):
    monkeypatch.setenv(gemm.TENSOR_CORES_ENV, "0")
    timer = FakeTimer()
    monkeypatch.setattr(decide, "_measure", timer)
    for pass_ in TUNED:
        cands = table.candidates(pass_, THIN, "float16", "nchw", "strict", DEV)
        assert _untiled(cands) == (DIRECT,)
        assert tuning.current(pass_, THIN, "float16", "nchw", "strict", DEV, cands) == DIRECT
        recorded = _run_engine(TimingRecorder(DEV), pass_)
        assert recorded.variant == DIRECT and recorded.launches
        assert not any("igemm" in plan.spec.template for _, plan in recorded.launches)
    # only the NCHW forward has a choice left, between CUDA-core kernels: the direct and tiled ones
    assert [{n.split(":")[0] for n in call} for call in timer.calls] == [{"direct", "tiled"}]
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV)
    assert table.candidates("forward", THIN, "float16", "nchw", "strict", DEV)[0] == WGMMA


def test_a_substituted_pre_ampere_device_gets_the_direct_kernels_only(fresh, monkeypatch):
    timer = FakeTimer()
    monkeypatch.setattr(decide, "_measure", timer)
    with device.substitute(device.fake(0, sm_count=108)):
        with device.substitute(PRE_AMPERE) as dev:
            assert device.get(0) is dev and dev.tensor_cores == device.NO_TENSOR_CORES
            for pass_ in TUNED:
                assert _untiled(table.candidates(pass_, THIN, "float16", "nchw", "strict", device.get(0))) == (DIRECT,)
                assert [f.name for f in table.eligible(pass_, THIN, "float16", "nchw", device.get(0))] == \
                    ["direct"] + ["tiled"] * (pass_ == "forward")
                recorded = _run_engine(TimingRecorder(device.get(0)), pass_)
                assert recorded.variant == DIRECT
                assert not any("igemm" in plan.spec.template for _, plan in recorded.launches)
        # the outer substitute is back, and with it the tensor cores
        assert device.get(0).sm_count == 108 and device.get(0).tensor_cores >= device.MMA_SYNC
        assert table.candidates("forward", THIN, "float16", "nchw", "strict", device.get(0))[0] == WGMMA
    assert [{n.split(":")[0] for n in call} for call in timer.calls] == [{"direct", "tiled"}]
    with pytest.raises(ValueError):
        with device.substitute(device.ASSUMED):
            pass


# --------------------------------------------------------------------- the choices file

def test_cache_file_round_trip(tmp_path):
    path = tmp_path / "d" / tuning.CACHE_FILE
    entry = {"variant": "gemm:64x64", "ms": {"gemm": 1.5, "gemm:64x64": 1.25}, "repeat": 3, "time": 1}
    assert tuning.TuningCache(path).put("k1", entry)
    assert tuning.TuningCache(path).get("k1") == entry
    assert tuning.TuningCache(path).put("k2", {"variant": "direct"})
    data = json.loads(path.read_text())
    assert data == {"format": tuning.FILE_FORMAT, "entries": {"k1": entry, "k2": {"variant": "direct"}}}
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")], "temporary file left behind"


def test_cache_sees_another_writers_entries(tmp_path):
    path = tmp_path / tuning.CACHE_FILE
    reader, writer = tuning.TuningCache(path), tuning.TuningCache(path)
    assert reader.get("k") is None
    writer.put("k", {"variant": "gemm"})
    assert reader.get("k") == {"variant": "gemm"}


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'{"format": 999}',
                                     b'{"format": 1, "entries": []}', b""])
def test_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, content):
    path = tmp_path / tuning.CACHE_FILE
    path.write_bytes(content)
    cache = tuning.TuningCache(path)
    assert cache.get("k") is None
    assert cache.put("k", {"variant": "direct"})
    assert json.loads(path.read_text()) == {"format": tuning.FILE_FORMAT, "entries": {"k": {"variant": "direct"}}}


def test_malformed_entries_are_dropped(tmp_path):
    path = tmp_path / tuning.CACHE_FILE
    path.write_text(json.dumps({"format": tuning.FILE_FORMAT, "entries": {
        "good": {"variant": "gemm"}, "no_variant": {"ms": {}}, "not_a_dict": "gemm", "number": {"variant": 3}}}))
    assert tuning.read_entries(path) == {"good": {"variant": "gemm"}}
    tuning.TuningCache(path).put("new", {"variant": "direct"})
    assert set(json.loads(path.read_text())["entries"]) == {"good", "new"}


def test_unwritable_cache_dir_keeps_choices_in_memory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = tuning.TuningCache(blocker / "sub" / tuning.CACHE_FILE)
    assert cache.put("k", {"variant": "gemm"}) is False
    assert cache.get("k") == {"variant": "gemm"}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores permissions")
def test_read_only_cache_dir_keeps_choices_in_memory(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        cache = tuning.TuningCache(directory / tuning.CACHE_FILE)
        assert cache.put("k", {"variant": "gemm"}) is False
        assert cache.get("k") == {"variant": "gemm"}
    finally:
        directory.chmod(0o700)


def test_concurrent_processes_and_threads_lose_no_entry(tmp_path):
    path = tmp_path / tuning.CACHE_FILE
    script = textwrap.dedent(f"""
        import sys
        from cupyconv.tuning import TuningCache
        cache = TuningCache({str(path)!r})
        for i in range(25):
            assert cache.put(f"p{{sys.argv[1]}}-{{i}}", {{"variant": "gemm", "i": i}})
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)], env=env) for n in range(6)]
    errors = []

    def writer(n):
        try:
            cache = tuning.TuningCache(path)
            for i in range(25):
                assert cache.put(f"t{n}-{i}", {"variant": "direct"})
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(timeout=120) for p in procs] == [0] * 6
    assert not errors
    entries = tuning.read_entries(path)
    assert set(entries) == {f"p{n}-{i}" for n in range(6) for i in range(25)} | \
        {f"t{n}-{i}" for n in range(4) for i in range(25)}


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "x"))
    assert tuning.cache_path() == tmp_path / "x" / tuning.CACHE_FILE
    monkeypatch.delenv(tuning.CACHE_DIR_ENV)
    platformdirs = pytest.importorskip("platformdirs")
    assert tuning.cache_dir() == Path(platformdirs.user_cache_dir("cupyconv", appauthor=False))


def test_the_store_follows_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "a"))
    a = store.cache()
    assert store.cache() is a and a.path == tmp_path / "a" / tuning.CACHE_FILE
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "b"))
    assert store.cache().path == tmp_path / "b" / tuning.CACHE_FILE
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "a"))
    assert store.cache() is a
    store.forget()
    assert store.cache() is not a and store.cache().path == a.path


# ------------------------------------------------------------------------- decisions

def test_first_call_times_candidates_keeps_the_fastest_and_persists_it(fresh, monkeypatch):
    cands = _cands()
    fastest = cands[2]
    timer = FakeTimer({fastest.name: 0.25}, default=1.0)
    monkeypatch.setattr(decide, "_measure", timer)
    v, _ = _choose()
    assert v == fastest
    assert timer.calls == [[c.name for c in cands]] and timer.devices == [DEV]
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) == fastest
    # the next call is a lookup
    assert _choose()[0] == fastest and len(timer.calls) == 1
    entry = _entries(fresh)[_key()]
    assert entry["variant"] == fastest.name
    assert entry["ms"][fastest.name] == 0.25 and set(entry["ms"]) == {c.name for c in cands}
    assert entry["repeat"] == decide.FIRST_CALL_REPEAT
    # another device of the process decides on its own
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 1) is None


class FakeBackground:
    """Stands in for the compiler's background builds: records what is handed over, finishes on demand."""

    def __init__(self):
        self.handed = []
        self.futures = []

    def __call__(self, specs, device_id, low_priority=False):
        self.handed.append((list(specs), device_id, low_priority))
        futures = [Future() for _ in specs]
        self.futures += futures
        return futures

    def finish(self):
        for f in self.futures:
            if not f.done():
                f.set_result(None)


def test_a_first_call_runs_the_heuristic_while_the_candidates_build_in_the_background(fresh, monkeypatch):
    from cupyconv.jit import compiler

    monkeypatch.setattr(decide, "_candidates_built", CANDIDATES_BUILT)
    background = FakeBackground()
    monkeypatch.setattr(compiler, "compile_in_background", background)
    cands = _cands()
    fastest = cands[1]
    timer = FakeTimer({fastest.name: 0.25})
    monkeypatch.setattr(decide, "_measure", timer)
    assert _choose()[0] == cands[0] == WGMMA
    assert not timer.calls and tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None
    (specs, device_id, low), = background.handed
    others = [p.spec for v in cands[1:] for p in table.plan("forward", v, THIN, "float16", "nchw",
                                                             "strict").plans()]
    assert specs == others and device_id == 0 and low, "the heuristic's caller builds it; the rest wait"
    assert not decide.settle(timeout=0.01)
    # calls while they build keep the heuristic and hand nothing over again
    assert _choose()[0] == WGMMA and not timer.calls and len(background.handed) == 1
    background.finish()
    assert decide.settle(timeout=1.0)
    assert _choose()[0] == fastest and len(timer.calls) == 1
    assert _entries(fresh)[_key()]["variant"] == fastest.name
    assert _choose()[0] == fastest and len(timer.calls) == 1 and len(background.handed) == 1


def test_candidates_already_built_are_timed_at_the_first_call(fresh, monkeypatch):
    from cupyconv.jit import compiler

    monkeypatch.setattr(decide, "_candidates_built", CANDIDATES_BUILT)
    monkeypatch.setattr(compiler, "compile_in_background", lambda specs, device_id, low_priority=False: [])
    timer = FakeTimer({_cands()[2].name: 0.5})
    monkeypatch.setattr(decide, "_measure", timer)
    assert _choose()[0] == _cands()[2] and len(timer.calls) == 1
    assert decide.settle(timeout=0)


def test_clear_forgets_the_background_builds(fresh, monkeypatch):
    from cupyconv.jit import compiler

    monkeypatch.setattr(decide, "_candidates_built", CANDIDATES_BUILT)
    background = FakeBackground()
    monkeypatch.setattr(compiler, "compile_in_background", background)
    monkeypatch.setattr(decide, "_measure", FakeTimer())
    _choose()
    tuning.clear()
    assert decide.settle(timeout=0)
    _choose()
    assert len(background.handed) == 2, "after clear() a first call hands its candidates over again"


def test_the_tuner_times_the_candidates_it_is_handed(fresh, monkeypatch):
    timer = FakeTimer({"direct": 0.5, "gemm": 2.0})
    monkeypatch.setattr(decide, "_measure", timer)
    handed = (GEMM, DIRECT)
    v = decide.choose("forward", THIN, "float16", "nchw", "strict", DEV, 0, handed, lambda v: None, lambda v: [])
    assert v == DIRECT and timer.calls == [["gemm", "direct"]]
    assert set(_entries(fresh)[_key()]["ms"]) == {"gemm", "direct"}
    # one candidate: nothing to choose, nothing timed or stored
    tuning.clear()
    assert decide.choose("grad_input", THIN, "float16", "nchw", "strict", DEV, 0, (DIRECT,), lambda v: None,
                         lambda v: []) == DIRECT
    assert len(timer.calls) == 1 and _key("grad_input") not in _entries(fresh)


def test_ties_go_to_the_heuristic(fresh, monkeypatch):
    monkeypatch.setattr(decide, "_measure", FakeTimer(default=1.0))
    assert _choose()[0] == WGMMA


def test_stored_choice_is_reused_without_timing_after_a_restart(fresh, monkeypatch):
    cands = _cands("grad_weight")
    monkeypatch.setattr(decide, "_measure", FakeTimer({cands[-1].name: 0.1}))
    assert _choose("grad_weight")[0] == cands[-1]
    tuning.clear()  # as a new process: nothing in memory, only the file

    def no_timing(*args):
        raise AssertionError("a stored choice must not be timed again")

    monkeypatch.setattr(decide, "_measure", no_timing)
    assert _choose("grad_weight")[0] == cands[-1]
    # another size in the same bucket reuses it too
    other = _g((2, 32, 10, 12), (32, 48, 3, 3), stride=2, padding=1)
    assert _choose("grad_weight", g=other)[0] == cands[-1]
    # so does another device of the same name and arch
    assert _choose("grad_weight", dev=DEV1)[0] == cands[-1]


@pytest.mark.parametrize("stored", ["direct", "gemm:7x7", "cudnn", "direct:64x64", "not a variant"])
def test_stored_choice_that_is_no_candidate_is_tuned_again(fresh, monkeypatch, stored):
    key = _key(g=WIDE, layout="nhwc")
    # the direct kernels are no candidate for a layer this wide
    assert DIRECT not in _cands(g=WIDE, layout="nhwc")
    tuning.TuningCache(fresh / tuning.CACHE_FILE).put(key, {"variant": stored})
    assert tuning.current("forward", WIDE, "float16", "nhwc", "strict", DEV, _cands(g=WIDE, layout="nhwc")) == WGMMA
    timer = FakeTimer()
    monkeypatch.setattr(decide, "_measure", timer)
    v, _ = _choose(g=WIDE, layout="nhwc")
    assert v in _cands(g=WIDE, layout="nhwc") and len(timer.calls) == 1
    assert _entries(fresh)[key]["variant"] == v.name


def test_autotune_off_uses_the_heuristic_and_writes_nothing(fresh, monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(decide, "_measure", timer)
    fresh.mkdir(parents=True)
    tuning.TuningCache(fresh / tuning.CACHE_FILE).put(_key(), {"variant": "direct"})
    before = (fresh / tuning.CACHE_FILE).read_bytes()
    v, runs = _choose()
    assert v == WGMMA and not runs and not timer.calls
    assert (fresh / tuning.CACHE_FILE).read_bytes() == before
    # without a GPU (the assumed device) and with the file's choice unread alike
    assert tuning.current("forward", THIN, "float16", "nchw", "strict", device.ASSUMED, _cands()) == WGMMA
    assert tuning.current("forward", THIN, "float16", "nchw", "strict", None, _cands()) == WGMMA
    tuning.clear()
    assert tuning.current("forward", THIN, "float16", "nchw", "strict", DEV, _cands()) == WGMMA
    assert _run_engine(Recorder(DEV), "forward").variant == WGMMA
    for off in ("false", "OFF", " no "):
        monkeypatch.setenv(tuning.AUTOTUNE_ENV, off)
        assert not tuning.enabled()
    monkeypatch.delenv(tuning.AUTOTUNE_ENV)
    assert tuning.enabled()
    assert tuning.current("forward", THIN, "float16", "nchw", "strict", DEV, _cands()) == DIRECT


def test_no_tuning_while_the_stream_is_captured(fresh, monkeypatch):
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(decide, "_measure", timer)
    monkeypatch.setattr(decide, "_capturing", lambda stream_ptr: True)
    assert _choose()[0] == WGMMA
    assert not timer.calls and not (fresh / tuning.CACHE_FILE).exists()
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None, \
        "a choice made under capture must not stick: the next eager call tunes"
    monkeypatch.setattr(decide, "_capturing", lambda stream_ptr: False)
    assert _choose()[0] == DIRECT and len(timer.calls) == 1


def test_capture_check_errs_on_the_safe_side(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda s: (_ for _ in ()).throw(RuntimeError()))
    assert decide._capturing(0) is True


def test_deterministic_mode_does_not_time_but_uses_a_stored_choice(fresh, monkeypatch):
    torch = pytest.importorskip("torch")
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(decide, "_measure", timer)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert _choose()[0] == WGMMA and not timer.calls
        tuning.clear()
        tuning.TuningCache(fresh / tuning.CACHE_FILE).put(_key(), {"variant": "direct"})
        assert _choose()[0] == DIRECT and not timer.calls
    finally:
        torch.use_deterministic_algorithms(saved)


def test_all_candidates_failing_falls_back_to_the_heuristic(fresh, monkeypatch):
    monkeypatch.setattr(decide, "_measure", lambda *a: {})
    assert _choose()[0] == WGMMA
    assert not (fresh / tuning.CACHE_FILE).exists()


def test_candidates_that_cannot_plan_or_compile_are_skipped(monkeypatch):
    from cupyconv.jit import compiler

    cands = _cands()
    bad_plan, bad_compile = cands[1], cands[2]
    bad_spec = table.plan("forward", bad_compile, THIN, "float16", "nchw", "strict").gemm.spec
    built, devices = [], set()

    def get_function(spec, device_id, arch=None):
        devices.add((device_id, arch))
        if spec == bad_spec:
            raise compiler.KernelCompileError("k", (), "error", "src")
        built.append(spec)

    def plans(v):
        if v == bad_plan:
            raise ValueError("cannot plan")
        return table.plan("forward", v, THIN, "float16", "nchw", "strict").plans()

    monkeypatch.setattr(compiler, "get_function", get_function)
    ok = decide._build(cands, plans, DEV1)
    assert ok == [c for c in cands if c not in (bad_plan, bad_compile)]
    assert len(built) == len(set(built)), "each kernel compiles once"
    assert devices == {(1, ARCH)}, "kernels compile for the device they are timed on"


def test_shape_discovery_runs_remember_nothing(fresh, monkeypatch):
    timer = FakeTimer()
    monkeypatch.setattr(decide, "_measure", timer)
    with decide.suspended():
        assert _choose()[0] == WGMMA
    assert not timer.calls and tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None


def test_engine_asks_the_tuner_once_per_configuration(fresh, monkeypatch):
    cands = _cands("grad_input")
    timer = FakeTimer({cands[1].name: 0.5})
    monkeypatch.setattr(decide, "_measure", timer)
    launcher = TimingRecorder(DEV)
    for _ in range(3):
        recorded = _run_engine(launcher, "grad_input")
        assert recorded.variant == cands[1]
        # the chosen variant's launches run, and only those
        assert {plan for _, plan in recorded.launches} == set(_plans("grad_input", cands[1]))
    assert len(timer.calls) == 1 and timer.calls[0] == [v.name for v in cands] and timer.devices == [DEV]
    assert tuning.current("grad_input", THIN, "float16", "nchw", "strict", DEV, cands) == cands[1]
    # a pass with one candidate never reaches the tuner
    assert table.candidates("grad_input", DEPTHWISE, "float64", "nchw", "strict", DEV) == (DIRECT,)
    assert _run_engine(launcher, "grad_input", g=DEPTHWISE, dtype="float64").variant == DIRECT
    assert len(timer.calls) == 1


def test_one_configuration_is_tuned_once_under_concurrent_first_calls(fresh, monkeypatch):
    timer = FakeTimer()
    monkeypatch.setattr(decide, "_measure", timer)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_choose()[0])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(timer.calls) == 1 and len(set(results)) == 1 and len(results) == 8


# ------------------------------------------------------------ choices without timing

def test_choose_without_timing_takes_the_heuristic_and_remembers_nothing(fresh, monkeypatch):
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(decide, "_measure", timer)
    v, runs = _choose(timing=False)
    assert v == WGMMA and not runs and not timer.calls
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None
    assert not (fresh / tuning.CACHE_FILE).exists()
    # what explain and host-only tools see: a recorder is never timed on
    assert _run_engine(Recorder(DEV), "forward").variant == WGMMA and not timer.calls
    # and a later eager call still tunes
    assert _choose()[0] == DIRECT and len(timer.calls) == 1


def test_choose_without_timing_takes_a_stored_or_remembered_choice(fresh, monkeypatch):
    timer = FakeTimer()
    monkeypatch.setattr(decide, "_measure", timer)
    cands = _cands("grad_weight")
    tuning.TuningCache(fresh / tuning.CACHE_FILE).put(_key("grad_weight"), {"variant": cands[1].name})
    assert _choose("grad_weight", timing=False)[0] == cands[1]
    assert _run_engine(Recorder(DEV), "grad_weight").variant == cands[1]
    assert tuning.chosen("grad_weight", THIN, "float16", "nchw", "strict", 0) is None
    # this process's choice wins over the file's
    decide.remember(("grad_weight", THIN, "float16", "nchw", "strict", 0), cands[2])
    assert _choose("grad_weight", timing=False)[0] == cands[2]
    assert _run_engine(Recorder(DEV), "grad_weight").variant == cands[2]
    assert {p for _, p in _run_engine(Recorder(DEV), "grad_weight").launches} == set(_plans("grad_weight", cands[2]))
    # the assumed device of a machine without a GPU gets the heuristic
    assert decide.choose("grad_weight", THIN, "float16", "nchw", "strict", device.ASSUMED, 0, cands,
                         lambda v: None, lambda v: [], timing=False) == cands[0]
    assert not timer.calls


# ------------------------------------------------------------------------- pinned

def test_pinned_runs_the_given_variants_and_the_heuristic_elsewhere(fresh, monkeypatch):
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(decide, "_measure", timer)
    gi = _cands("grad_input")
    decide.remember(("grad_input", THIN, "float16", "nchw", "strict", 0), gi[1])
    launcher = TimingRecorder(DEV)
    pin = _cands("forward")[2]
    with tuning.pinned({"forward": pin}):
        assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) == pin
        assert tuning.chosen("forward", WIDE, "float32", "nhwc", "tf32", 1) == pin, "a pin holds for every layer"
        assert tuning.chosen("grad_input", THIN, "float16", "nchw", "strict", 0) is None
        assert gi[0] == WGMMA and gi[1] != WGMMA
        assert tuning.current("grad_input", THIN, "float16", "nchw", "strict", DEV, gi) == WGMMA
        forward = _run_engine(launcher, "forward")
        assert forward.variant == pin and {p for _, p in forward.launches} == set(_plans("forward", pin, has_bias=True))
        # unpinned passes run their heuristic, whatever was chosen before, and time nothing
        assert _run_engine(launcher, "grad_input").variant == WGMMA
        assert _run_engine(launcher, "grad_weight").variant == WGMMA
        assert _choose("grad_weight")[0] == WGMMA
    assert not timer.calls and not (fresh / tuning.CACHE_FILE).exists()
    assert tuning.chosen("grad_weight", THIN, "float16", "nchw", "strict", 0) is None, "nothing remembered"
    # afterwards the process's choices hold again
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None
    assert tuning.chosen("grad_input", THIN, "float16", "nchw", "strict", 0) == gi[1]
    assert _run_engine(launcher, "grad_input").variant == gi[1]


def test_pins_nest_and_unwind_on_errors(fresh):
    with tuning.pinned({"forward": DIRECT}):
        with pytest.raises(RuntimeError):
            with tuning.pinned({"grad_input": DIRECT}):
                assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None
                assert tuning.chosen("grad_input", THIN, "float16", "nchw", "strict", 0) == DIRECT
                raise RuntimeError("boom")
        assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) == DIRECT
        assert tuning.chosen("grad_input", THIN, "float16", "nchw", "strict", 0) is None
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None


# ------------------------------------------------------------------------- tune()

def test_tune_parses_dicts_and_pairs():
    jobs = explicit._jobs([dict(in_channels=32, out_channels=48, kernel_size=3, stride=2, padding=1),
                           (dict(in_channels=32, out_channels=48, kernel_size=(3, 3), stride=2, padding=1,
                                 bias=False), (2, 32, 9, 11))], (2, 32, 9, 11), dtype="half", layout="channels_last")
    assert [j.g for j in jobs] == [THIN, THIN]
    assert [j.has_bias for j in jobs] == [True, False]
    assert {j.dtype for j in jobs} == {"float16"} and {j.layout for j in jobs} == {"nhwc"}
    # repeats are tuned once
    assert len(explicit._jobs([dict(in_channels=32, out_channels=48, kernel_size=3)] * 3, (2, 32, 9, 11))) == 1
    assert explicit._jobs(dict(in_channels=32, out_channels=48, kernel_size=3), (32, 9, 11))[0].precision == "strict"
    with pytest.raises(TypeError, match="input shape"):
        explicit._jobs(dict(in_channels=32, out_channels=48, kernel_size=3), None)
    with pytest.raises(TypeError, match="unknown"):
        explicit._jobs(dict(in_channels=32, out_channels=48, kernel_size=3, padding_mode="zeros"), (2, 32, 9, 11))
    with pytest.raises(ValueError):
        explicit._jobs(dict(in_channels=32, out_channels=48, kernel_size=3, groups=5), (2, 32, 9, 11))
    with pytest.raises(ValueError):
        explicit._jobs(dict(in_channels=32, out_channels=48, kernel_size=3), (2, 31, 9, 11))
    with pytest.raises(TypeError):
        explicit._jobs("layer", (2, 32, 9, 11))
    with pytest.raises(ValueError):
        cupyconv.tune(dict(in_channels=32, out_channels=48, kernel_size=3), (2, 32, 9, 11), passes=("grad_bias",))
    with pytest.raises(ValueError):
        cupyconv.tune(dict(in_channels=32, out_channels=48, kernel_size=3), (2, 32, 9, 11), repeat=0)


def test_tune_is_the_public_function_and_times_the_tuned_passes():
    assert cupyconv.tune is explicit.tune
    assert TUNED == (table.FORWARD, table.GRAD_INPUT, table.GRAD_WEIGHT)


def test_tune_finds_each_layer_of_a_model():
    torch = pytest.importorskip("torch")
    import cupyconv.torch as ct

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        ct.ConvTranspose2d(32, 24, 3, stride=2, padding=1, output_padding=1, bias=False), torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(24, 3, 3, padding=1))
    model.train()
    stats = model[1].running_mean.clone()
    jobs = explicit._jobs(model, (2, 64, 5, 7))
    assert [j.name for j in jobs] == ["0", "3", "5"]
    assert [j.g.input_shape for j in jobs] == [(2, 64, 5, 7), (2, 32, 10, 14), (2, 24, 20, 28)]
    assert [j.has_bias for j in jobs] == [True, False, True]
    assert {j.dtype for j in jobs} == {"float32"}
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(model[1].running_mean, stats), "tuning must not touch batch-norm statistics"
    x = torch.randn(2, 64, 5, 7).contiguous(memory_format=torch.channels_last)
    assert {j.layout for j in explicit._jobs(model, x)} == {"nhwc"}
    assert {j.layout for j in explicit._jobs(model, x, layout="nchw")} == {"nchw"}
    assert explicit._jobs(model[0], x.shape)[0].g == jobs[0].g
    assert explicit._jobs([(model[0], (2, 64, 5, 7)), (model[3], (1, 32, 3, 3))], None)[1].g.input_shape == \
        (1, 32, 3, 3)
    saved = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert explicit._jobs(model[0], x)[0].precision == "tf32"
        assert explicit._jobs(model[0], x, precision="strict")[0].precision == "strict"
        torch.backends.cudnn.allow_tf32 = False
        assert explicit._jobs(model[0], x)[0].precision == "strict"
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def test_tune_without_a_gpu_says_so():
    from conftest import gpu_usable

    if gpu_usable():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="GPU"):
        cupyconv.tune(dict(in_channels=32, out_channels=48, kernel_size=3), (2, 32, 9, 11))


def test_the_package_exports_the_tuning_names():
    for name in tuning.__all__:
        assert getattr(tuning, name) is not None, name
    assert tuning.pinned is decide.pinned and tuning.current is decide.current and tuning.chosen is decide.chosen
    assert tuning.TuningCache is store.TuningCache and tuning.make_key is store.make_key
    assert tuning.Variant is Variant and tuning.DIRECT == DIRECT and tuning.GEMM == GEMM


def test_import_stays_light():
    script = ("import sys, cupyconv\n"
              "heavy = [m for m in ('cupy', 'torch', 'tqdm', 'platformdirs') if m in sys.modules]\n"
              "assert not heavy, heavy\n"
              "assert callable(cupyconv.tune)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr


def test_each_candidate_is_timed_with_its_own_channels_last_copy(fresh, monkeypatch):
    """In a backward that shares grad_output's copy, timing runs still pay for their own copy, as a
    candidate that is chosen alone would: the shared copy is only for the chosen kernels."""
    runs = []

    def timer(cands, run, plans, device, stream_ptr, repeat):
        for v in cands:
            stages = []
            launcher.launch = lambda stage, plan, pointers: stages.append(stage)  # this run's launches only
            try:
                run(v)
            finally:
                del launcher.launch
            runs.append((v, stages))
        return {v: 1.0 for v in cands}

    monkeypatch.setattr(decide, "_measure", timer)
    with device.substitute(DEV):
        launcher = TimingRecorder(DEV)
        engine.backward(THIN, "float16", _Y, _X, _W, _GX, _GW, None, launcher, "nchw", "strict")
    timed = [(v, stages) for v, stages in runs if v.family in ("wgmma", "gemm")]
    assert {v.family for v, _ in timed} == {"wgmma", "gemm"}
    assert all(stages.count("to_channels_last") >= 1 for _, stages in timed)
    # the chosen kernels (wgmma's grad_input and grad_weight) share one copy of grad_output
    chosen = [p for p in launcher.passes if p.name in ("grad_input", "grad_weight")]
    copied = sum(stage == "to_channels_last" for p in chosen for stage, _ in p.launches)
    assert [p.variant for p in chosen] == [WGMMA, WGMMA] and copied == 2   # grad_output once, x once
    assert [stage for stage, _ in chosen[0].launches] == ["pack", "to_channels_last", "main"]
    assert "to_channels_last" in [stage for stage, _ in chosen[1].launches]
