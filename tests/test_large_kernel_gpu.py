"""Kernels too large for the direct kernels (101x101 and other huge or lopsided ones) on the GPU,
against float64 torch.

Each layer runs through the public APIs: the CuPy functions (NCHW; bfloat16, which CuPy
cannot hold, goes through the torch function instead) and the torch function on
channels_last tensors (float64, which torch keeps contiguous on CUDA, through the engine
on channels_last memory), in every dtype, with groups, strides, dilation, padding,
output padding and bias.  A launch watcher confirms that the large-kernel family ran them.  The
reference is float64 torch on the GPU, computed from the same rounded inputs, so the
bounds (those of test_kernels_gpu.py, relative to max|reference|) only allow for
accumulation and output rounding.  grad_weight must be bitwise reproducible.
"""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

cupy = pytest.importorskip("cupy")
import cupyconv  # noqa: E402
from cupyconv import engine  # noqa: E402
import cupyconv.torch as ct  # noqa: E402
from cupyconv.core import device  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.jit.compiler import compile_many  # noqa: E402
from cupyconv.plans import large_kernel, launch, table  # noqa: E402

DTYPES = ("float32", "float64", "float16", "bfloat16")
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
LARGE_KERNEL_TEMPLATES = {"conv_transpose2d_large_kernel_forward.cu", "conv_transpose2d_large_kernel_grad_input.cu",
                          "conv_transpose2d_large_kernel_grad_weight.cu"}

# (input shape, weight shape, layer arguments, bias): none of these kernels fits the direct
# kernels' shared memory in any dtype.
LAYERS = {
    "k101_grouped": ((2, 4, 20, 24), (4, 3, 101, 101), dict(groups=2, padding=3), True),
    "k101_strided_dilated": ((1, 3, 9, 11), (3, 2, 101, 101),
                             dict(stride=(2, 3), dilation=(1, 2), padding=(50, 7), output_padding=(1, 0)), True),
    "long_row": ((2, 2, 5, 30), (2, 4, 3, 2600), dict(stride=(2, 1), padding=(1, 100)), False),
    "tall_column": ((1, 2, 30, 3), (2, 3, 4000, 2), dict(stride=(3, 1), dilation=(1, 2), output_padding=(2, 0)), True),
    "depthwise_88": ((1, 8, 16, 16), (8, 1, 88, 88), dict(groups=8, padding=40, stride=2, output_padding=1), True),
}


def _geometry(name):
    x_shape, w_shape, kwargs, bias = LAYERS[name]
    params = ConvParams.from_args(**kwargs)
    return geometry(x_shape, w_shape, (w_shape[1] * params.groups,) if bias else None, params)


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every large-kernel launch of the sweep on a thread pool before the tests use them."""
    specs = []
    for name in LAYERS:
        g = _geometry(name)
        for dtype in DTYPES:
            for layout in ("nchw", "nhwc"):
                specs += [p.spec for p in table.all_plans(g, dtype, LAYERS[name][3], layout, device=device.get(0))]
    compile_many(specs, 0, workers=os.cpu_count() or 8)


def _data(name, dtype, seed=0):
    x_shape, w_shape, kwargs, bias = LAYERS[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64).to(getattr(torch, dtype))

    x, w = rnd(x_shape), rnd(w_shape)
    b = rnd((w_shape[1] * kwargs.get("groups", 1),)) if bias else None
    go = rnd(_geometry(name).output_shape)
    return x, w, b, go


def _reference(kwargs, x, w, b, go):
    """Output, grad_input, grad_weight and grad_bias of float64 torch on the same (rounded) values."""
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    br = None if b is None else b.detach().double().requires_grad_()
    y = F.conv_transpose2d(xr, wr, br, **kwargs)
    y.backward(go.double())
    return y.detach(), xr.grad, wr.grad, None if br is None else br.grad


def _raw_channels_last(kwargs, x, w, b, go):
    """Through the raw-pointer engine on channels_last memory: torch keeps float64 CUDA
    convolutions contiguous, so its API never hands the engine channels_last float64."""
    params = ConvParams.from_args(**kwargs)
    g = geometry(x.shape, w.shape, None if b is None else b.shape, params)
    dtype = str(x.dtype).split(".")[-1]
    cl = torch.channels_last
    x, go = x.contiguous(memory_format=cl), go.contiguous(memory_format=cl)
    y = torch.full(g.output_shape, float("nan"), dtype=x.dtype, device="cuda").contiguous(memory_format=cl)
    gi = torch.full(g.input_shape, float("nan"), dtype=x.dtype, device="cuda").contiguous(memory_format=cl)
    gw = torch.full(g.weight_shape, float("nan"), dtype=x.dtype, device="cuda")
    gb = torch.full((g.out_channels,), float("nan"), dtype=x.dtype, device="cuda")

    def alloc(nbytes):
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
        return t, t.data_ptr()

    launcher = launch.Launcher(0, torch.cuda.current_stream().cuda_stream, alloc)
    engine.forward(g, dtype, x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), launcher,
                   "nhwc")
    engine.backward(g, dtype, go.data_ptr(), x.data_ptr(), w.data_ptr(), gi.data_ptr(), gw.data_ptr(),
                    None if b is None else gb.data_ptr(), launcher, "nhwc")
    return y, gi, gw, None if b is None else gb


def _ours(kwargs, x, w, b, go, layout):
    """The same through the public APIs: CuPy's for NCHW (not bfloat16), torch's otherwise, and
    the engine itself for channels_last float64."""
    if layout == "nhwc" and x.dtype == torch.float64:
        return _raw_channels_last(kwargs, x, w, b, go)
    if layout == "nchw" and x.dtype != torch.bfloat16:
        cx, cw, cgo = (cupy.from_dlpack(t) for t in (x, w, go))
        y = cupyconv.conv_transpose2d(cx, cw, None if b is None else cupy.from_dlpack(b), **kwargs)
        gi, gw, gb = cupyconv.conv_transpose2d_backward(cgo, cx, cw, **kwargs)
        return tuple(None if a is None else torch.from_dlpack(a) for a in (y, gi, gw, gb if b is not None else None))
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    # fresh leaves: contiguous() may hand back x itself, which must not start requiring grad
    xs = x.detach().clone().contiguous(memory_format=fmt).requires_grad_()
    ws = w.detach().clone().requires_grad_()
    bs = None if b is None else b.detach().clone().requires_grad_()
    y = ct.conv_transpose2d(xs, ws, bs, **kwargs)
    if layout == "nhwc":
        assert y.is_contiguous(memory_format=torch.channels_last)
    y.backward(go.contiguous(memory_format=fmt))
    if layout == "nhwc":
        assert xs.grad.is_contiguous(memory_format=torch.channels_last)
    return y.detach(), xs.grad, ws.grad, None if bs is None else bs.grad


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values (unwritten outputs?)"
    scale = expected.abs().max().item()
    err = (a - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} * max|ref| {scale:.3e}"


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_large_kernels_match_float64_torch(name, dtype, layout):
    g = _geometry(name)
    dev = device.get(0)
    for pass_ in ("forward", "grad_input", "grad_weight"):
        assert [f.name for f in table.eligible(pass_, g, dtype, layout, dev)] == ["large_kernel"], pass_
    kwargs = LAYERS[name][2]
    x, w, b, go = _data(name, dtype, seed=len(name))
    with launch.watch() as seen:
        got = _ours(kwargs, x, w, b, go, layout)
        torch.cuda.synchronize()
    assert LARGE_KERNEL_TEMPLATES <= {plan.spec.template for _, plan in seen}
    want = _reference(kwargs, x, w, b, go)
    for what, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        if what == "grad_bias" and b is None:
            assert a is None and e is None
            continue
        assert a.dtype == x.dtype, what
        assert_close(a, e, TOLERANCE[dtype], f"{name} {dtype} {layout} {what}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_torch_module_runs_a_101x101_kernel(dtype):
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    ours = ct.ConvTranspose2d(6, 4, (101, 101), stride=(2, 1), padding=(7, 50), output_padding=(1, 0), groups=2,
                              dilation=(1, 2), bias=True).to("cuda", dt)
    theirs = torch.nn.ConvTranspose2d(6, 4, (101, 101), stride=(2, 1), padding=(7, 50), output_padding=(1, 0),
                                      groups=2, dilation=(1, 2), bias=True).to("cuda", torch.float64)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight.double())
        theirs.bias.copy_(ours.bias.double())
    x = torch.randn(2, 6, 13, 9, device="cuda", dtype=torch.float64).to(dt)
    xo, xt = x.clone().requires_grad_(), x.double().requires_grad_()
    y, want = ours(xo), theirs(xt)
    go = torch.randn(want.shape, device="cuda", dtype=torch.float64).to(dt)
    y.backward(go)
    want.backward(go.double())
    tol = TOLERANCE[dtype]
    assert_close(y.detach(), want.detach(), tol, "module output")
    assert_close(xo.grad, xt.grad, tol, "module grad_input")
    assert_close(ours.weight.grad, theirs.weight.grad, tol, "module grad_weight")
    assert_close(ours.bias.grad, theirs.bias.grad, tol, "module grad_bias")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_large_kernel_grad_weight_is_bitwise_reproducible(dtype, layout):
    """Over several split-K chunks too: each thread's sum and the chunks' reduction have fixed orders."""
    x_shape, w_shape = (8, 2, 64, 48), (2, 1, 101, 101)
    g = geometry(x_shape, w_shape, None, ConvParams.from_args(stride=2, padding=20, groups=2))
    partial, _ = large_kernel.plan_grad_weight(g, dtype, device.get(0).sm_count, layout)
    assert partial.grid[0] > 1, "the layer should split its rows into several chunks"
    gen = torch.Generator(device="cuda").manual_seed(1)
    dt = getattr(torch, dtype)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(x_shape, generator=gen, device="cuda", dtype=dt).contiguous(memory_format=fmt)
    w = torch.randn(w_shape, generator=gen, device="cuda", dtype=dt)
    go = torch.randn(g.output_shape, generator=gen, device="cuda", dtype=dt).contiguous(memory_format=fmt)
    kwargs = dict(stride=2, padding=20, groups=2)
    grads = []
    for _ in range(3):
        xs = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        ws = w.detach().clone().requires_grad_()
        ct.conv_transpose2d(xs, ws, None, **kwargs).backward(go)
        grads.append(ws.grad)
    want = _reference(kwargs, x, w, None, go)[2]
    assert_close(grads[0], want, TOLERANCE[dtype], "grad_weight over several chunks")
    for gw in grads[1:]:
        assert torch.equal(gw, grads[0]), "grad_weight is not reproducible bit for bit"
