"""Planning and launching the raw kernels.

A *plan* turns a :class:`~cupyconv.geometry.Geometry` and a dtype into the kernel
specialisation (its template constants), the grid and the runtime arguments.  Plans are
pure Python, so CI can enumerate and compile every one of them without a GPU.  Launches
take raw device pointers and a raw stream handle, so CuPy arrays and torch tensors
(bfloat16 included, which CuPy cannot represent) share one path that costs no DLPack
round trip.
"""
from __future__ import annotations

import ctypes
import math
import threading
import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import compiler
from .compiler import KernelSpec, get_function
from .geometry import Geometry

# storage type in the kernel, accumulator type, bytes per element
DTYPES = {
    "float32": ("float", "float", 4),
    "float64": ("double", "double", 8),
    "float16": ("half_t", "float", 2),
    "bfloat16": ("bf16_t", "float", 2),
}
INT32_LIMIT = 2 ** 31
_GRID_YZ_LIMIT = 65535
_STATIC_SMEM_LIMIT = 48 * 1024
_REDUCE_BLOCK = 256


def index_type(*element_counts: int) -> str:
    """32-bit offsets unless some tensor a kernel touches has 2**31 elements or more."""
    return "long long" if max(element_counts) >= INT32_LIMIT else "int"


def accumulator_bytes(dtype: str) -> int:
    return 8 if DTYPES[dtype][1] == "double" else 4


LAYOUTS = ("nchw", "nhwc")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _layer_constants(g: Geometry, dtype: str, index_t: str) -> dict:
    p = g.params
    return dict(
        SCALAR_T=DTYPES[dtype][0], INDEX_T=index_t,
        KH=g.kernel[0], KW=g.kernel[1], SH=p.stride[0], SW=p.stride[1], PH=p.padding[0], PW=p.padding[1],
        DH=p.dilation[0], DW=p.dilation[1], GROUPS=p.groups, CIN_G=g.in_per_group, COUT_G=g.out_per_group)


@dataclass(frozen=True)
class Plan:
    """One kernel launch: what to compile, how to launch it, and its non-pointer arguments."""

    spec: KernelSpec
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    scalars: Tuple[int, ...]   # runtime sizes, passed as index_t
    index_t: str
    scratch_bytes: int = 0     # split-K partials the caller must provide
    smem_bytes: int = 0        # dynamic shared memory per block
    # device -> (compiler generation, CUfunction handle, the kernel object that keeps its module loaded)
    _functions: Dict[int, tuple] = field(default_factory=dict, compare=False, hash=False, repr=False)
    _params: Dict[int, "_ParamBlock"] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def function(self, device_id: int) -> int:
        """The CUfunction handle of this plan's kernel on ``device_id``."""
        held = self._functions.get(device_id)
        if held is None or held[0] != compiler._generation:
            kernel = get_function(self.spec, device_id)
            if self.smem_bytes > _STATIC_SMEM_LIMIT:
                # Blocks may only use more than 48 KB once the function has opted in.
                kernel.max_dynamic_shared_size_bytes = self.smem_bytes
            held = self._functions[device_id] = (compiler._generation, kernel.kernel.ptr, kernel)
        return held[1]

    def run(self, device_id: int, stream_ptr: int, pointers: Sequence[int]) -> None:
        block = self._params.get(len(pointers))
        if block is None:
            block = self._params[len(pointers)] = _ParamBlock(len(pointers), self.scalars, self.index_t)
        block.launch(self.function(device_id), self.grid, self.block, self.smem_bytes, pointers, stream_ptr)


class _ParamBlock:
    """A kernel's parameter block, built once per plan; each launch only rewrites the pointers.

    cuLaunchKernel copies the parameters, so the block can be reused at once; the lock
    keeps two threads launching the same plan from interleaving their pointer writes.
    """

    def __init__(self, n_pointers: int, scalars: Sequence[int], index_t: str):
        scalar_type = ctypes.c_int64 if index_t == "long long" else ctypes.c_int32
        self.pointers = [ctypes.c_void_p() for _ in range(n_pointers)]
        self.values = self.pointers + [scalar_type(s) for s in scalars]
        self.array = (ctypes.c_void_p * len(self.values))(*[ctypes.addressof(v) for v in self.values])
        self.address = ctypes.addressof(self.array)
        self.lock = threading.Lock()

    def launch(self, function: int, grid, block, smem_bytes: int, pointers: Sequence[int], stream_ptr: int) -> None:
        with self.lock:
            for slot, ptr in zip(self.pointers, pointers):
                slot.value = ptr
            _driver().launchKernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                   smem_bytes, stream_ptr, self.address, 0)


@functools.lru_cache(maxsize=None)
def _driver():
    from cupy.cuda import driver

    return driver


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chunks(rows: int, other_blocks: int, min_items: int, sm_count: int, blocks_per_sm: int = 4,
            row_items: int = 1) -> Tuple[int, int]:
    """Split ``rows`` into enough fixed chunks to fill the GPU; returns (chunks, rows_per_chunk).

    ``blocks_per_sm`` blocks per SM are wanted in all, counting the ``other_blocks`` each
    chunk is launched with, but no chunk gets fewer than ``min_items`` of the
    ``row_items`` items that each row holds.
    """
    wanted = max(1, _cdiv(blocks_per_sm * sm_count, max(other_blocks, 1)))
    wanted = min(wanted, max(1, _cdiv(rows * row_items, min_items)))
    rows_per_chunk = _cdiv(rows, wanted)
    return _cdiv(rows, rows_per_chunk), rows_per_chunk


def _even_block(size: int, cap: int) -> int:
    """The block of at most ``cap`` that cuts ``size`` into the fewest, most even pieces."""
    return _cdiv(size, _cdiv(size, max(1, cap)))


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
    acc = accumulator_bytes(dtype)
    vec = 16 // acc
    row = _cdiv(g.kernel[1] * per_tap, vec) * vec
    return row, g.kernel[0] * row * acc


def _staged_block(g: Geometry, dtype: str, channels: int) -> Tuple[int, int]:
    """(channels per thread, channels staged at a time) whose weight rows fit shared memory.

    ``channels`` is the group's width on the side a thread blocks over (outputs of the
    forward, inputs of grad_input).
    """
    block = _even_block(channels, 8)
    while True:
        _, per_channel = _weight_rows(g, dtype, block)
        if per_channel <= _DIRECT_WEIGHT_LIMIT or block == 1:
            break
        block = _even_block(channels, block // 2)
    if per_channel > _DIRECT_WEIGHT_LIMIT:
        raise ValueError(
            f"kernel_size {g.kernel} is too large for the direct kernels: one channel's weights need "
            f"{per_channel} bytes of shared memory, over {_DIRECT_WEIGHT_LIMIT}")
    return block, per_channel


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw") -> Plan:
    _check_dtype(dtype)
    _check_layout(layout)
    if layout == "nhwc":
        return _plan_forward_nhwc(g, dtype, has_bias)
    sh, sw = g.params.stride
    dh, dw = g.params.dilation
    h_out, w_out = g.out_size
    index_t = index_type(_numel(g.input_shape), _numel(g.output_shape), _numel(g.weight_shape))
    oc_block, per_channel = _staged_block(g, dtype, g.out_per_group)
    ic_chunk = max(1, min(g.in_per_group, _DIRECT_WEIGHT_SMEM // per_channel))
    # Each cell keeps one accumulator per output channel and non-empty stride phase.
    phases = _phases(g.kernel[0], dh, sh) * _phases(g.kernel[1], dw, sw)
    cells = max(1, min(4, _DIRECT_ACCUMULATORS // (phases * oc_block), _STAGED_RUN // sw))
    block = 128
    q_h0, q_w0, qh, qw = _phase_cells(g)
    cells_w = _cdiv(qw, cells)
    constants = _layer_constants(g, dtype, index_t)
    constants.update(HAS_BIAS=bool(has_bias), OC_BLOCK=oc_block, CELLS=cells, IC_CHUNK=ic_chunk, BLOCK=block,
                     STAGE_STORES=cells * sw <= _STAGED_RUN)
    oc_blocks = g.groups * _cdiv(g.out_per_group, oc_block)
    grid = (_cdiv(qh * cells_w, block), min(oc_blocks, _GRID_YZ_LIMIT), min(g.batch, _GRID_YZ_LIMIT))
    spec = KernelSpec.make("conv_transpose2d_forward.cu", "conv_transpose2d_forward", constants)
    h, w = g.in_size
    return Plan(spec, grid, (block, 1, 1), (g.batch, h, w, h_out, w_out, q_h0, q_w0, qh, qw, cells_w), index_t)


def _window_cells(g: Geometry, cap: int) -> int:
    """Adjacent pixels per thread whose shared grad_output window stays small (<= 24 values)."""
    sw, dw = g.params.stride[1], g.params.dilation[1]
    cells = cap
    while cells > 1 and (cells - 1) * sw + (g.kernel[1] - 1) * dw + 1 > 24:
        cells //= 2
    return cells


@functools.lru_cache(maxsize=1024)
def plan_grad_input(g: Geometry, dtype: str, layout: str = "nchw") -> Plan:
    _check_dtype(dtype)
    _check_layout(layout)
    if layout == "nhwc":
        return _plan_grad_input_nhwc(g, dtype)
    index_t = index_type(_numel(g.input_shape), _numel(g.output_shape), _numel(g.weight_shape))
    ic_block, per_channel = _staged_block(g, dtype, g.in_per_group)
    oc_chunk = max(1, min(g.out_per_group, _DIRECT_WEIGHT_SMEM // per_channel))
    cells = _window_cells(g, max(1, min(8, 32 // ic_block)))
    block = 128
    h, w = g.in_size
    cells_w = _cdiv(w, cells)
    constants = _layer_constants(g, dtype, index_t)
    constants.update(IC_BLOCK=ic_block, CELLS=cells, OC_CHUNK=oc_chunk, BLOCK=block)
    ic_blocks = g.groups * _cdiv(g.in_per_group, ic_block)
    grid = (_cdiv(h * cells_w, block), min(ic_blocks, _GRID_YZ_LIMIT), min(g.batch, _GRID_YZ_LIMIT))
    spec = KernelSpec.make("conv_transpose2d_grad_input.cu", "conv_transpose2d_grad_input", constants)
    return Plan(spec, grid, (block, 1, 1), (g.batch, h, w) + g.out_size + (cells_w,), index_t)


_GRAD_WEIGHT_ACCUMULATORS = 64


@functools.lru_cache(maxsize=1024)
def plan_grad_weight(g: Geometry, dtype: str, sm_count: int, layout: str = "nchw") -> Tuple[Plan, Plan]:
    """The split-K partial pass and the fixed-order reduction that finishes it."""
    _check_dtype(dtype)
    _check_layout(layout)
    if layout == "nhwc":
        return _plan_grad_weight_nhwc(g, dtype, sm_count)
    kh, kw = g.kernel
    # A thread's block: whole kernel rows, as many input channels as fit, then kernel
    # rows and output channels from what is left of the accumulator budget.
    ic_block = _even_block(g.in_per_group, max(1, min(8, _GRAD_WEIGHT_ACCUMULATORS // kw)))
    rest = max(1, _GRAD_WEIGHT_ACCUMULATORS // (ic_block * kw))
    kh_block = _even_block(kh, rest)
    oc_block = _even_block(g.out_per_group, max(1, min(8, rest // kh_block)))
    cells = _window_cells(g, max(1, min(4, 16 // ic_block)))
    block = 128
    h, w = g.in_size
    rows = g.batch * h
    cells_w = _cdiv(w, cells)
    kh_blocks = _cdiv(kh, kh_block)
    yblocks = g.groups * _cdiv(g.in_per_group, ic_block) * _cdiv(g.out_per_group, oc_block)
    # Enough chunks for several waves of blocks, each thread still walking 8 or more steps.
    chunks, rows_per_chunk = _chunks(rows, yblocks * kh_blocks, 8 * block, sm_count, blocks_per_sm=8,
                                     row_items=cells_w)
    weight_elems = _numel(g.weight_shape)
    partial_elems = chunks * weight_elems
    index_t = index_type(_numel(g.input_shape), _numel(g.output_shape), partial_elems)
    constants = _layer_constants(g, dtype, index_t)
    constants.update(IC_BLOCK=ic_block, OC_BLOCK=oc_block, KH_BLOCK=kh_block, CELLS=cells, BLOCK=block)
    spec = KernelSpec.make("conv_transpose2d_grad_weight.cu", "conv_transpose2d_grad_weight_partial", constants)
    partial = Plan(spec, (chunks, min(yblocks, _GRID_YZ_LIMIT), kh_blocks), (block, 1, 1),
                   (g.batch, h, w) + g.out_size + (cells_w, rows_per_chunk), index_t,
                   scratch_bytes=partial_elems * accumulator_bytes(dtype))
    return partial, plan_reduce(dtype, weight_elems, chunks, index_t)


# channels_last direct kernels: lanes run along channels, a block holds a tile of at most
# _NHWC_TILE of them and as many pixel runs as fill _NHWC_THREADS threads.
_NHWC_TILE = 64
_NHWC_THREADS = 128
_NHWC_WEIGHT_SMEM = 40 * 1024  # five blocks of 128 threads still fit an SM


def _nhwc_tile(g: Geometry, dtype: str, channels: int, per_group: int) -> Tuple[int, int, int]:
    """(channel tile, channels per thread, staged channels per chunk) for an NHWC kernel
    whose lanes run along ``channels``, ``per_group`` of them to a group."""
    _staged_block(g, dtype, 1)  # the same kernel-size limit as the NCHW kernels
    per_tap = accumulator_bytes(dtype) * g.kernel[0] * g.kernel[1]
    tile = min(channels, _NHWC_TILE)
    while tile > 1 and tile * per_tap > _NHWC_WEIGHT_SMEM:
        tile = _cdiv(tile, 2)
    # A thread's channels share their group's input loads, so they must not straddle groups.
    per_thread = next(b for b in (4, 2, 1) if per_group % b == 0 and tile % b == 0)
    return tile, per_thread, max(1, _NHWC_WEIGHT_SMEM // (tile * per_tap))


_BLOCKS_TO_FILL = 2048  # enough blocks for several waves on any GPU we plan for


def _images_per_block(blocks: int, batch: int) -> int:
    """Images each block walks: up to 8, while ``_BLOCKS_TO_FILL`` blocks remain to fill the GPU."""
    per_block = 1
    while per_block < 8 and per_block < batch and blocks * _cdiv(batch, per_block * 2) >= _BLOCKS_TO_FILL:
        per_block *= 2
    return per_block


def _nhwc_grid(g: Geometry, runs_total: int, runs: int, channels: int, tile: int,
               staged_once: bool) -> Tuple[int, int, int]:
    """(run blocks, channel tiles, image blocks) of an NHWC forward or grad_input kernel.

    Weights staged once per channel tile serve several images; staged per chunk, they
    would not, so then each block takes one image.
    """
    xy = (_cdiv(runs_total, runs), min(_cdiv(channels, tile), _GRID_YZ_LIMIT))
    images = _images_per_block(xy[0] * xy[1], g.batch) if staged_once else 1
    return xy + (min(_cdiv(g.batch, images), _GRID_YZ_LIMIT),)


def _plan_forward_nhwc(g: Geometry, dtype: str, has_bias: bool) -> Plan:
    sh, sw = g.params.stride
    dh, dw = g.params.dilation
    h_out, w_out = g.out_size
    index_t = index_type(_numel(g.input_shape), _numel(g.output_shape), _numel(g.weight_shape))
    tile, ocb, ic_chunk = _nhwc_tile(g, dtype, g.out_channels, g.out_per_group)
    lanes = tile // ocb
    runs = max(1, _NHWC_THREADS // lanes)
    phases = _phases(g.kernel[0], dh, sh) * _phases(g.kernel[1], dw, sw)
    cells = max(1, min(4, 32 // (phases * ocb)))
    q_h0, q_w0, qh, qw = _phase_cells(g)
    cells_w = _cdiv(qw, cells)
    ic_chunk = min(ic_chunk, g.in_per_group)
    constants = _layer_constants(g, dtype, index_t)
    constants.update(HAS_BIAS=bool(has_bias), OC_TILE=tile, OCB=ocb, RUNS=runs, CELLS=cells, IC_CHUNK=ic_chunk)
    grid = _nhwc_grid(g, qh * cells_w, runs, g.out_channels, tile, ic_chunk == g.in_per_group)
    spec = KernelSpec.make("conv_transpose2d_forward_nhwc.cu", "conv_transpose2d_forward_nhwc", constants)
    h, w = g.in_size
    return Plan(spec, grid, (lanes * runs, 1, 1), (g.batch, h, w, h_out, w_out, q_h0, q_w0, qh, qw, cells_w), index_t)


def _plan_grad_input_nhwc(g: Geometry, dtype: str) -> Plan:
    index_t = index_type(_numel(g.input_shape), _numel(g.output_shape), _numel(g.weight_shape))
    tile, icb, oc_chunk = _nhwc_tile(g, dtype, g.in_channels, g.in_per_group)
    lanes = tile // icb
    runs = max(1, _NHWC_THREADS // lanes)
    cells = _window_cells(g, max(1, 8 // icb))
    h, w = g.in_size
    cells_w = _cdiv(w, cells)
    oc_chunk = min(oc_chunk, g.out_per_group)
    constants = _layer_constants(g, dtype, index_t)
    constants.update(IC_TILE=tile, ICB=icb, RUNS=runs, CELLS=cells, OC_CHUNK=oc_chunk)
    grid = _nhwc_grid(g, h * cells_w, runs, g.in_channels, tile, oc_chunk == g.out_per_group)
    spec = KernelSpec.make("conv_transpose2d_grad_input_nhwc.cu", "conv_transpose2d_grad_input_nhwc", constants)
    return Plan(spec, grid, (lanes * runs, 1, 1), (g.batch, h, w) + g.out_size + (cells_w,), index_t)


_NHWC_REDUCE_SMEM = 32 * 1024


def _plan_grad_weight_nhwc(g: Geometry, dtype: str, sm_count: int) -> Tuple[Plan, Plan]:
    kh, kw = g.kernel
    acc = accumulator_bytes(dtype)
    ic_block = _even_block(g.in_per_group, max(1, min(8, _GRAD_WEIGHT_ACCUMULATORS // kw)))
    kh_block = _even_block(kh, max(1, _GRAD_WEIGHT_ACCUMULATORS // (ic_block * kw)))
    values = ic_block * kh_block * kw
    # One input channel per thread (depthwise-like layers) leaves little to share between
    # cells, and narrower tiles with single cells ran fastest there (depthwise_up on an H100:
    # 0.14 ms against 0.34 ms with 64-channel tiles of 4 cells in float16).
    thin = ic_block == 1
    tile = min(g.out_channels, 16 if thin else _NHWC_TILE)
    while tile > 1 and values * tile * acc > _NHWC_REDUCE_SMEM:
        tile = _cdiv(tile, 2)
    runs = max(1, min(_NHWC_THREADS // tile, _NHWC_REDUCE_SMEM // (values * tile * acc)))
    cells = _window_cells(g, 1 if thin else max(1, min(4, 16 // ic_block)))
    h, w = g.in_size
    rows = g.batch * h
    cells_w = _cdiv(w, cells)
    kh_blocks = _cdiv(kh, kh_block)
    yblocks = _cdiv(g.out_channels, tile) * _cdiv(g.in_per_group, ic_block)
    chunks, rows_per_chunk = _chunks(rows, yblocks * kh_blocks, 8 * runs, sm_count, blocks_per_sm=8,
                                     row_items=cells_w)
    weight_elems = _numel(g.weight_shape)
    partial_elems = chunks * weight_elems
    index_t = index_type(_numel(g.input_shape), _numel(g.output_shape), partial_elems)
    constants = _layer_constants(g, dtype, index_t)
    constants.update(OC_TILE=tile, RUNS=runs, IC_BLOCK=ic_block, KH_BLOCK=kh_block, CELLS=cells)
    spec = KernelSpec.make("conv_transpose2d_grad_weight_nhwc.cu", "conv_transpose2d_grad_weight_nhwc_partial",
                           constants)
    partial = Plan(spec, (chunks, min(yblocks, _GRID_YZ_LIMIT), kh_blocks), (tile * runs, 1, 1),
                   (g.batch, h, w) + g.out_size + (cells_w, rows_per_chunk), index_t,
                   scratch_bytes=partial_elems * acc)
    return partial, plan_reduce(dtype, weight_elems, chunks, index_t)


@functools.lru_cache(maxsize=1024)
def plan_grad_bias(g: Geometry, dtype: str, sm_count: int, layout: str = "nchw") -> Tuple[Plan, Plan]:
    _check_dtype(dtype)
    _check_layout(layout)
    block = 256
    h_out, w_out = g.out_size
    channel_tile = min(g.out_channels, block)
    if layout == "nhwc":
        # A block is (pixel lane, channel): few channels leave room for many pixel lanes.
        channel_blocks = _cdiv(g.out_channels, channel_tile)
        chunks, rows_per_chunk = _chunks(g.batch * h_out * w_out, channel_blocks, 64 * (block // channel_tile),
                                         sm_count)
        grid_y = min(channel_blocks, _GRID_YZ_LIMIT)
    else:
        chunks, rows_per_chunk = _chunks(g.batch * h_out, g.out_channels, block // 32, sm_count)
        grid_y = min(g.out_channels, _GRID_YZ_LIMIT)
    index_t = index_type(_numel(g.output_shape), chunks * g.out_channels)
    constants = dict(SCALAR_T=DTYPES[dtype][0], INDEX_T=index_t, COUT=g.out_channels, BLOCK=block,
                     CHANNELS_LAST=layout == "nhwc", CHANNEL_TILE=channel_tile if layout == "nhwc" else 1)
    spec = KernelSpec.make("conv_transpose2d_grad_bias.cu", "conv_transpose2d_grad_bias_partial", constants)
    partial = Plan(spec, (chunks, grid_y, 1), (block, 1, 1),
                   (g.batch, h_out, w_out, rows_per_chunk), index_t,
                   scratch_bytes=chunks * g.out_channels * accumulator_bytes(dtype))
    return partial, plan_reduce(dtype, g.out_channels, chunks, index_t)


@functools.lru_cache(maxsize=1024)
def plan_reduce(dtype: str, elements: int, chunks: int, index_t: str) -> Plan:
    constants = dict(SCALAR_T=DTYPES[dtype][0], INDEX_T=index_t, BLOCK=_REDUCE_BLOCK)
    spec = KernelSpec.make("reduce_partials.cu", "reduce_partials", constants)
    grid = (min(_cdiv(elements, _REDUCE_BLOCK), 8192), 1, 1)
    return Plan(spec, grid, (_REDUCE_BLOCK, 1, 1), (elements, chunks), index_t)


Allocator = Callable[[int], Tuple[object, int]]


_SCRATCH_ALIGN = 256


def _carve(alloc: Allocator, sizes: Sequence[int]) -> Tuple[object, List[int]]:
    """One scratch allocation split into 256-byte aligned pieces of ``sizes`` bytes.

    A pass needs up to four scratch buffers; one allocation costs the host one
    allocator call instead of four.
    """
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += _cdiv(size, _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    keep, base = alloc(total)
    return keep, [base + o for o in offsets]


def run_split_k(partial: Plan, reduce: Plan, device_id: int, stream_ptr: int, inputs: Sequence[int],
                out_ptr: int, alloc: Allocator, scratch: Optional[int] = None) -> None:
    """Run a partial pass into scratch and reduce it into ``out_ptr``.

    The scratch comes from ``alloc`` unless the caller passes ``scratch`` (at least
    ``partial.scratch_bytes``).  It is released when this returns; both allocators we
    use (CuPy's pool and torch's caching allocator) are stream-ordered, so its reuse
    waits behind the reduce.
    """
    keep = None
    if scratch is None:
        keep, scratch = alloc(partial.scratch_bytes)
    partial.run(device_id, stream_ptr, tuple(inputs) + (scratch,))
    reduce.run(device_id, stream_ptr, (scratch, out_ptr))
    del keep


class SourceCopies:
    """channels_last copies of NCHW sources, made once and shared by the passes of one call.

    grad_input and grad_weight both read grad_output through the same copy; a backward
    call that runs both makes one of these and passes it to each.  The copies live as
    long as this object (stream-ordered, like all scratch).
    """

    def __init__(self) -> None:
        self._copies: Dict[Tuple[int, int], Tuple[object, int]] = {}  # (id(plan), src) -> (buffer, pointer)

    def get(self, plan: Plan, src: int, device_id: int, stream_ptr: int, alloc: Allocator) -> int:
        """The pointer of ``src`` copied by ``plan`` (a :func:`plan_to_channels_last`), made on first use."""
        hit = self._copies.get((id(plan), src))
        if hit is None:
            keep, ptr = alloc(plan.scratch_bytes)
            plan.run(device_id, stream_ptr, (src, ptr))
            hit = self._copies[(id(plan), src)] = (keep, ptr)
        return hit[1]


# ------------------------------------------------------------ tensor-core implicit GEMM

# mma.cuh's MMA_* codes; float32 is TF32 when allowed and 3xTF32 (fp32 accuracy) otherwise.
_MMA_KINDS = {"float16": 0, "bfloat16": 1}
MMA_TF32, MMA_3XTF32 = 2, 3
PRECISIONS = ("strict", "tf32")


@dataclass(frozen=True)
class Tile:
    """A block tile of the implicit GEMM and how its warps split it."""

    bm: int
    bn: int
    warps_m: int
    warps_n: int

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}"


TILES = {t.name: t for t in (Tile(256, 128, 4, 2), Tile(256, 64, 4, 2),
                             Tile(128, 128, 2, 4), Tile(128, 64, 2, 2), Tile(128, 32, 4, 1),
                             Tile(64, 128, 1, 4), Tile(64, 64, 2, 2), Tile(64, 32, 2, 1),
                             Tile(32, 64, 1, 2), Tile(32, 32, 1, 2))}


def mma_kind(dtype: str, precision: str) -> int:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if dtype == "float32":
        return MMA_TF32 if precision == "tf32" else MMA_3XTF32
    if dtype not in _MMA_KINDS:
        raise TypeError(f"tensor-core kernels take float16, bfloat16 or float32, got {dtype}")
    return _MMA_KINDS[dtype]


# Pipeline depths of the cp.async GEMM loop.  A stage of a BM x BN tile holds
# (BM + BN) rows of 80 bytes; four stages of 128x128 are 80 KB, so two blocks still
# fit an SM of sm_80/sm_90.
STAGE_CHOICES = (2, 3, 4)
DEFAULT_STAGES = 4
_ROW_BYTES = 80

# Activation tiles are cp.async copies through L1 (.ca) rather than L2 only (.cg): taps
# re-read neighbouring pixels, and the GEMMs were L2-bound (benchmarks/NOTES.md, v4).
# A module switch, so both can be timed in one process.
A_CACHE_L1 = True


def stage_bytes(tile: Tile) -> int:
    return (tile.bm + tile.bn) * _ROW_BYTES


def _gemm_constants(g: Geometry, dtype: str, layout: str, precision: str, tile: Tile, index_t: str) -> dict:
    _check_layout(layout)
    p = g.params
    return dict(SCALAR_T=DTYPES[dtype][0], INDEX_T=index_t, MMA_KIND=mma_kind(dtype, precision),
                CHANNELS_LAST=layout == "nhwc", KH=g.kernel[0], KW=g.kernel[1], SH=p.stride[0], SW=p.stride[1],
                PH=p.padding[0], PW=p.padding[1], DH=p.dilation[0], DW=p.dilation[1], GROUPS=p.groups,
                CIN_G=g.in_per_group, COUT_G=g.out_per_group, BM=tile.bm, BN=tile.bn, WARPS_M=tile.warps_m,
                WARPS_N=tile.warps_n)


def gemm_tile(rows: int, cols: int) -> Tile:
    """Heuristic block tile for a GEMM whose N is ``cols`` (and M ``rows``)."""
    if cols <= 32:
        return TILES["128x32"]
    if cols <= 64:
        return TILES["128x64"] if rows > 64 else TILES["64x64"]
    return TILES["128x128"] if rows > 64 else TILES["64x128"]


def grad_weight_tile(rows: int, cols: int) -> Tile:
    """grad_weight's M and N are channel counts: the smallest tile that covers them, up to 128."""
    def side(n: int) -> int:
        return 32 if n <= 32 else 64 if n <= 64 else 128
    bm, bn = side(rows), side(cols)
    if bm == 128 and bn == 32:
        bm = 64
    if bm == 32 and bn == 128:
        bn = 64
    return TILES[f"{bm}x{bn}"]


def _default_tile(tile: Tile, dtype: str, precision: str) -> Tile:
    """3xTF32 keeps a second set of accumulators; tiles over 64x64 would spill them."""
    if mma_kind(dtype, precision) == MMA_3XTF32 and tile.bm * tile.bn > 64 * 64:
        return TILES["64x64"]
    return tile


def _gemm_index_t(g: Geometry) -> str:
    return index_type(_numel(g.input_shape), _numel(g.output_shape), _numel(g.weight_shape))


def _bk(dtype: str) -> int:
    """GEMM K elements per shared-memory stage: 64 bytes."""
    return 64 // DTYPES[dtype][2]


def plan_pack_weight(g: Geometry, dtype: str, mode: int, tile: Tile) -> Plan:
    """Repack the weight into the B-operand layout of a GEMM plan (see pack_weight.cu)."""
    cg_n, cg_k = (g.out_per_group, g.in_per_group) if mode == 0 else (g.in_per_group, g.out_per_group)
    taps = g.kernel[0] * g.kernel[1]
    n_pad, k_pad = _cdiv(cg_n, tile.bn) * tile.bn, _cdiv(cg_k, _bk(dtype)) * _bk(dtype)
    total = g.groups * taps * n_pad * k_pad
    element = DTYPES[dtype][2]
    constants = dict(INDEX_T=index_type(total, _numel(g.weight_shape)), MODE=mode, ELEMENT_BYTES=element,
                     TAPS=taps, GROUPS=g.groups, CIN_G=g.in_per_group, COUT_G=g.out_per_group, N_PAD=n_pad,
                     K_PAD=k_pad, BLOCK=_REDUCE_BLOCK)
    spec = KernelSpec.make("pack_weight.cu", "pack_weight", constants)
    return Plan(spec, (min(_cdiv(total, _REDUCE_BLOCK), 8192), 1, 1), (_REDUCE_BLOCK, 1, 1), (),
                constants["INDEX_T"], scratch_bytes=total * element)


@functools.lru_cache(maxsize=1024)
def plan_to_channels_last(batch: int, channels: int, pixels: int, dtype: str) -> Plan:
    """Copy an NCHW activation into channels_last scratch (see to_channels_last.cu)."""
    total = batch * channels * pixels
    element = DTYPES[dtype][2]
    index_t = index_type(total)
    constants = dict(INDEX_T=index_t, ELEMENT_BYTES=element)
    spec = KernelSpec.make("to_channels_last.cu", "to_channels_last", constants)
    grid = (_cdiv(pixels, 64), _cdiv(channels, 64), max(1, min(batch, _GRID_YZ_LIMIT)))
    return Plan(spec, grid, (32, 8, 1), (batch, channels, pixels), index_t, scratch_bytes=total * element)


@dataclass(frozen=True)
class GemmPlans:
    """A weight repack into scratch, optionally the source into channels_last scratch, then the GEMM."""

    pack: Plan
    gemm: Plan
    to_channels_last: Optional[Plan] = None

    def run(self, device_id: int, stream_ptr: int, src: int, weight: int, bias: int, dst: int,
            alloc: "Allocator", copies: Optional["SourceCopies"] = None) -> None:
        """Launch the pack, the copy (taken from ``copies`` when given) and the GEMM on one stream."""
        to_cl = self.to_channels_last
        own_copy = to_cl is not None and copies is None
        keep, (packed, *src_cl) = _carve(alloc, [self.pack.scratch_bytes] + ([to_cl.scratch_bytes] if own_copy else []))
        self.pack.run(device_id, stream_ptr, (weight, packed))
        if own_copy:
            to_cl.run(device_id, stream_ptr, (src, src_cl[0]))
            src = src_cl[0]
        elif to_cl is not None:
            src = copies.get(to_cl, src, device_id, stream_ptr, alloc)
        self.gemm.run(device_id, stream_ptr, (src, packed, bias, dst))
        del keep

    @property
    def plans(self) -> List[Plan]:
        return [p for p in (self.pack, self.to_channels_last, self.gemm) if p is not None]


def vector_ok(g: Geometry, dtype: str, mode: int) -> bool:
    """Whether channels_last rows of the GEMM's source split into whole 16-byte vectors."""
    cg_k = g.in_per_group if mode == 0 else g.out_per_group
    return (cg_k * DTYPES[dtype][2]) % 16 == 0


def _plan_gemm(g: Geometry, dtype: str, mode: int, has_bias: bool, layout: str, precision: str,
               tile: Optional[Tile], aligned: bool, stages: Optional[int]) -> GemmPlans:
    sh, sw = g.params.stride
    if mode == 0:
        h_out, w_out = g.out_size
        m, cg_n, phases = g.batch * _cdiv(h_out, sh) * _cdiv(w_out, sw), g.out_per_group, sh * sw
        sizes = (g.batch,) + g.in_size + g.out_size
        src_channels, src_pixels = g.in_channels, g.in_size[0] * g.in_size[1]
    else:
        h, w = g.in_size
        m, cg_n, phases = g.batch * h * w, g.in_per_group, 1
        sizes = (g.batch,) + g.out_size + g.in_size
        src_channels, src_pixels = g.out_channels, g.out_size[0] * g.out_size[1]
    tile = tile or _default_tile(gemm_tile(m, cg_n), dtype, precision)
    index_t = _gemm_index_t(g)
    constants = _gemm_constants(g, dtype, layout, precision, tile, index_t)
    del constants["CHANNELS_LAST"]
    # Whole 16-byte channel runs are copied with cp.async; an NCHW source is first
    # copied into channels_last scratch for that (its own scratch is always aligned).
    vectors = vector_ok(g, dtype, mode)
    transpose = layout == "nchw" and vectors
    a_vec = transpose or (layout == "nhwc" and aligned and vectors)
    stages = (stages or DEFAULT_STAGES) if a_vec else 2
    if stages not in STAGE_CHOICES:
        raise ValueError(f"stages must be one of {STAGE_CHOICES}, got {stages}")
    constants.update(MODE=mode, HAS_BIAS=bool(has_bias) and mode == 0, A_VEC=a_vec, STAGES=stages, A_L1=A_CACHE_L1,
                     SRC_CL=layout == "nhwc" or transpose, DST_CL=layout == "nhwc")
    spec = KernelSpec.make("conv_transpose2d_igemm.cu", "conv_transpose2d_igemm", constants)
    grid = (_cdiv(m, tile.bm), g.groups * _cdiv(cg_n, tile.bn), phases)
    gemm = Plan(spec, grid, (32 * tile.warps_m * tile.warps_n, 1, 1), sizes, index_t,
                smem_bytes=stages * stage_bytes(tile))
    to_cl = plan_to_channels_last(g.batch, src_channels, src_pixels, dtype) if transpose else None
    return GemmPlans(plan_pack_weight(g, dtype, mode, tile), gemm, to_cl)


@functools.lru_cache(maxsize=1024)
def plan_forward_gemm(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw", precision: str = "strict",
                      tile: Optional[Tile] = None, aligned: bool = True, stages: Optional[int] = None) -> GemmPlans:
    """Forward as one implicit GEMM per stride phase (grid z).

    ``aligned``: the activation pointers are 16-byte aligned (channels_last vector loads).
    ``stages``: cp.async pipeline depth (one of :data:`STAGE_CHOICES`; default
    :data:`DEFAULT_STAGES`); the element-gathering fallback always double-buffers.
    """
    return _plan_gemm(g, dtype, 0, has_bias, layout, precision, tile, aligned, stages)


@functools.lru_cache(maxsize=1024)
def plan_grad_input_gemm(g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict",
                         tile: Optional[Tile] = None, aligned: bool = True, stages: Optional[int] = None) -> GemmPlans:
    """grad_input (a strided conv2d of grad_output) as one implicit GEMM; see :func:`plan_forward_gemm`."""
    return _plan_gemm(g, dtype, 1, False, layout, precision, tile, aligned, stages)


def grad_weight_vectors(g: Geometry, dtype: str, layout: str, aligned: bool = True) -> Tuple[bool, bool]:
    """(vector tiles, NCHW sources to copy into channels_last first) for the grad_weight GEMM.

    Vector tiles copy 16-byte channel runs of 16-bit channels_last data with cp.async.
    """
    runs = DTYPES[dtype][2] == 2 and g.in_per_group % 8 == 0 and g.out_per_group % 8 == 0
    transpose = runs and layout == "nchw"
    return transpose or (runs and layout == "nhwc" and aligned), transpose


@functools.lru_cache(maxsize=1024)
def plan_grad_weight_sources(g: Geometry, dtype: str) -> Tuple[Plan, Plan]:
    """The channels_last copies of x and grad_output that the vector grad_weight GEMM reads."""
    return (plan_to_channels_last(g.batch, g.in_channels, g.in_size[0] * g.in_size[1], dtype),
            plan_to_channels_last(g.batch, g.out_channels, g.out_size[0] * g.out_size[1], dtype))


def run_grad_weight_gemm(g: Geometry, dtype: str, partial: Plan, reduce: Plan, device_id: int, stream_ptr: int,
                         x: int, grad_out: int, out: int, alloc: Allocator, layout: str, aligned: bool,
                         copies: Optional[SourceCopies] = None) -> None:
    """Run a :func:`plan_grad_weight_gemm` pair, first copying NCHW sources into channels_last if it needs them.

    With ``copies``, the copy of grad_output is shared with grad_input's.
    """
    if not grad_weight_vectors(g, dtype, layout, aligned)[1]:
        run_split_k(partial, reduce, device_id, stream_ptr, (x, grad_out), out, alloc)
        return
    x_plan, go_plan = plan_grad_weight_sources(g, dtype)
    if copies is None:
        keep, (scratch, x_cl, go_cl) = _carve(alloc, [partial.scratch_bytes, x_plan.scratch_bytes,
                                                      go_plan.scratch_bytes])
        go_plan.run(device_id, stream_ptr, (grad_out, go_cl))
    else:
        keep, (scratch, x_cl) = _carve(alloc, [partial.scratch_bytes, x_plan.scratch_bytes])
        go_cl = copies.get(go_plan, grad_out, device_id, stream_ptr, alloc)
    x_plan.run(device_id, stream_ptr, (x, x_cl))
    run_split_k(partial, reduce, device_id, stream_ptr, (x_cl, go_cl), out, alloc, scratch)
    del keep


@functools.lru_cache(maxsize=1024)
def plan_grad_weight_gemm(g: Geometry, dtype: str, sm_count: int, layout: str = "nchw", precision: str = "strict",
                          tile: Optional[Tile] = None, aligned: bool = True,
                          stages: Optional[int] = None) -> Tuple[Plan, Plan]:
    """grad_weight as a split-K implicit GEMM per (group, tap), and the fixed-order reduction.

    When :func:`grad_weight_vectors` says the sources must be copied into
    channels_last first, :func:`plan_grad_weight_sources` plans those copies.
    """
    tile = tile or _default_tile(grad_weight_tile(g.in_per_group, g.out_per_group), dtype, precision)
    vec, transpose = grad_weight_vectors(g, dtype, layout, aligned)
    stages = (stages or DEFAULT_STAGES) if vec else 2
    if stages not in STAGE_CHOICES:
        raise ValueError(f"stages must be one of {STAGE_CHOICES}, got {stages}")
    taps = g.kernel[0] * g.kernel[1]
    h, w = g.in_size
    k_tiles = _cdiv(g.batch * h * w, _bk(dtype))
    base_blocks = _cdiv(g.in_per_group, tile.bm) * _cdiv(g.out_per_group, tile.bn) * g.groups * taps
    # Enough K ranges for 16 resident warps per SM, each range at least eight K tiles long.
    warps = tile.warps_m * tile.warps_n
    splits = max(1, min(_cdiv(16 * sm_count, warps * base_blocks), _cdiv(k_tiles, 8), 512))
    per_split = _cdiv(k_tiles, splits)
    splits = _cdiv(k_tiles, per_split)
    weight_elems = _numel(g.weight_shape)
    index_t = index_type(_numel(g.input_shape), _numel(g.output_shape), splits * weight_elems)
    constants = _gemm_constants(g, dtype, layout, precision, tile, index_t)
    constants.update(CHANNELS_LAST=layout == "nhwc" or transpose, VEC=vec, STAGES=stages, A_L1=A_CACHE_L1)
    spec = KernelSpec.make("conv_transpose2d_grad_weight_igemm.cu", "conv_transpose2d_grad_weight_igemm", constants)
    # Taps fastest: blocks reading the same K range of x and grad_out run together.
    grid = (g.groups * taps, _cdiv(g.in_per_group, tile.bm) * _cdiv(g.out_per_group, tile.bn), splits)
    bk = _bk(dtype)
    smem = stages * (bk * (tile.bm + tile.bn) * 2 + 2 * bk * 16) if vec else 2 * stage_bytes(tile)
    partial = Plan(spec, grid, (32 * tile.warps_m * tile.warps_n, 1, 1),
                   (g.batch, h, w) + g.out_size + (per_split,), index_t, scratch_bytes=splits * weight_elems * 4,
                   smem_bytes=smem)
    return partial, plan_reduce(dtype, weight_elems, splits, index_t)


def gemm_fits(g: Geometry, dtype: str) -> bool:
    """Whether the tensor-core kernels can run this layer at all (grid and dtype limits)."""
    if dtype not in ("float16", "bfloat16", "float32"):
        return False
    taps = g.kernel[0] * g.kernel[1]
    return g.groups * taps < 2 ** 31 and g.groups * _cdiv(max(g.in_per_group, g.out_per_group), 32) \
        <= _GRID_YZ_LIMIT and taps <= 256


def all_plans(g: Geometry, dtype: str, has_bias: bool, sm_count: int = 132, layout: str = "nchw") -> List[Plan]:
    """Every direct-kernel launch the forward and the three grads of this layer need (for compiling ahead)."""
    plans = [plan_forward(g, dtype, has_bias, layout), plan_grad_input(g, dtype, layout)]
    plans += plan_grad_weight(g, dtype, sm_count, layout)
    plans += plan_grad_bias(g, dtype, sm_count, layout)
    return plans


def all_gemm_plans(g: Geometry, dtype: str, has_bias: bool, layout: str, precision: str,
                   sm_count: int = 132) -> List[Plan]:
    """The tensor-core launches of this layer, for one layout and precision."""
    plans = []
    for aligned in ((False, True) if layout == "nhwc" else (True,)):
        for pair in (plan_forward_gemm(g, dtype, has_bias, layout, precision, aligned=aligned),
                     plan_grad_input_gemm(g, dtype, layout, precision, aligned=aligned)):
            plans += pair.plans
    plans += list(plan_grad_weight_gemm(g, dtype, sm_count, layout, precision))
    if grad_weight_vectors(g, dtype, layout)[1]:
        plans += list(plan_grad_weight_sources(g, dtype))
    return plans


def clear_plan_cache() -> None:
    for planner in (plan_forward, plan_grad_input, plan_grad_weight, plan_grad_bias, plan_reduce,
                    plan_forward_gemm, plan_grad_input_gemm, plan_grad_weight_gemm, plan_to_channels_last,
                    plan_grad_weight_sources):
        planner.cache_clear()
