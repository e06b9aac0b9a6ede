"""Benchmark cupyconv against PyTorch (cuDNN) in the same process.

``python -m cupyconv.bench`` times ``cupyconv.torch.conv_transpose2d`` and
``torch.nn.functional.conv_transpose2d`` through the same calls, for every layer x dtype x
layout: the forward pass under no_grad, and forward+backward through autograd (grad input,
grad weight and, with a bias, grad bias).  Each is timed with CUDA events, after a warm-up,
taking the median of repeated runs.  Torch is timed with cudnn.benchmark off and on and
the better of the two is the reference.  Next to the speedup each row gives cupyconv's
achieved TFLOP/s and the share of the measured device-to-device copy bandwidth that the
minimal bytes of the pass imply.

``--from-json`` reprints (and with ``--plot`` redraws) saved results without a GPU,
importing neither CuPy nor torch.  ``--models`` times training steps of published
architectures instead, original against converted (:mod:`cupyconv.model_bench`).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .core import dtypes
from .core.device import gpu_present
from .core.geometry import output_size
from .core.version import VERSION
from .cuda_timing import cuda_time_ms
from .tuning import settle as settle_tuning

PROG = "python -m cupyconv.bench"
# model_bench's models, named here so that the command line needs no torch import
MODEL_NAMES = ("dcgan_generator", "unet", "pix2pix_unet", "hifigan_generator")


@dataclass(frozen=True)
class BenchLayer:
    """One layer to benchmark: a ``ConvTranspose2d`` and the input batch and size it runs on.

    ``kernel``, ``stride``, ``padding``, ``dilation``, ``size`` (H, W) and
    ``output_padding`` are pairs; ``in_channels`` and ``out_channels`` are the module's.
    A ``one_d`` layer is a ``ConvTranspose1d`` along W (its pairs' first entries are 1 for
    kernel, stride, dilation and size, 0 for the paddings), timed through the 1-D functions.
    """

    name: str
    batch: int
    in_channels: int
    out_channels: int
    kernel: Tuple[int, int]
    stride: Tuple[int, int] = (1, 1)
    padding: Tuple[int, int] = (0, 0)
    dilation: Tuple[int, int] = (1, 1)
    groups: int = 1
    size: Tuple[int, int] = (8, 8)
    output_padding: Tuple[int, int] = (0, 0)
    bias: bool = True
    one_d: bool = False

    def __post_init__(self):
        if self.one_d and (self.kernel[0], self.stride[0], self.padding[0], self.dilation[0], self.size[0],
                           self.output_padding[0]) != (1, 1, 0, 1, 1, 0):
            raise ValueError(f"{self.name}: a 1-D layer runs along W, so its pairs must be (1, .) or (0, .) in H")

    def kwargs(self):
        """stride, padding, output_padding, groups and dilation, as keyword arguments of the layer's functional."""
        pick = (lambda pair: pair[1]) if self.one_d else (lambda pair: pair)
        return dict(stride=pick(self.stride), padding=pick(self.padding), output_padding=pick(self.output_padding),
                    groups=self.groups, dilation=pick(self.dilation))

    def spatial(self, pair) -> tuple:
        """A tensor's spatial shape: (H, W), or (L,) for a 1-D layer."""
        return tuple(pair[1:]) if self.one_d else tuple(pair)

    def functionals(self):
        """(torch's functional, cupyconv's) for this layer."""
        import torch.nn.functional as F

        from . import torch as cc_torch

        if self.one_d:
            return F.conv_transpose1d, cc_torch.conv_transpose1d
        return F.conv_transpose2d, cc_torch.conv_transpose2d

    def out_size(self) -> Tuple[int, int]:
        """The output's (H, W)."""
        return tuple(output_size(self.size[a], self.kernel[a], self.stride[a], self.padding[a],
                                 self.output_padding[a], self.dilation[a]) for a in range(2))


SEED_LAYERS = [
    BenchLayer("grouped_dilated", 16, 32, 64, (3, 5), (2, 3), (1, 2), (2, 1), 4, (128, 256), bias=False),
    BenchLayer("big_square", 8, 32, 32, (3, 3), size=(512, 1024)),
    BenchLayer("asym_kernel", 64, 64, 128, (3, 5), size=(128, 256)),
]

SUITE = SEED_LAYERS + [
    BenchLayer("dcgan_up", 64, 512, 256, (4, 4), (2, 2), (1, 1), size=(8, 8)),
    BenchLayer("unet_up2x2", 16, 256, 128, (2, 2), (2, 2), size=(64, 64)),
    BenchLayer("depthwise_up", 16, 128, 128, (4, 4), (2, 2), (1, 1), groups=128, size=(64, 64)),
    BenchLayer("outpad_up3x", 8, 64, 32, (3, 3), (3, 3), (1, 1), size=(96, 96), output_padding=(2, 2)),
    BenchLayer("batch1_latency", 1, 64, 64, (4, 4), (2, 2), (1, 1), size=(32, 32)),
    # audio upsamplers (vocoders): ConvTranspose1d along long sequences
    BenchLayer("vocoder_up8_1d", 16, 512, 256, (1, 16), (1, 8), (0, 4), size=(1, 8192), one_d=True),
    BenchLayer("audio_up2_1d", 16, 64, 32, (1, 4), (1, 2), (0, 1), size=(1, 16384), one_d=True),
]

# "tf32" is float32 tensors with TF32 allowed in torch (cuDNN and matmul) and in cupyconv;
# "float32" is strict float32 on both sides.
DTYPES = ("tf32", "float32", "float16", "bfloat16")
DTYPE_CHOICES = DTYPES + ("float64",)
ELEMENT_BYTES = {mode: dtypes.get("float32" if mode == "tf32" else mode).itemsize for mode in DTYPE_CHOICES}
LAYOUTS = ("nchw", "channels_last")
PASSES = ("forward", "forward+backward")
# grad input and grad weight each cost as many multiply-adds as the forward pass.
_PASS_FLOP_FACTOR = {"forward": 1, "forward+backward": 3}


# ----------------------------------------------------------------------------- work per pass

def _check_pass(pass_name: str) -> None:
    if pass_name not in PASSES:
        raise ValueError(f"unknown pass {pass_name!r}; choose from {PASSES}")


def layer_flops(layer: BenchLayer, pass_name: str) -> int:
    """FLOP of ``pass_name``: two per multiply-add, taps that land outside the output included."""
    _check_pass(pass_name)
    kh, kw = layer.kernel
    h, w = layer.size
    forward = 2 * layer.batch * layer.in_channels * (layer.out_channels // layer.groups) * h * w * kh * kw
    return forward * _PASS_FLOP_FACTOR[pass_name]


def layer_bytes(layer: BenchLayer, dtype: str, pass_name: str) -> int:
    """The fewest bytes ``pass_name`` can move: each operand read or written once per kernel."""
    _check_pass(pass_name)
    x = layer.batch * layer.in_channels * layer.size[0] * layer.size[1]
    w = layer.in_channels * (layer.out_channels // layer.groups) * layer.kernel[0] * layer.kernel[1]
    y = layer.batch * layer.out_channels * layer.out_size()[0] * layer.out_size()[1]
    b = layer.out_channels if layer.bias else 0
    elements = x + w + y + b
    if pass_name == "forward+backward":
        grad_input = y + w + x
        # grad bias reduces the grad_output that grad weight reads anyway: only its write counts.
        grad_weight = x + y + w + b
        elements += grad_input + grad_weight
    return elements * ELEMENT_BYTES[dtype]


def make_row(layer: BenchLayer, dtype: str, layout: str, pass_name: str, ms: Optional[float],
             torch_ms: Optional[float], copy_gbps: Optional[float], error: Optional[str] = None) -> dict:
    """One result row; the derived metrics are None where a time they need is missing."""
    seconds = None if ms is None else ms * 1e-3
    row = {"name": layer.name, "dtype": dtype, "layout": layout, "pass": pass_name, "ms": ms,
           "torch_ms": torch_ms,
           "speedup": None if ms is None or torch_ms is None else torch_ms / ms,
           "tflops": None if seconds is None else layer_flops(layer, pass_name) / seconds / 1e12,
           "bandwidth_pct": None if seconds is None or not copy_gbps
           else 100 * layer_bytes(layer, dtype, pass_name) / seconds / (copy_gbps * 1e9)}
    if error:
        row["error"] = error
    return row


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def case_rows(layer: BenchLayer, dtype: str, layout: str, setup: Callable[[], Callable[[str, str], float]],
              copy_gbps: Optional[float]) -> List[dict]:
    """Both passes of one (layer, dtype, layout) case.

    ``setup()`` allocates the case and returns ``time_pass(impl, pass_name)`` in ms, impl
    being "cupyconv" or "torch".  A failure (out of memory, an unsupported layer) becomes
    an error row instead of ending the run, so one bad case does not cost the others.
    """
    try:
        time_pass = setup()
    except Exception as exc:
        return [make_row(layer, dtype, layout, p, None, None, copy_gbps, f"setup: {_describe(exc)}")
                for p in PASSES]
    rows = []
    for pass_name in PASSES:
        times, errors = {}, []
        for impl in ("cupyconv", "torch"):
            try:
                times[impl] = time_pass(impl, pass_name)
            except Exception as exc:
                times[impl] = None
                errors.append(f"{impl}: {_describe(exc)}")
        rows.append(make_row(layer, dtype, layout, pass_name, times["cupyconv"], times["torch"], copy_gbps,
                             "; ".join(errors) or None))
    return rows


# ----------------------------------------------------------------------------- timing (GPU)

def copy_bandwidth_gbps(nbytes: int = 1 << 30, repeat: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting both the read and the write."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = functools.partial(dst.copy_, src)
    ms = cuda_time_ms(copy, repeat=repeat)
    del src, dst, copy
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _case_tensors(layer: BenchLayer, dtype: str, layout: str):
    """x, w, b and grad_output of one case, laid out as a torch user of that layout has them."""
    import torch

    dt = torch.float32 if dtype == "tf32" else getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(shape):
        return torch.randn(shape, generator=gen, device="cuda").to(dt)

    x = randn((layer.batch, layer.in_channels) + layer.spatial(layer.size))
    w = randn((layer.in_channels, layer.out_channels // layer.groups) + layer.spatial(layer.kernel))
    b = randn((layer.out_channels,)) if layer.bias else None
    go = randn((layer.batch, layer.out_channels) + layer.spatial(layer.out_size()))
    if layout == "channels_last":
        # model.to(memory_format=torch.channels_last) converts the weights too.
        x, w, go = (t.contiguous(memory_format=torch.channels_last) for t in (x, w, go))
    return x, w, b, go


def _pass_fn(conv, layer: BenchLayer, pass_name: str, x, w, b, go) -> Callable[[], None]:
    """One call of ``pass_name`` through ``conv``, an F.conv_transpose2d-like function."""
    import torch

    kwargs = layer.kwargs()
    if pass_name == "forward":
        def forward():
            with torch.no_grad():
                conv(x, w, b, **kwargs)
        return forward
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    br = None if b is None else b.detach().requires_grad_()
    leaves = [t for t in (xr, wr, br) if t is not None]

    def forward_backward():
        # As zero_grad(set_to_none=True) does in training: no accumulation kernels get timed.
        for t in leaves:
            t.grad = None
        conv(xr, wr, br, **kwargs).backward(go)
    return forward_backward


def _torch_ms(layer: BenchLayer, pass_name: str, tensors, repeat: int) -> float:
    """torch's time: the better of cudnn.benchmark off and on."""
    import torch

    times = []
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        times.append(cuda_time_ms(_pass_fn(layer.functionals()[0], layer, pass_name, *tensors), repeat=repeat))
    return min(times)


def _case_timer(layer: BenchLayer, dtype: str, layout: str, repeat: int) -> Callable[[str, str], float]:
    tensors = _case_tensors(layer, dtype, layout)

    def time_pass(impl: str, pass_name: str) -> float:
        if impl == "torch":
            return _torch_ms(layer, pass_name, tensors, repeat)
        fn = _pass_fn(layer.functionals()[1], layer, pass_name, *tensors)
        fn()
        # The first call hands the tuner's candidates to the background compiler; the warm-up
        # call after they have built times them, so the timed calls run the choice.
        settle_tuning()
        return cuda_time_ms(fn, repeat=repeat)
    return time_pass


def _resolve_dtype(dtype: str, allow_tf32: Optional[bool]) -> str:
    """The row's dtype name, where an explicit allow_tf32 decides between tf32 and strict float32."""
    if allow_tf32 is None or dtype not in ("tf32", "float32"):
        return dtype
    return "tf32" if allow_tf32 else "float32"


def run(layers: List[BenchLayer], dtype: Union[str, Sequence[str]] = "float32", repeat: int = 20,
        allow_tf32: Optional[bool] = None, progress: bool = True, layouts: Sequence[str] = ("nchw",),
        copy_gbps: Optional[float] = None) -> List[dict]:
    """Time every layer x dtype x layout, both passes; one row each, in that order.

    ``dtype`` is one name of DTYPE_CHOICES or a sequence of them.  ``allow_tf32``, when
    given, runs float32 and tf32 alike with TF32 on (True) or off (False), and the rows are
    named for what ran.  ``copy_gbps`` is measured here unless given.  RuntimeError without
    a CUDA GPU.
    """
    dtypes = list(dict.fromkeys(_resolve_dtype(d, allow_tf32)
                                for d in ([dtype] if isinstance(dtype, str) else dtype)))
    unknown = [d for d in dtypes if d not in DTYPE_CHOICES]
    if unknown:
        raise ValueError(f"unknown dtype {unknown}; choose from {DTYPE_CHOICES}")
    if set(layouts) - set(LAYOUTS):
        raise ValueError(f"unknown layout {sorted(set(layouts) - set(LAYOUTS))}; choose from {LAYOUTS}")
    require_gpu()
    import torch

    if copy_gbps is None:
        copy_gbps = copy_bandwidth_gbps()
    # 1-D tensors have no channels_last
    cases = [(layer, dt, layout) for layer, dt, layout in itertools.product(layers, dtypes, layouts)
             if not (layer.one_d and layout == "channels_last")]
    try:
        from tqdm import tqdm
        iterator = tqdm(cases, desc="bench", unit="case", disable=not progress)
    except ImportError:
        iterator = cases
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.benchmark)
    rows = []
    try:
        for layer, dt, layout in iterator:
            if hasattr(iterator, "set_postfix_str"):
                iterator.set_postfix_str(f"{layer.name} {dt} {layout}")
            # cupyconv.torch reads the cuDNN flag to decide, so one setting governs both sides.
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = dt == "tf32"
            rows += case_rows(layer, dt, layout, lambda: _case_timer(layer, dt, layout, repeat), copy_gbps)
            torch.cuda.empty_cache()
    finally:
        (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
         torch.backends.cudnn.benchmark) = saved
    return rows


def host_cost(calls: int = 1000, rounds: int = 7) -> List[dict]:
    """Per-call host time (µs) of cupyconv.torch against F.conv_transpose2d on a tiny layer.

    The layer is small enough that the GPU finishes each kernel faster than the host can
    issue the next, so wall time over many unsynchronised calls measures the host path.
    The two take turns for ``rounds`` rounds of ``calls`` calls, and each keeps its fastest
    round: other work on the host only ever adds time, so the minimum is the best estimate of
    the path's own cost, and taking turns exposes both to the same moments.  RuntimeError
    without a CUDA GPU.
    """
    require_gpu()
    import time

    import torch
    import torch.nn.functional as F

    from . import torch as cc_torch

    x = torch.randn(1, 8, 8, 8, device="cuda", requires_grad=True)
    w = torch.randn(8, 8, 3, 3, device="cuda", requires_grad=True)
    b = torch.randn(8, device="cuda", requires_grad=True)
    go = torch.randn(1, 8, 17, 17, device="cuda")

    def per_call_us(fn) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    rows = []
    for label, mode in (("forward, no_grad", "nograd"), ("forward, autograd", "grad"),
                        ("forward+backward", "backward")):
        timings: Dict[str, List[float]] = {"torch": [], "cupyconv": []}
        for _ in range(rounds):
            for name, conv in (("torch", F.conv_transpose2d), ("cupyconv", cc_torch.conv_transpose2d)):
                def call(conv=conv):
                    if mode == "nograd":
                        with torch.no_grad():
                            conv(x, w, b, stride=2)
                    elif mode == "grad":
                        conv(x, w, b, stride=2)
                    else:
                        conv(x, w, b, stride=2).backward(go)
                timings[name].append(per_call_us(call))
        torch_us, ours_us = min(timings["torch"]), min(timings["cupyconv"])
        rows.append(dict(call=label, torch_us=torch_us, cupyconv_us=ours_us, ratio=ours_us / torch_us))
    return rows


def require_gpu() -> None:
    """RuntimeError naming what is missing unless torch and CuPy both see a CUDA GPU."""
    try:
        import torch
    except ImportError:
        raise RuntimeError("the benchmark needs torch: pip install 'cupyconv[bench]'") from None
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device"
        raise RuntimeError(f"the benchmark needs a CUDA GPU, and torch {torch.__version__} sees none ({build}); "
                           f"--from-json PATH reports saved results without one")
    if not gpu_present():
        raise RuntimeError("the benchmark needs CuPy with a CUDA GPU: pip install 'cupyconv[cuda12]' "
                           "(or cuda13)")


def project_commit() -> Tuple[Optional[str], Optional[bool]]:
    """(short commit, uncommitted changes) of the checkout cupyconv runs from, or (None, None).

    Only the project's own repository counts: a copy of the package inside some other git
    repository records no commit rather than that repository's.
    """
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root or not (root / "cupyconv").is_dir():
            return None, None
        return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, None


def run_commit() -> Tuple[Optional[str], Optional[bool]]:
    """``CUPYCONV_COMMIT`` if set (a copy of the project without its git history), else :func:`project_commit`."""
    given = os.environ.get("CUPYCONV_COMMIT") or None
    return (given, None) if given else project_commit()


def where_this_runs() -> str:
    """One line naming the GPU (or its absence) and the commit, for outputs a reader keeps.

    Needs neither torch nor a GPU.
    """
    if gpu_present():
        from .core import device as _device

        dev = _device.get(0)
        where = f"{dev.name} (sm_{dev.arch})"
    else:
        where = "no CUDA GPU: the float64 NumPy reference"
    commit, dirty = run_commit()
    return f"ran on {where}, cupyconv {VERSION} at commit {commit_text(dict(commit=commit, dirty=dirty))}"


def environment() -> dict:
    """The device name, torch, CuPy and cuDNN versions, and the commit of this run: ``CUPYCONV_COMMIT``
    if set, else the project's own checkout (with ``dirty`` for uncommitted changes), else none."""
    import cupy
    import torch

    commit, dirty = run_commit()
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cupy=cupy.__version__,
                cudnn=torch.backends.cudnn.version(), commit=commit, dirty=dirty)


# ----------------------------------------------------------------------------- reporting

def _geomean(values) -> Optional[float]:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def geomean_speedups(rows: List[dict]) -> Dict[str, Optional[float]]:
    """Geometric mean speedup overall and per pass, over the rows that have one."""
    timed = [r for r in rows if r.get("speedup")]
    means = {"overall": _geomean(r["speedup"] for r in timed)}
    for pass_name in PASSES:
        means[pass_name] = _geomean(r["speedup"] for r in timed if r["pass"] == pass_name)
    return means


def _cell(value: Optional[float], width: int, fmt: str, suffix: str = "") -> str:
    return f"{'-':>{width}}" if value is None else f"{format(value, fmt) + suffix:>{width}}"


def format_table(rows: List[dict]) -> str:
    """The rows as a text table, ending with the geometric mean speedups."""
    lines = [f"{'layer':<18} {'dtype':<8} {'layout':<13} {'pass':<16} {'cupyconv ms':>11} {'torch ms':>9} "
             f"{'speedup':>8} {'TFLOP/s':>8} {'%copy-BW':>8}"]
    for r in rows:
        line = (f"{r['name']:<18} {r['dtype']:<8} {r.get('layout', 'nchw'):<13} {r['pass']:<16} "
                f"{_cell(r['ms'], 11, '.3f')} {_cell(r['torch_ms'], 9, '.3f')} "
                f"{_cell(r.get('speedup'), 8, '.2f', 'x')} {_cell(r.get('tflops'), 8, '.2f')} "
                f"{_cell(r.get('bandwidth_pct'), 8, '.1f')}")
        if r.get("error"):
            # torch's out-of-memory message runs over several lines; the JSON keeps all of it.
            line += f"  error: {r['error'].splitlines()[0]}"
        lines.append(line)
    means = geomean_speedups(rows)
    if means["overall"] is None:
        lines.append("geomean speedup: n/a (no row has both times)")
    else:
        per_pass = ", ".join(f"{p} {means[p]:.2f}x" for p in PASSES if means[p] is not None)
        lines.append(f"geomean speedup: {means['overall']:.2f}x overall ({per_pass})")
    failed = sum(1 for r in rows if r.get("error"))
    if failed:
        lines[-1] += f"; {failed} of {len(rows)} rows failed"
    return "\n".join(lines)


# A row is reported against a baseline run when its speedup fell below this share of the baseline's.
SLOWER_THAN_BASELINE = 0.95


def _case(row: dict) -> tuple:
    return row["name"], row["dtype"], row.get("layout", "nchw"), row["pass"]


def baseline_changes(rows: List[dict], baseline_rows: List[dict],
                     slower_than: float = SLOWER_THAN_BASELINE) -> dict:
    """The rows against an earlier run's (the same cases, matched by layer, dtype, layout and pass).

    Returns the number of cases both runs timed (``matched``), those only one of them has or
    timed (``unmatched``), the geometric mean speedups of the matched cases then and now, and
    ``slower``: (row, baseline row) for each case whose speedup fell below ``slower_than`` of
    the baseline's, the largest fall first.
    """
    then = {_case(r): r for r in baseline_rows if r.get("speedup")}
    now = {_case(r): r for r in rows if r.get("speedup")}
    both = [case for case in now if case in then]
    slower = [(now[c], then[c]) for c in both if now[c]["speedup"] < slower_than * then[c]["speedup"]]
    slower.sort(key=lambda pair: pair[0]["speedup"] / pair[1]["speedup"])
    return dict(matched=len(both), unmatched=len(set(now) ^ set(then)),
                geomean_then=_geomean(then[c]["speedup"] for c in both),
                geomean_now=_geomean(now[c]["speedup"] for c in both), slower=slower)


def format_baseline(changes: dict, baseline_env: dict, slower_than: float = SLOWER_THAN_BASELINE) -> str:
    """``baseline_changes`` as text: the geometric means then and now, then each slower case."""
    head = f"against the baseline at commit {commit_text(baseline_env)}: {changes['matched']} cases in both"
    if changes["unmatched"]:
        head += f", {changes['unmatched']} in one run only"
    if not changes["matched"]:
        return head + "; nothing to compare"
    lines = [head + f"; geomean speedup {changes['geomean_then']:.2f}x -> {changes['geomean_now']:.2f}x; "
                    f"{len(changes['slower'])} below {slower_than:.2f} of their baseline speedup"]
    if changes["slower"]:
        lines.append(f"  {'layer':<18} {'dtype':<8} {'layout':<13} {'pass':<16} {'speedup':>15} "
                     f"{'cupyconv ms':>17} {'torch ms':>17}")
    for row, base in changes["slower"]:
        lines.append(f"  {row['name']:<18} {row['dtype']:<8} {row.get('layout', 'nchw'):<13} {row['pass']:<16} "
                     f"{base['speedup']:>6.2f} -> {row['speedup']:<5.2f} {base['ms']:>8.3f} -> {row['ms']:<6.3f} "
                     f"{base['torch_ms']:>8.3f} -> {row['torch_ms']:.3f}")
    return "\n".join(lines)


def commit_text(env: dict) -> str:
    """The commit of a run as a report shows it: none, or the hash, marked when the checkout was dirty."""
    return f"{env.get('commit') or 'none'}{' (dirty)' if env.get('dirty') else ''}"


def format_header(env: dict) -> str:
    """One line naming the device, versions, commit and copy bandwidth of a run."""
    copy = env.get("copy_gbps")
    return (f"device {env.get('device')}, torch {env.get('torch')}, cupy {env.get('cupy')}, "
            f"cudnn {env.get('cudnn')}, commit {commit_text(env)}, "
            f"copy bandwidth {'n/a' if copy is None else f'{copy:.0f} GB/s'}")


def write_results(path: Path, env: dict, rows: List[dict]) -> None:
    """Save a run as JSON: the ``environment()`` fields plus ``rows``; ``load_results`` reads it back."""
    Path(path).write_text(json.dumps({**env, "rows": rows}, indent=1))


def load_results(path: Path) -> Tuple[dict, List[dict]]:
    """The environment and rows of a file written by ``write_results``; ValueError for anything else."""
    data = json.loads(Path(path).read_text())
    rows = data.pop("rows", None) if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"name", "dtype", "pass"} <= set(r)
                                             for r in rows):
        raise ValueError(f"{path} holds no benchmark rows")
    return data, rows


# Fields that must agree between result files merged into one report.
SAME_RUN_FIELDS = ("device", "commit", "dirty", "torch", "cupy", "cudnn")


def merge_results(parts: Sequence[Tuple[dict, List[dict]]]) -> Tuple[dict, List[dict]]:
    """One report from several runs of the same code on the same device (say, one per dtype, to fit a
    time limit): the first run's environment, every run's rows, and a case measured twice kept once
    (the later run's).  ValueError naming the field where two runs differ."""
    env, merged = dict(parts[0][0]), {}
    for other, rows in parts:
        for field in SAME_RUN_FIELDS:
            if other.get(field) != env.get(field):
                raise ValueError(f"the results come from different runs: {field} {env.get(field)!r} "
                                 f"against {other.get(field)!r}")
        for r in rows:
            merged[(r["name"], r["dtype"], r.get("layout", "nchw"), r["pass"])] = r
    return env, list(merged.values())


def select_rows(rows: List[dict], names: Optional[Sequence[str]] = None, dtypes: Optional[Sequence[str]] = None,
                layouts: Optional[Sequence[str]] = None) -> List[dict]:
    """The rows matching every selection that is given (None selects all)."""
    return [r for r in rows
            if (names is None or r["name"] in names) and (dtypes is None or r["dtype"] in dtypes)
            and (layouts is None or r.get("layout", "nchw") in layouts)]


def layer_label(name: str) -> str:
    """A suite layer's name over its shape (input, output channels, kernel, stride); other names alone."""
    layer = next((layer for layer in SUITE if layer.name == name), None)
    if layer is None:
        return name

    def dims(pair):
        return "×".join(str(v) for v in layer.spatial(pair))
    groups = f" g{layer.groups}" if layer.groups > 1 else ""
    return (f"{name}\n{layer.batch}×{layer.in_channels}×{dims(layer.size)} → {layer.out_channels}, "
            f"k{dims(layer.kernel)} s{dims(layer.stride)}{groups}")


def plot_speedups(env: dict, rows: List[dict], path: Path) -> None:
    """A bar chart of the speedup per layer, one bar per dtype/layout, a panel per pass.

    The titles give the geometric means, the labels each layer's shape.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    names = list(dict.fromkeys(r["name"] for r in rows))
    series = list(dict.fromkeys((r["dtype"], r.get("layout", "nchw")) for r in rows))
    passes = [p for p in PASSES if any(r["pass"] == p for r in rows)]
    speedup = {(r["name"], r["dtype"], r.get("layout", "nchw"), r["pass"]): r.get("speedup") for r in rows}
    colors = {d: f"C{i}" for i, d in enumerate(dict.fromkeys(d for d, _ in series))}
    hatches = {layout: "" if i == 0 else "//" for i, layout in enumerate(dict.fromkeys(lay for _, lay in series))}

    means = geomean_speedups(rows)
    known = [s for s in speedup.values() if s]
    low, high = min(known + [1.0]) / 1.3, max(known + [1.0]) * 1.3
    height = 0.8 / max(len(series), 1)
    legend_rows = math.ceil(len(series) / 4)
    fig_height = 1.8 + 0.2 * legend_rows + len(names) * max(0.5, 0.22 * len(series))
    fig = Figure(figsize=(5.5 * max(len(passes), 1), fig_height))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(len(passes), 1), sharey=True, squeeze=False)[0]
    for ax, pass_name in zip(axes, passes):
        for j, (dtype, layout) in enumerate(series):
            for i, name in enumerate(names):
                y = i + (j - (len(series) - 1) / 2) * height
                s = speedup.get((name, dtype, layout, pass_name))
                if s:
                    # Bars grow from 1x, so slowdowns and speedups point opposite ways on the log axis.
                    ax.barh(y, s - 1.0, left=1.0, height=height, color=colors[dtype], hatch=hatches[layout],
                            edgecolor="white", linewidth=0.5)
                elif (name, dtype, layout, pass_name) in speedup:
                    ax.text(1.0, y, " failed", va="center", fontsize=6, color="gray")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlim(low, high)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        mean = means.get(pass_name)
        ax.set_title(pass_name if mean is None else f"{pass_name}: geomean {mean:.2f}x")
        ax.set_xlabel("speedup over torch (torch ms / cupyconv ms)")
        ax.grid(axis="x", which="major", linewidth=0.3)
    axes[0].set_yticks(range(len(names)))
    axes[0].set_yticklabels([layer_label(name) for name in names], fontsize=6.5)
    axes[0].invert_yaxis()
    fig.legend(handles=[Patch(facecolor=colors[d], hatch=hatches[lay], edgecolor="white", label=f"{d}, {lay}")
                        for d, lay in series], loc="lower center", ncol=min(len(series), 4), fontsize=8,
               frameon=False)
    overall = "" if means["overall"] is None else f": geomean {means['overall']:.2f}x"
    fig.suptitle(f"cupyconv vs torch (cuDNN){overall}, {env.get('device', 'unknown device')}, "
                 f"commit {commit_text(env)}")
    # Room in inches for the legend below and the title above, whatever the figure's height.
    fig.tight_layout(rect=(0, (0.1 + 0.2 * legend_rows) / fig_height, 1, 1 - 0.3 / fig_height))
    fig.savefig(path, dpi=150)


# ----------------------------------------------------------------------------- command line

def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The parsed command line, plus the resolved ``dtypes``, ``layouts`` and ``layers``."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cupyconv {VERSION}")
    parser.add_argument("--suite", choices=("seeds", "all"), default="all",
                        help="the layers to run: the seed layers only, or all (default: all)")
    parser.add_argument("--layer", action="append", metavar="NAME",
                        help=f"only this layer (repeatable); one of {', '.join(layer.name for layer in SUITE)}")
    parser.add_argument("--dtype", action="append", choices=DTYPE_CHOICES,
                        help=f"only this dtype (repeatable; default: {' '.join(DTYPES)})")
    parser.add_argument("--layout", action="append", choices=LAYOUTS,
                        help="only this memory layout (repeatable; default: both)")
    parser.add_argument("--repeat", type=positive_int, default=20,
                        help="timed runs per measurement, of which the median is kept (default: 20)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results here (default: not written)")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="draw the speedups into this image, needs matplotlib (default: no plot)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (default: one is shown)")
    parser.add_argument("--baseline", type=Path, metavar="PATH", action="append",
                        help="an earlier run's --json file (repeat it to merge one run's files) of the same device: "
                             "after the table, list the selected cases whose speedup fell below "
                             f"{SLOWER_THAN_BASELINE} of the baseline's (default: no comparison)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--from-json", type=Path, metavar="PATH", action="append",
                        help="report saved results instead of measuring; needs no GPU; repeat it to merge runs "
                             "of one commit on one device (say, one per dtype) into one report")
    source.add_argument("--host-cost", action="store_true",
                        help="measure per-call host time against F.conv_transpose2d instead")
    source.add_argument("--models", action="store_true",
                        help="time training steps of published models, original against converted, instead")
    parser.add_argument("--model", action="append", choices=MODEL_NAMES,
                        help="with --models: only this model (repeatable; default: all)")
    parser.add_argument("--per-layer", action="store_true",
                        help="with --models: also time each model's transposed convolutions on their own")
    args = parser.parse_args(argv)
    if args.model and not args.models:
        parser.error("--model selects models of --models")
    if args.per_layer and not args.models:
        parser.error("--per-layer breaks down the models of --models")
    if args.baseline and (args.models or args.host_cost):
        parser.error("--baseline compares suite runs, not --models or --host-cost")
    args.dtypes = list(dict.fromkeys(args.dtype or DTYPES))
    args.layouts = list(dict.fromkeys(args.layout or LAYOUTS))
    suite = SEED_LAYERS if args.suite == "seeds" else SUITE
    # Saved results may hold layers of any name, so only a measured run checks them.
    unknown = sorted(set(args.layer or ()) - {layer.name for layer in suite})
    if unknown and args.from_json is None:
        parser.error(f"no layer {', '.join(unknown)} in suite {args.suite}; "
                     f"choose from {', '.join(layer.name for layer in suite)}")
    args.layers = [layer for layer in suite if args.layer is None or layer.name in args.layer]
    # Fail before a long GPU run, not after it.
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib (pip install 'cupyconv[bench]')")
    return args


def positive_int(text: str) -> int:
    """An argparse type: a positive int, else the command line's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _fail(message: str) -> None:
    """One line on stderr and exit status 2, as argparse does for a bad command line."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _saved_results(paths: Sequence[Path]) -> Tuple[dict, List[dict]]:
    """The merged report of saved result files; a one-line error and status 2 for a file that is not one."""
    parts = []
    for path in paths:
        try:
            parts.append(load_results(path))
        except OSError as exc:
            _fail(f"cannot read {path}: {exc.strerror or exc}")
        except (ValueError, KeyError, TypeError, AttributeError):
            _fail(f"{path} is not a results file written by --json")
    try:
        return merge_results(parts)
    except ValueError as exc:
        _fail(str(exc))


def _check_baseline_device(baseline: Optional[Tuple[dict, List[dict]]], env: dict) -> None:
    """Timings compare only on one kind of device: a baseline from another is refused."""
    if baseline is not None and baseline[0].get("device") != env.get("device"):
        _fail(f"the baseline ran on {baseline[0].get('device')}, these results on {env.get('device')}: "
              "compare runs of one device")


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m cupyconv.bench``: measure (or load with ``--from-json``), print the table, write JSON and plot."""
    args = parse_args(argv)
    if args.from_json is None:
        try:
            require_gpu()
        except RuntimeError as exc:
            _fail(str(exc))
    if args.models:
        from . import model_bench

        env = environment()
        print(f"device {env['device']}, torch {env['torch']}, cupy {env['cupy']}, commit {commit_text(env)}")
        names = args.model or model_bench.MODELS
        rows = model_bench.run(names, repeat=args.repeat)
        print(model_bench.format_table(rows))
        if args.json:
            write_results(args.json, env, rows)
        if args.per_layer:
            layer_rows = [r for name in names for mode in model_bench.MODES
                          for r in model_bench.layer_rows(name, mode, args.repeat)]
            print(model_bench.format_layer_table(layer_rows))
            if args.json:
                write_results(args.json.with_name(args.json.stem + "_layers.json"), env, layer_rows)
        return
    if args.host_cost:
        env = environment()
        print(f"device {env['device']}, torch {env['torch']}, cupy {env['cupy']}, commit {commit_text(env)}")
        print(f"{'call (tiny layer)':<20} {'torch us':>9} {'cupyconv us':>12} {'ratio':>6}")
        rows = host_cost()
        for r in rows:
            print(f"{r['call']:<20} {r['torch_us']:>9.1f} {r['cupyconv_us']:>12.1f} {r['ratio']:>6.2f}")
        if args.json:
            write_results(args.json, env, rows)
        return
    # Read and checked before a long GPU run, so that a bad file fails first.
    baseline = _saved_results(args.baseline) if args.baseline else None
    if args.from_json:
        env, rows = _saved_results(args.from_json)
        _check_baseline_device(baseline, env)
        rows = select_rows(rows, args.layer, args.dtype, args.layout)
    else:
        env = environment()
        _check_baseline_device(baseline, env)
        env["copy_gbps"] = copy_bandwidth_gbps()
        rows = run(args.layers, args.dtypes, args.repeat, progress=not args.no_progress, layouts=args.layouts,
                   copy_gbps=env["copy_gbps"])
    print(format_header(env))
    print(format_table(rows))
    if baseline is not None:
        then = select_rows(baseline[1], args.layer, args.dtype, args.layout)
        print(format_baseline(baseline_changes(rows, then), baseline[0]))
    if args.json:
        write_results(args.json, env, rows)
    if args.plot:
        plot_speedups(env, rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
