"""GEMMs over every tap on Hopper wgmma: the one-tap layers' forward with a scattering epilogue
(``kernels/conv_transpose2d_scatter_gemm.cu``), and grad_input with a gathering prologue
(``kernels/conv_transpose2d_gather_gemm.cu``).

A one-tap layer (kernel == stride, U-Net's 2 x 2 stride-2 upsampling; a 1 x 1 input, a generator's first layer;
1 x 1 kernels) is a plain GEMM: input pixels x input channels times input channels x (tap, output channel),
each product element landing on one output pixel.  grad_input of any layer is that GEMM transposed, input pixels
x (tap, output channel) times the weight, each row gathering the grad_output pixels its input pixel's taps land on
(an implicit GEMM; where taps overlap, a grad_output pixel is gathered once for each tap that lands on it).  The
halo-tile kernels run these layers per stride phase, storing each tile while their tensor cores wait; here two
consumer warpgroups take turns, one storing while the other multiplies.  fp16 and bf16 on exactly sm_90, and
grad_input of float32 at TF32 precision too (the forward's B is MN-major, which TF32 cannot read; grad_input's
operands are both K-major); one group.  A contiguous weight is copied into channels_last order first, an NCHW
activation into channels_last scratch; TF32 operands arrive rounded to nearest, through those copies or through
a rounding copy of each operand read in place.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..core.device import ASSUMED, WGMMA, Device
from ..core.geometry import Geometry, phase_taps
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import gemm, tensor_map, wgmma
from .family import Family
from .launch import Plan, cdiv, index_type, layer_constants, numel
from .sequences import PackedGemm, PassPlan

ROW_BYTES = 128   # a step's row: a pixel's channels (A), an input channel's columns (B); 64 16-bit values, 32 TF32
TMA_COORDINATE_LIMIT = 2 ** 31   # the copy engine's box coordinates are signed 32-bit
MASK_TAPS = 16    # a gathered row's landing kernel rows and columns are two 16-bit masks
HALF = ("float16", "bfloat16")
FORWARD, GRAD_INPUT = "forward", "grad_input"


@dataclass(frozen=True)
class ScatterTile:
    """A tile of ``64 * mb`` input pixels x ``bn`` columns (the forward's (tap, output channel) pairs,
    grad_input's input channels), held whole in one consumer warpgroup's accumulators (``mb * bn / 2`` registers
    a thread)."""

    mb: int
    bn: int

    @property
    def name(self) -> str:
        return f"{64 * self.mb}x{self.bn}"

    @property
    def registers_a_twice(self) -> bool:
        """Whether a consumer thread holds two steps of TF32 A words (16 a 64-pixel block) beside its
        accumulators, as the in-place gather does where they fit (the kernel's ``A_SETS``)."""
        return self.mb * self.bn // 2 + 2 * self.mb * 16 <= 160

    def stage_bytes(self) -> int:
        # A: one row a pixel; B: BN x 128 bytes (the forward's 64-column blocks of 64 channels, grad_input's rows)
        return ROW_BYTES * (64 * self.mb + self.bn)


TILES: Dict[str, ScatterTile] = {t.name: t for t in (ScatterTile(2, 128), ScatterTile(1, 256), ScatterTile(1, 128),
                                                     ScatterTile(2, 64))}
HEURISTIC = TILES["128x128"]
# grad_input's tile where the heuristic's make under half a wave (heuristic_tile)
FEW_TILES = TILES["64x128"]
MAX_STAGES = 8
# Heuristic tiles an SM from which the family leads (ScatterGemmFamily.leads), by pass
LEAD_WAVES = {FORWARD: 2.0, GRAD_INPUT: 0.5}


def one_tap(g: Geometry) -> bool:
    """Whether every output pixel receives exactly one tap: along each axis the taps of neighbouring input pixels
    neither overlap nor leave gaps (kernel == stride, or a single input pixel), they are not dilated apart, and
    output padding stays inside the cropped border (so no output pixel goes without a tap)."""
    p = g.params
    for axis in range(2):
        k, s, d = g.kernel[axis], p.stride[axis], p.dilation[axis]
        if not (d == 1 or k == 1) or p.output_padding[axis] > p.padding[axis]:
            return False
        if k != s and g.in_size[axis] != 1:
            return False
    return True


def gathers(g: Geometry) -> bool:
    """Whether grad_input's gather GEMM takes the layer: any kernel, stride and dilation (its K runs over every
    tap), but where the padding may crop a tap and grad_output does not land as copy-engine boxes
    (:func:`grad_output_boxes`), a gathered row keeps its landing taps as masks of :data:`MASK_TAPS` bits."""
    crops = any(g.params.padding)
    return not crops or grad_output_boxes(g) or max(g.kernel) <= MASK_TAPS


def eligible(g: Geometry, dtype: str, pass_: str = FORWARD, precision: str = "strict") -> bool:
    """fp16 or bf16, or for grad_input float32 at TF32 precision; one group, input channels and (tap, output
    channel) columns in whole 16-byte runs and an even number of output channels, within the tensor-core kernels'
    limits, fewer input pixels than the copy engine's coordinates reach, and a layer the pass's kernel takes: the
    forward :func:`one_tap`, grad_input :func:`gathers`."""
    if pass_ == FORWARD:
        takes = dtype in HALF and one_tap(g)
    else:
        takes = (dtype in HALF or (dtype == "float32" and precision == "tf32")) and gathers(g)
    return (takes and g.groups == 1 and g.in_channels % 8 == 0 and g.out_channels % 8 == 0
            and gemm.gemm_fits(g, dtype) and pixel_count(g) < TMA_COORDINATE_LIMIT)


def row_elements(dtype: str) -> int:
    """Values in a step's 128-byte row: 64 of fp16 or bf16, 32 of float32."""
    return ROW_BYTES // (4 if dtype == "float32" else 2)


def overlap_leads(g: Geometry) -> bool:
    """Whether grad_input of a layer whose taps overlap runs the gather ahead of the halo tiles: 128 input
    channels or more, and at most two taps a stride phase along each axis (DCGAN's and pix2pix's 4 x 4 stride-2
    layers).  There (NOTES v44, v45) its heuristic beat the halo tiles' 1.3-2.7x; a phase of many taps shares
    the halo tile's pixels among them, which the gather reads again for each."""
    p = g.params
    return g.in_channels >= 128 and all(phase_taps(g.kernel[a], p.stride[a], p.dilation[a]) <= 2 for a in range(2))


def stages_for(tile: ScatterTile) -> int:
    """The deepest ring of steps (A and B tiles) that fits shared memory."""
    return min(MAX_STAGES, wgmma.SMEM_LIMIT // tile.stage_bytes())


def columns(g: Geometry, pass_: str = FORWARD) -> int:
    """The GEMM's N: the forward's (tap, output channel) pairs, grad_input's input channels."""
    return g.kernel[0] * g.kernel[1] * g.out_channels if pass_ == FORWARD else g.in_channels


def pixel_count(g: Geometry) -> int:
    """The GEMM's M: input pixels of every image."""
    return g.batch * g.in_size[0] * g.in_size[1]


def grad_output_boxes(g: Geometry) -> bool:
    """Whether grad_input's A lands as copy-engine boxes of grad_output: a step of 64 columns stays within one
    tap (output channels in multiples of 64), and the copy engine walks the stride (8 at most)."""
    return g.out_channels % 64 == 0 and max(g.params.stride) <= tensor_map.MAX_ELEMENT_STRIDE


def pixel_box(g: Geometry, tile: ScatterTile) -> Tuple[int, int, int]:
    """grad_input's tile of ``64 * tile.mb`` pixels as (images, rows, columns), powers of two: the fewest tiles
    (the least of them past the layer's edges), then sides within the image, then the longest rows; with
    :func:`grad_output_boxes`, a box the copy engine takes at the stride."""
    pixels = 64 * tile.mb
    sh, sw = g.params.stride
    boxes = grad_output_boxes(g)
    best: Optional[Tuple[tuple, Tuple[int, int, int]]] = None
    sides = [1 << e for e in range(pixels.bit_length())]
    for cols in sides:
        for rows in (r for r in sides if cols * r <= pixels):
            if boxes and (sw * cols > tensor_map.MAX_BOX or sh * rows > tensor_map.MAX_BOX):
                continue
            images = pixels // (cols * rows)
            count = cdiv(g.batch, images) * cdiv(g.in_size[0], rows) * cdiv(g.in_size[1], cols)
            key = (count, cols > g.in_size[1], rows > g.in_size[0], -cols, -rows)
            if best is None or key < best[0]:
                best = (key, (images, rows, cols))
    assert best is not None
    return best[1]


def tile_count(g: Geometry, tile: ScatterTile, pass_: str = FORWARD) -> int:
    if pass_ == FORWARD:
        return cdiv(pixel_count(g), 64 * tile.mb) * cdiv(columns(g), tile.bn)
    images, rows, cols = pixel_box(g, tile)
    pixel_tiles = cdiv(g.batch, images) * cdiv(g.in_size[0], rows) * cdiv(g.in_size[1], cols)
    return pixel_tiles * cdiv(columns(g, pass_), tile.bn)


def heuristic_tile(g: Geometry, pass_: str = FORWARD) -> ScatterTile:
    """:data:`HEURISTIC`, but for grad_input where it makes fewer than half a wave of tiles, :data:`FEW_TILES`
    (twice as many): on pix2pix's 8² layer (64 tiles) that tile ran 1.4x faster in bf16 and 1.1-1.3x in TF32
    (NOTES v45, v46), while on layers of a wave or more (DCGAN's 128 tiles) the 128-pixel tiles ran as fast or
    faster."""
    if pass_ == GRAD_INPUT and tile_count(g, HEURISTIC, pass_) < LEAD_WAVES[GRAD_INPUT] * ASSUMED.sm_count:
        return FEW_TILES
    return HEURISTIC


def _mostly_padding(g: Geometry, tile: ScatterTile, pass_: str) -> bool:
    return tile.bn > 64 and columns(g, pass_) <= tile.bn // 2


def options(g: Geometry, pass_: str = FORWARD, dtype: str = "float16", layout: str = "nchw") -> List[Dict[str, object]]:
    """The heuristic, then the other tiles whose columns are not mostly padding.  TF32 grad_input of a
    channels_last grad_output (:func:`reads_in_place`) reads it in place first: :func:`in_place_tile`, then the
    other tiles that hold two steps of A in registers, then the rounding copy's heuristic and other tiles."""
    heuristic = heuristic_tile(g, pass_)
    found: List[Dict[str, object]] = [{}] + [{"tile": t.name} for t in TILES.values()
                                             if t != heuristic and not _mostly_padding(g, t, pass_)]
    if not reads_in_place(pass_, dtype, layout):
        return found
    first = in_place_tile(g)
    in_place = [{"tile": first.name, "inplace": True}] + [
        {"tile": t.name, "inplace": True} for t in TILES.values()
        if t != first and t.registers_a_twice and not _mostly_padding(g, t, pass_)]
    return in_place[:2] + found + in_place[2:]


def in_place_tile(g: Geometry) -> ScatterTile:
    """The tile that reads grad_output in place: :func:`heuristic_tile` where it holds two steps of A in
    registers (its consumers then keep a step's MMAs in flight while they load the next), else the 64 x 256 tile
    of as many accumulators, or 64 x 128 where 256 columns would be mostly padding.  On U-Net's one-tap layers
    in TF32 (8 and 16 images of 256 x 64², 8 of 512 x 32², NOTES v47) the 64 x 256 tile read in place ran 1.3-1.7x
    faster than the rounding copy's best tile, and the 128 x 128 tile, one set of A and a wait for each step's
    MMAs, 0.94-1.29x; on 8 x 1024 x 16² and DCGAN's 64 x 512 x 8² it tied with the copy's (64.3 against 69.6, 68.1
    against 67.0 µs)."""
    heuristic = heuristic_tile(g, GRAD_INPUT)
    if heuristic.registers_a_twice:
        return heuristic
    wide = TILES["64x256"]
    return TILES["64x128"] if _mostly_padding(g, wide, GRAD_INPUT) else wide


def reads_in_place(pass_: str, dtype: str, layout: str) -> bool:
    """Whether the ``inplace`` option applies: TF32 grad_input of a channels_last grad_output, which the
    consumers then round in registers in place of a rounding copy (an NCHW one needs its channels_last copy,
    which rounds on the way, and 16-bit operands need no rounding)."""
    return pass_ == GRAD_INPUT and dtype == "float32" and layout == "nhwc"


KERNELS = {FORWARD: "conv_transpose2d_scatter_gemm", GRAD_INPUT: "conv_transpose2d_gather_gemm"}


def _gemm_plan(g: Geometry, dtype: str, pass_: str, tile: Optional[ScatterTile], sm_count: int,
               **constants: object) -> Plan:
    """The pass's GEMM: persistent blocks, about one an SM, on the layer seen with its weight in channels_last
    order (the order either kernel reads)."""
    if not eligible(g, dtype, pass_, "tf32"):
        raise ValueError("the scatter and gather GEMMs run fp16 and bf16 layers of one group with input and output "
                         "channels in multiples of 8 (grad_input float32 ones too, at TF32), the scatter forward "
                         "those whose output pixels each receive one tap")
    tile = tile or heuristic_tile(g, pass_)
    stages = stages_for(tile)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), g.in_channels * columns(g))
    layer = layer_constants(g.with_weight_channels_last(), dtype, index_t)
    layer.update(MMA_KIND=wgmma.mma_kind(dtype, "tf32"), MB=tile.mb, BN=tile.bn, STAGES=stages, **constants)
    spec = KernelSpec.make(KERNELS[pass_] + ".cu", KERNELS[pass_], layer, wgmma.TARGET)
    blocks = max(1, min(tile_count(g, tile, pass_), sm_count))
    sizes = (g.batch,) + g.in_size + g.out_size
    if pass_ == FORWARD:
        maps = (pixel_rows_map(g, dtype, tile), weight_columns_map(g, dtype))
    else:
        maps = (weight_box_map(g, dtype, tile),) + ((grad_output_map(g, dtype, tile),) if grad_output_boxes(g) else ())
    return Plan(spec, (blocks, 1, 1), (384, 1, 1), sizes, index_t, smem_bytes=stages * tile.stage_bytes(),
                tensor_maps=maps)


def _weight_order(g: Geometry, dtype: str) -> Optional[Plan]:
    """A contiguous weight's copy into channels_last order, (C_in, C_out, kH, kW) -> (C_in, kH, kW, C_out): the
    activation copy's NCHW -> NHWC with C_in as the batch.  float32 (TF32) words are rounded on the way, and a
    channels_last float32 weight is copied rounded in place of being read in place."""
    tf32 = dtype == "float32"
    if g.weight_channels_last:
        return gemm.plan_round_tf32(numel(g.weight_shape)) if tf32 else None
    return gemm.plan_to_channels_last(g.in_channels, g.out_channels, g.kernel[0] * g.kernel[1], dtype,
                                      round_tf32=tf32)


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw", tile: Optional[ScatterTile] = None,
                 sm_count: int = 132) -> PackedGemm:
    """The forward as one GEMM that scatters its products, after the weight's copy into channels_last order where
    it is contiguous and the input's into channels_last scratch where it is NCHW."""
    main = _gemm_plan(g, dtype, FORWARD, tile, sm_count, DST_CL=layout == "nhwc", HAS_BIAS=bool(has_bias))
    to_cl = gemm.plan_to_channels_last(g.batch, g.in_channels, g.in_size[0] * g.in_size[1], dtype) \
        if layout == "nchw" else None
    return PackedGemm(_weight_order(g, dtype), main, to_cl)


def _matrix_map(pointer: int, dtype: str, rows: int, columns: int, box: Tuple[int, int]) -> tensor_map.TensorMap:
    """A row-major matrix of 16-bit values as the copy engine sees it: a one-image, one-row channels_last tensor of
    ``rows`` pixels of ``columns`` channels, copied in boxes of ``box`` (columns, rows) whose 128-byte rows land
    swizzled as the kernels' descriptors read them."""
    return tensor_map.channels_last(pointer, dtype, (1, columns, 1, rows), box + (1, 1))


def pixel_rows_map(g: Geometry, dtype: str, tile: ScatterTile) -> tensor_map.TensorMap:
    """The forward's A: the channels_last input (the main launch's first pointer) as pixels x input channels, a
    box of the tile's pixels by one step's 64 channels."""
    return _matrix_map(0, dtype, pixel_count(g), g.in_channels, (row_elements(dtype), 64 * tile.mb))


def weight_columns_map(g: Geometry, dtype: str) -> tensor_map.TensorMap:
    """The forward's B: the channels_last weight (the second pointer) as input channels x (tap, output channel)
    columns, a box of 64 columns by one step's 64 input channels for each 64-column block of a tile."""
    return _matrix_map(1, dtype, g.in_channels, columns(g), (64, row_elements(dtype)))


def weight_box_map(g: Geometry, dtype: str, tile: ScatterTile) -> tensor_map.TensorMap:
    """grad_input's B: the channels_last weight (the main launch's second pointer) as C_in rows of (tap, output
    channel) columns, copied a box of the tile's input channels by one step's 64 columns (128 bytes, swizzled as
    the kernel's descriptors read them)."""
    return _matrix_map(1, dtype, g.in_channels, columns(g), (row_elements(dtype), tile.bn))


def grad_output_map(g: Geometry, dtype: str, tile: ScatterTile) -> tensor_map.TensorMap:
    """grad_input's A (:func:`grad_output_boxes`): the channels_last grad_output (the main launch's first pointer),
    a box of one step's 64 channels at the tile's pixels' tap, walked at the stride."""
    images, rows, cols = pixel_box(g, tile)
    sh, sw = g.params.stride
    return tensor_map.channels_last(0, dtype, g.output_shape, (row_elements(dtype), sw * cols, sh * rows, images),
                                    (1, sw, sh, 1))


@functools.lru_cache(maxsize=1024)
def plan_grad_input(g: Geometry, dtype: str, layout: str = "nchw", tile: Optional[ScatterTile] = None,
                    sm_count: int = 132, in_place: bool = False) -> PackedGemm:
    """grad_input as one GEMM whose A rows gather each input pixel's taps from grad_output, after the weight's
    copy into channels_last order where it is contiguous and grad_output's into channels_last scratch where it
    is NCHW (the copy 16-bit grad_weight shares).  float32 runs at TF32 on operands rounded by those copies, or
    by a rounding copy of a channels_last grad_output or weight; ``in_place`` (:func:`reads_in_place`) reads
    such a grad_output as it is, the consumers rounding A in registers."""
    if in_place and not reads_in_place(GRAD_INPUT, dtype, layout):
        raise ValueError("the gather GEMM reads grad_output in place, rounding it in registers, for float32 "
                         f"(TF32) in channels_last only, not {dtype} in {layout}")
    tile = tile or heuristic_tile(g, GRAD_INPUT)
    _, rows, cols = pixel_box(g, tile)
    main = _gemm_plan(g, dtype, GRAD_INPUT, tile, sm_count, DST_CL=layout == "nhwc", A_BOXES=grad_output_boxes(g),
                      BOX_H=rows, BOX_W=cols, A_IN_PLACE=in_place)
    tf32 = dtype == "float32"
    if layout == "nchw":
        to_cl = gemm.plan_to_channels_last(g.batch, g.out_channels, g.out_size[0] * g.out_size[1], dtype,
                                           round_tf32=tf32)
    else:
        to_cl = gemm.plan_round_tf32(numel(g.output_shape)) if tf32 and not in_place else None
    return PackedGemm(_weight_order(g, dtype), main, to_cl)


class ScatterGemmFamily(Family):
    name = "scatter_gemm"
    passes = (FORWARD, GRAD_INPUT)
    max_variants = 4

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """sm_90 exactly (sm_90a code), the tensor cores switched on, and :func:`eligible`."""
        return (device.tensor_cores == WGMMA and device.arch == "90" and gemm.enabled()
                and _eligible(g, dtype, pass_, precision))

    def leads(self, pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict") -> bool:
        """Where its heuristic tile (:func:`heuristic_tile`) makes :data:`LEAD_WAVES` tiles an SM or more, and for
        the forward only in NCHW.  The forward beat the halo-tile kernel on U-Net's upsampling layers by up to 1.7x on the H100 (NOTES
        v25), before that kernel took its operands from the copy engine; on the H200 at eb2ff25 (NOTES v44) the
        halo-tile kernel's heuristic beat it on the three of those layers where it led in channels_last
        (1.12-1.45x, either weight layout), while in NCHW it still won the 64² and 128² grids (1.27x, 1.54x) and
        lost the 32² one by 1.13x.
        grad_input (NOTES v43, H200) beat the halo-tile kernel's heuristic 1.5-2.9x on U-Net's four upsampling
        layers down to 128 tiles (1024 input channels of 16 x 16 pixels), and lost 12x to the split GEMM on a
        1 x 1 input (4 tiles of 128 steps); where taps overlap, only on layers :func:`overlap_leads` picks.
        TF32 grad_input follows the same rules: on DCGAN's, pix2pix's, HiFi-GAN's and a 64² layer of two taps a
        phase it ran 1.2-3.0x faster than the heuristic of the family that led before, in both layouts (NOTES v46).
        Elsewhere it races them."""
        if pass_ == FORWARD and layout != "nchw":
            return False
        if pass_ == GRAD_INPUT and not one_tap(g) and not overlap_leads(g):
            return False
        return tile_count(g, heuristic_tile(g, pass_), pass_) >= LEAD_WAVES[pass_] * ASSUMED.sm_count

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        return [Variant.make(self.name, **opts) for opts in options(g, pass_, dtype, layout)]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        if dtype == "float32" and precision != "tf32":
            raise ValueError(f"the gather GEMM multiplies float32 at TF32 precision only, not {precision!r}")
        if not aligned:
            # Its copies need 16-byte aligned channel runs: channels_last activations, a weight read in place.
            if pass_ == FORWARD:
                return gemm.plan_forward_gemm(g, dtype, has_bias, layout, precision, aligned=False, sm_count=sm_count)
            return gemm.plan_grad_input_gemm(g, dtype, layout, precision, aligned=False, sm_count=sm_count)
        name = variant.kwargs.get("tile")
        tile = TILES[name] if name else None
        in_place = bool(variant.kwargs.get("inplace", False))
        if pass_ == FORWARD:
            if in_place:
                raise ValueError("the scatter forward reads its input in place already: no inplace option")
            return plan_forward(g, dtype, has_bias, layout, tile, sm_count)
        return plan_grad_input(g, dtype, layout, tile, sm_count, in_place)

    def clear(self) -> None:
        plan_forward.cache_clear()
        plan_grad_input.cache_clear()
        _eligible.cache_clear()


@functools.lru_cache(maxsize=1024)
def _eligible(g: Geometry, dtype: str, pass_: str, precision: str) -> bool:
    return eligible(g, dtype, pass_, precision)


FAMILY = ScatterGemmFamily()
