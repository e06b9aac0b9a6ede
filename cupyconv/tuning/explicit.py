"""``tune()``: time the candidate kernels of layers now, rather than on their first call.

It finds each layer's configurations (a module, a dict of arguments, or a whole model
run once on an example input), asks the pass table for each pass's candidates, times
them on random data through :mod:`.decide`, and keeps the fastest in this process and on
disk.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace as _replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from ..core import device as _device
from ..core import dtypes
from ..core.geometry import ConvParams, Geometry, geometry
from ..plans import table
from ..plans.launch import Launcher, cupy_allocator
from . import decide

TUNED_PASSES = (table.FORWARD, table.GRAD_INPUT, table.GRAD_WEIGHT)

@dataclass
class TuneResult:
    """What :func:`tune` chose for one layer applied to one input shape."""

    layer: str
    input_shape: Tuple[int, ...]
    dtype: str
    layout: str
    precision: str
    choices: Dict[str, str]                  # pass -> variant name
    sources: Dict[str, str]                  # pass -> "tuned", "stored" or "heuristic"
    times_ms: Dict[str, Dict[str, float]]    # pass -> variant name -> median ms

    def __str__(self) -> str:
        picks = ", ".join(f"{p}={v} ({self.sources[p]})" for p, v in self.choices.items())
        return f"{self.layer} on {self.input_shape} {self.dtype} {self.layout}: {picks}"


@dataclass(frozen=True)
class _Job:
    name: str
    g: Geometry
    dtype: str
    layout: str
    precision: str
    has_bias: bool
    device: Optional[int]


_LAYER_KEYS = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "output_padding", "groups",
               "dilation", "bias")
_LAYOUT_NAMES = {"nchw": "nchw", "contiguous": "nchw", "nhwc": "nhwc", "channels_last": "nhwc"}


def _torch_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _torch_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _shape_of(value, what: str) -> Tuple[int, ...]:
    shape = getattr(value, "shape", value)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"{what} must be a shape (a sequence of ints) or a tensor, got {type(value).__name__}") \
            from None
    if len(shape) not in (3, 4):
        raise ValueError(f"{what} must be (N, C_in, H, W) or (C_in, H, W), got {shape}")
    return shape


def _precision_for(dtype: str, precision: Optional[str], torch_layer: bool) -> str:
    if precision is None:
        precision = "strict"
        if torch_layer and dtype == "float32":
            torch = sys.modules.get("torch")
            if torch is not None and torch.backends.cudnn.allow_tf32:
                precision = "tf32"
    dtypes.check_precision(precision)
    return precision


def _layout_name(layout: Optional[str], example) -> str:
    if layout is None:
        if _torch_tensor(example) and example.dim() == 4 and not example.is_contiguous() \
                and example.is_contiguous(memory_format=sys.modules["torch"].channels_last):
            return "nhwc"
        return "nchw"
    if layout not in _LAYOUT_NAMES:
        raise ValueError(f"layout must be one of {sorted(_LAYOUT_NAMES)}, got {layout!r}")
    return _LAYOUT_NAMES[layout]


def _example(example, dtype, layout):
    """(shape, dtype name or None, layout, CUDA device or None) of an input given as a tensor or a shape."""
    shape = _shape_of(example, "input_shape")
    if _torch_tensor(example):
        device = example.device.index if example.device.type == "cuda" else None
        name = dtypes.dtype_name(dtype if dtype is not None else example.dtype)
        return shape, name, _layout_name(layout, example), device
    return shape, None if dtype is None else dtypes.dtype_name(dtype), _layout_name(layout, None), None


def _module_job(name: str, m, example, dtype, layout, precision) -> _Job:
    if getattr(m, "padding_mode", "zeros") != "zeros":
        raise ValueError(f"{name}: only padding_mode='zeros' is supported, got {m.padding_mode!r}")
    shape, dt, layout, device = _example(example, dtype, layout)
    weight = m.weight
    dt = dt or dtypes.dtype_name(weight.dtype)
    if device is None and weight.device.type == "cuda":
        device = weight.device.index
    params = ConvParams.from_args(m.stride, m.padding, m.output_padding, m.groups, m.dilation)
    g = geometry(shape, tuple(weight.shape), None, params)
    return _Job(name, g, dt, layout, _precision_for(dt, precision, True), m.bias is not None, device)


def _dict_job(spec: dict, example, dtype, layout, precision) -> _Job:
    unknown = set(spec) - set(_LAYER_KEYS)
    if unknown:
        raise TypeError(f"unknown layer arguments {sorted(unknown)}; expected ConvTranspose2d's {_LAYER_KEYS}")
    missing = [k for k in ("in_channels", "out_channels", "kernel_size") if k not in spec]
    if missing:
        raise TypeError(f"a layer dict needs {missing}")
    from ..core.geometry import as_int, as_pair

    params = ConvParams.from_args(spec.get("stride", 1), spec.get("padding", 0), spec.get("output_padding", 0),
                                  spec.get("groups", 1), spec.get("dilation", 1))
    cin, cout = as_int(spec["in_channels"], "in_channels"), as_int(spec["out_channels"], "out_channels")
    if cin < 1 or cout < 1 or cin % params.groups or cout % params.groups:
        raise ValueError(f"in_channels={cin} and out_channels={cout} must be positive multiples of "
                         f"groups={params.groups}")
    k = as_pair(spec["kernel_size"], "kernel_size")
    shape, dt, layout, device = _example(example, dtype, layout)
    dt = dt or "float32"
    g = geometry(shape, (cin, cout // params.groups) + k, None, params)
    name = (f"ConvTranspose2d({cin}, {cout}, kernel_size={k}, stride={params.stride}, padding={params.padding}, "
            f"output_padding={params.output_padding}, groups={params.groups}, dilation={params.dilation})")
    return _Job(name, g, dt, layout, _precision_for(dt, precision, False), bool(spec.get("bias", True)), device)


def _model_jobs(model, example, dtype, layout, precision) -> List[_Job]:
    """Run ``model`` once on ``example`` (a tensor, or a shape for random data) to see each layer's input."""
    torch = sys.modules["torch"]
    convs = {m: n or type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.ConvTranspose2d)}
    if not convs:
        return []
    if not _torch_tensor(example):
        first = next(iter(model.parameters()), None)
        example = torch.randn(_shape_of(example, "input_shape"),
                              device=None if first is None else first.device,
                              dtype=None if first is None else first.dtype)
    seen = []

    def hook(module, args):
        if args and _torch_tensor(args[0]):
            # the tensor itself only as far as _example reads it: no activation is kept alive
            seen.append((module,) + _example(args[0], dtype, layout))

    training = {m: m.training for m in model.modules()}
    handles = [m.register_forward_pre_hook(hook) for m in convs]
    try:
        model.eval()  # no batch-norm statistics change because of tuning
        with torch.no_grad(), decide.suspended():
            model(example)
    finally:
        for h in handles:
            h.remove()
        for m, mode in training.items():
            m.training = mode
    jobs = []
    for module, shape, dt, lay, device in seen:
        job = _module_job(convs[module], module, shape, dt, lay, precision)
        jobs.append(job if device is None else _replace(job, device=device))
    return jobs


def _jobs(layers, input_shape, dtype=None, layout=None, precision=None) -> List[_Job]:
    """The (layer, input) configurations that ``tune`` was asked about, in order, without repeats."""
    if dtype is not None:
        dtype = dtypes.dtype_name(dtype)
    items = layers if isinstance(layers, (list, tuple)) and not _is_pair(layers) else [layers]
    jobs: List[_Job] = []
    for item in items:
        if _is_pair(item):
            layer, example = item
        else:
            layer, example = item, input_shape
        if example is None:
            raise TypeError("tune needs an input shape for each layer: pass input_shape=... or (layer, shape) pairs")
        if isinstance(layer, dict):
            jobs.append(_dict_job(layer, example, dtype, layout, precision))
        elif _torch_module(layer):
            torch = sys.modules["torch"]
            if isinstance(layer, torch.nn.ConvTranspose2d):
                jobs.append(_module_job(type(layer).__name__, layer, example, dtype, layout, precision))
            else:
                jobs += _model_jobs(layer, example, dtype, layout, precision)
        else:
            raise TypeError(f"a layer must be a torch ConvTranspose2d, a model containing them or a dict of "
                            f"ConvTranspose2d arguments, got {type(layer).__name__}")
    unique = {}
    for job in jobs:
        unique.setdefault((job.g, job.dtype, job.layout, job.precision, job.has_bias, job.device), job)
    return list(unique.values())


def _is_pair(obj) -> bool:
    return (isinstance(obj, tuple) and len(obj) == 2 and (isinstance(obj[0], dict) or _torch_module(obj[0]))
            and not isinstance(obj[1], (dict, int)) and not _torch_module(obj[1]))


def _random(cupy, shape, dtype: str):
    """Activations or weights for timing: random normals, in the storage type the kernels read."""
    values = cupy.random.standard_normal(math.prod(shape), dtype=cupy.float32)
    if dtype == "bfloat16":
        return (values.view(cupy.uint32) >> 16).astype(cupy.uint16)
    return values.astype(dtype)


def _tune_job(job: _Job, passes: Sequence[str], device_id: int, repeat: int, force: bool) -> TuneResult:
    import cupy

    g, dtype, layout, precision = job.g, job.dtype, job.layout, job.precision
    device = _device.get(device_id)
    cands = {p: table.candidates(p, g, dtype, layout, precision, device) for p in passes}
    result = TuneResult(job.name, g.user_shape(g.input_shape), dtype, layout, precision, {}, {}, {})
    timed = [p for p in passes if g.batch and len(cands[p]) > 1]
    for pass_ in passes:
        if pass_ not in timed:
            result.choices[pass_], result.sources[pass_], result.times_ms[pass_] = cands[pass_][0].name, "heuristic", {}
    if not timed:
        return result
    storage = "uint16" if dtype == "bfloat16" else dtype
    with cupy.cuda.Device(device_id):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            # Inputs hold random data; each output is written by every candidate in turn.
            x = _random(cupy, g.input_shape, dtype) if {table.FORWARD, table.GRAD_WEIGHT} & set(timed) else None
            w = _random(cupy, g.weight_shape, dtype) if {table.FORWARD, table.GRAD_INPUT} & set(timed) else None
            b = _random(cupy, (g.out_channels,), dtype) if job.has_bias and table.FORWARD in timed else None
            y = _random(cupy, g.output_shape, dtype)
            dx = cupy.empty(math.prod(g.input_shape), dtype=storage) if table.GRAD_INPUT in timed else None
            dw = cupy.empty(math.prod(g.weight_shape), dtype=storage) if table.GRAD_WEIGHT in timed else None
            launcher = Launcher(device_id, stream.ptr, cupy_allocator())
            pointers = {}
            if table.FORWARD in timed:
                pointers[table.FORWARD] = (x.data.ptr, w.data.ptr, 0 if b is None else b.data.ptr, y.data.ptr)
            if table.GRAD_INPUT in timed:
                pointers[table.GRAD_INPUT] = (y.data.ptr, w.data.ptr, dx.data.ptr)
            if table.GRAD_WEIGHT in timed:
                pointers[table.GRAD_WEIGHT] = (x.data.ptr, y.data.ptr, dw.data.ptr)
            for pass_ in timed:
                ptrs = pointers[pass_]

                def plan(v, p=pass_):
                    return table.plan(p, v, g, dtype, layout, precision, job.has_bias, True, device.sm_count)

                decision = decide.decide(pass_, g, dtype, layout, precision, device, stream.ptr, cands[pass_],
                                         lambda v, plan=plan, ptrs=ptrs: plan(v).run(launcher, ptrs),
                                         lambda v, plan=plan: plan(v).plans(),
                                         repeat=repeat, explicit=True, force=force)
                if decide.enabled():
                    decide.remember((pass_, g, dtype, layout, precision, device_id), decision.variant)
                result.choices[pass_], result.sources[pass_] = decision.variant.name, decision.source
                result.times_ms[pass_] = dict(decision.times_ms)
        stream.synchronize()
        del x, w, b, y, dx, dw
    return result


def tune(layers, input_shape=None, *, dtype=None, layout: Optional[str] = None, precision: Optional[str] = None,
         device: Optional[int] = None, passes: Iterable[str] = TUNED_PASSES, repeat: int = decide.TUNE_REPEAT,
         force: bool = False, progress: Optional[bool] = None) -> List[TuneResult]:
    """Time the candidate kernels of each layer now and keep the fastest, in this process and on disk.

    ``layers`` is one layer or a list of them.  A layer is a ``torch.nn.ConvTranspose2d``
    (``cupyconv.torch.ConvTranspose2d`` too), a dict of ``ConvTranspose2d`` arguments
    (``in_channels``, ``out_channels``, ``kernel_size``, optionally ``stride``, ``padding``,
    ``output_padding``, ``groups``, ``dilation``, ``bias``), a ``(layer, input_shape)`` pair,
    or a whole model: then ``input_shape`` (a tensor, or a shape for random data) is run
    through the model once, in eval mode without gradients, to find each transposed
    convolution's input.

    ``input_shape`` is ``(N, C_in, H, W)`` or ``(C_in, H, W)``, or a tensor (its shape,
    dtype, layout and device are used).  ``dtype``: a module's weight dtype, or float32
    for dicts, unless given.  ``layout``: "nchw" or "channels_last" (the tensor's, else
    "nchw").  ``precision`` for float32: "strict" or "tf32"; by default what the layer
    runs with, i.e. torch's ``torch.backends.cudnn.allow_tf32`` for modules and strict
    (as the NumPy/CuPy API runs) for dicts.  ``device``: the CUDA device (default: the
    module's, else CuPy's current one).

    Stored choices are reused unless ``force``.  ``repeat`` timed runs follow a warm-up
    per candidate.  A progress bar (tqdm) is shown for more than one layer unless
    ``progress=False``.  Returns one :class:`TuneResult` per distinct configuration.
    Layers run with the choices unless ``CUPYCONV_AUTOTUNE=0``.
    """
    passes = tuple(passes)
    for p in passes:
        if p not in TUNED_PASSES:
            raise ValueError(f"pass must be one of {TUNED_PASSES}, got {p!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    jobs = _jobs(layers, input_shape, dtype, layout, precision)
    if not jobs:
        return []
    if not _device.gpu_present():
        raise RuntimeError("cupyconv.tune needs a CUDA GPU usable through CuPy")
    import cupy

    show = progress if progress is not None else len(jobs) > 1
    bar = None
    if show:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(jobs), desc="cupyconv tune", unit="layer")
        except ImportError:
            bar = None
    results = []
    try:
        for job in jobs:
            dev = device if device is not None else job.device if job.device is not None \
                else cupy.cuda.runtime.getDevice()
            results.append(_tune_job(job, passes, int(dev), repeat, force))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return results

