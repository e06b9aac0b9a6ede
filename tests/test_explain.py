"""cupyconv.explain: launch plans, work, traffic and roofline of a layer, with or without a GPU."""
import html
import json
import math
import subprocess
import sys

import pytest

from cupyconv.core import dtypes
from cupyconv.core.device import attribute_peak as _attribute_peak, gpu_present, table_peak as _table_peak
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.explain import DEFAULT_PEAK, NA_NO_GPU, Explanation, Peak, explain
from cupyconv.jit.templates import format_constant
from cupyconv.plans import direct, reduction, table, tiled

GPU = gpu_present()

# (input shape, weight shape, layer kwargs, dtype)
LAYERS = {
    "dense_3x5": ((2, 8, 9, 11), (8, 16, 3, 5), dict(), "float32"),
    "seed_grouped_dilated": ((16, 32, 128, 256), (32, 16, 3, 5),
                             dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4, bias=False), "float32"),
    "strided_outpad": ((3, 6, 7, 5), (6, 2, 4, 4), dict(stride=3, padding=1, output_padding=(2, 1)), "float64"),
    "unbatched_depthwise": ((6, 7, 7), (6, 1, 4, 4), dict(stride=4, groups=6), "float16"),
    "dilated_bf16": ((1, 4, 5, 5), (4, 5, 4, 4), dict(stride=6, dilation=2, padding=3, groups=2), "bfloat16"),
    "huge_64bit": ((1, 1, 50000, 50000), (1, 2, 2, 2), dict(stride=2), "float32"),
}
ALL_PASSES = ["forward", "grad_input", "grad_weight", "grad_bias"]


def _explain(name, **extra):
    x_shape, w_shape, kwargs, dtype = LAYERS[name]
    return explain(x_shape, w_shape, **kwargs, dtype=dtype, **extra)


def _geometry(name):
    x_shape, w_shape, kwargs, _ = LAYERS[name]
    kwargs = {k: v for k, v in kwargs.items() if k != "bias"}
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


@pytest.mark.parametrize("name", LAYERS)
def test_reports_every_pass_with_the_plans(name):
    x_shape, w_shape, kwargs, dtype = LAYERS[name]
    has_bias = kwargs.get("bias", True)
    e = _explain(name, output_mask=(True, True, True))
    assert isinstance(e, Explanation)
    assert [p.name for p in e.passes] == ALL_PASSES
    g = _geometry(name)
    sm = e.sm_count
    split_k = {"grad_weight": direct.plan_grad_weight(g, dtype, sm), "grad_bias": reduction.plan_grad_bias(g, dtype, sm)}
    # a split-K pass of one chunk writes its output itself: one "main" kernel, no reduce
    assert [(k.pass_name, k.stage) for k in e.kernels] == [("forward", "main"), ("grad_input", "main")] + [
        (name_, stage) for name_, (_, reduce) in split_k.items()
        for stage in (("partial", "reduce") if reduce is not None else ("main",))]
    assert e.geometry == g and e.input_shape == tuple(x_shape) and e.dtype == dtype
    assert e.output_shape == g.user_shape(g.output_shape) and len(e.output_shape) == len(x_shape)
    # thin layers' NCHW forwards run the tiled kernels, the rest the direct ones
    tiles = table.eligible("forward", g, dtype, "nchw")[0] is tiled.FAMILY
    forward = tiled.plan_forward(g, dtype, has_bias) if tiles else direct.plan_forward(g, dtype, has_bias)
    plans = [forward, direct.plan_grad_input(g, dtype),
             *(p for pair in split_k.values() for p in pair if p is not None)]
    assert len(plans) == len(e.kernels)
    for k, plan in zip(e.kernels, plans):
        assert k.template == plan.spec.template and k.function == plan.spec.function
        assert k.function in k.variant and k.template in k.variant
        assert k.constants == dict(plan.spec.constants)
        assert k.grid == plan.grid and k.block == plan.block
        assert tuple(k.scalars.values()) == plan.scalars
        assert not any(n.startswith("arg") for n in k.scalars), k.scalars   # names read from the signature
        assert k.index_t == plan.index_t and k.scratch_bytes == plan.scratch_bytes
        assert k.threads == math.prod(plan.grid) * math.prod(plan.block)
        assert k.source == plan.spec.source()
        header = k.source.splitlines()[0]
        for key, value in k.constants.items():     # every constant, substituted
            assert f"{key}={format_constant(value)}" in header
        assert "{{" not in k.source
    # The forward's scalars match the geometry; the split-K scratch is there.
    fwd = e.kernels[0]
    assert (fwd.scalars["H_out"], fwd.scalars["W_out"]) == g.out_size
    if tiles:   # patches of every image, channel block and place
        c = fwd.constants
        assert fwd.scalars["items"] == (g.batch * g.groups * math.ceil(g.out_per_group / c["OCB"])
                                        * fwd.scalars["blocks_h"] * fwd.scalars["blocks_w"])
    else:
        assert fwd.scalars["N"] == g.batch
    for name_, (partial, reduce) in split_k.items():
        kernels = e.pass_(name_).kernels
        if reduce is None:
            assert partial.grid[0] == 1 and [k.scratch_bytes for k in kernels] == [0]
            assert dict(partial.spec.constants)["SINGLE_CHUNK"] is True
        else:
            assert kernels[0].scratch_bytes > 0 and dict(partial.spec.constants)["SINGLE_CHUNK"] is False
            assert kernels[1].scalars == {"elements": math.prod(g.weight_shape if name_ == "grad_weight" else
                                                                (g.out_channels,)),
                                          "chunks": kernels[0].grid[0]}
    if name == "huge_64bit":
        assert fwd.index_t == "long long" and "typedef long long index_t" in fwd.source


@pytest.mark.parametrize("name", LAYERS)
def test_flops_bytes_and_roofline(name):
    x_shape, w_shape, kwargs, dtype = LAYERS[name]
    has_bias = kwargs.get("bias", True)
    e = _explain(name)
    g = _geometry(name)
    n, c_in, h, w = g.input_shape
    c_out, groups = g.out_channels, g.groups
    kh, kw = g.kernel
    size = dtypes.get(dtype).itemsize
    fwd = e.pass_("forward")
    assert fwd.flops == 2 * n * c_in * (c_out // groups) * h * w * kh * kw
    x_b, w_b, y_b = (math.prod(s) * size for s in (g.input_shape, g.weight_shape, g.output_shape))
    b_b = c_out * size
    assert fwd.bytes == x_b + w_b + y_b + (b_b if has_bias else 0)
    assert e.pass_("grad_input").flops == fwd.flops == e.pass_("grad_weight").flops
    assert e.pass_("grad_input").bytes == e.pass_("grad_weight").bytes == x_b + w_b + y_b
    # conv_transpose2d_backward computes grad_bias whether or not the forward had a bias
    assert [p.name for p in e.passes] == ALL_PASSES
    assert e.pass_("grad_bias").flops == math.prod(g.output_shape)
    assert e.pass_("grad_bias").bytes == y_b + b_b
    flop_rate = e.peak.flops_fp64 if dtype == "float64" else e.peak.flops_fp32
    for p in e.passes:
        assert p.flops > 0 and p.bytes > 0
        assert p.compute_s == pytest.approx(p.flops / flop_rate)
        assert p.memory_s == pytest.approx(p.bytes / e.peak.bandwidth)
        assert p.floor_s == max(p.compute_s, p.memory_s) > 0
        assert p.bound == ("compute" if p.compute_s > p.memory_s else "memory")
        assert sum(k.floor_s for k in p.kernels) >= p.floor_s * (1 - 1e-12)
        for k in p.kernels:
            assert k.bytes > 0 and k.flops >= 0 and k.floor_s > 0 and k.bound in ("compute", "memory")
    if len(e.pass_("grad_weight").kernels) == 2:
        partial, reduce = e.pass_("grad_weight").kernels
        assert partial.bytes == x_b + y_b + partial.scratch_bytes
        assert reduce.bytes == partial.scratch_bytes + w_b
    else:  # one chunk: the partial pass writes grad_weight itself
        (single,) = e.pass_("grad_weight").kernels
        assert single.stage == "main" and single.bytes == x_b + y_b + w_b
    assert e.floor_s == pytest.approx(sum(p.floor_s for p in e.passes))


def test_without_a_bias_explain_lists_the_passes_the_backward_runs():
    """The array API's backward returns grad_bias for a layer without a bias; torch's autograd does not ask."""
    import numpy as np

    import cupyconv

    x, w = np.ones((1, 2, 3, 3)), np.ones((2, 3, 2, 2))
    grads = cupyconv.conv_transpose2d_backward(np.ones((1, 3, 4, 4)), x, w)
    assert all(gr is not None for gr in grads)
    assert [p.name for p in explain(x.shape, w.shape, bias=False).passes] == ALL_PASSES
    assert [p.name for p in explain(x.shape, w.shape, bias=None).passes] == ALL_PASSES
    assert [p.name for p in explain(x.shape, w.shape, bias=False, output_mask=(True, True, False)).passes] == \
        ALL_PASSES[:3]

    torch = pytest.importorskip("torch")
    m = torch.nn.ConvTranspose2d(2, 3, 2, bias=False)
    assert [p.name for p in explain(m, (1, 2, 3, 3)).passes] == ALL_PASSES[:3]
    with_bias = torch.nn.ConvTranspose2d(2, 3, 2)
    assert [p.name for p in explain(with_bias, (1, 2, 3, 3)).passes] == ALL_PASSES


def test_seed_layer_numbers_are_sane():
    e = _explain("seed_grouped_dilated")
    fwd = e.pass_("forward")
    # 16*32*16*128*256*15*2 = 8.05 GFLOP; 873 MB of fp32 traffic -> memory bound on an H100
    assert fwd.flops == 8_053_063_680
    assert 0.8e9 < fwd.bytes < 0.9e9
    if not GPU:
        assert e.peak == DEFAULT_PEAK
        assert fwd.bound == "memory" and fwd.floor_s == pytest.approx(fwd.bytes / 3.0e12)
        assert 250e-6 < fwd.floor_s < 350e-6


def test_resources_without_a_gpu():
    if GPU:
        e = _explain("dense_3x5")
        for k in e.kernels:
            assert k.registers > 0 and k.max_threads_per_block >= k.block[0]
            assert k.shared_bytes >= 0 and k.local_bytes >= 0
        return
    e = _explain("dense_3x5")
    assert e.gpu is False and e.device == "no GPU" and e.sm_count == 132
    for k in e.kernels:
        assert k.registers is None and k.shared_bytes is None and k.local_bytes is None
        assert k.resources == NA_NO_GPU
    assert "H100" in e.peak.source and "estimate" in e.peak.source
    assert any("132 SMs" in n for n in e.notes)


def test_text_rendering():
    e = _explain("seed_grouped_dilated")
    text = str(e)
    for needle in ("ConvTranspose2d(32, 64", "stride=(2, 3)", "groups=4", "bias=False", "float32",
                   "(16, 64, 257, 766)", "conv_transpose2d_forward_tiled.cu:conv_transpose2d_forward_tiled",
                   "reduce_partials", "grid (", "block (128, 1, 1)", "scalars: H=128, W=256, H_out=257",
                   "rows_per_chunk=",
                   "scratch", "memory-bound", "floor", "GFLOP", "lines elided", "total floor"):
        assert needle in text, needle
    if not GPU:
        assert NA_NO_GPU in text and "H100" in text and "estimate" in text
    full = e.text(show_source=True)
    assert "lines elided" not in full
    for k in e.kernels:
        assert all(("      | " + line) in full for line in k.source.splitlines()[::10])
    e.show_source = True
    assert str(e) == full
    assert "Explanation" in repr(e) and len(repr(e)) < 400


def test_markdown_and_html_renderings():
    e = _explain("strided_outpad")
    md = e._repr_markdown_()
    assert md == e.markdown()
    for needle in ("| forward |", "| grad_bias |", "`conv_transpose2d_grad_input.cu:conv_transpose2d_grad_input",
                   "<details>", "</details>", "```cuda", "reduce_partials", "float64", "compute", "memory"):
        assert needle in md, needle
    assert md.count("<details>") == len(e.kernels)
    for k in e.kernels:
        assert k.source.rstrip("\n") in md
    page = e._repr_html_()
    assert page == e.html()
    assert page.count("<details>") == len(e.kernels) == page.count("</details>")
    for needle in ("<table>", "grad_weight", "partial", "reduce", "<th>grid</th>", "floor", "float64"):
        assert needle in page
    for k in e.kernels:
        assert html.escape(k.source) in page
    if not GPU:
        assert NA_NO_GPU in md and NA_NO_GPU in page


def test_the_copy_engines_descriptors_are_shown_with_their_kernels():
    """A kernel fed by the copy engine lists each TMA descriptor: the pointer argument, its tensor, its boxes and
    their strides; in text, Markdown and HTML, and in the dict."""
    e = explain((16, 1024, 8, 8), (1024, 512, 4, 4), stride=2, padding=1, layout="channels_last", dtype="bfloat16")
    # the halo-tile kernels take the copy engine where TMA is set; the gather GEMM always does
    fed = [k for k in e.kernels if k.constants.get("TMA") or k.function == "conv_transpose2d_gather_gemm"]
    if not GPU:   # the assumed H100 plans the wgmma forward's halos, the gather's weight and grad_weight's tiles by TMA
        assert {k.function for k in fed} >= {"conv_transpose2d_wgmma", "conv_transpose2d_gather_gemm",
                                             "conv_transpose2d_grad_weight_wgmma"}
    for k in e.kernels:
        assert bool(k.tensor_maps) == (k in fed)
    weight = [k for k in fed if k.function == "conv_transpose2d_grad_weight_wgmma"]
    for k in weight:
        assert k.tensor_maps[1] == ("pointer argument 1: bfloat16 tensor of (512, 16, 16, 16) elements (innermost "
                                    "first), boxes of (64, 18, 18, 1) at element strides (1, 2, 2, 1), 128-byte "
                                    "swizzle")
    text, md, page = e.text(), e.markdown(), e.html()
    for k in fed:
        for m in k.tensor_maps:
            assert f"tensor map: {m}" in text and f"tensor map: `{m}`" in md and html.escape(m) in page
    listed = [k["tensor_maps"] for p in json.loads(json.dumps(e.to_dict()))["passes"] for k in p["kernels"]]
    assert listed == [k.tensor_maps for k in e.kernels]


def test_to_dict_is_json():
    d = _explain("dense_3x5").to_dict()
    text = json.dumps(d)
    assert d["passes"][0]["name"] == "forward" and d["passes"][0]["kernels"][0]["threads"] > 0
    assert "conv_transpose2d_forward" in text and d["floor_s"] > 0


def test_arrays_and_bias_forms():
    np = pytest.importorskip("numpy")
    x = np.zeros((2, 4, 5, 6), np.float16)
    w = np.zeros((4, 3, 3, 3), np.float16)
    e = explain(x, w, bias=np.zeros(3, np.float16))
    assert e.dtype == "float16" and e.layer["bias"] and [p.name for p in e.passes] == ALL_PASSES
    assert any("fp32" in n for n in e.notes)
    assert explain(x, w, bias=None).layer["bias"] is False
    assert explain(x, w, dtype=np.float64).dtype == "float64"
    assert [p.name for p in explain(x, w, output_mask=(False, True, False)).passes] == ["forward", "grad_weight"]
    e = explain((1, 4, 5, 6), (4, 3, 3, 3), stride=2, output_size=(12, 13))
    assert e.output_shape == (1, 3, 12, 13) and e.layer["output_padding"] == (1, 0)


def test_custom_peak_and_sm_count():
    slow_memory = Peak("toy", bandwidth=1e9, flops_fp32=1e15, flops_fp64=1e15, source="made up")
    e = _explain("dense_3x5", peak=slow_memory, sm_count=4)
    assert all(p.bound == "memory" for p in e.passes) and e.peak is slow_memory and e.sm_count == 4
    g = _geometry("dense_3x5")
    assert e.pass_("grad_weight").kernels[0].grid == direct.plan_grad_weight(g, "float32", 4)[0].grid
    slow_math = Peak("toy", bandwidth=1e15, flops_fp32=1e6, flops_fp64=1e6, source="made up")
    assert explain((2, 8, 9, 11), (8, 16, 3, 5), peak=slow_math).pass_("forward").bound == "compute"


def test_batch_zero_launches_nothing():
    e = explain((0, 4, 5, 5), (4, 2, 3, 3))
    assert e.kernels == [] and [p.name for p in e.passes] == ALL_PASSES
    assert e.pass_("forward").flops == 0 and "batch is 0" in str(e)
    assert e.pass_("grad_weight").bytes == 4 * 2 * 9 * 4


def test_peak_table_and_attribute_estimate():
    assert _table_peak("NVIDIA H100 80GB HBM3").bandwidth == 3.0e12
    assert _table_peak("NVIDIA H100 80GB HBM3").flops_fp32 == 67e12
    assert _table_peak("NVIDIA H100 PCIe").bandwidth < 3.0e12
    assert _table_peak("NVIDIA H200").bandwidth > 3.0e12
    assert _table_peak("NVIDIA A100-SXM4-40GB").flops_fp32 == 19.5e12
    assert _table_peak("NVIDIA L40S").flops_fp64 < 2e12
    assert _table_peak("Some Future GPU") is None
    # H100 SXM-like attributes: 2.6 GHz HBM on a 5120-bit bus, 132 SMs at 1.98 GHz.
    est = _attribute_peak("Future GPU", dict(MemoryClockRate=2_619_000, GlobalMemoryBusWidth=5120,
                                             MultiProcessorCount=132, ClockRate=1_980_000), (9, 0))
    assert 2.0e12 < est.bandwidth < 3.4e12 and 60e12 < est.flops_fp32 < 70e12
    assert est.flops_fp64 == est.flops_fp32 / 2 and "estimate" in est.source
    consumer = _attribute_peak("Consumer", dict(MultiProcessorCount=10, ClockRate=1_000_000), (8, 9))
    assert consumer.bandwidth > 0 and consumer.flops_fp64 == consumer.flops_fp32 / 64
    assert _attribute_peak("Unknown", {}, (7, 5)).flops_fp32 > 0


BAD = {
    "channels": (((1, 2, 3, 3), (3, 2, 3, 3)), {}, ValueError),
    "rank": (((2, 3, 3), (2, 2, 3)), {}, ValueError),
    "stride0": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(stride=0), ValueError),
    "groups": (((1, 4, 3, 3), (4, 2, 3, 3)), dict(groups=3), ValueError),
    "outpad": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(stride=2, output_padding=2), ValueError),
    "negative_output": (((1, 2, 1, 1), (2, 2, 1, 1)), dict(padding=1), ValueError),
    "bias_shape": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(bias=(3,)), ValueError),
    "output_size": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(stride=2, output_size=(20, 20)), ValueError),
    "float_stride": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(stride=1.5), TypeError),
    "bool_groups": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(groups=True), TypeError),
    "dtype": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(dtype="int32"), TypeError),
    "shape_type": (("abc", (2, 2, 3, 3)), {}, TypeError),
    "float_shape": (((1, 2, 3.0, 3), (2, 2, 3, 3)), {}, TypeError),
    "no_weight": (((1, 2, 3, 3),), {}, TypeError),
    "mask": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(output_mask=(1, 1, 1)), TypeError),
    "peak": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(peak=3e12), TypeError),
    "sm_count": (((1, 2, 3, 3), (2, 2, 3, 3)), dict(sm_count=0), ValueError),
}


@pytest.mark.parametrize("name", BAD)
def test_invalid_arguments(name):
    args, kwargs, error = BAD[name]
    with pytest.raises(error):
        explain(*args, **kwargs)


def test_does_not_import_torch():
    code = ("import sys; from cupyconv.explain import explain; explain((1, 2, 3, 3), (2, 2, 3, 3)); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- torch modules

def test_module_and_input():
    torch = pytest.importorskip("torch")
    m = torch.nn.ConvTranspose2d(8, 6, (3, 2), stride=2, padding=1, output_padding=1, groups=2, dilation=(1, 2))
    x = torch.randn(2, 8, 7, 7)
    e = explain(m, x)
    assert e.output_shape == tuple(m(x).shape) and e.dtype == "float32"
    assert [p.name for p in e.passes] == ALL_PASSES and e.layer["source"] == "module ConvTranspose2d"
    same = explain((2, 8, 7, 7), (8, 3, 3, 2), stride=2, padding=1, output_padding=1, groups=2, dilation=(1, 2))
    assert [(k.grid, k.constants, k.scalars) for k in e.kernels] == \
        [(k.grid, k.constants, k.scalars) for k in same.kernels]
    # unbatched shape, float64, no bias, output_size as in forward(x, output_size)
    m = torch.nn.ConvTranspose2d(4, 4, 3, stride=2, bias=False).double()
    e = explain(m, (4, 5, 5), output_size=(12, 12))
    assert e.dtype == "float64" and e.output_shape == tuple(m(torch.randn(4, 5, 5).double(), (12, 12)).shape)
    assert [p.name for p in e.passes] == ALL_PASSES[:3]


def test_module_errors():
    torch = pytest.importorskip("torch")
    m = torch.nn.ConvTranspose2d(4, 4, 3)
    with pytest.raises(TypeError):
        explain(m)                                  # no input
    with pytest.raises(TypeError):
        explain(m, (1, 4, 5, 5), stride=2)          # layer arguments come from the module
    with pytest.raises(TypeError):
        explain(torch.nn.Conv2d(4, 4, 3), (1, 4, 5, 5))
    with pytest.raises(ValueError):
        explain(m, (1, 3, 5, 5))                    # wrong channel count


# ----------------------------------------------------------------------------- 1-D layers

def test_a_1d_layer_is_explained_as_the_one_row_layer_it_runs():
    """A 3-D weight shape is a 1-D layer: its launches are the one-row 2-D layer's, and the report keeps its own
    shapes and arguments (ConvTranspose1d's title, one-element tuples, the row left out)."""
    e = explain((3, 16, 300), (16, 8, 5), stride=2, padding=1, output_padding=1, dilation=3, groups=2,
                dtype="float16")
    row = explain((3, 16, 1, 300), (16, 8, 1, 5), stride=(1, 2), padding=(0, 1), output_padding=(0, 1),
                  dilation=(1, 3), groups=2, dtype="float16")
    assert [(k.variant, k.grid, k.constants, k.scalars) for k in e.kernels] == \
        [(k.variant, k.grid, k.constants, k.scalars) for k in row.kernels]
    assert [p.floor_s for p in e.passes] == [p.floor_s for p in row.passes]
    assert e.geometry == row.geometry and e.layout == "nchw"
    assert (e.input_shape, e.weight_shape, e.output_shape) == ((3, 16, 300), (16, 8, 5), (3, 16, 610))
    assert e.layer["kernel_size"] == (5,) and e.layer["stride"] == (2,) and e.layer["dilation"] == (3,)
    assert e.layer["one_d"] and not row.layer["one_d"]
    text = e.text()
    assert "ConvTranspose1d(16, 16, kernel_size=(5,), stride=(2,), padding=(1,), output_padding=(1,)" in text
    assert "one-row layer (3, 16, 1, 300)" in text and "ConvTranspose2d" not in text
    assert json.loads(json.dumps(e.to_dict(), default=list))["layer"]["one_d"] is True
    # unbatched, int or one-element arguments alike
    u = explain((16, 300), (16, 8, 5), stride=[2], padding=(1,), dtype="float16")
    assert u.input_shape == (16, 300) and u.output_shape == (8, 601)


def test_a_1d_module_and_its_output_size():
    torch = pytest.importorskip("torch")
    cct = pytest.importorskip("cupyconv.torch")
    for cls in (torch.nn.ConvTranspose1d, cct.ConvTranspose1d):
        m = cls(8, 6, 4, stride=3, padding=1, groups=2)
        x = torch.randn(2, 8, 50)
        e = explain(m, x)
        assert e.output_shape == tuple(m(x).shape) and e.layer["source"] == f"module {type(m).__name__}"
        assert e.text().startswith("cupyconv.explain: ConvTranspose1d(8, 6, kernel_size=(4,), stride=(3,)")
        # output_size as forward(x, output_size) takes it: the length, or the whole output shape
        for size in ([150], [2, 6, 151], (151,)):
            want = tuple(torch.nn.ConvTranspose1d.forward(m, x, list(size)).shape)
            assert explain(m, x, output_size=size).output_shape == want, size
        unbatched = explain(m, (8, 50), output_size=[6, 151])
        assert unbatched.output_shape == (6, 151) and unbatched.layer["output_padding"] == (2,)
    # an input whose channels are its fastest axis (a transposed (N, L, C) tensor) runs contiguous, as
    # cupyconv.torch.conv_transpose1d copies it: NCHW, where its one-row view would look channels_last
    x = torch.randn(2, 50, 8).transpose(1, 2)
    assert explain(torch.nn.ConvTranspose1d(8, 6, 4), x).layout == "nchw"
    assert explain(x, torch.randn(8, 6, 4)).layout == "nchw"


def test_1d_errors():
    with pytest.raises(ValueError, match="layout"):
        explain((2, 16, 40), (16, 8, 3), layout="channels_last")
    with pytest.raises(ValueError, match="output_size"):
        explain((2, 16, 40), (16, 8, 3), stride=2, output_size=(2, 8, 1, 81))
    with pytest.raises(ValueError, match="requested output_size"):
        explain((2, 16, 40), (16, 8, 3), stride=2, output_size=(90,))
    with pytest.raises(TypeError, match="output_size"):
        explain((2, 16, 40), (16, 8, 3), output_size=81)
    with pytest.raises(ValueError, match="input_shape must be 3-D"):
        explain((2, 16, 1, 40), (16, 8, 3))
    with pytest.raises(ValueError, match="stride"):
        explain((2, 16, 40), (16, 8, 3), stride=(2, 2))


def test_cupyconv_torch_module():
    pytest.importorskip("torch")
    cct = pytest.importorskip("cupyconv.torch")
    m = cct.ConvTranspose2d(4, 8, 4, stride=2, padding=1)
    e = explain(m, (3, 4, 6, 6))
    assert e.output_shape == (3, 8, 12, 12) and e.layer["source"] == "module ConvTranspose2d"


def test_explain_takes_the_layout_cupyconv_torch_runs():
    """channels_last when the input or the weight is, as torch's convolution decides."""
    torch = pytest.importorskip("torch")
    cct = pytest.importorskip("cupyconv.torch")
    m = cct.ConvTranspose2d(4, 8, 4, stride=2, padding=1)
    x = torch.randn(3, 4, 6, 6)
    assert explain(m, x).layout == "nchw"
    assert explain(m, x.contiguous(memory_format=torch.channels_last)).layout == "nhwc"
    m.to(memory_format=torch.channels_last)
    assert explain(m, x).layout == "nhwc"
    assert explain(x, m.weight).layout == "nhwc"
    assert explain(x, (4, 8, 4, 4)).layout == "nchw"


@pytest.mark.skipif(GPU, reason="checks the host-only plan for the assumed H100")
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_explain_reports_the_layouts_kernels(layout):
    """channels_last layers run the NHWC direct kernels (NCHW ones the tiled forward) and read the GEMM sources
    in place."""
    thin = explain((2, 8, 7, 6), (8, 3, 3, 2), groups=4, stride=2, layout=layout)
    functions = {k.function for k in thin.kernels}
    nhwc = layout == "channels_last"
    assert thin.layout == ("nhwc" if nhwc else "nchw")
    assert ("conv_transpose2d_forward_nhwc" in functions) == nhwc
    assert ("conv_transpose2d_forward_tiled" in functions) != nhwc
    assert thin.pass_("forward").variant.split(":")[0] == ("direct" if nhwc else "tiled")
    assert thin.pass_("grad_bias").variant == "reduction"
    dense = explain((2, 32, 9, 11), (32, 48, 3, 5), stride=2, padding=1, dtype="float16", layout=layout)
    stages = [k.stage for k in dense.kernels]
    # NCHW sources go through channels_last copies; grad_output's is made once for both grads
    assert stages.count("to_channels_last") == (0 if nhwc else 3)
    # the assumed H100 runs Hopper's wgmma kernels (sm_90a) for every pass of this 3x5 stride-2 layer (two
    # or three taps a stride phase, so grad_weight's leads too)
    assert dense.pass_("forward").variant == dense.pass_("grad_input").variant == "wgmma"
    assert dense.pass_("grad_weight").variant == "wgmma"
    mains = {k.pass_name: k for k in dense.kernels if k.stage == "main"}
    assert mains["grad_input"].function == mains["forward"].function == "conv_transpose2d_wgmma"
    assert (mains["forward"].constants["MODE"], mains["grad_input"].constants["MODE"]) == (0, 1)
    assert all(dict(k.constants).get("DST_CL", nhwc) == nhwc for k in dense.kernels if k.stage == "main")
    assert "channels_last" in dense.text() if nhwc else "contiguous" in dense.text()


@pytest.mark.skipif(GPU, reason="checks the host-only plan for the assumed H100")
def test_explain_reads_a_channels_last_weight_in_place():
    """A module moved to channels_last keeps its weight so: explain plans what the call runs, the weight read
    (packed) in its layout, and says so.  grad_weight is written in torch's format for it, channels_last beside a
    channels_last input whatever the weight's layout (the wgmma grad_weight's plain reduce either way); a
    contiguous weight's explanation says that too."""
    torch = pytest.importorskip("torch")
    cct = pytest.importorskip("cupyconv.torch")
    m = cct.ConvTranspose2d(32, 48, (3, 5), stride=2, padding=1).to(torch.bfloat16)
    x = torch.zeros(2, 32, 9, 11, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    contiguous = explain(m, x)
    m.to(memory_format=torch.channels_last)
    cl = explain(m, x)
    assert not contiguous.geometry.weight_channels_last and cl.geometry.weight_channels_last
    assert contiguous.layout == cl.layout == "nhwc"
    for e, flag in ((contiguous, False), (cl, True)):
        weight_readers = [k for k in e.kernels if "WEIGHT_CL" in dict(k.constants) and k.pass_name != "grad_weight"]
        assert {k.stage for k in weight_readers} >= {"pack", "main"}
        assert all(dict(k.constants)["WEIGHT_CL"] is flag for k in weight_readers)
        writers = [k for k in e.pass_("grad_weight").kernels if "WEIGHT_CL" in dict(k.constants)]
        assert [k.stage for k in writers] == ["partial"] and dict(writers[0].constants)["WEIGHT_CL"] is True
    kernels = [[(k.stage, k.function, k.constants) for k in e.pass_("grad_weight").kernels] for e in (contiguous, cl)]
    assert kernels[0] == kernels[1]
    assert [k.function for k in cl.pass_("grad_weight").kernels if k.stage == "reduce"] in (["reduce_partials"], [])
    assert "weight channels_last" in cl.text() and "weight channels_last" not in contiguous.text()
    assert "grad_weight is written channels_last" in contiguous.text()
    assert "grad_weight is written" not in cl.text()


@pytest.mark.skipif(GPU, reason="checks the host-only plan for the assumed H100")
def test_explain_reports_the_precision_that_runs():
    args = ((2, 32, 9, 11), (32, 32, 4, 4))
    strict = explain(*args, stride=2, padding=1, dtype="float32")
    tf32 = explain(*args, stride=2, padding=1, dtype="float32", precision="tf32")
    kinds = [{dict(k.constants).get("MMA_KIND") for k in e.kernels} - {None} for e in (strict, tf32)]
    assert kinds == [{3}, {2}]   # mma.cuh: 3xTF32 for strict float32, TF32 when allowed
    assert strict.precision == "strict" and tf32.precision == "tf32"
    with pytest.raises(ValueError, match="precision"):
        explain(*args, precision="fp8")
    with pytest.raises(ValueError, match="layout"):
        explain(*args, layout="nhcw")


@pytest.mark.skipif(GPU, reason="checks the host-only plan for the assumed H100")
def test_explain_matches_the_engine_on_a_recorder():
    """explain's kernels are the launches the engine makes for the same call, in order."""
    from cupyconv import engine
    from cupyconv.core import device
    from cupyconv.plans.launch import Recorder

    g = geometry((2, 32, 9, 11), (32, 48, 3, 5), None, ConvParams.from_args(stride=2, padding=1))
    rec = Recorder(device.ASSUMED)
    engine.forward(g, "bfloat16", 1 << 32, 2 << 32, 3 << 32, 4 << 32, rec, "nchw", "strict")
    engine.backward(g, "bfloat16", 4 << 32, 1 << 32, 2 << 32, 5 << 32, 6 << 32, 7 << 32, rec, "nchw", "strict")
    e = explain((2, 32, 9, 11), (32, 48, 3, 5), stride=2, padding=1, dtype="bfloat16")
    assert [(k.stage, k.function, k.grid) for k in e.kernels] == \
        [(stage, plan.spec.function, plan.grid) for stage, plan in rec.launches]


@pytest.mark.skipif(GPU, reason="checks the host-only plan for the assumed H100")
def test_a_split_forward_and_grad_input_show_their_partials_and_reduce():
    """A weight-bound layer's GEMMs split K: explain lists each pass's partial and reduce, the partials' bytes in
    both, and says how K was split."""
    x_shape, w_shape = (16, 1024, 4, 4), (1024, 512, 4, 4)
    e = explain(x_shape, w_shape, stride=2, padding=1, dtype="float32", precision="tf32")
    g = geometry(x_shape, w_shape, None, ConvParams.from_args(stride=2, padding=1))
    x_b, w_b, y_b = (math.prod(s) * 4 for s in (g.input_shape, g.weight_shape, g.output_shape))
    b_b = g.out_channels * 4
    # (bytes the partial pass reads, bytes the reduce writes, fp32 bytes of one range's partials)
    for name, (reads, written, one_range) in (("forward", (x_b + w_b, y_b + b_b, y_b)),
                                              ("grad_input", (y_b + w_b, x_b, x_b))):
        p = e.pass_(name)
        stages = [k.stage for k in p.kernels]
        assert stages[-2:] == ["partial", "reduce"] and p.variant == "gemm", (name, stages)
        partial, reduce = p.kernels[-2:]
        chunks = partial.constants["SPLIT_K"]
        assert chunks > 1 and reduce.function == "reduce_partials_bias"
        assert partial.scratch_bytes == chunks * one_range
        assert partial.bytes == reads + partial.scratch_bytes
        assert reduce.bytes == partial.scratch_bytes + written
        assert f"split-K over {chunks} even ranges of each stride phase's K tiles" in p.note


def test_grouped_mma_kernels_show_their_blocks():
    """A thin grouped channels_last layer plans the grouped mma forward and grad_weight; each kernel line names its
    block (groups a block, segment), and a kernel with no tiling constants shows its index type alone."""
    e = explain((16, 32, 128, 256), (32, 16, 3, 5), bias=False, stride=(2, 3), padding=(1, 2), dilation=(2, 1),
                groups=4, dtype="float16", layout="channels_last")
    assert [p.variant for p in e.passes if p.name in ("forward", "grad_weight")] == ["grouped_mma", "grouped_mma"]
    lines = {k.function: k.variant for k in e.kernels}
    assert lines["conv_transpose2d_forward_grouped_mma"].endswith("[GROUPS_PER_BLOCK=4, SEGQ=32, index_t int]")
    assert lines["conv_transpose2d_grad_weight_grouped_mma"].endswith("[GROUPS_PER_BLOCK=4, SEG=32, index_t int]")
    assert all(v.endswith("index_t int]") and "[, " not in v for v in lines.values())
