"""TMA descriptors (CUtensorMap) for kernels whose tiles the copy engine copies (sm_90).

A descriptor holds its tensor's address, so it is encoded at launch, from the launch's
pointer, by the driver's ``cuTensorMapEncodeTiled``; everything else about it (sizes,
strides, box, swizzle) is fixed by the plan.  The kernel takes the 128 bytes by value
(``const __grid_constant__ TensorMap``), so a CUDA graph captures them with the launch.
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

# CUtensorMapDataType, CUtensorMapSwizzle and CUtensorMapL2promotion as cuda.h numbers them
_DATA_TYPES = {"float16": 6, "float32": 7, "bfloat16": 9}
_ITEMSIZE = {"float16": 2, "float32": 4, "bfloat16": 2}
_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}
_L2_PROMOTION_256B = 3
_INTERLEAVE_NONE = 0
_OOB_FILL_ZEROS = 0
MAP_BYTES = 128
MAP_ALIGN = 64
MAX_BOX = 256            # elements a box may span along one dimension
MAX_ELEMENT_STRIDE = 8   # the largest traversal stride along one dimension
MAX_RANK = 5


@dataclass(frozen=True)
class TensorMap:
    """A tiled TMA descriptor of launch pointer ``pointer``: a tensor of ``dims`` elements (innermost first,
    ``strides`` in bytes for all but the innermost), copied in boxes of ``box`` elements that step
    ``element_strides`` apart, swizzled by ``swizzle`` bytes (0, 32, 64 or 128)."""

    pointer: int
    dtype: str
    dims: Tuple[int, ...]
    strides: Tuple[int, ...]
    box: Tuple[int, ...]
    element_strides: Tuple[int, ...]
    swizzle: int = 128

    def __post_init__(self) -> None:
        rank, item = len(self.dims), _ITEMSIZE.get(self.dtype)
        if item is None:
            raise ValueError(f"tensor maps hold {sorted(_DATA_TYPES)}, got {self.dtype!r}")
        if not 1 <= rank <= MAX_RANK or len(self.strides) != rank - 1 or len(self.box) != rank \
                or len(self.element_strides) != rank:
            raise ValueError(f"a rank-{rank} tensor map needs {rank - 1} strides, {rank} box sides and element "
                             f"strides, got {self}")
        if any(d < 1 or d >= 2 ** 32 for d in self.dims) or any(s % 16 or s >= 2 ** 40 for s in self.strides):
            raise ValueError(f"tensor map sizes below 2**32 and strides in 16-byte multiples below 2**40, got {self}")
        if any(not 1 <= b <= MAX_BOX for b in self.box) or (self.box[0] * item) % 16:
            raise ValueError(f"tensor map boxes span 1 to {MAX_BOX} elements, the innermost whole 16-byte runs, "
                             f"got {self.box}")
        if any(not 1 <= e <= MAX_ELEMENT_STRIDE for e in self.element_strides):
            raise ValueError(f"element strides run 1 to {MAX_ELEMENT_STRIDE}, got {self.element_strides}")
        if self.swizzle not in _SWIZZLES or (self.swizzle and self.box[0] * item > self.swizzle):
            raise ValueError(f"a {self.swizzle}-byte swizzle takes inner box rows of at most that many bytes")

    @property
    def box_bytes(self) -> int:
        """The bytes one box lands in shared memory (each side ceil(box / element stride) elements)."""
        count = 1
        for b, e in zip(self.box, self.element_strides):
            count *= -(-b // e)
        return count * _ITEMSIZE[self.dtype]


def channels_last(pointer: int, dtype: str, shape: Tuple[int, int, int, int], box: Tuple[int, int, int, int],
                  element_strides: Tuple[int, int, int, int] = (1, 1, 1, 1)) -> TensorMap:
    """The descriptor of a dense channels_last activation of NCHW ``shape``: sizes (C, W, H, N), innermost first,
    each pixel's channels one run."""
    n, c, h, w = shape
    pixel = c * _ITEMSIZE[dtype]
    return TensorMap(pointer, dtype, (c, w, h, n), (pixel, w * pixel, h * w * pixel), box, element_strides)


def fits(box: Tuple[int, ...], element_strides: Tuple[int, ...]) -> bool:
    """Whether the copy engine takes a box of these sides and traversal strides."""
    return all(1 <= b <= MAX_BOX for b in box) and all(1 <= e <= MAX_ELEMENT_STRIDE for e in element_strides)


_encode = None


def _driver_encode():
    """The driver's cuTensorMapEncodeTiled, bound on first use (planning needs no driver).  It declares no
    argument types: each call passes ctypes objects built once (:class:`Encoded`), which ctypes hands on as they
    are, a third of the time of converting declared arguments."""
    global _encode
    if _encode is None:
        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        function = ctypes.CDLL(name).cuTensorMapEncodeTiled
        function.restype = ctypes.c_int
        _encode = function
    return _encode


class Encoded:
    """The 128 bytes of one plan's descriptor, 64-byte aligned for the launch's parameter block, encoded
    again only when the launch's address changes."""

    def __init__(self, spec: TensorMap):
        self.spec = spec
        self._buffer = (ctypes.c_uint8 * (MAP_BYTES + MAP_ALIGN))()
        base = ctypes.addressof(self._buffer)
        self.address = base + (-base) % MAP_ALIGN
        rank = len(spec.dims)
        # the encoder's arguments before the tensor's address and after it, as the C types it takes
        self._head = (ctypes.c_void_p(self.address), ctypes.c_int(_DATA_TYPES[spec.dtype]), ctypes.c_uint32(rank))
        self._tail = ((ctypes.c_uint64 * rank)(*spec.dims), (ctypes.c_uint64 * max(rank - 1, 1))(*spec.strides),
                      (ctypes.c_uint32 * rank)(*spec.box), (ctypes.c_uint32 * rank)(*spec.element_strides),
                      ctypes.c_int(_INTERLEAVE_NONE), ctypes.c_int(_SWIZZLES[spec.swizzle]),
                      ctypes.c_int(_L2_PROMOTION_256B), ctypes.c_int(_OOB_FILL_ZEROS))
        self._encoded_for: Optional[int] = None

    def encode(self, pointer: int) -> None:
        if pointer == self._encoded_for:
            return
        if pointer % 16:
            raise ValueError(f"the copy engine reads tensors from 16-byte aligned addresses, got {pointer:#x}")
        status = _driver_encode()(*self._head, ctypes.c_void_p(pointer), *self._tail)
        if status:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for {self.spec} at {pointer:#x}")
        self._encoded_for = pointer
