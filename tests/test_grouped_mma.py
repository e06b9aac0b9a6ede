"""The grouped mma grad_weight planner (no GPU): which layers it takes, what it launches, and where the table puts
it."""
from __future__ import annotations

import pytest

from cupyconv.core.device import ASSUMED, fake
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import direct, gemm, grouped_mma, table
from cupyconv.plans.sequences import SplitK
from cupyconv.tuning import Variant


def _layer(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


# the suite's grouped_dilated: 8 input and 16 output channels a group, a 3 x 5 kernel
GROUPED_DILATED = _layer((16, 32, 128, 256), (32, 16, 3, 5), stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4)
GROUPED_MMA = Variant("grouped_mma")


@pytest.mark.parametrize("w_shape,kwargs,fits,why", [
    ((32, 16, 3, 5), dict(groups=4), True, "8 input, 16 output channels a group"),
    ((64, 32, 4, 4), dict(groups=8, stride=2), True, "two warps a group, 16 taps"),
    ((64, 16, 5, 5), dict(groups=8), True, "25 taps"),
    ((64, 16, 6, 5), dict(groups=8), False, "30 taps"),
    ((32, 8, 3, 3), dict(groups=4), False, "8 output channels a group: no whole 16 x 8 tile"),
    ((24, 16, 3, 3), dict(groups=4), False, "6 input channels a group"),
    ((128, 64, 3, 3), dict(groups=4), False, "16 warps a group"),
    ((8, 16, 3, 3), dict(), False, "one group"),
])
def test_eligibility(w_shape, kwargs, fits, why):
    g = _layer((2, w_shape[0], 9, 7), w_shape, **kwargs)
    assert grouped_mma.shape_fits(g, "float16") is fits, why
    assert grouped_mma.FAMILY.eligible("grad_weight", g, "bfloat16", "nhwc", ASSUMED) is fits, why
    for dtype in ("float32", "float64"):
        assert not grouped_mma.shape_fits(g, dtype)
    assert grouped_mma.FAMILY.eligible("grad_weight", g, "float16", "nchw", ASSUMED) is fits, why


def test_needs_mma_sync_and_the_tensor_cores_on(monkeypatch):
    assert grouped_mma.FAMILY.eligible("grad_weight", GROUPED_DILATED, "float16", "nhwc", fake(0, arch="80"))
    assert not grouped_mma.FAMILY.eligible("grad_weight", GROUPED_DILATED, "float16", "nhwc", fake(0, arch="75"))
    monkeypatch.setenv(gemm.TENSOR_CORES_ENV, "0")
    assert not grouped_mma.FAMILY.eligible("grad_weight", GROUPED_DILATED, "float16", "nhwc", ASSUMED)


def test_stage_bytes_hold_the_segment_and_every_kernel_rows_window():
    # x: 32 pixels x (4 groups x 8 channels = 4 units, pitch 5); grad_output: 3 rows x 98 columns (31 x 3 + 4 + 1)
    # x (4 x 16 = 8 units, pitch 9), 16 bytes a unit
    assert grouped_mma.stage_bytes(GROUPED_DILATED, 4, 32) == 16 * (32 * 5 + 3 * 98 * 9) == 44896
    assert grouped_mma.stage_bytes(GROUPED_DILATED, 1, 16) == 16 * (16 * 1 + 3 * 50 * 3)


def test_blocks_fill_four_warps_with_32_pixel_segments_first():
    assert grouped_mma.blocks(GROUPED_DILATED) == [(4, 32), (4, 16), (4, 64)]
    two_warps = _layer((2, 64, 9, 7), (64, 16, 4, 4), stride=2, groups=4)
    assert grouped_mma.blocks(two_warps)[0] == (2, 32)
    assert grouped_mma.blocks(_layer((2, 16, 9, 7), (16, 16, 3, 3), groups=2))[0] == (2, 32)   # only two groups
    # a window too wide for 32 pixels under the heuristic's shared memory: 16 first, 64 left out
    wide = _layer((2, 32, 9, 300), (32, 16, 5, 5), stride=(1, 8), groups=4)
    assert grouped_mma.stage_bytes(wide, 4, 32) > 48 * 1024
    assert grouped_mma.blocks(wide)[0] == (4, 16)
    assert all(grouped_mma.stage_bytes(wide, *b) <= 96 * 1024 for b in grouped_mma.blocks(wide))


def test_the_table_runs_it_first_on_channels_last_16_bit_layers_and_races_the_direct_kernels():
    for dtype in ("float16", "bfloat16"):
        cands = table.candidates("grad_weight", GROUPED_DILATED, dtype, "nhwc", "strict", ASSUMED)
        assert cands[:3] == (GROUPED_MMA, Variant.make("grouped_mma", tile="4x16"),
                             Variant.make("grouped_mma", tile="4x64"))
        assert Variant("direct") in cands
        assert all(Variant.parse(v.name) == v for v in cands)
    # NCHW runs it on channels_last copies, and leads there too
    assert table.candidates("grad_weight", GROUPED_DILATED, "bfloat16", "nchw", "strict", ASSUMED)[0] == GROUPED_MMA
    for layout in ("nhwc", "nchw"):
        assert not any(v.family == "grouped_mma"
                       for v in table.candidates("grad_weight", GROUPED_DILATED, "float32", layout, "tf32", ASSUMED))
    # 16 channels a side: the GEMMs run it, and the grouped mma kernel, which can, does not race them
    wider = _layer((2, 64, 9, 7), (64, 16, 4, 4), stride=2, groups=4)
    assert grouped_mma.FAMILY.eligible("grad_weight", wider, "float16", "nhwc", ASSUMED)
    assert not any(v.family == "grouped_mma" for v in table.candidates("grad_weight", wider, "float16", "nhwc"))


def test_plan_splits_rows_into_chunks_and_reduces_them():
    partial, reduce = grouped_mma.plan_grad_weight(GROUPED_DILATED, "float16", 132)
    constants = dict(partial.spec.constants)
    assert partial.spec.function == "conv_transpose2d_grad_weight_grouped_mma"
    assert (constants["GROUPS_PER_BLOCK"], constants["SEG"], constants["MMA_KIND"]) == (4, 32, 0)
    assert constants["SINGLE_CHUNK"] is False and reduce is not None
    assert partial.block == (128, 1, 1) and partial.smem_bytes == 44896
    chunks, rows_per_chunk = partial.grid[0], partial.scalars[-1]
    assert partial.grid[1:] == (1, 1) and chunks * rows_per_chunk >= 16 * 128 > (chunks - 1) * rows_per_chunk
    assert partial.scalars[-2] == 256 // 32   # segments a row
    assert partial.scratch_bytes == chunks * 32 * 16 * 15 * 4
    bf16 = grouped_mma.plan_grad_weight(GROUPED_DILATED, "bfloat16", 132, (4, 64))[0]
    assert dict(bf16.spec.constants)["MMA_KIND"] == 1 and dict(bf16.spec.constants)["SEG"] == 64


def test_one_chunk_writes_grad_weight_itself():
    g = _layer((1, 16, 1, 20), (16, 16, 3, 3), stride=2, padding=1, groups=2).with_weight_channels_last()
    partial, reduce = grouped_mma.plan_grad_weight(g, "float16", 132)
    assert reduce is None and partial.grid[0] == 1 and partial.scratch_bytes == 0
    assert dict(partial.spec.constants)["SINGLE_CHUNK"] is True and dict(partial.spec.constants)["WEIGHT_CL"] is True


def test_six_groups_take_two_blocks_of_four():
    g = _layer((3, 48, 7, 19), (48, 16, 2, 3), groups=6)
    partial, _ = grouped_mma.plan_grad_weight(g, "bfloat16", 132)
    assert partial.grid[1] == 2 and partial.block == (128, 1, 1)


@pytest.mark.parametrize("block", [(5, 32), (4, 48), (0, 32), (4, 8)])
def test_refuses_blocks_that_do_not_fit(block):
    with pytest.raises(ValueError, match="does not fit"):
        grouped_mma.plan_grad_weight(GROUPED_DILATED, "float16", 132, block)


def test_refuses_layers_it_cannot_run():
    with pytest.raises(ValueError, match="16-bit grouped layers"):
        grouped_mma.plan_grad_weight(GROUPED_DILATED, "float32", 132)


def test_unaligned_data_plans_the_direct_kernel():
    pinned = grouped_mma.FAMILY.plan("grad_weight", GROUPED_MMA, GROUPED_DILATED, "float16", "nhwc", "strict", False,
                                     False, 132)
    assert isinstance(pinned, SplitK)
    assert pinned == SplitK(*direct.plan_grad_weight(GROUPED_DILATED, "float16", 132, "nhwc"))


# ---------------------------------------------------------------------------------------------------- forward

@pytest.mark.parametrize("w_shape,kwargs,fits,why", [
    ((32, 16, 3, 5), dict(groups=4, stride=(2, 3)), True, "8 input, 16 output channels a group"),
    ((64, 8, 3, 3), dict(groups=8), True, "8 output channels a group: one N tile"),
    ((64, 64, 4, 4), dict(groups=2, stride=2), True, "32 input, 64 output channels a group"),
    ((128, 64, 3, 3), dict(groups=2), False, "64 input channels a group"),
    ((32, 128, 3, 3), dict(groups=4), False, "128 output channels a group"),
    ((32, 12, 3, 3), dict(groups=4), False, "12 output channels a group"),
    ((32, 16, 3, 3), dict(groups=4, stride=(1, 9)), False, "a column stride of 9"),
    ((8, 16, 3, 3), dict(), False, "one group"),
])
def test_forward_eligibility(w_shape, kwargs, fits, why):
    g = _layer((2, w_shape[0], 9, 7), w_shape, **kwargs)
    assert grouped_mma.forward_fits(g, "bfloat16") is fits, why
    assert grouped_mma.FAMILY.eligible("forward", g, "float16", "nhwc", ASSUMED) is fits, why
    assert not grouped_mma.forward_fits(g, "float32")
    assert grouped_mma.FAMILY.eligible("forward", g, "float16", "nchw", ASSUMED) is fits, why


def test_forward_stage_bytes():
    # kernel column kw reaches phase r from input column q + (r + 2 - kw) / 3: offsets 0 and 1, so 33 input columns
    # for 32 of each phase; two stages of 3 rows x 33 x (4 units, pitch 5); weights 4 x 15 x 16 x 8 halves; 64 fp32
    # biases; 96 output pixels x (8 units, pitch 9)
    assert grouped_mma.forward_stage_bytes(GROUPED_DILATED, 4, 32) == \
        2 * 16 * 3 * 33 * 5 + 4 * 15 * 16 * 8 * 2 + 64 * 4 + 16 * 96 * 9 == 45280


def test_forward_blocks_take_a_pixels_256_byte_run_of_groups():
    assert grouped_mma.forward_blocks(GROUPED_DILATED) == [(4, 32), (4, 16), (4, 64)]
    twelve = _layer((2, 96, 6, 21), (96, 16, 3, 3), stride=2, padding=1, groups=12)
    assert grouped_mma.forward_blocks(twelve)[0] == (8, 32)
    plan = grouped_mma.plan_forward(twelve, "float16", True, 132)
    assert plan.grid[1] == 2 and plan.block == (128, 1, 1)


def test_the_table_runs_the_forward_first_on_thin_groups():
    cands = table.candidates("forward", GROUPED_DILATED, "float16", "nhwc", "strict", ASSUMED)
    assert cands[0] == GROUPED_MMA and Variant("direct") in cands
    assert all(Variant.parse(v.name) == v for v in cands)
    # NCHW: it steps back behind the tiled forward, and races it
    nchw = table.candidates("forward", GROUPED_DILATED, "float16", "nchw", "strict", ASSUMED)
    assert nchw[0].family == "tiled" and GROUPED_MMA in nchw


def test_forward_plan_walks_items_with_resident_blocks():
    plan = grouped_mma.plan_forward(GROUPED_DILATED, "bfloat16", True, 132)
    constants = dict(plan.spec.constants)
    assert plan.spec.function == "conv_transpose2d_forward_grouped_mma"
    assert (constants["GROUPS_PER_BLOCK"], constants["SEGQ"], constants["MMA_KIND"], constants["HAS_BIAS"]) == \
        (4, 32, 1, True)
    h_out, w_out = GROUPED_DILATED.out_size
    assert w_out == 766   # 256 columns a phase (766 / 3 rounded up): 8 segments of 32
    assert plan.scalars == (16, 128, 256, h_out, w_out, 8)
    # 45 KB blocks: five stay resident on an SM of 228 KB
    assert plan.grid == (5 * 132, 1, 1) and plan.smem_bytes == 45280 and plan.scratch_bytes == 0
    tiny = _layer((1, 16, 2, 3), (16, 16, 3, 3), groups=2)
    assert grouped_mma.plan_forward(tiny, "float16", False, 132).grid[0] == 4   # one item for each of 4 output rows


def test_forward_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        grouped_mma.plan_forward(GROUPED_DILATED, "float16", False, 132, (4, 48))
    with pytest.raises(ValueError, match="16-bit grouped layers"):
        grouped_mma.plan_forward(GROUPED_DILATED, "float32", False, 132)


def test_unaligned_data_plans_the_direct_forward():
    planned = grouped_mma.FAMILY.plan("forward", GROUPED_MMA, GROUPED_DILATED, "float16", "nhwc", "strict", True,
                                      False, 132)
    assert planned.plans() == [direct.plan_forward(GROUPED_DILATED, "float16", True, "nhwc")]


# -------------------------------------------------------------------------------------------------- grad_input

@pytest.mark.parametrize("w_shape,kwargs,fits,why", [
    ((32, 16, 3, 5), dict(groups=4, stride=(2, 3)), True, "8 input, 16 output channels a group"),
    ((32, 32, 4, 4), dict(groups=2, stride=2), True, "16 input, 32 output channels a group"),
    ((64, 64, 4, 4), dict(groups=2, stride=2), False, "16 taps of 32 x 64 channels: weights past shared memory"),
    ((64, 8, 3, 3), dict(groups=8), False, "8 output channels a group: no k16 step"),
    ((128, 64, 3, 3), dict(groups=2), False, "64 input channels a group"),
    ((32, 128, 3, 3), dict(groups=4), False, "128 output channels a group"),
    ((32, 16, 6, 5), dict(groups=4), False, "30 taps"),
    ((8, 16, 3, 3), dict(), False, "one group"),
])
def test_grad_input_eligibility(w_shape, kwargs, fits, why):
    g = _layer((2, w_shape[0], 9, 7), w_shape, **kwargs)
    assert grouped_mma.grad_input_fits(g, "float16") is fits, why
    assert grouped_mma.FAMILY.eligible("grad_input", g, "bfloat16", "nhwc", ASSUMED) is fits, why
    assert not grouped_mma.grad_input_fits(g, "float32")
    assert grouped_mma.FAMILY.eligible("grad_input", g, "float16", "nchw", ASSUMED) is fits, why


def test_grad_input_stage_bytes():
    # two stages of 3 rows x 98 grad_output columns (31 x 3 + 4 + 1) x (2 groups x 16 channels = 4 units, pitch 5);
    # weights 2 groups x 15 taps x 8 input channels x (8 channel pairs + 4) words
    assert grouped_mma.grad_input_stage_bytes(GROUPED_DILATED, 2, 32) == \
        2 * 16 * 3 * 98 * 5 + 2 * 15 * 8 * 12 * 4 == 58560


def test_grad_input_blocks_and_plan():
    assert grouped_mma.grad_input_blocks(GROUPED_DILATED) == [(2, 32), (4, 16), (2, 16)]
    plan = grouped_mma.plan_grad_input(GROUPED_DILATED, "float16", 132)
    constants = dict(plan.spec.constants)
    assert plan.spec.function == "conv_transpose2d_grad_input_grouped_mma"
    assert (constants["GROUPS_PER_BLOCK"], constants["SEG"], constants["MMA_KIND"]) == (2, 32, 0)
    assert plan.scalars == (16, 128, 256) + GROUPED_DILATED.out_size + (8,)
    # 58.6 KB blocks: three stay resident on an SM of 228 KB, over two blocks of groups
    assert plan.grid == (3 * 132 // 2, 2, 1) and plan.smem_bytes == 58560 and plan.scratch_bytes == 0
    with pytest.raises(ValueError, match="does not fit"):
        grouped_mma.plan_grad_input(GROUPED_DILATED, "float16", 132, (4, 64))


def test_the_table_runs_grad_input_first_on_thin_groups():
    cands = table.candidates("grad_input", GROUPED_DILATED, "bfloat16", "nhwc", "strict", ASSUMED)
    assert cands[0] == GROUPED_MMA and Variant("direct") in cands
    assert [v.name for v in cands if v.family == "grouped_mma"] == ["grouped_mma", "grouped_mma:4x16",
                                                                     "grouped_mma:2x16"]
    planned = grouped_mma.FAMILY.plan("grad_input", GROUPED_MMA, GROUPED_DILATED, "float16", "nhwc", "strict", False,
                                      False, 132)
    assert planned.plans() == [direct.plan_grad_input(GROUPED_DILATED, "float16", "nhwc", None, False)]


def test_nchw_layers_read_channels_last_copies_and_store_nchw():
    """An NCHW layer's passes read channels_last copies (grad_output's one plan object, which a backward shares
    between grad_input and grad_weight) whatever the alignment, and the forward and grad_input store NCHW."""
    g = GROUPED_DILATED
    x_copy, go_copy = gemm.plan_grad_weight_sources(g, "float16")
    for aligned in (True, False):
        forward = table.plan("forward", GROUPED_MMA, g, "float16", "nchw", "strict", True, aligned, 132)
        grad_input = table.plan("grad_input", GROUPED_MMA, g, "float16", "nchw", "strict", False, aligned, 132)
        grad_weight = table.plan("grad_weight", GROUPED_MMA, g, "float16", "nchw", "strict", False, aligned, 132)
        assert forward.source_copy is x_copy and grad_input.source_copy is go_copy
        assert dict(forward.main.spec.constants)["OUT_NCHW"] is True
        assert dict(grad_input.main.spec.constants)["OUT_NCHW"] is True
        assert isinstance(grad_weight, SplitK) and grad_weight.sources == (x_copy, go_copy)
        assert grad_weight.partial.spec.function == "conv_transpose2d_grad_weight_grouped_mma"
        assert go_copy in grad_input.plans() and x_copy in forward.plans()
    cl = table.plan("forward", GROUPED_MMA, g, "float16", "nhwc", "strict", True, True, 132)
    assert cl.source_copy is None and dict(cl.main.spec.constants)["OUT_NCHW"] is False


def test_nchw_forward_stage_holds_the_odd_word_pitch():
    """A staged output pixel takes the larger of its two rows: whole 16-byte units of an odd count (channels_last
    stores), or the units and one word (NCHW stores)."""
    g = _layer((2, 16, 9, 7), (16, 8, 3, 3), stride=2, groups=2)
    # 16 more columns of each phase: 16 more staged input pixels on each of 3 kernel rows, in both stages (a pitch of
    # 1 unit for one group, 3 for two), and 2 x 16 more output pixels, of 20 bytes for one group's 8 channels
    # (NCHW; 16 channels_last) and of 48 for two groups' 16 (channels_last, 3 units; 36 NCHW)
    def more(groups):
        return grouped_mma.forward_stage_bytes(g, groups, 32) - grouped_mma.forward_stage_bytes(g, groups, 16)

    assert more(1) == 2 * 3 * 16 * 16 + 32 * 20
    assert more(2) == 2 * 3 * 16 * 16 * 3 + 32 * 48
