"""Each model's transposed convolutions, per layer and pass, against cuDNN in the same process (the v25 notes' table).

    python benchmarks/model_passes.py unet pix2pix_unet --modes bf16_autocast_channels_last

For every ConvTranspose2d layer a model of :data:`cupyconv.model_bench.MODELS` runs (at the benchmark's input
shape, in the mode's dtype and memory format, the weight in the model's own), it prints the GPU time of the
forward, of grad_input and of grad_weight (``torch.profiler``, every kernel of the pass), cuDNN's
(``cudnn.benchmark`` on) and ours (the tuner's choice, after it settles), our kernels, and each pass's sums over
the model's layers.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Tuple

PASSES = ("forward", "grad_input", "grad_weight")
# the benchmark's models with ConvTranspose2d layers (HiFi-GAN's are 1-D)
TWO_D_MODELS = ("dcgan_generator", "unet", "pix2pix_unet")


def parse_model_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Adds the models (all of :data:`TWO_D_MODELS` by default) and ``--modes`` to ``parser``, and parses
    ``argv``; an unknown model is a usage error."""
    from cupyconv import model_bench

    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help=f"of {', '.join(TWO_D_MODELS)} (default: all of them)")
    parser.add_argument("--modes", nargs="+", default=list(model_bench.MODES), choices=model_bench.MODES)
    opts = parser.parse_args(argv)
    for name in opts.models:
        if name not in TWO_D_MODELS:
            parser.error(f"model {name!r} is not one of {', '.join(TWO_D_MODELS)}")
    opts.models = opts.models or list(TWO_D_MODELS)
    return opts


def parse_args(argv=None) -> argparse.Namespace:
    return parse_model_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)


def model_layers(name: str, mode: str, device: str = "cuda") -> List[Tuple[tuple, object]]:
    """(input shape, layer) of each distinct ConvTranspose2d call one forward of the model makes, in order."""
    import torch
    from torch import nn

    from cupyconv import model_bench

    builder, kwargs, shape = model_bench.MODELS[name]
    fmt = torch.channels_last if mode == "bf16_autocast_channels_last" else torch.contiguous_format
    model = builder(**kwargs).to(device).to(memory_format=fmt)
    seen: Dict[tuple, Tuple[tuple, object]] = {}

    def record(module, args):
        key = (tuple(args[0].shape), tuple(module.weight.shape), module.stride, module.padding,
               module.output_padding, module.groups, module.dilation, module.bias is not None)
        seen.setdefault(key, (tuple(args[0].shape), module))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.ConvTranspose2d)]
    with torch.no_grad():
        model(model_bench._arranged(torch.randn(shape, device=device), fmt))
    for hook in hooks:
        hook.remove()
    return list(seen.values())


def _calls(pass_: str, x, w, go, layer):
    """(torch's call, cupyconv's call) of the pass; the gradients through each library's backward operator."""
    import torch
    import torch.nn.functional as F

    import cupyconv.torch as ct

    args = (layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)
    if pass_ == "forward":
        return (lambda: F.conv_transpose2d(x, w, None, *args)), (lambda: ct.conv_transpose2d(x, w, None, *args))
    mask = [pass_ == "grad_input", pass_ == "grad_weight", False]
    stride, padding, output_padding, groups, dilation = (list(a) if isinstance(a, tuple) else a for a in args)
    theirs = (lambda: torch.ops.aten.convolution_backward(go, x, w, None, stride, padding, dilation, True,
                                                          output_padding, groups, mask))
    ours = (lambda: torch.ops.cupyconv.conv_transpose2d_backward(go, x, w, stride, padding, output_padding, groups,
                                                                 dilation, mask))
    return theirs, ours


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    from cupyconv import model_bench
    from cupyconv.tuning import settle
    from pass_candidates import gpu_time_us   # beside this script

    opts = parse_args(argv)
    torch.backends.cudnn.benchmark = True
    for name in opts.models:
        for mode in opts.modes:
            channels_last = mode == "bf16_autocast_channels_last"
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            dtype = torch.bfloat16 if channels_last else torch.float32
            sums = {p: [0.0, 0.0] for p in PASSES}
            for x_shape, layer in model_layers(name, mode):
                x = model_bench._arranged(torch.randn(x_shape, device="cuda", dtype=dtype), fmt)
                w = layer.weight.detach().to(dtype)   # autocast's copy keeps the weight's memory format
                go = model_bench._arranged(torch.randn_like(F.conv_transpose2d(
                    x, w, None, layer.stride, layer.padding, layer.output_padding, layer.groups, layer.dilation)), fmt)
                cells = []
                with torch.no_grad():
                    for pass_ in PASSES:
                        theirs, ours = _calls(pass_, x, w, go, layer)
                        ours()
                        settle()
                        t_us, _ = gpu_time_us(theirs)
                        o_us, kernels = gpu_time_us(ours)
                        sums[pass_][0] += t_us
                        sums[pass_][1] += o_us
                        names = ", ".join(sorted({k.split("(")[0].split("<")[0] for k in kernels}))
                        cells.append(f"{pass_} {t_us:.1f} / {o_us:.1f} ({names})")
                print(f"{name} {mode} {x_shape} -> {tuple(w.shape)} s{layer.stride} p{layer.padding}: "
                      + " | ".join(cells), flush=True)
            print(f"{name} {mode} sums, cuDNN / ours µs: "
                  + ", ".join(f"{p} {t:.0f} / {o:.0f}" for p, (t, o) in sums.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
