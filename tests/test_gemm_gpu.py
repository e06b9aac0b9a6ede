"""The tensor-core implicit-GEMM kernels on a GPU, against float64 references.

Layers here have at least 16 channels per group, so the engine routes them to the GEMM
kernels (asserted, so a heuristic change cannot silently turn this into a test of the
direct kernels).  Strict float32 (3xTF32) must stay within 1e-5 of float64; TF32, fp16 and
bf16 must be no worse than twice torch's own error on the same data, dtype and layout.
cuDNN may compute a float32 layer without TF32 even when allowed, so for TF32 torch's
error is taken as at least that of an exact computation on TF32-rounded operands.
"""
from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv.torch as ct  # noqa: E402
from cupyconv import reference  # noqa: E402
from cupyconv.jit import compiler  # noqa: E402
from cupyconv.plans import gemm, launch, table  # noqa: E402
from cupyconv.tuning import Variant  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402

from layers import Layer, tensor_core_layers, uses_gemm  # noqa: E402
from tf32 import round_tf32  # noqa: E402

CASES = [  # (dtype, allow_tf32)
    (torch.float32, False), (torch.float32, True), (torch.float16, False), (torch.bfloat16, False)]
CASE_IDS = ["fp32_strict", "tf32", "fp16", "bf16"]


def gemm_layers(count: int, seed: int):
    return tensor_core_layers(count, seed, (16, 24, 40, 64, 72, 136), (16, 24, 40, 64, 72, 136))


LAYERS = gemm_layers(12, seed=7) + [
    Layer(2, 64, 48, (4, 4), (4, 4), (0, 0), (3, 1), (1, 1), 1, True, (3, 5), ""),  # phases with no taps
    Layer(1, 32, 32, (1, 1), (3, 2), (0, 0), (2, 1), (1, 1), 1, True, (7, 6), ""),   # 1x1, gaps between phases
]


def _geometry(layer):
    return geometry(layer.input_shape, layer.weight_shape, None, ConvParams.from_args(**layer.kwargs()))


def _data(layer, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(layer.input_shape, generator=gen, device="cuda", dtype=torch.float64)
    w = torch.randn(layer.weight_shape, generator=gen, device="cuda", dtype=torch.float64)
    b = torch.randn(layer.out_channels, generator=gen, device="cuda", dtype=torch.float64) if layer.bias else None
    go_shape = F.conv_transpose2d(x, w, None, **layer.kwargs()).shape
    go = torch.randn(go_shape, generator=gen, device="cuda", dtype=torch.float64)
    return x, w, b, go


def _run(fn, x, w, b, go, layer, dtype, channels_last):
    """Forward output and (grad_input, grad_weight, grad_bias) of ``fn`` in ``dtype``."""
    def prep(t):
        if t is None:
            return None
        t = t.detach().to(dtype)
        if channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t.requires_grad_()

    xs, ws, bs = prep(x), prep(w), prep(b)
    y = fn(xs, ws, bs, **layer.kwargs())
    gos = go.to(dtype)
    if channels_last and gos.dim() == 4:
        gos = gos.contiguous(memory_format=torch.channels_last)
    y.backward(gos)
    return y.detach(), xs.grad, ws.grad, None if bs is None else bs.grad


def _rel_err(got, ref):
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.fixture
def tf32_flag():
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("index", range(len(LAYERS)))
def test_gemm_matches_float64(index, case, channels_last, tf32_flag):
    layer = LAYERS[index]
    dtype, allow_tf32 = case
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    g = _geometry(layer)
    assert uses_gemm(g, ct._DTYPE_NAMES[dtype], 0)
    x, w, b, go = _data(layer, seed=index)
    ref = _run(F.conv_transpose2d, x, w, b, go, layer, torch.float64, False)
    ours = _run(ct.conv_transpose2d, x, w, b, go, layer, dtype, channels_last)
    theirs = _run(F.conv_transpose2d, x, w, b, go, layer, dtype, channels_last)
    names = ("output", "grad_input", "grad_weight", "grad_bias")
    floor = [0.0] * 4
    if allow_tf32:
        rounded = _run(F.conv_transpose2d, round_tf32(x), round_tf32(w), b, round_tf32(go), layer,
                       torch.float64, False)
        floor = [None if r is None else _rel_err(a, r) for a, r in zip(rounded, ref)]
    if channels_last and layer.batch is not None:
        assert ours[0].is_contiguous(memory_format=torch.channels_last)
        assert ours[1].is_contiguous(memory_format=torch.channels_last)
    for name, o, t, r, f in zip(names, ours, theirs, ref, floor):
        if r is None:
            continue
        assert o.dtype == dtype and o.shape == r.shape
        err = _rel_err(o, r)
        if dtype == torch.float32 and not allow_tf32:
            assert err <= 1e-5, f"{name}: strict fp32 error {err:.2e}"
        else:
            # twice torch's error, floored at a quarter of the dtype's rounding step so
            # an exact torch result does not demand exactness of a different summation order
            bound = max(2 * max(_rel_err(t, r), f), torch.finfo(dtype).eps / 4)
            assert err <= bound, f"{name}: error {err:.2e} vs torch's {_rel_err(t, r):.2e}"


def test_gemm_strict_fp32_against_numpy_reference():
    """An independent float64 check that involves no torch convolution at all."""
    import cupy

    from cupyconv import functional

    layer = LAYERS[1]
    rng = np.random.default_rng(3)
    x = rng.standard_normal(layer.input_shape).astype(np.float32)
    w = rng.standard_normal(layer.weight_shape).astype(np.float32)
    b = rng.standard_normal(layer.out_channels).astype(np.float32) if layer.bias else None
    p = ConvParams.from_args(**layer.kwargs())
    got = functional.conv_transpose2d(cupy.asarray(x), cupy.asarray(w), None if b is None else cupy.asarray(b),
                                      **layer.kwargs()).get()
    xb = x if layer.batch else x[None]
    want = reference.conv_transpose2d(xb.astype(np.float64), w.astype(np.float64),
                                      None if b is None else b.astype(np.float64), p.stride, p.padding,
                                      p.output_padding, p.groups, p.dilation).reshape(got.shape)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_gemm_grad_weight_is_bitwise_reproducible(channels_last):
    layer = Layer(4, 64, 96, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1, True, (33, 31), "")
    x, w, b, go = _data(layer)
    grads = [_run(ct.conv_transpose2d, x, w, b, go, layer, torch.float16, channels_last)[2:] for _ in range(3)]
    for gw, gb in grads[1:]:
        assert torch.equal(gw, grads[0][0]) and torch.equal(gb, grads[0][1])


def test_tensor_cores_can_be_switched_off(monkeypatch, tf32_flag):
    torch.backends.cudnn.allow_tf32 = False  # strict on both paths, so they must agree to fp32 rounding
    layer = LAYERS[0]
    g = _geometry(layer)
    assert uses_gemm(g, "float16", 0)
    monkeypatch.setenv(gemm.TENSOR_CORES_ENV, "0")
    assert not uses_gemm(g, "float16", 0)
    x, w, b, go = _data(layer)
    on_direct = _run(ct.conv_transpose2d, x, w, b, go, layer, torch.float32, False)
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV)
    on_gemm = _run(ct.conv_transpose2d, x, w, b, go, layer, torch.float32, False)
    for a, c in zip(on_direct, on_gemm):
        if a is not None:
            assert _rel_err(c, a.double()) <= 2e-6


def _scratch(nbytes):
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return buf, buf.data_ptr()


TILE_STAGES = [(tile, gemm.DEFAULT_STAGES) for tile in sorted(gemm.TILES)]
TILE_STAGES += [("64x64", s) for s in gemm.STAGE_CHOICES if s != gemm.DEFAULT_STAGES]


@pytest.mark.parametrize("tile,stages", TILE_STAGES)
def test_every_block_tile_is_correct(tile, stages):
    """The heuristic picks one tile and depth per layer; each candidate must be right on its own."""
    layer = Layer(2, 40, 72, (3, 2), (2, 1), (1, 0), (1, 0), (1, 2), 1, True, (11, 13), "")
    g = _geometry(layer)
    x, w, b, go = _data(layer)
    xs, ws, bs, gos = (t.half().contiguous() for t in (x, w, b, go))
    launcher = launch.Launcher(0, torch.cuda.current_stream().cuda_stream, _scratch)
    variant = Variant.make("gemm", tile=tile, stages=stages)

    def run(pass_, *pointers):
        table.plan(pass_, variant, g, "float16", "nchw", "strict", pass_ == "forward").run(launcher, pointers)

    y = torch.empty(go.shape, dtype=torch.float16, device="cuda")
    run("forward", xs.data_ptr(), ws.data_ptr(), bs.data_ptr(), y.data_ptr())
    gi = torch.empty_like(xs)
    run("grad_input", gos.data_ptr(), ws.data_ptr(), gi.data_ptr())
    gw = torch.empty_like(ws)
    run("grad_weight", xs.data_ptr(), gos.data_ptr(), gw.data_ptr())
    ref = _run(F.conv_transpose2d, x, w, b, go, layer, torch.float64, False)
    for got, want in zip((y, gi, gw), ref[:3]):
        assert _rel_err(got, want) <= 2e-3


# Where K is split into ranges: a weight-bound small grid whose heuristic splits it, a 3 x 3 kernel whose stride
# phases have 4, 2, 2 and 1 taps (so some ranges of the short phases are empty), a 2 x 2 kernel at stride 3 (a
# third of the phases have no taps: bias only), and grouped, dilated channels, each with a bias.
SPLIT_LAYERS = [
    Layer(4, 256, 136, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (3, 3), ""),
    Layer(2, 72, 40, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1, True, (5, 4), ""),
    Layer(2, 64, 48, (2, 2), (3, 3), (0, 0), (2, 1), (1, 1), 1, True, (3, 5), ""),
    Layer(3, 96, 64, (2, 3), (1, 2), (0, 1), (0, 1), (2, 1), 2, True, (4, 6), ""),
]
SPLIT_CASES = [("float16", "strict", 3e-3), ("bfloat16", "strict", 2e-2), ("float32", "tf32", 3e-3),
               ("float32", "strict", 1e-5)]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,precision,tol", SPLIT_CASES, ids=[c[0] + "_" + c[1] for c in SPLIT_CASES])
@pytest.mark.parametrize("index", range(len(SPLIT_LAYERS)))
def test_split_k_forward_and_grad_input_match_float64(index, dtype, precision, tol, layout):
    """Forward (with and without its bias) and grad_input with K split 2, 5 and 13 ways and by the heuristic,
    against float64; every split gives the same result on every run (a fixed-order reduce)."""
    layer = SPLIT_LAYERS[index]
    g = _geometry(layer)
    x, w, b, go = _data(layer, seed=index)
    tdtype = getattr(torch, dtype)
    cl = layout == "nhwc"
    fmt = torch.channels_last if cl else torch.contiguous_format
    xs, gos = (t.to(tdtype).contiguous(memory_format=fmt) for t in (x, go))
    ws, bs = w.to(tdtype).contiguous(), b.to(tdtype)
    ref = _run(F.conv_transpose2d, x, w, b, go, layer, torch.float64, False)
    no_bias = F.conv_transpose2d(x, w, None, **layer.kwargs())
    launcher = launch.Launcher(0, torch.cuda.current_stream().cuda_stream, _scratch)
    heuristic = table.plan("forward", Variant("gemm"), g, dtype, layout, precision, True).reduce
    if index == 0:
        assert heuristic is not None and heuristic.scalars[1] > 1, "the weight-bound layer splits untold"
    for split in (2, 5, 13, None):
        variant = Variant.make("gemm", **({} if split is None else {"split": split}))
        results = []
        for _ in range(2):
            y = torch.full(go.shape, float("nan"), dtype=tdtype, device="cuda").contiguous(memory_format=fmt)
            y0 = torch.full_like(y, float("nan"))
            gi = torch.full_like(xs, float("nan"))
            table.plan("forward", variant, g, dtype, layout, precision, True).run(
                launcher, (xs.data_ptr(), ws.data_ptr(), bs.data_ptr(), y.data_ptr()))
            table.plan("forward", variant, g, dtype, layout, precision, False).run(
                launcher, (xs.data_ptr(), ws.data_ptr(), 0, y0.data_ptr()))
            table.plan("grad_input", variant, g, dtype, layout, precision).run(
                launcher, (gos.data_ptr(), ws.data_ptr(), gi.data_ptr()))
            results.append((y, y0, gi))
        for name, got, want in zip(("forward", "forward without bias", "grad_input"), results[0],
                                   (ref[0], no_bias, ref[1])):
            assert _rel_err(got, want) <= tol, f"split {split}: {name} {_rel_err(got, want):.2e}"
        for a, c in zip(*results):
            assert torch.equal(a, c), f"split {split}: bitwise the same on every run"


@pytest.mark.parametrize("tile", [(0, 0), (64, 32)])
@pytest.mark.parametrize("weight_cl", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("mode", [0, 1])
def test_16_bit_weight_packs_alike_from_a_view_one_element_off_word_alignment(mode, weight_cl, tile):
    """pack_weight moves 16-bit weights a word at a time where the pointer allows: a weight view starting one
    element into its allocation takes the halfword path and packs the same bits."""
    g = geometry((1, 40, 3, 3), (40, 24, 4, 4), None, ConvParams.from_args(stride=2))
    if weight_cl:
        g = g.with_weight_channels_last()
    plan = gemm.plan_pack_weight_padded(g, "float16", mode, 64, 64, tile)
    w = (torch.rand(g.weight_shape, device="cuda") + 0.5).half()   # no zeros: every packed zero is padding
    memory = w.permute(0, 2, 3, 1).contiguous() if weight_cl else w
    flat = torch.empty(memory.numel() + 1, device="cuda", dtype=torch.float16)
    flat[1:] = memory.reshape(-1)
    stream = torch.cuda.current_stream().cuda_stream
    outs = []
    for ptr in (memory.data_ptr(), flat.data_ptr() + 2):
        out = torch.full((plan.scratch_bytes // 2,), -1, device="cuda", dtype=torch.int16)
        plan.run(0, stream, (ptr, out.data_ptr()))
        outs.append(out)
    torch.cuda.synchronize()
    assert (flat.data_ptr() + 2) % 4 == 2
    assert torch.equal(outs[0], outs[1])
    assert int((outs[0] != 0).sum()) == w.numel() and not bool((outs[0] == -1).any())


@pytest.mark.parametrize("element_bytes", (2, 4))
@pytest.mark.parametrize("batch,channels,pixels,offset", [
    (1, 64, 64, 0), (3, 40, 4100, 0), (2, 8, 6, 0), (2, 31, 97, 0), (1, 130, 129, 1), (4, 72, 900, 1),
    (1, 1, 1, 0), (66000, 2, 2, 0)])
def test_to_channels_last_copy(element_bytes, batch, channels, pixels, offset):
    """The NCHW -> channels_last copy in front of the GEMMs: odd sizes, tile edges, a misaligned
    source (one element past an allocation) and more images than a grid dimension holds."""
    dtype = {2: torch.int16, 4: torch.int32}[element_bytes]
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + channels + pixels)
    total = batch * channels * pixels
    flat = torch.randint(-2 ** 15, 2 ** 15, (total + offset,), generator=gen, device="cuda").to(dtype)
    src = flat[offset:].view(batch, channels, pixels)
    dst = torch.full((batch, pixels, channels), -1, dtype=dtype, device="cuda")
    name = {2: "float16", 4: "float32"}[element_bytes]
    plan = gemm.plan_to_channels_last(batch, channels, pixels, name)
    plan.run(0, torch.cuda.current_stream().cuda_stream, (src.data_ptr(), dst.data_ptr()))
    torch.cuda.synchronize()
    assert torch.equal(dst, src.transpose(1, 2))


@pytest.mark.parametrize("batch,channels,pixels", [(3, 40, 4100), (2, 31, 97), (1, 130, 129)])
def test_to_channels_last_copy_rounds_tf32(batch, channels, pixels):
    """The copy in front of the TF32 wgmma kernels rounds each float32 word as cvt.rna.tf32.f32 does (ties away,
    Inf and NaN kept, the largest values to Inf), and moves it where the plain copy would."""
    gen = torch.Generator(device="cuda").manual_seed(batch + channels + pixels)
    src = torch.randn(batch, channels, pixels, generator=gen, device="cuda")
    special = torch.tensor([1 + 2 ** -11, -(1 + 2 ** -11), 1 + 3 * 2 ** -11, 2 ** -140, float("inf"), float("nan"),
                            torch.finfo(torch.float32).max], device="cuda")
    src.view(-1)[:special.numel()] = special
    dst = torch.full((batch, pixels, channels), -1.0, device="cuda")
    plan = gemm.plan_to_channels_last(batch, channels, pixels, "float32", round_tf32=True)
    plan.run(0, torch.cuda.current_stream().cuda_stream, (src.data_ptr(), dst.data_ptr()))
    torch.cuda.synchronize()
    bits = src.transpose(1, 2).contiguous().view(torch.int32)
    finite = (bits & 0x7F800000) != 0x7F800000
    want = torch.where(finite, (bits + 0x1000) & ~0x1FFF, bits).view(torch.float32)
    assert torch.equal(dst.view(torch.int32), want.view(torch.int32))
    assert dst[0, 0, 0] == 1 + 2 ** -10 and dst[0, 1, 0] == -(1 + 2 ** -10), "ties away from zero"
    assert torch.isinf(dst[0, 6, 0]) and torch.isnan(dst[0, 5, 0])
    with pytest.raises(ValueError, match="float32"):
        gemm.plan_to_channels_last(batch, channels, pixels, "float16", round_tf32=True)


# The split layers, and 20 input channels (no whole 16-byte runs: the forward gathers x through registers)
IN_PLACE_LAYERS = SPLIT_LAYERS + [Layer(2, 20, 48, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1, True, (7, 9), "")]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype,tol", [("float16", 3e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("index", range(len(IN_PLACE_LAYERS)))
def test_gemms_read_a_channels_last_weight_in_place(index, dtype, tol, layout):
    """Forward (with its bias) and grad_input of a 16-bit channels_last weight read it in place (no pack), whole or
    split, on every tile, with channels past a tile's N and past a K tile zero: against float64."""
    layer = IN_PLACE_LAYERS[index]
    g = _geometry(layer).with_weight_channels_last()
    x, w, b, go = _data(layer, seed=index)
    tdtype = getattr(torch, dtype)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    xs, gos = (t.to(tdtype).contiguous(memory_format=fmt) for t in (x, go))
    ws, bs = w.to(tdtype).contiguous(memory_format=torch.channels_last), b.to(tdtype)
    ref = _run(F.conv_transpose2d, x, w, b, go, layer, torch.float64, False)
    launcher = launch.Launcher(0, torch.cuda.current_stream().cuda_stream, _scratch)
    variants = [Variant("gemm"), Variant.make("gemm", split=1), Variant.make("gemm", split=3)]
    if index == 0:   # every tile on the first layer only: each is a kernel to build
        variants += [Variant.make("gemm", tile=tile) for tile in sorted(gemm.TILES)]
    plans = {(pass_, variant): table.plan(pass_, variant, g, dtype, layout, "strict", pass_ == "forward")
             for pass_ in ("forward", "grad_input") for variant in variants}
    compiler.compile_many([p.spec for plan in plans.values() for p in plan.plans()], 0, workers=16)
    for (pass_, variant), plan in plans.items():
        assert plan.pack is None and dict(plan.gemm.spec.constants)["WEIGHT_DIRECT"]
        if pass_ == "forward":
            got = torch.full(go.shape, float("nan"), dtype=tdtype, device="cuda").contiguous(memory_format=fmt)
            plan.run(launcher, (xs.data_ptr(), ws.data_ptr(), bs.data_ptr(), got.data_ptr()))
            want = ref[0]
        else:
            got = torch.full(x.shape, float("nan"), dtype=tdtype, device="cuda").contiguous(memory_format=fmt)
            plan.run(launcher, (gos.data_ptr(), ws.data_ptr(), got.data_ptr()))
            want = ref[1]
        assert _rel_err(got, want) <= tol, f"{pass_} {variant.name}: {_rel_err(got, want):.2e}"
