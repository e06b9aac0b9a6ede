"""The tiled family: an NCHW forward for layers with few channels per group, built to move bytes.

Depthwise, grouped and dilated layers do little arithmetic per byte, so their forward is
bound by memory and by the instructions spent around each multiply-add.  The kernel
(``kernels/conv_transpose2d_forward_tiled.cu``) gives each thread an output tile that
starts on a whole stride period, ``rows`` x ``cols`` pixels of ``channels`` output
channels: every tap and input offset is then a compile-time constant, each input value
is loaded once per tile, and each tile row leaves in 16-byte (or narrower) vector
stores.  A tile is named ``{rows}x{cols}x{channels}b{blocks}`` in the tuner's variants
(``tiled:4x8x1b6``), ``blocks`` being the blocks of 128 threads an SM must hold at once: it caps the
registers, trading the loads each thread keeps in flight for more threads keeping them.
"""
from __future__ import annotations

import functools
import math
import re
from typing import List, Optional, Tuple

from ..core import dtypes
from ..core.device import Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import direct
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, cdiv, index_type, layer_constants, numel
from .sequences import OneKernel, PassPlan

Tile = Tuple[int, int, int, int]   # output rows, columns and channels per thread; blocks per SM

_THREADS = 128
# The block's weights, all of a group's input channels for its output channels, staged at once.
WEIGHT_SMEM = 16 * 1024
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


def fits(g: Geometry, dtype: str, tile: Tile) -> bool:
    rows, cols, channels, blocks = tile
    sh, sw = g.params.stride
    return (rows % sh == 0 and cols % sw == 0 and 1 <= channels <= g.out_per_group and 1 <= blocks <= _MAX_BLOCKS
            and g.in_per_group * g.kernel[0] * g.kernel[1] * channels * _acc_bytes(dtype) <= WEIGHT_SMEM)


def eligible(g: Geometry, dtype: str) -> bool:
    """Kernels of up to :data:`_MAX_TAPS` taps whose weights the direct kernels' limits admit, and at least one
    tile whose weights fit shared memory."""
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
    """Blocks per SM that leave each thread registers for its live accumulators (two a float64 one) and 96 more:
    ptxas keeps the input window, its addresses and the loads in flight there, and spilled below that (sm_90,
    the bench's depthwise and grouped layers)."""
    registers = accumulator_registers(g, dtype, (rows, cols, channels)) + 96
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
    """Output channels first (each input load feeds them all), then rows (input rows shared between them), then
    columns, within :data:`_ACCUMULATORS`, from a tile of one period of columns."""
    sh = g.params.stride[0]
    cols = _column_period(g, dtype)
    if cols > 64:
        return None
    channels = 1
    while channels * 2 <= min(_MAX_CHANNELS, g.out_per_group) \
            and accumulator_registers(g, dtype, (sh, cols, channels * 2)) <= _ACCUMULATORS \
            and fits(g, dtype, (sh, cols, channels * 2, 1)):
        channels *= 2
    rows = sh
    while rows * 2 <= _row_limit(g) and accumulator_registers(g, dtype, (rows * 2, cols, channels)) <= _ACCUMULATORS:
        rows *= 2
    # then columns, where the rows ran out first (a 1-D layer's single row)
    while cols * 2 <= _MAX_COLUMNS and accumulator_registers(g, dtype, (rows, cols * 2, channels)) <= _ACCUMULATORS:
        cols *= 2
    tile = (rows, cols, channels, _blocks(g, dtype, rows, cols, channels))
    return tile if fits(g, dtype, tile) else None


@functools.lru_cache(maxsize=1024)
def tiles(g: Geometry, dtype: str) -> Tuple[Tile, ...]:
    """The tiles worth timing, the heuristic first: it with half or twice the rows, channels or columns (within
    twice the accumulator budget, and the rows within :func:`_row_limit`: taller tiles took NVRTC seconds to
    build and ran no faster on the bench's depthwise layer)."""
    first = heuristic_tile(g, dtype)
    if first is None:
        return ()
    rows, cols, channels, blocks = first
    sh = g.params.stride[0]
    found = [first]
    for r, c, o in ((rows * 2, cols, channels), (rows // 2, cols, channels), (rows, cols, channels * 2),
                    (rows, cols, channels // 2), (rows, cols * 2, channels)):
        if r < sh or o < 1 or accumulator_registers(g, dtype, (r, c, o)) > 2 * _ACCUMULATORS or r > _row_limit(g):
            continue
        tile = (r, c, o, _blocks(g, dtype, r, c, o))
        if tile not in found and fits(g, dtype, tile):
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


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, tile: Optional[Tile] = None, aligned: bool = True) -> Plan:
    """The NCHW forward as output tiles; ``tile`` defaults to :func:`heuristic_tile`."""
    tile = tile or heuristic_tile(g, dtype)
    if tile is None or not fits(g, dtype, tile):
        raise ValueError(f"no tiled forward tile {tile} for this layer")
    rows, cols, channels, blocks = tile
    h_out, w_out = g.out_size
    vec = math.gcd(store_vector(g, dtype, aligned), cols)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    tiles_w = cdiv(w_out, cols)
    count = cdiv(h_out, rows) * tiles_w
    constants = layer_constants(g, dtype, index_t)
    constants.update(HAS_BIAS=bool(has_bias), OCB=channels, TILE_R=rows, TILE_V=cols, VEC=vec, BLOCK=_THREADS,
                     MIN_BLOCKS=blocks)
    oc_blocks = g.groups * cdiv(g.out_per_group, channels)
    grid = (cdiv(count, _THREADS), min(oc_blocks, GRID_YZ_LIMIT), min(g.batch, GRID_YZ_LIMIT))
    spec = KernelSpec.make("conv_transpose2d_forward_tiled.cu", "conv_transpose2d_forward_tiled", constants)
    h, w = g.in_size
    return Plan(spec, grid, (_THREADS, 1, 1), (g.batch, h, w, h_out, w_out, tiles_w, count), index_t)


class TiledFamily(Family):
    name = "tiled"
    passes = ("forward",)

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        return layout == "nchw" and eligible(g, dtype)

    def leads(self, pass_: str, g: Geometry, dtype: str) -> bool:
        # Measured ahead of the direct kernels on depthwise and grouped layers (NOTES.md); wider groups race them.
        return max(g.in_per_group, g.out_per_group) <= LEADS_UP_TO_CHANNELS

    def races(self, pass_: str, g: Geometry, dtype: str) -> bool:
        return min(g.in_per_group, g.out_per_group) < direct.RACE_BELOW_CHANNELS

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        return [Variant.make(self.name, tile=tile_name(t)) for t in tiles(g, dtype)]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        tile = variant.kwargs.get("tile")
        return OneKernel(plan_forward(g, dtype, has_bias, parse_tile(tile) if tile else None, aligned))

    def clear(self) -> None:
        plan_forward.cache_clear()
        tiles.cache_clear()


FAMILY = TiledFamily()
