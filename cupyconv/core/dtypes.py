"""The dtypes cupyconv computes in: one table, read by every face, planner and tool.

fp16 and bf16 are stored in two bytes and accumulate in fp32; float32 and float64
accumulate in their own precision.  CuPy has no bfloat16, so such arrays reach the
kernels as raw pointers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class DType:
    name: str               # "float32": NumPy's and torch's name
    c_type: str             # the storage type in the kernel templates
    itemsize: int           # bytes per element
    accumulator_bytes: int  # bytes per element of split-K partial sums
    tensor_cores: bool      # whether the tensor-core kernels take it (float32 as TF32 or 3xTF32)


DTYPES: Dict[str, DType] = {d.name: d for d in (
    DType("float16", "half_t", 2, 4, True),
    DType("bfloat16", "bf16_t", 2, 4, True),
    DType("float32", "float", 4, 4, True),
    DType("float64", "double", 8, 8, False),
)}
NAMES = tuple(DTYPES)
SUPPORTED = ", ".join(NAMES)
# torch's dtype aliases (torch.float is torch.float32, and so on)
_ALIASES = {"float": "float32", "half": "float16", "double": "float64"}


def get(name: str) -> DType:
    """The entry of a dtype name; TypeError for anything that is not one of :data:`NAMES`."""
    entry = DTYPES.get(name)
    if entry is None:
        raise TypeError(f"dtype must be one of {SUPPORTED}, got {name!r}")
    return entry


def dtype_name(dtype, what: str = "dtype") -> str:
    """The name of a dtype given as a string, a NumPy dtype or scalar type, a torch dtype or an array's dtype.

    Raises TypeError naming ``what`` for anything that is not one of :data:`NAMES`.
    """
    if isinstance(dtype, str):
        name = dtype
    elif str(dtype).startswith("torch."):
        name = str(dtype)[len("torch."):]
    else:
        try:
            import numpy

            name = numpy.dtype(dtype).name
        except TypeError:
            name = str(getattr(dtype, "name", dtype))
    name = _ALIASES.get(name, name)
    if name not in DTYPES:
        raise TypeError(f"{what} must be one of {SUPPORTED}, got {dtype}")
    return name


# float32 multiplies in full precision ("strict": 3xTF32 on tensor cores) or in TF32 where
# the caller allows it, as torch.backends.cudnn.allow_tf32 does for cuDNN.
PRECISIONS = ("strict", "tf32")


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
