"""Autotuning on a GPU: what it picks, that every pick is right, persistence, graph capture.

Every test here turns autotuning on (tests/conftest.py leaves it off for the rest of the
suite) and points the choices file at a temporary directory.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402
from cupyconv import tuning  # noqa: E402
from cupyconv.core import device as core_device  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.plans import gemm, launch, table, wgmma  # noqa: E402
from cupyconv.tuning import decide  # noqa: E402
from cupyconv.tuning.explicit import TUNED_PASSES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ConvTranspose2d arguments and an input shape.  THIN has under 64 channels per group, so
# the direct kernels compete with the tiles (in both layouts); WIDE reaches the 128-wide tiles.
THIN = (dict(in_channels=32, out_channels=48, kernel_size=3, stride=2, padding=1, output_padding=1),
        (3, 32, 13, 11))
WIDE = (dict(in_channels=128, out_channels=96, kernel_size=4, stride=2, padding=1), (2, 128, 9, 8))
CASES = [(torch.float16, False), (torch.bfloat16, False), (torch.float32, True), (torch.float32, False)]
CASE_IDS = ["fp16", "bf16", "tf32", "fp32_strict"]
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@pytest.fixture
def tuned(tmp_path, monkeypatch):
    """Autotuning on, an empty choices directory, and nothing remembered in this process."""
    cache = tmp_path / "tuning"
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(cache))
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV, raising=False)
    tuning.clear()
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    yield cache
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    tuning.clear()


@pytest.fixture
def timings(monkeypatch):
    """Counts the calls of the candidate timer (it still times)."""
    calls = []
    real = decide._measure

    def spy(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(decide, "_measure", spy)
    return calls


def _geometry(layer):
    args, shape = layer
    weight = (args["in_channels"], args["out_channels"] // args.get("groups", 1)) + (args["kernel_size"],) * 2
    params = ConvParams.from_args(args.get("stride", 1), args.get("padding", 0), args.get("output_padding", 0),
                                  args.get("groups", 1), args.get("dilation", 1))
    return geometry(shape, weight, None, params)


def _kwargs(layer):
    args = layer[0]
    return {k: args[k] for k in ("stride", "padding", "output_padding", "groups", "dilation") if k in args}


def _data(layer, seed=0):
    g = _geometry(layer)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(g.input_shape, generator=gen, device="cuda", dtype=torch.float64)
    w = torch.randn(g.weight_shape, generator=gen, device="cuda", dtype=torch.float64)
    b = torch.randn(g.out_channels, generator=gen, device="cuda", dtype=torch.float64)
    go = torch.randn(g.output_shape, generator=gen, device="cuda", dtype=torch.float64)
    return x, w, b, go


def _rel_err(got, ref):
    return float((got.detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _bound(dtype, tf32):
    if dtype == torch.float32:
        return 2 ** -8 if tf32 else 1e-5
    return 4 * torch.finfo(dtype).eps


def _reference(layer, x, w, b, go):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = F.conv_transpose2d(x, w, b, **_kwargs(layer))
    y.backward(go)
    return y.detach(), x.grad, w.grad


def _choices_in_process(g, dtype, layout, precision, g_weight=None):
    """Each pass's choice remembered in this process; ``g_weight``: the geometry grad_weight ran with, where it
    is not ``g`` (grad_weight written in torch's memory format, not the weight's)."""
    return {p: tuning.chosen(p, g_weight if p == "grad_weight" and g_weight is not None else g, dtype, layout,
                             precision, torch.cuda.current_device()) for p in TUNED_PASSES}


def _grad_weight_geometry(g, layout):
    """The geometry grad_weight runs with for a contiguous weight beside an x in ``layout``."""
    x = torch.empty(g.user_shape(g.input_shape), device="meta")
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    return ct._grad_weight_geometry(g, layout, x, torch.empty(g.weight_shape, device="meta"))


# ------------------------------------------------------------------------------ tune()

def test_tune_picks_candidates_persists_them_and_reuses_them(tuned):
    g = _geometry(THIN)
    dev = core_device.get(0)
    (result,) = cupyconv.tune(THIN[0], THIN[1], dtype="float16", repeat=3)
    assert result.dtype == "float16" and result.layout == "nchw" and result.input_shape == THIN[1]
    entries = json.loads((tuned / tuning.CACHE_FILE).read_text())["entries"]
    assert len(entries) == 3 and list(result.choices) == list(TUNED_PASSES)
    for pass_ in TUNED_PASSES:
        names = [v.name for v in table.candidates(pass_, g, "float16", "nchw", "strict", dev)]
        assert len(names) >= 2 and "direct" in names
        pick = result.choices[pass_]
        times = result.times_ms[pass_]
        assert result.sources[pass_] == "tuned"
        assert pick in names and set(times) <= set(names) and len(times) >= 2
        assert times[pick] == min(times.values()) and all(t > 0 for t in times.values())
        key = tuning.make_key(pass_, g, "float16", "nchw", "strict", dev.name, dev.arch)
        assert entries[key]["variant"] == pick
        assert tuning.chosen(pass_, g, "float16", "nchw", "strict", 0) == tuning.Variant.parse(pick)
    again = cupyconv.tune(THIN[0], THIN[1], dtype="float16")[0]
    assert again.choices == result.choices and set(again.sources.values()) == {"stored"}
    forced = cupyconv.tune(THIN[0], THIN[1], dtype="float16", repeat=2, force=True, passes=("forward",))[0]
    assert forced.sources == {"forward": "tuned"} and list(forced.choices) == ["forward"]


def test_tune_channels_last_times_the_direct_kernels_against_the_gemms(tuned):
    """Both kinds of kernel read channels_last in place, so the tuner races them there too."""
    (result,) = cupyconv.tune(THIN[0], THIN[1], dtype="float16", layout="channels_last", repeat=2)
    assert result.layout == "nhwc"
    for pass_ in TUNED_PASSES:
        times = result.times_ms[pass_]
        assert "direct" in times and any(v.startswith("gemm") for v in times), pass_
        assert times[result.choices[pass_]] == min(times.values())


def test_tune_a_model_with_a_progress_bar(tuned, capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ConvTranspose2d(64, 32, 4, 2, 1), torch.nn.ReLU(),
                                ct.ConvTranspose2d(32, 12, 4, 2, 1), torch.nn.ReLU(),
                                torch.nn.ConvTranspose2d(12, 3, 3, 1, 1)).cuda().half()
    results = cupyconv.tune(model, (2, 64, 6, 6), repeat=2, passes=("forward",))
    assert [r.input_shape for r in results] == [(2, 64, 6, 6), (2, 32, 12, 12), (2, 12, 24, 24)]
    assert [r.dtype for r in results] == ["float16"] * 3
    if importlib.util.find_spec("tqdm") is not None:
        assert "cupyconv tune" in capsys.readouterr().err
    # the last layer (12 input channels, 3 output channels) cannot use the tensor cores: its NCHW forward chooses
    # between the CUDA-core kernels, the tiled ones and the direct one
    assert results[2].sources == {"forward": "tuned"}
    assert results[2].choices["forward"].split(":")[0] in ("direct", "tiled")
    assert {v.split(":")[0] for v in results[2].times_ms["forward"]} == {"direct", "tiled"}


def test_explain_reports_the_tuned_kernels(tuned):
    (result,) = cupyconv.tune(WIDE[0], WIDE[1], dtype="float16", repeat=2, force=True)
    g = _geometry(WIDE)
    e = cupyconv.explain(WIDE[1], g.weight_shape, dtype="float16", **_kwargs(WIDE))
    for pass_ in TUNED_PASSES:
        v = tuning.Variant.parse(result.choices[pass_])
        assert e.pass_(pass_).variant == result.choices[pass_], "explain must show the tuned choice"
        plans = table.plan(pass_, v, g, "float16", "nchw", "strict", True, True,
                           core_device.get(0).sm_count).plans()
        main = [k for k in e.pass_(pass_).kernels if k.stage in ("main", "partial")][0]
        assert any(p.spec.constants == tuple(sorted(main.constants.items())) for p in plans), pass_


# --------------------------------------------------------------- every pick is right

def _run_variant(pass_, v, g, dtype, layout, precision, x, w, b, go):
    """Run one candidate of one pass on torch tensors, as the pass table plans it; returns its output."""
    def prep(t):
        t = t.to(dtype)
        return t.contiguous(memory_format=torch.channels_last) if layout == "nhwc" and t.dim() == 4 else t.contiguous()

    x, w, b, go = prep(x), w.to(dtype).contiguous(), b.to(dtype), prep(go)
    index = x.device.index
    launcher = launch.Launcher(index, torch.cuda.current_stream().cuda_stream, ct._scratch_allocator(x.device))
    memory_format = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    if pass_ == "forward":
        out = torch.full(g.output_shape, float("nan"), dtype=dtype, device="cuda").contiguous(
            memory_format=memory_format)
        pointers = (x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr())
    elif pass_ == "grad_input":
        out = torch.full(g.input_shape, float("nan"), dtype=dtype, device="cuda").contiguous(
            memory_format=memory_format)
        pointers = (go.data_ptr(), w.data_ptr(), out.data_ptr())
    else:
        out = torch.full(g.weight_shape, float("nan"), dtype=dtype, device="cuda")
        pointers = (x.data_ptr(), go.data_ptr(), out.data_ptr())
    aligned = all(p % 16 == 0 for p in pointers)
    plan = table.plan(pass_, v, g, DTYPE_NAMES[dtype], layout, precision, pass_ == "forward", aligned,
                      launcher.device.sm_count)
    with launch.watch() as seen:
        plan.run(launcher, pointers)
    assert {p for _, p in seen} == set(plan.plans()), f"{pass_} {v.name} launched other kernels"
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("layer", [THIN, WIDE], ids=["thin", "wide"])
def test_every_candidate_matches_float64(layer, case, layout, tuned):
    """The tuner may pick any candidate, so each one must be right on its own."""
    dtype, tf32 = case
    precision = "tf32" if tf32 else "strict"
    g = _geometry(layer)
    dt = DTYPE_NAMES[dtype]
    dev = core_device.get(0)
    x, w, b, go = _data(layer)
    y_ref, gi_ref, gw_ref = _reference(layer, x, w, b, go)
    wants = {"forward": y_ref, "grad_input": gi_ref, "grad_weight": gw_ref}
    tried = 0
    for pass_ in TUNED_PASSES:
        # an sm_90 GPU runs the fp16/bf16 passes on Hopper's wgmma kernels, and float32 (TF32 or 3xTF32) where
        # they take it, ahead of the GEMMs where the family leads (grad_weight: two taps or more a stride phase,
        # 3xTF32's wgmma.split_weight_leads; the float32 forward and grad_input: wgmma.tf32_leads), else racing them
        hopper = dev.arch == "90" and wgmma.eligible(g, dt, pass_, precision)
        assert hopper == (dev.arch == "90") or dt == "float32", "fp16/bf16 layers of 16 channels or more"
        first = wgmma.FAMILY if hopper and wgmma.FAMILY.leads(pass_, g, dt, layout, precision) else gemm.FAMILY
        fams = table.eligible(pass_, g, dt, layout, dev, precision)
        assert fams[0] is first and gemm.FAMILY in fams, "this GPU runs the tensor-core GEMMs"
        assert (wgmma.FAMILY in fams) == hopper
        cands = table.candidates(pass_, g, dt, layout, precision, dev)
        assert cands[0] == tuning.Variant(first.name)
        for v in cands:
            got = _run_variant(pass_, v, g, dtype, layout, precision, x, w, b, go)
            err = _rel_err(got, wants[pass_])
            assert err <= _bound(dtype, tf32), f"{pass_} {v.name}: error {err:.2e}"
            tried += 1
    assert tried >= 4


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_results_stay_correct_when_the_first_call_tunes(case, channels_last, tuned, timings):
    """A first call runs the heuristic while the other candidates build; the first call after they have built
    times them into the real outputs, then runs the winner last."""
    dtype, tf32 = case
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    layer = THIN
    g = _geometry(layer)
    x, w, b, go = _data(layer, seed=1)
    y_ref, gi_ref, gw_ref = _reference(layer, x, w, b, go)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    layout = "nhwc" if channels_last else "nchw"
    g_weight = _grad_weight_geometry(g, layout)
    assert g_weight.weight_channels_last is channels_last
    precision = ct._precision(DTYPE_NAMES[dtype])
    cupyconv.clear_cache()  # no candidate built yet in this process (CuPy's disk cache makes this quick)
    for call in range(3):
        xs = x.to(dtype).contiguous(memory_format=fmt).requires_grad_()
        ws, bs = w.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
        x_before = xs.detach().clone()
        y = ct.conv_transpose2d(xs, ws, bs, **_kwargs(layer))
        y.backward(go.to(dtype).contiguous(memory_format=fmt))
        torch.cuda.synchronize()
        assert torch.equal(xs.detach(), x_before), "tuning must not write into an input"
        for name, got, want in (("output", y, y_ref), ("grad_input", xs.grad, gi_ref), ("grad_weight", ws.grad,
                                                                                           gw_ref)):
            err = _rel_err(got, want)
            assert err <= _bound(dtype, tf32), f"call {call} {name}: error {err:.2e}"
        assert _rel_err(bs.grad, go.sum((0, 2, 3))) <= _bound(dtype, tf32)
        if call == 0:
            assert not timings, "a first call runs the heuristic while the other candidates build"
            assert all(v is None for v in _choices_in_process(g, DTYPE_NAMES[dtype], layout, precision,
                                                              g_weight).values())
            assert decide.settle(timeout=300)
        elif call == 1:
            assert len(timings) == 3, "the call after the candidates built times each of the three passes once"
    assert len(timings) == 3, "the third call must only look its choices up"
    picks = _choices_in_process(g, DTYPE_NAMES[dtype], layout, precision, g_weight)
    assert all(v is not None for v in picks.values())
    # the direct kernels race the GEMMs in both layouts, so which one wins is the GPU's to say;
    # every pick must be one of the pass's candidates
    dev = core_device.get(0)
    for pass_, v in picks.items():
        pass_g = g_weight if pass_ == "grad_weight" else g
        assert v in table.candidates(pass_, pass_g, DTYPE_NAMES[dtype], layout, precision, dev), (pass_, v)
    entries = json.loads((tuned / tuning.CACHE_FILE).read_text())["entries"]
    assert {e["variant"] for e in entries.values()} == {v.name for v in picks.values()}


def test_autotune_off_times_nothing(tuned, timings, monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    x, w, b, go = (t.half() for t in _data(THIN))
    ct.conv_transpose2d(x, w, b, **_kwargs(THIN))
    torch.cuda.synchronize()
    assert not timings and not (tuned / tuning.CACHE_FILE).exists()
    heuristic = tuning.Variant("wgmma") if core_device.get(0).arch == "90" else tuning.GEMM
    assert tuning.chosen("forward", _geometry(THIN), "float16", "nchw", "strict", 0) == heuristic


def test_pinned_candidates_run_and_are_right(tuned, timings):
    """pinned() makes a call run the given candidate (how the sanitizer reaches each one), times nothing
    and remembers nothing."""
    g = _geometry(THIN)
    dev = core_device.get(0)
    x, w, b, go = _data(THIN, seed=2)
    y_ref = _reference(THIN, x, w, b, go)[0]
    xs, ws, bs = x.half(), w.half(), b.half()
    cands = table.candidates("forward", g, "float16", "nchw", "strict", dev)
    assert len(cands) >= 2
    for v in cands:
        with decide.pinned({"forward": v}), launch.watch() as seen:
            y = ct.conv_transpose2d(xs, ws, bs, **_kwargs(THIN))
            torch.cuda.synchronize()
        planned = table.plan("forward", v, g, "float16", "nchw", "strict", True, True, dev.sm_count).plans()
        assert {p for _, p in seen} == set(planned), v.name
        err = _rel_err(y, y_ref)
        assert err <= _bound(torch.float16, False), f"{v.name}: error {err:.2e}"
    assert not timings and not (tuned / tuning.CACHE_FILE).exists()
    assert tuning.chosen("forward", g, "float16", "nchw", "strict", 0) is None


# --------------------------------------------------------------------- a fresh process

_FRESH = textwrap.dedent("""
    import json, sys
    import torch
    import cupyconv, cupyconv.torch as ct
    from cupyconv import tuning
    from cupyconv.tuning import decide
    from cupyconv.tuning.explicit import TUNED_PASSES

    def refuse(*args, **kwargs):
        raise AssertionError("timed again although the choice is stored")

    mode, shape = sys.argv[1], tuple(json.loads(sys.argv[2]))
    layer = dict(in_channels=32, out_channels=48, kernel_size=3, stride=2, padding=1, output_padding=1)
    if mode == "tune":
        print(json.dumps(cupyconv.tune(layer, shape, dtype="float16", repeat=2)[0].choices))
    else:
        decide._measure = refuse
        m = ct.ConvTranspose2d(**layer).cuda().half()
        x = torch.randn(shape, device="cuda", dtype=torch.half, requires_grad=True)
        m(x).sum().backward()
        torch.cuda.synchronize()
        w = m.weight
        from cupyconv.core.geometry import ConvParams, geometry
        g = geometry(shape, tuple(w.shape), None, ConvParams.from_args(2, 1, 1, 1, 1))
        print(json.dumps({p: tuning.chosen(p, g, "float16", "nchw", "strict", 0).name for p in TUNED_PASSES}))
""")


def test_persisted_choices_are_reused_by_a_fresh_process(tuned):
    env = {**os.environ, "PYTHONPATH": str(ROOT), tuning.AUTOTUNE_ENV: "1", tuning.CACHE_DIR_ENV: str(tuned)}

    def run(mode, shape):
        done = subprocess.run([sys.executable, "-c", _FRESH, mode, json.dumps(shape)], capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    tuned_choices = run("tune", list(THIN[1]))
    path = tuned / tuning.CACHE_FILE
    before = path.read_bytes()
    assert run("use", list(THIN[1])) == tuned_choices
    # a batch and image size in the same power-of-two bucket share the choice
    assert run("use", [4, 32, 15, 12]) == tuned_choices
    assert path.read_bytes() == before


# ------------------------------------------------------------------------- CUDA graphs

def test_no_tuning_while_capturing_a_cuda_graph(tuned, timings):
    torch.manual_seed(3)
    layer = ct.ConvTranspose2d(**THIN[0]).cuda().half()
    static_x = torch.randn(THIN[1], device="cuda", dtype=torch.half)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad(), decide.suspended():
        layer(static_x)  # compiles the heuristic's kernels, decides nothing
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = _geometry(THIN)
    assert tuning.chosen("forward", g, "float16", "nchw", "strict", 0) is None
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_y = layer(static_x)
    assert not timings, "a captured first call must not time candidates"
    assert not (tuned / tuning.CACHE_FILE).exists()
    assert tuning.chosen("forward", g, "float16", "nchw", "strict", 0) is None
    static_x.copy_(torch.randn(THIN[1], device="cuda", dtype=torch.half))
    graph.replay()
    torch.cuda.synchronize()
    want = F.conv_transpose2d(static_x.double(), layer.weight.double(), layer.bias.double(), **_kwargs(THIN))
    assert _rel_err(static_y, want) <= _bound(torch.float16, False)
    # out of capture, the first eager call hands the candidates to the compiler, and once they have built
    # the next one times them
    with torch.no_grad():
        layer(static_x)
        assert decide.settle(timeout=300)
        layer(static_x)
    torch.cuda.synchronize()
    assert len(timings) == 1 and (tuned / tuning.CACHE_FILE).exists()
