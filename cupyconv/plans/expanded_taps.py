"""Tensor-core gradients for layers with few output channels, through grad_output expanded by taps.

A generator's last layer (64 or 128 channels up to 3 RGB channels, 4 x 4 at stride 2) is too thin in its output
channels for the GEMM families, which need 16 channels a side, so its gradients ran on direct kernels: TAPS x
C_out CUDA-core multiply-adds for each input value read (grad_weight) or written (grad_input), several times
cuDNN's time.  Expanded by taps, G[pixel][tap * C_out + oc] (``kernels/include/tap_expanded_grad_out.cuh``),
grad_output turns both into mma.sync GEMMs with the taps in N (grad_weight: x^T G, split over pixel ranges and
reduced in a fixed order) or in K (grad_input: G W), and each kernel streams the large tensor, x, once.
One group, sm_80 and newer: fp16 and bf16 in both layouts, and float32 in NCHW (a float32 model's layout;
channels_last float32 tiles would need 32-bit transposed fragment loads), as TF32 where TF32 is allowed and as
3xTF32 (float32's accuracy) where it is not.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

from ..core import dtypes
from ..core.device import MMA_SYNC, Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import direct, gemm
from .family import Family
from .launch import Plan, cdiv, index_type, layer_constants, numel, split_rows
from .reduction import plan_wide_reduce, split_k_scratch
from .sequences import OneKernel, PassPlan, SplitK

MAX_OUT_CHANNELS = 15   # from 16 a side the GEMM families run the layer
MAX_EXPANDED = 128      # taps x output channels, padded: grad_weight's accumulators (64 a thread at most)
MAX_PREFETCHED = 64     # grad_output values a thread holds for the next tile (ptxas: up to 238 registers, 0 spills)
# strict float32's 3xTF32 holds three forms of each fragment and a second set of accumulators: past 64 expanded
# columns (an n8 tile each, every warp all of them) its kernels spilled (ptxas, sm_80 and sm_90, 112 columns)
MAX_EXPANDED_3XTF32 = 64
TILE_PIXELS = 64        # input pixels of a K tile (grad_weight) or of an M tile (grad_input)
THREADS = 128
STAGES = 4              # grad_weight's ring of x and G tiles, where it fits SMEM_LIMIT
STAGE_CHOICES = (3, 4)  # a 6-deep ring ran no faster on an H200 (v26 notes)
SMEM_LIMIT = 99 * 1024  # the least a block may opt in to where the family runs (sm_86 and sm_89)
SMEM_PER_SM = 227 * 1024
MAX_BLOCKS_PER_SM = 4


def expanded_columns(g: Geometry) -> int:
    """Taps x output channels, padded to whole k16 steps."""
    return cdiv(g.kernel[0] * g.kernel[1] * g.out_channels, 16) * 16


def prefetched_values(g: Geometry) -> int:
    """The grad_output values a thread holds in registers for the next tile: whole (pixel, kernel row) runs of
    KW x C_out values, :data:`TILE_PIXELS` x KH runs over the block's 128 threads."""
    return cdiv(TILE_PIXELS * g.kernel[0], THREADS) * g.kernel[1] * g.out_channels


def _vector(dtype: str) -> int:
    """Elements of a 16-byte copy or store."""
    return 16 // dtypes.get(dtype).itemsize


def _three_fold(dtype: str, precision: str) -> bool:
    """Whether the kernels multiply as 3xTF32: strict float32."""
    return dtype == "float32" and precision != "tf32"


def eligible(g: Geometry, dtype: str, layout: str, precision: str = "strict") -> bool:
    """Layers of one group with fewer than 16 output channels, at most :data:`MAX_EXPANDED` expanded columns and
    :data:`MAX_PREFETCHED` values a thread to prefetch: fp16/bf16 channels_last with input channels in whole
    16-byte runs; fp16, bf16 or float32 (strict float32 up to :data:`MAX_EXPANDED_3XTF32` columns) NCHW with 8
    or more input channels (fewer leave the tiles mostly empty) and images of whole 16-byte runs of pixels (a run
    never spans two images).  The direct kernels take an unaligned call, so they must fit the layer too."""
    if layout == "nhwc":
        fits_layout = dtype in ("float16", "bfloat16") and g.in_channels % 8 == 0
    else:
        three_fold_fits = not _three_fold(dtype, precision) or expanded_columns(g) <= MAX_EXPANDED_3XTF32
        fits_layout = (dtype in ("float16", "bfloat16", "float32") and three_fold_fits and g.in_channels >= 8
                       and (g.in_size[0] * g.in_size[1]) % _vector(dtype) == 0)
    return (fits_layout and g.groups == 1 and g.out_channels <= MAX_OUT_CHANNELS
            and expanded_columns(g) <= MAX_EXPANDED and prefetched_values(g) <= MAX_PREFETCHED
            and direct.fits(g, dtype, layout))


def _check_eligible(g: Geometry, dtype: str, layout: str, precision: str) -> None:
    if not eligible(g, dtype, layout, precision):
        raise ValueError("the expanded-taps kernels run layers of one group with fewer than 16 output channels: "
                         "fp16 and bf16 channels_last with input channels in multiples of 8, or fp16, bf16 and "
                         "float32 NCHW with 8 or more input channels and images of whole 16-byte runs of pixels "
                         f"(strict float32: at most {MAX_EXPANDED_3XTF32} taps x output channels)")


def _pixels(g: Geometry) -> int:
    return g.batch * g.in_size[0] * g.in_size[1]


def _blocks_per_sm(smem: int) -> int:
    return max(1, min(MAX_BLOCKS_PER_SM, SMEM_PER_SM // smem))


def weight_block_channels(g: Geometry, dtype: str = "float16", precision: str = "strict") -> int:
    """grad_weight's input channels a block: 128 (two m16 tiles a warp) while a warp's accumulators stay at 64; 64
    in strict float32, whose 3xTF32 keeps a second set of accumulators (128 took every register ptxas allows)."""
    wide = expanded_columns(g) <= 64 and g.in_channels > 64 and not _three_fold(dtype, precision)
    return 128 if wide else 64


def weight_tile_pixels(dtype: str, layout: str) -> int:
    """grad_weight's K tile: :data:`TILE_PIXELS`, or in NCHW 128 bytes of each channel's pixels (32 float32
    ones), which keeps a float32 ring as large as a 16-bit one."""
    return TILE_PIXELS if layout == "nhwc" else 128 // dtypes.get(dtype).itemsize


def weight_smem_bytes(g: Geometry, dtype: str = "float16", layout: str = "nhwc", stages: int = STAGES,
                      precision: str = "strict") -> int:
    """A ring stage: the x tile and G's, each row padded by 16 bytes ([pixel][channels] channels_last, [channel or
    column][pixels] NCHW)."""
    bm, pad, tp = weight_block_channels(g, dtype, precision), expanded_columns(g), weight_tile_pixels(dtype, layout)
    if layout == "nhwc":
        return stages * tp * (bm // 2 + 4 + pad // 2 + 4) * 4
    return stages * (bm + pad) * (tp * dtypes.get(dtype).itemsize // 4 + 4) * 4


def weight_stage_choices(g: Geometry, dtype: str = "float16", layout: str = "nhwc",
                         precision: str = "strict") -> Tuple[int, ...]:
    """The ring depths of :data:`STAGE_CHOICES` whose ring fits :data:`SMEM_LIMIT` (three always do)."""
    return tuple(s for s in STAGE_CHOICES if weight_smem_bytes(g, dtype, layout, s, precision) <= SMEM_LIMIT)


def weight_stages(g: Geometry, dtype: str = "float16", layout: str = "nhwc", precision: str = "strict") -> int:
    """The heuristic ring depth: :data:`STAGES`, or the deepest that fits."""
    fitting = weight_stage_choices(g, dtype, layout, precision)
    return STAGES if STAGES in fitting else max(fitting)


@functools.lru_cache(maxsize=1024)
def plan_grad_weight(g: Geometry, dtype: str, sm_count: int, stages: Optional[int] = None, layout: str = "nhwc",
                     precision: str = "strict") -> Tuple[Plan, Optional[Plan]]:
    """The partial GEMM over fixed ranges of pixel tiles, about :func:`_blocks_per_sm` blocks an SM in all, and
    the wide fixed-order reduce of its partials (none for a single range); ``stages``: the ring's depth, one of
    :func:`weight_stage_choices` (default :func:`weight_stages`)."""
    _check_eligible(g, dtype, layout, precision)
    choices = weight_stage_choices(g, dtype, layout, precision)
    stages = weight_stages(g, dtype, layout, precision) if stages is None else stages
    if stages not in choices:
        raise ValueError(f"stages must be one of {choices} for this layer, got {stages}")
    bm, smem = weight_block_channels(g, dtype, precision), weight_smem_bytes(g, dtype, layout, stages, precision)
    tp = weight_tile_pixels(dtype, layout)
    channel_blocks = cdiv(g.in_channels, bm)
    tiles = cdiv(_pixels(g), tp)
    chunks, per_chunk = split_rows(tiles, channel_blocks, 1, sm_count, _blocks_per_sm(smem))
    weight_elems = numel(g.weight_shape)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), chunks * weight_elems)
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=gemm.mma_kind(dtype, precision), NCHW=layout == "nchw", BM=bm, TP=tp, STAGES=stages,
                     SINGLE_CHUNK=chunks == 1)
    spec = KernelSpec.make("conv_transpose2d_grad_weight_expanded_taps.cu",
                           "conv_transpose2d_grad_weight_expanded_taps", constants)
    sizes = (_pixels(g),) + g.in_size + g.out_size + (per_chunk,)
    partial = Plan(spec, (chunks, channel_blocks, 1), (THREADS, 1, 1), sizes, index_t,
                   scratch_bytes=split_k_scratch(chunks, weight_elems, 4), smem_bytes=smem)
    return partial, None if chunks == 1 else plan_wide_reduce(dtype, weight_elems, chunks, index_t)


def input_block_channels(g: Geometry, dtype: str = "float16", precision: str = "strict") -> int:
    """grad_input's input channels a block: 32, 64 or 128 (a warp's n8 tiles come in pairs); at most 64 in strict
    float32, whose 3xTF32 keeps a second set of accumulators."""
    widest = 64 if _three_fold(dtype, precision) else 128
    return min(widest, 128 if g.in_channels > 64 else 64 if g.in_channels > 32 else 32)


def input_tile_pixels(dtype: str, precision: str = "strict") -> int:
    """grad_input's M tile: :data:`TILE_PIXELS`, or 32 in strict float32, whose 3xTF32 holds three forms of each
    fragment and a second set of accumulators (64 pixels a tile spilled, ptxas)."""
    return 32 if _three_fold(dtype, precision) else TILE_PIXELS


def input_smem_bytes(g: Geometry, dtype: str = "float16", layout: str = "nhwc", precision: str = "strict") -> int:
    """The weight's channel block (B), G's tile (A) and the output tile, each row padded by 16 bytes."""
    bn, pad = input_block_channels(g, dtype, precision), expanded_columns(g)
    tp = input_tile_pixels(dtype, precision)
    if layout == "nhwc":
        return (pad * (bn // 2 + 4) + pad * (tp // 2 + 4) + tp * (bn // 2 + 4)) * 4
    per_word = 4 // dtypes.get(dtype).itemsize
    return ((bn + tp) * (pad // per_word + 4) + bn * (tp // per_word + 4)) * 4


@functools.lru_cache(maxsize=1024)
def plan_grad_input(g: Geometry, dtype: str, sm_count: int, layout: str = "nhwc", precision: str = "strict") -> Plan:
    """Blocks that each hold a channel block's weight and walk pixel tiles, about :func:`_blocks_per_sm` an SM."""
    _check_eligible(g, dtype, layout, precision)
    bn, smem = input_block_channels(g, dtype, precision), input_smem_bytes(g, dtype, layout, precision)
    tp = input_tile_pixels(dtype, precision)
    channel_blocks = cdiv(g.in_channels, bn)
    tiles = cdiv(_pixels(g), tp)
    blocks = min(tiles, max(1, cdiv(sm_count * _blocks_per_sm(smem), channel_blocks)))
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=gemm.mma_kind(dtype, precision), NCHW=layout == "nchw", BN=bn, TP=tp)
    spec = KernelSpec.make("conv_transpose2d_grad_input_expanded_taps.cu",
                           "conv_transpose2d_grad_input_expanded_taps", constants)
    sizes = (_pixels(g),) + g.in_size + g.out_size
    return Plan(spec, (blocks, channel_blocks, 1), (THREADS, 1, 1), sizes, index_t, smem_bytes=smem)


class ExpandedTapsFamily(Family):
    name = "expanded_taps"
    passes = ("grad_input", "grad_weight")

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """sm_80 or newer, the tensor cores switched on, and :func:`eligible`."""
        return device.tensor_cores >= MMA_SYNC and gemm.enabled() and _eligible(g, dtype, layout, precision)

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        """grad_weight's ring depths that fit (a deeper ring holds more of x in flight, a shallower one fits more
        blocks an SM), the heuristic's first; grad_input has one way."""
        if pass_ == "grad_input":
            return [Variant(self.name)]
        heuristic = weight_stages(g, dtype, layout, precision)
        return [Variant(self.name)] + [Variant.make(self.name, stages=s)
                                       for s in weight_stage_choices(g, dtype, layout, precision) if s != heuristic]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        if not aligned:
            # x's rows land by 16-byte copies and grad_input leaves in 16-byte stores, so an unaligned call runs
            # the direct kernels
            return direct.FAMILY.plan(pass_, Variant(direct.FAMILY.name), g, dtype, layout, precision, has_bias,
                                      aligned, sm_count)
        if pass_ == "grad_input":
            return OneKernel(plan_grad_input(g, dtype, sm_count, layout, precision))
        return SplitK(*plan_grad_weight(g, dtype, sm_count, variant.kwargs.get("stages"), layout, precision))

    def clear(self) -> None:
        for planner in (plan_grad_input, plan_grad_weight, _eligible):
            planner.cache_clear()


@functools.lru_cache(maxsize=1024)
def _eligible(g: Geometry, dtype: str, layout: str, precision: str) -> bool:
    return eligible(g, dtype, layout, precision)


FAMILY = ExpandedTapsFamily()
