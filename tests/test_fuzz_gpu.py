"""Hypothesis-driven fuzzing of cupyconv.torch on random layers, against float64 torch on the GPU.

Each hypothesis example is a batch of random layers (kernel 1-11, stride 1-6, dilation 1-4,
padding up to dilation*(k-1), any valid output padding, groups up to depthwise, bias or
none, N 1-4 or unbatched, sizes 1-40), each in a random dtype and precision (strict
float32, TF32, float64, float16, bfloat16), with input, weight, bias and grad_output in
random layouts and views (contiguous, channels_last, strided, transposed, misaligned by
one element, stride 0).  Layers the tensor-core kernels can run also draw which of the
tuner's candidate kernels runs each pass.  The forward output and every requested
gradient are compared with float64 torch by ||ours - ref|| / ||ref||: float64 within 1e-11,
strict float32 within 1e-5, TF32/fp16/bf16 no worse than twice torch's own error in the
same dtype and layout (for TF32, at least the error of an exact product of TF32-rounded
operands, since cuDNN may compute float32 exactly).  Outputs are allocated from memory
that was just filled with NaN, so an element no kernel writes shows up as NaN.

Batches let one example compile all of its layers' kernels on a thread pool first.

Settings (environment):
  CUPYCONV_FUZZ_EXAMPLES  distinct layers to check (default 200; thousands for a soak run)
  CUPYCONV_FUZZ_BATCH     layers per hypothesis example (default 20)
  CUPYCONV_FUZZ_SEED      hypothesis seed (default 0; "random" for a fresh one each run)
  CUPYCONV_FUZZ_SHRINK    1: shrink a failing example (slow: every shrink step compiles)
  CUPYCONV_FUZZ_REPORT    path of a JSON summary (layers checked, coverage, worst errors)

A failing layer is reported as a ``FuzzCase(...)``; ``check_case(FuzzCase(...))`` in this
module reruns exactly that layer and data.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, Phase, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

F = torch.nn.functional

import cupyconv.torch as ct  # noqa: E402
from cupyconv import engine, tuning  # noqa: E402
from cupyconv.core import device  # noqa: E402
from cupyconv.plans import table  # noqa: E402
from cupyconv.plans.launch import Recorder  # noqa: E402
from cupyconv.jit.compiler import compile_many  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry, output_size  # noqa: E402
from layers import uses_gemm  # noqa: E402
from tf32 import round_tf32, tf32_allowed  # noqa: E402

EXAMPLES = int(os.environ.get("CUPYCONV_FUZZ_EXAMPLES", "200"))
BATCH = max(1, int(os.environ.get("CUPYCONV_FUZZ_BATCH", "20")))
SEED = os.environ.get("CUPYCONV_FUZZ_SEED", "0").strip()
SHRINK = os.environ.get("CUPYCONV_FUZZ_SHRINK", "0").strip() == "1"
REPORT = os.environ.get("CUPYCONV_FUZZ_REPORT")

MODES = ("float32", "tf32", "float64", "float16", "bfloat16")
TORCH_DTYPES = {"float32": torch.float32, "tf32": torch.float32, "float64": torch.float64,
                "float16": torch.float16, "bfloat16": torch.bfloat16}
ACTIVATION_VIEWS = ("contiguous", "channels_last", "sliced", "transposed", "offset", "offset_channels_last",
                    "expanded")
WEIGHT_VIEWS = ("contiguous", "channels_last", "sliced", "transposed", "offset")
BIAS_VIEWS = ("contiguous", "sliced", "offset", "expanded")
GRAD_SETS = ((True, True, True),) * 4 + ((True, False, False), (False, True, False), (False, False, True),
                                         (True, True, False), (False, True, True))
PASSES = ("forward", "grad_input", "grad_weight")
DEVICE = "cuda"
OUTPUTS = ("output", "grad_input", "grad_weight", "grad_bias")


@dataclass(frozen=True)
class FuzzCase:
    """One layer, its data and how it is laid out: everything needed to rerun it."""

    batch: Optional[int]                 # None: unbatched (C, H, W) input
    in_channels: int
    out_channels: int
    groups: int
    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    output_padding: Tuple[int, int]
    dilation: Tuple[int, int]
    bias: bool
    size: Tuple[int, int]
    mode: str                            # one of MODES
    x_view: str
    w_view: str
    b_view: str
    go_view: str
    grads: Tuple[bool, bool, bool]       # which of input, weight, bias require grad
    variants: Tuple[int, int, int]       # per pass, an index into the tuner's candidates
    seed: int

    def kwargs(self):
        return dict(stride=self.stride, padding=self.padding, output_padding=self.output_padding,
                    groups=self.groups, dilation=self.dilation)

    @property
    def input_shape(self):
        shape = (self.in_channels,) + self.size
        return shape if self.batch is None else (self.batch,) + shape

    @property
    def weight_shape(self):
        return (self.in_channels, self.out_channels // self.groups) + self.kernel

    @property
    def output_shape(self):
        out = tuple(output_size(self.size[a], self.kernel[a], self.stride[a], self.padding[a],
                                self.output_padding[a], self.dilation[a]) for a in range(2))
        shape = (self.out_channels,) + out
        return shape if self.batch is None else (self.batch,) + shape


# ------------------------------------------------------------------------ the strategy

@st.composite
def fuzz_cases(draw) -> FuzzCase:
    k = (draw(st.integers(1, 11)), draw(st.integers(1, 11)))
    s = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    d = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    op = tuple(draw(st.integers(0, max(s[a], d[a]) - 1)) for a in range(2))
    size = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    # padding up to dilation*(k-1), but small enough that the output keeps at least one row
    pad = tuple(draw(st.integers(0, min(d[a] * (k[a] - 1), ((size[a] - 1) * s[a] + d[a] * (k[a] - 1) + op[a]) // 2)))
                for a in range(2))
    shape = draw(st.sampled_from(("thin", "grouped", "depthwise", "lopsided", "gemm", "gemm")))
    if shape == "thin":
        groups, cin_g, cout_g = 1, draw(st.integers(1, 8)), draw(st.integers(1, 8))
    elif shape == "grouped":
        groups, cin_g, cout_g = draw(st.integers(2, 8)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    elif shape == "depthwise":
        groups, cin_g, cout_g = draw(st.integers(1, 32)), 1, draw(st.integers(1, 2))
    elif shape == "lopsided":  # one side wide enough for the tensor cores, the other not
        wide, thin = draw(st.sampled_from((16, 24, 40))), draw(st.integers(1, 8))
        groups = draw(st.integers(1, 2))
        cin_g, cout_g = (wide, thin) if draw(st.booleans()) else (thin, wide)
    else:
        groups = draw(st.integers(1, 2))
        cin_g, cout_g = draw(st.sampled_from((16, 24, 32, 40, 64))), draw(st.sampled_from((16, 24, 32, 40, 64)))
    batch = draw(st.sampled_from((None, 1, 2, 3, 4)))
    return FuzzCase(
        batch=batch, in_channels=cin_g * groups, out_channels=cout_g * groups, groups=groups, kernel=k, stride=s,
        padding=pad, output_padding=op, dilation=d, bias=draw(st.booleans()), size=size,
        mode=draw(st.sampled_from(MODES)), x_view=draw(st.sampled_from(ACTIVATION_VIEWS)),
        w_view=draw(st.sampled_from(WEIGHT_VIEWS)), b_view=draw(st.sampled_from(BIAS_VIEWS)),
        go_view=draw(st.sampled_from(ACTIVATION_VIEWS)), grads=draw(st.sampled_from(GRAD_SETS)),
        variants=tuple(draw(st.integers(0, 6)) for _ in PASSES), seed=draw(st.integers(0, 2 ** 31 - 1)))


def test_strategy_covers_the_required_space():
    """Runs without a GPU: the strategy only makes valid layers, and spans what the issue asks for."""
    seen = []

    @settings(max_examples=400, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_cases())
    def collect(case):
        g = geometry(case.input_shape, case.weight_shape, (case.out_channels,) if case.bias else None,
                     ConvParams.from_args(**case.kwargs()))
        assert g.user_shape(g.output_shape) == case.output_shape and min(g.out_size) >= 1
        for a in range(2):
            assert case.padding[a] <= case.dilation[a] * (case.kernel[a] - 1)
            assert case.output_padding[a] < max(case.stride[a], case.dilation[a])
        seen.append(case)

    collect()
    for a in range(2):
        assert {c.kernel[a] for c in seen} == set(range(1, 12))
        assert {c.stride[a] for c in seen} == set(range(1, 7))
        assert {c.dilation[a] for c in seen} == set(range(1, 5))
        sizes = {c.size[a] for c in seen}
        assert 1 in sizes and max(sizes) >= 36 and len(sizes) >= 30
        assert any(c.padding[a] == c.dilation[a] * (c.kernel[a] - 1) > 0 for c in seen)
        assert any(c.output_padding[a] == max(c.stride[a], c.dilation[a]) - 1 > 0 for c in seen)
    assert {c.batch for c in seen} == {None, 1, 2, 3, 4}
    assert {c.mode for c in seen} == set(MODES)
    assert {c.x_view for c in seen} == set(ACTIVATION_VIEWS) == {c.go_view for c in seen}
    assert {c.w_view for c in seen} == set(WEIGHT_VIEWS) and {c.b_view for c in seen} == set(BIAS_VIEWS)
    assert any(c.groups > 1 and c.in_channels == c.groups for c in seen)          # depthwise
    assert any(min(c.in_channels, c.out_channels) // c.groups >= 16 for c in seen)  # tensor-core layers
    assert any(c.bias for c in seen) and any(not c.bias for c in seen)
    assert {c.grads for c in seen} == set(GRAD_SETS)


# ----------------------------------------------------------------------------- the data

def _logical(shape, gen, constant_dim0: bool):
    t = torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.float64)
    if constant_dim0:
        t = t[:1].expand(shape).contiguous()
    return t


def _view(t64: torch.Tensor, dtype, kind: str) -> torch.Tensor:
    """``t64`` rounded to ``dtype`` and laid out as ``kind``; a fresh leaf each call."""
    base = t64.detach().to(dtype)
    four_d = base.dim() == 4
    if kind == "channels_last" and four_d:
        out = base.contiguous(memory_format=torch.channels_last)
    elif kind == "sliced":
        buf = torch.empty(base.shape[:-1] + (2 * base.shape[-1],), dtype=dtype, device=base.device)
        buf[..., ::2] = base
        out = buf[..., ::2]
    elif kind == "transposed" and base.dim() >= 2:
        out = base.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif kind in ("offset", "offset_channels_last"):
        # one element past an allocation: a pointer that is not 16-byte aligned
        if kind == "offset_channels_last" and four_d:
            src = base.permute(0, 2, 3, 1).contiguous()
        else:
            src = base.contiguous()
        flat = torch.empty(src.numel() + 1, dtype=dtype, device=base.device)
        flat[1:] = src.reshape(-1)
        out = flat[1:].view(src.shape)
        if kind == "offset_channels_last" and four_d:
            out = out.permute(0, 3, 1, 2)
    elif kind == "expanded":
        out = base[:1].expand(base.shape)
    else:
        out = base.contiguous()
    assert torch.equal(out, base)
    return out


def _aligned_for_torch(kind: str) -> str:
    """The view torch's own same-dtype run gets: misaligned views become aligned copies in the same layout.

    cuDNN 9.19 (torch 2.11) can fault with a sticky "misaligned address" on a float32
    channels_last input offset by one element under TF32, which would poison the CUDA
    context for every later layer.  Torch's error in a dtype and layout does not depend
    on where the data starts, so the bound is the same; cupyconv still gets the
    misaligned views.
    """
    return {"offset": "contiguous", "offset_channels_last": "channels_last"}.get(kind, kind)


def _run(fn, x, w, b, go, case: FuzzCase):
    """(output, grad_input, grad_weight, grad_bias) of ``fn``; None for gradients not asked for."""
    want = (case.grads[0], case.grads[1], case.grads[2] and b is not None)
    x.requires_grad_(want[0])
    w.requires_grad_(want[1])
    if b is not None:
        b.requires_grad_(want[2])
    y = fn(x, w, b, **case.kwargs())
    if any(want):
        y.backward(go)
    grads = (x.grad if want[0] else None, w.grad if want[1] else None, b.grad if want[2] else None)
    return (y.detach(),) + grads


def _rel_err(got, ref) -> float:
    got, ref = got.double(), ref.double()
    denom = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(got - ref))
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom


def _poison(shapes, dtype):
    """Fill the caching allocator's free blocks of these sizes with NaN, so unwritten outputs show."""
    blocks = [torch.full(s, float("nan"), dtype=dtype, device=DEVICE) for s in shapes]
    del blocks


def _geometry(case: FuzzCase):
    return geometry(case.input_shape, case.weight_shape, None, ConvParams.from_args(**case.kwargs()))


def _precision(case: FuzzCase) -> str:
    return "tf32" if case.mode == "tf32" else "strict"


def _dtype_name(case: FuzzCase) -> str:
    return "float32" if case.mode == "tf32" else case.mode


def _layout(case: FuzzCase, g, x, w) -> str:
    """The memory layout the engine runs ``x`` in, decided as cupyconv.torch decides it."""
    return ct._layout_for(x, w)


def _variants(case: FuzzCase, g, layout: str) -> dict:
    """The tuner candidate this case runs for each pass (the direct kernels where nothing else can)."""
    dt = _dtype_name(case)
    if not uses_gemm(g, dt, 0):
        return {}
    picked = {}
    for pass_, index in zip(PASSES, case.variants):
        cands = table.candidates(pass_, g, dt, layout, _precision(case), device.get(0))
        picked[pass_] = cands[index % len(cands)]
    return picked


def _specs(case: FuzzCase) -> list:
    """Kernels this case will launch, to compile ahead on a thread pool (a miss only costs time).

    The engine itself decides, on pointers as aligned as the real ones will be, on a
    recorder that notes each launch instead of making it.
    """
    g = _geometry(case)
    dt, precision, dtype = _dtype_name(case), _precision(case), TORCH_DTYPES[case.mode]

    def probe(shape, kind):
        return _view(torch.zeros(shape, dtype=torch.float64, device=DEVICE), dtype, kind)

    x, go, w_probe = (probe(shape, view) for shape, view in ((case.input_shape, case.x_view),
                                                            (case.output_shape, case.go_view),
                                                            (case.weight_shape, case.w_view)))
    layout = _layout(case, g, x, w_probe)
    g = g.with_weight_channels_last(ct._is_channels_last(w_probe))   # read in place, as the call will
    xp, gop = (ct._in_layout(t, layout).data_ptr() for t in (x, go))
    w, out = 1 << 20, 2 << 20
    recorder = Recorder(device.get(0))
    try:
        with tuning.pinned(_variants(case, g, layout)):
            engine.forward(g, dt, xp, w, out if case.bias else None, out, recorder, layout, precision)
            engine.grad_input(g, dt, gop, w, out, recorder, layout, precision)
            engine.grad_weight(g, dt, xp, gop, out, recorder, layout, precision)
            if case.bias:
                engine.grad_bias(g, dt, gop, out, recorder, layout)
    except Exception:  # planning here is only a head start: anything missed compiles on first use
        pass
    return [plan.spec for _, plan in recorder.launches]


# ---------------------------------------------------------------------------- the check

def _run_ours(case: FuzzCase, x, w, b, go, variants: dict, dtype):
    _poison([case.output_shape, case.input_shape, case.weight_shape, (case.out_channels,)], dtype)
    with tuning.pinned(variants):
        ours = _run(ct.conv_transpose2d, x, w, b, go, case)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    return ours


def check_case(case: FuzzCase) -> dict:
    """Run one case and assert it; returns its errors and bounds for the summary."""
    g = _geometry(case)
    dtype = TORCH_DTYPES[case.mode]
    gen = torch.Generator(device=DEVICE).manual_seed(case.seed)
    x64 = _logical(case.input_shape, gen, case.x_view == "expanded")
    w64 = _logical(case.weight_shape, gen, False)
    b64 = _logical((case.out_channels,), gen, case.b_view == "expanded") if case.bias else None
    go64 = _logical(case.output_shape, gen, case.go_view == "expanded")

    def data(views=lambda kind: kind):
        return (_view(x64, dtype, views(case.x_view)), _view(w64, dtype, views(case.w_view)),
                None if b64 is None else _view(b64, dtype, views(case.b_view)),
                _view(go64, dtype, views(case.go_view)))

    with tf32_allowed(case.mode == "tf32"):
        ref = _run(F.conv_transpose2d, x64.clone(), w64.clone(), None if b64 is None else b64.clone(), go64, case)
        floor = [0.0] * 4
        theirs = [None] * 4
        if case.mode in ("tf32", "float16", "bfloat16"):
            try:
                theirs = _run(F.conv_transpose2d, *data(_aligned_for_torch), case)
            except RuntimeError:  # torch has no kernel for this layout/dtype: fixed bounds below
                theirs = [None] * 4
            if case.mode == "tf32":
                rounded = _run(F.conv_transpose2d, round_tf32(x64), round_tf32(w64),
                               None if b64 is None else b64.clone(), round_tf32(go64), case)
                floor = [0.0 if r is None else _rel_err(a, r) for a, r in zip(rounded, ref)]
        x, w, b, go = data()
        layout = _layout(case, g, x, w)
        variants = _variants(case, g, layout)
        result = {"gemm": uses_gemm(g, _dtype_name(case), 0), "layout": layout,
                  "variants": {p: v.name for p, v in variants.items()}, "ratio": {}, "fallback": False}
        try:
            ours = _run_ours(case, x, w, b, go, variants, dtype)
        except Exception as exc:
            # The tuner skips candidates that fail to compile or launch, so a forced one that
            # does is not wrong results; the layer is then checked on the tuner's default.
            heuristic = _variants(dataclasses.replace(case, variants=(0, 0, 0)), g, layout)
            if variants == heuristic:
                raise
            result["fallback"] = f"{result['variants']}: {type(exc).__name__}: {exc}"[:400]
            variants = heuristic
            result["variants"] = {p: v.name for p, v in variants.items()}
            x, w, b, go = data()
            ours = _run_ours(case, x, w, b, go, variants, dtype)

    if ct._channels_last(x, w):
        out = ours[0]
        in_place = (out.is_contiguous(memory_format=torch.channels_last) if out.dim() == 4
                    else out.stride() == ct._unbatched_channels_last_strides(out.shape))
        assert in_place, f"{case}: output is not channels_last (strides {out.stride()})"
    for i, (name, o, r) in enumerate(zip(OUTPUTS, ours, ref)):
        if r is None:
            continue
        assert o is not None, f"{case}: {name} missing"
        assert o.dtype == dtype and tuple(o.shape) == tuple(r.shape), \
            f"{case}: {name} is {o.dtype} {tuple(o.shape)}, want {dtype} {tuple(r.shape)}"
        assert bool(torch.isfinite(o).all()), f"{case}: {name} has non-finite values (elements left unwritten?)"
        err = _rel_err(o, r)
        if case.mode == "float64":
            bound = 1e-11
        elif case.mode == "float32":
            bound = 1e-5
        elif theirs[i] is not None:
            # never below one correct rounding of the exact result into the dtype (eps / 2)
            bound = max(2 * max(_rel_err(theirs[i], r), floor[i]), torch.finfo(dtype).eps / 2)
        else:
            bound = {"tf32": 5e-3, "float16": 5e-3, "bfloat16": 3e-2}[case.mode]
        assert err <= bound, (f"{name}: ||ours - ref|| / ||ref|| = {err:.3e} > {bound:.3e} "
                              f"({'tensor cores ' + str(result['variants']) if result['gemm'] else 'direct'}, "
                              f"layout {layout})\nreproduce with check_case({case!r})")
        result["ratio"][name] = err / bound
    return result


# ------------------------------------------------------------------------------ the fuzz

@pytest.fixture
def heuristic_tuning(monkeypatch):
    # Layers the case does not force still must not spend the run timing candidates.
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")


@pytest.mark.gpu
def test_fuzz_random_layers_against_float64_torch(heuristic_tuning):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    # Hypothesis repeats earlier cases on purpose; repeats are skipped, and the budget of
    # examples is large enough that EXAMPLES distinct layers get checked.
    examples = 10 * max(1, math.ceil(EXAMPLES / BATCH))
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if SHRINK else [])
    stats = {"layers": 0, "unique": set(), "modes": Counter(), "paths": Counter(), "variants": Counter(),
             "views": Counter(), "worst": {}, "fallbacks": [], "repeats": 0, "started": time.time()}

    @settings(max_examples=examples, deadline=None, database=None, phases=phases, print_blob=True,
              derandomize=False, suppress_health_check=list(HealthCheck))
    @given(st.lists(fuzz_cases(), min_size=BATCH, max_size=BATCH))
    def fuzz(batch):
        if stats["layers"] >= EXAMPLES:
            return
        fresh = [case for case in dict.fromkeys(batch) if case not in stats["unique"]]
        stats["repeats"] += len(batch) - len(fresh)
        batch = fresh[:EXAMPLES - stats["layers"]]
        specs = [s for case in batch for s in _specs(case)]
        if specs:
            compile_many(specs, 0, workers=os.cpu_count() or 8)
        for case in batch:
            note(repr(case))
            result = check_case(case)
            stats["layers"] += 1
            stats["unique"].add(case)
            stats["modes"][case.mode] += 1
            stats["paths"][("gemm-" + result["layout"]) if result["gemm"] else "direct"] += 1
            for v in result["variants"].values():
                stats["variants"][v] += 1
            stats["views"][case.x_view] += 1
            if result["fallback"]:
                stats["fallbacks"].append(result["fallback"])
            for name, ratio in result["ratio"].items():
                key = f"{case.mode}/{name}"
                if ratio > stats["worst"].get(key, (0.0, ""))[0]:
                    stats["worst"][key] = (ratio, repr(case))

    if SEED.lower() != "random":
        fuzz = hypothesis.seed(int(SEED))(fuzz)
    failure = None
    try:
        fuzz()
    except BaseException as exc:
        failure = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _summarize(stats, failure)
    assert stats["layers"] >= EXAMPLES


def _summarize(stats: dict, failure: Optional[str]) -> None:
    summary = {"layers_checked": stats["layers"], "unique_layers": len(stats["unique"]),
               "repeats_skipped": stats["repeats"], "failures": 0 if failure is None else 1, "failure": failure,
               "seconds": round(time.time() - stats["started"], 1), "seed": SEED,
               "by_mode": dict(stats["modes"]), "by_path": dict(stats["paths"]),
               "by_variant": dict(stats["variants"]), "by_input_view": dict(stats["views"]),
               "forced_variants_that_could_not_run": stats["fallbacks"],
               "worst_error_over_bound": {k: {"ratio": round(r, 4), "case": c}
                                          for k, (r, c) in sorted(stats["worst"].items())}}
    brief = {k: summary[k] for k in ("layers_checked", "unique_layers", "failures", "seconds", "by_mode", "by_path")}
    brief["forced_variant_fallbacks"] = len(stats["fallbacks"])
    print("\ncupyconv fuzz: " + json.dumps(brief))
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump(summary, f, indent=1, default=str)


def test_failure_message_reproduces_the_case():
    """What a failure prints is enough to rebuild the very same case."""
    case = FuzzCase(2, 6, 4, 2, (3, 2), (2, 1), (1, 0), (1, 0), (1, 2), True, (5, 7), "float16", "sliced",
                    "transposed", "expanded", "offset_channels_last", (True, False, True), (1, 2, 3), 17)
    assert eval(repr(case), {"FuzzCase": FuzzCase}) == case
    assert asdict(case)["mode"] == "float16"
