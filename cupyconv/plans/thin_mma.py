"""The thin-output family: the NCHW float32 forward of layers with few output channels on the tensor cores.

A generator's RGB output layer (128 input channels up to 3, 4 x 4 at stride 2) runs its float32 forward on the
direct kernels, TAPS x C_out CUDA-core multiply-adds for each input value; the GEMM families need 16 output
channels and the wgmma kernel's thin tiles lost to the direct kernels in TF32.  Here each stride phase is an
mma.sync GEMM whose N is one n8 tile of output channels, fed from an input window staged once per channel chunk
and read by every tap through per-row ldmatrix addresses (``kernels/conv_transpose2d_forward_thin_mma.cu``).
TF32 only: strict float32 keeps the direct kernels.
"""
from __future__ import annotations

import functools
from typing import List

from ..core.device import MMA_SYNC, Device
from ..core.geometry import Geometry
from ..jit.compiler import KernelSpec
from ..tuning.variants import Variant
from . import gemm
from .family import Family
from .launch import Plan, cdiv, index_type, layer_constants, numel
from .sequences import OneKernel, PassPlan

THREADS = 128
PHASE_COLUMNS = 16          # output pixels of a phase row in a tile: one m16 tile
CHANNEL_CHUNK = 16          # input channels a stage: 64 bytes of float32 K
MAX_OUT_CHANNELS = 8        # one n8 tile
MAX_STRIDE = 4
MAX_TILES_A_WARP = 16       # phases x phase rows a warp accumulates (four registers each)
ROW_BYTES = 80              # a staged pixel's or weight row's channels, padded for ldmatrix
SMEM_LIMIT = 99 * 1024      # the least a block may opt in to on the sm_80+ GPUs the family runs on
WARPS = THREADS // 32
GRID_Y_LIMIT = 65535


def phase_rows(g: Geometry) -> int:
    """Phase rows of a tile (an m16 tile a phase each, every WARPS-th to a warp): 8 up to stride 2 x 2, whose
    four phases give a warp eight tiles; 4 past it (up to 16 tiles a warp at stride 4 x 4)."""
    return 8 if g.params.stride[0] * g.params.stride[1] <= 4 else 4


def window(g: Geometry, rows: int) -> tuple:
    """The input window a tile of ``rows`` phase rows reads: (rows, columns) of input pixels."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = g.kernel, g.params.stride, g.params.padding, g.params.dilation
    # (the lowest row a tap reaches, phase 0's last tap, to the highest, the last phase's tap 0; floor division)
    low_h, top_h = (ph - (kh - 1) * dh) // sh, (sh - 1 + ph) // sh
    low_w, top_w = (pw - (kw - 1) * dw) // sw, (sw - 1 + pw) // sw
    return rows + top_h - low_h, PHASE_COLUMNS + top_w - low_w


def smem_bytes(g: Geometry, rows: int) -> int:
    """Two stages of the window and the chunk's weights ([tap][8 output channels] rows), and the output tile."""
    wr, wc = window(g, rows)
    taps = g.kernel[0] * g.kernel[1]
    stage = (wr * wc + taps * 8) * ROW_BYTES
    sh, sw = g.params.stride
    return 2 * stage + g.out_channels * sh * rows * sw * PHASE_COLUMNS * 4


def eligible(g: Geometry, dtype: str, layout: str, precision: str) -> bool:
    """float32 at TF32 precision, NCHW, one group of at most :data:`MAX_OUT_CHANNELS` output channels and 16 or
    more input channels (a chunk's K), strides up to :data:`MAX_STRIDE`, and the two stages within
    :data:`SMEM_LIMIT`; a grid row of blocks an image (at most :data:`GRID_Y_LIMIT` images)."""
    sh, sw = g.params.stride
    rows = phase_rows(g)
    return (dtype == "float32" and precision == "tf32" and layout == "nchw" and g.groups == 1
            and g.out_channels <= MAX_OUT_CHANNELS and g.in_channels >= CHANNEL_CHUNK and g.batch <= GRID_Y_LIMIT
            and max(sh, sw) <= MAX_STRIDE and sh * sw * (rows // WARPS) <= MAX_TILES_A_WARP
            and smem_bytes(g, rows) <= SMEM_LIMIT)


@functools.lru_cache(maxsize=1024)
def plan_forward(g: Geometry, dtype: str, has_bias: bool, precision: str = "tf32") -> Plan:
    """A block a (tile, image): tiles of phase_rows x 16 pixels a phase, every phase."""
    if not eligible(g, dtype, "nchw", precision):
        raise ValueError("the thin-output forward runs NCHW float32 layers at TF32 precision of one group with at "
                         f"most {MAX_OUT_CHANNELS} output channels, {CHANNEL_CHUNK} or more input channels and "
                         f"strides up to {MAX_STRIDE}")
    rows = phase_rows(g)
    sh, sw = g.params.stride
    h_out, w_out = g.out_size
    tiles_h, tiles_w = cdiv(h_out, sh * rows), cdiv(w_out, sw * PHASE_COLUMNS)
    index_t = index_type(numel(g.input_shape), numel(g.output_shape), numel(g.weight_shape))
    constants = layer_constants(g, dtype, index_t)
    constants.update(HAS_BIAS=bool(has_bias), PR=rows)
    spec = KernelSpec.make("conv_transpose2d_forward_thin_mma.cu", "conv_transpose2d_forward_thin_mma", constants)
    h, w = g.in_size
    return Plan(spec, (tiles_h * tiles_w, g.batch, 1), (THREADS, 1, 1), (h, w, h_out, w_out, tiles_w), index_t,
                smem_bytes=smem_bytes(g, rows))


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
        # scalar loads and stores only: any alignment
        return OneKernel(plan_forward(g, dtype, has_bias, precision))

    def clear(self) -> None:
        for planner in (plan_forward, _eligible):
            planner.cache_clear()


@functools.lru_cache(maxsize=1024)
def _eligible(g: Geometry, dtype: str, layout: str, precision: str) -> bool:
    return eligible(g, dtype, layout, precision)


FAMILY = ThinMmaFamily()
