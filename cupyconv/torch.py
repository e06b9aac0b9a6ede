"""PyTorch integration: custom ops, an autograd-aware functional and a drop-in ``nn.ConvTranspose2d``.

Public API
----------
``conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1)``
    ``torch.nn.functional.conv_transpose2d``'s signature and semantics.
``conv_transpose1d(...)``, ``ConvTranspose1d``
    The same for ``torch.nn.functional.conv_transpose1d`` and ``nn.ConvTranspose1d``,
    run as one-row 2-D layers.
``ConvTranspose2d``
    A subclass of ``torch.nn.ConvTranspose2d`` (same constructor, parameters, state_dict,
    init and repr) whose forward runs cupyconv.
``convert(module)``
    Swaps every ``nn.ConvTranspose2d`` and ``nn.ConvTranspose1d`` of a model for ours, in place,
    keeping the very same Parameter objects (parametrized and uninitialised lazy modules
    are left alone).

Operators (``torch.ops.cupyconv``)
----------------------------------
``conv_transpose2d(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding,
int[] output_padding, int groups, int[] dilation) -> Tensor``

``conv_transpose2d_backward(Tensor grad_output, Tensor input, Tensor weight, int[] stride,
int[] padding, int[] output_padding, int groups, int[] dilation, bool[] output_mask)
-> (Tensor?, Tensor?, Tensor?)``
    ``(grad_input, grad_weight, grad_bias)``; an entry is None where ``output_mask`` is
    False, so no kernel runs for a gradient nobody asked for.

Both are ``torch.library`` operators with fake (meta) kernels, so ``torch.compile`` traces
them without graph breaks.  Their Autograd kernels carry both modes: reverse mode through
the backward operator (which is differentiable again, so double backward and higher work)
and forward mode by linearity; ``torch.func.vmap`` has batching rules for both.  Under
autocast the forward op casts its floating inputs to the autocast dtype, as
``conv_transpose2d`` does in PyTorch.

Transforms: the public functions also work under torch.func (grad, jvp, jacfwd, jacrev,
hessian, vmap), torch.autograd.forward_ad and torch.autograd.functional, with their own
rules (vmap folds batched activations into N and per-sample weights into groups: no
per-sample loop).  Under torch.compile a call that needs forward mode runs outside the
graph.  Output and gradient memory formats follow torch's convolution rules.

Execution: CUDA tensors run on :mod:`cupyconv.engine` (raw pointers, launched on
``torch.cuda.current_stream(input.device)`` with the input's device current, outputs and
split-K scratch from torch's caching allocator, no host synchronisation).  CPU tensors
run on the float64 NumPy reference and are cast back to the input dtype, so everything
(gradcheck, opcheck, torch.compile) can be tested without a GPU.

Host cost: the op dispatcher and a Python autograd kernel cost several times a cuDNN
call's host time.  So plain eager calls (ordinary tensors, no compile, tracing, dispatch
or function mode, functorch transform) take a fast path: the same implementation
functions behind a lean ``torch.autograd.Function`` (applied through its C++ base), or
called directly when no derivative is needed.  torch.func transforms and forward-mode AD
run that Function through ``Function.apply``; everything else goes through the
registered operators.  Both paths run identical kernels and give bitwise-identical
results.  Per configuration (shapes, dtypes, devices, parameters) the validated
geometry is cached, so a repeated call does no validation.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import numpy as _np

try:
    import torch
except ImportError as _exc:
    if _exc.name != "torch":
        raise
    raise ImportError('cupyconv.torch needs PyTorch, which is not installed: pip install "cupyconv[torch]" '
                      '(from a checkout: pip install ".[torch]"), or see https://pytorch.org for a CUDA build') from None
import torch.autograd.forward_ad as _forward_ad

from . import engine as _engine
from . import reference as _reference
from .core import complex_parts as _complex_parts
from .core import dtypes as _dtypes
from .core import one_d as _one_d
from .core.geometry import ConvParams, geometry as _geometry, output_mask as _output_mask
from .jit import compiler as _compiler
from .plans.launch import Launcher as _Launcher
from .torch_batching import backward_rule, forward_rule

__all__ = ["conv_transpose1d", "conv_transpose1d_backward", "conv_transpose2d", "conv_transpose2d_backward",
           "ConvTranspose1d", "ConvTranspose2d", "convert", "tf32_allowed"]

Tensor = torch.Tensor

_DTYPE_NAMES = {getattr(torch, name): name for name in _dtypes.NAMES}
_SUPPORTED = _dtypes.SUPPORTED


def tf32_allowed() -> bool:
    """Whether PyTorch allows TF32 in convolutions (``torch.backends.cudnn.allow_tf32``).

    When it does, float32 layers on the tensor-core kernels multiply in TF32 as cuDNN
    would; otherwise they use three TF32 products per term (3xTF32), which keeps float32
    accuracy.
    """
    if _cudnn_allow_tf32 is not None:
        return _cudnn_allow_tf32()
    return bool(torch.backends.cudnn.allow_tf32)


# What torch.backends.cudnn.allow_tf32 reads, without the module property around it, which
# costs about a microsecond of every call.
_cudnn_allow_tf32 = getattr(torch._C, "_get_cudnn_allow_tf32", None)


# ----------------------------------------------------------------------------- validation

def _check_tensors(named: Sequence[Tuple[str, Optional[Tensor]]]) -> None:
    """Every tensor a supported float dtype, all on one device, all of one dtype."""
    first = None
    for name, t in named:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested or t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got a {'nested' if t.is_nested else t.layout} "
                            f"tensor")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name} must have dtype {_SUPPORTED}, got {t.dtype}")
        if first is None:
            first = (name, t)
            continue
        name0, t0 = first
        if t.device != t0.device:
            raise ValueError(
                f"all tensors must be on the same device: {name0} is on {t0.device} but {name} is on {t.device}")
        if t.dtype != t0.dtype:
            raise TypeError(
                f"all tensors must have the same dtype: {name0} is {t0.dtype} but {name} is {t.dtype}")


def _validate_forward(x, w, b, stride, padding, output_padding, groups, dilation):
    _check_tensors((("input", x), ("weight", w), ("bias", b)))
    params = ConvParams.from_args(stride, padding, output_padding, groups, dilation)
    return _geometry(x.shape, w.shape, None if b is None else b.shape, params)


def _validate_backward(go, x, w, stride, padding, output_padding, groups, dilation, output_mask):
    _check_tensors((("grad_output", go), ("input", x), ("weight", w)))
    _output_mask(output_mask)
    params = ConvParams.from_args(stride, padding, output_padding, groups, dilation)
    g = _geometry(x.shape, w.shape, None, params)
    expected = g.user_shape(g.output_shape)
    if tuple(go.shape) != expected:
        raise ValueError(
            f"grad_output must have the output's shape {expected}, got {tuple(go.shape)}")
    return g


def _is_channels_last(t: Tensor) -> bool:
    """Whether a tensor is laid out channels_last (and not also plain contiguous)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _channels_last(x: Tensor, w: Tensor) -> bool:
    """torch's convolution memory format for the output and grad_input (and mostly grad_weight).

    channels_last when the input or the weight is; grad_output's format does not count.
    torch judges an unbatched input as its unsqueezed batch of one, whose batch stride
    never looks channels_last, so there only the weight counts; and on CUDA float64 always
    stays contiguous (cuDNN's rule).
    """
    if x.dim() == 3:
        channels_last = _is_channels_last(w)
    else:
        channels_last = _is_channels_last(x) or _is_channels_last(w)
    return channels_last and not (x.dtype is torch.float64 and x.is_cuda)


def _grad_weight_channels_last(x: Tensor, w: Tensor) -> bool:
    """grad_weight's memory format: ``_channels_last``, except that on CUDA torch keeps it
    contiguous for an unbatched input whose own strides are channels_last."""
    return _channels_last(x, w) and not (
        x.dim() == 3 and x.is_cuda and x.stride() == _unbatched_channels_last_strides(x.shape)
        and not x.is_contiguous())


def _as_channels_last(t: Tensor) -> Tensor:
    """channels_last memory; an unbatched (C, H, W) tensor gets that of its batch of one."""
    if t.dim() == 3:
        if t.stride() == _unbatched_channels_last_strides(t.shape):
            return t
        return _empty_unbatched_channels_last(t.shape, t.dtype, t.device).copy_(t)
    return t.contiguous(memory_format=torch.channels_last)


def _unbatched_channels_last_strides(shape):
    c, _, w = shape
    return (1, w * c, c)


def _empty_unbatched_channels_last(shape, dtype, device) -> Tensor:
    # allocated with its strides, not as a view of a batch of one: forward-mode AD gives a
    # view's tangent its base's layout
    return torch.empty_strided(tuple(shape), _unbatched_channels_last_strides(shape), dtype=dtype, device=device)


# Per-configuration state of the hot path: validated geometry, dtype name, device.
# Keyed by everything the validation looked at, so a hit needs no validation.
_forward_cache: dict = {}
_backward_cache: dict = {}
_CACHE_LIMIT = 4096


def _key_seq(v):
    return tuple(v) if isinstance(v, list) else v


# Only calls whose parameters are exactly ints or tuples of ints are cached: 2.0 == 2 and
# True == 1 with equal hashes, so a float or bool argument would otherwise find the entry
# of an earlier valid call and skip the validation that rejects it.  [0] and [-1] cover
# pairs and one-element tuples; this runs on every call, so it stays this cheap.

def _plain(v) -> bool:
    t = type(v)
    return t is int or (t is tuple and type(v[0]) is int and type(v[-1]) is int)


def _params_key(stride, padding, output_padding, groups, dilation):
    """The parameters as a cache key (lists become tuples), or None when they must be validated."""
    if type(stride) is list:
        stride = tuple(stride)
    if type(padding) is list:
        padding = tuple(padding)
    if type(output_padding) is list:
        output_padding = tuple(output_padding)
    if type(dilation) is list:
        dilation = tuple(dilation)
    try:
        if (_plain(stride) and _plain(padding) and _plain(output_padding) and type(groups) is int
                and _plain(dilation)):
            return stride, padding, output_padding, groups, dilation
    except IndexError:  # an empty tuple: validation names it
        pass
    return None


class _ForwardEntry:
    """What a forward of one configuration needs, worked out on its first call.

    The cache key holds the tensors' strides, so every layout decision (torch's memory
    format for the output, which inputs must be copied into the kernels' layout) is made
    here once, and a repeated call only allocates, launches and copies what this says.
    """

    __slots__ = ("g", "dtype", "device", "index", "out_shape", "out_strides", "layout", "x_ready", "w_ready",
                 "b_ready", "gw_channels_last", "alloc")

    def __init__(self, g, x, w, b):
        device = x.device
        self.device = device
        self.index = device.index if device.type == "cuda" else -1
        self.dtype = _DTYPE_NAMES[x.dtype]
        self.out_shape = g.user_shape(g.output_shape)
        self.layout = _layout_for(x, w)
        self.out_strides = _layout_strides(self.out_shape, self.layout)
        self.x_ready = _is_in_layout(x, self.layout)
        # A channels_last weight is read in place; any other is read as (C_in, C_out/groups, kH, kW).
        weight_channels_last = _is_channels_last(w)
        self.g = g.with_weight_channels_last(weight_channels_last)
        self.w_ready = weight_channels_last or w.is_contiguous()
        self.b_ready = b is None or b.is_contiguous()
        self.gw_channels_last = _grad_weight_layout(self.layout, x, w, weight_channels_last)
        self.alloc = _scratch_allocator(device)


class _BackwardEntry:
    """What a backward of one configuration needs (as :class:`_ForwardEntry`, for the three gradients)."""

    __slots__ = ("g", "dtype", "device", "index", "layout", "go_ready", "x_ready", "w_ready", "gi_strides",
                 "gw_strides", "gw_channels_last", "alloc")

    def __init__(self, g, go, x, w):
        device = x.device
        self.device = device
        self.index = device.index if device.type == "cuda" else -1
        self.dtype = _DTYPE_NAMES[x.dtype]
        layout = self.layout = _layout_for(x, w)
        self.go_ready = _is_in_layout(go, layout)
        self.x_ready = _is_in_layout(x, layout)
        # The kernels read the weight, and write grad_weight, in the weight's layout: (C_in, C_out/groups, kH, kW)
        # contiguous, or channels_last in place (what model.to(memory_format=torch.channels_last) gives).
        weight_channels_last = _is_channels_last(w)
        self.g = g.with_weight_channels_last(weight_channels_last)
        self.w_ready = weight_channels_last or w.is_contiguous()
        self.gi_strides = _layout_strides(tuple(x.shape), layout)
        self.gw_channels_last = _grad_weight_layout(layout, x, w, weight_channels_last)
        gw_channels_last = weight_channels_last if self.gw_channels_last is None else self.gw_channels_last
        self.gw_strides = _layout_strides(tuple(w.shape), "nhwc" if gw_channels_last else "nchw")
        self.alloc = _scratch_allocator(device)


def _grad_weight_layout(layout: str, x: Tensor, w: Tensor, weight_channels_last: bool) -> Optional[bool]:
    """torch's memory format for grad_weight (channels_last or not), where it differs from the weight's in memory:
    the kernels then write grad_weight in that format, not the weight's.  None where they agree, or where the
    weight's shape makes the two formats one memory (a 1 x 1 kernel, one output channel a group)."""
    gw_channels_last = layout == "nhwc" and _grad_weight_channels_last(x, w)
    if gw_channels_last == weight_channels_last or _one_memory(tuple(w.shape)):
        return None
    return gw_channels_last


@functools.lru_cache(maxsize=256)
def _one_memory(shape) -> bool:
    """Whether a 4-D tensor of ``shape`` is laid out alike contiguous and channels_last."""
    probe = torch.empty(shape, device="meta")
    return probe.dim() != 4 or probe.is_contiguous(memory_format=torch.channels_last)


def _grad_weight_geometry(g, layout: str, x: Tensor, w: Tensor):
    """The geometry the grad_weight pass runs with for these tensors: ``g`` (the weight's layout), or ``g`` with
    the other weight layout where torch's memory format for grad_weight differs (:func:`_grad_weight_layout`)."""
    told = _grad_weight_layout(layout, x, w, g.weight_channels_last)
    return g if told is None else g.with_weight_channels_last(told)


def _tensor_key(t):
    """What of a tensor the validation and the layout decisions look at (RuntimeError for one without strides)."""
    return t.shape, t.stride(), t.dtype, t.device, t.layout


def _forward_entry(x, w, b, stride, padding, output_padding, groups, dilation) -> _ForwardEntry:
    params = _params_key(stride, padding, output_padding, groups, dilation)
    key = entry = None
    if params is not None:
        try:
            # the layouts too: a sparse tensor of a cached shape must still meet validation
            key = (_tensor_key(x), _tensor_key(w), None if b is None else _tensor_key(b)) + params
            entry = _forward_cache.get(key)
        except RuntimeError:  # a tensor without sizes or strides: validation names it
            key = entry = None
    if entry is None:
        g = _validate_forward(x, w, b, stride, padding, output_padding, groups, dilation)
        entry = _ForwardEntry(g, x, w, b)
        if key is not None:
            if len(_forward_cache) >= _CACHE_LIMIT:
                _forward_cache.clear()
            _forward_cache[key] = entry
    return entry


def _backward_entry(go, x, w, stride, padding, output_padding, groups, dilation, output_mask) -> _BackwardEntry:
    params = _params_key(stride, padding, output_padding, groups, dilation)
    key = entry = None
    if params is not None:
        try:
            key = (_tensor_key(go), _tensor_key(x), _tensor_key(w)) + params
            entry = _backward_cache.get(key)
        except RuntimeError:
            key = entry = None
    if entry is None:
        g = _validate_backward(go, x, w, stride, padding, output_padding, groups, dilation, output_mask)
        entry = _BackwardEntry(g, go, x, w)
        if key is not None:
            if len(_backward_cache) >= _CACHE_LIMIT:
                _backward_cache.clear()
            _backward_cache[key] = entry
    elif len(output_mask) != 3:
        _output_mask(output_mask)  # a cached configuration still gets the one error a bad mask gets
    return entry


# ------------------------------------------------------------------------ CUDA execution

_cuda_ready = False
_get_device = _set_device = _raw_stream = None


def _init_cuda() -> None:
    """Bind the few CUDA entry points of the hot path once (imports CuPy lazily)."""
    global _cuda_ready, _get_device, _set_device, _raw_stream
    from cupy.cuda import runtime

    _get_device, _set_device = runtime.getDevice, runtime.setDevice
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    _raw_stream = raw if raw is not None else (lambda index: torch.cuda.current_stream(index).cuda_stream)
    _cuda_ready = True


def _enter_device(index: int) -> int:
    """Make ``index`` the current CUDA device; returns the previous one to restore.

    ``cudaSetDevice`` is called even when ``index`` is already current: on a fresh thread
    (autograd's device threads) it also binds the primary context, which the driver-API
    launch needs.
    """
    if not _cuda_ready:
        _init_cuda()
    prev = _get_device()
    _set_device(index)
    return prev


def _scratch_allocator(device):
    def alloc(nbytes: int):
        t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return t, t.data_ptr()
    return alloc


def _precision(dtype: str) -> str:
    return "tf32" if dtype == "float32" and tf32_allowed() else "strict"


def _layout_for(x: Tensor, w: Tensor) -> str:
    """channels_last memory is read and written in place, by every kernel."""
    return "nhwc" if _channels_last(x, w) else "nchw"


def _in_layout(t: Tensor, layout: str) -> Tensor:
    return _as_channels_last(t) if layout == "nhwc" else t.contiguous()


def _is_in_layout(t: Tensor, layout: str) -> bool:
    """Whether ``_in_layout`` would hand ``t`` back as it is."""
    if layout == "nchw":
        return t.is_contiguous()
    if t.dim() == 3:
        return t.stride() == _unbatched_channels_last_strides(t.shape)
    return t.is_contiguous(memory_format=torch.channels_last)


def _layout_strides(shape, layout: str) -> Tuple[int, ...]:
    """The strides of a new tensor of ``shape`` in ``layout``, as torch lays it out (asked of a meta tensor)."""
    if layout == "nchw":
        return torch.empty(shape, device="meta").stride()
    if len(shape) == 3:
        return _unbatched_channels_last_strides(shape)
    return torch.empty(shape, device="meta", memory_format=torch.channels_last).stride()


def _cuda_forward(x, w, b, entry: _ForwardEntry):
    # Tensors that want gradients let a configuration's first forward start compiling the backward.
    wants = (x.requires_grad, w.requires_grad, b is not None and b.requires_grad)
    if not entry.x_ready:
        x = _in_layout(x, entry.layout)
    if not entry.w_ready:
        w = w.contiguous()
    if not entry.b_ready:
        b = b.contiguous()
    out = x.new_empty_strided(entry.out_shape, entry.out_strides)
    index = entry.index
    prev = _enter_device(index)
    try:
        _engine.forward(entry.g, entry.dtype, x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(),
                        out.data_ptr(), _Launcher(index, _raw_stream(index), entry.alloc), entry.layout,
                        _precision(entry.dtype), wants if wants[0] or wants[1] or wants[2] else None,
                        entry.gw_channels_last)
    finally:
        if prev != index:
            _set_device(prev)
    return out


def _cuda_backward(go, x, w, mask, entry: _BackwardEntry):
    if not entry.go_ready:
        go = _in_layout(go, entry.layout)
    gi = gw = gb = None
    if mask[0]:
        if not entry.w_ready:
            w = w.contiguous()
        gi = x.new_empty_strided(x.shape, entry.gi_strides)
    if mask[1]:
        if not entry.x_ready:
            x = _in_layout(x, entry.layout)
        gw = w.new_empty_strided(w.shape, entry.gw_strides)
    if mask[2]:
        gb = go.new_empty((entry.g.out_channels,))
    index = entry.index
    prev = _enter_device(index)
    try:
        _engine.backward(entry.g, entry.dtype, go.data_ptr(), x.data_ptr(), w.data_ptr(),
                         None if gi is None else gi.data_ptr(), None if gw is None else gw.data_ptr(),
                         None if gb is None else gb.data_ptr(), _Launcher(index, _raw_stream(index), entry.alloc),
                         entry.layout, _precision(entry.dtype), entry.gw_channels_last)
    finally:
        if prev != index:
            _set_device(prev)
    return gi, gw, gb


# ------------------------------------------------------------------- CPU (reference) path

def _to_numpy64(t: Tensor):
    return t.detach().to(torch.float64).resolve_neg().numpy()


def _from_numpy(a, like: Tensor, shape) -> Tensor:
    # reshaped on the NumPy side: an output that is a view of another tensor would confuse
    # forward-mode AD, which gives a view's tangent its base's layout
    return torch.from_numpy(_np.ascontiguousarray(a).reshape(shape)).to(like.dtype)


def _cpu_forward(x, w, b, entry: _ForwardEntry):
    g = entry.g
    p = g.params
    xn = _to_numpy64(x).reshape(g.input_shape)
    y = _reference.conv_transpose2d(xn, _to_numpy64(w), None if b is None else _to_numpy64(b), p.stride,
                                    p.padding, p.output_padding, p.groups, p.dilation)
    out = _from_numpy(y, x, entry.out_shape)
    return _as_channels_last(out) if _channels_last(x, w) else out


def _cpu_backward(go, x, w, mask, entry: _BackwardEntry):
    g = entry.g
    p = g.params
    gi, gw, gb = _reference.conv_transpose2d_backward(
        _to_numpy64(go).reshape(g.output_shape), _to_numpy64(x).reshape(g.input_shape), _to_numpy64(w),
        p.stride, p.padding, p.output_padding, p.groups, p.dilation, tuple(bool(m) for m in mask))
    channels_last = _channels_last(x, w)
    gi = None if gi is None else _from_numpy(gi, x, x.shape)
    if gi is not None and channels_last:
        gi = _as_channels_last(gi)
    gw = None if gw is None else _from_numpy(gw, w, w.shape)
    if gw is not None and _grad_weight_channels_last(x, w):
        gw = _as_channels_last(gw)
    gb = None if gb is None else _from_numpy(gb, go, (g.out_channels,))
    return gi, gw, gb


# ------------------------------------------------------------------ the implementations

def _forward_impl(x, w, b, stride, padding, output_padding, groups, dilation) -> Tensor:
    entry = _forward_entry(x, w, b, stride, padding, output_padding, groups, dilation)
    if entry.index >= 0:
        return _cuda_forward(x, w, b, entry)
    if entry.device.type == "meta":
        return _conv_transpose2d_fake(x, w, b, stride, padding, output_padding, groups, dilation)
    if entry.device.type != "cpu":
        raise NotImplementedError(f"cupyconv runs CUDA and CPU tensors, got a tensor on {entry.device}")
    return _cpu_forward(x, w, b, entry)


def _backward_impl(go, x, w, stride, padding, output_padding, groups, dilation, output_mask):
    entry = _backward_entry(go, x, w, stride, padding, output_padding, groups, dilation, output_mask)
    if not (output_mask[0] or output_mask[1] or output_mask[2]):
        return None, None, None
    if entry.index >= 0:
        return _cuda_backward(go, x, w, output_mask, entry)
    if entry.device.type == "meta":
        return _conv_transpose2d_backward_fake(go, x, w, stride, padding, output_padding, groups, dilation,
                                               output_mask)
    if entry.device.type != "cpu":
        raise NotImplementedError(f"cupyconv runs CUDA and CPU tensors, got a tensor on {entry.device}")
    return _cpu_backward(go, x, w, output_mask, entry)


# ----------------------------------------------------------------------- the operators

_TAGS = tuple(getattr(torch.Tag, name) for name in ("needs_fixed_stride_order", "pt2_compliant_tag")
              if hasattr(torch.Tag, name))

_FORWARD_SCHEMA = ("(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] output_padding, "
                   "int groups, int[] dilation) -> Tensor")
_BACKWARD_SCHEMA = ("(Tensor grad_output, Tensor input, Tensor weight, int[] stride, int[] padding, "
                    "int[] output_padding, int groups, int[] dilation, bool[] output_mask) "
                    "-> (Tensor?, Tensor?, Tensor?)")

# Defined with torch.library rather than torch.library.custom_op because custom_op's
# autograd knows only reverse mode: under forward-mode AD it returns outputs without
# tangents, a silent zero.  Here the Autograd kernel is ours and carries both modes.
_LIB = torch.library.Library("cupyconv", "DEF")
_LIB.define("conv_transpose2d" + _FORWARD_SCHEMA, tags=_TAGS)
_LIB.define("conv_transpose2d_backward" + _BACKWARD_SCHEMA, tags=_TAGS)
# One gradient of the backward (which: 0 input, 1 weight, 2 bias).  torch's legacy vmap
# (torch.autograd.grad's is_grads_batched, torch.autograd.functional's vectorize=True)
# loops over operators without a batching rule, but only over those returning plain
# tensors, which the backward's optional outputs are not.
_LIB.define("_conv_transpose2d_grad(Tensor grad_output, Tensor input, Tensor weight, int[] stride, int[] padding, "
            "int[] output_padding, int groups, int[] dilation, int which) -> Tensor", tags=_TAGS)
_OPS = torch.ops.cupyconv
_FORWARD_OP = _OPS.conv_transpose2d.default
_BACKWARD_OP = _OPS.conv_transpose2d_backward.default
_ONE_GRAD_OP = _OPS._conv_transpose2d_grad.default


def _conv_transpose2d_kernel(input, weight, bias, stride, padding, output_padding, groups, dilation):
    return _forward_impl(input, weight, bias, stride, padding, output_padding, groups, dilation)


def _conv_transpose2d_backward_kernel(grad_output, input, weight, stride, padding, output_padding, groups, dilation,
                                      output_mask):
    return _backward_impl(grad_output, input, weight, stride, padding, output_padding, groups, dilation,
                          output_mask)


def _conv_transpose2d_fake(input, weight, bias, stride, padding, output_padding, groups, dilation):
    g = _validate_forward(input, weight, bias, stride, padding, output_padding, groups, dilation)
    out = input.new_empty(g.user_shape(g.output_shape))
    return _as_channels_last(out) if _channels_last(input, weight) else out


def _conv_transpose2d_backward_fake(grad_output, input, weight, stride, padding, output_padding, groups, dilation,
                                    output_mask):
    g = _validate_backward(grad_output, input, weight, stride, padding, output_padding, groups, dilation,
                           output_mask)
    channels_last = _channels_last(input, weight)
    gi = gw = gb = None
    if output_mask[0]:
        gi = input.new_empty(input.shape)
        if channels_last:
            gi = _as_channels_last(gi)
    if output_mask[1]:
        gw = weight.new_empty(weight.shape)
        if _grad_weight_channels_last(input, weight):
            gw = _as_channels_last(gw)
    if output_mask[2]:
        gb = grad_output.new_empty((g.out_channels,))
    return gi, gw, gb


def _one_hot(which: int):
    if type(which) is not int or not 0 <= which <= 2:
        raise ValueError(f"which must be 0 (grad_input), 1 (grad_weight) or 2 (grad_bias), got {which!r}")
    return [which == 0, which == 1, which == 2]


def _one_grad_kernel(grad_output, input, weight, stride, padding, output_padding, groups, dilation, which):
    return _backward_impl(grad_output, input, weight, stride, padding, output_padding, groups, dilation,
                          _one_hot(which))[which]


def _one_grad_fake(grad_output, input, weight, stride, padding, output_padding, groups, dilation, which):
    return _conv_transpose2d_backward_fake(grad_output, input, weight, stride, padding, output_padding, groups,
                                           dilation, _one_hot(which))[which]


_LIB.impl("conv_transpose2d", _conv_transpose2d_kernel, "CompositeExplicitAutograd")
_LIB.impl("conv_transpose2d_backward", _conv_transpose2d_backward_kernel, "CompositeExplicitAutograd")
_LIB.impl("_conv_transpose2d_grad", _one_grad_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("cupyconv::conv_transpose2d", _conv_transpose2d_fake, lib=_LIB)
torch.library.register_fake("cupyconv::conv_transpose2d_backward", _conv_transpose2d_backward_fake, lib=_LIB)
torch.library.register_fake("cupyconv::_conv_transpose2d_grad", _one_grad_fake, lib=_LIB)


def _params_from(inputs):
    stride, padding, output_padding, groups, dilation = inputs
    return (_key_seq(stride), _key_seq(padding), _key_seq(output_padding), groups, _key_seq(dilation))


def _op_params(params):
    s, p, op, d = (list(_pair(params[i])) for i in (0, 1, 2, 4))
    return s, p, op, params[3], d


def _op_forward(x, w, b, params) -> Tensor:
    return _FORWARD_OP(x, w, b, *_op_params(params))


def _op_backward(go, x, w, params, mask):
    return _BACKWARD_OP(go, x, w, *_op_params(params), list(mask))


# ------------------------------------------------------------------- derivative formulas
#
# y = A_w x + b, where A_w x is the transposed convolution of x with weight w, and the
# backward is (grad_input, grad_weight, grad_bias) = (A_w^T go, B(x, go), sum(go)).  Both
# are linear in each argument, so every derivative is the forward or the backward again:
# differentiable to any order, in either mode, on our own kernels.

def _plus(a, b):
    return b if a is None else a + b


def _formula_channels_last(x, w) -> bool:
    """``_channels_last`` for tensors the legacy vmap may have batched, which have no memory format to ask."""
    return not (_is_legacy_batched(x) or _is_legacy_batched(w)) and _channels_last(x, w)


def _save_forward(ctx, x, w, has_bias, params, output) -> None:
    ctx.params = params
    ctx.has_bias = has_bias
    ctx.save_for_backward(x, w)
    if _forward_ad._current_level >= 0:  # a dual level is open (eager forward AD or torch.func.jvp)
        ctx.save_for_forward(x, w)
        ctx.output_shape = output.shape
        ctx.channels_last = _formula_channels_last(x, w)


def _forward_grads(ctx, grad_output, needs):
    x, w = ctx.saved_tensors
    mask = (needs[0], needs[1], ctx.has_bias and needs[2])
    return _backward(grad_output, x, w, ctx.params, mask)


def _forward_tangent(ctx, dx, dw, db):
    """d(A_w x + b) = A_w dx + A_dw x + db."""
    x, w = ctx.saved_tensors
    t = None
    if dx is not None:
        t = _forward(dx, w, None, ctx.params)
    if dw is not None:
        t = _plus(t, _forward(x, dw, None, ctx.params))
    if db is not None:
        db = db.reshape((-1, 1, 1) if len(ctx.output_shape) == 3 else (1, -1, 1, 1))
        if t is None:
            t = db.expand(ctx.output_shape)
            t = _as_channels_last(t) if ctx.channels_last else t.contiguous()
        else:
            t = t + db
    return t


def _save_backward(ctx, go, x, w, params, mask) -> None:
    ctx.params = params
    ctx.mask = mask
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(go, x, w)
    if _forward_ad._current_level >= 0:
        ctx.save_for_forward(go, x, w)


def _backward_grads(ctx, needs, ggi, ggw, ggb):
    go, x, w = ctx.saved_tensors
    return _double_backward(go, x, w, ctx.params, needs, ggi, ggw, ggb)


def _backward_tangent(ctx, dgo, dx, dw):
    """d(A_w^T go) = A_w^T dgo + A_dw^T go, d B(x, go) = B(x, dgo) + B(dx, go), d sum(go) = sum(dgo)."""
    go, x, w = ctx.saved_tensors
    mask, params = ctx.mask, ctx.params
    gi = gw = gb = None
    if dgo is not None:
        gi, gw, gb = _backward(dgo, x, w, params, mask)
    if dw is not None and mask[0]:
        gi = _plus(gi, _backward(go, x, dw, params, (True, False, False))[0])
    if dx is not None and mask[1]:
        gw = _plus(gw, _backward(go, dx, w, params, (False, True, False))[1])
    # torch's forward AD takes None for a tangent only where the output is None too
    if mask[0] and gi is None:
        gi = _zeros(x, _formula_channels_last(x, w))
    if mask[1] and gw is None:
        gw = _zeros(w, _formula_channels_last(x, w) and _grad_weight_channels_last(x, w))
    if mask[2] and gb is None:
        gb = go.new_zeros((go.shape[-3],))
    return gi, gw, gb


def _zeros(like: Tensor, channels_last: bool) -> Tensor:
    zeros = like.new_zeros(like.shape)
    return _as_channels_last(zeros) if channels_last else zeros


def _double_backward(go, x, w, params, needs, ggi, ggw, ggb):
    """Gradients of (grad_input, grad_weight, grad_bias) = backward(go, x, w) w.r.t. go, x and w."""
    need_go, need_x, need_w = needs
    g_go = g_x = g_w = None
    if need_go:
        if ggi is not None:
            g_go = _forward(ggi, w, None, params)
        if ggw is not None:
            g_go = _plus(g_go, _forward(x, ggw, None, params))
        if ggb is not None:
            shape = (-1, 1, 1) if go.dim() == 3 else (1, -1, 1, 1)
            g_go = _plus(g_go, ggb.reshape(shape).expand(go.shape))
    if need_x and ggw is not None:
        g_x = _backward(go, x, ggw, params, (True, False, False))[0]
    if need_w and ggi is not None:
        g_w = _backward(go, ggi, w, params, (False, True, False))[1]
    return g_go, g_x, g_w


# ----------------------------------------------------------- the operators' autograd
#
# The Autograd kernels run the operators' own kernels below autograd and record these
# nodes, as torch's generated code does for a native operator.

_BelowAutograd = torch._C._AutoDispatchBelowAutograd
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_any_requires_grad = torch._C._any_requires_grad


def _below_autograd(op, keyset, *args):
    """The operator's own kernel (CPU, CUDA, fake...), past the Autograd key."""
    with _BelowAutograd():
        return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)


class _ForwardOpNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, x, w, b, *params):
        out = _below_autograd(_FORWARD_OP, keyset, x, w, b, *params)
        _save_forward(ctx, x, w, b is not None, _params_from(params), out)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return (None,) + _forward_grads(ctx, grad_output, ctx.needs_input_grad[1:4]) + (None,) * 5

    @staticmethod
    def jvp(ctx, _keyset, dx, dw, db, *_params):
        return _forward_tangent(ctx, dx, dw, db)


class _BackwardOpNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, go, x, w, *params_and_mask):
        grads = _below_autograd(_BACKWARD_OP, keyset, go, x, w, *params_and_mask)
        _save_backward(ctx, go, x, w, _params_from(params_and_mask[:5]), tuple(params_and_mask[5]))
        return grads

    @staticmethod
    def backward(ctx, ggi, ggw, ggb):
        return (None,) + _backward_grads(ctx, ctx.needs_input_grad[1:4], ggi, ggw, ggb) + (None,) * 6

    @staticmethod
    def jvp(ctx, _keyset, dgo, dx, dw, *_params_and_mask):
        return _backward_tangent(ctx, dgo, dx, dw)


class _OneGradOpNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, keyset, go, x, w, *params_and_which):
        grad = _below_autograd(_ONE_GRAD_OP, keyset, go, x, w, *params_and_which)
        which = params_and_which[5]
        _save_backward(ctx, go, x, w, _params_from(params_and_which[:5]), tuple(_one_hot(which)))
        ctx.which = which
        return grad

    @staticmethod
    def backward(ctx, grad):
        grads = [None, None, None]
        grads[ctx.which] = grad
        return (None,) + _backward_grads(ctx, ctx.needs_input_grad[1:4], *grads) + (None,) * 6

    @staticmethod
    def jvp(ctx, _keyset, dgo, dx, dw, *_params_and_which):
        return _backward_tangent(ctx, dgo, dx, dw)[ctx.which]


_FunctionBase_apply = torch._C._FunctionBase.__dict__["apply"]


def _autograd_kernel(op, node):
    apply = _FunctionBase_apply.__get__(None, node)

    def kernel(keyset, *args):
        if _functorch_active():
            # reached only by calling the operator itself inside grad/jvp transforms; the
            # public functions carry their own torch.func rules
            raise NotImplementedError(
                f"torch.ops.{op._schema.name.replace('::', '.')} supports torch.func.vmap but no other torch.func "
                f"transform when called directly: use cupyconv.torch.conv_transpose2d, which supports them all")
        if (_grad_enabled() and _any_requires_grad(*args)) or _forward_ad._current_level >= 0:
            return apply(keyset, *args)
        return _below_autograd(op, keyset, *args)
    return kernel


_LIB.impl("conv_transpose2d", _autograd_kernel(_FORWARD_OP, _ForwardOpNode), "Autograd", with_keyset=True)
_LIB.impl("conv_transpose2d_backward", _autograd_kernel(_BACKWARD_OP, _BackwardOpNode), "Autograd",
          with_keyset=True)
_LIB.impl("_conv_transpose2d_grad", _autograd_kernel(_ONE_GRAD_OP, _OneGradOpNode), "Autograd", with_keyset=True)


def _forward_op_vmap(info, in_dims, x, w, b, *params):
    return forward_rule(_op_forward, info.batch_size, in_dims, x, w, b, params)


def _backward_op_vmap(info, in_dims, go, x, w, *params_and_mask):
    return backward_rule(_op_backward, info.batch_size, in_dims, go, x, w, params_and_mask[:5], params_and_mask[5])


torch.library.register_vmap("cupyconv::conv_transpose2d", _forward_op_vmap, lib=_LIB)
torch.library.register_vmap("cupyconv::conv_transpose2d_backward", _backward_op_vmap, lib=_LIB)


def _autocast_kernel(device_type: str):
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def kernel(_keyset, input, weight, bias, stride, padding, output_padding, groups, dilation):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            input, weight, bias = _autocast_cast(device_type, input, weight, bias)
            return _FORWARD_OP(input, weight, bias, stride, padding, output_padding, groups, dilation)
    return kernel


# The autocast dtype is chosen at run time (float16 or bfloat16), which
# torch.library.register_autocast cannot express, so the rule is registered by hand.
for _device_type in ("cuda", "cpu"):
    _LIB.impl("conv_transpose2d", _autocast_kernel(_device_type),
              "Autocast" + torch._C._dispatch_key_for_device(_device_type), with_keyset=True)
del _device_type


def _autocast_cast(device_type: str, *tensors):
    """Autocast's rule: floating tensors on ``device_type`` that are not float64 go to the autocast dtype."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.device.type == device_type
                 and t.dtype is not torch.float64 else t for t in tensors)


# ------------------------------------------------------------- the differentiable functions
#
# What the public functions run.  Plain eager calls (ordinary tensors, no compile, tracing,
# dispatch or function mode, torch.func transform) take a fast path: the implementation
# directly when no derivative is wanted, else the node below applied through the C++ base
# of autograd.Function.  Under torch.func transforms and forward-mode AD the same node
# runs through autograd.Function.apply, which gives torch.func its grad, jvp and vmap rules.
# Everything else (compile, tracing, dispatch modes) calls the operators.

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_tracing_state = torch._C._get_tracing_state
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_grad_enabled = torch.is_grad_enabled


def _plain_eager(a, b, c) -> bool:
    """True for an ordinary eager call: plain tensors and nothing intercepting ops."""
    return (type(a) in _PLAIN_TYPES and type(b) in _PLAIN_TYPES and (c is None or type(c) in _PLAIN_TYPES)
            and not _is_compiling() and not _dispatch_modes() and not _function_mode()
            and not _functorch_active() and _tracing_state() is None)


_is_legacy_batched = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", lambda t: False)


def _kernels_can_run(a, b, c) -> bool:
    """``_plain_eager``, and no tensor batched by the legacy vmap.

    torch.autograd.functional's ``vectorize=True`` and gradcheck's batched checks hand the
    derivative formulas tangents and grad_outputs batched that way; only the dispatcher
    can unbatch them.
    """
    return _plain_eager(a, b, c) and not (_is_legacy_batched(a) or _is_legacy_batched(b)
                                          or (c is not None and _is_legacy_batched(c)))


class _ConvTranspose2dFunction(torch.autograd.Function):
    """The forward with its reverse, forward-mode and vmap rules."""

    @staticmethod
    def forward(x, w, b, params):
        if _kernels_can_run(x, w, b):
            return _forward_impl(x, w, b, *params)
        return _op_forward(x, w, b, params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, b, params = inputs
        _save_forward(ctx, x, w, b is not None, params, output)

    @staticmethod
    def backward(ctx, grad_output):
        return _forward_grads(ctx, grad_output, ctx.needs_input_grad[:3]) + (None,)

    @staticmethod
    def jvp(ctx, dx, dw, db, _params):
        return _forward_tangent(ctx, dx, dw, db)

    @staticmethod
    def vmap(info, in_dims, x, w, b, params):
        return forward_rule(_forward, info.batch_size, in_dims, x, w, b, params)


class _ConvTranspose2dBackwardFunction(torch.autograd.Function):
    """The backward with its reverse (double backward), forward-mode and vmap rules."""

    @staticmethod
    def forward(go, x, w, params, mask):
        if _kernels_can_run(go, x, w):
            return _backward_impl(go, x, w, *params, mask)
        return _op_backward(go, x, w, params, mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        go, x, w, params, mask = inputs
        _save_backward(ctx, go, x, w, params, mask)

    @staticmethod
    def backward(ctx, ggi, ggw, ggb):
        return _backward_grads(ctx, ctx.needs_input_grad[:3], ggi, ggw, ggb) + (None, None)

    @staticmethod
    def jvp(ctx, dgo, dx, dw, _params, _mask):
        return _backward_tangent(ctx, dgo, dx, dw)

    @staticmethod
    def vmap(info, in_dims, go, x, w, params, mask):
        return backward_rule(_backward, info.batch_size, in_dims, go, x, w, params, mask)


class _EagerConvTranspose2d(_ConvTranspose2dFunction):
    """The node plain eager calls apply: their callers have made the checks of the general forward, but for
    the legacy vmap's batched tensors, which only the operator can take."""

    @staticmethod
    def forward(x, w, b, params):
        if _is_legacy_batched(x) or _is_legacy_batched(w) or (b is not None and _is_legacy_batched(b)):
            return _op_forward(x, w, b, params)
        return _forward_impl(x, w, b, *params)


class _EagerConvTranspose2dBackward(_ConvTranspose2dBackwardFunction):
    """The backward's node for plain eager calls, which apply it once ``_kernels_can_run`` holds."""

    @staticmethod
    def forward(go, x, w, params, mask):
        return _backward_impl(go, x, w, *params, mask)


# Function.apply's Python wrapper re-checks what _plain_eager already established
# (no functorch transform active) and binds default args we don't have; its C++ base
# does the actual work.  Calling the base directly saves several microseconds a call.
_apply_forward = _FunctionBase_apply.__get__(None, _EagerConvTranspose2d)
_apply_backward = _FunctionBase_apply.__get__(None, _EagerConvTranspose2dBackward)
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", lambda t: t)


def _derivatives_forward_mode() -> bool:
    """Whether a call may need forward-mode or torch.func rules: a dual level is open or a transform runs."""
    return _forward_ad._current_level >= 0 or _functorch_active()


# torch.compile cannot trace an autograd.Function with a jvp rule, so under compile a call
# that needs one runs outside the graph (a graph break; fullgraph=True says so).  The
# wrappers are made on first use: torch.compiler.disable imports the compiler stack.
_outside_graph = {}


def _run_outside_graph(fn, *args):
    wrapped = _outside_graph.get(fn)
    if wrapped is None:
        wrapped = _outside_graph[fn] = torch.compiler.disable(fn)
    return wrapped(*args)


def _apply_forward_function(x, w, b, params):
    return _ConvTranspose2dFunction.apply(x, w, b, params)


def _apply_backward_function(go, x, w, params, mask):
    return _ConvTranspose2dBackwardFunction.apply(go, x, w, params, mask)


def _forward(x, w, b, params) -> Tensor:
    """Differentiable forward: the fast path in plain eager mode, the function or the op otherwise."""
    if _kernels_can_run(x, w, b):
        if (_forward_ad._current_level >= 0
                or (_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)))):
            return _apply_forward(x, w, b, params)
        return _forward_impl(x, w, b, *params)
    if _derivatives_forward_mode():
        if _is_compiling():
            return _run_outside_graph(_apply_forward_function, x, w, b, params)
        return _ConvTranspose2dFunction.apply(x, w, b, params)
    return _op_forward(x, w, b, params)


def _backward(go, x, w, params, mask):
    """Differentiable backward: (grad_input, grad_weight, grad_bias), None where ``mask`` is False."""
    if not (mask[0] or mask[1] or mask[2]):
        return None, None, None
    mask = (bool(mask[0]), bool(mask[1]), bool(mask[2]))
    if _kernels_can_run(go, x, w):
        if (_forward_ad._current_level >= 0
                or (_grad_enabled() and (go.requires_grad or x.requires_grad or w.requires_grad))):
            return _apply_backward(go, x, w, params, mask)
        return _backward_impl(go, x, w, *params, mask)
    if _is_legacy_batched(go) or _is_legacy_batched(x) or _is_legacy_batched(w):
        op_params = _op_params(params)
        return tuple(_ONE_GRAD_OP(go, x, w, *op_params, i) if mask[i] else None for i in range(3))
    if _derivatives_forward_mode():
        if _is_compiling():
            return _run_outside_graph(_apply_backward_function, go, x, w, params, mask)
        return _ConvTranspose2dBackwardFunction.apply(go, x, w, params, mask)
    return _op_backward(go, x, w, params, mask)


def _pair(v):
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, list):
        return tuple(v)
    return v


# --------------------------------------------------------------------------- public API

def conv_transpose2d(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride=1, padding=0,
                     output_padding=0, groups: int = 1, dilation=1) -> Tensor:
    """``torch.nn.functional.conv_transpose2d`` computed by cupyconv (differentiable).

    ``input`` is (N, C_in, H, W) or unbatched (C_in, H, W), ``weight`` (C_in, C_out/groups,
    kH, kW), ``bias`` (C_out,) or None; ``stride``, ``padding``, ``output_padding`` and
    ``dilation`` are ints or pairs.  All tensors must share one device and one dtype
    (float16, bfloat16, float32 or float64).  channels_last input gives channels_last output.
    """
    if _plain_eager(input, weight, bias):
        if input.is_complex():
            return _complex_forward(input, weight, bias, stride, padding, output_padding, groups, dilation)
        if _any_autocast() and torch.is_autocast_enabled(input.device.type):
            input, weight, bias = _autocast_cast(input.device.type, input, weight, bias)
        # Ints and tuples key the per-configuration cache as they are; lists are not hashable.
        params = (stride if type(stride) is not list else tuple(stride),
                  padding if type(padding) is not list else tuple(padding),
                  output_padding if type(output_padding) is not list else tuple(output_padding),
                  groups, dilation if type(dilation) is not list else tuple(dilation))
        if (_forward_ad._current_level >= 0
                or (_grad_enabled() and (input.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad)))):
            return _apply_forward(_unwrap_if_dead(input), _unwrap_if_dead(weight),
                                  None if bias is None else _unwrap_if_dead(bias), params)
        return _forward_impl(input, weight, bias, *params)
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if (t is not None or name != "bias") and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.is_complex():
        return _complex_forward(input, weight, bias, stride, padding, output_padding, groups, dilation)
    return _forward(input, weight, bias, (_pair(stride), _pair(padding), _pair(output_padding), groups,
                                          _pair(dilation)))


def conv_transpose2d_backward(grad_output: Tensor, input: Tensor, weight: Tensor, stride=1, padding=0,
                              output_padding=0, groups: int = 1, dilation=1,
                              output_mask: Sequence[bool] = (True, True, True)):
    """Gradients of :func:`conv_transpose2d`: ``(grad_input, grad_weight, grad_bias)``.

    An entry is None where ``output_mask`` is False (and its kernel does not run).
    grad_bias is ``grad_output`` summed over all but the channel axis, whether or not the
    forward had a bias.  Differentiable (double backward).
    """
    for name, t in (("grad_output", grad_output), ("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _output_mask(output_mask)
    params = (_pair(stride), _pair(padding), _pair(output_padding), groups, _pair(dilation))
    if input.is_complex():
        return _complex_backward(grad_output, input, weight, params, tuple(output_mask))
    return _backward(grad_output, input, weight, params, tuple(output_mask))


# ------------------------------------------------------------------------- complex tensors
#
# Three real layers per complex one (core/complex_parts.py), composed from torch's own
# differentiable .real/.imag views and torch.complex: autograd, forward AD, vmap and
# compile then hold for complex tensors as they do for real ones.

def _check_complex(named) -> None:
    first = None
    for name, t in named:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if first is None:
            first = (name, t.dtype)
        elif t.dtype != first[1]:
            raise TypeError(f"all tensors must have the same dtype: {first[0]} is {first[1]} but {name} is {t.dtype}")
    if first[1] not in (torch.complex64, torch.complex128):
        raise TypeError(f"{first[0]} must have dtype {_SUPPORTED}, complex64 or complex128, got {first[1]}")


def _real_parts(t: Tensor, layout: str):
    """t's real and imaginary parts, each dense in ``layout`` (a complex tensor's parts are strided views)."""
    return _in_layout(t.real, layout), _in_layout(t.imag, layout)


def _complex_forward(x, w, b, stride, padding, output_padding, groups, dilation) -> Tensor:
    _check_complex((("input", x), ("weight", w), ("bias", b)))
    _geometry(x.shape, w.shape, None if b is None else b.shape,
              ConvParams.from_args(stride, padding, output_padding, groups, dilation))
    layout = _layout_for(x, w)
    x_re, x_im = _real_parts(x, layout)
    w_re, w_im = _real_parts(w, layout)

    def conv(a, c):
        return conv_transpose2d(a, c, None, stride, padding, output_padding, groups, dilation)
    re, im = _complex_parts.forward(conv, x_re, x_im, w_re, w_im)
    if b is not None:
        shape = (-1, 1, 1) if re.dim() == 3 else (1, -1, 1, 1)
        re, im = re + b.real.reshape(shape), im + b.imag.reshape(shape)
    return torch.complex(re, im)


def _complex_backward(go, x, w, params, mask):
    _check_complex((("grad_output", go), ("input", x), ("weight", w)))
    layout = _layout_for(x, w)
    go_re, go_im = _real_parts(go, layout)
    x_re, x_im = _real_parts(x, layout)
    w_re, w_im = _real_parts(w, layout)
    gi = gw = gb = None
    if mask[0]:
        gi = torch.complex(*_complex_parts.grad_input(
            lambda g, c: _backward(g, x_re, c, params, (True, False, False))[0], go_re, go_im, w_re, w_im))
    if mask[1]:
        gw = torch.complex(*_complex_parts.grad_weight(
            lambda a, g: _backward(g, a, w_re, params, (False, True, False))[1], x_re, x_im, go_re, go_im))
    if mask[2]:
        gb = torch.complex(*(_backward(g, x_re, w_re, params, (False, False, True))[2] for g in (go_re, go_im)))
    return gi, gw, gb


def conv_transpose1d(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride=1, padding=0,
                     output_padding=0, groups: int = 1, dilation=1) -> Tensor:
    """``torch.nn.functional.conv_transpose1d`` computed by cupyconv (differentiable).

    ``input`` is (N, C_in, L) or unbatched (C_in, L), ``weight`` (C_in, C_out/groups, k);
    it runs on the 2-D kernels as a one-row layer, with no copy.
    """
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    s, p, op, d = _one_d.params_2d(stride, padding, output_padding, dilation)
    _one_d.check_ranks(input.shape, weight.shape)
    # contiguous first: torch has no channels_last for 1-D layers, and the one-row view of a
    # transposed (N, L, C) input would look channels_last to the 2-D rules
    return conv_transpose2d(input.contiguous().unsqueeze(-2), weight.contiguous().unsqueeze(-2), bias, s, p, op,
                            groups, d).squeeze(-2)


def conv_transpose1d_backward(grad_output: Tensor, input: Tensor, weight: Tensor, stride=1, padding=0,
                              output_padding=0, groups: int = 1, dilation=1,
                              output_mask: Sequence[bool] = (True, True, True)):
    """Gradients of :func:`conv_transpose1d`: ``(grad_input, grad_weight, grad_bias)``, None where masked."""
    for name, t in (("grad_output", grad_output), ("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    s, p, op, d = _one_d.params_2d(stride, padding, output_padding, dilation)
    _one_d.check_ranks(input.shape, weight.shape)
    if grad_output.dim() != input.dim():
        raise ValueError(f"grad_output must have the output's rank {input.dim()}, got shape {tuple(grad_output.shape)}")
    gi, gw, gb = conv_transpose2d_backward(*(t.contiguous().unsqueeze(-2) for t in (grad_output, input, weight)), s,
                                           p, op, groups, d, output_mask)
    return (None if gi is None else gi.squeeze(-2)), (None if gw is None else gw.squeeze(-2)), gb


class _CupyconvForward:
    """What the cupyconv modules share: torch's forward signature and output_size handling."""

    _spatial_dims: int
    _functional = None

    def forward(self, input: Tensor, output_size: Optional[List[int]] = None) -> Tensor:
        if self.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
        if output_size is None:
            output_padding = self.output_padding
        else:
            if not isinstance(input, torch.Tensor):
                raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
            if isinstance(output_size, torch.Tensor):
                # torch takes an integer tensor here; its elements would reach us as 0-d tensors
                if output_size.is_floating_point() or output_size.is_complex() or output_size.dim() != 1:
                    raise TypeError(f"output_size must be a sequence of ints, got a tensor of dtype "
                                    f"{output_size.dtype} and shape {tuple(output_size.shape)}")
                output_size = output_size.tolist()
            output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size,
                                                  self._spatial_dims, self.dilation)
        return type(self)._functional(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                      self.groups, self.dilation)


class ConvTranspose2d(_CupyconvForward, torch.nn.ConvTranspose2d):
    """Drop-in ``torch.nn.ConvTranspose2d`` whose forward runs cupyconv.

    Same constructor, parameters, state_dict keys, initialisation and repr as the torch
    module (it is a subclass and inherits them); ``padding_mode`` other than 'zeros' is a
    ValueError, as in torch.
    """

    _spatial_dims = 2
    _functional = staticmethod(conv_transpose2d)

    @functools.wraps(torch.nn.ConvTranspose2d.__init__)   # torch's signature
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _compiler.warm_up()   # NVRTC's one-off start-up, while the rest of the model is built


class ConvTranspose1d(_CupyconvForward, torch.nn.ConvTranspose1d):
    """Drop-in ``torch.nn.ConvTranspose1d`` whose forward runs cupyconv (as a one-row 2-D layer).

    Same constructor, parameters, state_dict keys, initialisation and repr as the torch module.
    """

    _spatial_dims = 1
    _functional = staticmethod(conv_transpose1d)

    @functools.wraps(torch.nn.ConvTranspose1d.__init__)   # torch's signature
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _compiler.warm_up()   # NVRTC's one-off start-up, while the rest of the model is built


_REPLACEMENTS = ((ConvTranspose2d, torch.nn.ConvTranspose2d), (ConvTranspose1d, torch.nn.ConvTranspose1d))


def _replacement(m):
    """The cupyconv class that replaces ``m``, or None where ``m`` is left alone."""
    for ours, theirs in _REPLACEMENTS:
        if isinstance(m, theirs):
            return None if isinstance(m, ours) else ours
    return None


def _converted(old: torch.nn.Module) -> torch.nn.Module:
    """A cupyconv module sharing ``old``'s parameters, buffers, hooks, attributes and training mode."""
    cls = _replacement(old)
    new = cls.__new__(cls)
    state = dict(old.__dict__)
    for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        if name in state:
            state[name] = type(state[name])(state[name])
    new.__dict__.update(state)
    return new


def _convertible(m) -> bool:
    if _replacement(m) is None:
        return False
    lazy = getattr(m, "has_uninitialized_params", None)
    if lazy is not None and lazy():
        return False
    # torch.nn.utils.parametrize swaps the class for a generated one that owns the
    # parametrized attributes: such modules are left as they are.
    return not torch.nn.utils.parametrize.is_parametrized(m)


def convert(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.ConvTranspose2d`` and ``nn.ConvTranspose1d`` (or subclass) in ``module`` by
    :class:`ConvTranspose2d` and :class:`ConvTranspose1d`, in place.

    The replacements keep the same Parameter objects (so optimisers and tied weights still
    see them), device, dtype, hooks and training mode; a module used at several places
    is replaced by one shared module.  Returns ``module``, or its replacement when
    ``module`` itself is a transposed convolution.
    """
    done = {}

    def swap(m):
        key = id(m)
        if key not in done:
            done[key] = _converted(m)
            _compiler.warm_up()   # NVRTC's start-up, before the first call needs it
        return done[key]

    if _convertible(module):
        return swap(module)
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if child is not None and _convertible(child):
                parent._modules[name] = swap(child)
    return module
