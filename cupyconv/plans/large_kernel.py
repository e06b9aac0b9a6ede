"""The large-kernel family: CUDA-core kernels for layers whose kernels the direct family cannot run.

The direct kernels stage a whole channel's KH x KW weights in shared memory and unroll
their tap loops and register windows over the kernel, so past some size (a 101x101
kernel, say) they cannot run a layer at all, though the reference can.  These kernels
run any kernel size, every dtype and both layouts: their tap loops run at run time and
their weights pass through shared memory a fixed-size tile of taps at a time, so neither
shared memory nor registers grow with the kernel.

The forward gathers by stride phase, one phase per block, so every tap a thread visits
contributes; grad_input is the strided convolution of grad_output as the same gather;
grad_weight is a deterministic split-K whose threads each own taps and sum their pixels
in a fixed order (see :class:`~.sequences.SplitK`).  The pass table consults the family
exactly where :func:`~.direct.fits` says the direct kernels cannot stage the weights.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

from ..core import dtypes
from ..core.device import ASSUMED, Device
from ..core.geometry import Geometry, phase_taps
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import direct
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, cdiv, check_layout, even_block, index_type, layer_constants, numel, split_rows
from .reduction import finishing_reduce, split_k_scratch
from .sequences import OneKernel, PassPlan, SplitK

_THREADS = 128
# Weights staged per tile of taps, whatever the kernel size: several blocks still share an SM.
TAP_TILE_BYTES = 16 * 1024
# fp32 (fp64) accumulators and grad_output window values a thread keeps, at most.
_ACCUMULATORS = 32
_GRID_X_LIMIT = 2 ** 31 - 1
# Blocks of _THREADS threads a gather wants on each SM to hide its load latency.
_BLOCKS_PER_SM = 4
# channels_last gathers run their lanes along a tile of at most this many channels.
_CHANNEL_TILE = 64


def _acc_bytes(dtype: str) -> int:
    return dtypes.get(dtype).accumulator_bytes


def _gather(g: Geometry, dtype: str, layout: str, sm_count: int, template: str, function: str, phases: int,
            cells: Tuple[int, int], taps: Tuple[int, int], channels: Tuple[int, int, int], extra: dict) -> Plan:
    """A gather kernel (large_kernel.cuh) over ``phases`` stride phases of at most ``cells``
    cells and ``taps`` taps each (along h, w); ``channels``: destination channels, and per
    group destination and source channels."""
    acc = _acc_bytes(dtype)
    dst_channels, dst_per_group, src_per_group = channels
    cells_h, cells_w = cells
    channel_tile = min(dst_channels, _CHANNEL_TILE)
    if layout == "nhwc":
        # Lanes along channels; a thread's channels share their group's loads, so lie in one group.
        ocb = next(b for b in (4, 2, 1) if dst_per_group % b == 0 and channel_tile % b == 0)
    else:
        # Lanes along pixels; every thread of a block takes the same channels of one group.
        ocb = even_block(dst_per_group, 8 if acc == 4 else 4)
    # fp64 accumulators take two registers each.
    cell_block = max(1, min(8, _ACCUMULATORS * 4 // acc // ocb, cells_h))

    def shape(ocb: int, cell_block: int):
        lanes = channel_tile // ocb if layout == "nhwc" else 1
        dst_tiles = cdiv(dst_channels, channel_tile) if layout == "nhwc" else g.groups * cdiv(dst_per_group, ocb)
        runs = max(1, _THREADS // lanes)
        tile_w = max(1, min(runs, 32, cells_w))
        tiles = (cdiv(cells_h, runs // tile_w * cell_block), cdiv(cells_w, tile_w))
        return lanes, dst_tiles, runs, tile_w, tiles, phases * tiles[0] * tiles[1] * dst_tiles * g.batch

    # A small output leaves few threads, each with a long sum over the taps, and a GPU whose
    # SMs hold a warp or two cannot hide their load latency.  Until there are blocks enough
    # to fill it, threads give up cells (which share only weights read from shared memory),
    # then channels (which share the input loads).
    while True:
        lanes, dst_tiles, runs, tile_w, (tiles_h, tiles_w), blocks_wanted = shape(ocb, cell_block)
        if blocks_wanted >= _BLOCKS_PER_SM * sm_count:
            break
        if cell_block > 1:
            cell_block //= 2
        elif ocb > 1 and layout == "nhwc":
            ocb //= 2
        elif ocb > 1:
            ocb = even_block(dst_per_group, ocb // 2)
        else:
            break
    entries = max(1, TAP_TILE_BYTES // (lanes * ocb * acc))   # (source channel, tap) pairs per tile
    ti = max(1, min(taps[1], 32, entries))
    tj = max(1, min(taps[0], entries // ti))
    src_chunk = max(1, min(src_per_group, entries // (ti * tj)))
    blocks = phases * tiles_h * tiles_w
    if blocks > _GRID_X_LIMIT:
        raise ValueError(f"the large-kernel {function} would need {blocks} blocks, over {_GRID_X_LIMIT}")
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    constants.update(extra, CHANNELS_LAST=layout == "nhwc", OCB=ocb, LANES=lanes, RUNS=runs, TILE_W=tile_w,
                     CELLS=cell_block, TJ=tj, TI=ti, SRC_CHUNK=src_chunk)
    spec = KernelSpec.make(template, function, constants)
    grid = (blocks, min(dst_tiles, GRID_YZ_LIMIT), min(g.batch, GRID_YZ_LIMIT))
    h, w = g.in_size
    return Plan(spec, grid, (lanes * runs, 1, 1), (g.batch, h, w) + g.out_size + (tiles_h, tiles_w), index_t)


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw",
                 sm_count: int = ASSUMED.sm_count) -> Plan:
    check_layout(layout)
    (sh, sw), (dh, dw) = g.params.stride, g.params.dilation
    h_out, w_out = g.out_size
    # Only the phases that hold outputs: min(stride, outputs) of them along each axis.
    phases = min(sh, h_out) * min(sw, w_out)
    return _gather(g, dtype, layout, sm_count, "conv_transpose2d_large_kernel_forward.cu",
                   "conv_transpose2d_large_kernel_forward", phases, (cdiv(h_out, sh), cdiv(w_out, sw)),
                   (phase_taps(g.kernel[0], sh, dh), phase_taps(g.kernel[1], sw, dw)),
                   (g.out_channels, g.out_per_group, g.in_per_group), dict(HAS_BIAS=bool(has_bias)))


@functools.lru_cache(maxsize=1024)
def plan_grad_input(g: Geometry, dtype: str, layout: str = "nchw", sm_count: int = ASSUMED.sm_count) -> Plan:
    check_layout(layout)
    return _gather(g, dtype, layout, sm_count, "conv_transpose2d_large_kernel_grad_input.cu",
                   "conv_transpose2d_large_kernel_grad_input", 1, g.in_size, g.kernel,
                   (g.in_channels, g.in_per_group, g.out_per_group), {})


def _window(cells: int, kwb: int, stride: int, dilation: int) -> int:
    """grad_output columns that ``cells`` adjacent pixels meet through ``kwb`` adjacent kernel columns."""
    return (cells - 1) * stride + (kwb - 1) * dilation + 1


@functools.lru_cache(maxsize=1024)
def plan_grad_weight(g: Geometry, dtype: str, sm_count: int, layout: str = "nchw") -> Tuple[Plan, Optional[Plan]]:
    """The split-K partial pass and the fixed-order reduction that finishes it (None for one chunk)."""
    dtypes.get(dtype)
    check_layout(layout)
    kh, kw = g.kernel
    sw, dw = g.params.stride[1], g.params.dilation[1]
    h, w = g.in_size
    budget = _ACCUMULATORS * 4 // _acc_bytes(dtype)   # fp64 values take two registers each
    icb = even_block(g.in_per_group, 4)
    ocb = even_block(g.out_per_group, 4)
    # Most kernel columns per thread, then most pixels a step, whose window still fits the budget.
    widest = max(1, min(4, kw, budget // (icb * ocb)))
    cells, kwb = next(((c, k) for k in range(widest, 0, -1) for c in (4, 2, 1)
                       if _window(c, k, sw, dw) * ocb <= budget), (1, 1))
    tap_cols = min(cdiv(kw, kwb), max(32, _THREADS // min(kh, 4)))
    tap_rows = even_block(kh, max(1, _THREADS // tap_cols))
    twx = cells * min(cdiv(w, cells), max(1, 64 // cells))
    pairs = g.groups * cdiv(g.in_per_group, icb) * cdiv(g.out_per_group, ocb)
    tap_tiles = cdiv(kh, tap_rows) * cdiv(kw, tap_cols * kwb)
    # Each thread walks every pixel of its chunk: chunks only where the other blocks leave the GPU idle.
    chunks, rows_per_chunk = split_rows(g.batch * h, pairs * tap_tiles, 64, sm_count, row_items=cdiv(w, cells))
    weight_elems = numel(g.weight_shape)
    partial_elems = chunks * weight_elems
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), partial_elems)
    constants = layer_constants(g, dtype, index_t)
    constants.update(CHANNELS_LAST=layout == "nhwc", ICB=icb, OCB=ocb, KWB=kwb, TAP_COLS=tap_cols, TAP_ROWS=tap_rows,
                     CELLS=cells, TWX=twx, SINGLE_CHUNK=chunks == 1)
    spec = KernelSpec.make("conv_transpose2d_large_kernel_grad_weight.cu",
                           "conv_transpose2d_large_kernel_grad_weight_partial", constants)
    grid = (chunks, min(tap_tiles, GRID_YZ_LIMIT), min(pairs, GRID_YZ_LIMIT))
    partial = Plan(spec, grid, (tap_cols * tap_rows, 1, 1),
                   (g.batch, h, w) + g.out_size + (rows_per_chunk,), index_t,
                   scratch_bytes=split_k_scratch(chunks, weight_elems, _acc_bytes(dtype)))
    return partial, finishing_reduce(dtype, weight_elems, chunks, index_t)


class LargeKernelFamily(Family):
    name = "large_kernel"
    passes = ("forward", "grad_input", "grad_weight")

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """Exactly the layers whose weights the direct kernels cannot stage."""
        return not direct.fits(g, dtype, layout)

    def races(self, pass_: str, g: Geometry, dtype: str) -> bool:
        # Never eligible beside the direct kernels, and the GEMMs take no kernel this large.
        return False

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        if pass_ == "forward":
            return OneKernel(plan_forward(g, dtype, has_bias, layout, sm_count))
        if pass_ == "grad_input":
            return OneKernel(plan_grad_input(g, dtype, layout, sm_count))
        return SplitK(*plan_grad_weight(g, dtype, sm_count, layout))

    def clear(self) -> None:
        for planner in (plan_forward, plan_grad_input, plan_grad_weight):
            planner.cache_clear()


FAMILY = LargeKernelFamily()
