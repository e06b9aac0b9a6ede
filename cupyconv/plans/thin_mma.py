"""The thin-output family: the NCHW float32 forward of layers with few output channels on the tensor cores.

A generator's RGB output layer (128 input channels up to 3, 4 x 4 at stride 2) runs its float32 forward on the
direct kernels, TAPS x C_out CUDA-core multiply-adds for each input value; the GEMM families need 16 output
channels and the wgmma kernel's thin tiles lost to the direct kernels in TF32.  Here a block stages the input
window of an output tile and runs one mma.sync GEMM over it, N = every (tap, output channel) pair, then sums each
output's terms from shared memory (``kernels/conv_transpose2d_forward_thin_mma.cu``).  Each input value leaves
shared memory once a k-step for all its taps, where a GEMM a stride phase read it once a tap and lost on shared
memory bandwidth.  TF32, or 3xTF32 for strict float32 (smaller tiles: an fp32 total beside each accumulator).
"""
from __future__ import annotations

import functools
from typing import List, Optional

from ..core.device import MMA_SYNC, Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import gemm
from .family import Family
from .launch import Plan, cdiv, index_type, layer_constants, numel
from .sequences import OneKernel, PassPlan

THREADS = 128
PHASE_COLUMNS = 16          # input columns a tile's outputs take from, before the halo
CHANNEL_CHUNK = 16          # input channels a stage: 64 bytes of float32 K
TILE_ROWS = (8, 4, 2, 1)    # input rows likewise, the most that fit the accumulators first
MAX_OUT_CHANNELS = 8
MAX_STRIDE = 4
# m16 x n8 tiles a warp accumulates (four registers each); 3xTF32 keeps an fp32 total beside each
MAX_ACCUMULATOR_TILES = {"tf32": 24, "strict": 12}
MMA_KINDS = {"tf32": 2, "strict": 3}   # kernels/include/mma.cuh: MMA_TF32, MMA_3XTF32
STAGES = 2                  # cp.async buffers of channel chunks: one in flight while the MMAs read one
SMEM_LIMIT = 99 * 1024      # the least a block may opt in to on the sm_80+ GPUs the family runs on
WARPS = THREADS // 32
GRID_Y_LIMIT = 65535


def _reach(k: int, s: int, p: int, d: int) -> tuple:
    """(lowest, highest) input row a tile's phase-row 0 reads, relative to the tile's origin: phase 0's last tap to
    the last phase's tap 0 (floor division, as the kernel's HR0 and HR_TOP)."""
    return (p - (k - 1) * d) // s, (s - 1 + p) // s


def window(g: Geometry, rows: int) -> tuple:
    """The input window a tile of ``rows`` x :data:`PHASE_COLUMNS` input positions reads: (rows, columns) of
    input pixels, its halo included."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.params.stride, g.params.padding, g.params.dilation
    low_h, top_h = _reach(kh, sh, ph, dh)
    low_w, top_w = _reach(kw, sw, pw, dw)
    return rows + top_h - low_h, PHASE_COLUMNS + top_w - low_w


def _banked(words: int) -> int:
    """The fewest words, at least ``words``, that are 8 mod 32: a fragment's four k rows on distinct banks."""
    return (words + 23) // 32 * 32 + 8


def mma_tiles(g: Geometry, rows: int) -> tuple:
    """(m16 tiles a warp, n8 tiles a warp): the window's pixels over the warps, and every (tap, output
    channel) pair in each warp."""
    wr, wc = window(g, rows)
    pairs = g.kernel[0] * g.kernel[1] * g.out_channels
    return cdiv(cdiv(wr * wc, 16), WARPS), cdiv(pairs, 8)


def tile_rows(g: Geometry, precision: str = "tf32") -> Optional[int]:
    """The most input rows a tile (of :data:`TILE_ROWS`) whose accumulators stay within ``precision``'s
    :data:`MAX_ACCUMULATOR_TILES` a warp; None where none does."""
    for rows in TILE_ROWS:
        mi, ni = mma_tiles(g, rows)
        if mi * ni <= MAX_ACCUMULATOR_TILES[precision]:
            return rows
    return None


def window_words(g: Geometry, rows: int, vec: int) -> int:
    """Words a channel's window takes in a stage: its rows widened to whole ``vec``-word runs (the kernel's
    CHANNEL_WORDS)."""
    wr, wc = window(g, rows)
    low, _ = _reach(g.kernel[1], g.params.stride[1], g.params.padding[1], g.params.dilation[1])
    run_low, run_high = low // vec * vec, -(-(low + wc) // vec) * vec
    return _banked(wr * (run_high - run_low))


def smem_bytes(g: Geometry, rows: int, vec: int = 1) -> int:
    """:data:`STAGES` buffers of the window (:func:`window_words` a channel) and the chunk's weights (a channel's
    pairs), or the GEMM's result that replaces them ([pair][window pixel] rows of 4 words more than the window's
    whole m16 tiles)."""
    mi, ni = mma_tiles(g, rows)
    stage = CHANNEL_CHUNK * (window_words(g, rows, vec) + _banked(ni * 8)) * 4
    return max(STAGES * stage, ni * 8 * (WARPS * mi * 16 + 4) * 4)


def vector_words(g: Geometry, aligned: bool) -> int:
    """4 where x's rows are whole 16-byte runs from a 16-byte aligned pointer (window rows land in 16-byte
    copies), else 1."""
    return 4 if aligned and g.in_size[1] % 4 == 0 else 1


def eligible(g: Geometry, dtype: str, layout: str, precision: str) -> bool:
    """float32 (TF32 or strict), NCHW, one group of at most :data:`MAX_OUT_CHANNELS` output channels and 16 or
    more input channels (a chunk's K), strides up to :data:`MAX_STRIDE`, a tile whose accumulators fit
    (:func:`tile_rows`) within :data:`SMEM_LIMIT`; a grid row of blocks an image (at most :data:`GRID_Y_LIMIT`
    images)."""
    sh, sw = g.params.stride
    if not (dtype == "float32" and precision in MMA_KINDS and layout == "nchw" and g.groups == 1
            and g.out_channels <= MAX_OUT_CHANNELS and g.in_channels >= CHANNEL_CHUNK and g.batch <= GRID_Y_LIMIT
            and max(sh, sw) <= MAX_STRIDE):
        return False
    rows = tile_rows(g, precision)
    return rows is not None and smem_bytes(g, rows, 4) <= SMEM_LIMIT and smem_bytes(g, rows, 1) <= SMEM_LIMIT


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, precision: str = "tf32", aligned: bool = True) -> Plan:
    """A block a (tile, image): tiles of stride x tile_rows by stride x 16 output pixels."""
    if not eligible(g, dtype, "nchw", precision):
        raise ValueError("the thin-output forward runs NCHW float32 layers (TF32 or strict) of one group with at "
                         f"most {MAX_OUT_CHANNELS} output channels, {CHANNEL_CHUNK} or more input channels, "
                         f"strides up to {MAX_STRIDE}, and few enough (tap, output channel) pairs for a warp's "
                         "accumulators")
    rows = tile_rows(g, precision)
    mi, ni = mma_tiles(g, rows)
    sh, sw = g.params.stride
    h_out, w_out = g.out_size
    tiles_h, tiles_w = cdiv(h_out, sh * rows), cdiv(w_out, sw * PHASE_COLUMNS)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    vec = vector_words(g, aligned)
    constants.update(HAS_BIAS=bool(has_bias), MMA_KIND=MMA_KINDS[precision], PR=rows, MI=mi, NI=ni, VEC=vec,
                     STAGES=STAGES)
    spec = KernelSpec.make("conv_transpose2d_forward_thin_mma.cu", "conv_transpose2d_forward_thin_mma", constants)
    h, w = g.in_size
    return Plan(spec, (tiles_h * tiles_w, g.batch, 1), (THREADS, 1, 1), (h, w, h_out, w_out, tiles_w), index_t,
                smem_bytes=smem_bytes(g, rows, vec))


class ThinMmaFamily(Family):
    name = "thin_mma"
    passes = ("forward",)

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """sm_80 or newer, the tensor cores switched on, and :func:`eligible`."""
        return device.tensor_cores >= MMA_SYNC and gemm.enabled() and _eligible(g, dtype, layout, precision)

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        return [Variant(self.name)]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        return OneKernel(plan_forward(g, dtype, has_bias, precision, aligned))

    def clear(self) -> None:
        for planner in (plan_forward, _eligible):
            planner.cache_clear()


@functools.lru_cache(maxsize=1024)
def _eligible(g: Geometry, dtype: str, layout: str, precision: str) -> bool:
    return eligible(g, dtype, layout, precision)


FAMILY = ThinMmaFamily()
