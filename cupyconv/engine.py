"""Running a layer on the GPU from raw device pointers.

Both front ends (the NumPy/CuPy array API and the torch integration) allocate their
outputs with their own allocator and call in here with pointers, a device ordinal and a
stream handle.  Nothing here synchronises the host, except a configuration's first call
when :mod:`cupyconv.tuning` times its candidate kernels.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Dict, Optional

from . import launch, tuning
from .geometry import Geometry

TENSOR_CORES_ENV = "CUPYCONV_TENSOR_CORES"
_sm_counts: Dict[int, int] = {}
_tensor_core_devices: Dict[int, bool] = {}


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


def _tensor_cores(device_id: int) -> bool:
    ok = _tensor_core_devices.get(device_id)
    if ok is None:
        import cupy

        major = int(cupy.cuda.Device(device_id).compute_capability[:-1] or 0)
        ok = _tensor_core_devices[device_id] = major >= 8
    return ok


def uses_gemm(g: Geometry, dtype: str, device_id: int) -> bool:
    """Whether this layer runs on the tensor-core implicit-GEMM kernels on ``device_id``.

    Those need sm_80 or newer and a GEMM with at least 16 channels per group on both
    sides; thinner layers (grouped, depthwise) waste most of each mma on padding and
    run faster on the direct kernels.  ``CUPYCONV_TENSOR_CORES=0`` turns them off.
    Both kinds read and write channels_last memory in place.
    """
    return gemm_eligible(g, dtype) and _tensor_cores(device_id)


def gemm_eligible(g: Geometry, dtype: str) -> bool:
    """The device-independent half of :func:`uses_gemm`."""
    return os.environ.get(TENSOR_CORES_ENV, "1").strip() != "0" and _gemm_shape(g, dtype)


@functools.lru_cache(maxsize=1024)
def _gemm_shape(g: Geometry, dtype: str) -> bool:
    # Asked on every launch (the torch layer asks once more to pick a layout): cache it.
    return min(g.in_per_group, g.out_per_group) >= 16 and launch.gemm_fits(g, dtype)


def _aligned(*pointers: int) -> bool:
    return all(p % 16 == 0 for p in pointers)


def forward(g: Geometry, dtype: str, x: int, weight: int, bias: Optional[int], out: int, device_id: int,
            stream_ptr: int, alloc: launch.Allocator, layout: str = "nchw", precision: str = "strict") -> None:
    """out = conv_transpose2d(x, weight, bias).

    Activations are contiguous in ``layout`` ("nchw", or "nhwc" for channels_last) and the
    weight is contiguous (C_in, C_out/groups, kH, kW).  ``precision`` is "strict" (fp32
    accuracy for float32) or "tf32"; it only matters for float32.  ``alloc`` provides
    stream-ordered scratch (the repacked weight of the tensor-core path).  The kernel
    variant is :mod:`cupyconv.tuning`'s choice; the first call of a configuration may
    time the candidates on ``stream_ptr``, writing each into ``out`` before the winner.
    """
    if g.batch == 0:
        return
    args = (g, dtype, x, weight, bias, out, device_id, stream_ptr, alloc, layout, precision)
    _run_forward(_variant(tuning.FORWARD, _run_forward, args, bias is not None, (x, out)), *args)


def grad_input(g: Geometry, dtype: str, grad_out: int, weight: int, out: int, device_id: int,
               stream_ptr: int, alloc: launch.Allocator, layout: str = "nchw", precision: str = "strict",
               copies: Optional[launch.SourceCopies] = None) -> None:
    """out = grad_input; arguments as :func:`forward`.

    ``copies``: channels_last copies of NCHW sources to share with :func:`grad_weight`
    in the same backward call (grad_output is read by both).
    """
    if g.batch == 0:
        return
    args = (g, dtype, grad_out, weight, out, device_id, stream_ptr, alloc, layout, precision)
    _run_grad_input(_variant(tuning.GRAD_INPUT, _run_grad_input, args, False, (grad_out, out)), *args,
                    copies=copies)


def grad_weight(g: Geometry, dtype: str, x: int, grad_out: int, out: int, device_id: int, stream_ptr: int,
                alloc: launch.Allocator, layout: str = "nchw", precision: str = "strict",
                copies: Optional[launch.SourceCopies] = None) -> None:
    """out = grad_weight (in the weight's dtype, reduced in a fixed order); see :func:`grad_input` for ``copies``."""
    if g.batch == 0:
        _zero(out, math.prod(g.weight_shape) * launch.DTYPES[dtype][2], stream_ptr)
        return
    args = (g, dtype, x, grad_out, out, device_id, stream_ptr, alloc, layout, precision)
    _run_grad_weight(_variant(tuning.GRAD_WEIGHT, _run_grad_weight, args, False, (x, grad_out)), *args,
                     copies=copies)


def _variant(pass_: str, runner, args: tuple, has_bias: bool = False, activations: tuple = ()) -> tuning.Variant:
    """The variant to run: direct without tensor cores, else the tuner's choice (a dict lookup once made).

    ``args`` are ``runner``'s arguments after the variant; they start with the geometry and
    dtype and end with device, stream, allocator, layout and precision.  ``activations``
    are the pointers whose alignment picks the GEMM's load path.
    """
    g, dtype = args[0], args[1]
    device_id, stream_ptr, _, layout, precision = args[-5:]
    if not uses_gemm(g, dtype, device_id):
        return tuning.DIRECT
    v = tuning.chosen(pass_, g, dtype, layout, precision, device_id)
    if v is None:
        v = tuning.choose(pass_, g, dtype, layout, precision, device_id, stream_ptr, lambda c: runner(c, *args),
                          lambda c: tuning._plan(pass_, c, g, dtype, layout, precision, has_bias,
                                                 _aligned(*activations), sm_count(device_id)))
    return v


def _run_forward(v: tuning.Variant, g: Geometry, dtype: str, x: int, weight: int, bias: Optional[int], out: int,
                 device_id: int, stream_ptr: int, alloc: launch.Allocator, layout: str, precision: str) -> None:
    if v.gemm:
        plans = launch.plan_forward_gemm(g, dtype, bias is not None, layout, precision, aligned=_aligned(x, out),
                                         **v.kwargs)
        plans.run(device_id, stream_ptr, x, weight, bias or 0, out, alloc)
    else:
        launch.plan_forward(g, dtype, bias is not None, layout).run(device_id, stream_ptr, (x, weight, bias or 0, out))


def _run_grad_input(v: tuning.Variant, g: Geometry, dtype: str, grad_out: int, weight: int, out: int,
                    device_id: int, stream_ptr: int, alloc: launch.Allocator, layout: str, precision: str,
                    copies: Optional[launch.SourceCopies] = None) -> None:
    if v.gemm:
        plans = launch.plan_grad_input_gemm(g, dtype, layout, precision, aligned=_aligned(grad_out, out), **v.kwargs)
        plans.run(device_id, stream_ptr, grad_out, weight, 0, out, alloc, copies)
    else:
        launch.plan_grad_input(g, dtype, layout).run(device_id, stream_ptr, (grad_out, weight, out))


def _run_grad_weight(v: tuning.Variant, g: Geometry, dtype: str, x: int, grad_out: int, out: int, device_id: int,
                     stream_ptr: int, alloc: launch.Allocator, layout: str, precision: str,
                     copies: Optional[launch.SourceCopies] = None) -> None:
    if v.gemm:
        aligned = _aligned(x, grad_out)
        partial, reduce = launch.plan_grad_weight_gemm(g, dtype, sm_count(device_id), layout, precision,
                                                       aligned=aligned, **v.kwargs)
        launch.run_grad_weight_gemm(g, dtype, partial, reduce, device_id, stream_ptr, x, grad_out, out, alloc,
                                    layout, aligned, copies)
    else:
        partial, reduce = launch.plan_grad_weight(g, dtype, sm_count(device_id), layout)
        launch.run_split_k(partial, reduce, device_id, stream_ptr, (x, grad_out), out, alloc)


def grad_bias(g: Geometry, dtype: str, grad_out: int, out: int, device_id: int, stream_ptr: int,
              alloc: launch.Allocator, layout: str = "nchw") -> None:
    if g.batch == 0:
        _zero(out, g.out_channels * launch.DTYPES[dtype][2], stream_ptr)
        return
    partial, reduce = launch.plan_grad_bias(g, dtype, sm_count(device_id), layout)
    launch.run_split_k(partial, reduce, device_id, stream_ptr, (grad_out,), out, alloc)
