"""Layer geometry: torch-style argument parsing, the output-size rule and shape checks.

Everything here is pure Python so that a bad argument is rejected before anything
is compiled or launched, with an exception that names the argument.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

Pair = Tuple[int, int]

# Layer constants are baked into the kernels as 32-bit ints, and torch keeps them in
# 32-bit fields too (it wraps larger ones): anything larger is rejected up front.
INT32_MAX = 2 ** 31 - 1


def as_int(value, name: str) -> int:
    """Return ``value`` as an int; bools, floats and other objects are a TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def as_pair(value, name: str) -> Pair:
    """torch's ``_pair``: an int, or a sequence of one or two ints."""
    if isinstance(value, (list, tuple)):
        if len(value) == 1:
            value = (value[0], value[0])
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or a pair of ints, got {len(value)} values: {tuple(value)!r}")
        return (as_int(value[0], name), as_int(value[1], name))
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or a pair of ints, got {type(value).__name__} {value!r}")
    v = int(value)
    return (v, v)


def output_length(in_size: int, kernel: int, stride: int, padding: int, output_padding: int, dilation: int) -> int:
    """The output-size rule along one axis, unchecked: any ints in, possibly a non-positive number out.

    For arguments already validated, and for callers that want to see a non-positive result
    rather than an exception; :func:`output_size` is the checked, public form.
    """
    return (in_size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def phase_taps(kernel: int, stride: int, dilation: int) -> int:
    """The most taps one stride phase of an axis holds: taps k fall in phase (k * dilation) % stride, which
    repeats every stride / gcd(stride, dilation) taps (the padding only renames the phases)."""
    return -(-kernel // (stride // math.gcd(stride, dilation)))


def output_size(in_size: int, kernel: int, stride: int, padding: int, output_padding: int, dilation: int) -> int:
    """One spatial dimension of a transposed convolution's output, checked as a layer's arguments are.

    Every argument must be an int (bools and floats are a TypeError naming it); stride,
    padding, output_padding and dilation must satisfy the layer's rules, ``in_size`` and
    ``kernel`` must be positive, and so must the result (ValueError otherwise).
    """
    in_size, kernel = as_int(in_size, "in_size"), as_int(kernel, "kernel")
    stride, padding = as_int(stride, "stride"), as_int(padding, "padding")
    output_padding, dilation = as_int(output_padding, "output_padding"), as_int(dilation, "dilation")
    ConvParams.from_args(stride, padding, output_padding, 1, dilation)
    if in_size < 1:
        raise ValueError(f"in_size must be >= 1, got {in_size}")
    if kernel < 1:
        raise ValueError(f"kernel must be >= 1, got {kernel}")
    size = output_length(in_size, kernel, stride, padding, output_padding, dilation)
    if size < 1:
        raise ValueError(
            f"the output size (in_size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1 "
            f"= {size} is not positive (in_size={in_size}, kernel={kernel}, stride={stride}, padding={padding}, "
            f"output_padding={output_padding}, dilation={dilation}); it must be at least 1")
    return size


@dataclass(frozen=True)
class ConvParams:
    """The hyper-parameters of a transposed convolution, validated and normalised."""

    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    output_padding: Pair = (0, 0)
    groups: int = 1
    dilation: Pair = (1, 1)

    @classmethod
    def from_args(cls, stride=1, padding=0, output_padding=0, groups=1, dilation=1) -> "ConvParams":
        """Validate torch-style arguments (ints or pairs); ValueError or TypeError names the bad one."""
        stride = as_pair(stride, "stride")
        padding = as_pair(padding, "padding")
        output_padding = as_pair(output_padding, "output_padding")
        dilation = as_pair(dilation, "dilation")
        groups = as_int(groups, "groups")
        if min(stride) < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if min(dilation) < 1:
            raise ValueError(f"dilation must be >= 1, got {dilation}")
        if min(padding) < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        if min(output_padding) < 0:
            raise ValueError(f"output_padding must be >= 0, got {output_padding}")
        for axis in range(2):
            if output_padding[axis] >= max(stride[axis], dilation[axis]):
                raise ValueError(
                    f"output_padding must be smaller than either stride or dilation, got "
                    f"output_padding={output_padding}, stride={stride}, dilation={dilation}")
        if groups < 1:
            raise ValueError(f"groups must be >= 1, got {groups}")
        for name, value in (("stride", stride), ("padding", padding), ("output_padding", output_padding),
                            ("dilation", dilation), ("groups", (groups,))):
            if max(value) > INT32_MAX:
                raise ValueError(f"{name} must be at most 2**31 - 1, got {value if len(value) == 2 else value[0]}")
        return cls(stride, padding, output_padding, groups, dilation)


@dataclass(frozen=True)
class Geometry:
    """A layer applied to one input shape: everything a kernel launch needs to know about sizes."""

    params: ConvParams
    batch: int
    in_channels: int
    out_channels: int
    in_size: Pair
    kernel: Pair
    out_size: Pair
    batched: bool = True
    # The weight's memory: (C_in, C_out/groups, kH, kW) contiguous, or channels_last, (C_in, kH, kW, C_out/groups)
    # in memory, as ``model.to(memory_format=torch.channels_last)`` leaves it.  Kernels read it, and write
    # grad_weight, in place either way.
    weight_channels_last: bool = False

    def __hash__(self) -> int:
        # Every launch looks a geometry up in a few caches; hash its fields once.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.params, self.batch, self.in_channels, self.out_channels, self.in_size, self.kernel,
                           self.out_size, self.batched, self.weight_channels_last))
            object.__setattr__(self, "_hash", cached)
        return cached

    def with_weight_channels_last(self, channels_last: bool = True) -> "Geometry":
        """The same layer with its weight (and grad_weight) in the other memory layout."""
        if channels_last == self.weight_channels_last:
            return self
        return Geometry(self.params, self.batch, self.in_channels, self.out_channels, self.in_size, self.kernel,
                        self.out_size, self.batched, channels_last)

    @property
    def groups(self) -> int:
        """The number of groups."""
        return self.params.groups

    @property
    def in_per_group(self) -> int:
        """Input channels per group."""
        return self.in_channels // self.params.groups

    @property
    def out_per_group(self) -> int:
        """Output channels per group."""
        return self.out_channels // self.params.groups

    @property
    def input_shape(self) -> Tuple[int, int, int, int]:
        """(N, C_in, H, W), with N = 1 for unbatched input."""
        return (self.batch, self.in_channels) + self.in_size

    @property
    def output_shape(self) -> Tuple[int, int, int, int]:
        """(N, C_out, H_out, W_out), with N = 1 for unbatched input."""
        return (self.batch, self.out_channels) + self.out_size

    @property
    def weight_shape(self) -> Tuple[int, int, int, int]:
        """(C_in, C_out // groups, kH, kW), whatever its memory layout."""
        return (self.in_channels, self.out_per_group) + self.kernel

    def user_shape(self, shape: Sequence[int]) -> Tuple[int, ...]:
        """The 4-D ``shape`` as the caller sees it: without the batch axis for unbatched input."""
        return tuple(shape) if self.batched else tuple(shape[1:])

    def flops(self) -> int:
        """Multiply-adds times two of the forward pass (taps that land outside the output included)."""
        return 2 * self.batch * self.in_channels * self.out_per_group * self.in_size[0] * self.in_size[1] \
            * self.kernel[0] * self.kernel[1]


def geometry(input_shape: Sequence[int], weight_shape: Sequence[int], bias_shape: Optional[Sequence[int]],
             params: ConvParams) -> Geometry:
    """Check the shapes against each other and the parameters, as PyTorch does, and size the output."""
    input_shape, weight_shape = tuple(input_shape), tuple(weight_shape)
    if len(input_shape) not in (3, 4):
        raise ValueError(
            f"input must be 3-D (C_in, H, W) or 4-D (N, C_in, H, W), got shape {input_shape}")
    if len(weight_shape) != 4:
        raise ValueError(
            f"weight must be 4-D (C_in, C_out/groups, kH, kW), got shape {weight_shape}")
    batched = len(input_shape) == 4
    n, c_in, h, w = input_shape if batched else (1,) + input_shape
    # As in torch, an empty batch may also have empty spatial dimensions; channels never.
    if c_in < 1 or (n > 0 and min(h, w) < 1):
        raise ValueError(
            f"input must have non-zero channel and spatial sizes (only an empty batch may have zero-size "
            f"spatial dimensions), got shape {input_shape}")
    if min(weight_shape) < 1:
        raise ValueError(f"weight must have non-zero sizes, got shape {weight_shape}")
    groups = params.groups
    if weight_shape[0] % groups:
        raise ValueError(
            f"groups={groups} must divide the weight's first dimension (C_in={weight_shape[0]})")
    if weight_shape[0] != c_in:
        raise ValueError(
            f"weight of shape {weight_shape} expects {weight_shape[0]} input channels, "
            f"but input of shape {input_shape} has {c_in}")
    c_out = weight_shape[1] * groups
    if bias_shape is not None and tuple(bias_shape) != (c_out,):
        raise ValueError(f"bias must have shape ({c_out},) (C_out), got {tuple(bias_shape)}")
    k = (weight_shape[2], weight_shape[3])
    p = params
    for a, in_size in enumerate((h, w)):
        extent = (in_size - 1) * p.stride[a] + p.dilation[a] * (k[a] - 1) + p.output_padding[a] + 1
        if extent > INT32_MAX:
            raise ValueError(
                f"the layer is too large along axis {a}: (input - 1) * stride + dilation * (kernel - 1) "
                f"+ output_padding + 1 = {extent} exceeds 2**31 - 1 (input {(h, w)}, kernel {k}, stride {p.stride}, "
                f"dilation {p.dilation}, output_padding {p.output_padding})")
    out = tuple(output_length((h, w)[a], k[a], p.stride[a], p.padding[a], p.output_padding[a], p.dilation[a])
                for a in range(2))
    if min(out) < (0 if n == 0 else 1):
        raise ValueError(
            f"the output size {out} is {'negative' if n == 0 else 'not positive'}: input {(h, w)}, kernel {k}, "
            f"stride {p.stride}, "
            f"padding {p.padding}, output_padding {p.output_padding}, dilation {p.dilation}")
    return Geometry(p, n, c_in, c_out, (h, w), k, out, batched)


def output_padding_for(output_size_arg, input_shape: Sequence[int], kernel: Pair, stride: Pair, padding: Pair,
                       dilation: Pair) -> Pair:
    """torch's ``_output_padding``: the output_padding that yields the requested ``output_size``."""
    if isinstance(output_size_arg, bool) or not isinstance(output_size_arg, (list, tuple)) \
            and not hasattr(output_size_arg, "__len__"):
        raise TypeError(f"output_size must be a sequence of ints, got {type(output_size_arg).__name__}")
    requested = [as_int(v, "output_size") for v in output_size_arg]
    if len(requested) == len(input_shape):
        requested = requested[-2:]
    if len(requested) != 2:
        raise ValueError(
            f"output_size must have 2 or {len(input_shape)} elements, got {len(output_size_arg)}")
    result = []
    for a in range(2):
        in_size = input_shape[len(input_shape) - 2 + a]
        smallest = output_length(in_size, kernel[a], stride[a], padding[a], 0, dilation[a])
        largest = smallest + stride[a] - 1
        if not smallest <= requested[a] <= largest:
            raise ValueError(
                f"requested output_size {tuple(requested)} is not possible: each size must lie between "
                f"{smallest} and {largest} along axis {a}")
        result.append(requested[a] - smallest)
    return (result[0], result[1])


def output_mask(value) -> Tuple[bool, bool, bool]:
    """The ``output_mask`` of a backward call: (grad_input, grad_weight, grad_bias) as three bools.

    Every face checks it here, so a mistake gets the same error everywhere: TypeError for
    something that is not a list or tuple of bools (Python's or NumPy's), ValueError for a
    sequence of bools of the wrong length.
    """
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"output_mask must be a sequence of three bools, got {type(value).__name__}")
    for v in value:
        if not (isinstance(v, bool) or (type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"))):
            raise TypeError(f"output_mask must be a sequence of three bools, got {list(value)!r}")
    if len(value) != 3:
        raise ValueError(f"output_mask must have three entries, got {list(value)!r}")
    return bool(value[0]), bool(value[1]), bool(value[2])
