"""Training steps of published architectures that use ``ConvTranspose2d`` or ``ConvTranspose1d``, original
against converted.

``python -m cupyconv.bench --models`` builds each model from its published layer specs,
makes a copy with :func:`cupyconv.torch.convert` (the same weights, the transposed
convolutions swapped for cupyconv's) and times one training step of each (forward, loss,
backward, SGD step) in the same process, in two modes: float32 NCHW with torch's default
precision flags, and bfloat16 autocast with channels_last memory.  Each side's output and
gradients are also compared with a float64 copy of the model on the same input.

The models:

- ``dcgan_generator``: the DCGAN generator (Radford, Metz and Chintala, 2016), 100-d noise to
  a 64 x 64 image through five 4 x 4 transposed convolutions, at the paper's batch of 128.
- ``unet``: the U-Net (Ronneberger, Fischer and Brox, 2015) with padded 3 x 3 convolutions,
  its decoder's four 2 x 2 stride-2 up-convolutions, on 256 x 256 inputs.
- ``pix2pix_unet``: the pix2pix U-Net-256 generator (Isola et al., 2017): eight 4 x 4 stride-2
  convolutions down, seven transposed ones up with skip connections and a final one to RGB.
  Its decoder's dropout is left out, so both sides compute the same function.
- ``hifigan_generator``: the HiFi-GAN V1 vocoder generator (Kong, Kim and Bae, 2020), 80-band mel
  frames to a waveform through four ``ConvTranspose1d`` upsamplings (x8, x8, x2, x2; kernels 16, 16,
  4, 4), each followed by a multi-receptive-field fusion of three residual blocks (kernels 3, 7
  and 11, dilations 1, 3 and 5), at the paper's batch of 16 and 8192-sample segments (32 frames).
  Its weight normalisation is left out (a reparametrisation of the same weights).  A 1-D model has
  no channels_last: its ``bf16_autocast_channels_last`` rows run bfloat16 autocast, contiguous.
"""
from __future__ import annotations

import copy
import functools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .tuning import settle as settle_tuning

MODES = ("fp32_nchw", "bf16_autocast_channels_last")


# ------------------------------------------------------------------------------- the models

def dcgan_generator(nz: int = 100, ngf: int = 64, channels: int = 3):
    """DCGAN's generator: (N, nz, 1, 1) noise to (N, channels, 64, 64) images."""
    from torch import nn

    def up(cin, cout, first=False):
        return [nn.ConvTranspose2d(cin, cout, 4, 1 if first else 2, 0 if first else 1, bias=False),
                nn.BatchNorm2d(cout), nn.ReLU(True)]

    return nn.Sequential(*up(nz, ngf * 8, first=True), *up(ngf * 8, ngf * 4), *up(ngf * 4, ngf * 2),
                         *up(ngf * 2, ngf), nn.ConvTranspose2d(ngf, channels, 4, 2, 1, bias=False), nn.Tanh())


def _double_conv(nn, cin: int, cout: int):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True))


def unet(channels: int = 3, classes: int = 2, width: int = 64):
    """The U-Net: four 2x2 max-pool steps down, four 2x2 stride-2 up-convolutions up, skips concatenated."""
    import torch
    from torch import nn

    widths = [width * 2 ** i for i in range(5)]

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.ModuleList([_double_conv(nn, channels, widths[0])]
                                      + [_double_conv(nn, widths[i], widths[i + 1]) for i in range(4)])
            self.pool = nn.MaxPool2d(2)
            self.up = nn.ModuleList([nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                     for i in reversed(range(4))])
            self.merge = nn.ModuleList([_double_conv(nn, 2 * widths[i], widths[i]) for i in reversed(range(4))])
            self.head = nn.Conv2d(widths[0], classes, 1)

        def forward(self, x):
            skips = []
            for i, block in enumerate(self.down):
                x = block(x if i == 0 else self.pool(x))
                skips.append(x)
            x = skips.pop()
            for up, merge in zip(self.up, self.merge):
                x = merge(torch.cat([skips.pop(), up(x)], dim=1))
            return self.head(x)

    return UNet()


def pix2pix_unet(channels: int = 3, width: int = 64):
    """pix2pix's U-Net-256 generator: C64-C128-C256-C512-C512-C512-C512-C512 down, the mirror image up."""
    import torch
    from torch import nn

    down_widths = [width, width * 2, width * 4] + [width * 8] * 5

    class Pix2PixUNet(nn.Module):
        def __init__(self):
            super().__init__()
            downs, cin = [], channels
            for i, cout in enumerate(down_widths):
                layers = [] if i == 0 else [nn.LeakyReLU(0.2, True)]
                layers.append(nn.Conv2d(cin, cout, 4, 2, 1, bias=False))
                if 0 < i < len(down_widths) - 1:
                    layers.append(nn.BatchNorm2d(cout))
                downs.append(nn.Sequential(*layers))
                cin = cout
            self.down = nn.ModuleList(downs)
            ups = []
            for i in reversed(range(1, len(down_widths))):
                cin_up = down_widths[i] if i == len(down_widths) - 1 else 2 * down_widths[i]
                ups.append(nn.Sequential(nn.ReLU(True), nn.ConvTranspose2d(cin_up, down_widths[i - 1], 4, 2, 1,
                                                                           bias=False),
                                         nn.BatchNorm2d(down_widths[i - 1])))
            self.up = nn.ModuleList(ups)
            self.out = nn.Sequential(nn.ReLU(True), nn.ConvTranspose2d(2 * width, channels, 4, 2, 1), nn.Tanh())

        def forward(self, x):
            skips = []
            for block in self.down:
                x = block(x)
                skips.append(x)
            skips.pop()
            for block in self.up:
                x = torch.cat([block(x), skips.pop()], dim=1)
            return self.out(x)

    return Pix2PixUNet()


def hifigan_generator(mels: int = 80, width: int = 512):
    """HiFi-GAN V1's generator: (N, mels, T) mel frames to an (N, 1, 256 T) waveform."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    slope = 0.1   # the paper's LeakyReLU slope between layers

    class ResBlock(nn.Module):
        """ResBlock1: per dilation, a dilated and an undilated convolution, each after a LeakyReLU, and a skip."""

        def __init__(self, channels, kernel, dilations=(1, 3, 5)):
            super().__init__()
            self.dilated = nn.ModuleList([nn.Conv1d(channels, channels, kernel, dilation=d,
                                                    padding=d * (kernel - 1) // 2) for d in dilations])
            self.plain = nn.ModuleList([nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2)
                                        for _ in dilations])

        def forward(self, x):
            for dilated, plain in zip(self.dilated, self.plain):
                x = x + plain(F.leaky_relu(dilated(F.leaky_relu(x, slope)), slope))
            return x

    class Generator(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Conv1d(mels, width, 7, padding=3)
            self.ups, self.fusions = nn.ModuleList(), nn.ModuleList()
            channels = width
            for rate, kernel in zip((8, 8, 2, 2), (16, 16, 4, 4)):
                self.ups.append(nn.ConvTranspose1d(channels, channels // 2, kernel, rate, (kernel - rate) // 2))
                channels //= 2
                self.fusions.append(nn.ModuleList([ResBlock(channels, k) for k in (3, 7, 11)]))
            self.post = nn.Conv1d(channels, 1, 7, padding=3)

        def forward(self, x):
            x = self.pre(x)
            for up, fusion in zip(self.ups, self.fusions):
                x = up(F.leaky_relu(x, slope))
                x = sum(block(x) for block in fusion) / len(fusion)
            return torch.tanh(self.post(F.leaky_relu(x)))

    return Generator()


# name -> (builder, keyword arguments, input shape (batch first))
MODELS: Dict[str, Tuple[Callable, dict, Tuple[int, ...]]] = {
    "dcgan_generator": (dcgan_generator, {}, (128, 100, 1, 1)),
    "unet": (unet, {}, (8, 3, 256, 256)),
    "pix2pix_unet": (pix2pix_unet, {}, (16, 3, 256, 256)),
    "hifigan_generator": (hifigan_generator, {}, (16, 80, 32)),
}


# ---------------------------------------------------------------------------- measuring

def _relative_error(value, reference) -> float:
    return float((value.detach().double() - reference.detach()).norm() / reference.detach().norm().clamp_min(1e-300))


def _step(model, x, optimizer, autocast: bool) -> Tuple[object, List[object]]:
    """One training step: forward, mean-square loss, backward, SGD; returns the output and the gradients."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    loss = out.float().square().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    optimizer.step()
    return out, grads


def _wall_ms(fn: Callable[[], None], device, warmup: int, repeat: int) -> float:
    """Median milliseconds of ``fn``: CUDA events on a GPU (as the layer benchmark times), the host clock otherwise."""
    import statistics

    if device.type == "cuda":
        from .cuda_timing import cuda_time_ms

        return cuda_time_ms(fn, warmup, repeat)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


ROUNDS = 3


def compare(name: str, mode: str, device="cuda", repeat: int = 10, warmup: int = 3,
            shape: Optional[Sequence[int]] = None, builder_args: Optional[dict] = None, rounds: int = ROUNDS) -> dict:
    """One row: model ``name`` in ``mode``, original against converted on the same weights and input.

    ``shape`` and ``builder_args`` override the model's input shape and builder arguments
    (smaller models for tests).  Errors are each side's relative error against a float64 copy,
    for the output and for all parameter gradients together, on the first step.  The two sides are
    timed in ``rounds`` alternating rounds of ``repeat`` steps (the order flips each round) and each keeps its
    fastest round's median: a host whose speed drifts within a process then slows both sides alike.
    """
    import torch

    from .torch import ConvTranspose1d, ConvTranspose2d, convert

    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    device = torch.device(device)
    builder, kwargs, default_shape = MODELS[name]
    torch.manual_seed(0)
    original = builder(**{**kwargs, **(builder_args or {})}).to(device)
    converted = convert(copy.deepcopy(original))
    reference = copy.deepcopy(original).double()
    channels_last = mode == "bf16_autocast_channels_last"
    autocast = channels_last
    x = torch.randn(tuple(shape or default_shape), device=device)
    if channels_last and x.dim() == 4:   # a 1-D model has no channels_last; its bf16 rows run contiguous
        original, converted = (m.to(memory_format=torch.channels_last) for m in (original, converted))
        x = x.contiguous(memory_format=torch.channels_last)

    ref_out, ref_grads = _step(reference, x.double(), torch.optim.SGD(reference.parameters(), lr=0.0), False)
    ref_flat = torch.cat([g.reshape(-1) for g in ref_grads if g is not None])
    row = dict(model=name, mode=mode, batch=x.shape[0],
               transposed_convs=sum(isinstance(m, (ConvTranspose2d, ConvTranspose1d)) for m in converted.modules()))
    steps = {}
    for side, model in (("torch", original), ("cupyconv", converted)):
        # lr 0: every timed step computes on the same weights (and BatchNorm's running statistics
        # are the only state that moves, identically on both sides).
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        out, grads = _step(model, x, optimizer, autocast)
        # The converted layers' first step handed the tuner's candidates to the background compiler;
        # the warm-up step after they have built times them, so the timed steps run the choices.
        settle_tuning()
        flat = torch.cat([g.reshape(-1) for g in grads if g is not None])
        row["torch_error" if side == "torch" else "error"] = dict(output=_relative_error(out, ref_out),
                                                                  grads=_relative_error(flat, ref_flat))
        steps[side] = functools.partial(_step, model, x, optimizer, autocast)
    times: Dict[str, List[float]] = {side: [] for side in steps}
    for r in range(rounds):
        for side in (("torch", "cupyconv") if r % 2 == 0 else ("cupyconv", "torch")):
            times[side].append(_wall_ms(steps[side], device, warmup if r < 2 else 1, repeat))
    row.update(torch_ms=min(times["torch"]), ms=min(times["cupyconv"]), rounds=rounds)
    row["speedup"] = row["torch_ms"] / row["ms"]
    return row


def run(names: Sequence[str] = tuple(MODELS), modes: Sequence[str] = MODES, repeat: int = 10) -> List[dict]:
    """Every (model, mode) row on the GPU, with cuDNN's autotuner on for torch as in training scripts."""
    import torch

    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        rows = []
        for name in names:
            for mode in modes:
                rows.append(compare(name, mode, "cuda", repeat))
                torch.cuda.empty_cache()
        return rows
    finally:
        torch.backends.cudnn.benchmark = saved


def layer_rows(name: str, mode: str, repeat: int = 10, shape: Optional[Sequence[int]] = None,
               builder_args: Optional[dict] = None) -> List[dict]:
    """Each distinct transposed convolution of model ``name`` in ``mode``, forward+backward on its own:
    torch against cupyconv on the shapes, dtype and layout the model's step gives it.

    Where a model's step is slower converted, this says which of its layers are the cause.  Under
    ``bf16_autocast_channels_last`` the layers run in bfloat16, as autocast runs them.  ``shape`` and
    ``builder_args`` are as for :func:`compare`.  Needs a CUDA GPU.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    from .cuda_timing import cuda_time_ms
    from .torch import conv_transpose1d, conv_transpose2d

    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    builder, kwargs, default_shape = MODELS[name]
    shape = tuple(shape or default_shape)
    torch.manual_seed(0)
    model = builder(**{**kwargs, **(builder_args or {})}).cuda()
    channels_last = mode == "bf16_autocast_channels_last"
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    dtype = torch.bfloat16 if channels_last else torch.float32
    model = model.to(memory_format=fmt)
    seen: Dict[tuple, dict] = {}

    def record(module, args):
        key = (tuple(args[0].shape), tuple(module.weight.shape), module.stride, module.padding,
               module.output_padding, module.groups, module.dilation, module.bias is not None)
        seen.setdefault(key, dict(count=0, module=module))["count"] += 1

    hooks = [m.register_forward_pre_hook(record) for m in model.modules()
             if isinstance(m, (nn.ConvTranspose2d, nn.ConvTranspose1d))]
    try:
        with torch.no_grad():
            model(_arranged(torch.randn(shape, device="cuda"), fmt))
    finally:
        for h in hooks:
            h.remove()
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    rows = []
    try:
        for (x_shape, w_shape, stride, padding, output_padding, groups, dilation, bias), seen_as in seen.items():
            args = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                        dilation=dilation)
            x = _arranged(torch.randn(x_shape, device="cuda", dtype=dtype), fmt).requires_grad_()
            w = seen_as["module"].weight.detach().to(dtype).requires_grad_()
            b = torch.randn(w_shape[1] * groups, device="cuda", dtype=dtype, requires_grad=True) if bias else None
            theirs, ours = (F.conv_transpose1d, conv_transpose1d) if len(w_shape) == 3 else \
                (F.conv_transpose2d, conv_transpose2d)
            out = theirs(x.detach(), w.detach(), None, **args)
            go = _arranged(torch.randn_like(out), fmt)
            row = dict(model=name, mode=mode, input=list(x_shape), weight=list(w_shape), stride=list(stride),
                       padding=list(padding), output_padding=list(output_padding), groups=groups,
                       dilation=list(dilation), bias=bias, count=seen_as["count"])
            for side, conv in (("torch", theirs), ("cupyconv", ours)):
                def step(conv=conv, x=x, w=w, b=b, go=go):
                    x.grad = w.grad = None
                    if b is not None:
                        b.grad = None
                    conv(x, w, b, **args).backward(go)
                step()
                settle_tuning()
                row["torch_ms" if side == "torch" else "ms"] = cuda_time_ms(step, 3, repeat)
            row["speedup"] = row["torch_ms"] / row["ms"]
            rows.append(row)
            del x, w, b, go, out
            torch.cuda.empty_cache()
    finally:
        torch.backends.cudnn.benchmark = saved
    return rows


def _arranged(t, fmt):
    """``t`` in memory format ``fmt`` where it has one (4-D); 1-D layers' 3-D tensors stay contiguous."""
    return t.contiguous(memory_format=fmt) if t.dim() == 4 else t.contiguous()


def format_layer_table(rows: List[dict]) -> str:
    """The per-layer rows as a text table: shapes, how often the step runs each, and the times."""
    lines = [f"{'model':<16} {'mode':<28} {'input':<20} {'weight':<18} {'stride':>6} {'pad':>5} {'runs':>4} "
             f"{'torch ms':>9} {'cupyconv ms':>11} {'speedup':>8}"]
    for r in rows:
        lines.append(f"{r['model']:<16} {r['mode']:<28} {'x'.join(map(str, r['input'])):<20} "
                     f"{'x'.join(map(str, r['weight'])):<18} {'x'.join(map(str, r['stride'])):>6} "
                     f"{'x'.join(map(str, r['padding'])):>5} {r['count']:>4} {r['torch_ms']:>9.3f} {r['ms']:>11.3f} "
                     f"{r['speedup']:>7.2f}x")
    return "\n".join(lines)


def format_table(rows: List[dict]) -> str:
    """The rows as a text table, ending with the geometric mean speedup."""
    import math

    lines = [f"{'model':<16} {'mode':<28} {'batch':>5} {'torch ms':>9} {'cupyconv ms':>11} {'speedup':>8} "
             f"{'torch err out/grad':>19} {'cupyconv err out/grad':>22}"]
    for r in rows:
        te, ce = r["torch_error"], r["error"]
        lines.append(f"{r['model']:<16} {r['mode']:<28} {r['batch']:>5} {r['torch_ms']:>9.2f} {r['ms']:>11.2f} "
                     f"{r['speedup']:>7.2f}x {te['output']:>9.1e}/{te['grads']:.1e} "
                     f"{ce['output']:>12.1e}/{ce['grads']:.1e}")
    if rows:
        mean = math.exp(sum(math.log(r["speedup"]) for r in rows) / len(rows))
        lines.append(f"geomean speedup: {mean:.2f}x over {len(rows)} rows")
    return "\n".join(lines)
