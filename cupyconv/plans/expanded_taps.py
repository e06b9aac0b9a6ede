"""Tensor-core gradients for layers with few output channels, through grad_output expanded by taps.

A generator's last layer (64 or 128 channels up to 3 RGB channels, 4 x 4 at stride 2) is too thin in its output
channels for the GEMM families, which need 16 channels a side, so its gradients ran on direct kernels: TAPS x
C_out CUDA-core multiply-adds for each input value read (grad_weight) or written (grad_input), several times
cuDNN's time.  Expanded by taps, G[pixel][tap * C_out + oc] (``kernels/include/tap_expanded_grad_out.cuh``),
grad_output turns both into mma.sync GEMMs with the taps in N (grad_weight: x^T G, split over pixel ranges and
reduced in a fixed order) or in K (grad_input: G W), and each kernel streams the large tensor, x, once.
fp16 and bf16, channels_last activations, one group, sm_80 and newer.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

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


def eligible(g: Geometry, dtype: str, layout: str) -> bool:
    """fp16/bf16 channels_last layers of one group with fewer than 16 output channels, at most
    :data:`MAX_EXPANDED` expanded columns and :data:`MAX_PREFETCHED` values a thread to prefetch, and input
    channels in whole 16-byte runs; the direct kernels take an unaligned call, so they must fit the layer too."""
    return (dtype in ("float16", "bfloat16") and layout == "nhwc" and g.groups == 1
            and g.out_channels <= MAX_OUT_CHANNELS and expanded_columns(g) <= MAX_EXPANDED
            and prefetched_values(g) <= MAX_PREFETCHED and g.in_channels % 8 == 0 and direct.fits(g, dtype, layout))


def _check_eligible(g: Geometry, dtype: str) -> None:
    if not eligible(g, dtype, "nhwc"):
        raise ValueError("the expanded-taps kernels run fp16 and bf16 channels_last layers of one group with "
                         "fewer than 16 output channels and input channels in multiples of 8")


def _pixels(g: Geometry) -> int:
    return g.batch * g.in_size[0] * g.in_size[1]


def _blocks_per_sm(smem: int) -> int:
    return max(1, min(MAX_BLOCKS_PER_SM, SMEM_PER_SM // smem))


def weight_block_channels(g: Geometry) -> int:
    """grad_weight's input channels a block: 128 (two m16 tiles a warp) while a warp's accumulators stay at 64."""
    return 128 if expanded_columns(g) <= 64 and g.in_channels > 64 else 64


def weight_smem_bytes(g: Geometry, stages: int = STAGES) -> int:
    bm, pad = weight_block_channels(g), expanded_columns(g)
    return stages * TILE_PIXELS * (bm // 2 + 4 + pad // 2 + 4) * 4


def weight_stage_choices(g: Geometry) -> Tuple[int, ...]:
    """The ring depths of :data:`STAGE_CHOICES` whose ring fits :data:`SMEM_LIMIT` (three always do)."""
    return tuple(s for s in STAGE_CHOICES if weight_smem_bytes(g, s) <= SMEM_LIMIT)


def weight_stages(g: Geometry) -> int:
    """The heuristic ring depth: :data:`STAGES`, or the deepest that fits."""
    fitting = weight_stage_choices(g)
    return STAGES if STAGES in fitting else max(fitting)


@functools.lru_cache(maxsize=1024)
def plan_grad_weight(g: Geometry, dtype: str, sm_count: int,
                     stages: Optional[int] = None) -> Tuple[Plan, Optional[Plan]]:
    """The partial GEMM over fixed ranges of pixel tiles, about :func:`_blocks_per_sm` blocks an SM in all, and
    the wide fixed-order reduce of its partials (none for a single range); ``stages``: the ring's depth, one of
    :func:`weight_stage_choices` (default :func:`weight_stages`)."""
    _check_eligible(g, dtype)
    stages = weight_stages(g) if stages is None else stages
    if stages not in weight_stage_choices(g):
        raise ValueError(f"stages must be one of {weight_stage_choices(g)} for this layer, got {stages}")
    bm, smem = weight_block_channels(g), weight_smem_bytes(g, stages)
    channel_blocks = cdiv(g.in_channels, bm)
    tiles = cdiv(_pixels(g), TILE_PIXELS)
    chunks, per_chunk = split_rows(tiles, channel_blocks, 1, sm_count, _blocks_per_sm(smem))
    weight_elems = numel(g.weight_shape)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), chunks * weight_elems)
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=gemm.mma_kind(dtype, "strict"), BM=bm, TP=TILE_PIXELS, STAGES=stages, SINGLE_CHUNK=chunks == 1)
    spec = KernelSpec.make("conv_transpose2d_grad_weight_expanded_taps.cu",
                           "conv_transpose2d_grad_weight_expanded_taps", constants)
    sizes = (_pixels(g),) + g.in_size + g.out_size + (per_chunk,)
    partial = Plan(spec, (chunks, channel_blocks, 1), (THREADS, 1, 1), sizes, index_t,
                   scratch_bytes=split_k_scratch(chunks, weight_elems, 4), smem_bytes=smem)
    return partial, None if chunks == 1 else plan_wide_reduce(dtype, weight_elems, chunks, index_t)


def input_block_channels(g: Geometry) -> int:
    """grad_input's input channels a block: 32, 64 or 128 (a warp's n8 tiles come in pairs)."""
    return 128 if g.in_channels > 64 else 64 if g.in_channels > 32 else 32


def input_smem_bytes(g: Geometry) -> int:
    bn, pad = input_block_channels(g), expanded_columns(g)
    return (pad * (bn // 2 + 4) + pad * (TILE_PIXELS // 2 + 4) + TILE_PIXELS * (bn // 2 + 4)) * 4


@functools.lru_cache(maxsize=1024)
def plan_grad_input(g: Geometry, dtype: str, sm_count: int) -> Plan:
    """Blocks that each hold a channel block's weight and walk pixel tiles, about :func:`_blocks_per_sm` an SM."""
    _check_eligible(g, dtype)
    bn, smem = input_block_channels(g), input_smem_bytes(g)
    channel_blocks = cdiv(g.in_channels, bn)
    tiles = cdiv(_pixels(g), TILE_PIXELS)
    blocks = min(tiles, max(1, cdiv(sm_count * _blocks_per_sm(smem), channel_blocks)))
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=gemm.mma_kind(dtype, "strict"), BN=bn, TP=TILE_PIXELS)
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
        return device.tensor_cores >= MMA_SYNC and gemm.enabled() and _eligible(g, dtype, layout)

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        """grad_weight's ring depths that fit (a deeper ring holds more of x in flight, a shallower one fits more
        blocks an SM), the heuristic's first; grad_input has one way."""
        if pass_ == "grad_input":
            return [Variant(self.name)]
        heuristic = weight_stages(g)
        return [Variant(self.name)] + [Variant.make(self.name, stages=s) for s in weight_stage_choices(g)
                                       if s != heuristic]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        if not aligned:
            # x's rows land by 16-byte copies and grad_input leaves in 16-byte stores, so an unaligned call runs
            # the direct kernels
            return direct.FAMILY.plan(pass_, Variant(direct.FAMILY.name), g, dtype, layout, precision, has_bias,
                                      aligned, sm_count)
        if pass_ == "grad_input":
            return OneKernel(plan_grad_input(g, dtype, sm_count))
        return SplitK(*plan_grad_weight(g, dtype, sm_count, variant.kwargs.get("stages")))

    def clear(self) -> None:
        for planner in (plan_grad_input, plan_grad_weight, _eligible):
            planner.cache_clear()


@functools.lru_cache(maxsize=1024)
def _eligible(g: Geometry, dtype: str, layout: str) -> bool:
    return eligible(g, dtype, layout)


FAMILY = ExpandedTapsFamily()
