"""The tensor-core implicit GEMMs (``mma.sync``, sm_80 and newer) for layers with 16 or more channels per group.

The forward is one GEMM per stride phase, grad_input one strided GEMM, grad_weight a
deterministic split-K GEMM per (group, tap).  The weight is first repacked into the B
operand's layout; NCHW sources are copied into channels_last scratch so that tiles load
whole 16-byte channel runs with cp.async.  float32 multiplies in TF32 when allowed and
otherwise in 3xTF32, which keeps float32 accuracy.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..core import dtypes
from ..core.device import ASSUMED, MMA_SYNC, Device
from ..core.geometry import Geometry, phase_taps
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, cdiv, check_layout, index_type, layer_constants, numel
from .reduction import ELEMENTWISE_BLOCK, finishing_reduce, plan_reduce_with_bias, split_k_scratch
from .sequences import PackedGemm, PassPlan, SplitK

# CUPYCONV_TENSOR_CORES=0 keeps every layer on the direct kernels.
TENSOR_CORES_ENV = "CUPYCONV_TENSOR_CORES"


def _itemsize(dtype: str) -> int:
    return dtypes.get(dtype).itemsize


# ------------------------------------------------------------ tensor-core implicit GEMM

# mma.cuh's MMA_* codes; float32 is TF32 when allowed and 3xTF32 (fp32 accuracy) otherwise.
_MMA_KINDS = {"float16": 0, "bfloat16": 1}
MMA_TF32, MMA_3XTF32 = 2, 3


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
    dtypes.check_precision(precision)
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
    check_layout(layout)
    constants = layer_constants(g, dtype, index_t)
    constants.update(MMA_KIND=mma_kind(dtype, precision), CHANNELS_LAST=layout == "nhwc", BM=tile.bm, BN=tile.bn,
                     WARPS_M=tile.warps_m, WARPS_N=tile.warps_n)
    return constants


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


def _bk(dtype: str) -> int:
    """GEMM K elements per shared-memory stage: 64 bytes."""
    return 64 // _itemsize(dtype)


def plan_pack_weight(g: Geometry, dtype: str, mode: int, tile: Tile) -> Plan:
    """Repack the weight into the B-operand layout of a GEMM plan (see pack_weight.cu)."""
    cg_n, cg_k = (g.out_per_group, g.in_per_group) if mode == 0 else (g.in_per_group, g.out_per_group)
    return plan_pack_weight_padded(g, dtype, mode, cdiv(cg_n, tile.bn) * tile.bn, cdiv(cg_k, _bk(dtype)) * _bk(dtype))


def plan_pack_weight_padded(g: Geometry, dtype: str, mode: int, n_pad: int, k_pad: int,
                            tile: Tuple[int, int] = (0, 0), round_tf32: bool = False, split_tf32: bool = False) -> Plan:
    """Repack the weight as [group][tap][n_pad][k_pad], zero-padded, or with ``tile`` = (n, k) as
    contiguous n x k tiles, one per (n tile, k chunk, tap) (see pack_weight.cu), from the weight in either
    layout; ``round_tf32`` rounds float32 values to TF32 on the way, ``split_tf32`` writes each tile as its TF32
    big parts followed by their TF32 residuals (3xTF32), which takes twice the scratch."""
    if (round_tf32 or split_tf32) and dtype != "float32":
        raise ValueError(f"only float32 weights round to TF32, got {dtype}")
    if split_tf32 and (round_tf32 or not tile[0]):
        raise ValueError("a weight split into TF32 parts is packed tile by tile, unrounded")
    taps = g.kernel[0] * g.kernel[1]
    total = g.groups * taps * n_pad * k_pad * (2 if split_tf32 else 1)
    element = _itemsize(dtype)
    region_k, region_n = pack_region(mode, taps, element, tile)
    constants = dict(INDEX_T=index_type(total, numel(g.weight_shape)), MODE=mode, ELEMENT_BYTES=element,
                     TAPS=taps, GROUPS=g.groups, CIN_G=g.in_per_group, COUT_G=g.out_per_group, N_PAD=n_pad,
                     K_PAD=k_pad, BLOCK=ELEMENTWISE_BLOCK, TILE_N=tile[0], TILE_K=tile[1], REGION_K=region_k,
                     REGION_N=region_n, ROUND_TF32=round_tf32, SPLIT_TF32=split_tf32,
                     WEIGHT_CL=g.weight_channels_last)
    spec = KernelSpec.make("pack_weight.cu", "pack_weight", constants)
    blocks = g.groups * cdiv(n_pad, region_n) * cdiv(k_pad, region_k)
    return Plan(spec, (blocks, 1, 1), (ELEMENTWISE_BLOCK, 1, 1), (), constants["INDEX_T"],
                scratch_bytes=total * element)


# Shared memory of one pack_weight region (static, so under 48 KB with room to spare).
_PACK_REGION_BYTES = 40 * 1024


def pack_region(mode: int, taps: int, element: int, tile: Tuple[int, int] = (0, 0)) -> Tuple[int, int]:
    """(k, n) of a block's region in pack_weight.cu, every tap of each: long runs on both sides of the transpose.

    The tiled order's runs are a region's n side of 16-byte k groups, so the forward (whose n, output channels,
    also runs along the weight's memory) takes one k group by a whole n tile, grad_input a whole k chunk by 8 n.
    The row-major order's runs are a region's k side: 128 bytes of k by 8 n.  n halves, then k, down to what
    shared memory holds."""
    vec = 16 // element
    tile_n, tile_k = tile
    if tile_n:
        region_k, region_n = (vec, tile_n) if mode == 0 else (tile_k, min(8, tile_n))
    else:
        region_k, region_n = 128 // element, 8

    def fits(k: int, n: int) -> bool:
        return k * n * (taps | 1) * element <= _PACK_REGION_BYTES

    while not fits(region_k, region_n) and region_n > 1:
        region_n //= 2
    while not fits(region_k, region_n) and region_k > vec and (not tile_n or (region_k // 2) % vec == 0):
        region_k //= 2
    return region_k, region_n


def plan_to_channels_last(batch: int, channels: int, pixels: int, dtype: str, round_tf32: bool = False) -> Plan:
    """Copy an NCHW activation into channels_last scratch (see to_channels_last.cu); ``round_tf32`` rounds
    float32 words to TF32 on the way, for kernels that multiply in TF32 only (3xTF32 needs every bit).

    One plan object per copy however it is asked for: passes share a copy through the plan's identity."""
    return _plan_to_channels_last(batch, channels, pixels, dtype, bool(round_tf32))


@functools.lru_cache(maxsize=1024)
def _plan_to_channels_last(batch: int, channels: int, pixels: int, dtype: str, round_tf32: bool) -> Plan:
    if round_tf32 and dtype != "float32":
        raise ValueError(f"only float32 words are rounded to TF32, got {dtype}")
    total = batch * channels * pixels
    element = _itemsize(dtype)
    index_t = index_type(total)
    constants = dict(INDEX_T=index_t, ELEMENT_BYTES=element, ROUND_TF32=round_tf32)
    spec = KernelSpec.make("to_channels_last.cu", "to_channels_last", constants)
    grid = (cdiv(pixels, 64), cdiv(channels, 64), max(1, min(batch, GRID_YZ_LIMIT)))
    return Plan(spec, grid, (32, 8, 1), (batch, channels, pixels), index_t, scratch_bytes=total * element)


# 16-byte vectors a block of round_tf32.cu moves per step of its loop, and the most blocks a copy launches (the
# loop walks any remainder)
_ROUND_VECTORS_A_BLOCK = 256 * 4
_ROUND_BLOCKS = 1 << 16


@functools.lru_cache(maxsize=1024)
def plan_round_tf32(words: int) -> Plan:
    """Copy ``words`` fp32 words into scratch rounded to TF32, layout unchanged (see round_tf32.cu): a
    channels_last source's counterpart of :func:`plan_to_channels_last`'s rounding. Both pointers 16-byte
    aligned."""
    index_t = index_type(words)
    spec = KernelSpec.make("round_tf32.cu", "round_tf32_copy", dict(INDEX_T=index_t))
    blocks = max(1, min(cdiv(cdiv(words, 4), _ROUND_VECTORS_A_BLOCK), _ROUND_BLOCKS))
    return Plan(spec, (blocks, 1, 1), (256, 1, 1), (words,), index_t, scratch_bytes=words * 4)


def vector_ok(g: Geometry, dtype: str, mode: int) -> bool:
    """Whether channels_last rows of the GEMM's source split into whole 16-byte vectors."""
    cg_k = g.in_per_group if mode == 0 else g.out_per_group
    return (cg_k * _itemsize(dtype)) % 16 == 0


# A split GEMM's K ranges are at least this many K tiles long: shorter ones spend more time filling and
# draining the pipeline and writing partials than multiplying.
_MIN_SPLIT_K_TILES = 8
_MAX_SPLITS = 32
# A GEMM of fewer K tiles runs whole: its blocks finish in a few µs, about what the reduce's launch costs the host
# (on an H200, a 16 -> 32 3x3 grad_input of 18 K tiles split two ways saved 2 µs of GPU time and added 16 of host).
_MIN_SPLIT_GEMM_K_TILES = 32


def gemm_splits(blocks: int, warps: int, k_tiles: int, sm_count: int, weight_bytes: int, out_elems: int) -> int:
    """K ranges for a forward or grad_input GEMM of ``blocks`` blocks of ``warps`` warps and ``k_tiles`` K tiles
    (the phase with the most taps): enough for 16 resident warps an SM, each range at least
    :data:`_MIN_SPLIT_K_TILES` long, none empty, and fp32 partials of ``out_elems`` each no larger in all than the
    weight (so a split layer is one the weight's reads bound, and the partials add at most that traffic again).
    One where the grid fills the SMs already, where K is shorter than :data:`_MIN_SPLIT_GEMM_K_TILES`, or where
    the grid is empty (a batch of none)."""
    if blocks == 0 or out_elems == 0 or k_tiles < _MIN_SPLIT_GEMM_K_TILES:
        return 1
    wanted = cdiv(16 * sm_count, warps * blocks)
    splits = max(1, min(wanted, k_tiles // _MIN_SPLIT_K_TILES, _MAX_SPLITS, weight_bytes // (4 * out_elems)))
    return cdiv(k_tiles, cdiv(k_tiles, splits))


def _heuristic_split(g: Geometry, dtype: str, mode: int, tile: Tile, sm_count: int) -> int:
    """:func:`gemm_splits` for the forward (``mode`` 0) or grad_input GEMM of the layer on ``tile``: K tiles of the
    widest stride phase (every tap for grad_input)."""
    (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.params.stride, g.params.dilation
    taps, phases = (phase_taps(kh, sh, dh) * phase_taps(kw, sw, dw), sh * sw) if mode == 0 else (kh * kw, 1)
    cg_k, cg_n = (g.in_per_group, g.out_per_group) if mode == 0 else (g.out_per_group, g.in_per_group)
    blocks = cdiv(_gemm_rows(mode, g), tile.bm) * g.groups * cdiv(cg_n, tile.bn) * phases
    return gemm_splits(blocks, tile.warps_m * tile.warps_n, taps * cdiv(cg_k, _bk(dtype)), sm_count,
                       numel(g.weight_shape) * _itemsize(dtype), numel(g.output_shape if mode == 0 else g.input_shape))


def _plan_gemm(g: Geometry, dtype: str, mode: int, has_bias: bool, layout: str, precision: str,
               tile: Optional[Tile], aligned: bool, stages: Optional[int], split: Optional[int],
               sm_count: int) -> PackedGemm:
    sh, sw = g.params.stride
    m = _gemm_rows(mode, g)
    if mode == 0:
        cg_n, phases = g.out_per_group, sh * sw
        sizes = (g.batch,) + g.in_size + g.out_size
        src_channels, src_pixels = g.in_channels, g.in_size[0] * g.in_size[1]
    else:
        cg_n, phases = g.in_per_group, 1
        sizes = (g.batch,) + g.out_size + g.in_size
        src_channels, src_pixels = g.out_channels, g.out_size[0] * g.out_size[1]
    tile = tile or _default_tile(gemm_tile(m, cg_n), dtype, precision)
    out_elems = numel(g.output_shape if mode == 0 else g.input_shape)
    if split is None:
        split = _heuristic_split(g, dtype, mode, tile, sm_count)
    elif not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"split must be a positive int, got {split!r}")
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape),
                         split * out_elems if split > 1 else 0)
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
    if phases * split > GRID_YZ_LIMIT:
        raise ValueError(f"{phases} stride phases x {split} K ranges pass the grid's z limit of {GRID_YZ_LIMIT}")
    in_place = aligned and weight_in_place(g, dtype)
    constants.update(MODE=mode, HAS_BIAS=bool(has_bias) and mode == 0, A_VEC=a_vec, STAGES=stages, A_L1=A_CACHE_L1,
                     SRC_CL=layout == "nhwc" or transpose, DST_CL=layout == "nhwc", SPLIT_K=split,
                     WEIGHT_DIRECT=in_place)
    spec = KernelSpec.make("conv_transpose2d_igemm.cu", "conv_transpose2d_igemm", constants)
    grid = (cdiv(m, tile.bm), g.groups * cdiv(cg_n, tile.bn), phases * split)
    gemm = Plan(spec, grid, (32 * tile.warps_m * tile.warps_n, 1, 1), sizes, index_t,
                scratch_bytes=split_k_scratch(split, out_elems, 4), smem_bytes=stages * stage_bytes(tile))
    reduce = None
    if split > 1:
        channels = g.out_channels if mode == 0 else g.in_channels
        plane = numel(g.out_size if mode == 0 else g.in_size)
        reduce = plan_reduce_with_bias(dtype, out_elems, split, channels, 1 if layout == "nhwc" else plane, index_t)
    # A TF32 GEMM rounds its fragments, so a copy already rounded (shared with the wgmma kernels) gives it the
    # same products.
    to_cl = plan_to_channels_last(g.batch, src_channels, src_pixels, dtype,
                                  round_tf32=mma_kind(dtype, precision) == MMA_TF32) if transpose else None
    return PackedGemm(None if in_place else plan_pack_weight(g, dtype, mode, tile), gemm, to_cl, reduce)


def weight_in_place(g: Geometry, dtype: str) -> bool:
    """Whether the forward and grad_input GEMMs read the weight in place rather than a packed copy: a
    channels_last weight in fp16 or bf16 (its memory (C_in, kH, kW, C_out/groups) holds each input channel's and
    tap's output channels as one run: grad_input's K, as the pack would lay it out, and the forward's N, a [K][N]
    B tile read by ldmatrix.trans) whose output channels come in whole 16-byte runs.  The weight pointer's
    alignment is the caller's to check (``aligned``)."""
    return g.weight_channels_last and _itemsize(dtype) == 2 and g.out_per_group % 8 == 0


@functools.lru_cache(maxsize=1024)
def plan_forward_gemm(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw", precision: str = "strict",
                      tile: Optional[Tile] = None, aligned: bool = True, stages: Optional[int] = None,
                      split: Optional[int] = None, sm_count: int = 132) -> PackedGemm:
    """Forward as one implicit GEMM per stride phase (grid z).

    ``aligned``: the activation pointers (and a channels_last weight's, which 16-bit GEMMs read in place) are
    16-byte aligned (channels_last vector loads).
    ``stages``: cp.async pipeline depth (one of :data:`STAGE_CHOICES`; default
    :data:`DEFAULT_STAGES`); the element-gathering fallback always double-buffers.
    ``split``: K ranges, each block taking one and a fixed-order reduce adding their partials and the bias;
    by default :func:`gemm_splits` for ``sm_count`` SMs (one wherever the grid fills them).
    """
    return _plan_gemm(g, dtype, 0, has_bias, layout, precision, tile, aligned, stages, split, sm_count)


@functools.lru_cache(maxsize=1024)
def plan_grad_input_gemm(g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict",
                         tile: Optional[Tile] = None, aligned: bool = True, stages: Optional[int] = None,
                         split: Optional[int] = None, sm_count: int = 132) -> PackedGemm:
    """grad_input (a strided conv2d of grad_output) as one implicit GEMM; see :func:`plan_forward_gemm`."""
    return _plan_gemm(g, dtype, 1, False, layout, precision, tile, aligned, stages, split, sm_count)


def grad_weight_vectors(g: Geometry, dtype: str, layout: str, aligned: bool = True) -> Tuple[bool, bool]:
    """(vector tiles, NCHW sources to copy into channels_last first) for the grad_weight GEMM.

    Vector tiles copy 16-byte channel runs of 16-bit channels_last data with cp.async.
    """
    runs = _itemsize(dtype) == 2 and g.in_per_group % 8 == 0 and g.out_per_group % 8 == 0
    transpose = runs and layout == "nchw"
    return transpose or (runs and layout == "nhwc" and aligned), transpose


@functools.lru_cache(maxsize=1024)
def plan_grad_weight_sources(g: Geometry, dtype: str) -> Tuple[Plan, Plan]:
    """The channels_last copies of x and grad_output that the vector grad_weight GEMM reads."""
    return (plan_to_channels_last(g.batch, g.in_channels, g.in_size[0] * g.in_size[1], dtype),
            plan_to_channels_last(g.batch, g.out_channels, g.out_size[0] * g.out_size[1], dtype))


@functools.lru_cache(maxsize=1024)
def plan_grad_weight_gemm(g: Geometry, dtype: str, sm_count: int, layout: str = "nchw", precision: str = "strict",
                          tile: Optional[Tile] = None, aligned: bool = True,
                          stages: Optional[int] = None) -> Tuple[Plan, Optional[Plan]]:
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
    k_tiles = cdiv(g.batch * h * w, _bk(dtype))
    base_blocks = cdiv(g.in_per_group, tile.bm) * cdiv(g.out_per_group, tile.bn) * g.groups * taps
    # Enough K ranges for 16 resident warps per SM, each range at least eight K tiles long.
    warps = tile.warps_m * tile.warps_n
    splits = max(1, min(cdiv(16 * sm_count, warps * base_blocks), cdiv(k_tiles, 8), 512))
    per_split = cdiv(k_tiles, splits)
    splits = cdiv(k_tiles, per_split)
    weight_elems = numel(g.weight_shape)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), splits * weight_elems)
    constants = _gemm_constants(g, dtype, layout, precision, tile, index_t)
    constants.update(CHANNELS_LAST=layout == "nhwc" or transpose, VEC=vec, STAGES=stages, A_L1=A_CACHE_L1,
                     SINGLE_CHUNK=splits == 1)
    spec = KernelSpec.make("conv_transpose2d_grad_weight_igemm.cu", "conv_transpose2d_grad_weight_igemm", constants)
    # Taps fastest: blocks reading the same K range of x and grad_out run together.
    grid = (g.groups * taps, cdiv(g.in_per_group, tile.bm) * cdiv(g.out_per_group, tile.bn), splits)
    bk = _bk(dtype)
    smem = stages * (bk * (tile.bm + tile.bn) * 2 + 2 * bk * 16) if vec else 2 * stage_bytes(tile)
    partial = Plan(spec, grid, (32 * tile.warps_m * tile.warps_n, 1, 1),
                   (g.batch, h, w) + g.out_size + (per_split,), index_t,
                   scratch_bytes=split_k_scratch(splits, weight_elems, 4), smem_bytes=smem)
    return partial, finishing_reduce(dtype, weight_elems, splits, index_t)


def gemm_fits(g: Geometry, dtype: str) -> bool:
    """Whether the tensor-core kernels can run this layer at all (grid and dtype limits)."""
    if not dtypes.get(dtype).tensor_cores:
        return False
    taps = g.kernel[0] * g.kernel[1]
    return g.groups * taps < 2 ** 31 and g.groups * cdiv(max(g.in_per_group, g.out_per_group), 32) \
        <= GRID_YZ_LIMIT and taps <= 256



@functools.lru_cache(maxsize=1024)
def gemm_shape(g: Geometry, dtype: str) -> bool:
    """16 or more channels a group on both sides, and a layer the GEMM kernels' offsets and grids hold."""
    return min(g.in_per_group, g.out_per_group) >= 16 and gemm_fits(g, dtype)


# Every call of a layer reads the switch.  os.environ.get runs a few Python frames for it (about 2 µs);
# the mapping os.environ keeps its values in (and updates with it) answers in one lookup.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_TENSOR_CORES_KEY = os.environ.encodekey(TENSOR_CORES_ENV) if hasattr(os.environ, "encodekey") else None


def enabled() -> bool:
    """Whether ``CUPYCONV_TENSOR_CORES`` leaves the tensor-core kernels on (it does unless it is 0)."""
    if _ENVIRON_DATA is not None and _TENSOR_CORES_KEY is not None:
        raw = _ENVIRON_DATA.get(_TENSOR_CORES_KEY)
        if raw is None:
            return True
        return os.environ.decodevalue(raw).strip() != "0"
    return os.environ.get(TENSOR_CORES_ENV, "1").strip() != "0"


# ------------------------------------------------------------------------ the variants

def _sides(n: int) -> Tuple[int, ...]:
    """Tile sides worth trying along a GEMM dimension of ``n``: the covering side and half of it."""
    side = 32 if n <= 32 else 64 if n <= 64 else 128
    return (side, side // 2) if side > 32 else (side,)


def _gemm_rows(mode: int, g: Geometry) -> int:
    """M of the forward's GEMM per stride phase (``mode`` 0), or of grad_input's."""
    if mode == 0:
        sh, sw = g.params.stride
        return g.batch * -(-g.out_size[0] // sh) * -(-g.out_size[1] // sw)
    return g.batch * g.in_size[0] * g.in_size[1]


# GEMM rows from which 256-row tiles are tried: four such tiles per SM of an H100.
_TALL_TILE_ROWS = 256 * 132 * 4


def options(pass_: str, g: Geometry, dtype: str, precision: str) -> List[Dict[str, object]]:
    """Planner options worth timing for a GEMM pass, the planner's own defaults first.

    Block tiles (by name) whose N side fits the GEMM's N (no 128-wide tiles for 16
    channels) and whose M side fits its M; tiles the 3xTF32 rule of :func:`_default_tile`
    would shrink are left out.  The other pipeline depths are tried with the default tile.
    """
    if pass_ == "grad_weight":
        bms, bns = _sides(g.in_per_group), _sides(g.out_per_group)
    else:
        rows = _gemm_rows(0 if pass_ == "forward" else 1, g)
        # 256-row tiles halve the weight traffic per output row; worth it only where the
        # M grid still fills the GPU many times over.
        bms = (64, 128, 256) if rows >= _TALL_TILE_ROWS else (64, 128) if rows > 64 else (32, 64)
        bns = _sides(g.out_per_group if pass_ == "forward" else g.in_per_group)
    found: List[Dict[str, object]] = [{}]
    if pass_ != "grad_weight" and heuristic_splits(pass_, g, dtype, precision) > 1:
        found.append({"split": 1})   # the heuristic splits K: race it against one range
    for bm in bms:
        for bn in bns:
            tile = TILES.get(f"{bm}x{bn}")
            if tile is not None and _default_tile(tile, dtype, precision) == tile:
                found.append({"tile": tile.name})
    found += [{"stages": s} for s in STAGE_CHOICES if s != DEFAULT_STAGES]
    return found


def heuristic_splits(pass_: str, g: Geometry, dtype: str, precision: str) -> int:
    """The K ranges of a forward or grad_input GEMM's heuristic plan on :data:`ASSUMED`'s SMs."""
    mode = 0 if pass_ == "forward" else 1
    tile = _default_tile(gemm_tile(_gemm_rows(mode, g), g.out_per_group if mode == 0 else g.in_per_group), dtype,
                         precision)
    return _heuristic_split(g, dtype, mode, tile, ASSUMED.sm_count)


class GemmFamily(Family):
    name = "gemm"
    passes = ("forward", "grad_input", "grad_weight")

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """sm_80 or newer, and a GEMM of at least 16 channels per group on both sides: thinner
        layers (grouped, depthwise) waste most of each mma on padding."""
        return device.tensor_cores >= MMA_SYNC and enabled() and gemm_shape(g, dtype)

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        return [Variant.make(self.name, **opts) for opts in options(pass_, g, dtype, precision)]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        kwargs = dict(variant.kwargs)
        if "tile" in kwargs:
            kwargs["tile"] = TILES[kwargs["tile"]]
        if pass_ == "forward":
            return plan_forward_gemm(g, dtype, has_bias, layout, precision, aligned=aligned, sm_count=sm_count,
                                     **kwargs)
        if pass_ == "grad_input":
            return plan_grad_input_gemm(g, dtype, layout, precision, aligned=aligned, sm_count=sm_count, **kwargs)
        partial, reduce = plan_grad_weight_gemm(g, dtype, sm_count, layout, precision, aligned=aligned, **kwargs)
        sources = plan_grad_weight_sources(g, dtype) if grad_weight_vectors(g, dtype, layout, aligned)[1] else None
        return SplitK(partial, reduce, sources)

    def clear(self) -> None:
        for planner in (plan_forward_gemm, plan_grad_input_gemm, plan_grad_weight_gemm, _plan_to_channels_last,
                        plan_grad_weight_sources, gemm_shape):
            planner.cache_clear()


FAMILY = GemmFamily()
