"""Benchmark cupyconv against PyTorch (cuDNN) in the same process.

``python -m cupyconv.bench`` times ``cupyconv.torch.conv_transpose2d`` and
``torch.nn.functional.conv_transpose2d`` through the same calls: the forward pass under
no_grad, and forward+backward through autograd (grad input, grad weight and, with a bias,
grad bias).  Each is timed with CUDA events, after a warm-up,
taking the median of repeated runs.  Torch is timed with cudnn.benchmark off and on and
the better of the two is the reference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple


@dataclass(frozen=True)
class BenchLayer:
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

    def kwargs(self):
        return dict(stride=self.stride, padding=self.padding, output_padding=self.output_padding,
                    groups=self.groups, dilation=self.dilation)


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
]


def cuda_time_ms(fn: Callable[[], None], warmup: int = 3, repeat: int = 20) -> float:
    """Median milliseconds of ``fn`` over ``repeat`` runs, timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _pass_times(conv, layer: BenchLayer, x, w, b, go, repeat: int) -> Tuple[float, float]:
    """Forward (no grad) and forward+backward times of ``conv``, an F.conv_transpose2d-like function."""
    import torch

    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    br = None if b is None else b.detach().requires_grad_()

    def fwd():
        with torch.no_grad():
            conv(x, w, b, **layer.kwargs())

    def fwd_bwd():
        conv(xr, wr, br, **layer.kwargs()).backward(go)

    return cuda_time_ms(fwd, repeat=repeat), cuda_time_ms(fwd_bwd, repeat=repeat)


def _torch_times(layer: BenchLayer, x, w, b, go, repeat: int) -> Tuple[float, float]:
    """torch's times: the better of cudnn.benchmark off and on, per pass."""
    import torch
    import torch.nn.functional as F

    times = []
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        times.append(_pass_times(F.conv_transpose2d, layer, x, w, b, go, repeat))
    torch.backends.cudnn.benchmark = False
    return min(t[0] for t in times), min(t[1] for t in times)


def run(layers: List[BenchLayer], dtype: str = "float32", repeat: int = 20, allow_tf32: bool = True,
        progress: bool = True) -> List[dict]:
    import torch

    from . import torch as cc_torch
    from .geometry import ConvParams, geometry

    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    rows = []
    try:
        from tqdm import tqdm
        iterator = tqdm(layers, desc=f"bench {dtype}", disable=not progress)
    except ImportError:
        iterator = layers
    for layer in iterator:
        dt = getattr(torch, dtype)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn((layer.batch, layer.in_channels) + layer.size, generator=gen, device="cuda").to(dt)
        w = torch.randn((layer.in_channels, layer.out_channels // layer.groups) + layer.kernel, generator=gen,
                        device="cuda").to(dt)
        b = torch.randn((layer.out_channels,), generator=gen, device="cuda").to(dt) if layer.bias else None
        out_shape = geometry(x.shape, w.shape, None, ConvParams.from_args(**layer.kwargs())).output_shape
        go = torch.randn(out_shape, generator=gen, device="cuda").to(dt)
        ours_f, ours_fb = _pass_times(cc_torch.conv_transpose2d, layer, x, w, b, go, repeat)
        torch_f, torch_fb = _torch_times(layer, x, w, b, go, repeat)
        for pass_name, ms, ref in (("forward", ours_f, torch_f), ("forward+backward", ours_fb, torch_fb)):
            rows.append(dict(name=layer.name, dtype=dtype, layout="nchw", **{"pass": pass_name}, ms=ms,
                             torch_ms=ref, speedup=ref / ms))
        del x, w, b, go
        torch.cuda.empty_cache()
    return rows


def host_cost(calls: int = 2000) -> List[dict]:
    """Per-call host time (µs) of cupyconv.torch against F.conv_transpose2d on a tiny layer.

    The layer is small enough that the GPU finishes each kernel faster than the host can
    issue the next, so wall time over many unsynchronised calls measures the host path.
    """
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
        timings = {}
        for name, conv in (("torch", F.conv_transpose2d), ("cupyconv", cc_torch.conv_transpose2d)):
            def call(conv=conv):
                if mode == "nograd":
                    with torch.no_grad():
                        conv(x, w, b, stride=2)
                elif mode == "grad":
                    conv(x, w, b, stride=2)
                else:
                    conv(x, w, b, stride=2).backward(go)
            timings[name] = per_call_us(call)
        rows.append(dict(call=label, torch_us=timings["torch"], cupyconv_us=timings["cupyconv"],
                         ratio=timings["cupyconv"] / timings["torch"]))
    return rows


def environment() -> dict:
    import cupy
    import torch

    commit = os.environ.get("CUPYCONV_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cupy=cupy.__version__,
                cudnn=torch.backends.cudnn.version(), commit=commit)


def format_table(rows: List[dict]) -> str:
    lines = [f"{'layer':<18} {'dtype':<9} {'pass':<17} {'cupyconv ms':>12} {'torch ms':>10} {'speedup':>8}"]
    for r in rows:
        lines.append(f"{r['name']:<18} {r['dtype']:<9} {r['pass']:<17} {r['ms']:>12.3f} {r['torch_ms']:>10.3f} "
                     f"{r['speedup']:>7.2f}x")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("seeds", "all"), default="all")
    parser.add_argument("--dtype", action="append", choices=("float32", "float16", "bfloat16", "float64"))
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--host-cost", action="store_true",
                        help="measure per-call host time against F.conv_transpose2d instead")
    args = parser.parse_args(argv)
    if args.host_cost:
        env = environment()
        print(f"device {env['device']}, torch {env['torch']}, cupy {env['cupy']}, commit {env['commit']}")
        print(f"{'call (tiny layer)':<20} {'torch us':>9} {'cupyconv us':>12} {'ratio':>6}")
        for r in host_cost():
            print(f"{r['call']:<20} {r['torch_us']:>9.1f} {r['cupyconv_us']:>12.1f} {r['ratio']:>6.2f}")
        return
    layers = SEED_LAYERS if args.suite == "seeds" else SUITE
    rows = []
    for dtype in args.dtype or ["float32"]:
        rows += run(layers, dtype, args.repeat)
    env = environment()
    print(f"device {env['device']}, torch {env['torch']}, cupy {env['cupy']}, cudnn {env['cudnn']}, "
          f"commit {env['commit']}")
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps({**env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
