"""What kind of array a caller passed, and whether the arrays of one call belong together.

NumPy and CuPy are recognised without importing anything heavy: CuPy is imported only
when a CuPy array can actually be present, and torch never is.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence, Tuple

from .dtypes import DTYPES, SUPPORTED


def kind_of(obj, name: str) -> str:
    """``"numpy"`` or ``"cupy"``; anything else is a TypeError naming the argument."""
    module = type(obj).__module__ or ""
    if module.startswith("cupy") and hasattr(obj, "__cuda_array_interface__"):
        return "cupy"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return "numpy"
    if module.startswith("torch"):
        raise TypeError(
            f"{name} is a torch.Tensor; use cupyconv.torch.conv_transpose2d (or the module) for tensors, "
            f"or pass NumPy/CuPy arrays here")
    raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(obj).__name__}")


def dtype_name(obj, name: str) -> str:
    """The array's dtype as a name; only floating dtypes are accepted."""
    dtype = str(getattr(obj, "dtype", ""))
    if dtype not in DTYPES:
        raise TypeError(f"{name} must have a floating dtype ({SUPPORTED}), got {dtype}")
    return dtype


def device_of(obj, kind: str) -> Optional[int]:
    """CUDA device ordinal for CuPy arrays, ``None`` for host arrays."""
    return int(obj.device.id) if kind == "cupy" else None


def _where(kind: str, device: Optional[int]) -> str:
    return "a NumPy array on the host" if kind == "numpy" else f"a CuPy array on cuda:{device}"


def common_placement(arrays: Sequence[Tuple[str, object]], optional: Sequence[str] = ("bias",)
                     ) -> Tuple[str, Optional[int], str]:
    """Check that the named arrays share kind, device and dtype; returns (kind, device, dtype).

    ``arrays`` is a sequence of (argument name, array); only the names in ``optional``
    may be None.
    """
    first = None
    for name, array in arrays:
        if array is None:
            if name in optional:
                continue
            raise TypeError(f"{name} must be a NumPy or CuPy array, got None")
        kind = kind_of(array, name)
        device = device_of(array, kind)
        dtype = dtype_name(array, name)
        if first is None:
            first = (name, kind, device, dtype)
            continue
        name0, kind0, device0, dtype0 = first
        if (kind, device) != (kind0, device0):
            raise ValueError(
                f"all arrays must be on the same device: {name0} is {_where(kind0, device0)} but {name} is "
                f"{_where(kind, device)}")
        if dtype != dtype0:
            raise TypeError(f"all arrays must have the same dtype: {name0} is {dtype0} but {name} is {dtype}")
    if first is None:
        raise TypeError("no arrays given")
    return first[1], first[2], first[3]
