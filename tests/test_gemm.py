"""The mma.sync GEMM planners without a GPU: where forward and grad_input split K, and what a split plan launches.

The split kernels' arithmetic runs on the GPU (tests/test_gemm_gpu.py); their reduce runs emulated in
tests/test_kernels_emulated.py.
"""
import math

import pytest

from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import gemm, launch, table
from cupyconv.plans.launch import Recorder
from cupyconv.core import device
from cupyconv.tuning.variants import Variant


def _g(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


# pix2pix's innermost decoder layer: 16 images of 4 x 4, a 33.5 MB float32 weight, a 2 MB output
WEIGHT_BOUND = _g((16, 1024, 4, 4), (1024, 512, 4, 4), stride=2, padding=1)
# DCGAN's third layer: 128 images of 8 x 8, its output eight times its weight
OUTPUT_BOUND = _g((128, 256, 8, 8), (256, 128, 4, 4), stride=2, padding=1)


def _split(plan):
    return dict(plan.gemm.spec.constants)["SPLIT_K"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bound_small_grids_split_k_and_reduce_in_the_destination_layout(dtype):
    for pass_, planner in (("forward", gemm.plan_forward_gemm), ("grad_input", gemm.plan_grad_input_gemm)):
        for layout in launch.LAYOUTS:
            args = (WEIGHT_BOUND, dtype, True, layout, "tf32") if pass_ == "forward" else \
                (WEIGHT_BOUND, dtype, layout, "tf32")
            plan = planner(*args)
            split = _split(plan)
            assert split > 1, (pass_, layout)
            out = WEIGHT_BOUND.output_shape if pass_ == "forward" else WEIGHT_BOUND.input_shape
            assert plan.gemm.scratch_bytes == split * math.prod(out) * 4, "fp32 partials of every output element"
            # the partials may move no more bytes than the weight
            assert plan.gemm.scratch_bytes <= math.prod(WEIGHT_BOUND.weight_shape) * (4 if dtype == "float32" else 2)
            phases = 4 if pass_ == "forward" else 1
            assert plan.gemm.grid[2] == phases * split
            reduce = plan.reduce
            assert reduce.spec.function == "reduce_partials_bias"
            channels = out[1]
            stride = 1 if layout == "nhwc" else out[2] * out[3]
            assert reduce.scalars == (math.prod(out), split, channels, stride)
            assert plan.plans()[-1] is reduce
            assert planner(*args, split=1).reduce is None


def test_split_ranges_are_whole_even_and_long_enough():
    bm = gemm.TILES["128x128"]
    for k_tiles in (8, 9, 31, 32, 64, 100, 256, 1000):
        for blocks in (1, 8, 32, 200):
            split = gemm.gemm_splits(blocks, bm.warps_m * bm.warps_n, k_tiles, 132, 1 << 30, 1)
            per = math.ceil(k_tiles / split)
            assert 1 <= split <= 32 and (split - 1) * per < k_tiles, "no K range is empty"
            assert split == 1 or per >= 8
            assert split == 1 or k_tiles >= 32, "a short GEMM runs whole"
    # each limit in turn: 32 K tiles in all, 16 warps an SM, 8 K tiles a range, 32 ranges, partials no larger
    # than the weight
    assert gemm.gemm_splits(1, 8, 31, 132, 1 << 30, 1) == 1
    assert gemm.gemm_splits(1, 8, 32, 132, 1 << 30, 1) == 4
    assert gemm.gemm_splits(33, 8, 1000, 132, 1 << 30, 1) == 8
    assert gemm.gemm_splits(1, 8, 40, 132, 1 << 30, 1) == 5
    assert gemm.gemm_splits(1, 8, 1000, 132, 1 << 30, 1) == 32
    assert gemm.gemm_splits(1, 8, 1000, 132, 4 * 1000 * 3, 1000) == 3
    assert gemm.gemm_splits(1, 8, 100, 132, 1 << 30, 1) == 12 and math.ceil(100 / 12) * 11 < 100
    assert gemm.gemm_splits(1000, 8, 1000, 132, 1 << 30, 1) == 1, "a grid that fills the SMs runs whole"
    assert gemm.gemm_splits(4, 8, 1000, 132, 1 << 30, 1 << 28) == 1, "partials larger than the weight: no split"
    empty = _g((0, 1024, 4, 4), (1024, 512, 4, 4), stride=2, padding=1)
    assert gemm.gemm_splits(0, 8, 1000, 132, 1 << 30, 0) == 1
    assert _split(gemm.plan_forward_gemm(empty, "float16", True, "nchw")) == 1, "a batch of none plans, unsplit"


def test_a_small_layers_short_gemm_runs_whole():
    # 16 -> 32 channels, 3x3: grad_input's K is 32 x 9 = 288, 18 fp32 K tiles (9 in 16 bits)
    small = _g((1, 16, 5, 7), (16, 32, 3, 3), stride=2, padding=1)
    for dtype in ("float32", "float16"):
        assert gemm.plan_grad_input_gemm(small, dtype, "nchw", "tf32").reduce is None
        assert _split(gemm.plan_forward_gemm(small, dtype, True, "nchw", "tf32")) == 1
    # twice the K (64 -> 128 channels, stride 1): 72 fp32 K tiles, split
    wider = _g((4, 64, 8, 8), (64, 128, 3, 3), stride=1, padding=1)
    assert gemm.plan_grad_input_gemm(wider, "float32", "nchw", "tf32").reduce is not None


def test_layers_whose_grids_fill_the_gpu_or_whose_outputs_outweigh_their_weights_run_whole():
    for dtype in ("float32", "float16"):
        assert _split(gemm.plan_forward_gemm(OUTPUT_BOUND, dtype, True, "nchw", "tf32")) == 1
        assert gemm.plan_grad_input_gemm(OUTPUT_BOUND, dtype, "nchw", "tf32").reduce is None


def test_more_sms_split_less():
    few = _split(gemm.plan_forward_gemm(WEIGHT_BOUND, "float16", False, "nhwc", sm_count=132))
    many = _split(gemm.plan_forward_gemm(WEIGHT_BOUND, "float16", False, "nhwc", sm_count=16))
    assert many < few


def test_a_split_is_checked_and_its_offsets_widened():
    for bad in (0, -2, True, 2.0, "4"):
        with pytest.raises(ValueError, match="split"):
            gemm.plan_forward_gemm(WEIGHT_BOUND, "float16", False, "nhwc", split=bad)
    with pytest.raises(ValueError, match="grid's z limit"):
        gemm.plan_forward_gemm(_g((1, 16, 2, 2), (16, 16, 1, 1), stride=(256, 256)), "float16", False, "nhwc",
                               split=2)
    # 2**31 partial elements need 64-bit offsets though the tensors themselves do not
    g = _g((64, 64, 64, 64), (64, 64, 4, 4), stride=2, padding=1)
    out = math.prod(g.output_shape)
    assert out < 2 ** 31 and gemm.plan_forward_gemm(g, "float16", False, "nhwc", split=1).gemm.index_t == "int"
    wide = gemm.plan_forward_gemm(g, "float16", False, "nhwc", split=2 ** 31 // out + 1)
    assert wide.gemm.index_t == "long long" and wide.reduce.index_t == "long long"


def test_the_tuner_races_the_split_against_one_range():
    for dtype, precision in (("float32", "tf32"), ("float16", "strict")):
        names = [v.name for v in table.candidates("forward", WEIGHT_BOUND, dtype, "nchw", precision)]
        assert "gemm" in names and "gemm:k1" in names
        assert names.index("gemm:k1") == names.index("gemm") + 1
    assert "gemm:k1" not in [v.name for v in table.candidates("forward", OUTPUT_BOUND, "float16", "nchw")]
    v = Variant.parse("gemm:64x128:k4")
    assert v.kwargs == {"tile": "64x128", "split": 4} and v.name == "gemm:64x128:k4"
    assert _split(table.plan("grad_input", v, WEIGHT_BOUND, "float16", "nhwc")) == 4


def test_a_split_pass_launches_its_partials_then_the_reduce_with_the_bias():
    dev = device.fake(0, arch="90")
    recorder = Recorder(dev)
    plan = gemm.plan_forward_gemm(WEIGHT_BOUND, "float16", True, "nchw", sm_count=dev.sm_count)
    recorder.enter("forward", Variant("gemm"))
    x, w, b, y = (i << 36 for i in range(1, 5))
    calls = []
    recorder.launch = lambda stage, p, pointers: calls.append((stage, p, tuple(pointers)))
    plan.run(recorder, (x, w, b, y))
    assert [c[0] for c in calls] == ["pack", "to_channels_last", "partial", "reduce"]
    (_, _, (_, packed)), (_, _, (_, x_cl)), (_, gemm_plan, partial_args), (_, reduce, reduce_args) = calls
    partials = partial_args[3]
    assert partial_args == (x_cl, packed, b, partials) and gemm_plan is plan.gemm
    assert reduce_args == (partials, b, y) and reduce is plan.reduce
    assert len({packed, x_cl, partials}) == 3 and partials not in (x, w, b, y)


def test_split_gemm_leads_weight_bound_grids_in_16_bits():
    """The 16-bit halo-tile kernels step behind the GEMM where it splits K four ways or more: their few tiles each
    read the whole weight.  Where it splits less, or not at all, they lead as before."""
    from cupyconv.plans import wgmma

    for dtype in ("float16", "bfloat16"):
        for pass_ in ("forward", "grad_input"):
            assert gemm.heuristic_splits(pass_, WEIGHT_BOUND, dtype, "strict") >= wgmma.SPLIT_GEMM_LEADS
            # (grad_input's gather GEMM steps back too, and races them both)
            eligible = table.eligible(pass_, WEIGHT_BOUND, dtype, "nhwc")
            halo_and_gemm = [f.name for f in eligible if f.name != "scatter_gemm"]
            assert halo_and_gemm[:2] == ["gemm", "wgmma"]
            assert table.candidates(pass_, WEIGHT_BOUND, dtype, "nhwc")[0] == Variant("gemm")
            assert gemm.heuristic_splits(pass_, OUTPUT_BOUND, dtype, "strict") == 1
            # (grad_input of its 4 x 4 stride-2 taps on 256 input channels: the gather GEMM leads)
            first = "scatter_gemm" if pass_ == "grad_input" else "wgmma"
            assert table.eligible(pass_, OUTPUT_BOUND, dtype, "nhwc")[0].name == first


def test_halo_kernels_reading_the_weight_in_place_lead_grad_input_gemms_split_fewer_than_16_ways():
    """Without its pack the 16-bit halo-tile grad_input leads until the GEMM splits 16 ways: pix2pix's 8²
    grad_input (4 ways), not its 4² one (16).  Forwards keep the limit of 4: pix2pix's 4² (8 ways) takes the GEMM."""
    from cupyconv.plans import wgmma

    def leader(pass_, g):
        # (on grid8 the gather GEMM leads them both: test_scatter_gemm)
        return next(f.name for f in table.eligible(pass_, g, "bfloat16", "nhwc") if f.name != "scatter_gemm")

    grid8 = _g((16, 1024, 8, 8), (1024, 512, 4, 4), stride=2, padding=1)
    for g, pass_, splits, first in ((WEIGHT_BOUND, "forward", 8, "gemm"), (WEIGHT_BOUND, "grad_input", 16, "gemm"),
                                    (grid8, "grad_input", 4, "wgmma")):
        assert gemm.heuristic_splits(pass_, g, "bfloat16", "strict") == splits
        assert leader(pass_, g.with_weight_channels_last()) == first
        # a contiguous weight still packs: the GEMM leads from 4 ways
        assert leader(pass_, g) == "gemm"
    assert wgmma.SPLIT_GEMM_LEADS_IN_PLACE == 16


# ---------------------------------------------------------------- a channels_last weight read in place

CL_WEIGHT = WEIGHT_BOUND.with_weight_channels_last()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gemms_read_a_channels_last_16_bit_weight_in_place(dtype):
    """Its output channels are one run per input channel and tap: grad_input's K, as in the pack, and the forward's
    N, a [K][N] tile.  No pack runs."""
    for layout in launch.LAYOUTS:
        for plan in (gemm.plan_grad_input_gemm(CL_WEIGHT, dtype, layout),
                     gemm.plan_forward_gemm(CL_WEIGHT, dtype, True, layout)):
            assert plan.pack is None and dict(plan.gemm.spec.constants)["WEIGHT_DIRECT"]
            assert "pack_weight" not in [p.spec.function for p in plan.plans()]


def test_gemms_pack_weights_they_cannot_read_in_place():
    cases = {
        "contiguous": (WEIGHT_BOUND, "bfloat16", True),
        "float32": (CL_WEIGHT, "float32", True),
        "unaligned pointer": (CL_WEIGHT, "bfloat16", False),
        # 20 output channels a group: not whole 16-byte runs
        "odd output channels": (_g((2, 32, 6, 6), (32, 20, 3, 3), stride=2).with_weight_channels_last(),
                                "float16", True),
    }
    for name, (g, dtype, aligned) in cases.items():
        for plan in (gemm.plan_grad_input_gemm(g, dtype, "nhwc", "tf32", aligned=aligned),
                     gemm.plan_forward_gemm(g, dtype, True, "nhwc", "tf32", aligned=aligned)):
            assert plan.pack is not None and not dict(plan.gemm.spec.constants)["WEIGHT_DIRECT"], name


def test_a_pass_without_a_pack_launches_on_the_weight_and_allocates_no_scratch():
    dev = device.fake(0, arch="80")
    recorder = Recorder(dev)
    plan = gemm.plan_grad_input_gemm(CL_WEIGHT, "bfloat16", "nhwc", split=1)
    assert plan.reduce is None and plan.to_channels_last is None
    recorder.enter("grad_input", Variant("gemm"))
    go, w, gi = (i << 36 for i in range(1, 4))
    calls, allocations = [], []
    recorder.launch = lambda stage, p, pointers: calls.append((stage, p, tuple(pointers)))
    recorder.alloc = lambda nbytes: allocations.append(nbytes) or (None, 1 << 40)
    plan.run(recorder, (go, w, gi))
    assert calls == [("main", plan.gemm, (go, w, 0, gi))] and allocations == []
    # split, the partials still take scratch
    split = gemm.plan_grad_input_gemm(CL_WEIGHT, "bfloat16", "nhwc", split=4)
    calls.clear()
    split.run(recorder, (go, w, gi))
    assert [c[0] for c in calls] == ["partial", "reduce"] and calls[0][2][1] == w
    assert allocations == [launch.aligned_size(split.gemm.scratch_bytes)]


def test_carving_nothing_calls_no_allocator():
    def alloc(nbytes):
        raise AssertionError("allocated")
    assert launch.carve(alloc, []) == (None, [])
    assert launch.carve(alloc, [0, 0]) == (None, [0, 0])


def test_the_tensor_core_switch_follows_the_environment_as_it_changes(monkeypatch):
    """``CUPYCONV_TENSOR_CORES`` is read at each call (through the mapping behind os.environ): set, changed,
    padded with spaces and removed within one process."""
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV, raising=False)
    assert gemm.enabled()
    for value, on in (("0", False), (" 0 ", False), ("1", True), ("", True), ("off", True)):
        monkeypatch.setenv(gemm.TENSOR_CORES_ENV, value)
        assert gemm.enabled() is on, value
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV)
    assert gemm.enabled()
