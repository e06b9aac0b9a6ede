"""Running a layer on the GPU from raw device pointers.

Both front ends (the NumPy/CuPy array API and the torch integration) allocate their
outputs with their own allocator and call in here with pointers, a device ordinal and a
stream handle.  Nothing here synchronises the host.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

from . import launch
from .geometry import Geometry

_sm_counts: Dict[int, int] = {}


def sm_count(device_id: int) -> int:
    count = _sm_counts.get(device_id)
    if count is None:
        import cupy

        count = _sm_counts[device_id] = int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])
    return count


def _zero(ptr: int, nbytes: int, stream_ptr: int) -> None:
    from cupy.cuda import runtime

    if nbytes:
        runtime.memsetAsync(ptr, 0, nbytes, stream_ptr)


def forward(g: Geometry, dtype: str, x: int, weight: int, bias: Optional[int], out: int, device_id: int,
            stream_ptr: int) -> None:
    """out = conv_transpose2d(x, weight, bias); all pointers to contiguous NCHW buffers."""
    if g.batch == 0:
        return
    plan = launch.plan_forward(g, dtype, bias is not None)
    plan.run(device_id, stream_ptr, (x, weight, bias or 0, out))


def grad_input(g: Geometry, dtype: str, grad_out: int, weight: int, out: int, device_id: int,
               stream_ptr: int) -> None:
    if g.batch == 0:
        return
    launch.plan_grad_input(g, dtype).run(device_id, stream_ptr, (grad_out, weight, out))


def grad_weight(g: Geometry, dtype: str, x: int, grad_out: int, out: int, device_id: int, stream_ptr: int,
                alloc: launch.Allocator) -> None:
    if g.batch == 0:
        _zero(out, math.prod(g.weight_shape) * launch.DTYPES[dtype][2], stream_ptr)
        return
    partial, reduce = launch.plan_grad_weight(g, dtype, sm_count(device_id))
    launch.run_split_k(partial, reduce, device_id, stream_ptr, (x, grad_out), out, alloc)


def grad_bias(g: Geometry, dtype: str, grad_out: int, out: int, device_id: int, stream_ptr: int,
              alloc: launch.Allocator) -> None:
    if g.batch == 0:
        _zero(out, g.out_channels * launch.DTYPES[dtype][2], stream_ptr)
        return
    partial, reduce = launch.plan_grad_bias(g, dtype, sm_count(device_id))
    launch.run_split_k(partial, reduce, device_id, stream_ptr, (grad_out,), out, alloc)
