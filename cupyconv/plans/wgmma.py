"""Hopper tensor-core kernels (``wgmma``, sm_90a) that read each source pixel once per tile.

The forward (per stride phase) and grad_input (a strided conv2d of grad_output) run on a
halo tile: a block copies the source pixels its destination patch needs into shared
memory once per channel chunk, and every tap's MMA reads that one tile from a shifted
origin (``kernels/conv_transpose2d_wgmma.cu``).  grad_input's halo is stored split by
stride phase, so each tap still reads contiguous rows.  The weight is repacked per tap as
for the ``mma.sync`` GEMMs, or in fp16 and bf16 a channels_last weight is read in place
(:func:`weight_in_place`), and NCHW sources are copied into channels_last scratch first,
as there.  grad_weight is the ``mma.sync`` family's split-K GEMM per tap with wgmma for
its math (``kernels/conv_transpose2d_grad_weight_wgmma.cu``): pixel tiles land channel
group by channel group, which makes both operands MN-major.  TF32 takes K-major operands only, so float32's
grad_weight (``kernels/conv_transpose2d_grad_weight_wgmma_tf32.cu``) runs K over (pixel, four images), on
copies of x and grad_output packed so (``kernels/to_image_quads.cu``).  Built for exactly sm_90
(``sm_90a`` code runs on no other architecture); other GPUs keep the ``gemm`` family.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..core import dtypes
from ..core.device import ASSUMED, WGMMA, Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import gemm, tensor_map
from .family import Family
from .launch import GRID_YZ_LIMIT, Plan, aligned_size, cdiv, index_type, layer_constants, numel
from .reduction import plan_reduce, plan_reduce_with_bias, plan_tap_major_reduce, split_k_scratch
from .sequences import PackedGemm, PackedSourcesSplitK, PassPlan, SplitK
from .tensor_map import TensorMap

TARGET = "sm_90a"
# wgmma kinds, as mma.cuh numbers them.  float32 runs as TF32 where the precision allows it (grad_weight on its
# own kernel, whose operands are K-major as TF32 needs), and strict float32 as 3xTF32 on the same kernels.
_KINDS = {"float16": 0, "bfloat16": 1}
_TF32, _3XTF32 = gemm.MMA_TF32, gemm.MMA_3XTF32
# A 3xTF32 step's sum moves into a second set of accumulators (the fp32 total), so its tiles hold at most this
# many a thread in each set.
SPLIT_ACCUMULATORS = 64


def mma_kind(dtype: str, precision: str = "strict") -> Optional[int]:
    """The halo-tile kernel's MMA kind for ``dtype`` at ``precision`` (the ``mma.sync`` GEMMs' numbering), or None
    where it has none (float64)."""
    if dtype not in _KINDS and dtype != "float32":
        return None
    return gemm.mma_kind(dtype, precision)


def operand_parts(dtype: str, precision: str = "tf32") -> int:
    """Parts each halo and weight buffer holds: two for 3xTF32 (TF32 big parts and residuals), else one.  The
    tile helpers below take float32 at TF32 precision unless told otherwise, as they did before 3xTF32 ran here."""
    return 2 if dtype == "float32" and precision == "strict" else 1


# Dynamic shared memory a block may use on an H100 (227 KB), less the kernel's static tap table.
SMEM_LIMIT = 227 * 1024 - 4096
B_STAGES = 4   # weight buffers by default
STAGE_CHOICES = (2, 3, 4, 6)


@dataclass(frozen=True)
class HaloTile:
    """A block's destination patch: ``images`` images x ``tile_h`` x ``tile_w`` pixels of the destination
    grid (one stride phase's, for the forward), and ``bn`` destination channels.

    The patch is split among the warpgroups in 64-pixel MMA blocks, 8 x 8 pixels each, or 64 pixels of the
    row where the patch is one row high (:attr:`one_row`: 1-D layers and grids under eight rows, which 8-row
    patches would mostly leave empty); each thread holds :attr:`accumulators` fp32 values.
    """

    images: int
    tile_h: int
    tile_w: int
    bn: int

    @property
    def name(self) -> str:
        return (f"{self.images}i" if self.images > 1 else "") + f"{self.tile_h}x{self.tile_w}x{self.bn}"

    @property
    def pixels(self) -> int:
        return self.images * self.tile_h * self.tile_w

    @property
    def warpgroups(self) -> int:
        return 2 if self.pixels >= 128 else 1

    @property
    def accumulators(self) -> int:
        return self.pixels // (64 * self.warpgroups) * self.bn // 2

    @property
    def one_row(self) -> bool:
        return self.tile_h == 1


# At most 128 accumulators a thread; a single warpgroup's 64 x 256 leave it too few
# registers besides (it spilled), so there is no 8x8x256.  N of 8 and 16 serve thin
# destinations (an RGB output layer), whose MMAs would otherwise be mostly padding.
TILES = {t.name: t for t in (HaloTile(1, 16, 16, 128), HaloTile(1, 32, 8, 128), HaloTile(1, 8, 16, 256),
                             HaloTile(1, 16, 8, 256), HaloTile(1, 16, 16, 64), HaloTile(1, 8, 16, 128),
                             HaloTile(1, 16, 8, 128), HaloTile(1, 8, 8, 128), HaloTile(1, 8, 8, 64),
                             HaloTile(4, 8, 8, 128), HaloTile(2, 8, 8, 256), HaloTile(4, 8, 8, 64),
                             HaloTile(2, 8, 8, 128), HaloTile(1, 32, 16, 64), HaloTile(1, 16, 16, 32),
                             HaloTile(1, 32, 16, 32), HaloTile(4, 8, 8, 32), HaloTile(1, 32, 16, 16),
                             HaloTile(1, 16, 16, 16), HaloTile(4, 8, 8, 16), HaloTile(1, 32, 16, 8),
                             HaloTile(1, 16, 16, 8), HaloTile(4, 8, 8, 8),
                             # one-row patches: the 2-D tiles' pixel counts along a row, and narrower ones
                             # for shorter rows
                             *(HaloTile(1, 1, w, bn) for bn, widths in ((256, (128,)), (128, (256, 128, 64)),
                                                                        (64, (512, 256, 128, 64)),
                                                                        (32, (512, 256, 128, 64)),
                                                                        (16, (512, 128)), (8, (512, 128)))
                               for w in widths))}


def rows_few(g: Geometry, pass_: str = "forward") -> bool:
    """Whether the destination grid is under eight rows high and 64 or more columns wide (a 1-D layer's is one
    row): one-row patches fill their MMA rows there, where an 8-row patch leaves most of its rows past the grid."""
    grid_h, grid_w = dst_grid(g, pass_)
    return grid_h < 8 and grid_w >= 64


def _row_tile(g: Geometry, pass_: str, dtype: str, bn: int, pixels: int) -> Optional[HaloTile]:
    """The widest one-row tile of N side ``bn`` and at most ``pixels`` pixels, no wider than the grid's row,
    whose halo fits; None where none does."""
    grid_w = dst_grid(g, pass_)[1]
    rows = [t for t in TILES.values() if t.one_row and t.bn == bn and t.tile_w <= min(pixels, 8 * cdiv(grid_w, 8))
            and _fits(g, dtype, t, pass_)]
    return max(rows, key=lambda t: t.tile_w, default=None)


def narrowest_bn(channels: int) -> int:
    """The N tile the heuristic gives a destination of ``channels`` channels a group, at most 32: 8 or 16 for
    thinner ones than 16 (before those tiles, 16 channels took 32-wide tiles, and still do)."""
    return 8 if channels <= 8 else 16 if channels < 16 else 32


def phase_offsets(g: Geometry) -> List[Tuple[List[int], List[int]]]:
    """For each stride phase (rh, rw), row-major: the input-row and input-column offsets of its taps."""
    (kh, kw), (sh, sw) = g.kernel, g.params.stride
    (ph, pw), (dh, dw) = g.params.padding, g.params.dilation
    found = []
    for rh in range(sh):
        rows = [(rh + ph - k * dh) // sh for k in range(kh) if (rh + ph - k * dh) % sh == 0]
        for rw in range(sw):
            cols = [(rw + pw - k * dw) // sw for k in range(kw) if (rw + pw - k * dw) % sw == 0]
            found.append((rows, cols))
    return found


def _mode(pass_: str) -> int:
    if pass_ not in ("forward", "grad_input"):
        raise ValueError(f"the wgmma kernels run forward and grad_input, not {pass_!r}")
    return 0 if pass_ == "forward" else 1


def _channels(g: Geometry, pass_: str) -> Tuple[int, int]:
    """(source, destination) channels per group: the GEMM's K per tap and its N."""
    return (g.in_per_group, g.out_per_group) if _mode(pass_) == 0 else (g.out_per_group, g.in_per_group)


def dst_grid(g: Geometry, pass_: str = "forward") -> Tuple[int, int]:
    """The destination grid a tile covers part of: the first stride phase's for the forward, grad_input's own."""
    if _mode(pass_) == 1:
        return g.in_size
    sh, sw = g.params.stride
    return cdiv(g.out_size[0], sh), cdiv(g.out_size[1], sw)


def phase_planes(g: Geometry, pass_: str = "forward") -> int:
    """Stride-phase planes the halo is split into: one for the forward, SH x SW for grad_input."""
    return 1 if _mode(pass_) == 0 else g.params.stride[0] * g.params.stride[1]


def halo_extent(g: Geometry, tile: HaloTile, pass_: str = "forward") -> Tuple[int, int]:
    """The halo (rows, columns) of one phase plane of one image, for the widest phase."""
    if _mode(pass_) == 1:
        (kh, kw), (sh, sw), (dh, dw) = g.kernel, g.params.stride, g.params.dilation
        return tile.tile_h + (kh - 1) * dh // sh, tile.tile_w + (kw - 1) * dw // sw
    spans = [(max(r) - min(r), max(c) - min(c)) for r, c in phase_offsets(g) if r and c]
    if not spans:
        return tile.tile_h, tile.tile_w
    return tile.tile_h + max(s[0] for s in spans), tile.tile_w + max(s[1] for s in spans)


def fewest_taps(g: Geometry, pass_: str = "forward") -> int:
    """Taps of the phase with the fewest (phases with none store the bias alone)."""
    if _mode(pass_) == 1:
        return g.kernel[0] * g.kernel[1]
    counts = [len(r) * len(c) for r, c in phase_offsets(g)]
    return min((c for c in counts if c), default=1)


def _itemsize(dtype: str) -> int:
    return dtypes.get(dtype).itemsize


def chunk_channels(g: Geometry, dtype: str, pass_: str = "forward") -> int:
    """Source channels per chunk: 128 bytes of each pixel, or all of them when fewer."""
    step = 32 // _itemsize(dtype)
    return min(128 // _itemsize(dtype), cdiv(_channels(g, pass_)[0], step) * step)


def halo_stages(g: Geometry, b_stages: int, pass_: str = "forward") -> int:
    """Halo buffers: two, so the next chunk's (or tile's) halo lands while this one is read, and more
    where chunks have few taps, so the halos keep up with the weight buffers."""
    return max(2, min(b_stages, cdiv(b_stages, fewest_taps(g, pass_)) + 1))


def smem_bytes(g: Geometry, dtype: str, tile: HaloTile, ck: int, b_stages: int, pass_: str = "forward",
               in_place: bool = False, parts: int = 1, tma: bool = False) -> int:
    """Dynamic shared memory of a plan: its halo and weight buffers.  A chunk of 128 bytes a pixel is a 128-byte
    row per halo pixel (the 128-byte swizzle); a narrower one, a plane per 16-byte channel group, each an odd
    number of pixels.  A weight read ``in_place`` (:func:`weight_in_place`) has its buffers start on a whole
    1024-byte swizzle period.  ``parts``: :func:`operand_parts`, each buffer that many times over.  Halos the copy
    engine lands (``tma``) start each phase plane on a whole swizzle period, and the ring one period more to
    align it."""
    halo_h, halo_w = halo_extent(g, tile, pass_)
    groups = ck * _itemsize(dtype) // 16
    planes = tile.images * phase_planes(g, pass_)
    pixels = planes * halo_h * halo_w
    if tma:
        halo = planes * cdiv(halo_h * halo_w * 128, 1024) * 1024
    else:
        halo = pixels * 128 if groups == 8 else groups * (pixels | 1) * 16
    halos = halo_stages(g, b_stages, pass_) * halo * parts
    if in_place:
        halos = cdiv(halos, 1024) * 1024
    return halos + b_stages * groups * tile.bn * 16 * parts + (1024 if tma else 0)


def halo_tensor_map(g: Geometry, dtype: str, tile: HaloTile, ck: int, pass_: str) -> Optional[TensorMap]:
    """The copy engine's descriptor of the halo-tile kernel's channels_last source (x for the forward, grad_output
    for grad_input), in boxes of a chunk's ``ck`` channels (128 bytes) x one phase plane of the halo, walked at
    the stride; None where the engine cannot take it (a plane wider than 256 source pixels, a stride past 8) or
    where a chunk would run into the next group's channels, which must read as zeros."""
    groups_whole = g.groups == 1 or _channels(g, pass_)[0] % ck == 0
    if ck * _itemsize(dtype) != 128 or not groups_whole:
        return None
    halo_h, halo_w = halo_extent(g, tile, pass_)
    split_h, split_w = g.params.stride if _mode(pass_) == 1 else (1, 1)
    box, element_strides = (ck, halo_w * split_w, halo_h * split_h, 1), (1, split_w, split_h, 1)
    if not tensor_map.fits(box, element_strides):
        return None
    source = g.input_shape if _mode(pass_) == 0 else g.output_shape
    return tensor_map.channels_last(0, dtype, source, box, element_strides)


def weight_in_place(g: Geometry, dtype: str, pass_: str, bn: int, ck: int) -> bool:
    """Whether the halo-tile kernel reads the weight in place rather than a packed copy: a weight the GEMMs would
    (:func:`.gemm.weight_in_place`), in B tiles of whole rounds of the producer's 128 16-byte copies, each thread
    at one place along the copied rows (output channels: the forward's N, grad_input's K chunk); the forward's N
    side (an MN-major operand of 128-byte rows) in 64-channel blocks.  It saves the pack's launch and its pass
    over the weight.  The weight pointer's alignment is the caller's to check."""
    if not gemm.weight_in_place(g, dtype) or ck * bn % 1024:
        return False
    forward = _mode(pass_) == 0
    return 128 % ((bn if forward else ck) // 8) == 0 and (bn % 64 == 0 or not forward)


def forward_tile(g: Geometry, pass_: str = "forward", dtype: str = "float16", precision: str = "tf32") -> HaloTile:
    """Heuristic tile: 256 destination pixels a block where the grid has them (several images of a
    small grid, one row of a grid under eight rows high), the channel side covering the destination
    channels up to 128; where that halo does not fit shared memory, the fitting tile of the most pixels.
    3xTF32 (strict float32) takes :func:`split_tile`."""
    if operand_parts(dtype, precision) == 2:
        return split_tile(g, pass_)
    grid_h, grid_w = dst_grid(g, pass_)
    n = _channels(g, pass_)[1]
    bn = narrowest_bn(n) if n <= 32 else 64 if n <= 64 else 128
    if grid_h <= 8 and grid_w <= 8 and dtype in _KINDS and n > 64:
        small = _small_grid_tile(g, pass_, dtype, n)
        if small is not None:
            return small
    if rows_few(g, pass_):
        # 256 destination channels or more in fp16/bf16: 128 x 256 tiles, which read each halo for twice the
        # channels (on the H200 1.15x and 1.5x the 256 x 128 ones, forward and grad_input of the suite's vocoder
        # layer).  Not in TF32: the vocoder's tuned TF32 forward ran 4.6 ms with 256 x 128 as the heuristic and
        # 5.7 with 128 x 256, which left 256 x 128 out of the race (NOTES v20).
        row = _row_tile(g, pass_, dtype, 256, 128) if n >= 256 and dtype in _KINDS else None
        row = row or _row_tile(g, pass_, dtype, bn, 512 if bn < 32 else 256)
        if row is not None:
            return row
    if grid_h <= 8 and grid_w <= 8:
        preferred = TILES[f"4i8x8x{bn}"] if g.batch >= 4 or bn <= 32 else TILES[f"8x8x{bn}"]
    elif bn < 32:
        # thin: few accumulators, so twice the pixels (each halo copy then serves more MMA rows)
        preferred = TILES[f"32x16x{bn}"] if grid_h > 16 else TILES[f"16x16x{bn}"]
    else:
        preferred = TILES[f"32x8x{bn}"] if grid_w <= 8 and bn == 128 else TILES[f"16x16x{bn}"]
    if _fits(g, dtype, preferred, pass_):
        return preferred
    fitting = [t for t in TILES.values() if _fits(g, dtype, t, pass_)]
    # one-row patches only where no 2-D one fits: on a grid of many rows their halos repeat the taps' rows
    fitting = [t for t in fitting if not t.one_row] or fitting
    if not fitting:
        raise ValueError("no wgmma tile's halo fits shared memory for this layer")
    # no wider channel side than the preferred one where that is possible; then as many pixels as
    # fit, then the channel side nearest the preferred one
    narrow = [t for t in fitting if t.bn <= bn] or fitting
    return max(narrow, key=lambda t: (t.pixels, -abs(t.bn - bn)))


def _tile_suits(g: Geometry, tile: HaloTile, pass_: str) -> bool:
    """Whether a tile is worth planning for this layer: a channel side not mostly padding and thin tiles only
    for thin destinations, a patch within the destination grid (one-row patches for grids of few rows, several
    images for grids a patch covers)."""
    grid_h, grid_w = dst_grid(g, pass_)
    n = _channels(g, pass_)[1]
    if tile.one_row and not rows_few(g, pass_):
        return False
    if tile.bn > 32 and n <= tile.bn // 2:
        return False
    if (tile.bn < 32 and n > tile.bn) or (tile.bn >= 32 and n < 16):
        return False
    if tile.tile_h > 8 * cdiv(grid_h, 8) or tile.tile_w > 8 * cdiv(grid_w, 8):
        return False
    return not (tile.images > 1 and (grid_h > tile.tile_h or grid_w > tile.tile_w or g.batch < tile.images))


def _split_fitting(g: Geometry, pass_: str) -> List[HaloTile]:
    """The tiles of at most :data:`SPLIT_ACCUMULATORS` accumulators a thread whose buffers of both parts fit."""
    return [t for t in TILES.values() if t.accumulators <= SPLIT_ACCUMULATORS and _fits(g, "float32", t, pass_, 2)]


def split_tiles(g: Geometry, pass_: str = "forward") -> List[HaloTile]:
    """The tiles 3xTF32 may run this layer on: suited to it (:func:`_tile_suits`), at most
    :data:`SPLIT_ACCUMULATORS` accumulators a thread, and buffers of both parts that fit shared memory."""
    return [t for t in _split_fitting(g, pass_) if _tile_suits(g, t, pass_)]


def split_tile(g: Geometry, pass_: str = "forward") -> HaloTile:
    """3xTF32's heuristic tile: the widest channel side up to the destination's channels (128 at most: three
    MMAs a product make the tile MMA-bound, and wide MMAs read the least shared memory per product), then the
    most pixels (256 at most on a side of 32, where the 512-pixel tile's buffers take half chunks: on the H200
    16x16x32 ran 0.92x its time on big_square both ways and on outpad_up3x's forward), then the smallest halo;
    on a grid no suited tile fits, any that fits."""
    n = _channels(g, pass_)[1]
    want = 128 if n > 64 else 64 if n > 32 else 32
    found = split_tiles(g, pass_) or _split_fitting(g, pass_)
    if not found:
        raise ValueError("no 3xTF32 wgmma tile's halo fits shared memory for this layer")
    narrow = [t for t in found if t.bn <= want] or found

    def halo(t: HaloTile) -> int:
        h, w = halo_extent(g, t, pass_)
        return t.images * h * w

    return max(narrow, key=lambda t: (t.bn, min(t.pixels, 256) if t.bn <= 32 else t.pixels, -halo(t)))


# Small grids of wide 16-bit layers are weight-bound: each block reads its taps' weights once per tile, so the
# biggest tile wins while there are blocks for the SMs (NOTES v13: four images a tile left most SMs idle).
SMALL_GRID_TILES = ("2i8x8x256", "2i8x8x128", "8x8x128", "8x8x64")


def _small_grid_tile(g: Geometry, pass_: str, dtype: str, channels: int,
                     sm_count: int = ASSUMED.sm_count) -> Optional[HaloTile]:
    """For a grid of 8 x 8 or less: the first of :data:`SMALL_GRID_TILES` no wider than the destination's
    channels that fits shared memory and makes tiles for at least half the SMs; None where none does."""
    for name in SMALL_GRID_TILES:
        tile = TILES[name]
        if tile.bn > channels or not _fits(g, dtype, tile, pass_):
            continue
        if 2 * tile_load(g, tile, pass_)[0] >= sm_count:
            return tile
    return None


def tile_load(g: Geometry, tile: HaloTile, pass_: str = "forward") -> Tuple[int, float]:
    """(the tiles of a pass, counting every stride phase, N tile and group; the share of their pixels inside the
    destination grid).  A small grid under an 8 x 8 patch leaves most of each tile's MMA rows idle."""
    grid_h, grid_w = dst_grid(g, pass_)
    per_image = cdiv(grid_h, tile.tile_h) * cdiv(grid_w, tile.tile_w)
    tiles = cdiv(g.batch, tile.images) * per_image
    phases = g.params.stride[0] * g.params.stride[1] if _mode(pass_) == 0 else 1
    fill = g.batch * grid_h * grid_w / (tiles * tile.pixels)
    return tiles * phases * g.groups * cdiv(_channels(g, pass_)[1], tile.bn), fill


def tf32_leads(g: Geometry, pass_: str = "forward", sm_count: int = ASSUMED.sm_count) -> bool:
    """Whether the TF32 kernel runs ahead of the ``mma.sync`` GEMM for float32: where a stride phase has two taps
    or more (so taps share the halo), the heuristic tile's pixels are at least half inside the grid, and there
    are blocks for at least half the SMs, counting the K ranges a weight-bound grid splits into
    (:func:`halo_splits`).  On the H100 (NOTES v13) it lost to the GEMM on each layer these rules turn away: one
    tap a phase (unet's 2 x 2), 4 x 4 grids (DCGAN's second layer) and grad_input of 64 unsplit tiles."""
    tiles, fill = tile_load(g, forward_tile(g, pass_, "float32"), pass_)
    splits = heuristic_halo_splits(g, pass_, "float32", "tf32", sm_count)
    return weight_phases(g)[0] >= 2 and fill >= 0.5 and 2 * tiles * splits >= sm_count


def _fits(g: Geometry, dtype: str, tile: HaloTile, pass_: str, parts: int = 1) -> bool:
    """Whether the tile's buffers fit with the smallest chunk and the shallowest weight ring."""
    return smem_bytes(g, dtype, tile, 32 // _itemsize(dtype), min(STAGE_CHOICES), pass_, parts=parts) <= SMEM_LIMIT


def eligible(g: Geometry, dtype: str, pass_: str = "forward", precision: str = "strict") -> bool:
    """Whether the kernel can run this pass of the layer: fp16/bf16, or float32 as TF32 or (strict) 3xTF32;
    source channels in whole 16-byte groups, 16 or more of them a group; destinations of 16 or more channels a
    group, or, for the fp16/bf16 forward, thinner ones on N tiles of 8 and 16; a tile whose halo fits shared
    memory, and grid limits (grad_weight: :func:`grad_weight_eligible`).

    Thin destinations are measured on RGB output layers' forward only (NOTES v13).  In float32 they stay on the
    direct kernels, which were 3.4x faster on pix2pix's and exact to float32 where TF32 is not; grad_input into
    a thin input (the grouped layers' few channels a group) keeps the direct kernels, which lead there."""
    if pass_ == "grad_weight":
        return grad_weight_eligible(g, dtype, precision)
    src, dst = _channels(g, pass_)
    kind = mma_kind(dtype, precision)
    thin_ok = dtype in _KINDS and _mode(pass_) == 0
    if kind is None or src % (16 // _itemsize(dtype)) or src < 16 or (dst < 16 and not thin_ok):
        return False
    if not gemm.gemm_fits(g, dtype):
        return False
    sh, sw = g.params.stride
    if sh * sw > GRID_YZ_LIMIT:
        return False
    if not (_split_fitting(g, pass_) if kind == _3XTF32 else any(_fits(g, dtype, t, pass_) for t in TILES.values())):
        return False
    return g.groups * cdiv(dst, narrowest_bn(dst)) <= GRID_YZ_LIMIT


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw", tile: Optional[HaloTile] = None,
                 stages: Optional[int] = None, sm_count: int = 132, precision: str = "strict",
                 weight_aligned: bool = True, split: Optional[int] = None, copy: bool = False) -> PackedGemm:
    """The forward as one halo-tile wgmma kernel per stride phase (grid z), after the weight repack
    and, for NCHW input, the channels_last copy.  float32 needs ``precision="tf32"``: it runs as TF32,
    rounded to nearest as the ``mma.sync`` kernels round (by the weight repack, the channels_last copy,
    or, for a source read in place, the kernel's producer).

    ``stages``: weight buffers (one of :data:`STAGE_CHOICES`; default :data:`B_STAGES`, fewer where
    shared memory runs out).  Blocks are persistent: about one per SM, each walking the tiles of its
    channel tile and phase.  ``weight_aligned``: the weight pointer is 16-byte aligned, so that a weight
    :func:`weight_in_place` may be read so.  ``split``: ranges of the input-channel chunks, each block taking
    one and writing fp32 partials that a fixed-order reduce adds with the bias; by default
    :func:`halo_splits` (one wherever the tiles fill the SMs). ``copy``: a channels_last TF32 source is copied
    rounded first (:func:`~cupyconv.plans.gemm.plan_round_tf32`), so that the copy engine lands its halos and the
    producer rounds nothing, as for an NCHW source's rounding channels_last copy.
    """
    return _plan("forward", g, dtype, has_bias, layout, tile, stages, sm_count, precision, weight_aligned, split,
                 copy)


@functools.lru_cache(maxsize=1024)
def plan_grad_input(g: Geometry, dtype: str, layout: str = "nchw", tile: Optional[HaloTile] = None,
                    stages: Optional[int] = None, sm_count: int = 132, precision: str = "strict",
                    weight_aligned: bool = True, split: Optional[int] = None, copy: bool = False) -> PackedGemm:
    """grad_input (a strided conv2d of grad_output) as one halo-tile wgmma kernel; see :func:`plan_forward`."""
    return _plan("grad_input", g, dtype, False, layout, tile, stages, sm_count, precision, weight_aligned, split,
                 copy)


# A K range is at least this many (chunk, tap) steps: shorter ones spend more of their time filling the pipeline
# and writing partials than multiplying.
_MIN_SPLIT_STEPS = 8
_MAX_SPLITS = 16


def halo_splits(g: Geometry, dtype: str, tile: HaloTile, ck: int, pass_: str = "forward",
                sm_count: int = ASSUMED.sm_count) -> int:
    """K ranges (of whole input-channel chunks) for a halo-tile pass whose tiles leave SMs idle: as many as keep
    every block resident at once (a block fills an SM), each range at least :data:`_MIN_SPLIT_STEPS` steps of the
    phase with the most taps, none empty, and fp32 partials no larger in all than the weight (so only a layer the
    weight's reads bound splits, and the partials add at most that traffic again).  One where the tiles fill the
    SMs, and for an empty grid."""
    tiles = tile_load(g, tile, pass_)[0]
    out_elems = numel(g.output_shape if _mode(pass_) == 0 else g.input_shape)
    if tiles == 0 or out_elems == 0:
        return 1
    chunks = cdiv(_channels(g, pass_)[0], ck)
    taps = weight_phases(g)[0] if _mode(pass_) == 0 else g.kernel[0] * g.kernel[1]
    weight_bytes = numel(g.weight_shape) * _itemsize(dtype)
    splits = max(1, min(sm_count // tiles, chunks * taps // _MIN_SPLIT_STEPS, chunks, _MAX_SPLITS,
                        weight_bytes // (4 * out_elems)))
    return cdiv(chunks, cdiv(chunks, splits))


def _fitted_buffers(g: Geometry, dtype: str, tile: HaloTile, pass_: str, parts: int,
                    stages: Optional[int]) -> Tuple[int, int]:
    """(channels a chunk, weight buffers) for the tile: the chunk shrunk, then (unless ``stages`` is asked for)
    the weight ring, until the buffers fit; 3xTF32 the other way round, since each of its steps waits for its
    MMAs: whole 128-byte chunks halve the steps.  The caller checks that the result fits."""
    ck = chunk_channels(g, dtype, pass_)
    b_stages = stages or B_STAGES

    def over(ck_: int, b_stages_: int) -> bool:
        return smem_bytes(g, dtype, tile, ck_, b_stages_, pass_, parts=parts) > SMEM_LIMIT

    step = 32 // _itemsize(dtype)   # channels of one MMA: chunks stay whole multiples of it
    while parts == 2 and stages is None and over(ck, b_stages) and b_stages > 2:
        b_stages -= 1
    while over(ck, b_stages) and ck > step:
        ck = max(step, ck // 2 // step * step)
    while stages is None and over(ck, b_stages) and b_stages > 2:
        b_stages -= 1
    return ck, b_stages


def _plan(pass_: str, g: Geometry, dtype: str, has_bias: bool, layout: str, tile: Optional[HaloTile],
          stages: Optional[int], sm_count: int, precision: str, weight_aligned: bool,
          split: Optional[int] = None, copy: bool = False) -> PackedGemm:
    mode = _mode(pass_)
    kind = mma_kind(dtype, precision)
    if kind is None:
        raise ValueError(f"the wgmma kernels take float16, bfloat16, or float32; got {dtype}")
    if copy and not (kind == _TF32 and layout == "nhwc"):
        raise ValueError(f"copy rounds a channels_last source to TF32; this pass runs {dtype} "
                         f"({precision}) on {layout}")
    parts = operand_parts(dtype, precision)
    tile = tile or forward_tile(g, pass_, dtype, precision)
    if parts == 2 and tile.accumulators > SPLIT_ACCUMULATORS:
        raise ValueError(f"3xTF32 tiles hold at most {SPLIT_ACCUMULATORS} accumulators a thread; "
                         f"tile {tile.name} holds {tile.accumulators}")
    if stages is not None and stages not in STAGE_CHOICES:
        raise ValueError(f"stages must be one of {STAGE_CHOICES}, got {stages}")
    ck, b_stages = _fitted_buffers(g, dtype, tile, pass_, parts, stages)
    smem = smem_bytes(g, dtype, tile, ck, b_stages, pass_, parts=parts)
    if smem > SMEM_LIMIT:
        raise ValueError(f"the halo of tile {tile.name} does not fit shared memory")
    in_place = False
    if weight_aligned and weight_in_place(g, dtype, pass_, tile.bn, ck):
        padded = smem_bytes(g, dtype, tile, ck, b_stages, pass_, True)
        in_place = padded <= SMEM_LIMIT
        smem = padded if in_place else smem
    halo_h, halo_w = halo_extent(g, tile, pass_)
    src_channels, dst_channels = _channels(g, pass_)
    # an NCHW source's channels_last copy rounds TF32 words, and so does a channels_last one's rounding copy
    # (``copy``), so the producer need not
    rounded_copy = kind == _TF32 and (layout == "nchw" or copy)
    # The copy engine lands halos the producer need not touch: 16-bit ones, or TF32 ones already rounded.
    src_map = None
    if parts == 1 and (kind != _TF32 or rounded_copy):
        src_map = halo_tensor_map(g, dtype, tile, ck, pass_)
        if src_map is not None:
            padded = smem_bytes(g, dtype, tile, ck, b_stages, pass_, in_place, tma=True)
            src_map, smem = (src_map, padded) if padded <= SMEM_LIMIT else (None, smem)
    grid_h, grid_w = dst_grid(g, pass_)
    phases = g.params.stride[0] * g.params.stride[1] if mode == 0 else 1
    tiles = cdiv(g.batch, tile.images) * cdiv(grid_h, tile.tile_h) * cdiv(grid_w, tile.tile_w)
    n_tiles = cdiv(dst_channels, tile.bn)
    if g.groups * n_tiles > GRID_YZ_LIMIT:
        raise ValueError(f"tile {tile.name} needs {g.groups * n_tiles} blocks along grid y, over {GRID_YZ_LIMIT}")
    chunks = cdiv(src_channels, ck)
    if split is None:
        split = halo_splits(g, dtype, tile, ck, pass_, sm_count)
    elif not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"split must be a positive int, got {split!r}")
    elif split > chunks:
        raise ValueError(f"split {split} is more K ranges than the layer's {chunks} chunks of {ck} channels")
    if phases * split > GRID_YZ_LIMIT:
        raise ValueError(f"{phases} stride phases x {split} K ranges pass the grid's z limit of {GRID_YZ_LIMIT}")
    blocks = min(tiles, max(1, sm_count // (g.groups * n_tiles * phases * split)))
    n_pad = n_tiles * tile.bn
    k_pad = chunks * ck
    dst_elems = numel(g.output_shape if mode == 0 else g.input_shape)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape),
                         g.groups * g.kernel[0] * g.kernel[1] * n_pad * k_pad, split * dst_elems if split > 1 else 0)
    constants = layer_constants(g, dtype, index_t)
    constants.update(MODE=mode, MMA_KIND=kind, TILE_IMAGES=tile.images, TILE_H=tile.tile_h,
                     TILE_W=tile.tile_w, WARPGROUPS=tile.warpgroups, BN=tile.bn, CK=ck, B_STAGES=b_stages,
                     HALO_STAGES=halo_stages(g, b_stages, pass_), HALO_H=halo_h, HALO_W=halo_w,
                     DST_CL=layout == "nhwc", HAS_BIAS=bool(has_bias) and mode == 0, SRC_ROUNDED=rounded_copy,
                     WEIGHT_DIRECT=in_place, SPLIT_K=split, TMA=src_map is not None)
    spec = KernelSpec.make("conv_transpose2d_wgmma.cu", "conv_transpose2d_wgmma", constants, TARGET)
    if mode == 0:
        sizes = (g.batch,) + g.in_size + g.out_size
        src_total, src_pixels = g.in_channels, g.in_size[0] * g.in_size[1]
    else:
        sizes = (g.batch,) + g.out_size + g.in_size
        src_total, src_pixels = g.out_channels, g.out_size[0] * g.out_size[1]
    main = Plan(spec, (blocks, g.groups * n_tiles, phases * split), (128 * (tile.warpgroups + 1), 1, 1), sizes,
                index_t, scratch_bytes=split_k_scratch(split, dst_elems, 4), smem_bytes=smem,
                tensor_maps=(src_map,) if src_map else ())
    reduce = None
    if split > 1:
        channels = g.out_channels if mode == 0 else g.in_channels
        plane = numel(g.out_size if mode == 0 else g.in_size)
        reduce = plan_reduce_with_bias(dtype, dst_elems, split, channels, 1 if layout == "nhwc" else plane, index_t)
    pack = None if in_place else gemm.plan_pack_weight_padded(g, dtype, mode, n_pad, k_pad, (tile.bn, ck),
                                                              round_tf32=kind == _TF32, split_tf32=kind == _3XTF32)
    if layout == "nchw":
        to_cl = gemm.plan_to_channels_last(g.batch, src_total, src_pixels, dtype, round_tf32=rounded_copy)
    else:
        to_cl = gemm.plan_round_tf32(g.batch * src_total * src_pixels) if copy else None
    return PackedGemm(pack, main, to_cl, reduce)


def heuristic_halo_splits(g: Geometry, pass_: str = "forward", dtype: str = "float16", precision: str = "tf32",
                          sm_count: int = ASSUMED.sm_count) -> int:
    """The K ranges of the heuristic tile's plan (:func:`halo_splits`); 1 where no tile fits."""
    try:
        tile = forward_tile(g, pass_, dtype, precision)
    except ValueError:
        return 1
    ck, _ = _fitted_buffers(g, dtype, tile, pass_, operand_parts(dtype, precision), None)
    return halo_splits(g, dtype, tile, ck, pass_, sm_count)


def options(g: Geometry, pass_: str = "forward", dtype: str = "float16", precision: str = "tf32"
            ) -> List[Dict[str, object]]:
    """Planner options worth timing: the heuristic, one K range where the heuristic splits K, the deepest weight
    ring with the heuristic tile, then the largest tiles whose N side fits the channels, whose patch fits the
    destination grid and whose halo fits shared memory.  3xTF32: the heuristic, one K range where it splits, then
    the largest of :func:`split_tiles`."""
    one_range = [{"split": 1}] if heuristic_halo_splits(g, pass_, dtype, precision) > 1 else []
    if operand_parts(dtype, precision) == 2:
        heuristic = split_tile(g, pass_)
        return [{}] + one_range + [{"tile": t.name} for t in sorted(split_tiles(g, pass_),
                                                                    key=lambda t: -t.pixels * t.bn) if t != heuristic]
    # Of the other ring depths only the deepest is raced: on the H100 the shallower ones never beat the
    # default by more than noise on the dense suite layers (benchmarks/NOTES.md, v10), and each
    # candidate costs a compile on a layer's first call.
    found: List[Dict[str, object]] = [{}] + one_range + [{"stages": max(STAGE_CHOICES)}]
    few = rows_few(g, pass_)
    # Larger patches first: they read the weights fewer times; on a grid of few rows, one-row patches first.
    for tile in sorted(TILES.values(), key=lambda t: (few and not t.one_row, -t.pixels * t.bn)):
        if _tile_suits(g, tile, pass_) and _fits(g, dtype, tile, pass_):
            found.append({"tile": tile.name})
    return found


@dataclass(frozen=True)
class WeightTile:
    """grad_weight's block tile: ``bm`` input channels (64 a warpgroup) x ``bn`` output channels, for up to
    ``taps`` taps of one stride phase side by side; a K step is ``rows`` x ``cols`` input pixels (8 x 8, 16 x 8,
    or 1 x 64 for inputs of few rows)."""

    bm: int
    bn: int
    taps: int
    rows: int = 8
    cols: int = 8

    @property
    def name(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.taps}" + (f"r{self.rows}" if self.rows != WEIGHT_TILE_H else "")
                + (f"w{self.cols}" if self.cols != 8 else ""))

    @property
    def one_row(self) -> bool:
        return self.rows == 1

    @property
    def warpgroups(self) -> int:
        return self.bm // 64


WEIGHT_TILE_H = 8     # a K step is 8 x 8 input pixels, unless a tile says otherwise
# At most 128 accumulators a thread (taps x bn / 2).  The 16-row tiles halve the barriers and copies' address
# arithmetic per multiply-add, at twice the shared memory a stage.
# The one-row tiles (K steps of 1 x 64 pixels) serve inputs under eight rows high, whose 8-row steps would be
# mostly past the input (a 1-D layer's one row fills an eighth of them).
WEIGHT_TILES = {t.name: t for t in (WeightTile(64, 64, 4), WeightTile(64, 64, 4, 16), WeightTile(64, 128, 2),
                                    WeightTile(128, 64, 4), WeightTile(128, 64, 4, 16), WeightTile(128, 128, 1),
                                    WeightTile(128, 256, 1), WeightTile(64, 64, 4, 1, 64),
                                    WeightTile(64, 128, 2, 1, 64), WeightTile(128, 64, 4, 1, 64),
                                    WeightTile(128, 128, 1, 1, 64), WeightTile(128, 256, 1, 1, 64))}
WEIGHT_STAGES = 4
# The 16-bit grad_weight kernel's register split (setmaxnreg): its producer warpgroup keeps 72 a thread (its
# unrolled copies spilled at 56), and its consumers want room beside their accumulators (ptxas gave every tile
# 156-163 registers in all, 128 of them accumulators).
REGISTER_FILE = 65536
WEIGHT_PRODUCER_REGISTERS = 72
WEIGHT_CONSUMER_HEADROOM = 48
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024   # the driver's share of each block's shared memory
WEIGHT_STATIC_SMEM = 256         # the kernel's tap table and mbarriers
# a step's MMAs stay in flight while the next tile lands, so grad_weight's ring needs three buffers or more
WEIGHT_STAGE_CHOICES = (3, 4, 6)


def _phase_shifts(g: Geometry) -> Tuple[List[List[int]], List[List[int]]]:
    """Per stride phase of the rows, then of the columns, the shifts of its taps.

    Tap (kh, kw) reads grad_output row SH*(i + ah) + rh: rh = (kh*DH - PH) mod SH, ah = floor((kh*DH - PH) / SH).
    """
    def per_phase(k, s, d, p):
        shifts: List[List[int]] = [[] for _ in range(s)]
        for t in range(k):
            shifts[(t * d - p) % s].append((t * d - p) // s)
        return shifts

    (kh, kw), (sh, sw) = g.kernel, g.params.stride
    return (per_phase(kh, sh, g.params.dilation[0], g.params.padding[0]),
            per_phase(kw, sw, g.params.dilation[1], g.params.padding[1]))


def weight_phases(g: Geometry) -> Tuple[int, int, int]:
    """(the most taps one stride phase has, the widest spread of one phase's row shifts, of its column shifts)."""
    rows, cols = ([a for a in side if a] for side in _phase_shifts(g))
    spread = [max(max(a) - min(a) for a in side) for side in (rows, cols)]
    return max(map(len, rows)) * max(map(len, cols)), spread[0], spread[1]


def weight_block_taps(g: Geometry, tap_group: int) -> List[int]:
    """The taps of each grad_weight block with ``tap_group`` taps a block: each stride phase's taps in chunks of
    ``tap_group`` (phases without taps hold no block)."""
    rows, cols = _phase_shifts(g)
    return [min(tap_group, taps - start) for taps in (len(r) * len(c) for r in rows for c in cols)
            for start in range(0, taps, tap_group)]


def weight_skips_absent_taps(g: Geometry, tap_group: int) -> bool:
    """Whether grad_weight's blocks test each tap of their group before its MMAs, rather than run every block's
    full group (an absent tap reads the first tap's origin and is never stored).  The test is a branch between
    MMAs, at which ptxas makes the warpgroup wait: 10% of the 15-tap asym_kernel's time (H200), against the 7%
    more MMAs its last group of three costs run full.  So blocks test their taps only where full groups would
    add more than an eighth to the MMAs (a 3 x 3 stride-2 layer's phases of 4, 2, 2 and 1 taps)."""
    taps = weight_block_taps(g, tap_group)
    issued, needed = len(taps) * tap_group, sum(taps)
    return issued - needed > needed / 8


def weight_tile(g: Geometry) -> WeightTile:
    """The grad_weight tile tried first: four taps of 64 x 64 channels where a stride phase has four taps or
    more (the best tile on the H100 wherever it applied, v11 notes), two taps of 64 x 128 where it has two or
    three, else one tap of 128 x 128; K steps of one row where :func:`weight_rows_few`."""
    phase_taps = weight_phases(g)[0]
    name = "64x64x4" if phase_taps >= 4 else "64x128x2" if phase_taps >= 2 else "128x128x1"
    row = WEIGHT_TILES[name + "r1w64"]
    # a one-row step's halo spans the taps' rows for 64 pixels: where that overflows shared memory, 8 x 8 steps
    if weight_rows_few(g) and weight_smem_bytes(g, row, min(WEIGHT_STAGE_CHOICES)) <= SMEM_LIMIT:
        return row
    return WEIGHT_TILES[name]


def weight_rows_few(g: Geometry) -> bool:
    """Whether grad_weight's K steps run along one input row: an input under eight rows high and 64 or more
    columns wide (a 1-D layer's), which 8 x 8-pixel steps would leave mostly empty."""
    h, w = g.in_size
    return h < 8 and w >= 64


def weight_smem_bytes(g: Geometry, tile: WeightTile, stages: int) -> int:
    """Shared memory of the grad_weight ring: per stage an x tile and a grad_output halo, each a 128-byte row
    per pixel and 64-channel block (the 128-byte swizzle), each block rounded up to whole swizzle periods of
    1024 bytes, and one period more to align the ring."""
    _, span_h, span_w = weight_phases(g)
    halo = (tile.rows + span_h) * (tile.cols + span_w)
    return (stages * (tile.bm // 64 * cdiv(tile.rows * tile.cols * 128, 1024)
                      + tile.bn // 64 * cdiv(halo * 128, 1024)) + 1) * 1024


def weight_tensor_maps(g: Geometry, dtype: str, tile: WeightTile) -> Tuple[TensorMap, ...]:
    """The copy engine's descriptors of the 16-bit grad_weight kernel's channels_last sources, or none where it
    cannot take the tiles (a stride past 8, a halo of more than 256 pixels' span): x in boxes of 64 channels x
    the tile's pixels, grad_output in boxes of 64 channels x the halo, walked at the stride."""
    _, span_h, span_w = weight_phases(g)
    sh, sw = g.params.stride
    halo_box = (64, (tile.cols + span_w) * sw, (tile.rows + span_h) * sh, 1)
    if not tensor_map.fits(halo_box, (1, sw, sh, 1)):
        return ()
    return (tensor_map.channels_last(0, dtype, g.input_shape, (64, tile.cols, tile.rows, 1)),
            tensor_map.channels_last(1, dtype, g.output_shape, halo_box, (1, sw, sh, 1)))


def grad_weight_eligible(g: Geometry, dtype: str, precision: str = "strict") -> bool:
    """16 or more channels a group on both sides, the GEMMs' grid limits, and a halo that fits shared memory;
    fp16/bf16 with whole 16-byte channel runs (:func:`plan_grad_weight`), or float32, TF32 or strict (3xTF32)
    (:func:`plan_grad_weight_tf32`)."""
    if min(g.in_per_group, g.out_per_group) < 16 or not gemm.gemm_fits(g, dtype):
        return False
    if dtype == "float32":
        parts = operand_parts(dtype, precision)
        return _tf32_weight_fits(g, (TF32_WEIGHT_TILES["64x64x4"], SPLIT_WEIGHT_TILES["64x64x2"])[parts - 1], parts)
    return (dtype in _KINDS and g.in_per_group % 8 == 0 and g.out_per_group % 8 == 0
            and weight_smem_bytes(g, WEIGHT_TILES["64x64x4"], min(WEIGHT_STAGE_CHOICES)) <= SMEM_LIMIT)


def _weight_ring(tile: WeightTile, stages: Optional[int], default: int, smem_of,
                 choices: Tuple[int, ...] = WEIGHT_STAGE_CHOICES) -> Tuple[int, int]:
    """(ring depth, shared memory) of a grad_weight kernel: ``stages`` (one of ``choices``), else ``default`` less
    whatever shared memory cannot hold, down to the shortest ring; ``smem_of(depth)`` is the ring's bytes."""
    if stages is not None and stages not in choices:
        raise ValueError(f"stages must be one of {choices} for grad_weight, got {stages}")
    ring = stages or default
    while stages is None and ring > min(choices) and smem_of(ring) > SMEM_LIMIT:
        ring -= 1
    smem = smem_of(ring)
    if smem > SMEM_LIMIT:
        raise ValueError(f"grad_weight tile {tile.name} with {ring} stages does not fit shared memory")
    return ring, smem


def weight_blocks_per_sm(tile: WeightTile, smem: int) -> int:
    """Blocks of the 16-bit grad_weight kernel an SM holds: two where shared memory holds two and the consumers'
    share of half the register file (the producer warpgroup keeping :data:`WEIGHT_PRODUCER_REGISTERS` a
    thread) leaves :data:`WEIGHT_CONSUMER_HEADROOM` registers beside the accumulators, else one."""
    threads = 128 * (tile.warpgroups + 1)
    launch = REGISTER_FILE // (2 * threads) // 8 * 8
    consumer = (launch * threads - WEIGHT_PRODUCER_REGISTERS * 128) // (128 * tile.warpgroups) // 8 * 8
    fits = 2 * (smem + SMEM_RESERVED_PER_BLOCK + WEIGHT_STATIC_SMEM) <= SMEM_PER_SM
    return 2 if fits and consumer >= WEIGHT_CONSUMER_HEADROOM + tile.taps * tile.bn // 2 else 1


def _weight_split_k(g: Geometry, dtype: str, tile: WeightTile, k_tiles: int, sm_count: int, smem: int,
                    function: str, constants: dict, batch_bound: Optional[int] = None,
                    producer: bool = False, tensor_maps: Tuple[TensorMap, ...] = ()) -> Tuple[Plan, Optional[Plan]]:
    """The partial pass and the fixed-order reduction shared by both grad_weight kernels (``function``, in the
    template of that name): a block per (group, tap chunk, stride phase) x channel tile x K range, and the
    kernel's own ``constants`` besides the layer's and the tile's.  ``batch_bound`` is the most images (or packed
    groups of images) that the kernel's source offsets may count, where that passes the batch; ``producer``,
    whether a warpgroup more than the tile's issues the copies, the copy engine's where ``tensor_maps``."""
    phase_taps, span_h, span_w = weight_phases(g)
    tap_chunks = cdiv(phase_taps, tile.taps)
    phases = g.params.stride[0] * g.params.stride[1]
    channel_tiles = cdiv(g.in_per_group, tile.bm) * cdiv(g.out_per_group, tile.bn)
    tap_blocks = g.groups * phases * tap_chunks   # grid x: (group, tap chunk, stride phase), phase fastest
    # About two blocks per SM in all, each K range at least two tiles long.
    splits = max(1, min(cdiv(2 * sm_count, tap_blocks * channel_tiles), cdiv(k_tiles, 2), 512))
    per_split = cdiv(k_tiles, splits)
    splits = cdiv(k_tiles, per_split)
    weight_elems = numel(g.weight_shape)
    taps = g.kernel[0] * g.kernel[1]
    # The partials are tap-major ([split][tap][ic][oc]), or a channels_last weight's own layout: one split of
    # a one-tap layer, or of a channels_last weight, is the weight itself.
    direct = splits == 1 and (taps == 1 or g.weight_channels_last)
    # The 16-bit kernel forms a tile's halo origin before it tests the halo's pixels; past the last image's edge
    # by up to 2 (padding + stride) rows and columns, which the offsets must still hold.
    (ph, pw), (sh, sw) = g.params.padding, g.params.stride
    overshoot = (2 * (ph + sh) + 1) * (g.out_size[1] + 2 * (pw + sw) + 1) * g.out_channels
    images = max(g.batch, batch_bound or 0)
    x_elems = images * g.in_channels * g.in_size[0] * g.in_size[1]
    go_elems = images * g.out_channels * g.out_size[0] * g.out_size[1]
    index_t = index_type(x_elems, go_elems + overshoot, splits * weight_elems)
    constants = {**layer_constants(g, dtype, index_t), **constants}
    constants.update(WARPGROUPS=tile.warpgroups, BN=tile.bn, TAP_GROUP=tile.taps, TAP_CHUNKS=tap_chunks,
                     SPAN_H=span_h, SPAN_W=span_w, SINGLE_CHUNK=direct)
    threads = 128 * tile.warpgroups
    if producer:
        threads += 128
        constants.update(MIN_BLOCKS=weight_blocks_per_sm(tile, smem), PRODUCER_REGISTERS=WEIGHT_PRODUCER_REGISTERS,
                         TMA=bool(tensor_maps))
    spec = KernelSpec.make(f"{function}.cu", function, constants, TARGET)
    partial = Plan(spec, (tap_blocks, channel_tiles, splits), (threads, 1, 1),
                   (g.batch,) + g.in_size + g.out_size + (per_split,), index_t,
                   scratch_bytes=0 if direct else splits * weight_elems * 4, smem_bytes=smem,
                   tensor_maps=tensor_maps)
    if direct:
        reduce = None
    elif g.weight_channels_last:
        reduce = plan_reduce(dtype, weight_elems, splits, index_t)
    else:
        reduce = plan_tap_major_reduce(dtype, weight_elems // taps, taps, splits, index_t)
    return partial, reduce


@functools.lru_cache(maxsize=1024)
def plan_grad_weight(g: Geometry, dtype: str, sm_count: int = 132, layout: str = "nchw",
                     tile: Optional[WeightTile] = None, stages: Optional[int] = None) -> SplitK:
    """grad_weight as split-K wgmma GEMMs per (group, stride phase, group of taps) and the fixed-order reduction;
    NCHW sources are copied into channels_last first (the ``mma.sync`` GEMM's copies).  ``stages`` defaults
    to :data:`WEIGHT_STAGES` for 8-row tiles and three for 16-row ones, fewer where shared memory runs out."""
    tile = tile or weight_tile(g)
    # By default two 64-pixel tiles' worth of pixels in flight ahead: four buffers of 64 pixels, three of 128 (so
    # that two blocks of a 16-row tile still share an SM).
    ring, smem = _weight_ring(tile, stages, WEIGHT_STAGES if tile.rows * tile.cols == 64 else 3,
                              lambda depth: weight_smem_bytes(g, tile, depth))
    h, w = g.in_size
    k_tiles = g.batch * cdiv(h, tile.rows) * cdiv(w, tile.cols)
    constants = dict(MMA_KIND=_KINDS[dtype], SKIP_ABSENT_TAPS=weight_skips_absent_taps(g, tile.taps),
                     TILE_H=tile.rows, TILE_W=tile.cols, STAGES=ring)
    partial, reduce = _weight_split_k(g, dtype, tile, k_tiles, sm_count, smem, "conv_transpose2d_grad_weight_wgmma",
                                      constants, producer=True, tensor_maps=weight_tensor_maps(g, dtype, tile))
    sources = gemm.plan_grad_weight_sources(g, dtype) if layout == "nchw" else None
    return SplitK(partial, reduce, sources)


# TF32 grad_weight (conv_transpose2d_grad_weight_wgmma_tf32.cu): K runs over (pixel, four images), so its K step
# is a few groups of four images x a pixel patch, and its tiles' sides and tap groups are the 16-bit kernel's.
TF32_WEIGHT_TILES = {t.name: t for t in (WeightTile(64, 64, 4), WeightTile(128, 64, 4), WeightTile(64, 128, 2),
                                         WeightTile(128, 128, 2), WeightTile(128, 128, 1))}
TF32_STEP_SLOTS = 16   # (pixel, image group) slots in a K step: 64 words of K, eight MMAs a tap
# 3xTF32 keeps a second set of accumulators (its fp32 total), so its tiles hold at most 64 a thread in each; its
# stages hold both parts of both operands, and each K tile waits for its MMAs, so its ring may be two deep (one
# tile copied ahead) and its K steps shrink where a phase's halo is wide.
SPLIT_WEIGHT_TILES = {t.name: t for t in (WeightTile(64, 64, 2), WeightTile(128, 64, 2), WeightTile(64, 128, 1),
                                          WeightTile(128, 128, 1))}
SPLIT_WEIGHT_STAGE_CHOICES = (2, 3)


@dataclass(frozen=True)
class ImageStep:
    """A TF32 grad_weight K step: ``quads`` groups of four images x ``rows`` x ``cols`` input pixels."""

    rows: int
    cols: int
    quads: int

    def __post_init__(self):
        if self.cols % 2 or min(self.rows, self.cols, self.quads) < 1:
            raise ValueError(f"a TF32 grad_weight step is rows x cols x image groups, cols even, got {self}")


def tf32_weight_step(g: Geometry, slots: int = TF32_STEP_SLOTS) -> ImageStep:
    """The widest pixel patch of ``slots`` slots that the input fills (an MMA takes two pixels of a row, so at
    least two columns), with image groups making up the rest, up to the batch's."""
    h, w = g.in_size
    cols = min(8 if w >= 6 else 4 if w >= 3 else 2, slots)
    rows = min(slots // cols, 1 << (h.bit_length() - 1))
    quads = max(1, min(slots // (rows * cols), cdiv(g.batch, 4)))
    return ImageStep(rows, cols, quads)


def _tf32_weight_fits(g: Geometry, tile: WeightTile, parts: int) -> bool:
    """Whether the image-quad grad_weight kernel can run ``tile``: its shortest ring in shared memory, with
    :func:`split_weight_step`'s K step for 3xTF32 (``parts`` 2)."""
    if parts == 2:
        return split_weight_step(g, tile) is not None
    return tf32_weight_smem_bytes(g, tile, min(WEIGHT_STAGE_CHOICES)) <= SMEM_LIMIT


def split_weight_step(g: Geometry, tile: WeightTile) -> Optional[ImageStep]:
    """3xTF32's K step for ``tile``: :func:`tf32_weight_step` of 16 slots, else 8 or 4, the first whose two-deep
    ring of both parts fits shared memory; None where none does."""
    for slots in (TF32_STEP_SLOTS, TF32_STEP_SLOTS // 2, TF32_STEP_SLOTS // 4):
        step = tf32_weight_step(g, slots)
        if tf32_weight_smem_bytes(g, tile, min(SPLIT_WEIGHT_STAGE_CHOICES), 2, step) <= SMEM_LIMIT:
            return step
    return None


def tf32_weight_smem_bytes(g: Geometry, tile: WeightTile, stages: int, parts: int = 1,
                           step: Optional[ImageStep] = None) -> int:
    """Shared memory of the TF32 grad_weight ring: per stage a 16-byte slot per (channel, slot) of the x tile
    and of the grad_output halo, each slot's plane padded by 16 bytes; ``parts`` (:func:`operand_parts`) times
    over.  ``step``: the K step, :func:`tf32_weight_step`'s by default."""
    step = step or tf32_weight_step(g)
    _, span_h, span_w = weight_phases(g)
    slots = step.quads * step.rows * step.cols
    halo_slots = step.quads * (step.rows + span_h) * (step.cols + span_w)
    return stages * parts * (slots * (tile.bm * 16 + 16) + halo_slots * (tile.bn * 16 + 16))


def tf32_weight_tile(g: Geometry) -> WeightTile:
    """Four taps where a stride phase has four or more, two where it has two or three, else one; 128 input
    channels a tile where a group has more than 64; the first of those whose shortest ring fits shared memory,
    else 64 x 64 x 4 (which :func:`grad_weight_eligible` requires to fit)."""
    phase_taps = weight_phases(g)[0]
    wide = g.in_per_group > 64
    if phase_taps >= 4:
        names = ["128x64x4"] * wide + ["64x64x4"]
    elif phase_taps >= 2:
        names = ["128x128x2"] * wide + ["64x128x2"]
    else:
        names = ["128x128x1"]
    for name in names:
        if _tf32_weight_fits(g, TF32_WEIGHT_TILES[name], 1):
            return TF32_WEIGHT_TILES[name]
    return TF32_WEIGHT_TILES["64x64x4"]


def split_weight_tile(g: Geometry) -> WeightTile:
    """3xTF32's grad_weight tile: :func:`tf32_weight_tile`'s choices at 64 accumulators a thread, two taps where a
    stride phase has two or more, else one; 128 input channels where a group has more than 64, the first with a
    K step (:func:`split_weight_step`), else 64 x 64 x 2 (which :func:`grad_weight_eligible` requires to fit)."""
    wide = g.in_per_group > 64
    if weight_phases(g)[0] >= 2:
        names = ["128x64x2"] * wide + ["64x64x2"]
    else:
        names = ["128x128x1"] * wide + ["64x128x1", "64x64x2"]
    for name in names:
        if _tf32_weight_fits(g, SPLIT_WEIGHT_TILES[name], 2):
            return SPLIT_WEIGHT_TILES[name]
    return SPLIT_WEIGHT_TILES["64x64x2"]


_QUAD_TILE = 32   # to_image_quads.cu packs four images x 32 channels x 32 pixels a block
_QUAD_THREADS = 256   # and, from four-channel runs, one run of four images a thread


def plan_to_image_quads(g: Geometry, layout: str, split: bool = False, aligned: bool = False
                        ) -> Tuple[Plan, Tuple[int, int]]:
    """The launch that packs x and grad_output for the TF32 grad_weight kernel as [n / 4][pixel][channel][n % 4]
    words rounded to TF32 (``kernels/to_image_quads.cu``), and the bytes of the two copies (grad_output's
    starts 256-byte aligned after x's in the launch's scratch).  ``split`` (3xTF32): each copy holds the words'
    TF32 big parts, then their residuals.  channels_last sources ``aligned`` to 16 bytes whose channels come in
    fours are read in 16-byte runs of four channels (VEC4), with no transpose."""
    quads = cdiv(g.batch, 4)
    sources = ((g.in_channels, g.in_size[0] * g.in_size[1]), (g.out_channels, g.out_size[0] * g.out_size[1]))
    parts = 2 if split else 1
    elems = [parts * quads * 4 * c * p for c, p in sources]
    vec4 = layout == "nhwc" and aligned and all(c % 4 == 0 for c, _ in sources)
    if vec4:
        blocks = [cdiv(quads * p * c // 4, _QUAD_THREADS) for c, p in sources]
    else:
        blocks = [quads * cdiv(c, _QUAD_TILE) * cdiv(p, _QUAD_TILE) for c, p in sources]
    index_t = index_type(*elems)   # the padded copies hold every offset the sources have
    spec = KernelSpec.make("to_image_quads.cu", "to_image_quads",
                           dict(INDEX_T=index_t, NHWC=layout == "nhwc", VEC4=vec4, SPLIT_TF32=split))
    copy_bytes = (elems[0] * 4, elems[1] * 4)
    plan = Plan(spec, (sum(blocks), 1, 1), (_QUAD_THREADS, 1, 1), (g.batch,) + sources[0] + sources[1] + (blocks[0],),
                index_t, scratch_bytes=aligned_size(copy_bytes[0]) + copy_bytes[1])
    return plan, copy_bytes


@functools.lru_cache(maxsize=1024)
def plan_grad_weight_tf32(g: Geometry, sm_count: int = 132, layout: str = "nchw", tile: Optional[WeightTile] = None,
                          stages: Optional[int] = None, precision: str = "tf32", aligned: bool = False
                          ) -> PackedSourcesSplitK:
    """float32 grad_weight at TF32 precision: x and grad_output packed into image quads in ``layout`` order
    (:func:`plan_to_image_quads`, ``aligned`` as it says), then split-K wgmma GEMMs per (group, stride phase, group of taps) on the packed
    copies (one kernel for both layouts), K in :func:`tf32_weight_step`'s steps, and the fixed-order reduction.
    ``stages`` defaults to the deepest ring up to :data:`WEIGHT_STAGES` that fits shared memory.  Strict
    ``precision`` runs as 3xTF32: sources packed in two parts, tiles of :data:`SPLIT_WEIGHT_TILES`."""
    parts = operand_parts("float32", precision)
    tile = tile or (tf32_weight_tile(g) if parts == 1 else split_weight_tile(g))
    if parts == 1:
        step = tf32_weight_step(g)
        ring, smem = _weight_ring(tile, stages, WEIGHT_STAGES, lambda depth: tf32_weight_smem_bytes(g, tile, depth))
    else:
        if tile.taps * tile.bn // 2 > 64:
            raise ValueError(f"3xTF32 grad_weight tiles hold at most 64 accumulators a thread; tile {tile.name} "
                             f"holds {tile.taps * tile.bn // 2}")
        step = split_weight_step(g, tile)
        if step is None:
            raise ValueError(f"3xTF32 grad_weight tile {tile.name} does not fit shared memory")
        ring, smem = _weight_ring(tile, stages, max(SPLIT_WEIGHT_STAGE_CHOICES),
                                  lambda depth: tf32_weight_smem_bytes(g, tile, depth, 2, step),
                                  SPLIT_WEIGHT_STAGE_CHOICES)
    h, w = g.in_size
    k_tiles = cdiv(g.batch, 4 * step.quads) * cdiv(h, step.rows) * cdiv(w, step.cols)
    # Packed offsets count slots of four images, from the tile's image group up to QUADS groups past the last
    # (and, split, through the residuals' copy after the big parts').
    quads = cdiv(g.batch, 4)
    partial, reduce = _weight_split_k(g, "float32", tile, k_tiles, sm_count, smem,
                                      "conv_transpose2d_grad_weight_wgmma_tf32",
                                      dict(TILE_H=step.rows, TILE_W=step.cols, QUADS=step.quads, STAGES=ring,
                                           SPLIT_TF32=parts == 2),
                                      batch_bound=parts * quads + step.quads)
    pack, copy_bytes = plan_to_image_quads(g, layout, parts == 2, aligned)
    return PackedSourcesSplitK(pack, SplitK(partial, reduce), copy_bytes)


def split_weight_leads(g: Geometry) -> bool:
    """Whether 3xTF32's grad_weight kernel runs ahead of the ``mma.sync`` GEMM: where each stride phase's tap shifts
    spread at most one pixel each way, so that its two-part halos stay small.  On the H200 (v32 notes, channels_last)
    it took 0.47x the GEMM's time on dcgan_up (4 x 4, stride 2) and 0.25x on unet_up2x2 (2 x 2, stride 2), but
    1.07x on asym_kernel (3 x 5, stride 1) and 2.2x on big_square (3 x 3, stride 1), whose halos a K step of
    eight pixels reads are four to five times its x tile."""
    _, span_h, span_w = weight_phases(g)
    return max(span_h, span_w) <= 1


def tf32_weight_options(g: Geometry, precision: str = "tf32") -> List[Dict[str, object]]:
    """The heuristic, then the other TF32 tiles (3xTF32's, for strict ``precision``) whose channel sides the layer
    fills at least halfway, whose tap groups its stride phases fill, and whose shortest ring fits shared memory."""
    parts = operand_parts("float32", precision)
    found: List[Dict[str, object]] = [{}]
    heuristic, tiles = (tf32_weight_tile(g), TF32_WEIGHT_TILES) if parts == 1 else \
        (split_weight_tile(g), SPLIT_WEIGHT_TILES)
    phase_taps = weight_phases(g)[0]
    for tile in tiles.values():
        if tile == heuristic or (tile.bm > 64 and g.in_per_group <= tile.bm // 2) \
                or (tile.bn > 64 and g.out_per_group <= tile.bn // 2) or (tile.taps > 1 and phase_taps < tile.taps) \
                or not _tf32_weight_fits(g, tile, parts):
            continue
        found.append({"tile": tile.name})
    return found


def grad_weight_options(g: Geometry) -> List[Dict[str, object]]:
    """The heuristic, then the other tiles whose channel sides the layer fills at least halfway, whose tap
    groups its stride phases fill, whose rows its input has, and whose shortest ring fits shared memory: the
    heuristic's 16-row sibling first; one-row tiles exactly where the heuristic is one (an input of few rows,
    :func:`weight_rows_few`).  (A deeper ring never won on the H100.)"""
    found: List[Dict[str, object]] = [{}]
    heuristic = weight_tile(g)
    phase_taps = weight_phases(g)[0]
    sibling = WeightTile(heuristic.bm, heuristic.bn, heuristic.taps, 16)
    order = sorted(WEIGHT_TILES.values(), key=lambda t: t != sibling)
    for tile in order:
        # one-row steps where the heuristic takes them (an input of few rows), and only there: 8 x 8 steps ran
        # 4-5x slower on a 1-D layer (NOTES v20)
        if tile == heuristic or (tile.bm > 64 and g.in_per_group <= tile.bm // 2) \
                or (tile.bn > 64 and g.out_per_group <= tile.bn // 2) or (tile.taps > 1 and phase_taps < tile.taps) \
                or (tile.rows > WEIGHT_TILE_H and g.in_size[0] < tile.rows) or tile.one_row != heuristic.one_row \
                or weight_smem_bytes(g, tile, min(WEIGHT_STAGE_CHOICES)) > SMEM_LIMIT:
            continue
        found.append({"tile": tile.name})
    return found


# K ranges of the mma.sync GEMM's heuristic from which it runs ahead of the 16-bit halo-tile kernels; and for
# grad_input where both read a channels_last weight in place (pix2pix's 16 x 1024 x 8² and 4² in bf16 on an H200:
# split 4 ways, 61 µs against the GEMM's 83; split 16 ways, 60 against 29).  The forwards stay at 4 in place too
# (4², split 8 ways: the GEMM 31 µs, the halo-tile kernel 45).
SPLIT_GEMM_LEADS = 4
SPLIT_GEMM_LEADS_IN_PLACE = 16


def _grad_input_in_place(g: Geometry, dtype: str) -> bool:
    """Whether the heuristic halo-tile grad_input reads the weight in place (:func:`weight_in_place`)."""
    try:
        return plan_grad_input(g, dtype).pack is None
    except ValueError:
        return False


class WgmmaFamily(Family):
    name = "wgmma"
    passes = ("forward", "grad_input", "grad_weight")
    max_variants = 6

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """sm_90 exactly (sm_90a code), the tensor cores switched on, and :func:`eligible`."""
        return (device.tensor_cores == WGMMA and device.arch == "90" and gemm.enabled()
                and _eligible(g, dtype, pass_, precision))

    def leads(self, pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict") -> bool:
        """grad_weight's kernels lead where a stride phase has two taps or more, which a block's tile then shares;
        with one tap a phase the mma.sync GEMM was as fast or faster on the H100 (v12 notes), so it races them.
        The TF32 grad_weight kernel beat the GEMM on all such layers measured but a 3-tap dilated one in NCHW and,
        in one of two runs, pix2pix's 1 x 1 input (v14 notes); the tuner races the two.  The float32 (TF32)
        forward and grad_input lead as :func:`tf32_leads` says; fp16 and bf16 ones unless the GEMM would split K
        :data:`SPLIT_GEMM_LEADS` ways or more (a weight-bound grid, whose few halo tiles each read the weight whole:
        on pix2pix's 1², 2² and 4² grids the split GEMM took 0.5-0.9x their time forward, 0.3-0.5x for grad_input),
        or for grad_input :data:`SPLIT_GEMM_LEADS_IN_PLACE` ways where they read the weight in place.  Strict
        float32's grad_weight (3xTF32) leads as :func:`split_weight_leads` says."""
        if pass_ == "grad_weight":
            if dtype == "float32" and precision == "strict":
                return split_weight_leads(g)
            return weight_phases(g)[0] >= 2
        if dtype == "float32":
            return tf32_leads(g, pass_)
        in_place = pass_ == "grad_input" and _grad_input_in_place(g, dtype)
        limit = SPLIT_GEMM_LEADS_IN_PLACE if in_place else SPLIT_GEMM_LEADS
        return gemm.heuristic_splits(pass_, g, dtype, "strict") < limit

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        if pass_ == "grad_weight":
            found = tf32_weight_options(g, precision) if dtype == "float32" else grad_weight_options(g)
        else:
            found = options(g, pass_, dtype, precision)
            if layout == "nhwc" and mma_kind(dtype, precision) == _TF32:
                # A rounding copy of a channels_last source lets the copy engine land its halos, where in place the
                # producer warps round every element; it was faster on each dense layer timed, forward and
                # grad_input (NOTES v42: 1.25-2.3x), so every option copies, and in place is raced last: second,
                # it pushed the fastest copying tile of a DCGAN layer's grad_input out of the raced few.
                found = [dict(opts, copy=True) for opts in found] + [{}]
        return [Variant.make(self.name, **opts) for opts in found]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        kwargs = dict(variant.kwargs)
        if pass_ == "grad_weight" and dtype == "float32":
            tiles = TF32_WEIGHT_TILES if operand_parts(dtype, precision) == 1 else SPLIT_WEIGHT_TILES
            tile = tiles[kwargs["tile"]] if "tile" in kwargs else None
            return plan_grad_weight_tf32(g, sm_count, layout, tile, kwargs.get("stages"), precision, aligned)
        if pass_ == "grad_weight":
            if layout == "nhwc" and not aligned:
                partial, reduce = gemm.plan_grad_weight_gemm(g, dtype, sm_count, layout, aligned=False)
                return SplitK(partial, reduce)
            tile = WEIGHT_TILES[kwargs["tile"]] if "tile" in kwargs else None
            return plan_grad_weight(g, dtype, sm_count, layout, tile, kwargs.get("stages"))
        tile = TILES[kwargs["tile"]] if "tile" in kwargs else None
        forward = _mode(pass_) == 0
        if layout == "nhwc" and not aligned:
            # The halo copies need 16-byte aligned channel groups; an offset view takes the mma.sync GEMM.
            if forward:
                return gemm.plan_forward_gemm(g, dtype, has_bias, layout, precision, aligned=False, sm_count=sm_count)
            return gemm.plan_grad_input_gemm(g, dtype, layout, precision, aligned=False, sm_count=sm_count)
        # ``aligned`` covers a channels_last weight's pointer too (the engine's), which the kernel may read in place
        copy = bool(kwargs.get("copy", False))
        if forward:
            return plan_forward(g, dtype, has_bias, layout, tile, kwargs.get("stages"), sm_count, precision, aligned,
                                kwargs.get("split"), copy)
        return plan_grad_input(g, dtype, layout, tile, kwargs.get("stages"), sm_count, precision, aligned,
                               kwargs.get("split"), copy)

    def clear(self) -> None:
        plan_forward.cache_clear()
        plan_grad_input.cache_clear()
        plan_grad_weight.cache_clear()
        plan_grad_weight_tf32.cache_clear()
        _eligible.cache_clear()


@functools.lru_cache(maxsize=1024)
def _eligible(g: Geometry, dtype: str, pass_: str, precision: str) -> bool:
    return eligible(g, dtype, pass_, precision)


FAMILY = WgmmaFamily()
