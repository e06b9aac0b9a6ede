"""Reductions: grad_bias, and the fixed-order reduce that finishes every split-K pass.

grad_bias = grad_output.sum((0, 2, 3)) is summed in fixed chunks of pixels or values into fp32
(fp64 for float64) partials, which one more kernel adds up in chunk order: no atomics, so the
result is bitwise reproducible.  Every split-K pass that needs one chunk only writes its
result directly instead (``SINGLE_CHUNK``): no scratch and no reduce launch.  grad_weight's
wgmma kernel writes its partials tap-major, so its reduce (:func:`plan_tap_major_reduce`)
also moves the taps last, and only a one-tap layer's single chunk skips it.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

from ..core import dtypes
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, cdiv, check_layout, index_type, numel, split_rows
from .sequences import PassPlan, SplitK

# threads per block of the reduce, the weight repack and other elementwise kernels
ELEMENTWISE_BLOCK = 256
# A block sums up to this many grad_output elements in one chunk (64 per thread): below it,
# a second launch to add chunks costs more than the parallelism it buys.
_ONE_CHUNK_ELEMENTS = 64 * 256
# grad_bias's loads: each thread keeps this many in flight, and takes at least this many of them a chunk.
_GRAD_BIAS_UNROLL = 4


def grad_bias_vector(g: Geometry, dtype: str, layout: str, aligned: bool) -> int:
    """Values of grad_output a grad_bias thread reads at once: a 16-byte run where every run lies within one
    channel (channels_last) or one channel's plane (NCHW) and ``aligned`` says grad_output is 16-byte aligned,
    else 1."""
    vec = 16 // dtypes.get(dtype).itemsize
    h_out, w_out = g.out_size
    whole = g.out_channels % vec == 0 if layout == "nhwc" else (h_out * w_out) % vec == 0
    return vec if aligned and whole else 1


@functools.lru_cache(maxsize=1024)
def plan_grad_bias(g: Geometry, dtype: str, sm_count: int, layout: str = "nchw",
                   aligned: bool = True) -> Tuple[Plan, Optional[Plan]]:
    dtypes.get(dtype)
    check_layout(layout)
    block = 256
    h_out, w_out = g.out_size
    vec = grad_bias_vector(g, dtype, layout, aligned)
    # A thread sums at least this many runs of a chunk: fewer for wider runs, which carry more bytes each.
    min_steps = max(_GRAD_BIAS_UNROLL * 4, 64 // vec)
    if layout == "nhwc":
        # A block is (pixel lane, channel run): few channels leave room for many pixel lanes.
        channel_tile = min(g.out_channels, block)
        channel_blocks = cdiv(g.out_channels, channel_tile)
        pixel_lanes = block // (channel_tile // vec)
        items, per_block = g.batch * h_out * w_out, channel_tile   # pixels, each of channel_tile values
        chunks, per_chunk = split_rows(items, channel_blocks, min_steps * pixel_lanes, sm_count)
        grid_y = min(channel_blocks, GRID_YZ_LIMIT)
    else:
        # A block walks runs of one channel's planes strung together: chunks are ranges of whole runs.
        channel_tile = 1
        runs = cdiv(g.batch * h_out * w_out, vec)
        items, per_block = g.batch * h_out * w_out, 1
        chunks, runs_per_chunk = split_rows(runs, g.out_channels, min_steps * block, sm_count)
        per_chunk = runs_per_chunk * vec
        grid_y = min(g.out_channels, GRID_YZ_LIMIT)
    if items * per_block <= _ONE_CHUNK_ELEMENTS:
        chunks, per_chunk = 1, items
    # A thread forms offsets up to a few unrolled steps past the end before it tests them.
    index_t = index_type(numel(g.output_shape) + _GRAD_BIAS_UNROLL * block * vec, chunks * g.out_channels)
    constants = dict(SCALAR_T=dtypes.get(dtype).c_type, INDEX_T=index_t, COUT=g.out_channels, BLOCK=block,
                     CHANNELS_LAST=layout == "nhwc", CHANNEL_TILE=channel_tile, VEC=vec, UNROLL=_GRAD_BIAS_UNROLL,
                     SINGLE_CHUNK=chunks == 1)
    spec = KernelSpec.make("conv_transpose2d_grad_bias.cu", "conv_transpose2d_grad_bias_partial", constants)
    partial = Plan(spec, (chunks, grid_y, 1), (block, 1, 1),
                   (g.batch, h_out, w_out, per_chunk), index_t,
                   scratch_bytes=split_k_scratch(chunks, g.out_channels, dtypes.get(dtype).accumulator_bytes))
    # Few channels over many chunks: the wide reduce, whose warps share each channel's chunks.
    reduce = None if chunks == 1 else plan_wide_reduce(dtype, g.out_channels, chunks, index_t,
                                                       1024 if chunks > 64 else ELEMENTWISE_BLOCK)
    return partial, reduce


def split_k_scratch(chunks: int, elements: int, partial_bytes: int) -> int:
    """Bytes of the partials a split-K pass of ``chunks`` chunks writes: none for one chunk,
    which writes its result directly (the kernel's ``SINGLE_CHUNK``)."""
    return 0 if chunks == 1 else chunks * elements * partial_bytes


# Below this many elements the reduce of one thread an element launches under 128 blocks, too few to fill a GPU
# when each thread walks hundreds of chunks in turn (a thin grouped layer's grad_weight: 7680 elements over 500
# chunks took 28 µs on an H200): the wide reduce spreads every element's chunks over a block's warps instead.
_WIDE_REDUCE_ELEMENTS = 128 * ELEMENTWISE_BLOCK
_WIDE_REDUCE_CHUNKS = 16


def finishing_reduce(dtype: str, elements: int, chunks: int, index_t: str) -> Optional[Plan]:
    """The reduce that adds a split-K pass's ``chunks`` partials in order; None for a single chunk.  Few elements
    over many chunks take the wide reduce (also a fixed order)."""
    if chunks == 1:
        return None
    if elements <= _WIDE_REDUCE_ELEMENTS and chunks >= _WIDE_REDUCE_CHUNKS:
        return plan_wide_reduce(dtype, elements, chunks, index_t, 1024 if chunks > 64 else ELEMENTWISE_BLOCK)
    return plan_reduce(dtype, elements, chunks, index_t)


# The reduces take their longer runs (16-byte loads, tiles of 1024 runs) only where those still make this many
# blocks: few elements over many chunks (a small layer split over its pixels) need the blocks more.
_REDUCE_BLOCKS = 256


def tap_major_tile(taps: int, vec: int, runs: int) -> Tuple[int, int]:
    """(taps, rows) of a tap-major reduce block's tile: every tap of a layer of up to 32 (more split evenly
    over tiles), and as many rows, in runs of ``vec``, as make about ``runs`` runs."""
    tap_tiles = cdiv(taps, 32)
    tap_tile = cdiv(taps, tap_tiles)
    return tap_tile, cdiv(runs, tap_tile) * vec


@functools.lru_cache(maxsize=1024)
def plan_tap_major_reduce(dtype: str, rows: int, taps: int, chunks: int, index_t: str) -> Plan:
    """The reduce of partials written tap-major, ``[chunk][tap][row]``: adds the chunks in order and writes
    ``out[row][tap]`` (the weight's layout), through tiles of :func:`tap_major_tile`.  Rows are read four at
    a time (16-byte loads of the 256-byte aligned scratch) where their count is a multiple of four, and the
    loads of four chunks are in flight before any is added."""
    vec = 4 if rows % 4 == 0 else 1
    for runs in (1024, 256):
        tap_tile, row_tile = tap_major_tile(taps, vec, runs)
        grid = (cdiv(rows, row_tile), cdiv(taps, tap_tile), 1)
        if grid[0] * grid[1] >= _REDUCE_BLOCKS:
            break
    constants = dict(SCALAR_T=dtypes.get(dtype).c_type, INDEX_T=index_t, TAPS=taps, VEC=vec,
                     CHUNKS_AT_ONCE=1 if chunks == 1 else 4, RUNS=runs)
    spec = KernelSpec.make("reduce_tap_major_partials.cu", "reduce_tap_major_partials", constants)
    return Plan(spec, grid, (256, 1, 1), (rows, chunks), index_t)


def reduce_run(dtype: str, elements: int) -> int:
    """Elements a reduce thread adds at once: runs of four (16-byte loads of the 256-byte aligned scratch) where
    their count is a multiple of four, they sum in fp32 and the runs still fill :data:`_REDUCE_BLOCKS` blocks,
    else one."""
    fp32 = dtypes.get(dtype).accumulator_bytes == 4
    return 4 if fp32 and elements % 4 == 0 and elements // 4 >= _REDUCE_BLOCKS * ELEMENTWISE_BLOCK else 1


@functools.lru_cache(maxsize=1024)
def plan_reduce(dtype: str, elements: int, chunks: int, index_t: str) -> Plan:
    """The reduce of partials ``[chunk][element]``: a thread adds runs of four elements (16-byte loads of the
    256-byte aligned scratch) where their count is a multiple of four, they sum in fp32 and the runs still fill
    :data:`_REDUCE_BLOCKS` blocks, else one."""
    vec = reduce_run(dtype, elements)
    constants = dict(SCALAR_T=dtypes.get(dtype).c_type, INDEX_T=index_t, BLOCK=ELEMENTWISE_BLOCK, VEC=vec)
    spec = KernelSpec.make("reduce_partials.cu", "reduce_partials", constants)
    grid = (min(cdiv(elements // vec, ELEMENTWISE_BLOCK), 8192), 1, 1)
    return Plan(spec, grid, (ELEMENTWISE_BLOCK, 1, 1), (elements, chunks), index_t)


@functools.lru_cache(maxsize=1024)
def plan_wide_reduce(dtype: str, elements: int, chunks: int, index_t: str, block: int = ELEMENTWISE_BLOCK) -> Plan:
    """The reduce for few elements over many chunks: a block of 32 elements whose ``block / 32`` warps each add
    every ``block / 32``-th chunk, in a fixed order."""
    constants = dict(SCALAR_T=dtypes.get(dtype).c_type, INDEX_T=index_t, BLOCK=block, VEC=1)
    spec = KernelSpec.make("reduce_partials.cu", "reduce_partials_wide", constants)
    return Plan(spec, (cdiv(elements, 32), 1, 1), (block, 1, 1), (elements, chunks), index_t)


@functools.lru_cache(maxsize=1024)
def plan_reduce_with_bias(dtype: str, elements: int, chunks: int, channels: int, channel_stride: int,
                          index_t: str) -> Plan:
    """The reduce of a split GEMM's partials in the destination's layout: the chunks in order, then the bias of
    each element's channel, ``(element // channel_stride) % channels``, where the launch passes a bias.  Runs of
    four as :func:`reduce_run` says."""
    vec = reduce_run(dtype, elements)
    constants = dict(SCALAR_T=dtypes.get(dtype).c_type, INDEX_T=index_t, BLOCK=ELEMENTWISE_BLOCK, VEC=vec)
    spec = KernelSpec.make("reduce_partials.cu", "reduce_partials_bias", constants)
    grid = (min(cdiv(elements // vec, ELEMENTWISE_BLOCK), 8192), 1, 1)
    return Plan(spec, grid, (ELEMENTWISE_BLOCK, 1, 1), (elements, chunks, channels, channel_stride), index_t)


class ReductionFamily(Family):
    name = "reduction"
    passes = ("grad_bias",)

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        return SplitK(*plan_grad_bias(g, dtype, sm_count, layout, aligned))

    def clear(self) -> None:
        plan_grad_bias.cache_clear()
        plan_reduce.cache_clear()
        plan_reduce_with_bias.cache_clear()
        plan_tap_major_reduce.cache_clear()
        plan_wide_reduce.cache_clear()


FAMILY = ReductionFamily()
