"""The depthwise family: channels_last forward and grad_input of layers with one input and one output channel a group.

A depthwise layer does a multiply-add per tap for each value it moves, so its passes are bound by memory.  The
direct channels_last kernels ran its forward at 28% of the copy bandwidth (H100, fp16).  Here each thread takes an
8- or 16-byte run of a pixel's channels (one channel where the channels or the pointers do not allow runs) for a
patch of destination pixels, so every load and store moves whole runs and a warp's neighbouring runs fill whole
lines (``kernels/conv_transpose2d_depthwise_nhwc.cu``).  The forward's patches start on a whole stride period, so
its taps and their input pixels are compile-time constants and the patch's input window is loaded once into
registers for all its taps.  A tile is named ``{rows}x{cols}x{channels}b{blocks}`` in the tuner's variants
(``depthwise:4x6x2b2``): a thread's destination rows, columns and channels, and the blocks an SM must hold.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

from ..core import dtypes
from ..core.device import Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import tiled
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, cdiv, index_type, layer_constants, numel
from .sequences import OneKernel, PassPlan

THREADS = 256
MIN_BLOCKS = 2            # blocks an SM holds at once, at least: at most 128 registers a thread
WEIGHT_SMEM = 32 * 1024   # the block's taps, widened, in static shared memory
MAX_TAPS = 64             # the unrolled tap loops grow with the kernel
MAX_CHANNEL_RUNS = 32     # a block's channel runs: a warp's worth
GRID_X_LIMIT = 2 ** 31 - 1


def eligible(g: Geometry, dtype: str, layout: str) -> bool:
    """channels_last fp16, bf16 or float32 (CUDA float64 runs NCHW, as torch's own float64 convolution answers), one
    input and one output channel a group, at most :data:`MAX_TAPS` taps, the blocks within the grid's dimensions
    even at a pixel a thread."""
    taps = g.kernel[0] * g.kernel[1]
    pixels = max(numel(g.out_size), numel(g.in_size)) * g.batch
    return (layout == "nhwc" and dtype in ("float16", "bfloat16", "float32") and g.in_per_group == 1
            and g.out_per_group == 1 and taps <= MAX_TAPS and cdiv(g.in_channels, MAX_CHANNEL_RUNS) <= GRID_YZ_LIMIT
            and cdiv(pixels, THREADS // MAX_CHANNEL_RUNS) <= GRID_X_LIMIT)


def vector(g: Geometry, dtype: str, aligned: bool, run_bytes: int = 16) -> int:
    """Channels a thread: a ``run_bytes`` run (16 or 8) where every pixel's channels start on one (the pointers
    16-byte aligned, the channels whole runs), else one."""
    run = max(1, run_bytes // dtypes.get(dtype).itemsize)
    return run if aligned and g.in_channels % run == 0 else 1


def _mode(pass_: str) -> int:
    if pass_ not in ("forward", "grad_input"):
        raise ValueError(f"the depthwise kernels run forward and grad_input, not {pass_!r}")
    return 0 if pass_ == "forward" else 1


def window(g: Geometry, rows: int, cols: int) -> Tuple[int, int]:
    """The input pixels (rows, columns) a forward patch reads, from the first it reads to the last (the tiled
    family's stride-period tile edges)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.params.stride, g.params.padding, g.params.dilation
    return tiled.phase_tile_edges(rows, kh, sh, ph, dh)[1], tiled.phase_tile_edges(cols, kw, sw, pw, dw)[1]


def registers(g: Geometry, dtype: str, rows: int, cols: int, vec: int, pass_: str = "forward") -> int:
    """32-bit registers of a thread's accumulators and the loads it holds: the forward's window, grad_input's taps
    in flight (every tap's where those take at most 64 registers, else a kernel row's: the kernel's KH_UNROLL)."""
    item, acc = dtypes.get(dtype).itemsize, dtypes.get(dtype).accumulator_bytes
    words = cdiv(rows * cols * vec * acc, 4)
    if _mode(pass_) == 0:
        win_h, win_w = window(g, rows, cols)
        return words + cdiv(win_h * win_w * vec * item, 4)
    tap_words = rows * cols * cdiv(vec * item, 4)
    taps = g.kernel[0] * g.kernel[1]
    return words + tap_words * (taps if taps * tap_words <= 64 else g.kernel[1])


Tile = Tuple[int, int, int, int]   # destination rows, columns, channels a thread; blocks an SM


def register_budget(blocks: int) -> int:
    """32-bit registers a thread's window and accumulators may take with ``blocks`` blocks an SM: the register file's
    share less 32 for the addresses, a tap's weights and the widened values."""
    return 65536 // (THREADS * blocks) - 32


def _shapes(g: Geometry, pass_: str) -> List[Tuple[int, int]]:
    """Patch shapes: forward patches of whole stride periods, up to four periods along a row and two down;
    grad_input two by two pixels, two side by side, or one."""
    if _mode(pass_) == 1:
        return [(2, 2), (1, 2), (1, 1)]
    sh, sw = g.params.stride
    return [(sh * r, sw * c) for r in (1, 2) for c in (1, 2, 3, 4)]


def _best_shape(g: Geometry, dtype: str, pass_: str, vec: int, blocks: int) -> Optional[Tuple[int, int]]:
    """The patch that fits :func:`register_budget`: the forward's with the most pixels and then the fewest window
    pixels a pixel (each window load then serves the most multiply-adds), the first of :func:`_shapes` for
    grad_input."""
    fitting = [s for s in _shapes(g, pass_) if registers(g, dtype, *s, vec, pass_) <= register_budget(blocks)]
    if not fitting:
        return None
    if _mode(pass_) == 1:
        return fitting[0]

    def per_pixel(s: Tuple[int, int]) -> float:
        h, w = window(g, *s)
        return h * w / (s[0] * s[1])

    return min(fitting, key=lambda s: (-s[0] * s[1], per_pixel(s), s[0]))


# Channel runs in the order the heuristic prefers them.  On the H200 (NOTES v40) the forward ran fastest on 8-byte
# runs, whose halved registers a pixel buy patches twice the size (depthwise_up fp16: 43 us at 4 x 4 against 71 at
# 2 x 2 in 16-byte runs; float32 45 us at 4 x 6 against 54 at 2 x 4), and grad_input on 16-byte runs of 2 x 2
# pixels (fp16 42 us against 64 in 8-byte runs; float32 60 against 78 in 8-byte runs of 1 x 2).
RUN_BYTES = {"forward": (8, 16), "grad_input": (16, 8)}


def tiles(g: Geometry, dtype: str, pass_: str, aligned: bool = True) -> List[Tile]:
    """The tiles worth running, the heuristic first: channel runs in :data:`RUN_BYTES`' order, each at
    :data:`MIN_BLOCKS` and, for the forward, one block more.  grad_input keeps every tap's loads in flight at once,
    which a third block's registers do not hold (sm_90 spilled its fp16 and float32 two-pixel patches)."""
    found: List[Tile] = []
    for run_bytes in RUN_BYTES[pass_]:
        vec = vector(g, dtype, aligned, run_bytes)
        for blocks in (MIN_BLOCKS, MIN_BLOCKS + 1) if _mode(pass_) == 0 else (MIN_BLOCKS,):
            shape = _best_shape(g, dtype, pass_, vec, blocks)
            if shape is not None and (shape + (vec, blocks)) not in found:
                found.append(shape + (vec, blocks))
    if not found:
        sh, sw = g.params.stride
        found.append((sh, sw, 1, MIN_BLOCKS) if _mode(pass_) == 0 else (1, 1, 1, MIN_BLOCKS))
    return found


def tile_name(tile: Tile) -> str:
    return "{}x{}x{}b{}".format(*tile)


def parse_tile(name: str) -> Tile:
    shape, blocks = name.split("b")
    rows, cols, vec = shape.split("x")
    return int(rows), int(cols), int(vec), int(blocks)


def _channel_runs(g: Geometry, dtype: str, vec: int) -> int:
    """Channel runs a block covers: all of them up to a warp's worth, fewer where the taps would pass
    :data:`WEIGHT_SMEM`."""
    runs = min(cdiv(g.in_channels, vec), MAX_CHANNEL_RUNS)
    taps, acc = g.kernel[0] * g.kernel[1], dtypes.get(dtype).accumulator_bytes
    while runs > 1 and taps * runs * vec * acc > WEIGHT_SMEM:
        runs //= 2
    return runs


@functools.lru_cache(maxsize=1024)
def plan(g: Geometry, dtype: str, pass_: str, has_bias: bool = False, aligned: bool = True,
         tile: Optional[Tile] = None) -> Plan:
    """A thread a (patch, channel run); a block :data:`THREADS` threads (fewer where the channel runs do not
    divide it), its channel runs fastest.  A tile whose runs the pointers or channels do not allow takes single
    channels."""
    if not eligible(g, dtype, "nhwc"):
        raise ValueError("the depthwise kernels run channels_last fp16, bf16 and float32 layers of one input and one "
                         f"output channel a group and at most {MAX_TAPS} taps")
    mode = _mode(pass_)
    rows, cols, vec, blocks = tile or tiles(g, dtype, pass_, aligned)[0]
    if vec != 1 and vec * dtypes.get(dtype).itemsize not in (8, 16):
        raise ValueError(f"a depthwise thread takes one channel or an 8- or 16-byte run of them, not {vec} {dtype}")
    if not aligned or g.in_channels % vec:
        vec = 1
    sh, sw = g.params.stride
    if rows < 1 or cols < 1 or (mode == 0 and (rows % sh or cols % sw)):
        raise ValueError(f"a depthwise forward patch is whole stride periods, got {rows}x{cols}")
    runs = _channel_runs(g, dtype, vec)
    tiles_block = THREADS // runs
    # A weight of one output channel a group lies the same in either layout: one kernel serves both.
    g = g.with_weight_channels_last(False)
    h_dst, w_dst = g.out_size if mode == 0 else g.in_size
    h_src, w_src = g.in_size if mode == 0 else g.out_size
    tiles_h, tiles_w = cdiv(h_dst, rows), cdiv(w_dst, cols)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    constants.update(MODE=mode, ROWS=rows, COLS=cols, VEC=vec, CV_BLOCK=runs, TILES_BLOCK=tiles_block,
                     HAS_BIAS=bool(has_bias) and mode == 0, MIN_BLOCKS=blocks)
    spec = KernelSpec.make("conv_transpose2d_depthwise_nhwc.cu", "conv_transpose2d_depthwise_nhwc", constants)
    grid = (cdiv(g.batch * tiles_h * tiles_w, tiles_block), cdiv(cdiv(g.in_channels, vec), runs), 1)
    return Plan(spec, grid, (runs * tiles_block, 1, 1), (g.batch, h_src, w_src, h_dst, w_dst, tiles_h, tiles_w),
                index_t)


class DepthwiseFamily(Family):
    name = "depthwise"
    passes = ("forward", "grad_input")
    max_variants = 4

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        return eligible(g, dtype, layout)

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        return [Variant(self.name)] + [Variant.make(self.name, tile=tile_name(t)) for t in tiles(g, dtype, pass_)[1:]]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        if layout != "nhwc":
            raise ValueError(f"the depthwise kernels run channels_last tensors, not {layout!r}")
        tile = variant.kwargs.get("tile")
        return OneKernel(plan(g, dtype, pass_, has_bias, aligned, parse_tile(tile) if tile else None))

    def clear(self) -> None:
        plan.cache_clear()


FAMILY = DepthwiseFamily()
