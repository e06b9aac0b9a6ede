"""Random valid layers for the sweeps, drawn from a seeded generator."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Tuple

from cupyconv.core.geometry import output_length


@dataclass(frozen=True)
class Layer:
    batch: Optional[int]          # None: unbatched (C, H, W) input
    in_channels: int
    out_channels: int
    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    output_padding: Tuple[int, int]
    dilation: Tuple[int, int]
    groups: int
    bias: bool
    size: Tuple[int, int]
    dtype: str

    @property
    def input_shape(self):
        shape = (self.in_channels,) + self.size
        return shape if self.batch is None else (self.batch,) + shape

    @property
    def weight_shape(self):
        return (self.in_channels, self.out_channels // self.groups) + self.kernel

    def kwargs(self):
        return dict(stride=self.stride, padding=self.padding, output_padding=self.output_padding,
                    groups=self.groups, dilation=self.dilation)

    def out_size(self):
        # unchecked, so that random_layer can see an empty output and draw again
        return tuple(output_length(self.size[a], self.kernel[a], self.stride[a], self.padding[a],
                                   self.output_padding[a], self.dilation[a]) for a in range(2))


def grad_weight_geometry(layer: Layer, g, layout: str = "nhwc"):
    """The geometry cupyconv.torch runs grad_weight with for ``layer`` (``g``: the layer as its other passes run
    it, the weight channels_last or not) beside an x in ``layout``: grad_weight written in torch's memory format
    for it, which follows a channels_last x."""
    import torch

    import cupyconv.torch as ct

    x = torch.empty(layer.input_shape, device="meta")
    if layout == "nhwc" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.empty(layer.weight_shape, device="meta")
    if g.weight_channels_last:
        w = w.contiguous(memory_format=torch.channels_last)
    return ct._grad_weight_geometry(g, layout, x, w)


def random_layer(rng: random.Random, dtype: str, max_kernel=7, max_stride=4, max_dilation=3, max_size=13,
                 max_channels_per_group=6) -> Layer:
    while True:
        k = (rng.randint(1, max_kernel), rng.randint(1, max_kernel))
        s = (rng.randint(1, max_stride), rng.randint(1, max_stride))
        d = (rng.randint(1, max_dilation), rng.randint(1, max_dilation))
        p = tuple(rng.randint(0, d[a] * (k[a] - 1)) for a in range(2))
        op = tuple(rng.randint(0, max(s[a], d[a]) - 1) for a in range(2))
        groups = rng.choice([1, 1, 2, 3, 4])
        depthwise = rng.random() < 0.15
        cin_g = 1 if depthwise else rng.randint(1, max_channels_per_group)
        cout_g = rng.randint(1, max_channels_per_group)
        if depthwise:
            groups = rng.randint(2, 8)
        size = (rng.randint(1, max_size), rng.randint(1, max_size))
        batch = rng.choice([None, 1, 1, 2, 3])
        layer = Layer(batch, cin_g * groups, cout_g * groups, k, s, p, op, d, groups, rng.random() < 0.6, size,
                      dtype)
        if min(layer.out_size()) >= 1:
            return layer


def uses_gemm(g, dtype: str, device_id: int = 0) -> bool:
    """Whether the pass table lets the tensor-core GEMMs run this layer on CUDA device ``device_id``."""
    from cupyconv.core import device
    from cupyconv.plans import table

    return any(f.name == "gemm" for f in table.eligible("forward", g, dtype, "nchw", device.get(device_id)))


def tensor_core_layers(count: int, seed: int, in_per_group, out_per_group, groups=(1, 1, 1, 2, 3),
                       bias: Optional[bool] = None):
    """Random valid layers wide enough for the tensor-core kernels: channels per group drawn from
    ``in_per_group`` and ``out_per_group``, kernels 1-5, strides 1-3, dilation 1-2, batch None (unbatched) to 3.
    ``bias`` None draws it per layer; a bool gives every layer that (the backward passes read no bias)."""
    rng = random.Random(seed)
    layers = []
    while len(layers) < count:
        k = (rng.randint(1, 5), rng.randint(1, 5))
        s = (rng.randint(1, 3), rng.randint(1, 3))
        d = (rng.randint(1, 2), rng.randint(1, 2))
        p = tuple(rng.randint(0, d[a] * (k[a] - 1)) for a in range(2))
        op = tuple(rng.randint(0, max(s[a], d[a]) - 1) for a in range(2))
        g = rng.choice(list(groups))
        cin_g, cout_g = rng.choice(list(in_per_group)), rng.choice(list(out_per_group))
        size = (rng.randint(1, 19), rng.randint(1, 23))
        batch = rng.choice([None, 1, 2, 3])
        with_bias = rng.random() < 0.6 if bias is None else bias
        layer = Layer(batch, cin_g * g, cout_g * g, k, s, p, op, d, g, with_bias, size, "")
        if min(layer.out_size()) >= 1:
            layers.append(layer)
    return layers
