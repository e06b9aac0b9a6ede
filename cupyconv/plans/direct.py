"""The direct kernels: gathers on CUDA cores for every layer, dtype and layout.

They run any layer (float64 included) and win where tensor-core tiles would be mostly
padding: grouped, depthwise and dilated layers with few channels per group.  NCHW
kernels run their lanes along pixels, channels_last (NHWC) kernels along channels.
grad_weight is a deterministic split-K reduction (see :class:`~.sequences.SplitK`).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

from ..core import dtypes
from ..core.device import Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant, block_tile, tile_block
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, cdiv, check_layout, even_block, index_type, layer_constants, numel, split_rows
from .reduction import finishing_reduce, split_k_scratch
from .sequences import OneKernel, PassPlan, SplitK

# Below this many channels per group the direct kernels can beat the tensor cores, whose
# tiles are then mostly padding: only then are they timed against them.
RACE_BELOW_CHANNELS = 64


def _acc_bytes(dtype: str) -> int:
    return dtypes.get(dtype).accumulator_bytes


def _phase_cells(g: Geometry) -> Tuple[int, int, int, int]:
    """(q_h0, q_w0, QH, QW): the low-resolution cells whose stride phases cover the output.

    Output pixel (oh, ow) is phase (oh + PH) % SH of cell (oh + PH) // SH (and the same
    along w); the forward kernels walk cells q_h0 .. q_h0 + QH - 1 and q_w0 .. q_w0 + QW - 1.
    """
    (sh, sw), (ph, pw), (h_out, w_out) = g.params.stride, g.params.padding, g.out_size
    q_h0, q_w0 = ph // sh, pw // sw
    return q_h0, q_w0, (h_out - 1 + ph) // sh - q_h0 + 1, (w_out - 1 + pw) // sw - q_w0 + 1


def _phases(kernel: int, dilation: int, stride: int) -> int:
    """How many of the ``stride`` output phases along one axis receive at least one tap."""
    return len({(k * dilation) % stride for k in range(kernel)})


# The direct kernels keep their per-thread blocks near this many fp32 accumulators:
# enough reuse of every load, with registers left for two or more blocks per SM.
_DIRECT_ACCUMULATORS = 48
_DIRECT_WEIGHT_SMEM = 12 * 1024
# The forward stages output runs of up to this many columns per thread through shared
# memory (at most 17 KB a block); the weight rows get what is left of the 48 KB.
_STAGED_RUN = 16
_DIRECT_WEIGHT_LIMIT = 30 * 1024


def _weight_rows(g: Geometry, dtype: str, per_tap: int) -> Tuple[int, int]:
    """(padded row length, bytes per channel) of the direct kernels' staged weight rows."""
    acc = _acc_bytes(dtype)
    vec = 16 // acc
    row = cdiv(g.kernel[1] * per_tap, vec) * vec
    return row, g.kernel[0] * row * acc


def _staged_block(g: Geometry, dtype: str, channels: int) -> Tuple[int, int]:
    """(channels per thread, channels staged at a time) whose weight rows fit shared memory.

    ``channels`` is the group's width on the side a thread blocks over (outputs of the
    forward, inputs of grad_input).
    """
    block = even_block(channels, 8)
    while True:
        _, per_channel = _weight_rows(g, dtype, block)
        if per_channel <= _DIRECT_WEIGHT_LIMIT or block == 1:
            break
        block = even_block(channels, block // 2)
    if per_channel > _DIRECT_WEIGHT_LIMIT:
        raise ValueError(
            f"kernel_size {g.kernel} is too large for the direct kernels: one channel's weights need "
            f"{per_channel} bytes of shared memory, over {_DIRECT_WEIGHT_LIMIT}")
    return block, per_channel


# The direct kernels unroll every tap and keep register windows that grow with the kernel's
# span, the rows and columns one pixel's dilated taps reach ((KH-1)*DH+1 by (KW-1)*DW+1), so a
# kernel whose weights still fit shared memory can outgrow the registers.  ptxas -v (NVRTC 12.9,
# sm_90) over the forward, grad_input and grad_weight kernels, NCHW and NHWC, every dtype, strides
# and dilations 1 and 2, 1 to 64 channels per group and depthwise, puts the edge at:
#   columns: 32.  At 33 the float64 NHWC forward spills; from 43 to 47 on (by dtype) it spills
#            at 255 registers, and 1x128 to 1x256 spill hundreds to thousands of bytes.
#   rows:    8.  At 9 the NCHW grad_input (depthwise, stride 2) and float64 forward spill at
#            255 registers; 64x1 does in half of the configurations.
#   taps:    64 (8x8, 2x32, 3x21).  9x9, 7x7 dilated by 2, and 11x11 with 16 channels
#            (116-456 bytes in forward and grad_input) spill at 255 registers.
# Inside the edge only float64 grad_weight reaches 255 registers (4-12 bytes of spill, at any
# size: its accumulator block, not the span).  ptxas also spills up to tens of bytes, at every
# size down to 1x1, where it settles for 64 to 168 registers; no size rule removes those.
# Past the edge they still ran faster than the large_kernel family does today (H100, float32
# and float16: 9x9, 11x11 and 7x7 dilated by 2 with 8 channels, depthwise 9x9, 1x48; 0.96-2.2x
# on the forward, 1.1-2.8x on forward+backward), so only shared memory decides where they run.


def fits(g: Geometry, dtype: str, layout: str = "nchw") -> bool:
    """Whether the direct kernels can run this layer: one channel's KH x KW weights must fit the
    shared memory that ``_staged_block`` and ``_nhwc_tile`` stage them in (the large_kernel family
    runs the rest)."""
    check_layout(layout)
    try:
        if layout == "nhwc":
            _nhwc_tile(g, dtype, g.out_channels, g.out_per_group)
            _nhwc_tile(g, dtype, g.in_channels, g.in_per_group)
        else:
            _staged_block(g, dtype, g.out_per_group)
            _staged_block(g, dtype, g.in_per_group)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw") -> Plan:
    dtypes.get(dtype)
    check_layout(layout)
    if layout == "nhwc":
        return _plan_forward_nhwc(g, dtype, has_bias)
    sh, sw = g.params.stride
    dh, dw = g.params.dilation
    h_out, w_out = g.out_size
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    oc_block, per_channel = _staged_block(g, dtype, g.out_per_group)
    ic_chunk = max(1, min(g.in_per_group, _DIRECT_WEIGHT_SMEM // per_channel))
    # Each cell keeps one accumulator per output channel and non-empty stride phase.
    phases = _phases(g.kernel[0], dh, sh) * _phases(g.kernel[1], dw, sw)
    cells = max(1, min(4, _DIRECT_ACCUMULATORS // (phases * oc_block), _STAGED_RUN // sw))
    block = 128
    q_h0, q_w0, qh, qw = _phase_cells(g)
    cells_w = cdiv(qw, cells)
    constants = layer_constants(g, dtype, index_t)
    constants.update(HAS_BIAS=bool(has_bias), OC_BLOCK=oc_block, CELLS=cells, IC_CHUNK=ic_chunk, BLOCK=block,
                     STAGE_STORES=cells * sw <= _STAGED_RUN)
    oc_blocks = g.groups * cdiv(g.out_per_group, oc_block)
    grid = (cdiv(qh * cells_w, block), min(oc_blocks, GRID_YZ_LIMIT), min(g.batch, GRID_YZ_LIMIT))
    spec = KernelSpec.make("conv_transpose2d_forward.cu", "conv_transpose2d_forward", constants)
    h, w = g.in_size
    return Plan(spec, grid, (block, 1, 1), (g.batch, h, w, h_out, w_out, q_h0, q_w0, qh, qw, cells_w), index_t)


def _window_cells(g: Geometry, cap: int, window: int = 24) -> int:
    """Adjacent pixels per thread whose shared grad_output window stays small (<= ``window`` values)."""
    sw, dw = g.params.stride[1], g.params.dilation[1]
    cells = cap
    while cells > 1 and (cells - 1) * sw + (g.kernel[1] - 1) * dw + 1 > window:
        cells //= 2
    return cells


def _grad_input_block(g: Geometry, dtype: str, layout: str) -> Tuple[int, int]:
    """The heuristic's (input channels, adjacent input pixels) a grad_input thread accumulates."""
    if layout == "nhwc":
        icb = _nhwc_tile(g, dtype, g.in_channels, g.in_per_group)[1]
        return icb, _window_cells(g, max(1, 8 // icb))
    ic_block = _staged_block(g, dtype, g.in_per_group)[0]
    return ic_block, _window_cells(g, max(1, min(8, 32 // ic_block)))


# The grad_input blocks the tuner may race against the heuristic's: up to this many fp32 accumulators a thread,
# and a grad_output window row of up to this many values.
_GRAD_INPUT_ACCUMULATORS_RACED = 64
_GRAD_INPUT_WINDOW_RACED = 32


def grad_input_blocks(g: Geometry, dtype: str, layout: str = "nchw") -> List[Tuple[int, int]]:
    """The grad_input blocks worth timing, the heuristic's first: (input channels, adjacent input pixels) a
    thread accumulates.  NCHW: twice and half the heuristic's pixels.  channels_last: four and eight times its
    pixels, and twice its channels with two and four times its pixels (the heuristic's 8 accumulators a thread
    load each grad_output value, one per group of lanes, for few products).  As for grad_weight, only grouped
    layers in 16- and 32-bit dtypes race more than the heuristic.

    On an H100 (GPU time, every block of 1 to 8 channels and 1 to 16 pixels timed; heuristic against the best):
    NCHW fp16 grouped_dilated 414 -> 308 µs (8 x 8), where the heuristic stayed fastest in float32.  channels_last
    with 16-byte runs of output channels (:func:`channel_runs`), fp16: grouped_dilated 416 -> 368 µs (8 x 4), a
    3 x 3 layer of eight channels a group 40 -> 32 µs (8 x 8), a 4 x 4 one of sixteen 377 -> 153 µs (8 x 4).
    Blocks of fewer channels than the heuristic's never won."""
    heuristic = _grad_input_block(g, dtype, layout)
    if g.groups == 1 or dtypes.get(dtype).accumulator_bytes > 4:
        return [heuristic]
    ic, cells = heuristic
    if layout == "nchw":
        blocks = ((ic, 2 * cells), (ic, cells // 2))
    else:
        blocks = ((ic, 4 * cells), (ic, 8 * cells), (2 * ic, 2 * cells), (2 * ic, 4 * cells))
    tile = _nhwc_tile(g, dtype, g.in_channels, g.in_per_group)[0] if layout == "nhwc" else 0
    found = [heuristic]
    for block in blocks:
        b_ic, b_cells = block
        if (b_cells < 1 or b_ic > g.in_per_group or b_ic * b_cells > _GRAD_INPUT_ACCUMULATORS_RACED
                or _window_cells(g, b_cells, _GRAD_INPUT_WINDOW_RACED) != b_cells or block in found):
            continue
        if layout == "nhwc" and (g.in_per_group % b_ic or tile % b_ic):
            continue
        found.append(block)
    return found


@functools.lru_cache(maxsize=1024)
def plan_grad_input(g: Geometry, dtype: str, layout: str = "nchw", block: Optional[Tuple[int, int]] = None,
                    aligned: bool = True) -> Plan:
    """``block``: (input channels, adjacent input pixels) a thread accumulates (:func:`grad_input_blocks`); None
    for the heuristic's.  ``aligned``: grad_output starts on 16 bytes (channels_last kernels then read it in
    16-byte runs of output channels where a group's channels come in whole runs)."""
    dtypes.get(dtype)
    check_layout(layout)
    ic_block, cells = block or _grad_input_block(g, dtype, layout)
    if not (1 <= ic_block <= g.in_per_group and cells >= 1):
        raise ValueError(f"grad_input block {block} does not fit the layer's channels")
    if layout == "nhwc":
        return _plan_grad_input_nhwc(g, dtype, ic_block, cells, channel_runs(g, dtype, aligned))
    _, per_channel = _weight_rows(g, dtype, ic_block)
    if per_channel > _DIRECT_WEIGHT_LIMIT:
        raise ValueError(f"grad_input block {block}: its weight rows need {per_channel} bytes of shared memory")
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    oc_chunk = max(1, min(g.out_per_group, _DIRECT_WEIGHT_SMEM // per_channel))
    block_threads = 128
    h, w = g.in_size
    cells_w = cdiv(w, cells)
    constants = layer_constants(g, dtype, index_t)
    constants.update(IC_BLOCK=ic_block, CELLS=cells, OC_CHUNK=oc_chunk, BLOCK=block_threads)
    ic_blocks = g.groups * cdiv(g.in_per_group, ic_block)
    grid = (cdiv(h * cells_w, block_threads), min(ic_blocks, GRID_YZ_LIMIT), min(g.batch, GRID_YZ_LIMIT))
    spec = KernelSpec.make("conv_transpose2d_grad_input.cu", "conv_transpose2d_grad_input", constants)
    return Plan(spec, grid, (block_threads, 1, 1), (g.batch, h, w) + g.out_size + (cells_w,), index_t)


_GRAD_WEIGHT_ACCUMULATORS = 64
# The blocks the tuner may race against the heuristic's: up to this many fp32 accumulators a thread.  More
# accumulators load each input cell and grad_output window for more products, at fewer threads an SM.
_GRAD_WEIGHT_ACCUMULATORS_RACED = 128


def _grad_weight_block(g: Geometry, layout: str) -> Tuple[int, int, int]:
    """The heuristic's (input channels, output channels, kernel rows) a grad_weight thread accumulates: whole
    kernel rows, as many input channels as fit, then kernel rows and (NCHW) output channels from what is left
    of the budget.  A channels_last thread holds one output channel."""
    kh, kw = g.kernel
    ic_block = even_block(g.in_per_group, max(1, min(8, _GRAD_WEIGHT_ACCUMULATORS // kw)))
    rest = max(1, _GRAD_WEIGHT_ACCUMULATORS // (ic_block * kw))
    kh_block = even_block(kh, rest)
    if layout == "nhwc":
        return ic_block, 1, kh_block
    return ic_block, even_block(g.out_per_group, max(1, min(8, rest // kh_block))), kh_block


def grad_weight_blocks(g: Geometry, dtype: str, layout: str = "nchw") -> List[Tuple[int, int, int]]:
    """The grad_weight blocks worth timing, the heuristic's first: every kernel row in one thread (each input
    cell loaded once, not once a kernel row), twice the output channels (NCHW: each grad_output window serves
    twice the products), and half the input channels with each of those.  Only grouped layers, which no
    tensor-core family runs, time more than the heuristic, and not in float64 (whose accumulators take twice
    the registers).

    On an H200 (GPU time, heuristic against the best block): grouped_dilated NCHW 1.46 -> 0.56 ms in fp16
    (twice the output channels) and 0.83 -> 0.66 ms in fp32 (half the input channels, every row); a 3 x 3
    layer of eight channels a group, NCHW fp16, 77 -> 57 µs (every row).  In channels_last the heuristic was
    fastest but on that 3 x 3 layer (102 -> 87 µs, half the input channels): there a block of more
    accumulators halves the threads a block holds."""
    heuristic = _grad_weight_block(g, layout)
    if g.groups == 1 or dtypes.get(dtype).accumulator_bytes > 4:
        return [heuristic]
    kh, kw = g.kernel
    ic, oc, kh_block = heuristic
    half_ic = even_block(g.in_per_group, cdiv(ic, 2))
    more_oc = even_block(g.out_per_group, 2 * oc) if layout == "nchw" else oc
    found = [heuristic]
    for block in ((ic, oc, kh), (ic, more_oc, kh_block), (half_ic, oc, kh), (half_ic, more_oc, kh_block)):
        if block not in found and block[0] * block[1] * block[2] * kw <= _GRAD_WEIGHT_ACCUMULATORS_RACED:
            found.append(block)
    return found


@functools.lru_cache(maxsize=1024)
def plan_grad_weight(g: Geometry, dtype: str, sm_count: int, layout: str = "nchw",
                     block: Optional[Tuple[int, int, int]] = None) -> Tuple[Plan, Optional[Plan]]:
    """The split-K partial pass and the fixed-order reduction that finishes it (None for one chunk).

    ``block``: (input channels, output channels, kernel rows) a thread accumulates (:func:`grad_weight_blocks`);
    None for the heuristic's.  A channels_last thread holds one output channel."""
    dtypes.get(dtype)
    check_layout(layout)
    ic_block, oc_block, kh_block = block or _grad_weight_block(g, layout)
    if not (1 <= ic_block <= g.in_per_group and 1 <= oc_block <= g.out_per_group and 1 <= kh_block <= g.kernel[0]):
        raise ValueError(f"grad_weight block {block} does not fit the layer's channels and kernel rows")
    if layout == "nhwc":
        if oc_block != 1:
            raise ValueError(f"a channels_last grad_weight thread holds one output channel, got block {block}")
        return _plan_grad_weight_nhwc(g, dtype, sm_count, ic_block, kh_block)
    kh = g.kernel[0]
    cells = _window_cells(g, max(1, min(4, 16 // ic_block)))
    threads = 128
    yblocks = g.groups * cdiv(g.in_per_group, ic_block) * cdiv(g.out_per_group, oc_block)
    return _split_k_partial(g, dtype, sm_count, "conv_transpose2d_grad_weight.cu",
                            "conv_transpose2d_grad_weight_partial",
                            dict(IC_BLOCK=ic_block, OC_BLOCK=oc_block, KH_BLOCK=kh_block, BLOCK=threads), cells,
                            yblocks, cdiv(kh, kh_block), threads, threads)


def _split_k_partial(g: Geometry, dtype: str, sm_count: int, template: str, function: str, tiling: dict,
                     cells: int, yblocks: int, kh_blocks: int, threads: int,
                     row_threads: int) -> Tuple[Plan, Optional[Plan]]:
    """A direct grad_weight kernel's partial pass over fixed chunks of input rows, and its reduce.

    ``row_threads`` threads share the steps of one chunk's rows.
    """
    h, w = g.in_size
    cells_w = cdiv(w, cells)
    # Enough chunks for several waves of blocks, each thread still walking 8 or more steps.
    chunks, rows_per_chunk = split_rows(g.batch * h, yblocks * kh_blocks, 8 * row_threads, sm_count,
                                        blocks_per_sm=8, row_items=cells_w)
    weight_elems = numel(g.weight_shape)
    partial_elems = chunks * weight_elems
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), partial_elems)
    constants = layer_constants(g, dtype, index_t)
    constants.update(tiling, CELLS=cells, SINGLE_CHUNK=chunks == 1)
    spec = KernelSpec.make(template, function, constants)
    partial = Plan(spec, (chunks, min(yblocks, GRID_YZ_LIMIT), kh_blocks), (threads, 1, 1),
                   (g.batch, h, w) + g.out_size + (cells_w, rows_per_chunk), index_t,
                   scratch_bytes=split_k_scratch(chunks, weight_elems, _acc_bytes(dtype)))
    return partial, finishing_reduce(dtype, weight_elems, chunks, index_t)


# channels_last direct kernels: lanes run along channels, a block holds a tile of at most
# _NHWC_TILE of them and as many pixel runs as fill _NHWC_THREADS threads.
_NHWC_TILE = 64
_NHWC_THREADS = 128
_NHWC_WEIGHT_SMEM = 40 * 1024  # five blocks of 128 threads still fit an SM


def _nhwc_tile(g: Geometry, dtype: str, channels: int, per_group: int) -> Tuple[int, int, int]:
    """(channel tile, channels per thread, staged channels per chunk) for an NHWC kernel
    whose lanes run along ``channels``, ``per_group`` of them to a group."""
    _staged_block(g, dtype, 1)  # the same kernel-size limit as the NCHW kernels
    per_tap = _acc_bytes(dtype) * g.kernel[0] * g.kernel[1]
    tile = min(channels, _NHWC_TILE)
    while tile > 1 and tile * per_tap > _NHWC_WEIGHT_SMEM:
        tile = cdiv(tile, 2)
    # A thread's channels share their group's input loads, so they must not straddle groups.
    per_thread = next(b for b in (4, 2, 1) if per_group % b == 0 and tile % b == 0)
    return tile, per_thread, max(1, _NHWC_WEIGHT_SMEM // (tile * per_tap))


_BLOCKS_TO_FILL = 2048  # enough blocks for several waves on any GPU we plan for


def _images_per_block(blocks: int, batch: int) -> int:
    """Images each block walks: up to 8, while ``_BLOCKS_TO_FILL`` blocks remain to fill the GPU."""
    per_block = 1
    while per_block < 8 and per_block < batch and blocks * cdiv(batch, per_block * 2) >= _BLOCKS_TO_FILL:
        per_block *= 2
    return per_block


def _nhwc_grid(g: Geometry, runs_total: int, runs: int, channels: int, tile: int,
               staged_once: bool) -> Tuple[int, int, int]:
    """(run blocks, channel tiles, image blocks) of an NHWC forward or grad_input kernel.

    Weights staged once per channel tile serve several images; staged per chunk, they
    would not, so then each block takes one image.
    """
    xy = (cdiv(runs_total, runs), min(cdiv(channels, tile), GRID_YZ_LIMIT))
    images = _images_per_block(xy[0] * xy[1], g.batch) if staged_once else 1
    return xy + (min(cdiv(g.batch, images), GRID_YZ_LIMIT),)


def _plan_forward_nhwc(g: Geometry, dtype: str, has_bias: bool) -> Plan:
    sh, sw = g.params.stride
    dh, dw = g.params.dilation
    h_out, w_out = g.out_size
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    tile, ocb, ic_chunk = _nhwc_tile(g, dtype, g.out_channels, g.out_per_group)
    lanes = tile // ocb
    runs = max(1, _NHWC_THREADS // lanes)
    phases = _phases(g.kernel[0], dh, sh) * _phases(g.kernel[1], dw, sw)
    cells = max(1, min(4, 32 // (phases * ocb)))
    q_h0, q_w0, qh, qw = _phase_cells(g)
    cells_w = cdiv(qw, cells)
    ic_chunk = min(ic_chunk, g.in_per_group)
    constants = layer_constants(g, dtype, index_t)
    constants.update(HAS_BIAS=bool(has_bias), OC_TILE=tile, OCB=ocb, RUNS=runs, CELLS=cells, IC_CHUNK=ic_chunk)
    grid = _nhwc_grid(g, qh * cells_w, runs, g.out_channels, tile, ic_chunk == g.in_per_group)
    spec = KernelSpec.make("conv_transpose2d_forward_nhwc.cu", "conv_transpose2d_forward_nhwc", constants)
    h, w = g.in_size
    return Plan(spec, grid, (lanes * runs, 1, 1), (g.batch, h, w, h_out, w_out, q_h0, q_w0, qh, qw, cells_w), index_t)


def channel_runs(g: Geometry, dtype: str, aligned: bool) -> int:
    """Output channels a channels_last grad_input thread loads at once: a 16-byte run where grad_output is aligned
    and each group's channels come in whole runs, else 1.  Not in float64, whose runs of two, held for every
    pixel of a tap in double registers, spill at the widest kernels the direct family runs (1 x 32).

    Runs against single channels, the heuristic's block (H100, GPU time): grouped_dilated 803 -> 416 µs in fp16
    and 1224 -> 610 µs in float32 (cuDNN: 499 and 561)."""
    info = dtypes.get(dtype)
    run = 16 // info.itemsize
    return run if aligned and info.accumulator_bytes == 4 and g.out_per_group % run == 0 else 1


def _plan_grad_input_nhwc(g: Geometry, dtype: str, icb: int, cells: int, oc_vec: int) -> Plan:
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    tile, _, oc_chunk = _nhwc_tile(g, dtype, g.in_channels, g.in_per_group)
    if g.in_per_group % icb or tile % icb:
        raise ValueError(f"a channels_last grad_input thread's {icb} channels must divide the group's {g.in_per_group}"
                         f" and the tile's {tile}")
    lanes = tile // icb
    runs = max(1, _NHWC_THREADS // lanes)
    h, w = g.in_size
    cells_w = cdiv(w, cells)
    oc_chunk = min(oc_chunk, g.out_per_group)
    if oc_chunk < g.out_per_group:
        if oc_chunk < oc_vec:
            oc_vec = 1   # not even one run of channels' weights fits the staging space
        oc_chunk = oc_chunk // oc_vec * oc_vec   # staged chunks of whole runs
    constants = layer_constants(g, dtype, index_t)
    constants.update(IC_TILE=tile, ICB=icb, RUNS=runs, CELLS=cells, OC_CHUNK=oc_chunk, OC_VEC=oc_vec)
    grid = _nhwc_grid(g, h * cells_w, runs, g.in_channels, tile, oc_chunk == g.out_per_group)
    spec = KernelSpec.make("conv_transpose2d_grad_input_nhwc.cu", "conv_transpose2d_grad_input_nhwc", constants)
    return Plan(spec, grid, (lanes * runs, 1, 1), (g.batch, h, w) + g.out_size + (cells_w,), index_t)


_NHWC_REDUCE_SMEM = 32 * 1024


def _plan_grad_weight_nhwc(g: Geometry, dtype: str, sm_count: int, ic_block: int,
                           kh_block: int) -> Tuple[Plan, Optional[Plan]]:
    kh, kw = g.kernel
    acc = _acc_bytes(dtype)
    values = ic_block * kh_block * kw
    # One input channel per thread (depthwise-like layers) leaves little to share between
    # cells, and narrower tiles with single cells ran fastest there (depthwise_up on an H100:
    # 0.14 ms against 0.34 ms with 64-channel tiles of 4 cells in float16).
    thin = ic_block == 1
    tile = min(g.out_channels, 16 if thin else _NHWC_TILE)
    while tile > 1 and values * tile * acc > _NHWC_REDUCE_SMEM:
        tile = cdiv(tile, 2)
    runs = max(1, min(_NHWC_THREADS // tile, _NHWC_REDUCE_SMEM // (values * tile * acc)))
    cells = _window_cells(g, 1 if thin else max(1, min(4, 16 // ic_block)))
    yblocks = cdiv(g.out_channels, tile) * cdiv(g.in_per_group, ic_block)
    return _split_k_partial(g, dtype, sm_count, "conv_transpose2d_grad_weight_nhwc.cu",
                            "conv_transpose2d_grad_weight_nhwc_partial",
                            dict(OC_TILE=tile, RUNS=runs, IC_BLOCK=ic_block, KH_BLOCK=kh_block), cells, yblocks,
                            cdiv(kh, kh_block), tile * runs, runs)


class DirectFamily(Family):
    name = "direct"
    passes = ("forward", "grad_input", "grad_weight")

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        return fits(g, dtype, layout)

    def races(self, pass_: str, g: Geometry, dtype: str) -> bool:
        return min(g.in_per_group, g.out_per_group) < RACE_BELOW_CHANNELS

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        if pass_ == "forward":
            return OneKernel(plan_forward(g, dtype, has_bias, layout))
        tile = variant.kwargs.get("tile")
        block = None if tile is None else tile_block(tile)
        if pass_ == "grad_input":
            return OneKernel(plan_grad_input(g, dtype, layout, block, aligned))
        return SplitK(*plan_grad_weight(g, dtype, sm_count, layout, block))

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        """grad_input's and grad_weight's thread blocks (:func:`grad_input_blocks`, :func:`grad_weight_blocks`),
        the heuristic's as the plain variant; the forward runs its heuristic only."""
        if pass_ == "forward":
            return [Variant(self.name)]
        blocks = (grad_input_blocks if pass_ == "grad_input" else grad_weight_blocks)(g, dtype, layout)
        return [Variant(self.name)] + [Variant.make(self.name, tile=block_tile(b)) for b in blocks[1:]]

    def clear(self) -> None:
        for planner in (plan_forward, plan_grad_input, plan_grad_weight):
            planner.cache_clear()


FAMILY = DirectFamily()
