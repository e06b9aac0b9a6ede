"""The tiled family: an NCHW forward for layers with few channels per group, built to move bytes.

Depthwise, grouped and dilated layers do little arithmetic per byte, so their forward is
bound by memory and by the instructions spent around each multiply-add.  The kernel
(``kernels/conv_transpose2d_forward_tiled.cu``) gives each thread an output tile that
starts on a whole stride period, ``rows`` x ``cols`` pixels of ``channels`` output
channels: every tap and input offset is then a compile-time constant, and each tile
row leaves in 16-byte (or narrower) vector stores.  A block of 128 threads covers a
patch of tiles in one output plane and stages the input window the patch reads in shared
memory, so each input value is loaded once for the whole patch; it walks a run of such patches, holding
the next one's loads in registers while it computes this one (two 16-bit cells a load where the input's width
is even).  A tile is named
``{rows}x{cols}x{channels}b{blocks}`` in the tuner's variants (``tiled:4x8x1b6``),
``blocks`` being the blocks of 128 threads an SM must hold at once: it caps the registers,
and with them the input channels a block stages at once.
"""
from __future__ import annotations

import functools
import math
import re
from typing import List, Optional, Tuple

from ..core import dtypes
from ..core.device import ASSUMED, Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import direct
from .family import Family
from .launch import Plan, cdiv, index_type, layer_constants, numel
from .sequences import OneKernel, PassPlan

Tile = Tuple[int, int, int, int]   # output rows, columns and channels per thread; blocks per SM

_THREADS = 128
# The block's weights, all of a group's input channels for its output channels, staged at once.
WEIGHT_SMEM = 16 * 1024
# Its input window, IC_CHUNK input channels at a time, within this many bytes ...
WINDOW_SMEM = 24 * 1024
# ... and the registers each thread holds the next chunk's share of it in meanwhile, at most (more only where
# one input channel's share needs them).
_HELD_REGISTERS = 16
# What the blocks an SM holds take of its shared memory in all (227 KB on sm_90, less each block's reserve).
_SMEM_PER_SM = 200 * 1024
# Registers of the fed stride phases' accumulators a thread keeps (the heuristic; other candidates up to twice
# that): room for several blocks per SM, and no spills (float64 past 128 spilled, ptxas sm_90).
_ACCUMULATORS = 64
# The unrolled tap loops grow with the kernel and the tile; past this many taps the direct kernels run.
_MAX_TAPS = 32
_MAX_ROWS, _MAX_CHANNELS, _MAX_COLUMNS = 8, 8, 32
# Its heuristic runs ahead of the direct kernels' up to this many channels per group.
LEADS_UP_TO_CHANNELS = 16
_REGISTERS_PER_SM, _REGISTER_BYTES = 65536, 4
_MAX_BLOCKS = 8   # 64 registers a thread


def _acc_bytes(dtype: str) -> int:
    return dtypes.get(dtype).accumulator_bytes


def store_vector(g: Geometry, dtype: str, aligned: bool = True) -> int:
    """Elements per vector store: up to 16 bytes, and a divisor of the output's width so that every output row
    starts aligned (one element when the output pointer is not 16-byte aligned)."""
    if not aligned:
        return 1
    vec = 16 // dtypes.get(dtype).itemsize
    while vec > 1 and g.out_size[1] % vec:
        vec //= 2
    return vec


def _fed(kernel: int, dilation: int, stride: int, padding: int, extent: int) -> int:
    """How many of ``extent`` tile positions along one axis (from a whole stride period) some tap feeds."""
    phases = {(k * dilation) % stride for k in range(kernel)}
    return sum((i + padding) % stride in phases for i in range(extent))


def live_accumulators(g: Geometry, tile: Tile) -> int:
    """The accumulators a tile keeps that taps add to (those of phases no tap feeds hold the bias)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.params.stride, g.params.padding, g.params.dilation
    rows, cols, channels = tile[:3]
    return _fed(kh, dh, sh, ph, rows) * _fed(kw, dw, sw, pw, cols) * channels


def accumulator_registers(g: Geometry, dtype: str, tile: Tile) -> int:
    """The registers the live accumulators take: two a float64 one."""
    return live_accumulators(g, tile) * _acc_bytes(dtype) // _REGISTER_BYTES


def _weight_cells(g: Geometry, channels: int) -> int:
    """The weights a block stages: every input channel of the group and tap, for ``channels`` output channels."""
    return g.in_per_group * g.kernel[0] * g.kernel[1] * channels


def _weight_bytes(g: Geometry, dtype: str, channels: int) -> int:
    return _weight_cells(g, channels) * _acc_bytes(dtype)


def phase_tile_edges(extent: int, kernel: int, stride: int, padding: int, dilation: int) -> Tuple[int, int]:
    """The first input position a tile of ``extent`` positions (from a whole stride period) reads along one axis,
    and how many it reads: the kernel's ROW0/ROWS (COL0/COLS)."""
    offsets = [(i + padding) // stride - (t * dilation) // stride for i in range(extent) for t in range(kernel)
               if (t * dilation) % stride == (i + padding) % stride]
    return min(offsets), max(offsets) - min(offsets) + 1


_PATCH_COLUMNS = 192


def patch(g: Geometry, tile: Tile) -> Tuple[int, int]:
    """A block's patch of tiles in one output plane, across and down, 128 in all: up to 32 tiles and 192 output
    columns across (rows of a patch load in long runs), or one row of 128 tiles for an input one row high (a 1-D
    layer's).  It leaves the image size out, so that a new size compiles nothing (the 1-D case is a bucket of its
    own; a 16-bit input whose width changes parity changes :func:`pairs`).  On the bench's layers (H200):
    grouped_dilated's 6-column tiles ran 0.47 ms 32 across and 0.63 ms 16 across in float32; depthwise_up's
    8-column ones, on 128-column rows, 16 across."""
    if g.in_size[0] == 1:
        return _THREADS, 1
    width = 4
    while width < 32 and width * 2 * tile[1] <= _PATCH_COLUMNS:
        width *= 2
    return width, _THREADS // width


def _window(g: Geometry, dtype: str, tile: Tile) -> Tuple[int, int, int, int]:
    """One input channel's window for the tile's patch: its rows, its columns, those padded to the kernel's vector
    reads, and its first column's offset from the patch's (the kernel's WR, WC, WC_PAD and COL0)."""
    rows, cols = tile[:2]
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.params.stride, g.params.padding, g.params.dilation
    tr, tc = rows // sh, cols // sw
    width, height = patch(g, tile)
    rows_read = (height - 1) * tr + phase_tile_edges(rows, kh, sh, ph, dh)[1]
    vr_max = 16 // _acc_bytes(dtype)
    vr = vr_max if tc % vr_max == 0 else 2 if tc % 2 == 0 else 1
    col0, cols_read = phase_tile_edges(cols, kw, sw, pw, dw)
    padded = cdiv((width - 1) * tc + cdiv(cols_read, vr) * vr, vr) * vr
    return rows_read, (width - 1) * tc + cols_read, padded, col0


def window_cells(g: Geometry, dtype: str, tile: Tile) -> int:
    """The window cells one input channel takes in shared memory for the tile's patch (WR x WC_PAD)."""
    rows, _, padded, _ = _window(g, dtype, tile)
    return rows * padded


def pairs(g: Geometry, dtype: str, aligned: bool) -> bool:
    """Whether the kernel loads the window two 16-bit cells at a time: every row's pairs start 4-byte aligned
    where the input's width is even and its pointer aligned.  An odd width compiles a kernel of its own."""
    return aligned and dtypes.get(dtype).itemsize == 2 and g.in_size[1] % 2 == 0


def _window_loads(g: Geometry, dtype: str, tile: Tile, paired: bool) -> int:
    """The loads one input channel's window takes: a pair each from an even column (WR x SPAN), or else counted
    as a cell each of its padded rows, the count its chunks were measured with (the spill test's float32 grouped
    layer spilled with one more channel a chunk)."""
    rows, cols, padded, col0 = _window(g, dtype, tile)
    return rows * cdiv(cols + col0 % 2, 2) if paired else rows * padded


def _held_width(dtype: str) -> int:
    """Registers one held window cell takes: it is held as stored, two registers a float64."""
    return 2 if dtypes.get(dtype).itemsize == 8 else 1


def _one_channel_registers(g: Geometry, dtype: str, tile: Tile) -> int:
    """Registers a thread holds one input channel's share of the window in."""
    return cdiv(window_cells(g, dtype, tile), _THREADS) * _held_width(dtype)


def _weight_registers(g: Geometry, dtype: str, channels: int) -> int:
    """Registers a thread holds its share of the next channel block's weights (and bias) in: the kernel holds them
    where that takes two registers or fewer, and loads them when it stages them otherwise."""
    held = cdiv(_weight_cells(g, channels) + channels, _THREADS)
    return held * _held_width(dtype) if held <= 2 else 0


def _compute_registers(dtype: str, channels: int) -> int:
    """Registers the tap loops take besides the accumulators and what is held: a few taps' weights read from
    shared memory ahead of their multiply-adds (two registers a float64 one), the window row and the addresses
    (ptxas sm_90, the spill test's layers)."""
    return 48 + 4 * channels * _acc_bytes(dtype) // _REGISTER_BYTES


def _held_registers(g: Geometry, dtype: str, tile: Tile) -> int:
    """Registers a thread holds the next chunk's window in: what the tile's ``blocks`` leave after its accumulators,
    the weights it holds and the tap loops, up to :data:`_HELD_REGISTERS`, and at least one input channel's share."""
    per_thread = _REGISTERS_PER_SM // (_THREADS * tile[3]) // 8 * 8
    left = (per_thread - accumulator_registers(g, dtype, tile) - _weight_registers(g, dtype, tile[2])
            - _compute_registers(dtype, tile[2]))
    return max(_one_channel_registers(g, dtype, tile), min(_HELD_REGISTERS, left))


def _window_budget(g: Geometry, dtype: str, tile: Tile) -> int:
    """Shared-memory bytes for the window: :data:`WINDOW_SMEM`, or less where ``blocks`` of the tile's blocks with
    their weights must share an SM's."""
    return min(WINDOW_SMEM, _SMEM_PER_SM // tile[3] - _weight_bytes(g, dtype, tile[2]))


def fits(g: Geometry, dtype: str, tile: Tile) -> bool:
    """Whole stride periods, and a group's weights with one input channel's window in shared memory."""
    rows, cols, channels, blocks = tile
    sh, sw = g.params.stride
    return (rows % sh == 0 and cols % sw == 0 and 1 <= channels <= g.out_per_group and 1 <= blocks <= _MAX_BLOCKS
            and _weight_bytes(g, dtype, channels) <= WEIGHT_SMEM
            and window_cells(g, dtype, tile) * _acc_bytes(dtype) <= _window_budget(g, dtype, tile))


def eligible(g: Geometry, dtype: str) -> bool:
    """Kernels of up to :data:`_MAX_TAPS` taps whose weights the direct kernels' limits admit, and at least one
    tile whose weights and input window fit shared memory."""
    return (g.kernel[0] * g.kernel[1] <= _MAX_TAPS and direct.fits(g, dtype, "nchw")
            and bool(tiles(g, dtype)))


def _column_period(g: Geometry, dtype: str) -> int:
    """The narrowest tile width: whole stride periods of 16-byte stores, or of element pairs where those would
    pass 8 columns.  It leaves the output's width out, so that a layer's candidates are the same for every image
    size a stored choice serves; the plan narrows the stores to what the rows' alignment allows."""
    sw = g.params.stride[1]
    for vec in (16 // dtypes.get(dtype).itemsize, 2, 1):
        period = sw * vec // math.gcd(sw, vec)
        if period <= 8:
            return period
    return sw


def _blocks(g: Geometry, dtype: str, rows: int, cols: int, channels: int) -> int:
    """Blocks per SM that leave each thread registers for its live accumulators (two a float64 one), the next
    chunk's window and weights it holds, and the tap loops' own (:func:`_compute_registers`)."""
    tile = (rows, cols, channels)
    registers = (accumulator_registers(g, dtype, tile) + max(_HELD_REGISTERS, _one_channel_registers(g, dtype, tile))
                 + _weight_registers(g, dtype, channels) + _compute_registers(dtype, channels))
    return max(1, min(_MAX_BLOCKS, _REGISTERS_PER_SM // (_THREADS * registers)))


def _row_limit(g: Geometry) -> int:
    """The most tile rows worth computing: :data:`_MAX_ROWS`, or for an input one row high (a 1-D layer's) its
    output's height in whole stride periods.  Such an input is its own bucket of stored choices, so the candidates
    still leave the image size out."""
    sh = g.params.stride[0]
    if g.in_size[0] == 1:
        return cdiv(g.out_size[0], sh) * sh
    return max(_MAX_ROWS, sh)


def heuristic_tile(g: Geometry, dtype: str) -> Optional[Tile]:
    """Output channels first (each input load feeds them all), then rows (input rows shared between them), within
    :data:`_ACCUMULATORS`, from a tile of one period of columns; then columns where the rows are cut short (a 1-D
    layer's single row).  Wider tiles measured slower elsewhere: the bench's float32 depthwise layer ran 8 x 4
    tiles in 0.058 ms and 8 x 8 ones in 0.074 (H200)."""
    sh = g.params.stride[0]
    cols = _column_period(g, dtype)
    if cols > 64 or _sized(g, dtype, sh, cols, 1) is None:
        return None

    def grows(rows: int, cols: int, channels: int) -> bool:
        return (accumulator_registers(g, dtype, (rows, cols, channels)) <= _ACCUMULATORS
                and _sized(g, dtype, rows, cols, channels) is not None)

    channels = 1
    while channels * 2 <= min(_MAX_CHANNELS, g.out_per_group) and grows(sh, cols, channels * 2):
        channels *= 2
    rows = sh
    # (a stride-1 layer's window, an input pixel for every output one, stops the rows where it fills shared memory)
    while rows * 2 <= _row_limit(g) and grows(rows * 2, cols, channels):
        rows *= 2
    while _row_limit(g) < _MAX_ROWS and cols * 2 <= _MAX_COLUMNS and grows(rows, cols * 2, channels):
        cols *= 2
    return _sized(g, dtype, rows, cols, channels)


def _sized(g: Geometry, dtype: str, rows: int, cols: int, channels: int) -> Optional[Tile]:
    """The tile with the blocks per SM its registers allow, if it fits."""
    tile = (rows, cols, channels, _blocks(g, dtype, rows, cols, channels))
    return tile if fits(g, dtype, tile) else None


@functools.lru_cache(maxsize=1024)
def tiles(g: Geometry, dtype: str) -> Tuple[Tile, ...]:
    """The tiles worth timing, the heuristic first: it with one more block an SM, and with half the rows, columns
    or channels, or twice the channels (within twice the accumulator budget).  Taller and wider tiles than the
    heuristic's were never the fastest on the bench's grouped and depthwise layers, and took longer to build."""
    first = heuristic_tile(g, dtype)
    if first is None:
        return ()
    rows, cols, channels, blocks = first
    sh, sw = g.params.stride
    found = [first]
    # (float64 tiles spilled with one more block: ptxas sm_90, the spill test's grouped layer)
    if _acc_bytes(dtype) == 4 and fits(g, dtype, (rows, cols, channels, blocks + 1)):
        found.append((rows, cols, channels, blocks + 1))
    for r, c, o in ((rows // 2, cols, channels), (rows, cols // 2, channels), (rows, cols, channels * 2),
                    (rows, cols, channels // 2)):
        if min(r, c, o) < 1 or r % sh or c % sw or accumulator_registers(g, dtype, (r, c, o)) > 2 * _ACCUMULATORS:
            continue
        tile = _sized(g, dtype, r, c, o)
        if tile is not None and tile not in found:
            found.append(tile)
    return tuple(found)


def tile_name(tile: Tile) -> str:
    rows, cols, channels, blocks = tile
    return f"{rows}x{cols}x{channels}b{blocks}"


_TILE_NAME = re.compile(r"(\d+)x(\d+)x(\d+)b(\d+)")


def parse_tile(name: str) -> Tile:
    found = _TILE_NAME.fullmatch(name)
    if not found:
        raise ValueError(f"a tiled forward tile is rows x cols x channels b blocks per SM, got {name!r}")
    return tuple(int(n) for n in found.groups())


def _chunk(g: Geometry, dtype: str, tile: Tile, paired: bool) -> int:
    """Input channels staged at once: as many as the window's shared memory and the registers held for the next
    chunk take (at least one, which :func:`fits` leaves room for), split evenly over the group's.  A held pair of
    16-bit cells takes one register."""
    cells = window_cells(g, dtype, tile)
    limit = min(_window_budget(g, dtype, tile) // (cells * _acc_bytes(dtype)),
                _held_registers(g, dtype, tile) * _THREADS // (_window_loads(g, dtype, tile, paired)
                                                                * _held_width(dtype)))
    limit = max(1, min(g.in_per_group, limit))
    return cdiv(g.in_per_group, cdiv(g.in_per_group, limit))


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, tile: Optional[Tile] = None, aligned: bool = True,
                 sm_count: int = ASSUMED.sm_count) -> Plan:
    """The NCHW forward as output tiles; ``tile`` defaults to :func:`heuristic_tile`.  The grid holds the SMs'
    ``blocks`` blocks each once, and each block walks an even share of the patches."""
    tile = tile or heuristic_tile(g, dtype)
    if tile is None or not fits(g, dtype, tile):
        raise ValueError(f"no tiled forward tile {tile} for this layer")
    rows, cols, channels, blocks = tile
    h_out, w_out = g.out_size
    vec = math.gcd(store_vector(g, dtype, aligned), cols)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    tx, ty = patch(g, tile)
    paired = pairs(g, dtype, aligned)
    ic_chunk = _chunk(g, dtype, tile, paired)
    blocks_w, blocks_h = cdiv(w_out, cols * tx), cdiv(h_out, rows * ty)
    items = g.batch * g.groups * cdiv(g.out_per_group, channels) * blocks_h * blocks_w
    constants = layer_constants(g, dtype, index_t)
    constants.update(HAS_BIAS=bool(has_bias), OCB=channels, TILE_R=rows, TILE_V=cols, VEC=vec, TX=tx, TY=ty,
                     IC_CHUNK=ic_chunk, MIN_BLOCKS=blocks, PAIRS=paired)
    grid = (max(1, min(items, sm_count * blocks)), 1, 1)
    spec = KernelSpec.make("conv_transpose2d_forward_tiled.cu", "conv_transpose2d_forward_tiled", constants)
    h, w = g.in_size
    return Plan(spec, grid, (_THREADS, 1, 1), (h, w, h_out, w_out, blocks_w, blocks_h, items), index_t)


class TiledFamily(Family):
    name = "tiled"
    passes = ("forward",)

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        return layout == "nchw" and eligible(g, dtype)

    def leads(self, pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict") -> bool:
        # Measured ahead of the direct kernels on depthwise and grouped layers (NOTES.md); wider groups race them.
        return max(g.in_per_group, g.out_per_group) <= LEADS_UP_TO_CHANNELS

    def races(self, pass_: str, g: Geometry, dtype: str) -> bool:
        return min(g.in_per_group, g.out_per_group) < direct.RACE_BELOW_CHANNELS

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        return [Variant.make(self.name, tile=tile_name(t)) for t in tiles(g, dtype)]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        tile = variant.kwargs.get("tile")
        return OneKernel(plan_forward(g, dtype, has_bias, parse_tile(tile) if tile else None, aligned, sm_count))

    def clear(self) -> None:
        plan_forward.cache_clear()
        tiles.cache_clear()


FAMILY = TiledFamily()
