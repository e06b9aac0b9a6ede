#!/usr/bin/env python3
"""Run compute-sanitizer (memcheck, racecheck, synccheck) over every cupyconv kernel family.

    python scripts/sanitize.py                      # all tools, all cases
    python scripts/sanitize.py --tools racecheck --cases gemm
    python scripts/sanitize.py --dry-run            # the plan and the commands; needs no GPU
    python scripts/sanitize.py --list               # the cases

The workload is a set of tiny layers run forward and backward through cupyconv.torch (and
the CuPy API): the direct kernels (forward, grad_input, grad_weight and grad_bias with
their split-K reductions) in float32, float64, float16 and bfloat16; every tile of the
tiled NCHW forward, with vector and element stores; the tensor-core kernels (GEMM forward
and grad_input, grad_weight GEMM, weight repack, channels_last copy) in float16, bfloat16,
strict float32 and TF32, on NCHW, channels_last and misaligned channels_last memory; every
tuner candidate (block tile, pipeline depth) of one layer per layout; weights in
channels_last memory (read, and grad_weight written, in place); and NaN/Inf data.  Data
is made on the host and copied over, and memory caching is off in torch and CuPy, so the
only kernels that run are cupyconv's and every buffer is its own
allocation (memcheck sees an access one element past it).

First one plain run compiles every kernel into a private CuPy cache and checks results
against float64 torch on the host; then each tool runs the same workload.  The report
says, per tool, clean or unclean with the errors by kernel, and which kernels ran.  The
exit status is 0 when every tool is clean and every kernel template ran, 1 when a tool
reported errors or the coverage is short, 2 for bad arguments or no compute-sanitizer,
3 when the workload itself failed.  Kernels are the 32-bit-offset variants: the 64-bit
ones need tensors of 2**31 elements (tests/test_huge_gpu.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOOLS = ("memcheck", "racecheck", "synccheck")
ERROR_EXIT = 86
EXIT_OK, EXIT_UNCLEAN, EXIT_USAGE, EXIT_WORKLOAD = 0, 1, 2, 3
PASSES = ("forward", "grad_input", "grad_weight")


@dataclass(frozen=True)
class Case:
    """One tiny layer run forward and backward once."""

    name: str
    x_shape: Tuple[int, ...]
    w_shape: Tuple[int, int, int, int]
    kwargs: Tuple[Tuple[str, object], ...]
    bias: bool
    dtype: str                       # float32, float64, float16, bfloat16
    precision: str = "strict"        # or "tf32" (float32 only)
    layout: str = "nchw"             # memory format of input and grad_output: "nchw" or "nhwc"
    api: str = "torch"               # "torch" (cupyconv.torch) or "cupy" (the array API)
    unaligned: bool = False          # activations one element past a 16-byte boundary
    nonfinite: bool = False          # NaN and Inf planted in input and grad_output
    variants: Tuple[Tuple[str, str], ...] = ()   # (pass, tuner variant name) forced
    weight_cl: bool = False          # the weight channels_last: read, and grad_weight written, in place

    def __post_init__(self) -> None:
        # Like cuDNN, the torch path runs a layer whose weight is channels_last in channels_last, whatever the
        # input's memory: an NCHW case would plan kernels that never run.
        if self.weight_cl and self.layout != "nhwc":
            raise ValueError(f"case {self.name}: a channels_last weight runs in the nhwc layout")

    @property
    def kw(self) -> dict:
        return dict(self.kwargs)


def _kw(**kwargs) -> Tuple[Tuple[str, object], ...]:
    return tuple(sorted(kwargs.items()))


# Thin layers run on the direct kernels; the second has 25 taps (two kernel-row blocks
# in grad_weight) and stride 4; the last stages its forward weights in three chunks
# and reads grad_output windows too wide to share between pixels.
DIRECT_LAYERS = {
    "grouped": ((2, 4, 5, 6), (4, 3, 3, 2), _kw(stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2,
                                                 dilation=(1, 2))),
    "k5s4": ((1, 3, 4, 3), (3, 2, 5, 5), _kw(stride=4, padding=2, output_padding=3)),
    "depthwise": ((2, 6, 5, 5), (6, 1, 4, 4), _kw(stride=2, padding=1, groups=6)),
    "wide_rows": ((1, 24, 4, 6), (24, 8, 5, 9), _kw(stride=(1, 2), padding=(2, 4), dilation=(1, 3))),
    # enough rows that grad_weight and grad_bias split into several chunks and a reduce
    # (the others fit one chunk, which writes its gradient directly); two input channels, so
    # that its channels_last input is not also contiguous
    "many_rows": ((16, 2, 16, 8), (2, 2, 3, 11), _kw(stride=3, dilation=(1, 3))),
}
# Kernels too large for the direct kernels run on the large_kernel family.
LARGE_KERNEL_LAYERS = {
    "k101": ((8, 2, 9, 6), (2, 1, 101, 101), _kw(stride=(2, 1), padding=(3, 50), groups=2)),
}
# Layers wide enough for the tensor cores: 16 and 32 channels per group; 20 input
# channels per group (rows of 40 bytes in fp16: the element-gathering load path); and
# 128 channels, whose GEMMs take the 64- and 128-wide block tiles.
GEMM_LAYERS = {
    "dense": ((2, 16, 5, 4), (16, 32, 3, 3), _kw(stride=2, padding=1, output_padding=1)),
    "grouped20": ((1, 40, 4, 5), (40, 16, 2, 3), _kw(stride=(1, 2), padding=(0, 1), groups=2, dilation=(2, 1))),
    "wide": ((1, 128, 3, 2), (128, 128, 2, 2), _kw(stride=2)),
}
GEMM_CASES = (("float16", "strict"), ("bfloat16", "strict"), ("float32", "strict"), ("float32", "tf32"))


def base_cases() -> List[Case]:
    from cupyconv.core.geometry import ConvParams, geometry
    from cupyconv.plans import tiled

    cases = []
    for name, (xs, ws, kw) in DIRECT_LAYERS.items():
        for dtype in ("float32", "float64", "float16", "bfloat16"):
            cases.append(Case(f"direct-{name}-{dtype}", xs, ws, kw, name != "depthwise", dtype))
    # NCHW forwards of thin layers lead with the tiled kernels: the direct forward forced, and every tile of
    # the tiled one, with element stores (an input one element off a 16-byte boundary) on top
    for name, (xs, ws, kw) in DIRECT_LAYERS.items():
        cases.append(Case(f"direct-{name}-float16-direct-forward", xs, ws, kw, name != "depthwise", "float16",
                          variants=(("forward", "direct"),)))
    for name in ("grouped", "depthwise"):
        xs, ws, kw = DIRECT_LAYERS[name]
        g = geometry(xs, ws, None, ConvParams.from_args(**dict(kw)))
        for tile in tiled.tiles(g, "float16"):
            variant = f"tiled:{tiled.tile_name(tile)}"
            cases.append(Case(f"{variant}-{name}-float16", xs, ws, kw, True, "float16",
                              variants=(("forward", variant),)))
        cases.append(Case(f"tiled-{name}-float32-unaligned", xs, ws, kw, True, "float32", unaligned=True))
    xs, ws, kw = DIRECT_LAYERS["grouped"]
    cases.append(Case("direct-grouped-float32-cupy", xs, ws, kw, True, "float32", api="cupy"))
    cases.append(Case("direct-grouped-float32-nonfinite", xs, ws, kw, True, "float32", nonfinite=True))
    for name, (xs, ws, kw) in DIRECT_LAYERS.items():
        for dtype in ("float32", "float16"):
            cases.append(Case(f"direct-{name}-{dtype}-nhwc", xs, ws, kw, name != "depthwise", dtype, layout="nhwc"))
    # channels_last grad_input reading 16-byte runs of a group's eight output channels (a raced block, and the
    # heuristic's in fp32's runs of four); one element off a 16-byte boundary it reads a channel at a time
    xs, ws, kw = (2, 16, 5, 6), (16, 8, 3, 3), _kw(stride=2, padding=1, groups=2)
    for dtype, variant, unaligned in (("float16", "direct:8x4", False), ("bfloat16", "direct", False),
                                      ("float32", "direct", False), ("float16", "direct", True)):
        cases.append(Case(f"direct-runs-{dtype}-nhwc{'-unaligned' if unaligned else ''}", xs, ws, kw, True, dtype,
                          layout="nhwc", unaligned=unaligned, variants=(("grad_input", variant),)))
    for name, (xs, ws, kw) in LARGE_KERNEL_LAYERS.items():
        for dtype in ("float32", "float64", "float16", "bfloat16"):
            for layout in ("nchw", "nhwc"):
                cases.append(Case(f"large-{name}-{dtype}-{layout}", xs, ws, kw, True, dtype, layout=layout))
    for name, (xs, ws, kw) in GEMM_LAYERS.items():
        for dtype, precision in GEMM_CASES:
            tag = "tf32" if precision == "tf32" else dtype
            for layout in ("nchw", "nhwc"):
                cases.append(Case(f"gemm-{name}-{tag}-{layout}", xs, ws, kw, True, dtype, precision, layout))
            cases.append(Case(f"gemm-{name}-{tag}-nhwc-unaligned", xs, ws, kw, True, dtype, precision, "nhwc",
                              unaligned=True))
    # On sm_90 the fp16/bf16 forward and grad_input of the GEMM layers run the wgmma kernels.
    # Here 256 two-pixel images with an 8x8 tile make 256 tiles: more than an H100 has SMs,
    # so persistent blocks walk two tiles each and the producer runs ahead across tiles
    # (its mbarriers wrap their phases).  (One pixel would make channels_last and NCHW the
    # same memory, and the op would run the NCHW kernels.)
    # float32 at TF32 precision runs them too, its producer rounding each halo vector in shared memory.
    # TF32 in both layouts: an NCHW source's rounded copy lets the producer hand halos over as they land, a
    # channels_last one is rounded by the producer
    for dtype, precision, layout in (("float16", "strict", "nhwc"), ("bfloat16", "strict", "nchw"),
                                     ("float32", "tf32", "nhwc"), ("float32", "tf32", "nchw")):
        tag = "tf32" if precision == "tf32" else dtype
        cases.append(Case(f"wgmma-persistent-{tag}-{layout}", (256, 16, 1, 2), (16, 64, 3, 3), _kw(), True,
                          dtype, precision, layout=layout, variants=(("forward", "wgmma:8x8x64"),)))
    # and a channels_last TF32 source copied rounded first (the ``copy`` option), read as the NCHW copy is, the
    # forward and grad_input pinned to it
    cases.append(Case("wgmma-persistent-tf32-nhwc-copy", (256, 16, 1, 2), (16, 64, 3, 3), _kw(), True, "float32",
                      "tf32", layout="nhwc", variants=(("forward", "wgmma:8x8x64:copy"), ("grad_input", "wgmma:copy"))))
    # strict float32 runs them as 3xTF32, its producer splitting each halo vector into two parts in shared memory,
    # the forward and grad_input pinned in both layouts, and once with NaN and Inf in the sources
    for layout, nonfinite in (("nhwc", False), ("nchw", False), ("nhwc", True)):
        cases.append(Case(f"wgmma-persistent-3xtf32-{layout}{'-nonfinite' if nonfinite else ''}", (256, 16, 1, 2),
                          (16, 64, 3, 3), _kw(), True, "float32", layout=layout, nonfinite=nonfinite,
                          variants=(("forward", "wgmma:8x8x64"), ("grad_input", "wgmma"))))
    # a thin destination (three output channels) on N tiles of 8, persistent as above
    cases.append(Case("wgmma-persistent-thin-bfloat16-nhwc", (256, 16, 1, 2), (16, 3, 4, 4), _kw(stride=2, padding=1),
                      True, "bfloat16", layout="nhwc", variants=(("forward", "wgmma:4i8x8x8"),)))
    # grad_weight's wgmma kernel races the GEMM, so it runs pinned: four taps a block on a 4 x 4 stride-2 layer,
    # and on a 3 x 3 stride-1 one a last group of one tap; both split K across blocks.
    cases.append(Case("wgmma-grad-weight-float16-nhwc", (2, 16, 10, 9), (16, 16, 4, 4), _kw(stride=2, padding=1),
                      False, "float16", layout="nhwc", variants=(("grad_weight", "wgmma"),)))
    cases.append(Case("wgmma-grad-weight-bfloat16-nchw", (3, 16, 9, 9), (16, 32, 3, 3), _kw(padding=1), False,
                      "bfloat16", layout="nchw", variants=(("grad_weight", "wgmma"),)))
    # the 16-row tile: a three-buffer ring, and a last K step past the input's 18 rows
    cases.append(Case("wgmma-grad-weight-float16-nhwc-16rows", (1, 16, 18, 9), (16, 16, 4, 4),
                      _kw(stride=2, padding=1), False, "float16", layout="nhwc",
                      variants=(("grad_weight", "wgmma:64x64x4r16"),)))
    # TF32 grad_weight (four images a K row, each word its own copy): a batch of 3 (the last image group part
    # empty), a split K, and in channels_last 20 -> 17 channels at stride 1 (a last tap group of one)
    cases.append(Case("wgmma-grad-weight-tf32-nchw", (3, 16, 9, 9), (16, 24, 4, 4), _kw(stride=2, padding=1), False,
                      "float32", "tf32", layout="nchw", variants=(("grad_weight", "wgmma"),)))
    cases.append(Case("wgmma-grad-weight-tf32-nhwc", (5, 20, 6, 6), (20, 17, 3, 3), _kw(padding=1), False,
                      "float32", "tf32", layout="nhwc", variants=(("grad_weight", "wgmma"),)))
    # channels in whole fours, packed from 16-byte runs (VEC4), a batch of 5 (the last image group part empty)
    for tag, precision in (("tf32", "tf32"), ("3xtf32", "strict")):
        cases.append(Case(f"wgmma-grad-weight-{tag}-nhwc-runs", (5, 20, 6, 6), (20, 16, 3, 3), _kw(padding=1),
                          False, "float32", precision, layout="nhwc", variants=(("grad_weight", "wgmma"),)))
    # 3xTF32: sources packed in two parts, both copied into each stage
    cases.append(Case("wgmma-grad-weight-3xtf32-nchw", (3, 16, 9, 9), (16, 24, 4, 4), _kw(stride=2, padding=1), False,
                      "float32", layout="nchw", variants=(("grad_weight", "wgmma"),)))
    cases.append(Case("wgmma-grad-weight-3xtf32-nhwc", (5, 20, 6, 6), (20, 17, 3, 3), _kw(padding=1), False,
                      "float32", layout="nhwc", variants=(("grad_weight", "wgmma"),)))
    # one-row patches (1-D layers and grids under eight rows): a 70-column row (a last patch part outside), in
    # each 16-bit type and TF32; three rows on a 1 x 128 x 256 tile; grad_weight's 1 x 64 K steps, split over K
    xs, ws, kw = (2, 16, 1, 70), (16, 32, 1, 4), _kw(stride=(1, 2), padding=(0, 1))
    one_row = (("forward", "wgmma"), ("grad_input", "wgmma"), ("grad_weight", "wgmma"))
    for dtype, precision, layout in (("float16", "strict", "nhwc"), ("bfloat16", "strict", "nchw"),
                                     ("float32", "tf32", "nhwc")):
        tag = "tf32" if precision == "tf32" else dtype
        cases.append(Case(f"wgmma-one-row-{tag}-{layout}", xs, ws, kw, True, dtype, precision, layout=layout,
                          variants=one_row))
    cases.append(Case("wgmma-one-row-float16-nhwc-3rows", (1, 16, 3, 66), (16, 256, 3, 4), _kw(stride=2, padding=1),
                      True, "float16", layout="nhwc",
                      variants=(("forward", "wgmma:1x128x256"), ("grad_input", "wgmma:1x128x16"),
                                ("grad_weight", "wgmma:64x128x2r1w64"))))
    # channels_last weights (model.to(memory_format=torch.channels_last)): every weight offset, both packs and
    # grad_weight's stores in that layout; wgmma's grad_weight split over K (the plain reduce) and in one K range
    # of 16 taps (writing grad_weight itself)
    xs, ws, kw = DIRECT_LAYERS["grouped"]
    cases.append(Case("direct-grouped-float32-nhwc-weight_cl", xs, ws, kw, True, "float32", layout="nhwc",
                      weight_cl=True))
    cases.append(Case("large-k101-float32-nhwc-weight_cl", (8, 2, 9, 6), (2, 2, 101, 101),
                      _kw(stride=(2, 1), padding=(3, 50)), True, "float32", layout="nhwc", weight_cl=True))
    xs, ws, kw = GEMM_LAYERS["dense"]
    for dtype, precision in GEMM_CASES:
        tag = "tf32" if precision == "tf32" else dtype
        cases.append(Case(f"gemm-dense-{tag}-nhwc-weight_cl", xs, ws, kw, True, dtype, precision, "nhwc",
                          weight_cl=True))
    for tag, dtype, precision in (("float16", "float16", "strict"), ("tf32", "float32", "tf32")):
        cases.append(Case(f"wgmma-grad-weight-{tag}-nhwc-weight_cl", (2, 16, 10, 9), (16, 16, 4, 4),
                          _kw(stride=2, padding=1), False, dtype, precision, layout="nhwc",
                          variants=(("grad_weight", "wgmma"),), weight_cl=True))
        cases.append(Case(f"wgmma-grad-weight-{tag}-nhwc-weight_cl-one-range", (1, 16, 2, 2), (16, 16, 4, 4),
                          _kw(stride=2, padding=1), False, dtype, precision, layout="nhwc",
                          variants=(("grad_weight", "wgmma"),), weight_cl=True))
    # a 16-bit channels_last weight read in place: wgmma's forward (an MN-major B of two 64-channel column blocks,
    # 72 output channels) and grad_input (64-channel swizzled rows, a second chunk of 8), and the GEMMs' ([K][N] B
    # tiles for the forward) split over uneven K ranges; then grad_input's 32-channel chunk, in the pack's planes
    for dtype in ("float16", "bfloat16"):
        cases.append(Case(f"wgmma-weight-in-place-{dtype}-nhwc", (1, 64, 6, 6), (64, 72, 3, 3),
                          _kw(stride=2, padding=1), True, dtype, layout="nhwc", weight_cl=True,
                          variants=(("forward", "wgmma"), ("grad_input", "wgmma"))))
        cases.append(Case(f"gemm-weight-in-place-{dtype}-nhwc", (1, 64, 6, 6), (64, 72, 3, 3),
                          _kw(stride=2, padding=1), True, dtype, layout="nhwc", weight_cl=True,
                          variants=(("forward", "gemm:k3"), ("grad_input", "gemm:k3"))))
    cases.append(Case("wgmma-weight-in-place-planes-bfloat16-nhwc", (1, 48, 7, 9), (48, 32, 3, 3),
                      _kw(stride=2, padding=1), False, "bfloat16", layout="nhwc", weight_cl=True,
                      variants=(("grad_input", "wgmma"),)))
    # halos of 64-channel chunks land by the copy engine (TMA): the forward's boxes hang past the 3 x 7 input,
    # grad_input's are walked at stride (2, 1), and grad_weight's tiles come through it as well
    for dtype in ("float16", "bfloat16"):
        cases.append(Case(f"wgmma-copy-engine-{dtype}-nhwc", (2, 64, 3, 7), (64, 64, 3, 4),
                          _kw(stride=(2, 1), padding=(1, 0)), True, dtype, layout="nhwc",
                          variants=(("forward", "wgmma"), ("grad_input", "wgmma"), ("grad_weight", "wgmma"))))
    # weight-bound: two 2 x 2 images of 128 channels, whose GEMMs split K (forward and grad_input each forced to
    # uneven ranges, in 16 bits a last one empty) and reduce the partials with the bias
    for dtype, precision, layout in (("float16", "strict", "nhwc"), ("bfloat16", "strict", "nchw"),
                                     ("float32", "tf32", "nchw"), ("float32", "strict", "nhwc")):
        tag = "tf32" if precision == "tf32" else dtype
        cases.append(Case(f"gemm-split-{tag}-{layout}", (2, 128, 2, 2), (128, 32, 4, 4), _kw(stride=2, padding=1),
                          True, dtype, precision, layout,
                          variants=(("forward", "gemm:k5"), ("grad_input", "gemm:k7"))))
    cases.append(Case("gemm-dense-float16-cupy", xs, ws, kw, True, "float16", api="cupy"))
    cases.append(Case("gemm-dense-float32-nonfinite", xs, ws, kw, True, "float32", nonfinite=True))
    cases.append(Case("gemm-dense-tf32-nhwc-nonfinite", xs, ws, kw, True, "float32", "tf32", "nhwc", nonfinite=True))
    cases.append(Case("gemm-dense-float16-nhwc-nonfinite", xs, ws, kw, True, "float16", layout="nhwc",
                      nonfinite=True))
    # the one-tap GEMMs (scatter forward, gather grad_input): a channels_last weight read in place and a contiguous
    # one copied into that order, both layouts, bias; a cropping layer (one input row, 4 x 2 kernels at stride 2,
    # padding (1, 0), 64 output channels: grad_output by copy-engine boxes where the others gather rows); then 320 tiles of 64 x 128 (8 input channels, 5120 columns), so that each block's two
    # consumer warpgroups take tiles in turn, the first waiting on the second.  grad_input's tiles cover x, so a tiny layer has one or two: its walk over
    # many is the same block code (pingpong_gemm.cuh) as this forward's, and test_scatter_gemm_gpu runs it.
    for dtype, layout, weight_cl in (("float16", "nhwc", True), ("bfloat16", "nchw", False)):
        cases.append(Case(f"scatter-gemm-{dtype}-{layout}" + ("-weight_cl" if weight_cl else ""), (1, 64, 6, 8),
                          (64, 48, 2, 2), _kw(stride=2), True, dtype, layout=layout, weight_cl=weight_cl,
                          variants=(("forward", "scatter_gemm"), ("grad_input", "scatter_gemm"))))
    cases.append(Case("scatter-gemm-cropped-float16-nhwc", (2, 64, 1, 3), (64, 64, 4, 2), _kw(stride=2, padding=(1, 0)),
                      True, "float16", layout="nhwc", weight_cl=True,
                      variants=(("forward", "scatter_gemm"), ("grad_input", "scatter_gemm"))))
    # grad_input of overlapping taps (4 x 4 at stride 2, cropped) through the gather: 64 output channels by
    # copy-engine boxes, 48 by gathered rows with landing masks; and a dilated 3 x 3
    for cout, dtype, layout in ((64, "bfloat16", "nhwc"), (48, "float16", "nchw")):
        cases.append(Case(f"scatter-gemm-overlapping-{cout}-{dtype}-{layout}", (2, 64, 3, 5), (64, cout, 4, 4),
                          _kw(stride=2, padding=1), False, dtype, layout=layout, weight_cl=layout == "nhwc",
                          variants=(("grad_input", "scatter_gemm"),)))
    # the same gather at TF32 (float32 operands through rounding copies): boxes beside a channels_last weight read
    # through its rounding copy, gathered rows beside a contiguous one rounded into channels_last order
    for cout, layout in ((64, "nhwc"), (48, "nchw")):
        cases.append(Case(f"scatter-gemm-overlapping-{cout}-tf32-{layout}", (2, 64, 3, 5), (64, cout, 4, 4),
                          _kw(stride=2, padding=1), False, "float32", "tf32", layout, weight_cl=layout == "nhwc",
                          variants=(("grad_input", "scatter_gemm"),)))
    # and reading a channels_last grad_output in place, the consumers rounding A in registers: boxes (64 output
    # channels) and gathered rows (48)
    for cout in (64, 48):
        cases.append(Case(f"scatter-gemm-overlapping-{cout}-tf32-nhwc-inplace", (2, 64, 3, 5), (64, cout, 4, 4),
                          _kw(stride=2, padding=1), False, "float32", "tf32", "nhwc", weight_cl=cout == 64,
                          variants=(("grad_input", "scatter_gemm:inplace"),)))
    cases.append(Case("scatter-gemm-dilated-float16-nhwc", (1, 32, 5, 6), (32, 40, 3, 3), _kw(padding=2, dilation=2),
                      False, "float16", layout="nhwc", variants=(("grad_input", "scatter_gemm"),)))
    cases.append(Case("scatter-gemm-persistent-bfloat16-nhwc", (1, 8, 16, 32), (8, 320, 4, 4), _kw(stride=4), False,
                      "bfloat16", layout="nhwc", weight_cl=True, variants=(("forward", "scatter_gemm:64x128"),)))
    # the expanded-taps gradients (three output channels): two pixel ranges and their wide reduce; then a
    # channels_last weight, a 3 x 3 kernel with output padding and the three-deep ring
    cases.append(Case("expanded-taps-float16-nhwc", (2, 32, 6, 7), (32, 3, 4, 4), _kw(stride=2, padding=1), True,
                      "float16", layout="nhwc",
                      variants=(("grad_input", "expanded_taps"), ("grad_weight", "expanded_taps"))))
    cases.append(Case("expanded-taps-bfloat16-nhwc-weight_cl", (1, 16, 9, 9), (16, 5, 3, 3),
                      _kw(stride=2, padding=1, output_padding=1), False, "bfloat16", layout="nhwc", weight_cl=True,
                      variants=(("grad_input", "expanded_taps"), ("grad_weight", "expanded_taps:s3"))))
    # NCHW, images of 40 pixels (pixel tiles across image borders, the last one part empty): TF32, strict float32
    # (3xTF32) and bf16
    for dtype, precision in (("float32", "tf32"), ("float32", "strict"), ("bfloat16", "strict")):
        cases.append(Case(f"expanded-taps-{dtype}-{precision}-nchw", (3, 24, 5, 8), (24, 3, 4, 4),
                          _kw(stride=2, padding=1), True, dtype, precision=precision, layout="nchw",
                          variants=(("grad_input", "expanded_taps"), ("grad_weight", "expanded_taps"))))
    # the thin-output forward: an RGB layer of 16-byte rows (40 channels: a part-empty chunk), with bias, in TF32 and
    # strict float32 (3xTF32); then one of five output channels from activations one element off (word copies) with
    # output padding
    for precision in ("tf32", "strict"):
        cases.append(Case(f"thin-mma-{precision}-nchw", (2, 40, 5, 8), (40, 3, 4, 4), _kw(stride=2, padding=1), True,
                          "float32", precision, variants=(("forward", "thin_mma"),)))
    cases.append(Case("thin-mma-tf32-nchw-unaligned", (1, 24, 7, 8), (24, 5, 3, 3),
                      _kw(stride=2, padding=1, output_padding=1), False, "float32", "tf32", unaligned=True,
                      variants=(("forward", "thin_mma"),)))
    # the grouped mma forward, grad_input and grad_weight (8 input channels a group): grad_weight split over five
    # chunks and reduced, segments of 32 pixels past the row's end; six groups in grad_weight blocks of four (the
    # second block's last two warps idle); one chunk writing a channels_last weight's gradient itself, in segments
    # of 16, and grad_input in blocks of one group; twelve groups in forward blocks of eight, the second holding
    # four, with a bias
    cases.append(Case("grouped-mma-float16-nhwc", (2, 16, 5, 21), (16, 16, 3, 5),
                      _kw(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=2, output_padding=(1, 0)), False,
                      "float16", layout="nhwc",
                      variants=(("grad_input", "grouped_mma"), ("grad_weight", "grouped_mma"))))
    cases.append(Case("grouped-mma-bfloat16-nhwc-partial-block", (1, 48, 3, 7), (48, 16, 2, 3), _kw(groups=6),
                      True, "bfloat16", layout="nhwc",
                      variants=(("grad_input", "grouped_mma"), ("grad_weight", "grouped_mma"))))
    cases.append(Case("grouped-mma-float16-nhwc-weight_cl-one-chunk", (1, 16, 1, 20), (16, 16, 3, 3),
                      _kw(stride=2, padding=1, groups=2), False, "float16", layout="nhwc", weight_cl=True,
                      variants=(("grad_input", "grouped_mma:1x16"), ("grad_weight", "grouped_mma:2x16"))))
    cases.append(Case("grouped-mma-float16-nhwc-twelve-groups", (1, 96, 3, 5), (96, 16, 3, 3),
                      _kw(stride=2, padding=1, groups=12), True, "float16", layout="nhwc",
                      variants=(("forward", "grouped_mma"), ("grad_weight", "grouped_mma"))))
    # NCHW through channels_last copies: the forward and grad_input store NCHW output, grad_output's copy is shared
    cases.append(Case("grouped-mma-bfloat16-nchw", (2, 32, 3, 21), (32, 16, 3, 5),
                      _kw(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4, output_padding=(1, 0)), True,
                      "bfloat16", layout="nchw",
                      variants=(("forward", "grouped_mma"), ("grad_input", "grouped_mma"),
                                ("grad_weight", "grouped_mma"))))
    # the depthwise family (channels_last): 16- and 8-byte channel runs, patches past the image's edges, a bias;
    # single channels from activations one element off; explicit tiles of the float32 runs on a stride-1 layer
    cases.append(Case("depthwise-float16-nhwc", (2, 24, 5, 7), (24, 1, 4, 4), _kw(stride=2, padding=1, groups=24), True,
                      "float16", layout="nhwc", variants=(("forward", "depthwise"), ("grad_input", "depthwise"))))
    cases.append(Case("depthwise-bfloat16-nhwc-unaligned", (1, 16, 4, 7), (16, 1, 5, 3),
                      _kw(stride=(3, 2), padding=(2, 1), output_padding=(1, 0), dilation=(1, 2), groups=16), True,
                      "bfloat16", layout="nhwc", unaligned=True,
                      variants=(("forward", "depthwise"), ("grad_input", "depthwise"))))
    cases.append(Case("depthwise-float32-nhwc-tiles", (2, 12, 6, 5), (12, 1, 3, 3), _kw(padding=1, groups=12), False,
                      "float32", layout="nhwc",
                      variants=(("forward", "depthwise:2x4x2b3"), ("grad_input", "depthwise:1x2x4b2"))))
    return cases


VARIANT_BASES = ("gemm-wide-float16-nhwc", "gemm-wide-bfloat16-nchw", "gemm-wide-float32-nchw",
                 "gemm-dense-tf32-nhwc")


def variant_cases(cases: Sequence[Case]) -> List[Case]:
    """For a few layers, one case per tuner candidate of each pass beyond the default."""
    from cupyconv.plans import table

    out = []
    by_name = {c.name: c for c in cases}
    for base in VARIANT_BASES:
        case = by_name[base]
        g = _geometry(case)
        per_pass = {p: [v.name for v in table.candidates(p, g, case.dtype, case.layout, case.precision)[1:]]
                    for p in PASSES}
        for i in range(max((len(v) for v in per_pass.values()), default=0)):
            forced = tuple((p, names[i]) for p, names in per_pass.items() if i < len(names))
            out.append(replace(case, name=f"{base}-variant{i + 1}", variants=forced))
    return out


def all_cases() -> List[Case]:
    cases = base_cases()
    return cases + variant_cases(cases)


def select(cases: Sequence[Case], patterns: Optional[str]) -> List[Case]:
    """Cases whose name contains any of the comma-separated ``patterns`` (all when none)."""
    if not patterns or patterns == "all":
        return list(cases)
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [c for c in cases if any(p in c.name for p in wanted)]
    if not chosen:
        raise ValueError(f"no case matches {patterns!r}; see --list")
    return chosen


def _geometry(case: Case):
    from cupyconv.core.geometry import ConvParams, geometry

    g = geometry(case.x_shape, case.w_shape, None, ConvParams.from_args(**case.kw))
    return g.with_weight_channels_last(case.weight_cl)


# -------------------------------------------------------------------- the plan, no GPU

def _forced_variants(case: Case):
    """Run the case's tuner variants, and the tuner's default for the other passes.

    Nothing is timed and nothing is remembered, so planning on the host and running on the
    GPU pick the same kernels.
    """
    from cupyconv.tuning import Variant, pinned

    return pinned({p: Variant.parse(name) for p, name in case.variants})


def planned_specs(case: Case, sm_count: int = 132) -> list:
    """The kernels (KernelSpecs) the case launches, worked out on the host for an sm_90 GPU of ``sm_count`` SMs."""
    from cupyconv import engine
    from cupyconv.core import device
    from cupyconv.plans.launch import Recorder

    g = _geometry(case)
    dtype, layout = case.dtype, case.layout
    recorder = Recorder(device.fake(0, sm_count=sm_count))
    act = 2 if case.unaligned else 1 << 20
    w, out = 2 << 20, 3 << 20
    with _forced_variants(case):
        engine.forward(g, dtype, act, w, out if case.bias else None, out, recorder, layout, case.precision)
        engine.grad_input(g, dtype, act, w, out, recorder, layout, case.precision)
        engine.grad_weight(g, dtype, act, act, out, recorder, layout, case.precision)
        if case.bias or case.api == "cupy":
            engine.grad_bias(g, dtype, act, out, recorder, layout)
    return [plan.spec for _, plan in recorder.launches]


def template_functions() -> Dict[str, str]:
    """Every kernel function of every template: {function: template}."""
    from cupyconv.jit import templates

    pattern = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(')
    found = {}
    for name in templates.template_names():
        for function in pattern.findall(templates.expanded(name)):
            found[function] = name
    return found


def kernel_label(function: str, constants: dict) -> str:
    """A kernel and the constants that make its variants: dtype, MMA kind, layout, tile, stages."""
    keys = ("SCALAR_T", "MMA_KIND", "MODE", "SRC_CL", "DST_CL", "CHANNELS_LAST", "A_VEC", "BM", "BN", "TAP_GROUP",
            "STAGES", "ELEMENT_BYTES")
    parts = [f"{k}={constants[k]}" for k in keys if k in constants]
    return function + ("[" + ",".join(parts) + "]" if parts else "")


def plan_labels(cases: Sequence[Case]) -> List[str]:
    return sorted({kernel_label(s.function, dict(s.constants)) for c in cases for s in planned_specs(c)})


# ------------------------------------------------------------------------- the worker

def _host_tensor(torch, shape, dtype, seed: int, nonfinite: bool):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64)
    if nonfinite:
        flat = t.view(-1)
        for i, value in zip(range(0, flat.numel(), max(1, flat.numel() // 5)), (float("nan"), float("inf"),
                                                                               float("-inf"), float("nan"))):
            flat[i] = value
    return t.to(getattr(torch, dtype))


def _to_device(torch, t, layout: str, unaligned: bool):
    """Copy a host tensor over (a plain memcpy: no kernel), channels_last and misaligned if asked."""
    if t.dim() == 4 and layout == "nhwc":
        nhwc = t.permute(0, 2, 3, 1).contiguous()
        if unaligned:
            flat = torch.empty(nhwc.numel() + 1, dtype=t.dtype)
            flat[1:] = nhwc.reshape(-1)
            return flat.to("cuda")[1:].view(nhwc.shape).permute(0, 3, 1, 2)
        return nhwc.to("cuda").permute(0, 3, 1, 2)
    if unaligned:
        flat = torch.empty(t.numel() + 1, dtype=t.dtype)
        flat[1:] = t.reshape(-1)
        return flat.to("cuda")[1:].view(t.shape)
    return t.contiguous().to("cuda")


def run_case(case: Case, check: bool) -> dict:
    import numpy as np
    import torch

    import cupyconv
    import cupyconv.torch as ct

    F = torch.nn.functional
    torch.backends.cudnn.allow_tf32 = case.precision == "tf32"
    x = _host_tensor(torch, case.x_shape, case.dtype, 1, case.nonfinite)
    w = _host_tensor(torch, case.w_shape, case.dtype, 2, False)
    c_out = case.w_shape[1] * case.kw.get("groups", 1)
    b = _host_tensor(torch, (c_out,), case.dtype, 3, False) if case.bias else None
    out_shape = F.conv_transpose2d(x.double(), w.double(), None, **case.kw).shape
    go = _host_tensor(torch, tuple(out_shape), case.dtype, 4, case.nonfinite)
    with _forced_variants(case):
        if case.api == "cupy":
            import cupy

            def dev(t):
                return cupy.asarray(t.numpy())

            y = cupyconv.conv_transpose2d(dev(x), dev(w), None if b is None else dev(b), **case.kw)
            grads = cupyconv.conv_transpose2d_backward(dev(go), dev(x), dev(w), **case.kw)
            cupy.cuda.Device().synchronize()
            got = [torch.from_numpy(cupy.asnumpy(a)) for a in (y,) + tuple(grads)]
        else:
            xd = _to_device(torch, x, case.layout, case.unaligned).requires_grad_()
            wd = w.to("cuda")
            if case.weight_cl:
                wd = wd.contiguous(memory_format=torch.channels_last)
            wd.requires_grad_()
            bd = None if b is None else b.to("cuda").requires_grad_()
            god = _to_device(torch, go, case.layout, case.unaligned)
            y = ct.conv_transpose2d(xd, wd, bd, **case.kw)
            y.backward(god)
            torch.cuda.synchronize()
            got = [t.detach().cpu() for t in (y, xd.grad, wd.grad)] + ([bd.grad.cpu()] if bd is not None else [])
    status = {"case": case.name, "ok": True}
    if check and not case.nonfinite:
        xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        br = None if b is None else b.detach().double().requires_grad_()
        yr = F.conv_transpose2d(xr, wr, br, **case.kw)
        yr.backward(go.double())
        want = [yr, xr.grad, wr.grad] + ([br.grad] if br is not None else [go.double().sum((0, 2, 3))]
                                         if case.api == "cupy" else [])
        tol = 5e-3 if case.precision == "tf32" else \
            {"float64": 1e-10, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}[case.dtype]
        for a, e in zip(got, want):
            err = float((a.double() - e.detach()).abs().max() / e.detach().abs().max().clamp_min(1e-30))
            if not np.isfinite(err) or err > tol:
                status.update(ok=False, error=f"max relative error {err:.3e} > {tol:g}")
    return status


def worker_main(names: Sequence[str], report: str, check: bool) -> int:
    import cupy

    from cupyconv.jit import compiler

    cupy.cuda.set_allocator(None)  # every CuPy buffer its own cudaMalloc, as torch's with caching off
    by_name = {c.name: c for c in all_cases()}
    if check:
        # the plain run fills the disk cache for the sanitized ones; side by side is much faster
        from cupyconv.core import device
        from cupyconv.jit.compiler import compile_many

        sm = device.get(0).sm_count
        specs = [spec for name in names for spec in planned_specs(by_name[name], sm)]
        compile_many(specs, 0, workers=os.cpu_count() or 8)
    statuses = []
    for name in names:
        try:
            statuses.append(run_case(by_name[name], check))
        except Exception as exc:  # reported per case; the sanitizer's own report follows regardless
            statuses.append({"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    kernels = sorted({kernel_label(spec.function, dict(spec.constants)) for spec, _ in compiler.compiled_specs()})
    with open(report, "w") as f:
        json.dump({"cases": statuses, "kernels": kernels}, f, indent=1)
    return 0 if all(s["ok"] for s in statuses) else EXIT_WORKLOAD


# ---------------------------------------------------------------- sanitizer and output

def find_sanitizer(explicit: Optional[str] = None) -> Optional[str]:
    if explicit:
        return explicit if Path(explicit).is_file() or shutil.which(explicit) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in filter(None, homes):
        for rel in ("bin/compute-sanitizer", "compute-sanitizer/compute-sanitizer"):
            path = Path(home) / rel
            if path.is_file():
                return str(path)
    return None


def sanitizer_options(help_text: str) -> List[str]:
    """Options every run gets, those this compute-sanitizer knows."""
    options = ["--error-exitcode", str(ERROR_EXIT)]
    for flag, value in (("--show-backtrace", "no"), ("--report-api-errors", "no"), ("--print-limit", "200")):
        if flag in help_text:
            options += [flag, value]
    return options


def tool_command(sanitizer: str, tool: str, options: Sequence[str], worker: Sequence[str]) -> List[str]:
    return [sanitizer, "--tool", tool, *options, *worker]


def worker_command(cases: str, report: str, check: bool = False) -> List[str]:
    """The workload process: ``cases`` as given to --cases."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--cases", cases, "--report", report]
    return cmd + (["--check"] if check else [])


_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
_RACE = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
# Where compute-sanitizer names the kernel of an access: "at kernel+0x1a0" (no line
# information, as NVRTC builds them) or "at 0x1a0 in file.cu:12:kernel(...)".
_KERNEL = (re.compile(r"\bat\s+([A-Za-z_]\w*)(?:\([^)]*\))?\+0x[0-9a-fA-F]+"),
           re.compile(r"\bat\s+0x[0-9a-fA-F]+\s+in\s+(?:\S*?:\d+:)?([A-Za-z_]\w*)"))


@dataclass
class ToolResult:
    tool: str
    clean: bool
    errors: Optional[int]
    warnings: int = 0
    by_kernel: Dict[str, int] = field(default_factory=dict)
    returncode: Optional[int] = None
    seconds: float = 0.0
    note: str = ""
    kernels: List[str] = field(default_factory=list)
    failed_cases: List[str] = field(default_factory=list)


def parse_output(tool: str, text: str, returncode: Optional[int]) -> ToolResult:
    """What compute-sanitizer said: errors (None when it printed no summary), and the kernels named."""
    errors, warnings = None, 0
    m = _RACE.search(text)
    if m:
        errors, warnings = int(m.group(2)), int(m.group(3))
    for m in _SUMMARY.finditer(text):
        errors = max(errors or 0, int(m.group(1)))
    by_kernel: Dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("="):
            for pattern in _KERNEL:
                for name in pattern.findall(line):
                    by_kernel[name] = by_kernel.get(name, 0) + 1
    note = ""
    if errors is None:
        tail = [line for line in text.strip().splitlines() if line.strip()][-3:]
        note = "no summary from compute-sanitizer: " + " | ".join(tail)
    clean = errors == 0 and warnings == 0 and returncode in (0, None)
    if errors == 0 and returncode == ERROR_EXIT:
        clean, note = False, "compute-sanitizer exited with its error code"
    return ToolResult(tool, clean, errors, warnings, by_kernel, returncode, note=note)


def _run(cmd: Sequence[str], env: dict, timeout: float) -> Tuple[int, str, float]:
    start = time.time()
    try:
        proc = subprocess.run(list(cmd), env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
        return proc.returncode, proc.stdout, time.time() - start
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, out + f"\n[timed out after {timeout:.0f} s]", time.time() - start


def _worker_env(cache_dir: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env["CUPYCONV_AUTOTUNE"] = "0"
    env["CUPY_CACHE_DIR"] = cache_dir
    env["CUPYCONV_CACHE_DIR"] = os.path.join(cache_dir, "tuning")
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    return env


def run_tool(tool: str, sanitizer: str, options: Sequence[str], cases: str, workdir: str, env: dict,
             timeout: float, log_dir: Optional[str]) -> ToolResult:
    report = os.path.join(workdir, f"{tool}.json")
    cmd = tool_command(sanitizer, tool, options, worker_command(cases, report))
    returncode, output, seconds = _run(cmd, env, timeout)
    if log_dir:
        Path(log_dir, f"{tool}.log").write_text(output)
    result = parse_output(tool, output, returncode)
    result.seconds = round(seconds, 1)
    try:
        data = json.loads(Path(report).read_text())
        result.kernels = data["kernels"]
        result.failed_cases = [s["case"] for s in data["cases"] if not s["ok"]]
    except (OSError, ValueError, KeyError):
        result.clean = False
        result.note = (result.note + "; " if result.note else "") + "the workload did not finish"
    if returncode not in (0, ERROR_EXIT) and result.errors == 0:
        result.clean = False
        result.note = (result.note + "; " if result.note else "") + f"exit status {returncode}"
    return result


def report_lines(results: Sequence[ToolResult], missing: Sequence[str]) -> List[str]:
    lines = ["", f"{'tool':<10} {'result':<8} {'errors':>6} {'warnings':>8} {'seconds':>8}  details"]
    for r in results:
        details = ", ".join(f"{k}: {v}" for k, v in sorted(r.by_kernel.items())) if not r.clean else ""
        details = "; ".join(x for x in (details, r.note) if x)
        errors = "?" if r.errors is None else str(r.errors)
        lines.append(f"{r.tool:<10} {'clean' if r.clean else 'UNCLEAN':<8} {errors:>6} {r.warnings:>8} "
                     f"{r.seconds:>8.1f}  {details}")
    if missing:
        lines.append("kernel templates that did not run: " + ", ".join(missing))
    return lines


# ------------------------------------------------------------------------------- main

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, from {', '.join(TOOLS)}")
    p.add_argument("--cases", default="all", help="comma-separated substrings of case names (see --list)")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, CUDA_HOME, /usr/local/cuda)")
    p.add_argument("--jobs", type=int, default=len(TOOLS), help="tools run side by side (default: all)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per tool (default 420)")
    p.add_argument("--logs", help="folder for each tool's full output")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    p.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        p.error(f"--tools takes {', '.join(TOOLS)}; got {args.tools!r}")
    args.tools = tools
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    if args.worker and not args.report:
        p.error("--worker needs --report")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cases = all_cases()
    try:
        chosen = select(cases, args.cases)
    except ValueError as exc:
        print(f"sanitize.py: {exc}", file=sys.stderr)
        return EXIT_USAGE
    names = [c.name for c in chosen]
    if args.worker:
        return worker_main(names, args.report, args.check)
    if args.list:
        for c in chosen:
            print(c.name)
        return EXIT_OK
    expected = sorted(template_functions())
    planned = plan_labels(chosen)
    planned_functions = sorted({label.split("[")[0] for label in planned})
    sanitizer = find_sanitizer(args.sanitizer)
    if args.dry_run:
        print(f"{len(chosen)} cases, {len(planned)} kernel variants; tools: {', '.join(args.tools)}")
        for label in planned:
            print("  " + label)
        missing = [f for f in expected if f not in planned_functions]
        if missing and args.cases == "all":
            print("kernel templates no case reaches: " + ", ".join(missing))
        shown = sanitizer or "compute-sanitizer"
        print(" ".join(worker_command(args.cases, "<dir>/plain.json", check=True)))
        for tool in args.tools:
            print(" ".join(tool_command(shown, tool, ["--error-exitcode", str(ERROR_EXIT)],
                                        worker_command(args.cases, f"<dir>/{tool}.json"))))
        return EXIT_OK
    if sanitizer is None:
        print("sanitize.py: compute-sanitizer not found (PATH, CUDA_HOME, /usr/local/cuda); pass --sanitizer",
              file=sys.stderr)
        return EXIT_USAGE
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    help_text = _run([sanitizer, "--help"], dict(os.environ), 60)[1]
    options = sanitizer_options(help_text)
    workdir = tempfile.mkdtemp(prefix="cupyconv-sanitize-")
    env = _worker_env(os.path.join(workdir, "kernel_cache"))
    try:
        print(f"plain run of {len(chosen)} cases (compiles every kernel, checks results) ...", flush=True)
        plain_report = os.path.join(workdir, "plain.json")
        code, output, seconds = _run(worker_command(args.cases, plain_report, check=True), env, args.timeout)
        try:
            plain = json.loads(Path(plain_report).read_text())
        except (OSError, ValueError):
            print(output[-5000:])
            print("sanitize.py: the workload failed without a sanitizer", file=sys.stderr)
            return EXIT_WORKLOAD
        bad = [s for s in plain["cases"] if not s["ok"]]
        if code != 0 or bad:
            for s in bad:
                print(f"  {s['case']}: {s.get('error')}")
            print(output[-3000:])
            print("sanitize.py: the workload failed without a sanitizer", file=sys.stderr)
            return EXIT_WORKLOAD
        print(f"  {len(plain['kernels'])} kernel variants compiled and run in {seconds:.0f} s")
        with ThreadPoolExecutor(max_workers=min(args.jobs, len(args.tools))) as pool:
            futures = [pool.submit(run_tool, tool, sanitizer, options, args.cases, workdir, env, args.timeout,
                                   args.logs) for tool in args.tools]
            results = [f.result() for f in futures]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # what ran under the tools (the plain run compiles ahead, so its list is the plan's)
    ran_labels = sorted({label for r in results for label in r.kernels})
    ran = {label.split("[")[0] for label in ran_labels}
    missing = [f for f in expected if f not in ran] if args.cases == "all" else []
    for r in results:
        if r.failed_cases:
            r.clean = False
            r.note = (r.note + "; " if r.note else "") + "cases failed: " + ", ".join(r.failed_cases)
    for line in report_lines(results, missing):
        print(line)
    if ran_labels and set(ran_labels) != set(planned):
        extra = sorted(set(ran_labels) - set(planned))
        lacking = sorted(set(planned) - set(ran_labels))
        print(f"note: the run and the plan differ: ran but not planned {extra}, planned but not run {lacking}")
    print(f"{len(ran_labels)} kernel variants of {len(ran)} kernel functions ran under the tools")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": [asdict(r) for r in results], "missing": missing,
                                               "kernels": ran_labels, "cases": names}, indent=1))
    return EXIT_OK if all(r.clean for r in results) and not missing else EXIT_UNCLEAN


if __name__ == "__main__":
    sys.exit(main())
