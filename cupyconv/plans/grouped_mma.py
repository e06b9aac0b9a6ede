"""Thin grouped layers on mma.sync tensor cores: the forward (``conv_transpose2d_forward_grouped_mma.cu``), grad_input
(``conv_transpose2d_grad_input_grouped_mma.cu``) and grad_weight (``conv_transpose2d_grad_weight_grouped_mma.cu``).

A grouped layer of 8 input channels a group is too thin for the implicit GEMMs (their tiles are 16 or more channels
a side, and they re-read every pixel for every tap), so it ran on the direct CUDA-core kernels.  These kernels stage
a segment of one row, and the rows it meets on every kernel row, once for a few whole groups, and run every tap's
mma out of the staged rows: ldmatrix takes a row address a lane, so a tap's stride and dilation are only
addresses.  They read channels_last 16-bit data whose channels come in whole 16-byte runs.  An NCHW layer's sources
are copied into channels_last scratch first (grad_output's copy shared by grad_input and grad_weight), and the
forward and grad_input write NCHW output themselves; the tuner races them against the NCHW kernels.  On an H200,
grouped_dilated's NCHW grad_weight took 553-557 µs this way (346 of them the copies) against the direct kernel's
556 (fp16) and 662 (bf16).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

from ..core.device import MMA_SYNC, Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant, block_tile, tile_block
from . import direct, gemm
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, cdiv, index_type, layer_constants, numel, split_rows
from .reduction import finishing_reduce, split_k_scratch
from .sequences import OneKernel, PassPlan, SplitK

_MMA_KINDS = {"float16": 0, "bfloat16": 1}
# A warp holds 4 fp32 accumulators a tap for its 16 x 8 tile: 25 taps (5 x 5) keep them at 100 registers.
MAX_TAPS = 25
# Warps a block holds: one per 16 x 8 tile of its groups' channels.
_MAX_WARPS = 8
# Staged rows a block may hold; the heuristic's stay under about a fifth of an H100 SM's shared memory.
_MAX_STAGE_BYTES = 96 * 1024
_STAGE_BYTES = 48 * 1024
SEGMENTS = (16, 32, 64)


def _warps_per_group(g: Geometry) -> int:
    return (g.out_per_group // 16) * (g.in_per_group // 8)


def stage_bytes(g: Geometry, groups_per_block: int, seg: int) -> int:
    """Shared memory of a block: ``seg`` pixels of x and, on every kernel row, the grad_output columns they meet,
    for ``groups_per_block`` groups, in rows of an odd number of 16-byte units."""
    kh, kw = g.kernel
    sw, dw = g.params.stride[1], g.params.dilation[1]
    span = (seg - 1) * sw + (kw - 1) * dw + 1
    x_pitch = (groups_per_block * g.in_per_group // 8) | 1
    g_pitch = (groups_per_block * g.out_per_group // 8) | 1
    return 16 * (seg * x_pitch + kh * span * g_pitch)


def shape_fits(g: Geometry, dtype: str) -> bool:
    """16-bit data, grouped, whole 16 x 8 tiles of each group's channels, at most :data:`MAX_TAPS` taps, a warp a
    tile of one group in a block, and a 16-pixel segment that fits shared memory."""
    return (dtype in _MMA_KINDS and g.groups > 1 and g.out_per_group % 16 == 0 and g.in_per_group % 8 == 0
            and g.kernel[0] * g.kernel[1] <= MAX_TAPS and _warps_per_group(g) <= _MAX_WARPS
            and stage_bytes(g, 1, 16) <= _MAX_STAGE_BYTES and g.groups <= GRID_YZ_LIMIT)


def blocks(g: Geometry) -> List[Tuple[int, int]]:
    """(groups a block, pixels a segment) worth timing, the heuristic's first: as many groups as fill 4 warps,
    with segments of 32 pixels where they fit the heuristic's shared memory, then 16 and 64.

    Pinned on an H200 (GPU time of the pass, fp16; the direct kernel's best block and cuDNN beside):
    16x32x128x256 -> 64, 3 x 5, stride (2, 3), dilation (2, 1), 4 groups: 223 µs with 32 pixels, 236 with 64
    (direct 937, cuDNN 318); 16x128x32x32 -> 256, 3 x 3, 16 groups: 34 µs (direct 69, cuDNN 59); 4x64x30x30 -> 128,
    5 x 5, 8 groups: 35 µs with 16 pixels, 38 with 32 (direct 33, cuDNN 28)."""
    gpb = max(1, min(g.groups, 4 // _warps_per_group(g)))
    while gpb > 1 and stage_bytes(g, gpb, 16) > _MAX_STAGE_BYTES:
        gpb -= 1
    fitting = [(gpb, seg) for seg in (32, 16, 64) if stage_bytes(g, gpb, seg) <= _MAX_STAGE_BYTES]
    first = next((b for b in fitting if stage_bytes(g, *b) <= _STAGE_BYTES), (gpb, 16))  # (gpb, 16) always fits
    return [first] + [b for b in fitting if b != first]


@functools.lru_cache(maxsize=512)
def plan_grad_weight(g: Geometry, dtype: str, sm_count: int,
                     block: Optional[Tuple[int, int]] = None) -> Tuple[Plan, Optional[Plan]]:
    """The split-K partial pass over fixed chunks of (image, row) rows, and the fixed-order reduce (None for one
    chunk).  ``block``: (groups a block, pixels a segment), None for the heuristic's."""
    if not shape_fits(g, dtype):
        raise ValueError("the grouped mma grad_weight takes 16-bit grouped layers of 8k input and 16k output "
                         f"channels a group and at most {MAX_TAPS} taps")
    gpb, seg = block or blocks(g)[0]
    if not (1 <= gpb <= g.groups and gpb * _warps_per_group(g) <= _MAX_WARPS and seg in SEGMENTS
            and stage_bytes(g, gpb, seg) <= _MAX_STAGE_BYTES):
        raise ValueError(f"grouped mma block {block} does not fit the layer")
    h, w = g.in_size
    segs_w = cdiv(w, seg)
    yblocks = cdiv(g.groups, gpb)
    chunks, rows_per_chunk = split_rows(g.batch * h, yblocks, 2, sm_count, blocks_per_sm=4, row_items=segs_w)
    weight_elems = numel(g.weight_shape)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), chunks * weight_elems)
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=_MMA_KINDS[dtype], GROUPS_PER_BLOCK=gpb, SEG=seg, SINGLE_CHUNK=chunks == 1)
    spec = KernelSpec.make("conv_transpose2d_grad_weight_grouped_mma.cu", "conv_transpose2d_grad_weight_grouped_mma",
                           constants)
    threads = gpb * _warps_per_group(g) * 32
    partial = Plan(spec, (chunks, yblocks, 1), (threads, 1, 1), (g.batch, h, w) + g.out_size + (segs_w, rows_per_chunk),
                   index_t, scratch_bytes=split_k_scratch(chunks, weight_elems, 4), smem_bytes=stage_bytes(g, gpb, seg))
    return partial, finishing_reduce(dtype, weight_elems, chunks, index_t)


# ---------------------------------------------------------------------------------------------------- forward

# The forward's warps a block; a warp holds 4 fp32 accumulators an 8-channel N tile of its 16 output columns.
FORWARD_WARPS = 4
_MAX_FORWARD_OUT_CHANNELS = 64
_MAX_FORWARD_IN_CHANNELS = 32
_MAX_FORWARD_STRIDE = 8
_FORWARD_STAGE_BYTES = 64 * 1024   # three blocks an SM
_SM_SHARED_BYTES = 228 * 1024   # an H100's or H200's; an A100's 164 KB holds fewer, and its blocks take turns


def _column_offsets(g: Geometry) -> List[int]:
    """Input column offsets of the taps that reach an output column: kernel column kw reaches output column
    q * SW + r from input column q + (r + PW - kw * DW) / SW where that divides."""
    sw, pw, dw, kw = g.params.stride[1], g.params.padding[1], g.params.dilation[1], g.kernel[1]
    return [(r + pw - k * dw) // sw for r in range(sw) for k in range(kw) if (r + pw - k * dw) % sw == 0]


def forward_stage_bytes(g: Geometry, groups_per_block: int, segq: int) -> int:
    """Shared memory of a forward block: two stages of the input rows of ``segq`` columns of every phase on each
    kernel row, the block's weights and fp32 bias, and the segment's output pixels, for ``groups_per_block``
    groups."""
    offsets = _column_offsets(g)
    xspan = segq + max(offsets) - min(offsets)
    x_pitch = (groups_per_block * g.in_per_group // 8) | 1
    o_units = groups_per_block * g.out_per_group // 8
    o_row = max(16 * (o_units | 1), 16 * o_units + 4)   # the channels_last or the NCHW stores' staged pixel
    weights = cdiv(groups_per_block * g.kernel[0] * g.kernel[1] * g.out_per_group * g.in_per_group * 2, 16) * 16
    bias = cdiv(groups_per_block * g.out_per_group * 4, 16) * 16
    return 2 * 16 * g.kernel[0] * xspan * x_pitch + weights + bias + g.params.stride[1] * segq * o_row


def forward_fits(g: Geometry, dtype: str) -> bool:
    """16-bit data, grouped, whole 8-channel runs on both sides of at most 32 input and 64 output channels a group,
    a column stride of at most 8 (a warp's tile walks the phases unrolled), and a 16-column segment of one group
    that fits shared memory."""
    return (dtype in _MMA_KINDS and g.groups > 1 and g.in_per_group % 8 == 0 and g.out_per_group % 8 == 0
            and g.in_per_group <= _MAX_FORWARD_IN_CHANNELS and g.out_per_group <= _MAX_FORWARD_OUT_CHANNELS
            and g.kernel[0] * g.kernel[1] <= MAX_TAPS and g.params.stride[1] <= _MAX_FORWARD_STRIDE
            and forward_stage_bytes(g, 1, 16) <= _MAX_STAGE_BYTES
            and g.groups <= GRID_YZ_LIMIT)


def forward_blocks(g: Geometry) -> List[Tuple[int, int]]:
    """(groups a block, output columns of each phase a segment) worth timing, the heuristic's first: groups up to
    128 output channels (a pixel's 256-byte run), segments of 32 columns where three blocks fit an SM, then 16 and
    64.

    Pinned on an H200 (GPU time, fp16; the direct kernel and cuDNN beside): grouped_dilated 185 µs with 32 columns,
    200 with 64, 220 with 16 (direct 487, cuDNN 1305); 16x128x32x32 -> 256, 3 x 3, 16 groups: 19 µs with 32, 20
    with 16, 29 with 64 (direct 54, cuDNN 67)."""
    gpb = max(1, min(g.groups, 128 // g.out_per_group))
    while gpb > 1 and forward_stage_bytes(g, gpb, 16) > _MAX_STAGE_BYTES:
        gpb -= 1
    fitting = [(gpb, seg) for seg in (32, 16, 64) if forward_stage_bytes(g, gpb, seg) <= _MAX_STAGE_BYTES]
    first = next((b for b in fitting if forward_stage_bytes(g, *b) <= _FORWARD_STAGE_BYTES), (gpb, 16))
    return [first] + [b for b in fitting if b != first]


@functools.lru_cache(maxsize=512)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, sm_count: int,
                 block: Optional[Tuple[int, int]] = None, out_nchw: bool = False) -> Plan:
    """One kernel over (image, output row, segment) items, a grid of blocks walking them in turn.  ``block``:
    (groups a block, output columns of each phase a segment), None for the heuristic's; ``out_nchw``: the output
    is NCHW (x, a channels_last copy)."""
    if not forward_fits(g, dtype):
        raise ValueError("the grouped mma forward takes 16-bit grouped layers of 8k input channels a group (at most "
                         f"{_MAX_FORWARD_IN_CHANNELS}) and 8k output channels (at most {_MAX_FORWARD_OUT_CHANNELS})")
    gpb, segq = block or forward_blocks(g)[0]
    if not (1 <= gpb <= g.groups and segq in SEGMENTS and forward_stage_bytes(g, gpb, segq) <= _MAX_STAGE_BYTES):
        raise ValueError(f"grouped mma forward block {block} does not fit the layer")
    h, w = g.in_size
    h_out, w_out = g.out_size
    segs = cdiv(cdiv(w_out, g.params.stride[1]), segq)
    yblocks = cdiv(g.groups, gpb)
    items = g.batch * h_out * segs
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=_MMA_KINDS[dtype], HAS_BIAS=bool(has_bias), GROUPS_PER_BLOCK=gpb, SEGQ=segq,
                     WARPS=FORWARD_WARPS, OUT_NCHW=bool(out_nchw))
    spec = KernelSpec.make("conv_transpose2d_forward_grouped_mma.cu", "conv_transpose2d_forward_grouped_mma",
                           constants)
    # As many blocks as stay resident (up to 8 an SM), each staging its weights once for the items it walks: blocks
    # of a second wave would stage them again, and start only as the first wave ends.
    smem = forward_stage_bytes(g, gpb, segq)
    resident = max(1, min(8, _SM_SHARED_BYTES // (smem + 1024)))
    grid = (max(1, min(items, cdiv(resident * sm_count, yblocks))), yblocks, 1)
    return Plan(spec, grid, (FORWARD_WARPS * 32, 1, 1), (g.batch, h, w, h_out, w_out, segs), index_t,
                smem_bytes=smem)


# -------------------------------------------------------------------------------------------------- grad_input

GRAD_INPUT_WARPS = 4
_MAX_GRAD_INPUT_IN_CHANNELS = 32
_MAX_GRAD_INPUT_OUT_CHANNELS = 64


def grad_input_stage_bytes(g: Geometry, groups_per_block: int, seg: int) -> int:
    """Shared memory of a grad_input block: two stages of the grad_output columns ``seg`` input pixels meet on every
    kernel row, and the block's weights in rows of output-channel pairs padded by four words."""
    kh, kw = g.kernel
    sw, dw = g.params.stride[1], g.params.dilation[1]
    span = (seg - 1) * sw + (kw - 1) * dw + 1
    g_pitch = (groups_per_block * g.out_per_group // 8) | 1
    weights = groups_per_block * kh * kw * g.in_per_group * (g.out_per_group // 2 + 4) * 4
    return 2 * 16 * kh * span * g_pitch + weights


def grad_input_fits(g: Geometry, dtype: str) -> bool:
    """16-bit data, grouped, 8k input channels a group (at most 32) and 16k output channels (at most 64), at most
    :data:`MAX_TAPS` taps, and a 16-pixel segment of one group that fits shared memory."""
    return (dtype in _MMA_KINDS and g.groups > 1 and g.in_per_group % 8 == 0 and g.out_per_group % 16 == 0
            and g.in_per_group <= _MAX_GRAD_INPUT_IN_CHANNELS and g.out_per_group <= _MAX_GRAD_INPUT_OUT_CHANNELS
            and g.kernel[0] * g.kernel[1] <= MAX_TAPS and grad_input_stage_bytes(g, 1, 16) <= _MAX_STAGE_BYTES
            and g.groups <= GRID_YZ_LIMIT)


def grad_input_blocks(g: Geometry) -> List[Tuple[int, int]]:
    """Up to three (groups a block, input pixels a segment) worth timing, the heuristic's first: groups up to 64
    output channels (a grad_output pixel's 128-byte run in 16 bits) or half as many, segments of 32 or 16 pixels
    (64 last); the heuristic's is the first of them where three blocks fit an SM, else the smallest."""
    most = max(1, min(g.groups, 64 // g.out_per_group))
    half = max(1, most // 2)
    tried = dict.fromkeys(((most, 32), (most, 16), (half, 32), (half, 16), (most, 64)))
    found = [b for b in tried if grad_input_stage_bytes(g, *b) <= _MAX_STAGE_BYTES] or [(1, 16)]  # (1, 16) fits
    first = next((b for b in found if grad_input_stage_bytes(g, *b) <= _FORWARD_STAGE_BYTES),
                 min(found, key=lambda b: grad_input_stage_bytes(g, *b)))
    return ([first] + [b for b in found if b != first])[:3]


@functools.lru_cache(maxsize=512)
def plan_grad_input(g: Geometry, dtype: str, sm_count: int, block: Optional[Tuple[int, int]] = None,
                    out_nchw: bool = False) -> Plan:
    """One kernel over (image, input row, segment) items, a grid of resident blocks walking them in turn.
    ``block``: (groups a block, input pixels a segment), None for the heuristic's; ``out_nchw``: grad_input is NCHW
    (grad_output, a channels_last copy)."""
    if not grad_input_fits(g, dtype):
        raise ValueError("the grouped mma grad_input takes 16-bit grouped layers of 8k input channels a group (at "
                         f"most {_MAX_GRAD_INPUT_IN_CHANNELS}) and 16k output channels (at most "
                         f"{_MAX_GRAD_INPUT_OUT_CHANNELS})")
    gpb, seg = block or grad_input_blocks(g)[0]
    if not (1 <= gpb <= g.groups and seg in SEGMENTS and grad_input_stage_bytes(g, gpb, seg) <= _MAX_STAGE_BYTES):
        raise ValueError(f"grouped mma grad_input block {block} does not fit the layer")
    h, w = g.in_size
    segs = cdiv(w, seg)
    yblocks = cdiv(g.groups, gpb)
    items = g.batch * h * segs
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=_MMA_KINDS[dtype], GROUPS_PER_BLOCK=gpb, SEG=seg, WARPS=GRAD_INPUT_WARPS,
                     OUT_NCHW=bool(out_nchw))
    spec = KernelSpec.make("conv_transpose2d_grad_input_grouped_mma.cu", "conv_transpose2d_grad_input_grouped_mma",
                           constants)
    smem = grad_input_stage_bytes(g, gpb, seg)
    resident = max(1, min(8, _SM_SHARED_BYTES // (smem + 1024)))
    grid = (max(1, min(items, cdiv(resident * sm_count, yblocks))), yblocks, 1)
    return Plan(spec, grid, (GRAD_INPUT_WARPS * 32, 1, 1), (g.batch, h, w) + g.out_size + (segs,), index_t,
                smem_bytes=smem)


class GroupedMmaFamily(Family):
    name = "grouped_mma"
    passes = ("forward", "grad_input", "grad_weight")

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """sm_80 or newer with the tensor cores switched on, and :func:`forward_fits`, :func:`grad_input_fits` or
        :func:`shape_fits`; either layout."""
        fits = {"forward": forward_fits, "grad_input": grad_input_fits}.get(pass_, shape_fits)
        return device.tensor_cores >= MMA_SYNC and gemm.enabled() and fits(g, dtype)

    def leads(self, pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict") -> bool:
        """All but the NCHW forward, which pays a copy of x and stores NCHW output two bytes a lane: on an H200 it
        lost to the tiled forward on grouped_dilated (378 against 326 µs, fp16) and beat it on a 3 x 3 layer of 16
        groups (26 against 82; the direct kernel 42), so there it steps back and races.  NCHW grad_input alone
        lost to the direct kernel on grouped_dilated (513 against 414 µs, most of it the copy of grad_output) but
        leads: in a backward it shares that copy with grad_weight's."""
        return not (pass_ == "forward" and layout == "nchw")

    def races(self, pass_: str, g: Geometry, dtype: str) -> bool:
        """Only where the implicit GEMMs cannot run the layer (fewer than 16 channels a group on a side): on a
        4 x 4 layer of 16 a side its grad_weight took 74 µs against wgmma's 68 (H200, fp16)."""
        return not gemm.gemm_shape(g, dtype)

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        found = {"forward": forward_blocks, "grad_input": grad_input_blocks}.get(pass_, blocks)(g)
        return [Variant(self.name)] + [Variant.make(self.name, tile=block_tile(b)) for b in found[1:]]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        tile = variant.kwargs.get("tile")
        block = None if tile is None else tile_block(tile)
        nchw = layout == "nchw"
        # The 16-byte copies and stores need aligned channels_last data (else the direct kernel runs the pass); an
        # NCHW layer's kernels read aligned copies and store NCHW output an element at a time.
        if pass_ == "forward":
            if nchw:
                return OneKernel(plan_forward(g, dtype, has_bias, sm_count, block, out_nchw=True),
                                 source_copy=gemm.plan_grad_weight_sources(g, dtype)[0])
            if not aligned:
                return OneKernel(direct.plan_forward(g, dtype, has_bias, layout))
            return OneKernel(plan_forward(g, dtype, has_bias, sm_count, block))
        if pass_ == "grad_input":
            if nchw:
                return OneKernel(plan_grad_input(g, dtype, sm_count, block, out_nchw=True),
                                 source_copy=gemm.plan_grad_weight_sources(g, dtype)[1])
            if not aligned:
                return OneKernel(direct.plan_grad_input(g, dtype, layout, None, aligned))
            return OneKernel(plan_grad_input(g, dtype, sm_count, block))
        if nchw:
            return SplitK(*plan_grad_weight(g, dtype, sm_count, block), gemm.plan_grad_weight_sources(g, dtype))
        if not aligned:
            return SplitK(*direct.plan_grad_weight(g, dtype, sm_count, layout))
        return SplitK(*plan_grad_weight(g, dtype, sm_count, block))

    def clear(self) -> None:
        plan_forward.cache_clear()
        plan_grad_input.cache_clear()
        plan_grad_weight.cache_clear()


FAMILY = GroupedMmaFamily()
