"""Time every candidate of a pass, pinned, against cuDNN in the same process (the v23 notes' tables).

    python benchmarks/pass_candidates.py pix2pix_4 --dtype float32 bfloat16 --layout nchw
    python benchmarks/pass_candidates.py 16x1024x4x4:512:k4s2p1 --layout nhwc --weight-channels-last

A layer is one of :data:`LAYERS` or ``NxCxHxW:OUT:kKsSpP[oO]``, each of K, S, P and the output padding O one number
for both axes or ``HxW`` (``16x512x1x32:256:k1x16s1x8p0x4``, a 1-D layer as HiFi-GAN's, on one row;
``8x64x96x96:32:k3s3p1o2``, the suite's outpad_up3x).  ``--also`` names variants to time
beside the table's candidates, pinned, where they plan for the pass (a tile a family does not list, or a family
before it joins the tuner's candidates).  For each dtype, layout and pass (forward, grad_input, grad_weight) it
prints cuDNN's time (``cudnn.benchmark`` on, TF32 allowed for float32), the heuristic candidate's, and every
candidate the pass table lists, fastest first, then the fastest one's kernels.  Times are the GPU time of every
kernel the pass launches (``torch.profiler``), averaged over five calls after three warm-ups.  float32 runs at TF32
precision, as under torch's defaults.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from typing import Callable, Dict, List, Tuple

LAYERS = {
    # pix2pix's decoder and DCGAN's generator, as their layers run in the model benchmark
    "pix2pix_1": ((16, 512, 1, 1), 512, 4, 2, 1),
    "pix2pix_2": ((16, 1024, 2, 2), 512, 4, 2, 1),
    "pix2pix_4": ((16, 1024, 4, 4), 512, 4, 2, 1),
    "pix2pix_8": ((16, 1024, 8, 8), 512, 4, 2, 1),
    "dcgan_4": ((128, 512, 4, 4), 256, 4, 2, 1),
    "dcgan_8": ((128, 256, 8, 8), 128, 4, 2, 1),
    # the RGB output layers
    "pix2pix_128": ((16, 128, 128, 128), 3, 4, 2, 1),
    "dcgan_32": ((128, 64, 32, 32), 3, 4, 2, 1),
    # HiFi-GAN's generator, its 1-D upsampling layers on one row
    "hifigan_32": ((16, 512, 1, 32), 256, (1, 16), (1, 8), (0, 4)),
    "hifigan_256": ((16, 256, 1, 256), 128, (1, 16), (1, 8), (0, 4)),
    "hifigan_2048": ((16, 128, 1, 2048), 64, (1, 4), (1, 2), (0, 1)),
    "hifigan_4096": ((16, 64, 1, 4096), 32, (1, 4), (1, 2), (0, 1)),
}
_PAIR = r"(\d+)(?:x(\d+))?"
_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)x(\d+):(\d+):k" + _PAIR + "s" + _PAIR + "p" + _PAIR + "(?:o" + _PAIR + ")?")
Pair = Tuple[int, int]
PASSES = ("forward", "grad_input", "grad_weight")
GRADIENTS = ("grad_input", "grad_weight")
WARMUP, CALLS = 3, 5


def _pair(value) -> Pair:
    return tuple(value) if isinstance(value, tuple) else (value, value)


def parse_layer(text: str) -> Tuple[Tuple[int, int, int, int], int, Pair, Pair, Pair, Pair]:
    """(input shape, output channels, kernel, stride, padding, output padding) of a name in :data:`LAYERS` or a
    spec; the last four as (height, width) pairs."""
    if text in LAYERS:
        x_shape, out, k, s, p = LAYERS[text]
        return x_shape, out, _pair(k), _pair(s), _pair(p), (0, 0)
    match = _SPEC.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is neither one of {', '.join(LAYERS)} nor NxCxHxW:OUT:kKsSpP")
    g = match.groups()
    pairs = [(int(g[i] or 0), int(g[i + 1] or g[i] or 0)) for i in (5, 7, 9, 11)]
    return tuple(map(int, g[:4])), int(g[4]), pairs[0], pairs[1], pairs[2], pairs[3]


def layer_name(x_shape, out_channels: int, k: Pair, s: Pair, p: Pair, o: Pair = (0, 0)) -> str:
    """The spec of a layer, each pair as one number where its sides agree."""
    def side(pair: Pair) -> str:
        return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}x{pair[1]}"
    outpad = f"o{side(o)}" if any(o) else ""
    return f"{'x'.join(map(str, x_shape))}:{out_channels}:k{side(k)}s{side(s)}p{side(p)}{outpad}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layers", nargs="+", type=parse_layer, help="layer names or NxCxHxW:OUT:kKsSpP specs")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--layout", nargs="+", default=["nchw"], choices=("nchw", "nhwc"))
    parser.add_argument("--weight-channels-last", action="store_true",
                        help="the weight channels_last too, as model.to(memory_format=torch.channels_last) leaves it")
    parser.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    parser.add_argument("--also", nargs="+", default=[], type=_variant, metavar="VARIANT",
                        help="variants to time beside the candidates where they plan, e.g. scatter_gemm:64x256")
    return parser.parse_args(argv)


def _variant(text: str):
    from cupyconv.tuning import Variant

    try:
        return Variant.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def timed_variants(pass_: str, g, dtype: str, layout: str, precision: str, also) -> list:
    """The table's candidates for the pass, the heuristic first, then each of ``also`` not among them that plans
    for this pass of the layer."""
    from cupyconv.plans import table

    found = list(table.candidates(pass_, g, dtype, layout, precision))
    for variant in also:
        if variant in found:
            continue
        try:
            table.plan(pass_, variant, g, dtype, layout, precision)
        except (ValueError, TypeError, KeyError):
            continue
        found.append(variant)
    return found


def gpu_time_us(fn: Callable[[], object]) -> Tuple[float, Dict[str, float]]:
    """The GPU time of one call of ``fn`` in µs, and per kernel name, from ``torch.profiler``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    per_kernel: Dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / CALLS
    return sum(per_kernel.values()), dict(per_kernel)


def _calls(pass_: str, x, w, b, go, kw: dict):
    """(torch's call, cupyconv's call) of the pass."""
    import torch
    import torch.nn.functional as F

    import cupyconv.torch as ct

    if pass_ == "forward":
        return (lambda: F.conv_transpose2d(x, w, b, **kw)), (lambda: ct.conv_transpose2d(x, w, b, **kw))
    stride, padding = list(kw["stride"]), list(kw["padding"])   # (height, width) pairs
    outpad = list(kw["output_padding"])
    which = GRADIENTS.index(pass_)
    mask = [which == 0, which == 1, False]
    theirs = (lambda: torch.ops.aten.convolution_backward(go, x, w, None, stride, padding, [1, 1], True, outpad, 1,
                                                          mask)[which])
    ours = (lambda: torch.ops.cupyconv._conv_transpose2d_grad(go, x, w, stride, padding, outpad, 1, [1, 1], which))
    return theirs, ours


def run(args: argparse.Namespace) -> List[str]:
    import torch
    import torch.nn.functional as F

    from cupyconv.core.geometry import ConvParams, geometry
    from cupyconv.tuning import pinned

    if not torch.cuda.is_available():
        raise SystemExit("pass_candidates needs a CUDA GPU that torch can see")
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    lines = []
    for x_shape, out_channels, k, s, p, o in args.layers:
        kw = dict(stride=s, padding=p, output_padding=o)
        w_shape = (x_shape[1], out_channels) + k
        g = geometry(x_shape, w_shape, None, ConvParams.from_args(**kw)).with_weight_channels_last(
            args.weight_channels_last)
        name = layer_name(x_shape, out_channels, k, s, p, o)
        for dtype in args.dtype:
            precision = "tf32" if dtype == "float32" else "strict"
            tdtype = getattr(torch, dtype)
            for layout in args.layout:
                fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
                x = torch.randn(x_shape, device="cuda", dtype=tdtype).contiguous(memory_format=fmt)
                w = (torch.randn(w_shape, device="cuda") / (x_shape[1] * k[0] * k[1]) ** 0.5).to(tdtype)
                if args.weight_channels_last:
                    w = w.contiguous(memory_format=torch.channels_last)
                b = torch.randn(out_channels, device="cuda", dtype=tdtype)
                go = torch.randn_like(F.conv_transpose2d(x, w, None, **kw)).contiguous(memory_format=fmt)
                for pass_ in args.passes:
                    theirs, ours = _calls(pass_, x, w, b, go, kw)
                    cudnn_us, _ = gpu_time_us(theirs)
                    candidates = timed_variants(pass_, g, dtype, layout, precision, args.also)
                    timed = []
                    for variant in candidates:
                        with pinned({pass_: variant}):
                            us, kernels = gpu_time_us(ours)
                        timed.append((us, variant.name, kernels))
                    heuristic = timed[0]
                    timed.sort(key=lambda t: t[0])
                    where = f"{name} {dtype} {layout}{' weight channels_last' if args.weight_channels_last else ''}"
                    lines.append(f"{where} {pass_}: cuDNN {cudnn_us:.1f} us; heuristic {heuristic[1]} "
                                 f"{heuristic[0]:.1f}; " + ", ".join(f"{n} {us:.1f}" for us, n, _ in timed))
                    best = sorted(timed[0][2].items(), key=lambda kv: -kv[1])
                    lines.append("    fastest's kernels: " + "; ".join(f"{k[:48]} {us:.1f}" for k, us in best))
                    print(lines[-2], lines[-1], sep="\n", flush=True)
    return lines


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
