"""Check and time every variant of the Hopper wgmma kernels, pinned, on one GPU (the v10 notes' tables).

    python benchmarks/wgmma_variants.py sass                    # HGMMA and no local memory, via nvcc + cuobjdump
    python benchmarks/wgmma_variants.py check [forward|grad_input|grad_weight]
    python benchmarks/wgmma_variants.py time  [forward|grad_input|grad_weight] [LAYER,...]

``check`` runs the dense suite layers (reduced) with every option and 20 random layers,
fp16 and bf16, both layouts, against torch float64, and prints failures and a count.
``time`` prints, per suite layer, dtype and layout: torch (better of cudnn.benchmark off and
on), the mma.sync GEMM and each wgmma option, in median ms from CUDA events.  Needs an sm_90 GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import cupyconv.torch as ct
from cupyconv.cuda_timing import cuda_time_ms
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import launch, scatter_gemm, wgmma
from cupyconv.tuning import Variant, pinned

SUITE = {
    "asym_kernel": ((64, 64, 128, 256), (64, 128, 3, 5), dict()),
    "big_square": ((8, 32, 512, 1024), (32, 32, 3, 3), dict()),
    "dcgan_up": ((64, 512, 8, 8), (512, 256, 4, 4), dict(stride=2, padding=1)),
    "unet_up2x2": ((16, 256, 64, 64), (256, 128, 2, 2), dict(stride=2)),
    "outpad_up3x": ((8, 64, 32, 32), (64, 32, 3, 3), dict(stride=3, padding=1, output_padding=2)),
    # the 1-D rows as the kernels run them, one input row (one-row patches)
    "vocoder_up8_1d": ((16, 512, 1, 8192), (512, 256, 1, 16), dict(stride=(1, 8), padding=(0, 4))),
    "audio_up2_1d": ((16, 64, 1, 16384), (64, 32, 1, 4), dict(stride=(1, 2), padding=(0, 1))),
}
REDUCED = {"asym_kernel": (4, 64, 40, 70), "big_square": (2, 32, 64, 96), "unet_up2x2": (4, 256, 20, 24),
           "vocoder_up8_1d": (2, 512, 1, 700), "audio_up2_1d": (2, 64, 1, 1500)}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _pairs(kw):
    def pair(key, default):
        value = kw.get(key, default)
        return list(value) if isinstance(value, (list, tuple)) else [value, value]
    return (pair("stride", 1), pair("padding", 0), pair("output_padding", 0), kw.get("groups", 1),
            pair("dilation", 1))


GRADIENTS = ("grad_input", "grad_weight")
FUNCTIONS = {"forward": "conv_transpose2d_wgmma", "grad_input": "conv_transpose2d_wgmma",
             "grad_weight": "conv_transpose2d_grad_weight_wgmma"}


def _options(g, pass_):
    """The pass's wgmma planner options, the heuristic first."""
    return wgmma.grad_weight_options(g) if pass_ == "grad_weight" else wgmma.options(g, pass_)


def _call(pass_, x, w, b, go, kw):
    """One call of the pass through cupyconv's torch op."""
    if pass_ == "forward":
        return ct.conv_transpose2d(x, w, b, **kw)
    stride, padding, output_padding, groups, dilation = _pairs(kw)
    return torch.ops.cupyconv._conv_transpose2d_grad(go, x, w, stride, padding, output_padding, groups, dilation,
                                                     GRADIENTS.index(pass_))


def _torch_call(pass_, x, w, b, go, kw):
    if pass_ == "forward":
        return F.conv_transpose2d(x, w, b, **kw)
    stride, padding, output_padding, groups, dilation = _pairs(kw)
    which = GRADIENTS.index(pass_)
    return torch.ops.aten.convolution_backward(go, x, w, None, stride, padding, dilation, True, output_padding,
                                               groups, [which == 0, which == 1, False])[which]


def _tensors(xs, ws, kw, dtype, layout, bias):
    dt = DTYPES[dtype]
    x = torch.randn(xs, device="cuda", dtype=dt)
    w = torch.randn(ws, device="cuda", dtype=dt) / (ws[0] * ws[2] * ws[3]) ** 0.5
    b = torch.randn(ws[1] * kw.get("groups", 1), device="cuda", dtype=dt) if bias else None
    go = torch.randn_like(F.conv_transpose2d(x, w, None, **kw))
    if layout == "nhwc":
        x, go = x.contiguous(memory_format=torch.channels_last), go.contiguous(memory_format=torch.channels_last)
    return x, w, b, go


def _relative(value, reference):
    return float((value.double() - reference).norm() / reference.norm().clamp_min(1e-30))


def _pass_specs(g):
    """(pass, kernel spec) of each heuristic Hopper kernel the layer runs: the scatter GEMM's forward too where
    every output pixel receives one tap."""
    specs = [("forward", wgmma.plan_forward(g, "float16", True, "nhwc").gemm.spec),
             ("grad_input", wgmma.plan_grad_input(g, "float16", "nhwc").gemm.spec),
             ("grad_weight", wgmma.plan_grad_weight(g, "float16", 132, "nhwc").partial.spec)]
    if scatter_gemm.eligible(g, "float16"):
        for tile in scatter_gemm.TILES.values():
            specs.append((f"scatter_{tile.name}", scatter_gemm.plan_forward(g, "float16", True, "nhwc", tile).gemm.spec))
    return specs


def sass() -> None:
    """Each dense layer's heuristic kernels, with a contiguous weight (packed) and a channels_last one (read in
    place where :func:`wgmma.weight_in_place` allows).  Sources and cubins go to a scratch folder."""
    with tempfile.TemporaryDirectory() as scratch:
        for name, (xs, ws, kw) in SUITE.items():
            contiguous = geometry(xs, ws, None, ConvParams.from_args(**kw))
            for weight, g in (("w", contiguous), ("w_cl", contiguous.with_weight_channels_last())):
                for pass_, spec in _pass_specs(g):
                    source = os.path.join(scratch, f"{name}_{weight}_{pass_}.cu")
                    cubin = source[:-3] + ".cubin"
                    with open(source, "w") as f:
                        f.write(spec.source())
                    built = subprocess.run(["nvcc", "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                                            "-Xptxas=-v", "-o", cubin, source], capture_output=True, text=True)
                    report = [line.strip() for line in built.stderr.splitlines()
                              if "registers" in line or "spill" in line]
                    text = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
                    in_place = dict(spec.constants).get("WEIGHT_DIRECT", False)
                    print(f"SASS {name:<14} {weight:<4} {pass_:<17} in place {str(in_place):<5} "
                          f"HGMMA {text.count('HGMMA')} LDL {text.count('LDL')} STL {text.count('STL')} {report}")


def _random_layers(count, seed):
    """The GPU sweeps' random tensor-core layers (tests/layers.py), each batched (an unbatched one as a batch of
    one), as (name, input shape, weight shape, arguments)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from layers import tensor_core_layers

    layers = tensor_core_layers(count, seed, (16, 24, 40, 64, 72, 136, 200), (16, 24, 40, 64, 72, 136, 264))
    return [(f"random{i}", (layer.batch or 1,) + layer.input_shape[-3:], layer.weight_shape, layer.kwargs())
            for i, layer in enumerate(layers)]


def check(pass_: str) -> None:
    layers = [(n, REDUCED.get(n, xs), ws, kw) for n, (xs, ws, kw) in SUITE.items()] + _random_layers(20, 11)
    count = bad = 0
    for name, xs, ws, kw in layers:
        g = geometry(xs, ws, None, ConvParams.from_args(**kw))
        options = [{}] + (_options(g, pass_)[1:] if name in SUITE else [])
        for dtype in DTYPES:
            if not wgmma.eligible(g, dtype, pass_):
                continue
            for layout in ("nchw", "nhwc"):
                for option in options:
                    variant = Variant.make("wgmma", **option)
                    x, w, b, go = _tensors(xs, ws, kw, dtype, layout, bias=count % 3 != 0)
                    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
                    ref = F.conv_transpose2d(x64, w64, None if b is None else b.double(), **kw)
                    if pass_ in GRADIENTS:
                        ref.backward(go.double())
                        ref = x64.grad if pass_ == "grad_input" else w64.grad
                    theirs = _torch_call(pass_, x, w, b, go, kw)
                    with pinned({pass_: variant}), launch.watch() as seen:
                        ours = _call(pass_, x, w, b, go, kw)
                    torch.cuda.synchronize()
                    ran = any(plan.spec.function == FUNCTIONS[pass_] for _, plan in seen)
                    error, torch_error = _relative(ours, ref.detach()), _relative(theirs, ref.detach())
                    count += 1
                    if not (ran and torch.isfinite(ours).all() and error <= 2 * torch_error + 1e-6):
                        bad += 1
                        print(f"FAIL {name} {dtype} {layout} {variant.name}: {error:.2e} against torch's "
                              f"{torch_error:.2e}; wgmma ran: {ran}")
    print(f"{pass_}: {count - bad}/{count} within twice torch's error")


def timing(pass_: str, names) -> None:
    for name in names:
        xs, ws, kw = SUITE[name]
        g = geometry(xs, ws, None, ConvParams.from_args(**kw))
        for dtype in DTYPES:
            for layout in ("nchw",) if xs[2] == 1 else ("nchw", "nhwc"):   # one row: the layouts are one
                x, w, b, go = _tensors(xs, ws, kw, dtype, layout, bias=pass_ == "forward")
                times = {}
                for benchmark in (False, True):
                    torch.backends.cudnn.benchmark = benchmark
                    times[f"cudnn{'+benchmark' if benchmark else ''}"] = cuda_time_ms(
                        lambda: _torch_call(pass_, x, w, b, go, kw), repeat=30)
                torch.backends.cudnn.benchmark = False
                variants = [Variant("gemm")] + [Variant.make("wgmma", **o) for o in _options(g, pass_)]
                for variant in variants:
                    with pinned({pass_: variant}):
                        times[variant.name] = cuda_time_ms(lambda: _call(pass_, x, w, b, go, kw), repeat=30)
                reference = min(times["cudnn"], times["cudnn+benchmark"])
                ours = {k: v for k, v in times.items() if k.startswith("wgmma")}
                best = min(ours, key=ours.get)
                print(f"{pass_} {name:<12} {dtype:<9} {layout} torch {reference:.3f} gemm {times['gemm']:.3f} "
                      f"best {best} {ours[best]:.3f} ({reference / ours[best]:.2f}x) "
                      + " ".join(f"{k}={v:.3f}" for k, v in ours.items()), flush=True)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "check"
    which = sys.argv[2] if len(sys.argv) > 2 else "forward"
    if command == "sass":
        sass()
    elif command == "check":
        check(which)
    elif command == "time":
        timing(which, sys.argv[3].split(",") if len(sys.argv) > 3 else list(SUITE))
    else:
        raise SystemExit(__doc__)
