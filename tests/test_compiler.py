"""NVRTC compilation of every kernel template, dtype and variant, with no GPU.

The architecture is given explicitly, so this runs on CI machines without a device.
"""
import itertools
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from cupyconv.core import dtypes
from cupyconv.jit import compiler
from cupyconv.plans import (depthwise, direct, expanded_taps, gemm, grouped_mma, launch, reduction, scatter_gemm,
                            table, thin_mma, wgmma)
from cupyconv.jit.compiler import KernelCompileError, KernelSpec, compile_ptx
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.tuning.variants import Variant

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

ARCHS = ("compute_80", "compute_90")
# Specs built for one architecture only (KernelSpec.target) compile for its virtual architecture
# alone: sm_90a code (wgmma) exists for no other GPU.
TARGET_ARCHS = {"sm_90a": "compute_90a"}
WGMMA_TEMPLATE = "conv_transpose2d_wgmma.cu"
WGMMA_GRAD_WEIGHT_TEMPLATE = "conv_transpose2d_grad_weight_wgmma.cu"
WGMMA_TF32_WEIGHT_TEMPLATE = "conv_transpose2d_grad_weight_wgmma_tf32.cu"
SCATTER_GEMM_TEMPLATE = "conv_transpose2d_scatter_gemm.cu"
GATHER_GEMM_TEMPLATE = "conv_transpose2d_gather_gemm.cu"
HOPPER_TEMPLATES = (WGMMA_TEMPLATE, WGMMA_GRAD_WEIGHT_TEMPLATE, WGMMA_TF32_WEIGHT_TEMPLATE, SCATTER_GEMM_TEMPLATE,
                    GATHER_GEMM_TEMPLATE)
DTYPES = dtypes.NAMES

# Layers chosen to reach every tiling branch of the planners: one or many stride phases,
# one or several kernel-row blocks for grad_weight, channel blocks that do and do not
# divide the group, depthwise, staged and plain forward stores, chunked weights, and
# 64-bit offsets.
VARIANT_LAYERS = {
    "dense_3x5": ((2, 8, 9, 11), (8, 16, 3, 5), dict()),
    "strided_2x3_grouped": ((2, 8, 9, 11), (8, 3, 3, 5), dict(stride=(2, 3), padding=(1, 2), groups=4,
                                                              dilation=(2, 1), output_padding=(1, 0))),
    "stride_4_depthwise": ((1, 6, 7, 7), (6, 1, 4, 4), dict(stride=4, groups=6)),
    "stride_6_kernel_11": ((1, 2, 5, 5), (2, 5, 11, 11), dict(stride=6, dilation=2, padding=3)),
    "huge_64bit": ((1, 1, 50000, 50000), (1, 2, 2, 2), dict(stride=2)),
    # forward output runs too long to stage through shared memory; grad_output windows
    # too wide to share between pixels
    "stride_17": ((1, 3, 3, 4), (3, 2, 3, 2), dict(stride=(17, 18), padding=(1, 2), output_padding=(5, 3))),
    # weights staged in several chunks
    "chunked_weights": ((2, 40, 5, 6), (40, 12, 5, 9), dict(stride=(1, 2), padding=(2, 4), dilation=(1, 3))),
    # too large for the direct kernels: the large_kernel family
    "kernel_101": ((2, 4, 5, 6), (4, 3, 101, 101), dict(stride=(2, 1), dilation=(1, 2), padding=3, groups=2)),
}


def _plans():
    seen = {}
    for layer, (x_shape, w_shape, kwargs) in VARIANT_LAYERS.items():
        g = geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))
        for dtype in DTYPES:
            for bias in (False, True):
                for layout in launch.LAYOUTS:
                    for plan in table.all_plans(g, dtype, bias, layout,
                                                families_named=("direct", "tiled", "large_kernel", "reduction")):
                        seen.setdefault(plan.spec, f"{layer}-{dtype}-{layout}-{plan.spec.function}-{plan.index_t}")
        # a channels_last weight, read and written in place (weight_index): every direct, tiled and large kernel
        for layout in launch.LAYOUTS:
            for plan in table.all_plans(g.with_weight_channels_last(), "float32", True, layout,
                                        families_named=("direct", "tiled", "large_kernel")):
                seen.setdefault(plan.spec, f"{layer}-weight_cl-{layout}-{plan.spec.function}-{plan.index_t}")
    return seen


# The tensor-core kernels: every dtype/precision, both layouts, every block tile, and
# both index widths.
GEMM_LAYERS = {
    "gemm_dense_3x5": ((2, 32, 9, 11), (32, 48, 3, 5), dict()),
    "gemm_strided_grouped": ((2, 64, 9, 11), (64, 16, 4, 3), dict(stride=(2, 3), padding=(1, 0), groups=2,
                                                                  dilation=(1, 2), output_padding=(1, 2))),
    "gemm_huge_64bit": ((1, 16, 24000, 24000), (16, 16, 2, 2), dict(stride=2)),
    # channel runs that are not whole 16-byte vectors: the element-gathering fallback
    "gemm_odd_channels": ((2, 20, 7, 9), (20, 18, 3, 3), dict(stride=2, padding=1)),
}
GEMM_CASES = (("float16", "strict"), ("bfloat16", "strict"), ("float32", "strict"), ("float32", "tf32"))


def _gemm_plans():
    seen = {}
    for layer, (x_shape, w_shape, kwargs) in GEMM_LAYERS.items():
        g = geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))
        for (dtype, precision), layout in itertools.product(GEMM_CASES, launch.LAYOUTS):
            plans = table.all_plans(g, dtype, True, layout, precision, families_named=("gemm",))
            plans += [p for p in reduction.plan_grad_bias(g, dtype, 132, layout) if p is not None]
            for plan in plans:
                seen.setdefault(plan.spec, f"{layer}-{dtype}-{precision}-{layout}-{plan.spec.function}-{plan.index_t}")
    g = geometry(*GEMM_LAYERS["gemm_dense_3x5"][:2], None, ConvParams.from_args())
    for tile in gemm.TILES.values():
        for plan in (gemm.plan_forward_gemm(g, "float16", False, "nhwc", tile=tile).gemm,
                     gemm.plan_grad_input_gemm(g, "bfloat16", "nchw", tile=tile).gemm,
                     gemm.plan_grad_weight_gemm(g, "float32", 132, "nchw", "tf32", tile=tile)[0]):
            seen.setdefault(plan.spec, f"tile-{tile.name}-{plan.spec.function}")
        vec = gemm.plan_grad_weight_gemm(g, "float16", 132, "nhwc", tile=tile)[0]
        seen.setdefault(vec.spec, f"tile-{tile.name}-vector-{vec.spec.function}")
    # a channels_last weight: read in place in 16 bits (both modes, every tile), packed in float32 (both modes), and
    # grad_weight's stores
    for dtype, precision in (("bfloat16", "strict"), ("float32", "strict")):
        for plan in table.all_plans(g.with_weight_channels_last(), dtype, False, "nhwc", precision,
                                    families_named=("gemm",)):
            seen.setdefault(plan.spec, f"gemm_dense_3x5-weight_cl-{dtype}-{plan.spec.function}-{plan.index_t}")
    for tile in gemm.TILES.values():
        plan = gemm.plan_forward_gemm(g.with_weight_channels_last(), "float16", True, "nchw", tile=tile).gemm
        seen.setdefault(plan.spec, f"tile-{tile.name}-weight_in_place-{plan.spec.function}")
    for stages in gemm.STAGE_CHOICES:
        for plan in (gemm.plan_forward_gemm(g, "float16", True, "nchw", stages=stages).gemm,
                     gemm.plan_grad_input_gemm(g, "float32", "nhwc", "tf32", stages=stages).gemm,
                     gemm.plan_grad_weight_gemm(g, "bfloat16", 132, "nchw", stages=stages)[0]):
            seen.setdefault(plan.spec, f"stages-{stages}-{plan.spec.function}")
    return seen


# Hopper's wgmma forward (sm_90a): both kinds, both layouts, bias on and off, several block
# tiles, stride phases (some without taps), channel groups and output channels that are not
# whole 16-byte runs, several images a tile, and 64-bit offsets.
WGMMA_LAYERS = {
    "wgmma_dense_3x5": ((2, 64, 9, 11), (64, 48, 3, 5), dict(padding=(1, 2))),
    "wgmma_strided_grouped": ((2, 48, 7, 9), (48, 20, 4, 3), dict(stride=(2, 3), padding=(1, 0), groups=2,
                                                                   dilation=(1, 2), output_padding=(1, 2))),
    "wgmma_empty_phases": ((1, 16, 6, 5), (16, 136, 2, 3), dict(stride=(3, 4))),
    "wgmma_small_grid": ((5, 32, 8, 8), (32, 64, 4, 4), dict(stride=2, padding=1)),   # 4 images a tile
    "wgmma_huge_64bit": ((1, 16, 24000, 24000), (16, 16, 2, 2), dict(stride=2)),
    # one input row (a 1-D layer): one-row patches
    "wgmma_one_row": ((2, 64, 1, 300), (64, 48, 1, 16), dict(stride=(1, 8), padding=(0, 4))),
}
WGMMA_CASES = (("float16", "nchw", True), ("bfloat16", "nhwc", False), ("float16", "nhwc", False),
               ("bfloat16", "nchw", True))


def _wgmma_layer(name):
    x_shape, w_shape, kwargs = WGMMA_LAYERS[name]
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


def _layer(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


# grad_input on the wgmma kernel (MODE 1, a strided conv2d of grad_output with its halo in SH x SW phase
# planes): strides 1 to 3 (3 with a 3 x 3 kernel), a kernel smaller than the stride, groups with an odd
# number of grad_in channels (single-element stores), several images a tile, and 64-bit offsets.
WGMMA_GRAD_INPUT_LAYERS = {
    "wgmma_dense_3x5": _wgmma_layer("wgmma_dense_3x5"),
    "wgmma_grad_stride2": _layer((2, 64, 9, 11), (64, 48, 3, 5), stride=2, padding=1),
    "wgmma_grad_stride3_k3": _layer((2, 32, 10, 13), (32, 40, 3, 3), stride=3, padding=1, output_padding=2),
    "wgmma_grad_grouped_odd": _layer((3, 34, 7, 9), (34, 16, 4, 3), stride=(2, 3), padding=(1, 0), groups=2,
                                     dilation=(1, 2), output_padding=(1, 2)),
    "wgmma_empty_phases": _wgmma_layer("wgmma_empty_phases"),
    "wgmma_small_grid": _wgmma_layer("wgmma_small_grid"),
    "wgmma_huge_64bit": _wgmma_layer("wgmma_huge_64bit"),
    "wgmma_one_row": _wgmma_layer("wgmma_one_row"),
}
# tiles the heuristic does not pick for these layers: one and two consumer warpgroups, N of 64 to 256
WGMMA_GRAD_INPUT_TILES = (("wgmma_dense_3x5", "16x16x128"), ("wgmma_dense_3x5", "8x16x256"),
                          ("wgmma_grad_stride2", "32x16x64"), ("wgmma_grad_stride3_k3", "8x8x64"),
                          ("wgmma_small_grid", "2i8x8x128"))


# grad_weight on wgmma: every tile on a 4 x 4 stride-2 layer (four taps a stride phase), a 3 x 5 stride-1 one
# (15 taps, a halo two rows and four columns wider) and a 2 x 2 stride-2 one (one tap a phase), in fp16 and bf16
WGMMA_GRAD_WEIGHT_LAYERS = {
    "4x4_stride2": _layer((4, 128, 12, 10), (128, 64, 4, 4), stride=2, padding=1),
    "3x5_stride1": _wgmma_layer("wgmma_dense_3x5"),
    "2x2_stride2": _layer((2, 256, 9, 7), (256, 128, 2, 2), stride=2),
    # dilation 2 at stride 2: three taps a phase, so two-tap groups, the last one half full
    "3x1_dilated": _layer((2, 64, 9, 9), (64, 128, 3, 1), stride=2, padding=1, dilation=2),
    # one 8 x 8 pixel tile: a single K range, whose tap-major partial the reduce still transposes
    "one_tile": _layer((1, 64, 8, 8), (64, 64, 4, 4), stride=2, padding=1),
    # one tile of a 1x1 kernel: the single K range writes grad_weight itself
    "one_tile_1x1": _layer((1, 64, 8, 8), (64, 64, 1, 1), stride=2),
    # 20 rows: the 16-row tiles too, their last K step half past the input
    "tall_4x4": _layer((2, 64, 20, 12), (64, 64, 4, 4), stride=2, padding=1),
    # one input row (a 1-D layer, two taps a phase): K steps of 1 x 64 pixels, the last one partly past the row
    "one_row_1d": _layer((2, 64, 1, 300), (64, 64, 1, 16), stride=(1, 8), padding=(0, 4)),
    # three input rows, a 3 x 3 kernel at stride 2: one-row K steps whose halo spans two grad_out rows
    "three_rows": _layer((2, 64, 3, 150), (64, 128, 3, 3), stride=2, padding=1),
}
# TF32 grad_weight's K steps follow the input's size: 2 x 8 pixels, 4 x 4, 2 x 2 with four image groups, and
# one row of two with image groups (a 1 x 1 input); channels in no whole 16-byte runs, and a 64-bit layer
WGMMA_TF32_WEIGHT_LAYERS = {
    **{name: WGMMA_GRAD_WEIGHT_LAYERS[name] for name in ("4x4_stride2", "3x5_stride1", "3x1_dilated", "one_tile_1x1")},
    "4x4_input": _layer((128, 136, 4, 4), (136, 72, 4, 4), stride=2, padding=1),
    "2x2_input": _layer((16, 64, 2, 2), (64, 48, 4, 4), stride=2, padding=1),
    "1x1_input_grouped": _layer((9, 34, 1, 1), (34, 17, 3, 3), stride=1, padding=1, groups=2),
    "huge_64bit": _layer((4096, 64, 64, 128), (64, 16, 2, 2), stride=2),
    # one K step of a 1x1 kernel: the single K range writes grad_weight itself
    "one_step_1x1": _layer((4, 64, 2, 8), (64, 64, 1, 1), stride=2),
}

def _wgmma_plans():
    seen = {}

    def add(label, packed):
        for plan in packed.plans():
            seen.setdefault(plan.spec, f"{label}-{plan.spec.function}-{plan.index_t}")

    dense = _wgmma_layer("wgmma_dense_3x5")
    for dtype, layout, bias in itertools.product(("float16", "bfloat16"), launch.LAYOUTS, (False, True)):
        add(f"wgmma_dense_3x5-{dtype}-{layout}-{'bias' if bias else 'nobias'}",
            wgmma.plan_forward(dense, dtype, bias, layout))
    for name in WGMMA_LAYERS:
        if name != "wgmma_dense_3x5":
            for dtype, layout, bias in WGMMA_CASES[:2]:
                add(f"{name}-{dtype}-{layout}", wgmma.plan_forward(_wgmma_layer(name), dtype, bias, layout))
    # every block tile, on the dense layer (a tile the heuristic would not pick still plans and builds)
    for i, tile in enumerate(wgmma.TILES.values()):
        dtype, layout, bias = WGMMA_CASES[i % len(WGMMA_CASES)]
        add(f"wgmma-tile-{tile.name}-{dtype}-{layout}", wgmma.plan_forward(dense, dtype, bias, layout, tile))
    # every depth of the weight ring
    for i, stages in enumerate(wgmma.STAGE_CHOICES):
        dtype, layout, bias = WGMMA_CASES[i % len(WGMMA_CASES)]
        add(f"wgmma-stages-{stages}-{dtype}-{layout}", wgmma.plan_forward(dense, dtype, bias, layout,
                                                                          stages=stages))
    # grad_input (MODE 1): the heuristic on every layer it runs, both kinds and layouts, a few tiles
    for name, g in WGMMA_GRAD_INPUT_LAYERS.items():
        for dtype, layout, _ in WGMMA_CASES[:2]:
            add(f"{name}-grad_input-{dtype}-{layout}", wgmma.plan_grad_input(g, dtype, layout))
    for i, (name, tile) in enumerate(WGMMA_GRAD_INPUT_TILES):
        dtype, layout, _ = WGMMA_CASES[i % len(WGMMA_CASES)]
        add(f"{name}-grad_input-tile-{tile}-{dtype}-{layout}",
            wgmma.plan_grad_input(WGMMA_GRAD_INPUT_LAYERS[name], dtype, layout, wgmma.TILES[tile]))
    # TF32 (float32 at "tf32" precision): the forward on the dense layer in both layouts, with and without a bias,
    # and on one and two consumer warpgroups; grad_input on the strided and grouped layers, both layouts, and
    # on the 64-bit layer
    for layout, bias in itertools.product(launch.LAYOUTS, (False, True)):
        add(f"wgmma_dense_3x5-tf32-{layout}-{'bias' if bias else 'nobias'}",
            wgmma.plan_forward(dense, "float32", bias, layout, precision="tf32"))
    for tile in ("8x8x64", "16x16x128"):
        add(f"wgmma-tf32-tile-{tile}", wgmma.plan_forward(dense, "float32", True, "nhwc", wgmma.TILES[tile],
                                                            precision="tf32"))
    # a channels_last TF32 source copied rounded first: the kernel reads it as it reads an NCHW source's copy
    add("wgmma_dense_3x5-tf32-nhwc-copy", wgmma.plan_forward(dense, "float32", True, "nhwc", precision="tf32",
                                                             copy=True))
    add("wgmma_grad_stride2-tf32-nhwc-copy", wgmma.plan_grad_input(WGMMA_GRAD_INPUT_LAYERS["wgmma_grad_stride2"],
                                                                   "float32", "nhwc", precision="tf32", copy=True))
    for layout in launch.LAYOUTS:
        add(f"wgmma_one_row-tf32-{layout}", wgmma.plan_forward(_wgmma_layer("wgmma_one_row"), "float32", True, layout,
                                                               precision="tf32"))
    for name, layout in itertools.product(("wgmma_grad_stride2", "wgmma_grad_grouped_odd", "wgmma_one_row"),
                                          launch.LAYOUTS):
        add(f"{name}-grad_input-tf32-{layout}",
            wgmma.plan_grad_input(WGMMA_GRAD_INPUT_LAYERS[name], "float32", layout, precision="tf32"))
    add("wgmma_huge_64bit-grad_input-tf32-nhwc",
        wgmma.plan_grad_input(WGMMA_GRAD_INPUT_LAYERS["wgmma_huge_64bit"], "float32", "nhwc", precision="tf32"))
    # 3xTF32 (strict float32): the forward on the dense layer in both layouts, with a bias and without, every tile
    # it may take there in turn; grad_input on the strided, grouped, one-row and 64-bit layers; a channels_last
    # weight's split pack
    for layout, bias in itertools.product(launch.LAYOUTS, (False, True)):
        add(f"wgmma_dense_3x5-3xtf32-{layout}-{'bias' if bias else 'nobias'}",
            wgmma.plan_forward(dense, "float32", bias, layout, precision="strict"))
    for i, tile in enumerate(wgmma.split_tiles(dense)):
        add(f"wgmma-3xtf32-tile-{tile.name}", wgmma.plan_forward(dense, "float32", i % 2 == 0, launch.LAYOUTS[i % 2],
                                                                   tile, precision="strict"))
    for i, name in enumerate(("wgmma_grad_stride2", "wgmma_grad_grouped_odd", "wgmma_one_row", "wgmma_huge_64bit")):
        add(f"{name}-grad_input-3xtf32", wgmma.plan_grad_input(WGMMA_GRAD_INPUT_LAYERS[name], "float32",
                                                               launch.LAYOUTS[i % 2], precision="strict"))
    add("wgmma_dense_3x5-weight_cl-forward-3xtf32",
        wgmma.plan_forward(dense.with_weight_channels_last(), "float32", True, "nhwc", precision="strict"))
    # thin destinations: an RGB output layer's forward (N tiles of 8) and a 12-channel one (N tiles of 16), in both
    # 16-bit kinds, with and without a bias
    rgb = _layer((2, 64, 20, 18), (64, 3, 4, 4), stride=2, padding=1)
    for dtype, layout, bias in WGMMA_CASES[:2]:
        add(f"thin-rgb-{dtype}-{layout}", wgmma.plan_forward(rgb, dtype, bias, layout))
    twelve = _layer((2, 32, 9, 11), (32, 12, 3, 3), stride=2, padding=1)
    for dtype, layout, bias in WGMMA_CASES[2:]:
        add(f"thin-12-{dtype}-{layout}", wgmma.plan_forward(twelve, dtype, bias, layout))
    # grad_weight: every tile option of each layer, both kinds and layouts
    for name, g in WGMMA_GRAD_WEIGHT_LAYERS.items():
        for i, opts in enumerate(wgmma.grad_weight_options(g)):
            dtype, layout, _ = WGMMA_CASES[i % len(WGMMA_CASES)]
            add(f"{name}-grad_weight-{opts.get('tile', 'heuristic')}-{dtype}-{layout}",
                wgmma.plan_grad_weight(g, dtype, 132, layout, wgmma.WEIGHT_TILES.get(opts.get("tile"))))
    # TF32 grad_weight: every tile option of each layer, the layouts in turn, and the ring depths that fit
    for name, g in WGMMA_TF32_WEIGHT_LAYERS.items():
        for i, opts in enumerate(wgmma.tf32_weight_options(g)):
            layout = launch.LAYOUTS[i % 2]
            add(f"{name}-grad_weight-tf32-{opts.get('tile', 'heuristic')}-{layout}",
                wgmma.plan_grad_weight_tf32(g, 132, layout, wgmma.TF32_WEIGHT_TILES.get(opts.get("tile"))))
    # 3xTF32 grad_weight: the heuristic on each layer where it fits, the layouts in turn, both ring depths
    for i, (name, g) in enumerate(WGMMA_TF32_WEIGHT_LAYERS.items()):
        if wgmma.grad_weight_eligible(g, "float32", "strict"):
            add(f"{name}-grad_weight-3xtf32-{launch.LAYOUTS[i % 2]}",
                wgmma.plan_grad_weight_tf32(g, 132, launch.LAYOUTS[i % 2], precision="strict"))
    add("4x4_stride2-grad_weight-3xtf32-stages-2",
        wgmma.plan_grad_weight_tf32(WGMMA_TF32_WEIGHT_LAYERS["4x4_stride2"], 132, "nhwc", stages=2, precision="strict"))
    # aligned channels_last sources, packed from four-channel runs, in both precisions
    for precision in ("tf32", "strict"):
        add(f"4x4_stride2-grad_weight-{precision}-nhwc-aligned",
            wgmma.plan_grad_weight_tf32(WGMMA_TF32_WEIGHT_LAYERS["4x4_stride2"], 132, "nhwc", precision=precision,
                                        aligned=True))
    # a channels_last weight: tiles packed from it, and grad_weight's partials in its layout (several K ranges,
    # one range of many taps writing grad_weight itself, and a one-tap layer)
    for name in ("wgmma_dense_3x5", "wgmma_small_grid"):
        g = _wgmma_layer(name).with_weight_channels_last()
        add(f"{name}-weight_cl-forward", wgmma.plan_forward(g, "bfloat16", True, "nhwc"))
        add(f"{name}-weight_cl-grad_input", wgmma.plan_grad_input(g, "float32", "nhwc", precision="tf32"))
        # TF32 packs it, rounded (the 16-bit forward above reads it in place)
        add(f"{name}-weight_cl-forward-tf32", wgmma.plan_forward(g, "float32", True, "nhwc", precision="tf32"))
    # a channels_last 16-bit weight read in place: the forward's MN-major B in one, two and four 64-channel column
    # blocks past 136 channels; grad_input's K-major rows (a 64-channel chunk) and planes (a 32-channel one); groups
    wide = _layer((2, 64, 9, 11), (64, 136, 3, 5), stride=2, padding=1).with_weight_channels_last()
    for i, tile in enumerate(("8x8x64", "16x16x128", "8x16x256")):
        dtype, layout, bias = WGMMA_CASES[i % len(WGMMA_CASES)]
        add(f"weight_in_place-forward-{tile}-{dtype}-{layout}",
            wgmma.plan_forward(wide, dtype, bias, layout, wgmma.TILES[tile]))
        add(f"weight_in_place-grad_input-{tile}-{dtype}-{layout}",
            wgmma.plan_grad_input(wide, dtype, layout, wgmma.TILES[tile]))
    grouped = _layer((2, 128, 9, 11), (128, 72, 4, 4), stride=2, padding=1, groups=2).with_weight_channels_last()
    add("weight_in_place-grouped-forward", wgmma.plan_forward(grouped, "bfloat16", True, "nhwc"))
    add("weight_in_place-grouped-grad_input", wgmma.plan_grad_input(grouped, "float16", "nchw"))
    narrow = _layer((2, 48, 9, 11), (48, 32, 3, 3), stride=2).with_weight_channels_last()
    add("weight_in_place-grad_input-planes", wgmma.plan_grad_input(narrow, "bfloat16", "nhwc"))
    for name in ("4x4_stride2", "one_tile", "one_tile_1x1"):
        g = WGMMA_GRAD_WEIGHT_LAYERS[name].with_weight_channels_last()
        add(f"{name}-weight_cl-grad_weight", wgmma.plan_grad_weight(g, "float16", 132, "nhwc"))
    for name in ("4x4_stride2", "2x2_input", "one_step_1x1"):
        g = WGMMA_TF32_WEIGHT_LAYERS[name].with_weight_channels_last()
        add(f"{name}-weight_cl-grad_weight-tf32", wgmma.plan_grad_weight_tf32(g, 132, "nchw"))
    for stages in (3, 4):   # six stages of this tile do not fit shared memory
        add(f"4x4_stride2-grad_weight-tf32-stages-{stages}",
            wgmma.plan_grad_weight_tf32(WGMMA_TF32_WEIGHT_LAYERS["4x4_stride2"], 132, "nhwc",
                                        wgmma.TF32_WEIGHT_TILES["64x64x4"], stages))
    # the scatter GEMM: every tile, both dtypes, both layouts, both weight layouts (a contiguous one copied into
    # channels_last order), bias or none
    for i, (name, tile) in enumerate(scatter_gemm.TILES.items()):
        for j, (dtype, layout, bias) in enumerate(WGMMA_CASES):
            g = SCATTER_LAYERS["k2s2"].with_weight_channels_last(bool((i + j) % 2))
            add(f"scatter_gemm-{name}-{dtype}-{layout}-{'bias' if bias else 'nobias'}-w{'cl' if (i + j) % 2 else ''}",
                scatter_gemm.plan_forward(g, dtype, bias, layout, tile))
    add("scatter_gemm-one_pixel", scatter_gemm.plan_forward(SCATTER_LAYERS["one_pixel_k4s2p1"], "bfloat16", True, "nhwc"))
    # the gather GEMM (grad_input of the same layers): every tile, both dtypes and layouts, taps cropped or not
    for i, (name, tile) in enumerate(scatter_gemm.TILES.items()):
        for j, (dtype, layout, _) in enumerate(WGMMA_CASES):
            layer = ("k2s2", "one_pixel_k4s2p1")[(i + j) % 2]
            add(f"gather_gemm-{name}-{dtype}-{layout}-{layer}",
                scatter_gemm.plan_grad_input(SCATTER_LAYERS[layer], dtype, layout, tile))
    # and of layers whose taps overlap, both grad_output paths; float32 at TF32, every tile
    for i, (layer, g) in enumerate(OVERLAPPING_LAYERS.items()):
        dtype, layout, _ = WGMMA_CASES[i % len(WGMMA_CASES)]
        add(f"gather_gemm-{dtype}-{layout}-{layer}", scatter_gemm.plan_grad_input(g, dtype, layout))
    for i, (name, tile) in enumerate(scatter_gemm.TILES.items()):
        layer, layout = list(OVERLAPPING_LAYERS)[i % len(OVERLAPPING_LAYERS)], ("nchw", "nhwc")[i % 2]
        add(f"gather_gemm-{name}-tf32-{layout}-{layer}",
            scatter_gemm.plan_grad_input(OVERLAPPING_LAYERS[layer].with_weight_channels_last(i % 2 == 1), "float32",
                                         layout, tile))
    return seen


# Layers whose output pixels each receive one tap (the scatter GEMM's)
SCATTER_LAYERS = {"k2s2": _layer((2, 64, 7, 9), (64, 48, 2, 2), stride=2),
                  "one_pixel_k4s2p1": _layer((3, 128, 1, 1), (128, 64, 4, 4), stride=2, padding=1),
                  # 40 output channels (grad_input's steps cross taps: its rows gathered), cropped taps
                  "k2x3_crop": _layer((2, 32, 6, 5), (32, 40, 2, 3), stride=(2, 3), padding=1, output_padding=(1, 0))}
# Layers whose taps overlap (the gather GEMM's grad_input alone): pix2pix's 4 x 4 stride-2 cropped layer with
# grad_output by the copy engine (64 output channels), and gathered (48); a dilated 3 x 3 of 40 output channels
OVERLAPPING_LAYERS = {"k4s2p1_boxes": _layer((2, 64, 5, 7), (64, 64, 4, 4), stride=2, padding=1),
                      "k4s2p1_rows": _layer((2, 64, 5, 7), (64, 48, 4, 4), stride=2, padding=1),
                      "k3d2_rows": _layer((1, 32, 6, 9), (32, 40, 3, 3), padding=2, dilation=2)}
# Layers with few output channels (the expanded-taps kernels'): an RGB output layer; a dilated asymmetric kernel
# whose runs of taps make the most values a thread prefetches; 112 expanded columns (64-channel weight blocks) over
# 256 input channels; one output channel over 32 input channels; a small layer of one pixel range
EXPANDED_TAPS_LAYERS = {
    "rgb": _layer((2, 128, 13, 17), (128, 3, 4, 4), stride=2, padding=1),
    "asym_dilated": _layer((2, 24, 7, 9), (24, 5, 3, 5), stride=(2, 3), padding=(1, 2), dilation=(2, 1)),
    "wide": _layer((8, 256, 16, 16), (256, 7, 4, 4), stride=2).with_weight_channels_last(),
    "mask": _layer((2, 32, 11, 7), (32, 1, 4, 4), stride=2, padding=1),
    "small": _layer((1, 64, 4, 4), (64, 3, 4, 4), stride=2, padding=1).with_weight_channels_last(),
}


def _expanded_taps_plans():
    seen = {}
    for i, (name, g) in enumerate(EXPANDED_TAPS_LAYERS.items()):
        dtype = ("float16", "bfloat16")[i % 2]
        stages = expanded_taps.STAGE_CHOICES[i % len(expanded_taps.STAGE_CHOICES)]
        for plan in expanded_taps.plan_grad_weight(g, dtype, 132, stages):
            if plan is not None:
                seen.setdefault(plan.spec, f"expanded_taps-{name}-{dtype}-{plan.spec.function}")
        plan = expanded_taps.plan_grad_input(g, dtype, 132)
        seen.setdefault(plan.spec, f"expanded_taps-{name}-{dtype}-{plan.spec.function}")
    # NCHW (images of whole 16-byte runs): float32 (TF32, 3xTF32) and bf16 on the RGB layer, fp16 on the dilated one
    rgb = _layer((2, 128, 12, 10), (128, 3, 4, 4), stride=2, padding=1)
    asym = _layer((2, 24, 8, 9), (24, 5, 3, 5), stride=(2, 3), padding=(1, 2), dilation=(2, 1))
    for name, g, dtype, precision in (("rgb_nchw", rgb, "float32", "tf32"), ("rgb_nchw", rgb, "float32", "strict"),
                                      ("rgb_nchw", rgb, "bfloat16", "strict"),
                                      ("asym_dilated_nchw", asym, "float16", "strict")):
        for plan in (*expanded_taps.plan_grad_weight(g, dtype, 132, None, "nchw", precision),
                     expanded_taps.plan_grad_input(g, dtype, 132, "nchw", precision)):
            if plan is not None:
                seen.setdefault(plan.spec, f"expanded_taps-{name}-{dtype}-{precision}-{plan.spec.function}")
    return seen


# The grouped mma forward, grad_input and grad_weight: one grad_weight warp a group (3 x 5, stride and dilation, a
# reduce) and two (16 channels a side, 4 x 4), every block, both kinds, bias on and off; a channels_last weight read
# and written in place, and one chunk writing grad_weight itself
GROUPED_MMA_LAYERS = {
    "thin_3x5": _layer((2, 32, 9, 11), (32, 16, 3, 5), stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4,
                       output_padding=(1, 0)),
    "two_warps_4x4": _layer((2, 64, 7, 9), (64, 16, 4, 4), stride=2, padding=1, groups=4),
    "one_chunk_weight_cl": _layer((1, 16, 1, 20), (16, 16, 3, 3), stride=2, padding=1, groups=2
                                  ).with_weight_channels_last(),
}


def _grouped_mma_plans():
    seen = {}
    for name, g in GROUPED_MMA_LAYERS.items():
        for dtype, block in itertools.product(("float16", "bfloat16"), grouped_mma.blocks(g)):
            for plan in grouped_mma.plan_grad_weight(g, dtype, 132, block):
                if plan is not None:
                    seen.setdefault(plan.spec, f"grouped_mma-{name}-{dtype}-{block}-{plan.spec.function}")
        # the NCHW stores change only the epilogue: the heuristic block has them
        for (dtype, bias), (i, block) in itertools.product((("float16", False), ("bfloat16", True)),
                                                           enumerate(grouped_mma.forward_blocks(g))):
            for nchw in (False, True)[:2 if i == 0 else 1]:
                plan = grouped_mma.plan_forward(g, dtype, bias, 132, block, nchw)
                seen.setdefault(plan.spec, f"grouped_mma-{name}-{dtype}-{block}-nchw{nchw}-{plan.spec.function}")
        for dtype, (i, block) in itertools.product(("float16", "bfloat16"),
                                                   enumerate(grouped_mma.grad_input_blocks(g))):
            for nchw in (False, True)[:2 if i == 0 else 1]:
                plan = grouped_mma.plan_grad_input(g, dtype, 132, block, nchw)
                seen.setdefault(plan.spec, f"grouped_mma-{name}-{dtype}-{block}-nchw{nchw}-{plan.spec.function}")
    return seen


# The thin-output forward: an RGB layer (stride 2, bias, rows of whole 16-byte runs), two of 8 output channels
# (stride 1; 4 x 4 at stride 2, one-row tiles), and one of asymmetric stride and dilation with a part-empty channel
# chunk and a channels_last weight (the last three copy words); then strict float32's 3xTF32 on RGB layers of
# 16-byte rows and of odd width
THIN_MMA_LAYERS = {
    "rgb": (_layer((2, 128, 10, 12), (128, 3, 4, 4), stride=2, padding=1), True, "tf32"),
    "eight_s1": (_layer((2, 16, 9, 7), (16, 8, 3, 3), stride=1, padding=1), False, "tf32"),
    "eight_k4s2": (_layer((2, 48, 7, 9), (48, 8, 4, 4), stride=2, padding=1), True, "tf32"),
    "asym_wcl": (_layer((2, 40, 7, 5), (40, 5, 5, 3), stride=(3, 2), padding=(2, 1), output_padding=(1, 0),
                        dilation=(1, 2)).with_weight_channels_last(), True, "tf32"),
    "rgb_strict": (_layer((2, 128, 10, 12), (128, 3, 4, 4), stride=2, padding=1), True, "strict"),
    "rgb_strict_words": (_layer((2, 64, 11, 13), (64, 3, 4, 4), stride=2, padding=1), False, "strict"),
}


def _thin_mma_plans():
    return {thin_mma.plan_forward(g, "float32", bias, precision).spec: f"thin_mma-{name}"
            for name, (g, bias, precision) in THIN_MMA_LAYERS.items()}


# The depthwise kernels: depthwise_up's forward and grad_input in each dtype (the heuristic tiles), every other tile
# the tuner races in fp16 and float32, a single-channel build of an asymmetric, dilated layer with a channels_last
# weight, and a 7 x 7 kernel's grad_input
DEPTHWISE_UP = _layer((16, 128, 64, 64), (128, 1, 4, 4), stride=2, padding=1, groups=128)
DEPTHWISE_LAYERS = {
    **{f"up-{pass_}-{dtype}": (DEPTHWISE_UP, dtype, pass_, None)
       for dtype in ("float16", "bfloat16", "float32") for pass_ in ("forward", "grad_input")},
    **{f"up-{pass_}-{dtype}-{depthwise.tile_name(t)}": (DEPTHWISE_UP, dtype, pass_, t)
       for dtype in ("float16", "float32") for pass_ in ("forward", "grad_input")
       for t in depthwise.tiles(DEPTHWISE_UP, dtype, pass_)[1:]},
    "asym-forward-single": (_layer((2, 5, 7, 9), (5, 1, 3, 5), stride=(3, 2), padding=(2, 1), output_padding=(1, 0),
                                   dilation=(1, 2), groups=5).with_weight_channels_last(), "float16", "forward", None),
    "k7-grad_input": (_layer((2, 64, 9, 9), (64, 1, 7, 7), padding=3, groups=64), "bfloat16", "grad_input", None),
}


def _depthwise_plans():
    return {depthwise.plan(g, dtype, pass_, pass_ == "forward", True, tile).spec: f"depthwise-{name}"
            for name, (g, dtype, pass_, tile) in DEPTHWISE_LAYERS.items()}


WGMMA_PLANS = _wgmma_plans()
PLANS = {**_plans(), **_gemm_plans(), **WGMMA_PLANS, **_expanded_taps_plans(), **_grouped_mma_plans(),
         **_thin_mma_plans(), **_depthwise_plans()}


def test_variants_reach_every_template_and_both_index_widths():
    templates_used = {spec.template for spec in PLANS}
    from cupyconv.jit import templates

    assert templates_used == set(templates.template_names())
    widths = {dict(spec.constants)["INDEX_T"] for spec in PLANS}
    assert widths == {"int", "long long"}
    assert {dict(s.constants).get("SCALAR_T") for s in PLANS} == {"float", "double", "half_t", "bf16_t", None}
    for data_movement in ("pack_weight.cu", "to_channels_last.cu"):
        assert {dict(s.constants)["ELEMENT_BYTES"] for s in PLANS if s.template == data_movement} == {2, 4}
    assert {(dict(s.constants)["ROUND_TF32"], dict(s.constants)["ELEMENT_BYTES"]) for s in PLANS
            if s.template == "to_channels_last.cu"} == {(False, 2), (False, 4), (True, 4)}
    gemms = [dict(s.constants) for s in PLANS if s.template == "conv_transpose2d_igemm.cu"]
    assert {c["STAGES"] for c in gemms if c["A_VEC"]} == set(gemm.STAGE_CHOICES)
    assert {(c["SRC_CL"], c["DST_CL"]) for c in gemms} == {(True, True), (True, False), (False, False)}
    grad_weight = [dict(s.constants) for s in PLANS if s.template == "conv_transpose2d_grad_weight_igemm.cu"]
    assert {c["STAGES"] for c in grad_weight if c["VEC"]} == set(gemm.STAGE_CHOICES)
    assert {c["VEC"] for c in grad_weight} == {True, False}
    assert {(c["MODE"], c["WEIGHT_DIRECT"]) for c in gemms} == {(0, True), (0, False), (1, True), (1, False)}
    hopper = [dict(s.constants) for s in PLANS if s.template == WGMMA_TEMPLATE]
    in_place = {(c["MODE"], c["WEIGHT_DIRECT"]) for c in hopper}
    assert in_place == {(0, True), (0, False), (1, True), (1, False)}, in_place
    scatter = [dict(s.constants) for s in PLANS if s.template == SCATTER_GEMM_TEMPLATE]
    assert {(c["MB"], c["BN"]) for c in scatter} == {(t.mb, t.bn) for t in scatter_gemm.TILES.values()}
    assert {(c["DST_CL"], c["HAS_BIAS"], c["MMA_KIND"]) for c in scatter} >= {(True, True, 1), (False, True, 0), (True, False, 0)}
    gather = [dict(s.constants) for s in PLANS if s.template == GATHER_GEMM_TEMPLATE]
    assert {(c["MB"], c["BN"]) for c in gather} == {(t.mb, t.bn) for t in scatter_gemm.TILES.values()}
    assert {(c["DST_CL"], c["MMA_KIND"], c["PH"] > 0) for c in gather} >= {(True, 1, True), (False, 0, False)}
    assert {c["A_BOXES"] for c in gather} == {True, False}, "grad_output by the copy engine, and gathered"
    assert {(c["KH"] > c["SH"], c["A_BOXES"]) for c in gather} >= {(True, True), (True, False)}, "overlapping taps"
    assert any(c["DH"] > 1 and c["KH"] > 1 for c in gather), "taps dilated apart"
    assert {c["MMA_KIND"] for c in gather} == {0, 1, 2}, "fp16, bf16 and TF32"
    assert {s.target for s in PLANS if s.template in HOPPER_TEMPLATES} == {wgmma.TARGET}
    assert {s.target for s in PLANS if s.template not in HOPPER_TEMPLATES} == {""}
    weights = [dict(s.constants) for s in PLANS if s.template == WGMMA_GRAD_WEIGHT_TEMPLATE]
    assert {c["TAP_GROUP"] for c in weights} == {t.taps for t in wgmma.WEIGHT_TILES.values()}
    assert {c["SINGLE_CHUNK"] for c in weights} == {True, False} and {c["MMA_KIND"] for c in weights} == {0, 1}
    assert {c["SKIP_ABSENT_TAPS"] for c in weights} == {True, False}, "full tap groups, and groups that test each tap"
    assert {(c["TILE_H"], c["TILE_W"]) for c in weights} == {(t.rows, t.cols) for t in wgmma.WEIGHT_TILES.values()} \
        == {(8, 8), (16, 8), (1, 64)}
    tf32_weights = [dict(s.constants) for s in PLANS if s.template == WGMMA_TF32_WEIGHT_TEMPLATE]
    assert {(c["TILE_H"], c["TILE_W"], c["QUADS"]) for c in tf32_weights} >= {(2, 8, 1), (4, 4, 1), (2, 2, 4),
                                                                               (1, 2, 3)}
    assert {c["STAGES"] for c in tf32_weights if not c["SPLIT_TF32"]} == {3, 4}
    assert {c["STAGES"] for c in tf32_weights if c["SPLIT_TF32"]} == {2, 3}, "3xTF32's two- and three-deep rings"
    assert {c["TILE_W"] for c in tf32_weights if c["SPLIT_TF32"]} >= {8}
    quad_packs = [dict(s.constants) for s in PLANS if s.template == "to_image_quads.cu"]
    assert {c["NHWC"] for c in quad_packs} == {True, False} and {c["SPLIT_TF32"] for c in quad_packs} == {True, False}
    assert {(c["VEC4"], c["SPLIT_TF32"]) for c in quad_packs if c["NHWC"]} == {(True, True), (True, False),
                                                                                (False, True), (False, False)}
    assert {c["INDEX_T"] for c in quad_packs} == {"int", "long long"}
    assert {c["TAP_GROUP"] for c in tf32_weights} == {t.taps for t in wgmma.TF32_WEIGHT_TILES.values()}
    assert {c["SINGLE_CHUNK"] for c in tf32_weights} == {True, False}
    assert {c["INDEX_T"] for c in tf32_weights} == {"int", "long long"}
    assert any(c["CIN_G"] % 8 or c["COUT_G"] % 8 for c in tf32_weights), "channels in no whole 16-byte runs"
    assert {c["MMA_KIND"] for c in hopper} == {0, 1, 2, 3} and {c["INDEX_T"] for c in hopper} == {"int", "long long"}
    tf32 = [c for c in hopper if c["MMA_KIND"] == 2]
    assert {c["SRC_ROUNDED"] for c in tf32} == {True, False} and not any(c["SRC_ROUNDED"] for c in hopper
                                                                         if c["MMA_KIND"] != 2)
    assert {c["SCALAR_T"] for c in tf32} == {"float"} and {(c["MODE"], c["DST_CL"]) for c in tf32} == {
        (0, False), (0, True), (1, False), (1, True)} and {c["WARPGROUPS"] for c in tf32} == {1, 2}
    assert {(c["DST_CL"], c["HAS_BIAS"]) for c in hopper} == {(False, False), (False, True), (True, False),
                                                              (True, True)}
    assert {wgmma.HaloTile(c["TILE_IMAGES"], c["TILE_H"], c["TILE_W"], c["BN"]).name for c in hopper} \
        == set(wgmma.TILES)
    assert {c["WARPGROUPS"] for c in hopper} == {1, 2} and {c["HALO_STAGES"] for c in hopper} >= {2, 4}
    assert any(c["SH"] * c["SW"] > 1 for c in hopper) and any(c["GROUPS"] > 1 for c in hopper)
    assert any(c["COUT_G"] % 8 for c in hopper), "output channels that are not whole 16-byte runs"
    assert {c["BN"] for c in hopper if c["COUT_G"] < 16 and c["MODE"] == 0} == {8, 16}, "thin outputs, N 8 and 16"
    assert {c["B_STAGES"] for c in hopper} == set(wgmma.STAGE_CHOICES)
    # grad_input too: strides up to 3 (with a 3 x 3 kernel), grad_in channels that are odd, several images a tile
    grad = [c for c in hopper if c["MODE"] == 1]
    assert {c["MODE"] for c in hopper} == {0, 1} and not any(c["HAS_BIAS"] for c in grad)
    assert {max(c["SH"], c["SW"]) for c in grad} >= {1, 2, 3} and any(c["SH"] == c["KH"] == 3 for c in grad)
    assert {c["MMA_KIND"] for c in grad} == {0, 1, 2, 3} and {c["DST_CL"] for c in grad} == {True, False}
    assert {c["INDEX_T"] for c in grad} == {"int", "long long"} and {c["WARPGROUPS"] for c in grad} == {1, 2}
    assert any(c["CIN_G"] % 2 for c in grad) and any(c["TILE_IMAGES"] > 1 for c in grad)
    packs = [dict(s.constants) for s in PLANS if s.template == "pack_weight.cu"]
    assert {c["TILE_N"] > 0 for c in packs} == {True, False}, "weights packed row by row and tile by tile"
    assert {c["MODE"] for c in packs if c["TILE_N"] > 0} == {0, 1}, "tiles packed for both wgmma passes"
    assert {(c["ROUND_TF32"], c["ELEMENT_BYTES"]) for c in packs} == {(False, 2), (False, 4), (True, 4)}
    # channels_last weights: read by every layer template and both packs, and written by every grad_weight kernel,
    # the wgmma ones' single K range of many taps included; the depthwise kernels' weights (one output channel a
    # group) lie the same either way, and they take them as contiguous
    layer_templates = {s.template for s in PLANS if "WEIGHT_CL" in dict(s.constants)
                       and s.template not in ("pack_weight.cu", "conv_transpose2d_depthwise_nhwc.cu")}
    assert {s.template for s in PLANS if dict(s.constants).get("WEIGHT_CL")} == layer_templates | {"pack_weight.cu"}
    assert {(c["MODE"], c["TILE_N"] > 0) for c in packs if c["WEIGHT_CL"]} == {(0, False), (1, False), (0, True),
                                                                                (1, True)}
    for cl_weights in ([c for c in weights if c["WEIGHT_CL"]], [c for c in tf32_weights if c["WEIGHT_CL"]]):
        assert {(c["SINGLE_CHUNK"], c["KH"] * c["KW"] > 1) for c in cl_weights} == {(True, True), (True, False),
                                                                                    (False, True)}


def _compile_cases():
    """(spec, arch) for every plan: the one architecture its target names, else compute_90, and compute_80 too for
    the first plan of each kind of kernel (template, function, element and index types, MMA kind).

    The generic templates hold no code that differs between sm_80 and sm_90 (their few ``__CUDA_ARCH__`` tests
    ask for sm_80 or newer), so what compute_80 could refuse is an instruction it lacks, which one build of each
    kind of kernel shows; building every plan twice was a third of the CPU suite's time."""
    kinds, cases = set(), []
    for spec, name in PLANS.items():
        constants = dict(spec.constants)
        kind = (spec.template, spec.function) + tuple(constants.get(c) for c in ("SCALAR_T", "INDEX_T", "MMA_KIND"))
        if spec.target:
            archs = (TARGET_ARCHS[spec.target],)
        else:
            archs = ("compute_90",) if kind in kinds else ARCHS
            kinds.add(kind)
        cases += [pytest.param(spec, arch, id=f"{name}-{arch}") for arch in archs]
    return cases


COMPILE_CASES = _compile_cases()


def test_architecture_specific_specs_compile_for_their_target_only():
    targeted = [case.values for case in COMPILE_CASES if case.values[0].target]
    assert len(targeted) == len([s for s in PLANS if s.target]) > 0
    assert all(arch == TARGET_ARCHS[spec.target] for spec, arch in targeted)
    generic = [case.values for case in COMPILE_CASES if not case.values[0].target]
    assert {spec for spec, arch in generic if arch == "compute_90"} == {s for s in PLANS if not s.target}
    sm_80 = [spec for spec, arch in generic if arch == "compute_80"]
    assert {(s.template, s.function) for s in sm_80} == {(s.template, s.function) for s in PLANS if not s.target}
    assert {dict(s.constants).get("SCALAR_T") for s in sm_80} == {"float", "double", "half_t", "bf16_t", None}


def _ptx_facts(spec, arch):
    """What test_template_compiles checks of a build's PTX (kept instead of the PTX: there are over a thousand
    builds), or the error the build raised."""
    try:
        ptx = compile_ptx(spec.source(), spec.function, arch)
    except Exception as error:   # raised again by the case's own test
        return error
    return {"entry": f".entry {spec.function}" in ptx, "targets": set(re.findall(r"^\.target (\S+)", ptx, re.M)),
            "wgmma": {op: op in ptx for op in ("wgmma.mma_async", "wgmma.fence", "wgmma.wait_group")}}


@pytest.fixture(scope="module")
def built(request):
    """The facts of every compile case this session runs, built on a thread per CPU up front: NVRTC releases the
    GIL, and these builds are most of the CPU suite's time."""
    cases = {tuple(item.callspec.params.values()) for item in request.session.items
             if getattr(item, "originalname", None) == "test_template_compiles" and item.module.__name__ == __name__}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(cases, pool.map(lambda case: _ptx_facts(*case), cases)))


@pytest.mark.parametrize("spec,arch", COMPILE_CASES)
def test_template_compiles(spec, arch, built):
    facts = built[(spec, arch)] if (spec, arch) in built else _ptx_facts(spec, arch)
    if isinstance(facts, Exception):
        raise facts
    assert facts["entry"]
    assert f"sm_{arch.split('_')[1]}" in facts["targets"]
    # warpgroup MMAs only where the target allows them, and there for real
    assert facts["wgmma"]["wgmma.mma_async"] == (spec.template in HOPPER_TEMPLATES)
    if spec.template == WGMMA_TEMPLATE:
        assert "sm_90a" in facts["targets"] and facts["wgmma"]["wgmma.fence"] and facts["wgmma"]["wgmma.wait_group"]


def _ptxas_log(spec, extra=()):
    """The NVRTC log of building ``spec`` to a cubin with its own options (ptxas verbose)."""
    program = nvrtc.createProgram(spec.source(), f"{spec.function}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, list(spec.options) + list(extra) + ["-Xptxas=-v"])
        except nvrtc.NVRTCError:
            raise KernelCompileError(spec.function, spec.options, nvrtc.getProgramLog(program), spec.source()) \
                from None
        return nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


# Every block tile in fp16 (channels_last, bias) and bf16 (NCHW) for the tiles of 128
# accumulators a thread, the register-heaviest; the other weight-ring depths on the largest tile.
SPILL_CASES = {f"{tile.name}-{dtype}": (tile, dtype, None) for tile in wgmma.TILES.values()
               for dtype in ("float16", "bfloat16") if dtype == "float16" or tile.accumulators == 128}
SPILL_CASES.update({f"16x16x128-stages{s}-float16": (wgmma.TILES["16x16x128"], "float16", s)
                    for s in wgmma.STAGE_CHOICES if s != wgmma.B_STAGES})
# grad_input: the tiles of 128 accumulators a thread in fp16 on the dense layer, and in bf16 on the stride-3
# 3 x 3 layer (nine phase planes, the smallest chunk) two of them and the heuristic's tile
SPILL_CASES.update({f"grad_input-{tile.name}-float16": (tile, "float16", None, "wgmma_dense_3x5")
                    for tile in wgmma.TILES.values() if tile.accumulators == 128})
SPILL_CASES.update({f"grad_input-stride3-{name}-bfloat16": (wgmma.TILES.get(name), "bfloat16", None,
                                                             "wgmma_grad_stride3_k3")
                    for name in ("16x16x128", "8x16x256", "heuristic")})


def _spill_plan(name):
    tile, dtype, stages, *grad_input = SPILL_CASES[name]
    layout = "nhwc" if dtype == "float16" else "nchw"
    if grad_input:
        return wgmma.plan_grad_input(WGMMA_GRAD_INPUT_LAYERS[grad_input[0]], dtype, layout, tile, stages).gemm
    return wgmma.plan_forward(_wgmma_layer("wgmma_dense_3x5"), dtype, True, layout, tile, stages).gemm


@pytest.mark.parametrize("name", sorted(SPILL_CASES))
def test_wgmma_kernels_build_for_sm_90a_without_spilling(name, ptxas_logs):
    """NVRTC builds the wgmma kernels (forward and grad_input) to sm_90a cubins; ptxas keeps every tile in
    registers, with no stack frame and no serialised warpgroup MMAs."""
    _assert_builds_without_spilling(_spill_plan(name), ptxas_logs)


# 3xTF32 keeps two sets of accumulators: its tiles of 64 a thread (the most it takes), forward and grad_input, and
# grad_input's smallest chunk (the stride-3 layer's nine phase planes)
SPLIT_SPILL_CASES = {f"{pass_}-{tile.name}": (pass_, tile) for tile in wgmma.TILES.values()
                     if tile.accumulators == wgmma.SPLIT_ACCUMULATORS for pass_ in ("forward", "grad_input")
                     if pass_ == "forward" or wgmma._fits(WGMMA_GRAD_INPUT_LAYERS["wgmma_grad_stride3_k3"], "float32",
                                                          tile, pass_, 2)}


@pytest.mark.parametrize("name", sorted(SPLIT_SPILL_CASES))
def test_3xtf32_wgmma_kernels_build_for_sm_90a_without_spilling(name, ptxas_logs):
    pass_, tile = SPLIT_SPILL_CASES[name]
    if pass_ == "forward":
        main = wgmma.plan_forward(_wgmma_layer("wgmma_dense_3x5"), "float32", True, "nhwc", tile, precision="strict")
    else:
        main = wgmma.plan_grad_input(WGMMA_GRAD_INPUT_LAYERS["wgmma_grad_stride3_k3"], "float32", "nchw", tile,
                                     precision="strict")
    assert dict(main.gemm.spec.constants)["MMA_KIND"] == 3
    _assert_builds_without_spilling(main.gemm, ptxas_logs)


# Split K: pix2pix's 16 x 1024 x 8² layer, whose TF32 passes split untuned (two and four ranges), strict float32's,
# and the widest 16-bit tile split over a channels_last weight read in place.
_PIX2PIX_8 = geometry((16, 1024, 8, 8), (1024, 512, 4, 4), None, ConvParams.from_args(stride=2, padding=1))
SPLIT_K_SPILL_CASES = {
    "forward-tf32": ("forward", Variant("wgmma"), "float32", "nchw", "tf32", False),
    "grad_input-tf32": ("grad_input", Variant("wgmma"), "float32", "nchw", "tf32", False),
    "forward-3xtf32-k2": ("forward", Variant.make("wgmma", split=2), "float32", "nhwc", "strict", False),
    "forward-bf16-2i8x8x256-k2": ("forward", Variant.make("wgmma", tile="2i8x8x256", split=2), "bfloat16", "nhwc",
                                  "strict", True),
    "grad_input-bf16-2i8x8x256-k4": ("grad_input", Variant.make("wgmma", tile="2i8x8x256", split=4), "bfloat16",
                                     "nhwc", "strict", True),
}


def _split_k_plan(name):
    pass_, variant, dtype, layout, precision, weight_cl = SPLIT_K_SPILL_CASES[name]
    g = _PIX2PIX_8.with_weight_channels_last(weight_cl)
    return table.plan(pass_, variant, g, dtype, layout, precision, pass_ == "forward")


@pytest.mark.parametrize("name", sorted(SPLIT_K_SPILL_CASES))
def test_split_k_wgmma_kernels_build_for_sm_90a_without_spilling(name, ptxas_logs):
    """A split block stores its fp32 partials through the unsplit epilogue's indexing: no more registers."""
    plan = _split_k_plan(name)
    assert dict(plan.gemm.spec.constants)["SPLIT_K"] > 1 and plan.reduce is not None
    _assert_builds_without_spilling(plan.gemm, ptxas_logs)


def _assert_builds_without_spilling(main, ptxas_logs):
    spec = main.spec
    assert spec.target == "sm_90a" and f"-arch={spec.target}" in spec.options
    log = ptxas_logs(spec)
    assert "for 'sm_90a'" in log, log
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found, log
    assert found.groups() == ("0", "0", "0"), log
    assert "serialized" not in log and "Performance Loss" not in log, log
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 255, log
    # static shared memory (tap table, barriers) and the plan's dynamic shared memory fit an H100's 227 KB
    static = re.search(r"(\d+) bytes smem", log)
    assert main.smem_bytes + (int(static.group(1)) if static else 0) <= 227 * 1024, log


def test_the_target_survives_the_architecture_cupy_adds():
    """On a GPU, CuPy appends its own ``-arch=sm_90`` (and more) after a spec's options: NVRTC must still
    build for sm_90a, or ptxas rejects the warpgroup MMAs; without the target it does reject them."""
    spec = wgmma.plan_forward(_wgmma_layer("wgmma_small_grid"), "float16", False, "nhwc").gemm.spec
    cupy_adds = ("-ftz=true", "-arch=sm_90", "--device-as-default-execution-space")
    assert "for 'sm_90a'" in _ptxas_log(spec, cupy_adds)
    with pytest.raises(KernelCompileError, match="wgmma"):
        _ptxas_log(replace(spec, target=""), cupy_adds)


def test_index_width_follows_tensor_size():
    assert launch.index_type(10, 2 ** 31 - 1) == "int"
    assert launch.index_type(10, 2 ** 31) == "long long"
    g = geometry((1, 1, 50000, 50000), (1, 2, 2, 2), None, ConvParams.from_args(stride=2))
    assert direct.plan_forward(g, "float16", False).index_t == "long long"
    small = geometry((1, 1, 50, 50), (1, 2, 2, 2), None, ConvParams.from_args(stride=2))
    assert direct.plan_forward(small, "float16", False).index_t == "int"


def test_spatial_size_is_a_runtime_argument():
    params = ConvParams.from_args(stride=2, padding=1)
    specs = {direct.plan_forward(geometry((n, 4) + hw, (4, 3, 3, 3), None, params), "float32", True).spec
             for n, hw in ((1, (5, 5)), (7, (31, 9)), (2, (128, 64)))}
    assert len(specs) == 1


def test_compile_error_reports_kernel_options_and_lines():
    source = "\n".join([
        "extern \"C\" __global__ void broken(float* y) {",
        "    int a = 1;",
        "    y[0] = undefined_symbol + a;",
        "}",
    ])
    with pytest.raises(KernelCompileError) as info:
        compile_ptx(source, "broken", "compute_90")
    message = str(info.value)
    assert "broken" in message and "--std=c++17" in message and "compute_90" in message
    assert "undefined_symbol" in message
    assert ">>     3 |     y[0] = undefined_symbol + a;" in message
    assert info.value.kernel == "broken"


def test_clear_cache_empties_the_in_process_cache():
    compiler._entries[("k",)] = compiler._Entry()
    compiler.clear_cache()
    assert not compiler._entries


def test_kernel_spec_is_hashable_and_order_independent():
    a = KernelSpec.make("reduce_partials.cu", "reduce_partials", {"BLOCK": 256, "INDEX_T": "int"})
    b = KernelSpec.make("reduce_partials.cu", "reduce_partials", {"INDEX_T": "int", "BLOCK": 256})
    assert a == b and hash(a) == hash(b)


def test_kernel_spec_target_is_part_of_its_identity_and_options():
    constants = {"BLOCK": 256, "INDEX_T": "int"}
    plain = KernelSpec.make("reduce_partials.cu", "reduce_partials", constants)
    hopper = KernelSpec.make("reduce_partials.cu", "reduce_partials", constants, "sm_90a")
    assert plain.target == "" and plain.options == compiler.COMPILE_OPTIONS
    assert hopper.target == "sm_90a" and hopper.options == compiler.COMPILE_OPTIONS + ("-arch=sm_90a",)
    assert hopper != plain and len({plain, hopper}) == 2
    assert compiler._key(hopper, 0, "90") != compiler._key(plain, 0, "90")
    compiler.clear_cache()
    try:
        for spec in (plain, hopper):
            compiler._entries[compiler._key(spec, 0, "90")] = compiler._Entry(function=object())
        assert compiler.compiled_specs() == {(plain, 0), (hopper, 0)}
    finally:
        compiler.clear_cache()


def test_importing_compiles_nothing():
    import subprocess
    import sys

    code = ("import cupyconv, sys; from cupyconv.jit import compiler; "
            "assert compiler.compile_count() == 0; "
            "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tuners_candidates_build_on_a_lower_priority_pool(monkeypatch):
    import os
    import threading

    if not hasattr(os, "getpriority"):
        pytest.skip("no per-thread priorities on this platform")

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = nice()
    low, normal = compiler._pool(True), compiler._pool(False)
    assert low is not normal and compiler._pool(True) is low
    assert normal.submit(nice).result() == mine
    assert low.submit(nice).result() == min(19, mine + 10)
    # nothing left to build: no future, nothing queued
    monkeypatch.setattr(compiler, "device_arch", lambda device_id: "90")
    monkeypatch.setattr(compiler, "_is_built", lambda spec, device_id, arch: True)
    assert compiler.compile_in_background([KernelSpec.make("t.cu", "f", {})], 0, low_priority=True) == []


def test_candidate_builds_wait_until_no_build_a_call_needs_is_in_flight(monkeypatch):
    import threading

    built = []
    monkeypatch.setattr(compiler, "_build_quietly", lambda spec, device_id, arch: built.append(spec))
    monkeypatch.setattr(compiler, "_foreground", 1)
    spec = KernelSpec.make("t.cu", "f", {})
    worker = threading.Thread(target=compiler._build_when_idle, args=(spec, 0, "90"))
    worker.start()
    worker.join(0.2)
    assert worker.is_alive() and not built, "a candidate must not build beside a call's own kernels"
    with compiler._foreground_idle:
        compiler._foreground = 0
        compiler._foreground_idle.notify_all()
    worker.join(5)
    assert not worker.is_alive() and built == [spec]


WEIGHT_SPILL_CASES = [(layer, opts.get("tile"), dtype) for layer, g in WGMMA_GRAD_WEIGHT_LAYERS.items()
                      for opts in wgmma.grad_weight_options(g) for dtype in ("float16", "bfloat16")]


def _weight_split(layer, tile, dtype):
    return wgmma.plan_grad_weight(WGMMA_GRAD_WEIGHT_LAYERS[layer], dtype, 132, "nhwc", wgmma.WEIGHT_TILES.get(tile))


@pytest.mark.parametrize("layer,tile,dtype", WEIGHT_SPILL_CASES,
                         ids=[f"{layer}-{tile or 'heuristic'}-{dtype}" for layer, tile, dtype in WEIGHT_SPILL_CASES])
def test_wgmma_grad_weight_kernels_build_for_sm_90a_without_spilling(layer, tile, dtype, ptxas_logs):
    split = _weight_split(layer, tile, dtype)
    spec = split.partial.spec
    assert spec.target == "sm_90a"
    log = ptxas_logs(spec)
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found and found.groups() == ("0", "0", "0"), log
    assert "serialized" not in log and "Performance Loss" not in log, log
    static = re.search(r"(\d+) bytes smem", log)
    assert split.partial.smem_bytes + (int(static.group(1)) if static else 0) <= 227 * 1024, log


TF32_WEIGHT_SPILL_CASES = [(layer, opts.get("tile"), layout, "tf32") for layer, g in WGMMA_TF32_WEIGHT_LAYERS.items()
                           for opts in wgmma.tf32_weight_options(g) for layout in launch.LAYOUTS
                           if layer != "huge_64bit"]
# 3xTF32 (strict float32): every tile it offers on each layer where it fits, the layouts in turn
TF32_WEIGHT_SPILL_CASES += [(layer, opts.get("tile"), launch.LAYOUTS[i % 2], "strict")
                            for layer, g in WGMMA_TF32_WEIGHT_LAYERS.items()
                            if layer != "huge_64bit" and wgmma.grad_weight_eligible(g, "float32", "strict")
                            for i, opts in enumerate(wgmma.tf32_weight_options(g, "strict"))]


def _tf32_weight_split(layer, tile, layout, precision="tf32"):
    tiles = wgmma.TF32_WEIGHT_TILES if precision == "tf32" else wgmma.SPLIT_WEIGHT_TILES
    return wgmma.plan_grad_weight_tf32(WGMMA_TF32_WEIGHT_LAYERS[layer], 132, layout, tiles.get(tile),
                                       precision=precision)


@pytest.mark.parametrize("layer,tile,layout,precision", TF32_WEIGHT_SPILL_CASES,
                         ids=[f"{layer}-{tile or 'heuristic'}-{layout}-{precision}"
                              for layer, tile, layout, precision in TF32_WEIGHT_SPILL_CASES])
def test_tf32_grad_weight_kernels_build_for_sm_90a_without_spilling(layer, tile, layout, precision, ptxas_logs):
    split = _tf32_weight_split(layer, tile, layout, precision)
    assert dict(split.partial.spec.constants)["SPLIT_TF32"] == (precision == "strict")
    log = ptxas_logs(split.partial.spec)
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found and found.groups() == ("0", "0", "0"), log
    assert "serialized" not in log and "Performance Loss" not in log, log
    static = re.search(r"(\d+) bytes smem", log)
    assert split.partial.smem_bytes + (int(static.group(1)) if static else 0) <= 227 * 1024, log


def _channels_last_weight_splits(layer):
    g = {**WGMMA_GRAD_WEIGHT_LAYERS, **WGMMA_TF32_WEIGHT_LAYERS}[layer].with_weight_channels_last()
    splits = [wgmma.plan_grad_weight_tf32(g, 132, "nhwc")]
    if layer in WGMMA_GRAD_WEIGHT_LAYERS:
        splits.append(wgmma.plan_grad_weight(g, "bfloat16", 132, "nhwc"))
    return splits


@pytest.mark.parametrize("layer", ("4x4_stride2", "one_tile", "2x2_input"))
def test_grad_weight_kernels_writing_a_channels_last_weight_build_without_spilling(layer, ptxas_logs):
    for split in _channels_last_weight_splits(layer):
        assert dict(split.partial.spec.constants)["WEIGHT_CL"]
        log = ptxas_logs(split.partial.spec)
        found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert found and found.groups() == ("0", "0", "0"), log


def _scatter_plan(tile, dtype):
    return scatter_gemm.plan_forward(SCATTER_LAYERS["k2s2"].with_weight_channels_last(), dtype, True, "nhwc",
                                     scatter_gemm.TILES[tile])


def _gather_plan(tile, dtype):
    # grad_output by the copy engine, taps cropped
    return scatter_gemm.plan_grad_input(SCATTER_LAYERS["one_pixel_k4s2p1"], dtype, "nchw", scatter_gemm.TILES[tile])


def _gathered_rows_plan(tile, dtype):
    # grad_output's rows gathered: the producer keeps each row's offset and landing taps
    return scatter_gemm.plan_grad_input(SCATTER_LAYERS["k2x3_crop"], dtype, "nchw", scatter_gemm.TILES[tile])


def _overlapping_plan(layer):
    return lambda tile, dtype: scatter_gemm.plan_grad_input(OVERLAPPING_LAYERS[layer], dtype, "nhwc",
                                                            scatter_gemm.TILES[tile])


# The scatter and gather GEMMs' kernels: their plans, and the transpose immediates of A and B (the forward's B
# MN-major)
ONE_TAP_KERNELS = {"scatter": (_scatter_plan, ("0", "1")), "gather": (_gather_plan, ("0", "0")),
                   "gather_rows": (_gathered_rows_plan, ("0", "0")),
                   "gather_overlapping": (_overlapping_plan("k4s2p1_boxes"), ("0", "0")),
                   "gather_overlapping_rows": (_overlapping_plan("k4s2p1_rows"), ("0", "0")),
                   "gather_dilated_rows": (_overlapping_plan("k3d2_rows"), ("0", "0"))}


# float32 (at TF32) is the gather's alone: the scatter forward's B is MN-major, which TF32 cannot read
ONE_TAP_BUILDS = [(kernel, dtype) for kernel in sorted(ONE_TAP_KERNELS) for dtype in ("float16", "bfloat16", "float32")
                  if not (kernel == "scatter" and dtype == "float32")]


@pytest.mark.parametrize("kernel,dtype", ONE_TAP_BUILDS)
@pytest.mark.parametrize("tile", sorted(scatter_gemm.TILES))
def test_one_tap_gemm_kernels_build_for_sm_90a_without_spilling(kernel, tile, dtype, ptxas_logs):
    """Each tile's accumulators (up to 128 a consumer thread), the gather producer's per-row offsets and landing
    taps, and the shared-memory ring fit, with no stack frame and no serialised warpgroup MMAs; A is K-major (TF32
    MMAs take no transpose immediates: both operands are)."""
    make, majors = ONE_TAP_KERNELS[kernel]
    main = make(tile, dtype).gemm
    log = ptxas_logs(main.spec)
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found and found.groups() == ("0", "0", "0"), log
    assert "serialized" not in log and "Performance Loss" not in log, log
    static = re.search(r"(\d+) bytes smem", log)
    assert main.smem_bytes + (int(static.group(1)) if static else 0) <= 227 * 1024, log
    ptx = compile_ptx(main.spec.source(), main.spec.function, "compute_90a", main.spec.options[:1])
    if dtype == "float32":
        assert re.search(r"wgmma\.mma_async[^;]*?k8\.f32\.tf32\.tf32[^;]*?, 1, 1;", ptx, re.S)
    else:
        assert set(re.findall(r"wgmma\.mma_async[^;]*?, 1, 1, (\d), (\d);", ptx, re.S)) == {majors}


def _in_place_plan(layer, tile):
    return scatter_gemm.plan_grad_input(OVERLAPPING_LAYERS[layer], "float32", "nhwc", scatter_gemm.TILES[tile],
                                        in_place=True)


IN_PLACE_LAYERS = ("k4s2p1_boxes", "k4s2p1_rows", "k3d2_rows")


@pytest.mark.parametrize("layer", IN_PLACE_LAYERS)
@pytest.mark.parametrize("tile", sorted(scatter_gemm.TILES))
def test_tf32_gather_reading_grad_output_in_place_builds_without_spilling(layer, tile, ptxas_logs):
    """The TF32 gather that reads a channels_last grad_output in place: each consumer thread's A words fit with no
    stack frame and no serialised MMAs, two steps' sets of them where they fit beside the accumulators (all tiles
    but 128 x 128, whose 128 accumulators leave room for one set of 32), and its MMAs take A from registers,
    four words each, with B through its descriptor."""
    main = _in_place_plan(layer, tile).gemm
    assert dict(main.spec.constants)["A_IN_PLACE"]
    log = ptxas_logs(main.spec)
    found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found and found.groups() == ("0", "0", "0"), log
    assert "serialized" not in log and "Performance Loss" not in log, log
    ptx = compile_ptx(main.spec.source(), main.spec.function, "compute_90a", main.spec.options[:1])
    mmas = re.findall(r"wgmma\.mma_async[^;]*?k8\.f32\.tf32\.tf32 \{[^}]*\}, (\{[^}]*\}|%rd\d+), %rd\d+, p, 1, 1;",
                      ptx, re.S)
    t = scatter_gemm.TILES[tile]
    sets = 2 if t.registers_a_twice else 1   # the planner's mirror of the kernel's A_SETS; a step per set
    assert len(mmas) == t.mb * 4 * sets and all(a.count("%r") == 4 for a in mmas), mmas
    assert ptx.count("ld.shared.b32") == t.mb * 16 * sets, "four words a thread for each 8-column MMA step of a block"
    assert ptx.count("wgmma.wait_group.sync.aligned 1;") == (sets == 2) * 2, "two sets: a step's MMAs stay in flight"


@pytest.mark.parametrize("name", ["asym_dilated", "wide"])
def test_expanded_taps_kernels_build_without_spilling(name):
    """The layers whose threads prefetch the most grad_output values (50 and 56 of :data:`MAX_PREFETCHED`) build
    for sm_80 and sm_90 with no stack frame, channels_last and NCHW (TF32 and bf16)."""
    g = EXPANDED_TAPS_LAYERS[name]
    assert expanded_taps.prefetched_values(g) >= 48
    # the same layer on an image of whole 16-byte runs, for NCHW
    nchw = geometry((g.batch, g.in_channels, 8, 8), g.weight_shape, None, g.params).with_weight_channels_last(
        g.weight_channels_last)
    # (strict float32, 3xTF32, takes up to 64 expanded columns: neither layer's 80 or 112; TF32 takes both)
    assert not expanded_taps.eligible(nchw, "float32", "nchw", "strict")
    for spec in (expanded_taps.plan_grad_weight(g, "bfloat16", 132)[0].spec,
                 expanded_taps.plan_grad_input(g, "float16", 132).spec,
                 expanded_taps.plan_grad_weight(nchw, "bfloat16", 132, None, "nchw")[0].spec,
                 expanded_taps.plan_grad_input(nchw, "bfloat16", 132, "nchw").spec,
                 expanded_taps.plan_grad_weight(nchw, "float32", 132, None, "nchw", "tf32")[0].spec,
                 expanded_taps.plan_grad_input(nchw, "float32", 132, "nchw", "tf32").spec):
        for arch in ("sm_80", "sm_90"):
            log = _ptxas_log(spec, (f"-arch={arch}",))
            found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
            assert found and found.groups() == ("0", "0", "0"), (spec.function, arch, log)


@pytest.mark.parametrize("name", list(THIN_MMA_LAYERS))
def test_thin_mma_kernels_build_without_spilling(name):
    """The thin-output forward builds for sm_80 and sm_90 with no stack frame."""
    g, bias, precision = THIN_MMA_LAYERS[name]
    spec = thin_mma.plan_forward(g, "float32", bias, precision).spec
    for arch in ("sm_80", "sm_90"):
        log = _ptxas_log(spec, (f"-arch={arch}",))
        found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert found and found.groups() == ("0", "0", "0"), (arch, log)


@pytest.mark.parametrize("name", list(DEPTHWISE_LAYERS))
def test_depthwise_kernels_build_without_spilling(name):
    """The depthwise kernels build for sm_80 and sm_90 with no stack frame (their windows and accumulators stay in
    registers)."""
    g, dtype, pass_, tile = DEPTHWISE_LAYERS[name]
    spec = depthwise.plan(g, dtype, pass_, pass_ == "forward", True, tile).spec
    for arch in ("sm_80", "sm_90"):
        log = _ptxas_log(spec, (f"-arch={arch}",))
        found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert found and found.groups() == ("0", "0", "0"), (arch, log)


@pytest.mark.parametrize("precision", ["tf32", "strict"])
def test_expanded_taps_float32_rgb_kernels_build_without_spilling(precision):
    """pix2pix's float32 RGB layer (NCHW, TF32 or 3xTF32) and a strict float32 layer of 64 expanded columns, the
    most 3xTF32 takes, build for sm_90 (and, but TF32's grad_input, sm_80) with no stack frame.  TF32's grad_input
    spills 8 bytes for sm_80 at 168 registers; asking for one block an SM removes it at 180-192 registers, a block
    an SM fewer, so sm_80 keeps the spill."""
    layers = [_layer((16, 128, 128, 128), (128, 3, 4, 4), stride=2, padding=1)]
    if precision == "strict":
        layers.append(_layer((2, 128, 8, 8), (128, 4, 4, 4), stride=2, padding=1))
    for g in layers:
        for spec in (expanded_taps.plan_grad_weight(g, "float32", 132, None, "nchw", precision)[0].spec,
                     expanded_taps.plan_grad_input(g, "float32", 132, "nchw", precision).spec):
            tf32_grad_input = precision == "tf32" and "grad_input" in spec.function
            for arch in ("sm_90",) if tf32_grad_input else ("sm_80", "sm_90"):
                log = _ptxas_log(spec, (f"-arch={arch}",))
                found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                  log)
                assert found and found.groups() == ("0", "0", "0"), (spec.function, arch, log)


@pytest.mark.parametrize("name", list(GROUPED_MMA_LAYERS))
def test_grouped_mma_kernels_build_without_spilling(name):
    """Every block of the grouped mma forward, grad_input and grad_weight builds for sm_80 and sm_90 with no stack
    frame, grad_weight's single chunk and partials alike, the forward's and grad_input's second block storing NCHW;
    its dynamic shared memory is all it uses."""
    g = GROUPED_MMA_LAYERS[name]
    specs = [grouped_mma.plan_grad_weight(g, ("float16", "bfloat16")[i % 2], 132, block)[0].spec
             for i, block in enumerate(grouped_mma.blocks(g))]
    specs += [grouped_mma.plan_forward(g, ("float16", "bfloat16")[i % 2], i % 2 == 0, 132, block, i == 1).spec
              for i, block in enumerate(grouped_mma.forward_blocks(g))]
    specs += [grouped_mma.plan_grad_input(g, ("bfloat16", "float16")[i % 2], 132, block, i == 1).spec
              for i, block in enumerate(grouped_mma.grad_input_blocks(g))]
    for i, spec in enumerate(specs):
        for arch in ("sm_80", "sm_90"):
            log = _ptxas_log(spec, (f"-arch={arch}",))
            found = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
            assert found and found.groups() == ("0", "0", "0"), (arch, spec.function, log)
            assert not re.search(r"[1-9]\d* bytes smem", log), log


def test_the_wgmma_transpose_immediates_follow_the_operand_majors():
    """The forward and grad_input read K-major operands (transpose immediates 0, 0); grad_weight reads both
    MN-major (1, 1)."""
    def immediates(spec):
        ptx = compile_ptx(spec.source(), spec.function, "compute_90a", spec.options[:1])
        return set(re.findall(r"wgmma\.mma_async[^;]*?, 1, 1, (\d), (\d);", ptx, re.S))

    g = WGMMA_GRAD_WEIGHT_LAYERS["4x4_stride2"]
    assert immediates(wgmma.plan_grad_weight(g, "bfloat16", 132, "nhwc").partial.spec) == {("1", "1")}
    assert immediates(wgmma.plan_forward(g, "bfloat16", False, "nhwc").gemm.spec) == {("0", "0")}
    assert immediates(wgmma.plan_grad_input(g, "float16", "nhwc").gemm.spec) == {("0", "0")}
    # TF32 takes no transpose immediates: K-major operands only
    spec = wgmma.plan_grad_weight_tf32(g, 132, "nchw").partial.spec
    tf32 = compile_ptx(spec.source(), spec.function, "compute_90a", spec.options[:1])
    assert re.search(r"wgmma\.mma_async[^;]*?k8\.f32\.tf32\.tf32[^;]*?, 1, 1;", tf32, re.S)


# The specs each ptxas test builds, from its parameters: ptxas_logs builds them all up front.
_PTXAS_SPECS = {
    "test_wgmma_kernels_build_for_sm_90a_without_spilling": lambda name: [_spill_plan(name).spec],
    "test_split_k_wgmma_kernels_build_for_sm_90a_without_spilling": lambda name: [_split_k_plan(name).gemm.spec],
    "test_wgmma_grad_weight_kernels_build_for_sm_90a_without_spilling":
        lambda layer, tile, dtype: [_weight_split(layer, tile, dtype).partial.spec],
    "test_tf32_grad_weight_kernels_build_for_sm_90a_without_spilling":
        lambda layer, tile, layout, precision: [_tf32_weight_split(layer, tile, layout, precision).partial.spec],
    "test_grad_weight_kernels_writing_a_channels_last_weight_build_without_spilling":
        lambda layer: [split.partial.spec for split in _channels_last_weight_splits(layer)],
    "test_one_tap_gemm_kernels_build_for_sm_90a_without_spilling":
        lambda kernel, tile, dtype: [ONE_TAP_KERNELS[kernel][0](tile, dtype).gemm.spec],
    "test_tf32_gather_reading_grad_output_in_place_builds_without_spilling":
        lambda layer, tile: [_in_place_plan(layer, tile).gemm.spec],
}


def _ptxas_log_or_error(spec):
    try:
        return _ptxas_log(spec)
    except Exception as error:   # raised again by the test that reads it
        return error


@pytest.fixture(scope="module")
def ptxas_logs(request):
    """``log(spec)``: ptxas's log of a spec, every one this session's ptxas tests need built up front on a thread
    per CPU (NVRTC releases the GIL); a spec built by no selected test is built when asked for."""
    specs = {spec for item in request.session.items
             if item.module.__name__ == __name__ and getattr(item, "originalname", None) in _PTXAS_SPECS
             for spec in _PTXAS_SPECS[item.originalname](**item.callspec.params)}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        logs = dict(zip(specs, pool.map(_ptxas_log_or_error, specs)))

    def log(spec):
        found = logs[spec] if spec in logs else _ptxas_log_or_error(spec)
        if isinstance(found, Exception):
            raise found
        return found
    return log


def test_warm_up_starts_nvrtc_once_a_process_in_a_daemon_thread(monkeypatch):
    """compiler.warm_up builds a one-line kernel to PTX in a daemon thread, once a process (later calls return
    the same thread), and where NVRTC fails it ends quietly: the first real build reports the problem."""
    monkeypatch.setattr(compiler, "_warm_up", None)
    built = []
    real = compiler.compile_ptx
    monkeypatch.setattr(compiler, "compile_ptx", lambda *a, **k: built.append(a[2]) or real(*a, **k))
    thread = compiler.warm_up()
    assert thread.daemon and thread.name == compiler.WARM_UP_THREAD
    assert compiler.warm_up() is thread
    thread.join(60)
    assert not thread.is_alive() and built == ["compute_80"]

    failures = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args))
    monkeypatch.setattr(compiler, "_warm_up", None)

    def no_nvrtc(*args, **kwargs):
        raise ImportError("no NVRTC here")
    monkeypatch.setattr(compiler, "compile_ptx", no_nvrtc)
    quiet = compiler.warm_up()
    quiet.join(60)
    assert quiet is not thread and not quiet.is_alive() and failures == []
