"""NVRTC compilation of every kernel template, dtype and variant, with no GPU.

The architecture is given explicitly, so this runs on CI machines without a device.
"""
import itertools

import pytest

from cupyconv.core import dtypes
from cupyconv.jit import compiler
from cupyconv.plans import direct, gemm, launch, reduction, table
from cupyconv.jit.compiler import KernelCompileError, KernelSpec, compile_ptx
from cupyconv.core.geometry import ConvParams, geometry

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

ARCHS = ("compute_80", "compute_90")
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
                                                families_named=("direct", "large_kernel", "reduction")):
                        seen.setdefault(plan.spec, f"{layer}-{dtype}-{layout}-{plan.spec.function}-{plan.index_t}")
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
    for stages in gemm.STAGE_CHOICES:
        for plan in (gemm.plan_forward_gemm(g, "float16", True, "nchw", stages=stages).gemm,
                     gemm.plan_grad_input_gemm(g, "float32", "nhwc", "tf32", stages=stages).gemm,
                     gemm.plan_grad_weight_gemm(g, "bfloat16", 132, "nchw", stages=stages)[0]):
            seen.setdefault(plan.spec, f"stages-{stages}-{plan.spec.function}")
    return seen


PLANS = {**_plans(), **_gemm_plans()}


def test_variants_reach_every_template_and_both_index_widths():
    templates_used = {spec.template for spec in PLANS}
    from cupyconv.jit import templates

    assert templates_used == set(templates.template_names())
    widths = {dict(spec.constants)["INDEX_T"] for spec in PLANS}
    assert widths == {"int", "long long"}
    assert {dict(s.constants).get("SCALAR_T") for s in PLANS} == {"float", "double", "half_t", "bf16_t", None}
    for data_movement in ("pack_weight.cu", "to_channels_last.cu"):
        assert {dict(s.constants)["ELEMENT_BYTES"] for s in PLANS if s.template == data_movement} == {2, 4}
    gemms = [dict(s.constants) for s in PLANS if s.template == "conv_transpose2d_igemm.cu"]
    assert {c["STAGES"] for c in gemms if c["A_VEC"]} == set(gemm.STAGE_CHOICES)
    assert {(c["SRC_CL"], c["DST_CL"]) for c in gemms} == {(True, True), (True, False), (False, False)}
    grad_weight = [dict(s.constants) for s in PLANS if s.template == "conv_transpose2d_grad_weight_igemm.cu"]
    assert {c["STAGES"] for c in grad_weight if c["VEC"]} == set(gemm.STAGE_CHOICES)
    assert {c["VEC"] for c in grad_weight} == {True, False}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", list(PLANS), ids=list(PLANS.values()))
def test_template_compiles(spec, arch):
    ptx = compile_ptx(spec.source(), spec.function, arch)
    assert f".entry {spec.function}" in ptx
    assert f".target sm_{arch.split('_')[1]}" in ptx


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


def test_importing_compiles_nothing():
    import subprocess
    import sys

    code = ("import cupyconv, sys; from cupyconv.jit import compiler; "
            "assert compiler.compile_count() == 0; "
            "assert 'cupy' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
