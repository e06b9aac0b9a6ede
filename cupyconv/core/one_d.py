"""1-D transposed convolution as a one-row 2-D layer.

An input (N, C, L) is the image (N, C, 1, L), a weight (C_in, C_out/groups, k) the kernel
(C_in, C_out/groups, 1, k), and each hyper-parameter ``v`` the pair ``(neutral, v)``: the
2-D kernels then run the layer with no copy, and every 2-D check applies.
"""
from __future__ import annotations

import numbers
from typing import Tuple

from .geometry import as_int


def as_single(value, name: str) -> int:
    """torch's ``_single``: an int, or a sequence of one int."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{name} must be an int or a sequence of one int for a 1-D convolution, got "
                             f"{len(value)} values: {tuple(value)!r}")
        return as_int(value[0], name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or a sequence of one int, got {type(value).__name__} {value!r}")
    return int(value)


def params_2d(stride, padding, output_padding, dilation) -> Tuple[tuple, tuple, tuple, tuple]:
    """The 2-D (stride, padding, output_padding, dilation) of a 1-D layer's arguments."""
    return ((1, as_single(stride, "stride")), (0, as_single(padding, "padding")),
            (0, as_single(output_padding, "output_padding")), (1, as_single(dilation, "dilation")))


def check_ranks(input_shape, weight_shape, input_name: str = "input") -> None:
    """A 1-D layer takes (N, C, L) or (C, L) inputs and (C_in, C_out/groups, k) weights."""
    if len(input_shape) not in (2, 3):
        raise ValueError(f"{input_name} must be 3-D (N, C_in, L) or 2-D unbatched (C_in, L) for a 1-D transposed "
                         f"convolution, got shape {tuple(input_shape)}")
    if len(weight_shape) != 3:
        raise ValueError(f"weight must be 3-D (C_in, C_out/groups, k) for a 1-D transposed convolution, got shape "
                         f"{tuple(weight_shape)}")
