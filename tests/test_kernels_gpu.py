"""Every kernel against float64 torch on the GPU, over a randomized sweep of layers."""
from __future__ import annotations

import os
import random

import pytest

from cupyconv import engine
from cupyconv.core import device
from cupyconv.plans import direct, launch, reduction, table
from cupyconv.jit.compiler import compile_count, compile_many
from cupyconv.tuning import decide
from cupyconv.core.geometry import ConvParams, geometry

from layers import Layer, random_layer, uses_gemm

torch = pytest.importorskip("torch")
F = torch.nn.functional
pytestmark = pytest.mark.gpu

DTYPES = ("float32", "float64", "float16", "bfloat16")
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
SWEEP = int(os.environ.get("CUPYCONV_GPU_SWEEP", "320"))


def _sweep_layers():
    rng = random.Random(20261126)
    return [random_layer(rng, DTYPES[i % len(DTYPES)]) for i in range(SWEEP)]


LAYERS = _sweep_layers()


def torch_dtype(name):
    return getattr(torch, name)


def make_inputs(layer: Layer, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch_dtype(layer.dtype)

    def rnd(shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64).to(dt)

    x = rnd(layer.input_shape)
    w = rnd(layer.weight_shape)
    b = rnd((layer.out_channels,)) if layer.bias else None
    out_shape = (layer.out_channels,) + layer.out_size()
    if layer.batch is not None:
        out_shape = (layer.batch,) + out_shape
    go = rnd(out_shape)
    return x, w, b, go


def cupyconv_raw(layer_kwargs, x, w, b, go, dtype_name, layout="nchw"):
    """Forward and all grads through the raw-pointer engine, on torch tensors (bfloat16 included).

    ``layout="nhwc"`` hands the engine channels_last copies of the activations and
    channels_last outputs to fill.
    """
    params = ConvParams.from_args(**layer_kwargs)
    g = geometry(x.shape, w.shape, None if b is None else b.shape, params)
    dev = x.device.index
    stream = torch.cuda.current_stream(x.device).cuda_stream
    nan = float("nan")
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    y = torch.full(g.output_shape, nan, dtype=x.dtype, device=x.device).contiguous(memory_format=fmt)
    gi = torch.full(g.input_shape, nan, dtype=x.dtype, device=x.device).contiguous(memory_format=fmt)
    gw = torch.full(g.weight_shape, nan, dtype=x.dtype, device=x.device)
    gb = torch.full((g.out_channels,), nan, dtype=x.dtype, device=x.device)
    x4, go4 = (x, go) if g.batched else (x[None], go[None])
    x4, go4 = x4.contiguous(memory_format=fmt), go4.contiguous(memory_format=fmt)

    def alloc(nbytes):
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=x.device)
        return t, t.data_ptr()

    launcher = launch.Launcher(dev, stream, alloc)
    engine.forward(g, dtype_name, x4.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(),
                   launcher, layout)
    engine.grad_input(g, dtype_name, go4.data_ptr(), w.data_ptr(), gi.data_ptr(), launcher, layout)
    engine.grad_weight(g, dtype_name, x4.data_ptr(), go4.data_ptr(), gw.data_ptr(), launcher, layout)
    engine.grad_bias(g, dtype_name, go4.data_ptr(), gb.data_ptr(), launcher, layout)
    unbatch = (lambda t: t) if g.batched else (lambda t: t[0])
    return unbatch(y), unbatch(gi), gw, gb


def torch_reference(layer_kwargs, x, w, b, go):
    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    br = None if b is None else b.double().requires_grad_()
    y = F.conv_transpose2d(xr, wr, br, **layer_kwargs)
    y.backward(go.double())
    gb = go.double().sum(dim=tuple(d for d in range(go.dim()) if d != go.dim() - 3))
    return y.detach(), xr.grad, wr.grad, gb


def assert_close(actual, expected, tol, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values (unwritten outputs?)"
    if expected.numel() == 0:
        return
    scale = expected.abs().max().item()
    err = (a - expected).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} * max|ref| {scale:.3e}"


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every kernel of the sweep on a thread pool before the tests use them."""
    specs = []
    for layer in LAYERS:
        g = geometry(layer.input_shape, layer.weight_shape, (layer.out_channels,) if layer.bias else None,
                     ConvParams.from_args(**layer.kwargs()))
        for layout in ("nchw", "nhwc"):
            specs += [p.spec for p in table.all_plans(g, layer.dtype, layer.bias, layout, device=device.get(0),
                                                      families_named=("direct", "tiled", "reduction"))]
    compile_many(specs, 0, workers=os.cpu_count() or 8)


@pytest.mark.parametrize("index", range(len(LAYERS)))
def test_random_layer(index):
    layer = LAYERS[index]
    x, w, b, go = make_inputs(layer, seed=index)
    kwargs = layer.kwargs()
    got = cupyconv_raw(kwargs, x, w, b, go, layer.dtype)
    want = torch_reference(kwargs, x, w, b, go)
    tol = TOLERANCE[layer.dtype]
    for name, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        assert_close(a, e, tol, f"{layer} {name}")


@pytest.mark.parametrize("index", range(0, len(LAYERS), 3))
def test_random_layer_channels_last(index):
    """The same kernels reading and writing channels_last memory in place."""
    layer = LAYERS[index]
    x, w, b, go = make_inputs(layer, seed=index)
    kwargs = layer.kwargs()
    got = cupyconv_raw(kwargs, x, w, b, go, layer.dtype, layout="nhwc")
    want = torch_reference(kwargs, x, w, b, go)
    tol = TOLERANCE[layer.dtype]
    for name, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        assert_close(a, e, tol, f"{layer} channels_last {name}")


def test_sweep_covers_the_required_space():
    """The sweep itself must span what the kernels claim to support."""
    assert len(LAYERS) >= 300
    assert {l.dtype for l in LAYERS} == set(DTYPES)
    assert {l.kernel[0] for l in LAYERS} == set(range(1, 8)) == {l.kernel[1] for l in LAYERS}
    assert {l.stride[0] for l in LAYERS} == set(range(1, 5)) == {l.stride[1] for l in LAYERS}
    assert {l.dilation[0] for l in LAYERS} == {1, 2, 3}
    assert any(l.groups > 1 and l.in_channels == l.groups for l in LAYERS)  # depthwise
    assert any(l.batch is None for l in LAYERS) and any(l.batch == 1 for l in LAYERS)
    assert any(max(l.output_padding) > 0 for l in LAYERS)
    assert any(l.bias for l in LAYERS) and any(not l.bias for l in LAYERS)


SEED_LAYERS = [
    # (input shape, C_out, kernel, stride, padding, dilation, groups, bias)
    ((16, 32, 128, 256), 64, (3, 5), (2, 3), (1, 2), (2, 1), 4, False),
    ((8, 32, 512, 1024), 32, (3, 3), (1, 1), (0, 0), (1, 1), 1, True),
    ((64, 64, 128, 256), 128, (3, 5), (1, 1), (0, 0), (1, 1), 1, True),
]


@pytest.mark.parametrize("seed_layer", SEED_LAYERS, ids=["grouped_dilated", "big_square", "asym_kernel"])
def test_seed_layer(seed_layer):
    shape, c_out, k, s, p, d, groups, bias = seed_layer
    layer = Layer(shape[0], shape[1], c_out, k, s, p, (0, 0), d, groups, bias, shape[2:], "float32")
    x, w, b, go = make_inputs(layer, seed=7)
    kwargs = layer.kwargs()
    got = cupyconv_raw(kwargs, x, w, b, go, "float32")
    want = torch_reference(kwargs, x, w, b, go)
    for name, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        assert_close(a, e, TOLERANCE["float32"], f"seed {name}")
    del got, want
    torch.cuda.empty_cache()


# Direct-kernel tilings the random sweep (at most 6 channels per group, stride 4) never
# reaches: (input shape, weight shape, layer arguments, dtypes).
DIRECT_EDGE_LAYERS = {
    # stride 17 x 18: output runs too long to stage through shared memory
    "long_stride": ((2, 3, 3, 4), (3, 2, 3, 2), dict(stride=(17, 18), padding=(1, 2), output_padding=(5, 3)),
                    ("float32", "float16")),
    # 40 input channels whose weights are staged in several chunks; 12 outputs per group
    # in blocks of 6; a 9-wide dilated kernel row too wide for shared grad_output windows
    "chunked_weights": ((2, 40, 5, 6), (40, 12, 5, 9), dict(stride=(1, 2), padding=(2, 4), dilation=(1, 3)),
                        ("float64", "float32", "bfloat16")),
    # more channel blocks than grid.y holds (65535), so blocks loop over them
    "many_groups": ((1, 66000, 2, 2), (66000, 1, 2, 2), dict(stride=2, padding=0, groups=66000), ("float32",)),
    # more images than grid.z holds
    "many_images": ((65600, 2, 2, 1), (2, 3, 2, 2), dict(stride=(1, 2)), ("float32",)),
}


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype_name,name", [(dt, name) for name, case in DIRECT_EDGE_LAYERS.items()
                                             for dt in case[3]])
def test_direct_kernel_edge_tilings(name, dtype_name, layout):
    x_shape, w_shape, kwargs, _ = DIRECT_EDGE_LAYERS[name]
    g = geometry(x_shape, w_shape, (w_shape[1] * kwargs.get("groups", 1),), ConvParams.from_args(**kwargs))
    assert not uses_gemm(g, dtype_name, 0)
    gen = torch.Generator(device="cuda").manual_seed(3)
    dt = torch_dtype(dtype_name)
    x, w, b, go = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64).to(dt)
                   for shape in (x_shape, w_shape, (g.out_channels,), g.output_shape))
    got = cupyconv_raw(kwargs, x, w, b, go, dtype_name, layout)
    want = torch_reference(kwargs, x, w, b, go)
    for what, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, want):
        assert_close(a, e, TOLERANCE[dtype_name], f"{name} {dtype_name} {layout} {what}")


# Grouped layers whose grad_input and grad_weight the tuner races thread blocks for: several split-K chunks, a
# remainder of output channels (5 a group in blocks of 2), rows of 19, 30 and 52 pixels that leave runs of every
# block's pixels unfinished, and the seed layer's dilated 3 x 5 taps in miniature.
RACED_BLOCK_LAYERS = {
    "grouped_dilated": ((4, 32, 40, 52), (32, 16, 3, 5),
                        dict(stride=(2, 3), padding=(1, 2), dilation=(2, 1), groups=4)),
    "g8_3x3": ((3, 64, 33, 30), (64, 8, 3, 3), dict(stride=1, padding=1, groups=8)),
    "uneven_4x4": ((2, 24, 17, 19), (24, 5, 4, 4), dict(stride=2, padding=1, groups=3)),
}


def _raced_block_case(name, pass_, dtype_name, layout, seed):
    """A layer of RACED_BLOCK_LAYERS for ``pass_``: its arguments and geometry, the direct variants the pass table
    lists (one per block, the heuristic's first) with each one's block as its tile names it, and x, w and
    grad_output drawn in float64 and rounded to the dtype."""
    x_shape, w_shape, kwargs = RACED_BLOCK_LAYERS[name]
    g = geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))
    blocks = (direct.grad_input_blocks if pass_ == "grad_input" else direct.grad_weight_blocks)(g, dtype_name, layout)
    assert len(blocks) > 1
    variants = [v for v in table.candidates(pass_, g, dtype_name, layout, "tf32", device.get(0))
                if v.family == "direct"]
    assert len(variants) == len(blocks)
    tiles = [v.kwargs.get("tile", "x".join(map(str, blocks[0]))) for v in variants]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch_dtype(dtype_name)
    data = tuple(torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64).to(dt)
                 for shape in (x_shape, w_shape, g.output_shape))
    return kwargs, g, list(zip(variants, tiles)), data


def _launched(seen, function):
    """The constants of the one launch of ``function`` that ``launch.watch`` saw."""
    ran = [dict(p.spec.constants) for _, p in seen if p.spec.function.startswith(function)]
    assert len(ran) == 1
    return ran[0]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(RACED_BLOCK_LAYERS))
def test_every_raced_grad_weight_block(name, dtype_name, layout):
    kwargs, _, variants, (x, w, go) = _raced_block_case(name, "grad_weight", dtype_name, layout, seed=5)
    want = torch_reference(kwargs, x, w, None, go)[2]
    for v, tile in variants:
        with decide.pinned({"grad_weight": v}), launch.watch() as seen:
            got = cupyconv_raw(kwargs, x, w, None, go, dtype_name, layout)[2]
        ran = _launched(seen, "conv_transpose2d_grad_weight")
        assert "x".join(str(ran.get(k, 1)) for k in ("IC_BLOCK", "OC_BLOCK", "KH_BLOCK")) == tile
        assert_close(got, want, TOLERANCE[dtype_name], f"{name} {dtype_name} {layout} grad_weight {v.name}")


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", list(RACED_BLOCK_LAYERS))
def test_every_raced_grad_input_block(name, dtype_name, layout):
    kwargs, g, variants, (x, w, go) = _raced_block_case(name, "grad_input", dtype_name, layout, seed=6)
    want = torch_reference(kwargs, x, w, None, go)[1]
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    go = go.contiguous(memory_format=fmt)
    def alloc(nbytes):   # the heuristic's NCHW grouped mma grad_input reads a channels_last copy
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
        return t, t.data_ptr()

    launcher = launch.Launcher(0, torch.cuda.current_stream().cuda_stream, alloc)
    for v, tile in variants:
        got = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda").contiguous(memory_format=fmt)
        # grad_input alone: every block compiles, and nothing else needs to
        with decide.pinned({"grad_input": v}), launch.watch() as seen:
            engine.grad_input(g, dtype_name, go.data_ptr(), w.data_ptr(), got.data_ptr(), launcher, layout)
        ran = _launched(seen, "conv_transpose2d_grad_input")
        assert f"{ran['IC_BLOCK' if layout == 'nchw' else 'ICB']}x{ran['CELLS']}" == tile
        if layout == "nhwc":   # 16-byte runs of output channels where a group's channels come in whole runs
            run = 16 // go.element_size()
            assert ran["OC_VEC"] == (run if g.out_per_group % run == 0 else 1)
        assert_close(got, want, TOLERANCE[dtype_name], f"{name} {dtype_name} {layout} grad_input {v.name}")
    # grad_output one element past an aligned address: read a channel at a time
    shifted = torch.empty(go.numel() + 1, dtype=go.dtype, device="cuda")[1:].as_strided(go.shape, go.stride())
    shifted.copy_(go)
    got = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda").contiguous(memory_format=fmt)
    with launch.watch() as seen:
        engine.grad_input(g, dtype_name, shifted.data_ptr(), w.data_ptr(), got.data_ptr(), launcher, layout)
    assert all(dict(p.spec.constants).get("OC_VEC", 1) == 1 for _, p in seen)
    assert_close(got, want, TOLERANCE[dtype_name], f"{name} {dtype_name} {layout} grad_input, unaligned")


@pytest.mark.parametrize("channels", [3, 32, 300])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("offset", [0, 1])
def test_grad_bias_in_runs_and_single_values(channels, dtype_name, layout, offset):
    """grad_bias: pixel lanes for few channels, channel tiles past 256, many chunks; 16-byte runs where the
    channels (channels_last) or planes (NCHW) come in whole runs, single values where they do not or where
    grad_output starts one element past an aligned address.  Against float64 sums, reproducible bit for bit."""
    x_shape, w_shape = (4, 2, 45, 62), (2, channels, 2, 2)
    g = geometry(x_shape, w_shape, (channels,), ConvParams.from_args(stride=2))
    plan = reduction.plan_grad_bias(g, dtype_name, device.get(0).sm_count, layout, offset == 0)[0]
    constants = dict(plan.spec.constants)
    if layout == "nhwc":
        assert constants["CHANNEL_TILE"] == min(channels, 256)
    vec = 16 // torch.empty((), dtype=torch_dtype(dtype_name)).element_size()
    whole = channels % vec == 0 if layout == "nhwc" else (90 * 124) % vec == 0
    assert constants["VEC"] == (vec if whole and offset == 0 else 1) and plan.grid[0] > 1
    gen = torch.Generator(device="cuda").manual_seed(channels)
    go = torch.randn(g.output_shape, generator=gen, device="cuda", dtype=torch.float64).to(torch_dtype(dtype_name))
    if layout == "nhwc":
        go = go.contiguous(memory_format=torch.channels_last)
    # the same values one element past the allocator's aligned start
    storage = torch.empty(go.numel() + offset, device="cuda", dtype=go.dtype)
    shaped = storage[offset:].view(go.permute(0, 2, 3, 1).shape if layout == "nhwc" else go.shape)
    shaped.copy_(go.permute(0, 2, 3, 1) if layout == "nhwc" else go)
    want = go.double().sum((0, 2, 3))
    stream = torch.cuda.current_stream().cuda_stream

    def alloc(nbytes):
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")
        return t, t.data_ptr()

    results = []
    for _ in range(2):
        gb = torch.full((channels,), float("nan"), device="cuda", dtype=go.dtype)
        engine.grad_bias(g, dtype_name, shaped.data_ptr(), gb.data_ptr(), launch.Launcher(0, stream, alloc), layout)
        results.append(gb)
    assert_close(results[0], want, TOLERANCE[dtype_name], f"grad_bias {channels} channels {dtype_name} {layout}")
    assert torch.equal(results[0], results[1]), "grad_bias is not reproducible bit for bit"


def test_direct_edge_layers_reach_their_tilings():
    def constants(name, dtype, plan):
        x_shape, w_shape, kwargs, _ = DIRECT_EDGE_LAYERS[name]
        g = geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))
        return g, dict(plan(g, dtype).spec.constants)

    _, fwd = constants("long_stride", "float32", lambda g, dt: direct.plan_forward(g, dt, True))
    assert fwd["STAGE_STORES"] is False
    g, fwd = constants("chunked_weights", "float64", lambda g, dt: direct.plan_forward(g, dt, True))
    assert fwd["IC_CHUNK"] < g.in_per_group and fwd["OC_BLOCK"] == 6
    _, gw = constants("chunked_weights", "float32", lambda g, dt: direct.plan_grad_weight(g, dt, 132)[0])
    assert gw["CELLS"] == 1
    g, _ = constants("many_groups", "float32", lambda g, dt: direct.plan_forward(g, dt, True))
    assert direct.plan_forward(g, "float32", True).grid[1] == 65535


# ------------------------------------------------------------------ the CuPy array API

cupy = pytest.importorskip("cupy")
import cupyconv  # noqa: E402


@pytest.mark.parametrize("index", range(0, len(LAYERS), 7))
def test_cupy_api_matches_raw_engine(index):
    """The public CuPy path gives bit-identical results to the raw engine on the same data."""
    layer = LAYERS[index]
    if layer.dtype == "bfloat16":
        layer = Layer(**{**layer.__dict__, "dtype": "float32"})
    x, w, b, go = make_inputs(layer, seed=1000 + index)
    kwargs = layer.kwargs()
    raw = cupyconv_raw(kwargs, x, w, b, go, layer.dtype)
    cx, cw, cgo = (cupy.from_dlpack(t) for t in (x, w, go))
    cb = None if b is None else cupy.from_dlpack(b)
    y = cupyconv.conv_transpose2d(cx, cw, cb, **kwargs)
    gi, gw, gb = cupyconv.conv_transpose2d_backward(cgo, cx, cw, **kwargs)
    for name, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), (y, gi, gw, gb), raw):
        assert isinstance(a, cupy.ndarray) and str(a.dtype) == layer.dtype, name
        assert torch.equal(torch.from_dlpack(a), e), f"{layer} {name} differs from the raw engine"


def test_cupy_non_default_stream_and_output_mask():
    layer = Layer(2, 6, 4, (3, 2), (2, 1), (1, 0), (1, 0), (1, 2), 2, True, (9, 7), "float32")
    x, w, b, go = make_inputs(layer, seed=3)
    kwargs = layer.kwargs()
    want = torch_reference(kwargs, x, w, b, go)
    cx, cw, cb, cgo = (cupy.from_dlpack(t) for t in (x, w, b, go))
    torch.cuda.synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = cupyconv.conv_transpose2d(cx, cw, cb, **kwargs)
        gi, gw, gb = cupyconv.conv_transpose2d_backward(cgo, cx, cw, **kwargs, output_mask=(False, True, False))
    stream.synchronize()
    assert gi is None and gb is None
    assert_close(torch.from_dlpack(y), want[0], 1e-5, "output on a side stream")
    assert_close(torch.from_dlpack(gw), want[2], 1e-5, "grad_weight on a side stream")


def test_numpy_inputs_use_the_gpu_and_return_numpy():
    import numpy as np

    assert cupyconv.backend() == "cupy"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 5, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 2)).astype(np.float32)
    y = cupyconv.conv_transpose2d(x, w, None, stride=2, padding=1)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    ref = F.conv_transpose2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), stride=2, padding=1)
    assert np.abs(y - ref.numpy()).max() <= 1e-5 * np.abs(ref.numpy()).max()


def test_new_image_size_does_not_recompile():
    w = cupy.random.standard_normal((4, 2, 3, 3), dtype=cupy.float32)
    cupyconv.conv_transpose2d(cupy.random.standard_normal((1, 4, 8, 8), dtype=cupy.float32), w, stride=2)
    before = compile_count()
    for size in ((9, 13), (31, 5), (64, 64)):
        cupyconv.conv_transpose2d(cupy.random.standard_normal((3, 4) + size, dtype=cupy.float32), w, stride=2)
    assert compile_count() == before


def test_cupy_array_on_second_device_if_present():
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU")
    with cupy.cuda.Device(1):
        x = cupy.random.standard_normal((1, 2, 5, 5), dtype=cupy.float32)
        w = cupy.random.standard_normal((2, 2, 3, 3), dtype=cupy.float32)
    y = cupyconv.conv_transpose2d(x, w)
    assert y.device.id == 1


def test_empty_batch():
    x = cupy.zeros((0, 4, 5, 5), dtype=cupy.float32)
    w = cupy.random.standard_normal((4, 2, 3, 3), dtype=cupy.float32)
    y = cupyconv.conv_transpose2d(x, w)
    assert y.shape == (0, 2, 7, 7)
    gi, gw, gb = cupyconv.conv_transpose2d_backward(cupy.zeros((0, 2, 7, 7), dtype=cupy.float32), x, w)
    assert gi.shape == x.shape and bool((gw == 0).all()) and bool((gb == 0).all())


def test_numpy_bfloat16_on_gpu():
    import numpy as np

    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cupyconv import reference

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 6, 5)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((4, 3, 3, 2)).astype(ml_dtypes.bfloat16)
    y = cupyconv.conv_transpose2d(x, w, None, stride=2, groups=2)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype
    ref = reference.conv_transpose2d(x, w, None, (2, 2), (0, 0), (0, 0), 2, (1, 1))
    assert np.abs(y.astype(np.float64) - ref).max() <= 3e-2 * np.abs(ref).max()


def test_unwritable_disk_cache_falls_back_to_memory(monkeypatch, tmp_path):
    from cupyconv import reference

    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    cupyconv.clear_cache()
    x = cupy.random.standard_normal((2, 3, 5, 4), dtype=cupy.float64)
    w = cupy.random.standard_normal((3, 5, 2, 7), dtype=cupy.float64)
    y = cupyconv.conv_transpose2d(x, w, stride=(3, 1), dilation=(1, 2), padding=(0, 3))
    ref = reference.conv_transpose2d(x.get(), w.get(), None, (3, 1), (0, 3), (0, 0), 1, (1, 2))
    assert float(abs(y.get() - ref).max()) <= 1e-10 * float(abs(ref).max())


def test_compiler_cache_cleared_alone_between_calls():
    """compiler.clear_cache() without the plan cache: plans fetch fresh kernels, nothing launches stale ones."""
    import gc

    from cupyconv import reference
    from cupyconv.jit import compiler

    x = cupy.random.standard_normal((2, 16, 7, 6), dtype=cupy.float32)
    w = cupy.random.standard_normal((16, 16, 3, 3), dtype=cupy.float32)
    ref = reference.conv_transpose2d(x.get(), w.get(), None, (2, 2), (1, 1), (1, 1), 1, (1, 1))
    for _ in range(3):
        y = cupyconv.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1)
        cupy.cuda.Device().synchronize()
        assert float(abs(y.get() - ref).max()) <= 1e-4 * float(abs(ref).max())
        before = compiler.compile_count()
        compiler.clear_cache()
        gc.collect()  # modules only the compiler cache held would be unloaded here
        cupyconv.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1)
        assert compiler.compile_count() > before, "plans kept launching the kernels the compiler let go of"
