"""The direct family's planner: the grad_input and grad_weight thread blocks the tuner races, and the blocks it
refuses."""
from __future__ import annotations

import pytest

from cupyconv.core.device import ASSUMED
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import direct, table
from cupyconv.tuning.variants import Variant


def _geometry(x_shape, w_shape, **kwargs):
    params = ConvParams.from_args(**kwargs)
    return geometry(x_shape, w_shape, None, params)


GROUPED = _geometry((16, 32, 128, 256), (32, 16, 3, 5), stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4)
DEPTHWISE = _geometry((16, 128, 64, 64), (128, 1, 4, 4), stride=2, padding=1, groups=128)
DENSE_THIN = _geometry((8, 32, 64, 64), (32, 16, 3, 3))


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_grouped_layers_race_grad_weight_blocks_under_the_accumulator_cap(layout):
    blocks = direct.grad_weight_blocks(GROUPED, "float16", layout)
    assert blocks[0] == (8, 1, 1)   # the heuristic's: all eight input channels, one kernel row
    assert len(blocks) == len(set(blocks)) > 1
    assert (8, 1, 3) in blocks   # every kernel row in one thread
    for ic, oc, kh in blocks:
        assert ic * oc * kh * GROUPED.kernel[1] <= 128
        assert oc == 1 or layout == "nchw"   # a channels_last thread holds one output channel
    if layout == "nchw":
        assert (8, 2, 1) in blocks


BLOCKS = {"grad_input": direct.grad_input_blocks, "grad_weight": direct.grad_weight_blocks}


def _planned_block(pass_, plan, layout):
    """The block a pass's (first) kernel was planned for, as :data:`BLOCKS` lists it."""
    constants = dict(plan.spec.constants)
    if pass_ == "grad_weight":
        return constants["IC_BLOCK"], constants.get("OC_BLOCK", 1), constants["KH_BLOCK"]
    return constants["IC_BLOCK" if layout == "nchw" else "ICB"], constants["CELLS"]


@pytest.mark.parametrize("pass_", list(BLOCKS))
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_raced_candidates_name_their_blocks_and_plan_them(pass_, layout):
    # channels_last 16-bit grad_weight runs the grouped mma kernel first; the direct kernels race it
    cands = [v for v in table.candidates(pass_, GROUPED, "bfloat16", layout, "strict", ASSUMED) if v.family == "direct"]
    assert cands[0] == Variant("direct")
    blocks = BLOCKS[pass_](GROUPED, "bfloat16", layout)
    assert [v.kwargs.get("tile") for v in cands[1:]] == ["x".join(map(str, b)) for b in blocks[1:]]
    specs = set()
    for v, block in zip(cands, blocks):
        assert Variant.parse(v.name) == v
        plans = table.plan(pass_, v, GROUPED, "bfloat16", layout).plans()
        assert _planned_block(pass_, plans[0], layout) == block
        if pass_ == "grad_input":   # one kernel, over runs of a row's pixels (cells_w)
            assert len(plans) == 1 and plans[0].scalars[-1] == -(-GROUPED.in_size[1] // block[1])
        specs.add(plans[0].spec)
    assert len(specs) == len(blocks)


def test_only_the_heuristic_where_blocks_would_not_pay_or_fit():
    assert direct.grad_weight_blocks(GROUPED, "float64", "nchw") == [(8, 1, 1)]   # double accumulators
    assert len(direct.grad_weight_blocks(DEPTHWISE, "float16", "nhwc")) == 1    # nothing to block
    for layout in ("nchw", "nhwc"):   # a tensor-core family runs it: the direct kernels race their heuristic
        assert len(direct.grad_weight_blocks(DENSE_THIN, "float16", layout)) == 1
        direct_cands = [v for v in table.candidates("grad_weight", DENSE_THIN, "float16", layout, "strict", ASSUMED)
                        if v.family == "direct"]
        assert direct_cands == [Variant("direct")]


@pytest.mark.parametrize("layout,block", [("nchw", (9, 1, 1)), ("nchw", (8, 17, 1)), ("nchw", (8, 1, 4)),
                                          ("nchw", (0, 1, 1)), ("nhwc", (8, 2, 1))])
def test_a_block_the_layer_cannot_hold_is_refused(layout, block):
    with pytest.raises(ValueError, match="block"):
        direct.plan_grad_weight(GROUPED, "float16", 132, layout, block)


G8_3X3 = _geometry((16, 64, 64, 64), (64, 8, 3, 3), stride=1, padding=1, groups=8)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_grouped_layers_race_grad_input_blocks_of_more_accumulators(layout):
    for g in (GROUPED, G8_3X3):
        blocks = direct.grad_input_blocks(g, "float16", layout)
        heuristic = blocks[0]
        assert len(blocks) == len(set(blocks)) > 1
        sw, dw, kw = g.params.stride[1], g.params.dilation[1], g.kernel[1]
        for ic, cells in blocks:
            assert ic * cells <= 64 and (cells - 1) * sw + (kw - 1) * dw + 1 <= 32
            assert ic >= heuristic[0]   # fewer channels a thread never won
            assert layout == "nchw" or g.in_per_group % ic == 0   # a channels_last thread's channels in one group
    assert direct.grad_input_blocks(GROUPED, "float16", "nchw") == [(8, 4), (8, 8), (8, 2)]
    assert (4, 16) in direct.grad_input_blocks(G8_3X3, "float16", "nhwc")


def test_grad_input_races_only_the_heuristic_where_blocks_would_not_pay():
    assert direct.grad_input_blocks(GROUPED, "float64", "nchw") == [(8, 4)]
    assert direct.grad_input_blocks(DEPTHWISE, "float16", "nhwc") == [(1, 8)]   # no wider window, one channel
    for layout in ("nchw", "nhwc"):
        assert len(direct.grad_input_blocks(DENSE_THIN, "float16", layout)) == 1


@pytest.mark.parametrize("layout,block", [("nchw", (9, 4)), ("nchw", (0, 4)), ("nchw", (8, 0)), ("nhwc", (3, 2)),
                                          ("nhwc", (16, 2))])
def test_a_grad_input_block_the_layer_cannot_hold_is_refused(layout, block):
    with pytest.raises(ValueError, match="block|channels"):
        direct.plan_grad_input(GROUPED, "float16", layout, block)


@pytest.mark.parametrize("dtype,run", [("float16", 8), ("bfloat16", 8), ("float32", 4), ("float64", 1)])
def test_channels_last_grad_input_reads_grad_output_in_16_byte_runs_where_it_can(dtype, run):
    def oc_vec(g, aligned=True):
        return dict(direct.plan_grad_input(g, dtype, "nhwc", aligned=aligned).spec.constants)["OC_VEC"]

    assert oc_vec(GROUPED) == run                  # 16 output channels a group
    assert oc_vec(GROUPED, aligned=False) == 1     # grad_output off a 16-byte boundary
    assert oc_vec(DEPTHWISE) == 1                  # one channel a group
    odd = _geometry((2, 24, 9, 9), (24, 6, 3, 3), stride=2, groups=4)   # 6 channels a group: runs would straddle
    assert oc_vec(odd) == (run if 6 % run == 0 else 1)   # float64 reads a channel at a time everywhere
    for g in (GROUPED, DEPTHWISE):   # the NCHW kernel has no such runs
        assert "OC_VEC" not in dict(direct.plan_grad_input(g, dtype, "nchw").spec.constants)


def test_staged_weight_chunks_hold_whole_runs_of_output_channels():
    def constants(w_shape):
        g = _geometry((2, w_shape[0], 9, 9), w_shape, stride=2)
        c = dict(direct.plan_grad_input(g, "float16", "nhwc").spec.constants)
        return c["OC_VEC"], c["OC_CHUNK"]

    assert constants((32, 32, 5, 5)) == (8, 8)    # 12 channels' weights fit: staged 8 at a time
    assert constants((64, 64, 7, 7)) == (1, 3)    # not even 8 fit: a channel at a time
