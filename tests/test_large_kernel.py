"""The large-kernel family without a GPU: where the pass table sends huge kernels, what its
planners choose, and its kernels run through the C++ emulation against the float64 reference.

The emulated layers have few channels and small images, so each kernel runs in a moment;
between them they reach every tiling branch: several staged tap tiles and source chunks,
stride phases that no tap reaches, taps far outside small inputs, channel blocks that do
and do not divide a group, grid-stride loops over channel tiles and images, and split-K
grad_weight over one and several chunks.  See ``cuda_emulator``.
"""
from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cupyconv import reference
from cupyconv.core import dtypes
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import direct, large_kernel, launch, table

import cuda_emulator

HUGE = [  # (dtype, kernel) that no direct kernel can stage
    ("float32", (101, 101)), ("float16", (101, 101)), ("bfloat16", (101, 101)), ("float64", (101, 101)),
    ("float32", (88, 88)), ("float64", (62, 64)), ("bfloat16", (2, 4000)), ("float32", (3, 2600)),
]
SMALL = [("float32", (3, 3)), ("float64", (7, 5)), ("float16", (1, 31))]
# (dtype, kernel, dilation) on either side of the span the direct kernels unroll without
# spilling (32 columns, 8 rows, 64 taps; a dilated kernel spans the rows and columns its taps
# reach; see the comment above direct.fits).  Past it they spill a little but were measured
# faster than large_kernel, so they run every layer whose weights fit their shared memory.
INSIDE_SPAN = [("float32", (8, 8), 1), ("float64", (1, 32), 1), ("float16", (2, 32), 1), ("bfloat16", (3, 21), 1),
               ("float32", (4, 16), 1), ("bfloat16", (8, 1), 1), ("float16", (4, 4), 2), ("float64", (1, 16), 2)]
OUTSIDE_SPAN = [("float32", (9, 9), 1), ("float64", (1, 33), 1), ("float16", (2, 33), 1), ("bfloat16", (3, 22), 1),
                ("float32", (5, 13), 1), ("bfloat16", (9, 1), 1), ("float64", (64, 1), 1), ("float32", (16, 4), 1),
                ("float16", (5, 5), 2), ("float64", (1, 17), 2), ("float32", (11, 11), 1), ("float32", (87, 87), 1),
                ("float32", (3, 100), 1)]
SPAN_CASES = [(d, k, 1) for d, k in HUGE + SMALL] + INSIDE_SPAN + OUTSIDE_SPAN


def _geometry(kernel, in_channels=4, out_per_group=3, groups=2, size=(6, 5), batch=2, **kwargs):
    return geometry((batch, in_channels) + size, (in_channels, out_per_group) + kernel, None,
                    ConvParams.from_args(groups=groups, **kwargs))


# ------------------------------------------------------------------------------ routing

@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,kernel", HUGE)
def test_the_table_sends_kernels_too_large_for_the_direct_kernels_to_large_kernel(dtype, kernel, layout):
    g = _geometry(kernel)
    assert not direct.fits(g, dtype, layout)
    for pass_ in ("forward", "grad_input", "grad_weight"):
        assert [f.name for f in table.eligible(pass_, g, dtype, layout)] == ["large_kernel"]
        assert [v.name for v in table.candidates(pass_, g, dtype, layout)] == ["large_kernel"]
    assert [f.name for f in table.eligible("grad_bias", g, dtype, layout)] == ["reduction"]
    templates = {p.spec.template for p in table.all_plans(g, dtype, True, layout)}
    assert {"conv_transpose2d_large_kernel_forward.cu", "conv_transpose2d_large_kernel_grad_input.cu",
            "conv_transpose2d_large_kernel_grad_weight.cu"} <= templates
    assert not any(t.startswith("conv_transpose2d_forward") or t.startswith("conv_transpose2d_grad_input")
                   for t in templates)


CUDA_CORE = ("direct", "tiled")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,kernel", SMALL)
def test_kernels_the_direct_kernels_stage_stay_on_them(dtype, kernel, layout):
    g = _geometry(kernel)
    assert direct.fits(g, dtype, layout)
    for pass_ in ("forward", "grad_input", "grad_weight"):
        names = [f.name for f in table.eligible(pass_, g, dtype, layout)]
        assert "large_kernel" not in names and "direct" in names
        # (an NCHW forward of few taps may lead with the tiled kernels, the direct forward's sibling)
        assert table.candidates(pass_, g, dtype, layout)[0].family in CUDA_CORE


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,kernel,dilation", INSIDE_SPAN)
def test_kernels_within_the_unrolled_span_stay_on_the_direct_kernels(dtype, kernel, dilation, layout):
    g = _geometry(kernel, dilation=dilation)
    assert direct.fits(g, dtype, layout)
    for pass_ in ("forward", "grad_input", "grad_weight"):
        assert [f.name for f in table.eligible(pass_, g, dtype, layout) if f.name != "tiled"] == ["direct"]
        assert table.candidates(pass_, g, dtype, layout)[0].family in CUDA_CORE


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,kernel,dilation", [c for c in OUTSIDE_SPAN if c[1] != (87, 87)])
def test_kernels_past_the_unrolled_span_stay_on_the_direct_kernels(dtype, kernel, dilation, layout):
    """Shared memory alone decides: past the span the direct kernels spill a little, yet ran faster."""
    g = _geometry(kernel, dilation=dilation)
    assert direct.fits(g, dtype, layout)
    for pass_ in ("forward", "grad_input", "grad_weight"):
        assert table.candidates(pass_, g, dtype, layout)[0].family in CUDA_CORE


@pytest.mark.parametrize("dtype,kernel,dilation", SPAN_CASES)
def test_fits_admits_only_layers_the_direct_planners_take(dtype, kernel, dilation):
    """Eligibility and the direct planners' refusal are one check, so no layer falls between the families."""
    g = _geometry(kernel, dilation=dilation)
    for layout in ("nchw", "nhwc"):
        try:
            direct.plan_forward(g, dtype, False, layout)
            direct.plan_grad_input(g, dtype, layout)
            planned = True
        except ValueError as exc:
            assert "is too large for the direct kernels" in str(exc)
            planned = False
        assert direct.fits(g, dtype, layout) is planned


def test_no_layer_the_reference_accepts_is_left_without_a_family():
    for dtype, kernel, dilation in SPAN_CASES:
        for layout in ("nchw", "nhwc"):
            g = _geometry(kernel, dilation=dilation)
            for pass_ in table.PASSES:
                assert table.eligible(pass_, g, dtype, layout), (dtype, kernel, layout, pass_)


# ----------------------------------------------------------------- what the planners choose

def _static_smem(plan, dtype):
    """Shared memory a planned large-kernel launch declares, from its template constants."""
    c = dict(plan.spec.constants)
    acc = dtypes.get(dtype).accumulator_bytes
    if plan.spec.template.endswith("grad_weight.cu"):
        return c["TWX"] * c["ICB"] * acc
    return c["SRC_CHUNK"] * c["TJ"] * c["TI"] * c["LANES"] * c["OCB"] * acc


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", dtypes.NAMES)
@pytest.mark.parametrize("kernel,channels,groups", [
    ((101, 101), (4, 3), 2), ((1001, 1001), (64, 64), 1), ((1, 100000), (3, 5), 1), ((4000, 2), (128, 128), 128),
    ((257, 129), (200, 300), 4)])
def test_shared_memory_and_registers_do_not_grow_with_the_kernel(kernel, channels, groups, dtype, layout):
    g = geometry((1, channels[0]) + (9, 7), (channels[0], channels[1] // groups) + kernel, None,
                 ConvParams.from_args(groups=groups, stride=(2, 1)))
    acc = dtypes.get(dtype).accumulator_bytes
    plans = [large_kernel.plan_forward(g, dtype, True, layout), large_kernel.plan_grad_input(g, dtype, layout),
             large_kernel.plan_grad_weight(g, dtype, 132, layout)[0]]
    for plan in plans:
        c = dict(plan.spec.constants)
        assert _static_smem(plan, dtype) <= large_kernel.TAP_TILE_BYTES < launch.STATIC_SMEM_LIMIT
        assert plan.block[0] <= 128 and plan.smem_bytes == 0
        assert max(plan.grid[1:]) <= launch.GRID_YZ_LIMIT
        # per-thread arrays: accumulators, and the grad_output window of grad_weight
        registers = 32 * 4 // acc
        if "TJ" in c:
            assert c["CELLS"] * c["OCB"] <= registers
            assert c["TI"] <= 32 and c["TJ"] * c["TI"] * c["SRC_CHUNK"] * c["LANES"] * c["OCB"] * acc \
                <= large_kernel.TAP_TILE_BYTES
        else:
            window = (c["CELLS"] - 1) * c["SW"] + (c["KWB"] - 1) * c["DW"] + 1
            assert c["ICB"] * c["OCB"] * c["KWB"] <= registers and window * c["OCB"] <= registers


def test_channels_last_threads_own_channels_of_one_group():
    for in_per_group, out_per_group, groups in [(8, 16, 4), (1, 1, 128), (6, 6, 3), (3, 5, 2), (2, 100, 1)]:
        g = geometry((1, in_per_group * groups, 4, 4), (in_per_group * groups, out_per_group, 90, 90), None,
                     ConvParams.from_args(groups=groups))
        fwd = dict(large_kernel.plan_forward(g, "float32", False, "nhwc").spec.constants)
        gi = dict(large_kernel.plan_grad_input(g, "float32", "nhwc").spec.constants)
        assert out_per_group % fwd["OCB"] == 0 and in_per_group % gi["OCB"] == 0
        assert fwd["LANES"] * fwd["OCB"] == min(out_per_group * groups, 64)


def test_grad_weight_splits_rows_only_where_blocks_are_few():
    few = geometry((4, 1, 60, 9), (1, 1, 3, 4), None, ConvParams.from_args(stride=2))
    many = geometry((4, 64, 60, 9), (64, 64, 101, 101), None, ConvParams.from_args())
    partial, reduce = large_kernel.plan_grad_weight(few, "float32", 132)
    assert partial.grid[0] > 1 and reduce.scalars == (12, partial.grid[0])
    assert dict(partial.spec.constants)["SINGLE_CHUNK"] is False
    assert partial.scratch_bytes == partial.grid[0] * 12 * 4
    partial, reduce = large_kernel.plan_grad_weight(many, "float32", 132)
    # one chunk writes grad_weight itself: no scratch as large as the weight, no reduce
    assert partial.grid[0] == 1 and partial.scratch_bytes == 0 and reduce is None
    assert dict(partial.spec.constants)["SINGLE_CHUNK"] is True


def test_the_forward_launches_only_phases_that_hold_outputs():
    g, _ = _layer("long_stride")
    assert g.out_size == (5, 4)
    plan = large_kernel.plan_forward(g, "float32", True)
    tiles_h, tiles_w = plan.scalars[-2:]
    assert plan.grid[0] == 5 * 4 * tiles_h * tiles_w  # not 9 * 7 phases
    huge = geometry((1, 1, 1, 1), (1, 1, 101, 101), None, ConvParams.from_args(stride=70000))
    assert large_kernel.plan_forward(huge, "float32", True).grid[0] == 101 * 101


def test_templates_render_without_placeholders():
    g = _geometry((101, 101))
    for plan in (large_kernel.plan_forward(g, "bfloat16", True, "nhwc"), large_kernel.plan_grad_input(g, "float64"),
                 large_kernel.plan_grad_weight(g, "float16", 132, "nhwc")[0]):
        source = plan.spec.source()
        assert "{{" not in source and plan.spec.function in source
        # tap loops run at run time: no loop bounded by the kernel size is unrolled
        assert not re.search(r"#pragma unroll\s*\n\s*for \([^)]*\b(KH|KW|TAPS)\b", source)
        assert "#pragma unroll 1" in source


# ------------------------------------------------------------------ compiled, on NVRTC

def _compile_cases():
    g = geometry((2, 6, 5, 7), (6, 4, 101, 99), None,
                 ConvParams.from_args(stride=(2, 3), dilation=(1, 2), padding=(3, 40), groups=2))
    wide = geometry((1, 64, 8, 8), (64, 64, 88, 88), None, ConvParams.from_args())
    cases = {}
    for i, dtype in enumerate(dtypes.NAMES):
        layout = ("nchw", "nhwc")[i % 2]
        for geo, name in ((g, "grouped"), (wide, "wide")):
            for plan in (large_kernel.plan_forward(geo, dtype, True, layout),
                         large_kernel.plan_grad_input(geo, dtype, layout),
                         large_kernel.plan_grad_weight(geo, dtype, 132, layout)[0]):
                cases[f"{name}-{dtype}-{layout}-{plan.spec.function}"] = plan.spec
    return cases


COMPILE_CASES = _compile_cases()


def _ptxas_report(spec):
    """(spill stores and loads, registers, log) that ptxas reports for the kernel built for sm_90."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    program = nvrtc.createProgram(spec.source(), f"{spec.function}.cu", (), ())
    try:
        nvrtc.compileProgram(program, ["--std=c++17", "--gpu-architecture=sm_90", "--ptxas-options=-v"])
        log = nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills, log
    return spills.groups(), int(re.search(r"Used (\d+) registers", log).group(1)), log


@pytest.mark.parametrize("name", sorted(COMPILE_CASES))
def test_kernels_compile_without_spilling(name):
    """NVRTC builds each kernel for sm_90 and ptxas reports its registers: none spill to local memory."""
    spills, registers, log = _ptxas_report(COMPILE_CASES[name])
    assert spills == ("0", "0"), log
    assert registers <= 128, log


# Layers at the edge of the span the direct kernels unroll, each in a configuration whose kernels
# come close to spilling there, and the layer one column or row past it, where they first spill:
# (kernel, kernel past the edge, dilation, stride, channels per group, groups, dtype, layout).
SPAN_EDGE = [
    ((1, 32), (1, 33), 1, 1, 16, 1, "float64", "nhwc"),  # the NHWC forward spills at 33 columns
    ((8, 8), (8, 9), 1, 1, 16, 1, "float32", "nchw"),
    ((2, 32), (2, 33), 1, 1, 4, 1, "float16", "nchw"),
    ((3, 21), (3, 22), 1, 2, 16, 1, "bfloat16", "nchw"),
    ((4, 4), (5, 4), 2, 1, 1, 16, "float16", "nhwc"),  # a 7x7 span; 9 rows past it
    ((8, 2), (9, 2), 1, 2, 1, 16, "float32", "nchw"),  # grad_input spills at 9 rows
]


def _edge_geometry(kernel, dilation, stride, per_group, groups):
    channels = per_group * groups
    return geometry((2, channels, 16, 16), (channels, per_group) + kernel, None,
                    ConvParams.from_args(groups=groups, stride=stride, dilation=dilation))


@pytest.mark.parametrize("edge", SPAN_EDGE, ids=lambda e: f"{e[0][0]}x{e[0][1]}-d{e[2]}-s{e[3]}-{e[6]}-{e[7]}")
def test_direct_kernels_at_the_edge_of_the_span_compile_without_spilling(edge):
    """At the edge of the span ptxas keeps the direct kernels in registers."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    kernel, _past, dilation, stride, per_group, groups, dtype, layout = edge
    g = _edge_geometry(kernel, dilation, stride, per_group, groups)
    assert direct.fits(g, dtype, layout)
    plans = [direct.plan_forward(g, dtype, True, layout), direct.plan_grad_input(g, dtype, layout),
             direct.plan_grad_weight(g, dtype, 132, layout)[0]]
    with ThreadPoolExecutor(len(plans)) as pool:
        for spills, _, log in pool.map(lambda plan: _ptxas_report(plan.spec), plans):
            assert spills == ("0", "0"), log


# ------------------------------------------------------------------ emulated on the CPU

emulated = pytest.mark.skipif(not cuda_emulator.available(), reason="needs g++ to emulate the kernels")

# (input shape, weight shape, layer arguments)
LAYERS = {
    # a real 101x101 kernel on a tiny image: taps in several staged tiles, most outside the input
    "k101": ((1, 1, 3, 4), (1, 1, 101, 101), dict(padding=(2, 0))),
    # groups, strides 2 x 3 and dilation 2 along h: output rows of odd phase get no tap (bias only)
    "phases": ((2, 4, 5, 7), (4, 3, 7, 9), dict(stride=(2, 3), padding=(3, 2), dilation=(2, 1), output_padding=(1, 0),
                                                 groups=2)),
    # stride and dilation sharing no factor, so every phase holds its own taps; output_padding
    "coprime": ((1, 3, 6, 5), (3, 2, 5, 6), dict(stride=(3, 2), dilation=(2, 3), padding=(4, 1),
                                                 output_padding=(2, 1))),
    # depthwise with a long, thin kernel
    "depthwise": ((1, 4, 9, 6), (4, 1, 11, 3), dict(stride=(1, 2), padding=(5, 0), groups=4)),
    # a kernel wider than the input, mostly padded away: taps of whole tiles fall outside
    "padded_away": ((1, 1, 4, 4), (1, 2, 25, 23), dict(padding=(12, 11))),
    # channel blocks that do not divide the group (NCHW) and lanes of 1 or 2 channels (channels_last)
    "odd_channels": ((1, 10, 3, 4), (10, 9, 3, 40), dict(stride=(2, 1), padding=(1, 10))),
    # strides longer than the output: only the phases that hold outputs, wrapping past the stride
    "long_stride": ((2, 2, 2, 1), (2, 3, 6, 4), dict(stride=(9, 7), padding=(7, 1), output_padding=(4, 2))),
    # few blocks and many input rows: grad_weight splits the rows into several chunks
    "many_rows": ((4, 2, 30, 9), (2, 1, 3, 4), dict(stride=2, padding=1, groups=2)),
}
# Relative to max|reference|, as in test_kernels_emulated; the reference sees the same rounded inputs.
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
C_TYPE = {"float32": "float", "float64": "double", "float16": "half_t", "bfloat16": "bf16_t"}
ACC = {"float32": ("float", np.float32), "float64": ("double", np.float64), "float16": ("float", np.float32),
       "bfloat16": ("float", np.float32)}
# The 101x101 layer in NCHW float32 and the phases layer in float32 run in tests further down.
CASES = [("k101", "float64", "nhwc"), ("phases", "float64", "nchw"),
         ("coprime", "bfloat16", "nchw"), ("coprime", "float64", "nhwc"),
         ("depthwise", "float16", "nhwc"), ("padded_away", "float64", "nchw"),
         ("odd_channels", "float32", "nchw"), ("odd_channels", "float64", "nhwc"), ("many_rows", "float64", "nhwc"),
         ("long_stride", "float64", "nchw")]


def _storage(a, dtype):
    """float64 values rounded to ``dtype``, as the kernels' buffers hold them (bfloat16 as its bits)."""
    if dtype != "bfloat16":
        return a.astype(dtype)
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _values(a, dtype):
    if dtype != "bfloat16":
        return a.astype(np.float64)
    return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _layer(name, batch=None):
    x_shape, w_shape, kwargs = LAYERS[name]
    if batch is not None:
        x_shape = (batch,) + x_shape[1:]
    params = ConvParams.from_args(**kwargs)
    g = geometry(x_shape, w_shape, (w_shape[1] * params.groups,), params)
    args = dict(stride=params.stride, padding=params.padding, output_padding=params.output_padding,
                groups=params.groups, dilation=params.dilation)
    return g, args


def _check(actual, expected, dtype, what):
    scale = np.abs(expected).max()
    err = np.abs(_values(actual, dtype) - expected).max()
    assert err <= TOLERANCE[dtype] * scale, f"{what}: max error {err:.3e} > {TOLERANCE[dtype]:g} * {scale:.3e}"


class Emulated:
    """One layer's data in ``dtype`` and ``layout``, and the three passes run through the emulator."""

    def __init__(self, name, dtype, layout, batch=None, seed=0):
        self.g, self.args = _layer(name, batch)
        self.dtype, self.layout, self.name = dtype, layout, name
        rng = np.random.default_rng(seed)
        g = self.g
        self.x, self.w, self.b, self.go = (_storage(rng.standard_normal(s), dtype) for s in
                                           (g.input_shape, g.weight_shape, (g.out_channels,), g.output_shape))
        x64, w64, b64, go64 = (_values(a, dtype) for a in (self.x, self.w, self.b, self.go))
        self.want_y = reference.conv_transpose2d(x64, w64, b64, **self.args)
        self.want_gi, self.want_gw, _ = reference.conv_transpose2d_backward(go64, x64, w64, **self.args)

    def to_layout(self, a):
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1) if self.layout == "nhwc" else a)

    def from_layout(self, a):
        return np.ascontiguousarray(a.transpose(0, 3, 1, 2) if self.layout == "nhwc" else a)

    def empty(self, shape):
        return _storage(np.full(shape, np.nan), self.dtype)

    def forward(self, plan):
        ctype = C_TYPE[self.dtype]
        *_, y = cuda_emulator.run(plan, [self.to_layout(self.x), self.w, self.b,
                                         self.to_layout(self.empty(self.g.output_shape))], [ctype] * 4)
        _check(self.from_layout(y), self.want_y, self.dtype, f"{self.name} {self.dtype} {self.layout} forward")

    def grad_input(self, plan):
        ctype = C_TYPE[self.dtype]
        *_, gi = cuda_emulator.run(plan, [self.to_layout(self.go), self.w,
                                          self.to_layout(self.empty(self.g.input_shape))], [ctype] * 3)
        _check(self.from_layout(gi), self.want_gi, self.dtype, f"{self.name} {self.dtype} {self.layout} grad_input")

    def grad_weight(self, partial, reduce):
        ctype, (acc, acc_np) = C_TYPE[self.dtype], ACC[self.dtype]
        sources = [self.to_layout(self.x), self.to_layout(self.go)]
        if reduce is None:  # one chunk writes grad_weight itself
            assert partial.grid[0] == 1 and partial.scratch_bytes == 0
            *_, gw = cuda_emulator.run(partial, sources + [self.empty(self.g.weight_shape)], [ctype] * 3)
        else:
            partials = np.full(partial.grid[0] * self.w.size, np.nan, acc_np)
            *_, partials = cuda_emulator.run(partial, sources + [partials], [ctype, ctype, acc])
            _, gw = cuda_emulator.run(reduce, [partials, self.empty(self.g.weight_shape)], [acc, ctype])
        _check(gw, self.want_gw, self.dtype, f"{self.name} {self.dtype} {self.layout} grad_weight")
        return gw


def _case_plans(name, dtype, layout):
    g, _ = _layer(name)
    return (large_kernel.plan_forward(g, dtype, True, layout), large_kernel.plan_grad_input(g, dtype, layout),
            *large_kernel.plan_grad_weight(g, dtype, 4, layout))


@pytest.fixture(scope="module")
def prebuilt():
    """Compile the emulated kernels of the sweep on a thread pool (g++ runs in parallel) before the tests run them."""
    builds = {}
    for name, dtype, layout in CASES:
        forward, grad_input, partial, reduce = _case_plans(name, dtype, layout)
        ctype, acc = C_TYPE[dtype], ACC[dtype][0]
        builds.update({forward: [ctype] * 4, grad_input: [ctype] * 3})
        if reduce is None:
            builds[partial] = [ctype] * 3
        else:
            builds.update({partial: [ctype, ctype, acc], reduce: [acc, ctype]})
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        list(pool.map(lambda item: cuda_emulator.build(*item), builds.items()))


def test_the_emulated_cases_reach_both_ends_of_split_k():
    """grad_weight in one chunk written directly, and in several chunks with their reduce."""
    single = {large_kernel.plan_grad_weight(_layer(n)[0], d, 4, l)[1] is None for n, d, l in CASES}
    assert single == {True, False}


@emulated
@pytest.mark.parametrize("name,dtype,layout", CASES)
def test_kernels_match_the_reference(name, dtype, layout, prebuilt):
    run = Emulated(name, dtype, layout, seed=len(name))
    forward, grad_input, partial, reduce = _case_plans(name, dtype, layout)
    run.forward(forward)
    run.grad_input(grad_input)
    run.grad_weight(partial, reduce)


@emulated
@pytest.mark.parametrize("name,dtype,layout", [("phases", "float64", "nhwc"), ("many_rows", "float32", "nchw")])
def test_a_channels_last_weight_is_read_and_written_in_place(name, dtype, layout):
    """The weight in channels_last memory, (C_in, kH, kW, C_out/groups): read so by the forward and grad_input,
    and grad_weight written so (several split-K chunks for many_rows)."""
    run = Emulated(name, dtype, layout, seed=3)
    g = run.g.with_weight_channels_last()
    run.w = np.ascontiguousarray(run.w.transpose(0, 2, 3, 1))
    run.forward(large_kernel.plan_forward(g, dtype, True, layout))
    run.grad_input(large_kernel.plan_grad_input(g, dtype, layout))
    # grad_weight's memory, compared element by element with the reference's channels_last memory
    run.want_gw = np.ascontiguousarray(run.want_gw.transpose(0, 2, 3, 1)).reshape(run.want_gw.shape)
    partial, reduce = large_kernel.plan_grad_weight(g, dtype, 4, layout)
    assert dict(partial.spec.constants)["WEIGHT_CL"] and (reduce is not None) == (name == "many_rows")
    run.grad_weight(partial, reduce)


@emulated
def test_the_tabled_101x101_layer_runs_what_the_table_plans():
    run = Emulated("k101", "float32", "nchw", seed=5)
    g = run.g
    assert not direct.fits(g, "float32", "nchw")
    plans = {p: table.plan(p, table.candidates(p, g, "float32")[0], g, "float32", "nchw", "strict", True, True, 4)
             for p in ("forward", "grad_input", "grad_weight")}
    run.forward(plans["forward"].main)
    run.grad_input(plans["grad_input"].main)
    run.grad_weight(plans["grad_weight"].partial, plans["grad_weight"].reduce)
    c = dict(plans["forward"].main.spec.constants)
    assert c["TI"] * c["TJ"] < 101 * 101  # several tap tiles


@emulated
@pytest.mark.parametrize("name,dtype,layout", [("phases", "float64", "nchw"), ("odd_channels", "float32", "nhwc")])
def test_small_tap_tiles_and_source_chunks(name, dtype, layout, monkeypatch):
    """A tiny staging budget: many tap tiles per phase and one source channel staged at a time."""
    monkeypatch.setattr(large_kernel, "TAP_TILE_BYTES", 96)
    large_kernel.FAMILY.clear()
    try:
        run = Emulated(name, dtype, layout, seed=3)
        fwd = large_kernel.plan_forward(run.g, dtype, True, layout)
        gi = large_kernel.plan_grad_input(run.g, dtype, layout)
        for plan in (fwd, gi):
            c = dict(plan.spec.constants)
            assert c["SRC_CHUNK"] == 1 and c["TJ"] * c["TI"] < c["KH"] * c["KW"] // 4
        run.forward(fwd)
        run.grad_input(gi)
    finally:
        large_kernel.FAMILY.clear()


def _one_block_column(plan):
    """The plan with grid.y = grid.z = 1: its blocks must loop over channel tiles and images themselves."""
    return launch.Plan(plan.spec, (plan.grid[0], 1, 1), plan.block, plan.scalars, plan.index_t, plan.scratch_bytes)


@emulated
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_blocks_loop_over_channel_tiles_images_and_tap_tiles(layout):
    run = Emulated("phases", "float32", layout, batch=3, seed=11)
    g = run.g
    fwd, gi = large_kernel.plan_forward(g, "float32", True, layout), large_kernel.plan_grad_input(g, "float32", layout)
    partial, reduce = large_kernel.plan_grad_weight(g, "float32", 4, layout)
    assert fwd.grid[1] * fwd.grid[2] > 1 and gi.grid[2] > 1 and partial.grid[2] > 1
    run.forward(_one_block_column(fwd))
    run.grad_input(_one_block_column(gi))
    run.grad_weight(_one_block_column(partial), reduce)


@emulated
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_grad_weight_over_several_chunks_is_reproducible(layout):
    run = Emulated("many_rows", "float32", layout, seed=2)
    partial, reduce = large_kernel.plan_grad_weight(run.g, "float32", 4, layout)
    assert partial.grid[0] > 1
    first = run.grad_weight(partial, reduce)
    assert np.array_equal(first.view(np.uint32), run.grad_weight(partial, reduce).view(np.uint32))


@emulated
def test_a_wrong_kernel_is_caught():
    """The emulated comparison is a real check: a forward that misses one phase's taps no longer matches."""
    run = Emulated("coprime", "float64", "nchw", seed=1)
    plan = large_kernel.plan_forward(run.g, "float64", True, "nchw")
    broken = launch.Plan(launch.KernelSpec.make(plan.spec.template, plan.spec.function,
                                                {**dict(plan.spec.constants), "DW": 1}),
                         plan.grid, plan.block, plan.scalars, plan.index_t)
    with pytest.raises(AssertionError, match="max error"):
        run.forward(broken)
