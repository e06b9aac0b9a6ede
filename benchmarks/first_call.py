"""A new layer's first forward+backward from empty caches, and from the disk cache in a new process.

    python benchmarks/first_call.py [--autotune 0|1] [--nvrtc-warm] [--module] [--json FILE]

Each layer runs in two child processes that share a fresh ``CUPY_CACHE_DIR`` and
``CUPYCONV_CACHE_DIR``.  The first ("cold") compiles what the first call runs, then waits for
the tuner's background builds and makes the call that times the candidates; the second
("disk") finds the kernels in CuPy's disk cache and the tuner's choices in ``tuning.json``.  Each child
first pays torch's own first-use costs on other tensors and sets up CuPy on the device (no kernel), then
times one forward+backward of the layer with the host synchronised, and counts the kernel builds and their
wall time.  So a cold first call pays NVRTC's start-up in its process, as a user's first layer does (about
0.2 s on an H100's host, 0.9 s on a slow CPU); ``--nvrtc-warm`` compiles a CuPy kernel first, leaving it out
as this script did before.  ``--module`` calls the layer as a ``cupyconv.torch.ConvTranspose2d`` built before
torch's and CuPy's set-up, as a user's model is: building it starts NVRTC's start-up in the background
(``compiler.warm_up``).  Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LAYERS = {
    # name: (input shape, weight shape, kwargs, dtype, channels_last)
    "dcgan_up_fp16_nhwc": ((16, 512, 8, 8), (512, 256, 4, 4), dict(stride=2, padding=1), "float16", True),
    "unet_up2x2_bf16_nhwc": ((4, 256, 32, 32), (256, 128, 2, 2), dict(stride=2), "bfloat16", True),
    "asym_kernel_fp16_nchw": ((4, 64, 64, 64), (64, 128, 3, 5), dict(), "float16", False),
    "dcgan_up_fp32_nchw": ((16, 512, 8, 8), (512, 256, 4, 4), dict(stride=2, padding=1), "float32", False),
    "small_fp32_nchw": ((1, 8, 8, 8), (8, 8, 3, 3), dict(stride=2), "float32", False),
}


def child(name: str, nvrtc_warm: bool = False, module: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    x_shape, w_shape, kw, dtype, channels_last = LAYERS[name]
    dt = getattr(torch, dtype)
    if module:
        import cupyconv.torch as ct

        layer = ct.ConvTranspose2d(w_shape[0], w_shape[1], w_shape[2:], **kw)
    # torch's and CuPy's own first-use costs, on other shapes.
    a = torch.randn(2, 3, 5, 5, device="cuda", dtype=dt, requires_grad=True)
    y0 = F.conv_transpose2d(a, torch.randn(3, 2, 2, 2, device="cuda", dtype=dt, requires_grad=True))
    y0.backward(torch.ones_like(y0))
    import cupy
    cupy.cuda.Device(0).use()
    cupy.empty(3)
    if nvrtc_warm:
        cupy.ones(3).sum()   # CuPy's own kernels: the first NVRTC program of the process
    import cupyconv.torch as ct
    from cupyconv.jit import compiler

    builds = []
    build = compiler._build

    def timed(spec, device_id):
        start = time.perf_counter()
        try:
            return build(spec, device_id)
        finally:
            builds.append((spec.function, time.perf_counter() - start))

    compiler._build = timed
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(x_shape, device="cuda", dtype=dt).to(memory_format=fmt).requires_grad_()
    w = (torch.randn(w_shape, device="cuda", dtype=dt) * 0.05).to(memory_format=fmt).requires_grad_()
    b = torch.randn(w_shape[1], device="cuda", dtype=dt, requires_grad=True)
    if module:
        layer = layer.to(device="cuda", dtype=dt, memory_format=fmt)
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.bias.copy_(b)
        x.grad = None

        def call():
            layer.zero_grad(set_to_none=True)
            return layer(x)
    else:
        def call():
            x.grad = w.grad = b.grad = None
            return ct.conv_transpose2d(x, w, b, **kw)
    torch.cuda.synchronize()
    start = time.perf_counter()
    y = call()
    torch.cuda.synchronize()
    mid = time.perf_counter()
    y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    end = time.perf_counter()
    row = {"forward_s": mid - start, "backward_s": end - mid, "total_s": end - start, "builds": len(builds),
           "build_s": sum(t for _, t in builds), "slowest_build": max(builds, key=lambda b: b[1]) if builds else None}
    # The tuner's other candidates build in the background; the next call after they have built
    # times them and stores the choice, which the "disk" process then finds.
    from cupyconv import tuning

    tuning.settle()
    row["settled_s"] = time.perf_counter() - end
    x.grad = None
    torch.cuda.synchronize()
    race = time.perf_counter()
    call().backward(torch.ones_like(y))
    torch.cuda.synchronize()
    row["race_s"] = time.perf_counter() - race
    row["all_builds"] = len(builds)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--autotune", default=os.environ.get("CUPYCONV_AUTOTUNE", "1"))
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--nvrtc-warm", action="store_true",
                        help="compile a CuPy kernel before the first call, leaving NVRTC's start-up out")
    parser.add_argument("--module", action="store_true",
                        help="call the layer as a cupyconv.torch.ConvTranspose2d built before torch's set-up")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.nvrtc_warm, args.module)))
        return 0
    rows = []
    for name in args.layers.split(","):
        with tempfile.TemporaryDirectory() as cupy_cache, tempfile.TemporaryDirectory() as tune_cache:
            env = dict(os.environ, CUPY_CACHE_DIR=cupy_cache, CUPYCONV_CACHE_DIR=tune_cache,
                       CUPYCONV_AUTOTUNE=args.autotune)
            row = {"layer": name, "autotune": args.autotune, "nvrtc_warm": args.nvrtc_warm, "module": args.module}
            for phase in ("cold", "disk"):
                out = subprocess.run([sys.executable, __file__, "--child", name]
                                     + (["--nvrtc-warm"] if args.nvrtc_warm else [])
                                     + (["--module"] if args.module else []),
                                     env=env, capture_output=True, text=True)
                if out.returncode:
                    print(out.stderr, file=sys.stderr)
                    return 1
                row[phase] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            c, d = row["cold"], row["disk"]
            print(f"{name:24s} autotune={args.autotune} nvrtc_warm={args.nvrtc_warm} module={args.module} "
                  f"cold {c['total_s']:.3f} s (fwd {c['forward_s']:.3f}, "
                  f"{c['builds']} builds, {c['build_s']:.2f} s build wall, slowest {c['slowest_build']}; "
                  f"candidates built {c['settled_s']:.2f} s later ({c['all_builds']} builds), timed in "
                  f"{c['race_s']:.3f} s) | "
                  f"disk {d['total_s'] * 1e3:.1f} ms ({d['builds']} loads, {d['build_s'] * 1e3:.1f} ms)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
