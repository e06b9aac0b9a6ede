"""``explain``: what cupyconv would launch for a layer, and how fast it could possibly be.

For the forward pass and each gradient this reports the kernels that a call launches for
the given layout, dtype and precision (the pass table's families and the tuner's choice,
replayed on a recorder: the very code path a call takes), each kernel's template,
function and
specialisation constants), its grid, block and runtime scalars, the copy engine's (TMA)
descriptors of the tensors it reads that way, the split-K scratch, the
fully substituted CUDA source, the FLOPs and minimum bytes of the pass, and a roofline
floor on its time.  Register, shared- and local-memory use are read from the compiled
kernel when a GPU is present.  Everything else is pure Python: ``explain`` works on a
machine without a GPU, and imports torch only when it is given a torch module.

    >>> from cupyconv import explain
    >>> e = explain((8, 32, 64, 64), (32, 16, 4, 4), stride=2, padding=1, layout="channels_last")
    >>> print(e)                          # plain text; e.show_source = True for whole sources
    >>> e.passes[0].floor_s, e.kernels[0].grid

In a notebook the result renders as Markdown/HTML with collapsible sources.
"""
from __future__ import annotations

import html
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from . import engine
from .core import device as _device
from .core import dtypes, one_d
from .core.device import DEFAULT_PEAK, PEAK_TABLE, Peak
from .core.geometry import ConvParams, Geometry, geometry, output_mask as _output_mask, output_padding_for
from .plans.launch import Plan, Recorder, RecordedPass

__all__ = ["explain", "Explanation", "KernelRecord", "PassRecord", "Peak", "device_peak", "DEFAULT_PEAK",
           "PEAK_TABLE"]

NA_NO_GPU = "n/a without a GPU"


def device_peak(device_id: int = 0) -> Peak:
    """Roofline peaks for CUDA device ``device_id`` (table by name, else from its attributes)."""
    return _device.get(device_id).peak


# ---------------------------------------------------------------------------- records

@dataclass
class KernelRecord:
    """One kernel launch of one pass."""

    pass_name: str                 # "forward", "grad_input", "grad_weight" or "grad_bias"
    stage: str                     # "main", "partial" (split-K pass) or "reduce"
    template: str
    function: str
    variant: str                   # "template:function" plus the tile constants that select it
    constants: Dict[str, object]
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    scalars: Dict[str, int]        # runtime arguments, by their names in the kernel signature
    index_t: str
    scratch_bytes: int
    flops: int                     # this launch's arithmetic (reduces count their additions)
    bytes: int                     # this launch's minimum traffic, split-K scratch included
    floor_s: float
    bound: str                     # "memory" or "compute"
    registers: Optional[int] = None
    shared_bytes: Optional[int] = None
    local_bytes: Optional[int] = None
    max_threads_per_block: Optional[int] = None
    resources: str = NA_NO_GPU     # "from the compiled kernel on device N", or why not
    source: str = field(default="", repr=False)
    tensor_maps: List[str] = field(default_factory=list)   # the copy engine's descriptors, one line each

    @property
    def threads(self) -> int:
        """Threads launched: grid size times block size."""
        return _prod(self.grid) * _prod(self.block)


@dataclass
class PassRecord:
    """The forward pass or one gradient: its useful work, minimum traffic and roofline floor."""

    name: str
    flops: int
    bytes: int                     # inputs read once + outputs written once (no scratch)
    compute_s: float
    memory_s: float
    floor_s: float
    bound: str
    kernels: List[KernelRecord]
    note: str = ""
    variant: str = ""              # the tuning variant that runs (family and options), "" when nothing runs


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


# --------------------------------------------------------------------------- formatting

def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _time(seconds: float) -> str:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1000 else _si(n, "B")


def _tuple(t) -> str:
    return repr(tuple(int(v) for v in t))


def _kv(d: Dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def _resources_text(k: KernelRecord) -> str:
    if k.registers is None:
        return f"registers / shared / local memory: {k.resources}"
    return (f"registers {k.registers}/thread, shared {_bytes(k.shared_bytes or 0)}, local "
            f"{_bytes(k.local_bytes or 0)}, max threads/block {k.max_threads_per_block} ({k.resources})")


def _elide(source: str, head: int = 8, tail: int = 4) -> List[str]:
    lines = source.splitlines()
    if len(lines) <= head + tail + 1:
        return lines
    return lines[:head] + [f"... {len(lines) - head - tail} lines elided (show_source=True shows them) ..."] \
        + lines[-tail:]


# ------------------------------------------------------------------------ the explanation

@dataclass
class Explanation:
    """What cupyconv launches for one layer and input shape; print it or show it in a notebook."""

    layer: Dict[str, object]       # the layer's arguments, normalised
    input_shape: Tuple[int, ...]
    weight_shape: Tuple[int, ...]
    output_shape: Tuple[int, ...]
    dtype: str
    geometry: Geometry
    device: str                    # the GPU's name, or "no GPU"
    gpu: bool
    peak: Peak
    sm_count: int
    backend: str                   # cupyconv.backend() here: where NumPy inputs would run
    passes: List[PassRecord]
    notes: List[str]
    show_source: bool = False
    layout: str = "nchw"           # "nchw" or "nhwc" (channels_last) activations
    precision: str = "strict"      # float32 multiplies: "strict" or "tf32"

    @property
    def kernels(self) -> List[KernelRecord]:
        """Every kernel launch, in pass order."""
        return [k for p in self.passes for k in p.kernels]

    def pass_(self, name: str) -> PassRecord:
        """The pass called ``name`` ("forward", "grad_input", "grad_weight" or "grad_bias"); KeyError if absent."""
        for p in self.passes:
            if p.name == name:
                return p
        raise KeyError(f"no pass {name!r}; have {[p.name for p in self.passes]}")

    @property
    def floor_s(self) -> float:
        """Roofline floor of the forward plus every gradient reported."""
        return sum(p.floor_s for p in self.passes)

    def to_dict(self) -> dict:
        """Plain data (JSON-friendly apart from tuples), sources included."""
        return dict(layer=self.layer, input_shape=self.input_shape, weight_shape=self.weight_shape,
                    output_shape=self.output_shape, dtype=self.dtype, device=self.device, gpu=self.gpu,
                    peak=asdict(self.peak), sm_count=self.sm_count, backend=self.backend,
                    passes=[dict(asdict(p), kernels=[dict(asdict(k), threads=k.threads) for k in p.kernels])
                            for p in self.passes],
                    notes=list(self.notes), floor_s=self.floor_s, layout=self.layout, precision=self.precision)

    # -- headings shared by the renderings
    def _title(self) -> str:
        L = self.layer
        return (f"ConvTranspose{1 if L.get('one_d') else 2}d({L['in_channels']}, {L['out_channels']}, "
                f"kernel_size={_tuple(L['kernel_size'])}, "
                f"stride={_tuple(L['stride'])}, padding={_tuple(L['padding'])}, "
                f"output_padding={_tuple(L['output_padding'])}, groups={L['groups']}, "
                f"dilation={_tuple(L['dilation'])}, bias={L['bias']}), {self.dtype}")

    def _peak_line(self) -> str:
        p = self.peak
        return (f"roofline peaks: {_si(p.bandwidth, 'B/s')}, {_si(p.flops(self.dtype), 'FLOP/s')} "
                f"({'fp64' if self.dtype == 'float64' else 'fp32'} CUDA cores) - {p.source}")

    def _pass_line(self, p: PassRecord) -> str:
        other = p.compute_s if p.bound == "memory" else p.memory_s
        runs = f" [variant {p.variant}]" if p.variant else ""
        return (f"{p.name}{runs}: {_si(p.flops, 'FLOP')}, {_bytes(p.bytes)} min traffic -> floor {_time(p.floor_s)} "
                f"({p.bound}-bound; {'compute' if p.bound == 'memory' else 'memory'} term {_time(other)})")

    def _memory_line(self) -> str:
        layout = "channels_last (NHWC)" if self.layout == "nhwc" else "contiguous (NCHW)"
        weight = ", weight channels_last (read and written in place)" if self.geometry.weight_channels_last else ""
        precision = f", float32 precision {self.precision}" if self.dtype == "float32" else ""
        return f"activations {layout}{weight}{precision}"

    # -- plain text
    def text(self, show_source: Optional[bool] = None) -> str:
        """The plain-text report (what ``print`` shows).

        Each kernel's source is shortened to its first and last lines unless
        ``show_source`` (default: this explanation's ``show_source``) is true.
        """
        show = self.show_source if show_source is None else show_source
        out = [f"cupyconv.explain: {self._title()}",
               f"input {_tuple(self.input_shape)} x weight {_tuple(self.weight_shape)} -> output "
               f"{_tuple(self.output_shape)}",
               f"device: {self.device}; NumPy inputs run on backend {self.backend!r}",
               self._memory_line(),
               self._peak_line()]
        out += [f"note: {n}" for n in self.notes]
        for p in self.passes:
            out += ["", "== " + self._pass_line(p)]
            if p.note:
                out.append(f"   {p.note}")
            for i, k in enumerate(p.kernels, 1):
                out += [f"  [{i}] {k.stage}: {k.variant}",
                        f"      constants: {_kv(k.constants)}",
                        f"      grid {_tuple(k.grid)} x block {_tuple(k.block)} = {k.threads} threads; "
                        f"index_t {k.index_t}; scratch {_bytes(k.scratch_bytes)}",
                        f"      scalars: {_kv(k.scalars)}"]
                out += [f"      tensor map: {m}" for m in k.tensor_maps]
                out += [f"      {_resources_text(k)}",
                        f"      this launch: {_si(k.flops, 'FLOP')}, {_bytes(k.bytes)} -> floor {_time(k.floor_s)} "
                        f"({k.bound}-bound)"]
                lines = k.source.splitlines() if show else _elide(k.source)
                out.append(f"      source ({len(k.source.splitlines())} lines):")
                out += ["      | " + line for line in lines]
        out += ["", f"total floor, forward + gradients: {_time(self.floor_s)}"]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return (f"<Explanation {self._title()}; input {_tuple(self.input_shape)}; "
                f"{len(self.kernels)} kernels; floor {_time(self.floor_s)}>")

    # -- notebooks
    def markdown(self) -> str:
        """The report as Markdown: pass and kernel tables, each whole source in a collapsible block."""
        md = [f"### cupyconv.explain: `{self._title()}`", "",
              f"input `{_tuple(self.input_shape)}` x weight `{_tuple(self.weight_shape)}` -> output "
              f"`{_tuple(self.output_shape)}`  ",
              f"device: {self.device}; NumPy inputs run on backend `{self.backend}`  ",
              f"{self._memory_line()}  ",
              self._peak_line()]
        md += [f"- note: {n}" for n in self.notes]
        md += ["", "| pass | variant | FLOPs | min bytes | compute | memory | floor | bound | kernels |",
               "|---|---|---|---|---|---|---|---|---|"]
        for p in self.passes:
            md.append(f"| {p.name} | {p.variant or '-'} | {_si(p.flops, 'FLOP')} | {_bytes(p.bytes)} | "
                      f"{_time(p.compute_s)} | {_time(p.memory_s)} | **{_time(p.floor_s)}** | {p.bound} | "
                      f"{len(p.kernels)} |")
        md += ["", f"Total floor, forward + gradients: **{_time(self.floor_s)}**", ""]
        md += ["| pass | stage | variant | grid | block | scalars | scratch | regs | shared | local |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for k in self.kernels:
            regs = NA_NO_GPU if k.registers is None else str(k.registers)
            shared = "n/a" if k.shared_bytes is None else _bytes(k.shared_bytes)
            local = "n/a" if k.local_bytes is None else _bytes(k.local_bytes)
            md.append(f"| {k.pass_name} | {k.stage} | `{k.variant}` | {_tuple(k.grid)} | {_tuple(k.block)} | "
                      f"{_kv(k.scalars)} | {_bytes(k.scratch_bytes)} | {regs} | {shared} | {local} |")
        md.append("")
        for k in self.kernels:
            md += [f"<details><summary>{k.pass_name} / {k.stage}: {k.function} "
                   f"({len(k.source.splitlines())} lines of CUDA)</summary>", "",
                   f"constants: `{_kv(k.constants)}`", ""] + [f"tensor map: `{m}`  " for m in k.tensor_maps] + [
                   "", "```cuda", k.source.rstrip("\n"), "```", "",
                   "</details>", ""]
        return "\n".join(md)

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def html(self) -> str:
        """The report as HTML (what a notebook shows): tables, and each whole source in a ``<details>`` block."""
        e = html.escape
        h = [f"<div class='cupyconv-explain'><h4>cupyconv.explain: <code>{e(self._title())}</code></h4>",
             f"<p>input <code>{_tuple(self.input_shape)}</code> &times; weight <code>{_tuple(self.weight_shape)}"
             f"</code> &rarr; output <code>{_tuple(self.output_shape)}</code><br>"
             f"device: {e(self.device)}; NumPy inputs run on backend <code>{e(self.backend)}</code><br>"
             f"{e(self._memory_line())}<br>{e(self._peak_line())}</p>"]
        if self.notes:
            h.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in self.notes) + "</ul>")
        h.append("<table><tr><th>pass</th><th>variant</th><th>FLOPs</th><th>min bytes</th><th>compute</th>"
                 "<th>memory</th><th>floor</th><th>bound</th></tr>")
        for p in self.passes:
            h.append(f"<tr><td>{e(p.name)}</td><td>{e(p.variant or '-')}</td><td>{_si(p.flops, 'FLOP')}</td>"
                     f"<td>{_bytes(p.bytes)}</td>"
                     f"<td>{_time(p.compute_s)}</td><td>{_time(p.memory_s)}</td><td><b>{_time(p.floor_s)}</b></td>"
                     f"<td>{p.bound}</td></tr>")
        h.append(f"</table><p>Total floor, forward + gradients: <b>{_time(self.floor_s)}</b></p>")
        h.append("<table><tr><th>pass</th><th>stage</th><th>variant</th><th>grid</th><th>block</th>"
                 "<th>scalars</th><th>scratch</th><th>registers</th><th>shared</th><th>local</th></tr>")
        for k in self.kernels:
            regs = NA_NO_GPU if k.registers is None else str(k.registers)
            shared = "n/a" if k.shared_bytes is None else _bytes(k.shared_bytes)
            local = "n/a" if k.local_bytes is None else _bytes(k.local_bytes)
            h.append(f"<tr><td>{e(k.pass_name)}</td><td>{e(k.stage)}</td><td><code>{e(k.variant)}</code></td>"
                     f"<td>{_tuple(k.grid)}</td><td>{_tuple(k.block)}</td><td>{e(_kv(k.scalars))}</td>"
                     f"<td>{_bytes(k.scratch_bytes)}</td><td>{e(regs)}</td><td>{shared}</td><td>{local}</td></tr>")
        h.append("</table>")
        for k in self.kernels:
            maps = "".join(f"<p>tensor map: <code>{e(m)}</code></p>" for m in k.tensor_maps)
            h.append(f"<details><summary>{e(k.pass_name)} / {e(k.stage)}: <code>{e(k.function)}</code> "
                     f"({len(k.source.splitlines())} lines of CUDA)</summary>"
                     f"<p>constants: <code>{e(_kv(k.constants))}</code></p>{maps}"
                     f"<pre><code class='language-cuda'>{e(k.source)}</code></pre></details>")
        h.append("</div>")
        return "\n".join(h)

    def _repr_html_(self) -> str:
        return self.html()


# -------------------------------------------------------------------------- arguments

def _scalar_names(source: str, function: str, count: int) -> List[str]:
    """The names of the kernel's ``index_t`` parameters, read from its signature."""
    for m in re.finditer(r"\b" + re.escape(function) + r"\s*\(([^)]*)\)", source):
        names = re.findall(r"\bindex_t\s+(\w+)", m.group(1))
        if len(names) == count:
            return names
    return [f"arg{i}" for i in range(count)]


def _dtype_name(dtype) -> str:
    """A dtype name from a string, a NumPy dtype or scalar type, or a torch dtype; float32 for None."""
    return "float32" if dtype is None else dtypes.dtype_name(dtype)


_LAYOUTS = {"nchw": "nchw", "contiguous": "nchw", "nhwc": "nhwc", "channels_last": "nhwc"}


def _layout_name(layout, example, weight=None) -> str:
    """The layout asked for, else the one cupyconv.torch runs the example tensors in.

    That is torch's convolution memory format: channels_last where the input or the
    weight is, except float64 on CUDA (see cupyconv.torch._channels_last).
    """
    if layout is None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(example, torch.Tensor) and example.dim() in (3, 4):
            from .torch import _layout_for

            if not isinstance(weight, torch.Tensor):  # shapes or a layer without its weight: the input decides
                weight = torch.empty((1, 1, 1, 1), device="meta")
            return _layout_for(example, weight)
        return "nchw"
    if layout not in _LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(_LAYOUTS)}, got {layout!r}")
    return _LAYOUTS[layout]


def _weight_channels_last(weight) -> bool:
    """Whether cupyconv.torch reads this weight (a torch tensor) in its channels_last memory, as its kernels do."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(weight, torch.Tensor):
        return False
    from .torch import _is_channels_last

    return _is_channels_last(weight)


def _grad_weight_layout(layout: str, example, weight) -> Optional[bool]:
    """What cupyconv.torch tells the engine about grad_weight's memory format for this call: torch's format for it
    where that is not the weight's (channels_last beside a channels_last input and a contiguous weight, or the
    reverse), else None.  Only torch weights have it: the NumPy/CuPy API writes grad_weight in the weight's
    layout."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(weight, torch.Tensor) or weight.dim() != 4:
        return None
    from .torch import _grad_weight_layout as torch_rule, _is_channels_last

    x = example
    if not isinstance(x, torch.Tensor):
        x = torch.empty(_shape(example, "input"), device="meta")
        if layout == "nhwc" and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
    return torch_rule(layout, x, weight, _is_channels_last(weight))


def _shape(value, name: str) -> Tuple[int, ...]:
    shape = getattr(value, "shape", value)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"{name} must be a shape (a sequence of ints) or an array, got {type(value).__name__}")
    out = []
    for v in shape:
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise TypeError(f"{name} must contain ints, got {tuple(shape)!r}")
        out.append(int(v.__index__()))
    return tuple(out)


def _torch_module_class(obj):
    """``torch.nn.Module`` when ``obj`` is one; never imports torch for other objects."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):
        return None
    return torch.nn.Module if isinstance(obj, torch.nn.Module) else None


def _from_module(module, inp, dtype):
    import torch  # only reached when a module was given

    if not isinstance(module, (torch.nn.ConvTranspose2d, torch.nn.ConvTranspose1d)):
        raise TypeError(f"explain() takes an nn.ConvTranspose2d or nn.ConvTranspose1d module, got "
                        f"{type(module).__name__}")
    if getattr(module, "padding_mode", "zeros") != "zeros":
        raise ValueError(f"only padding_mode='zeros' is supported, got {module.padding_mode!r}")
    if inp is None:
        raise TypeError("explain(module, input): input (a tensor or a shape) is required")
    dtype = _dtype_name(dtype if dtype is not None else module.weight.dtype)
    layer = dict(stride=module.stride, padding=module.padding, output_padding=module.output_padding,
                 groups=module.groups, dilation=module.dilation)
    return _shape(inp, "input"), tuple(module.weight.shape), module.bias is not None, layer, dtype


def explain(input_shape, weight_shape=None, bias=True, stride=1, padding=0, output_padding=0, groups=1,
            dilation=1, dtype=None, *, output_size=None, output_mask: Optional[Sequence[bool]] = None,
            layout: Optional[str] = None, precision: Optional[str] = None, device: Optional[int] = None,
            peak: Optional[Peak] = None, sm_count: Optional[int] = None, compile: bool = True,
            show_source: bool = False) -> Explanation:
    """Explain the kernels cupyconv launches for a layer applied to an input shape.

    Two forms:

    - ``explain(input_shape, weight_shape, bias=True, stride=1, padding=0, output_padding=0,
      groups=1, dilation=1, dtype="float32")`` with torch's argument conventions. Shapes may be
      given as arrays (their ``.shape`` is used; a NumPy/CuPy array's dtype too when ``dtype``
      is None). ``bias`` is a bool, a shape or an array.
    - ``explain(module, input)`` with an ``nn.ConvTranspose2d`` (``cupyconv.torch.ConvTranspose2d``
      too) and an input tensor or shape; the dtype is the module weight's.

    A 1-D layer (a 3-D weight shape ``(C_in, C_out/groups, k)`` with an ``(N, C_in, L)`` or ``(C_in, L)``
    input, int or one-element arguments, or an ``nn.ConvTranspose1d``) is explained as it runs: as the
    one-row 2-D layer, contiguous; the shapes and arguments are reported in its own 1-D form.

    ``layout`` is "nchw" (contiguous) or "channels_last"; by default the input tensor's memory
    format, else contiguous. ``precision`` ("strict" or "tf32") matters for float32: by default
    what the call would run with, i.e. torch's ``torch.backends.cudnn.allow_tf32`` for a module and
    strict (as the NumPy/CuPy API runs) otherwise. The kernels listed are the ones a call with
    these settings launches: the pass table's families and, on a GPU, the tuner's remembered or
    stored choice.
    ``output_size`` picks the output_padding as ``ConvTranspose2d.forward(x, output_size)`` does.
    ``output_mask`` (grad_input, grad_weight, grad_bias) chooses the gradients reported; by
    default those the backward computes: all three for shapes, as ``conv_transpose2d_backward``
    returns grad_bias whether or not the forward had a bias, and grad_bias for a module only
    when it has a bias, as torch's autograd asks for it only then. On a GPU (``device``, default 0) each
    kernel is compiled (``compile=False`` skips that) to read its register and memory use, and
    the peaks come from the device; without one, H100 peaks are assumed. ``peak`` overrides them
    and ``sm_count`` the SM count that sizes the split-K grids. Bad arguments raise ValueError or
    TypeError, as the layer itself would.
    """
    from_module = _torch_module_class(input_shape) is not None
    layout_asked = layout
    if from_module:
        given = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                     dilation=dilation)
        defaults = dict(stride=1, padding=0, output_padding=0, groups=1, dilation=1)
        changed = [k for k in given if given[k] != defaults[k]] + ([] if bias is True else ["bias"])
        if changed:
            raise TypeError(f"explain(module, input) reads the layer from the module; do not pass {changed}")
        in_shape, w_shape, has_bias, layer, dtype = _from_module(input_shape, weight_shape, dtype)
        source_kind = f"module {type(input_shape).__name__}"
        layout = _layout_name(layout, weight_shape, input_shape.weight)
        weight = input_shape.weight
        if precision is None and dtype == "float32":
            precision = "tf32" if sys.modules["torch"].backends.cudnn.allow_tf32 else "strict"
    else:
        if weight_shape is None:
            raise TypeError("explain(input_shape, weight_shape, ...) needs weight_shape (or pass a module and input)")
        if dtype is None:
            dtype = getattr(input_shape, "dtype", None)
        dtype = _dtype_name(dtype)
        in_shape, w_shape = _shape(input_shape, "input_shape"), _shape(weight_shape, "weight_shape")
        layer = dict(stride=stride, padding=padding, output_padding=output_padding, groups=groups,
                     dilation=dilation)
        has_bias = bias
        source_kind = "arguments"
        layout = _layout_name(layout, input_shape, weight_shape)
        weight = weight_shape
    precision = "strict" if precision is None else precision
    dtypes.check_precision(precision)
    is_1d = len(w_shape) == 3
    if is_1d:
        in_shape, w_shape, layer, output_size = _as_one_row(in_shape, w_shape, layer, output_size,
                                                            "input" if from_module else "input_shape")
        if layout_asked is not None and _layout_name(layout_asked, None) == "nhwc":
            raise ValueError("layout must be 'nchw' (contiguous) for a 1-D layer: torch has no channels_last for "
                             "3-D tensors, and cupyconv runs a 1-D layer contiguous")
        layout, weight = "nchw", None   # as cupyconv.torch runs a 1-D layer: contiguous

    if isinstance(has_bias, bool):
        bias_shape = None
    elif has_bias is None:
        has_bias, bias_shape = False, None
    else:
        bias_shape = _shape(has_bias, "bias")
        has_bias = True

    params = ConvParams.from_args(**layer)
    if output_size is not None:
        if len(w_shape) != 4:
            raise ValueError(f"weight must be 4-D (C_in, C_out/groups, kH, kW), got shape {w_shape}")
        op = output_padding_for(output_size, in_shape, w_shape[2:], params.stride, params.padding,
                                params.dilation)
        params = ConvParams.from_args(params.stride, params.padding, op, params.groups, params.dilation)
    g = geometry(in_shape, w_shape, bias_shape, params).with_weight_channels_last(_weight_channels_last(weight))
    grad_weight_channels_last = None if is_1d else _grad_weight_layout(
        layout, weight_shape if from_module else input_shape, weight)

    if output_mask is not None:
        mask = _output_mask(output_mask)
    else:
        mask = (True, True, bool(has_bias) if from_module else True)

    if peak is not None and not isinstance(peak, Peak):
        raise TypeError(f"peak must be a cupyconv.explain.Peak, got {type(peak).__name__}")
    if sm_count is not None and (isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1):
        raise ValueError(f"sm_count must be a positive int, got {sm_count!r}")

    notes: List[str] = []
    if is_1d:
        notes.append("a 1-D layer: it runs on the 2-D kernels as the one-row layer "
                     f"{_tuple(g.user_shape(g.input_shape))}, with no copy")
    gpu = _device.gpu_present()
    device_id = 0 if device is None else int(device)
    if gpu:
        dev = _device.get(device_id)
        device_name = f"GPU {device_id}: {dev.name}"
    else:
        dev = _device.ASSUMED
        device_name = "no GPU"
        if sm_count is None:
            notes.append(f"no GPU: planned for an assumed {dev.name} with {dev.sm_count} SMs and sm_{dev.arch} "
                         "tensor cores; a real device may differ")
    if grad_weight_channels_last is not None and mask[1]:
        notes.append("grad_weight is written " + ("channels_last" if grad_weight_channels_last else "contiguous")
                     + ", torch's memory format for it here, where the weight is read "
                     + ("contiguous" if grad_weight_channels_last else "channels_last"))
    if sm_count is not None and sm_count != dev.sm_count:
        dev = replace(dev, sm_count=sm_count)
    if peak is None:
        peak = dev.peak
    from .functional import backend

    try:
        backend_name = backend()
    except (RuntimeError, ValueError) as exc:
        backend_name = f"unavailable ({exc})"
    if backend_name == "numpy":
        notes.append("NumPy inputs run on the float64 NumPy reference here, not on these kernels; "
                     "CuPy arrays and CUDA torch tensors on a GPU run the kernels below")
    if dtypes.get(dtype).itemsize == 2:
        notes.append(f"{dtype} is stored in 2 bytes and accumulated in fp32; the compute term uses the fp32 "
                     "CUDA-core peak")
    notes.append("FLOPs count 2 per multiply-add over every tap, cropped ones included (bias adds are not "
                 "counted); min bytes = each input read once + each output written once; the floors leave out "
                 "launch overhead (a few microseconds per kernel), which dominates small layers")

    # a 1-D layer's shapes and arguments in its own form: without the row, its pairs' second entries
    own = (lambda t: tuple(t[:-2]) + tuple(t[-1:])) if is_1d else tuple
    pair = (lambda t: tuple(t[1:])) if is_1d else tuple
    explanation = Explanation(
        layer=dict(in_channels=g.in_channels, out_channels=g.out_channels, kernel_size=pair(g.kernel),
                   stride=pair(params.stride), padding=pair(params.padding),
                   output_padding=pair(params.output_padding), groups=params.groups,
                   dilation=pair(params.dilation), bias=bool(has_bias), source=source_kind, one_d=is_1d),
        input_shape=own(g.user_shape(g.input_shape)), weight_shape=own(g.weight_shape),
        output_shape=own(g.user_shape(g.output_shape)), dtype=dtype, geometry=g, device=device_name, gpu=gpu,
        peak=peak, sm_count=dev.sm_count, backend=backend_name,
        passes=_passes(g, dtype, bool(has_bias), mask, layout, precision, dev, peak, grad_weight_channels_last),
        notes=notes, show_source=show_source, layout=layout, precision=precision)

    if gpu and compile:
        _read_resources(explanation, device_id)
    elif gpu:
        for k in explanation.kernels:
            k.resources = "not compiled (compile=False)"
    return explanation


def _as_one_row(in_shape, w_shape, layer, output_size, input_name):
    """A 1-D layer's (input shape, weight shape, 2-D arguments, output_size) as the one-row 2-D layer runs it."""
    one_d.check_ranks(in_shape, w_shape, input_name)
    stride, padding, output_padding, dilation = one_d.params_2d(layer["stride"], layer["padding"],
                                                                layer["output_padding"], layer["dilation"])
    if output_size is not None:
        if isinstance(output_size, bool) or not hasattr(output_size, "__len__"):
            raise TypeError(f"output_size must be a sequence of ints, got {type(output_size).__name__}")
        # as torch's ConvTranspose1d: the length alone, or the whole output shape
        if len(output_size) not in (1, len(in_shape)):
            raise ValueError(f"output_size must have 1 or {len(in_shape)} elements for a {len(in_shape)}-D input "
                             f"to a 1-D layer, got {len(output_size)}")
        output_size = (1, output_size[-1])
    return (tuple(in_shape[:-1]) + (1, in_shape[-1]), tuple(w_shape[:2]) + (1, w_shape[2]),
            dict(stride=stride, padding=padding, output_padding=output_padding, groups=layer["groups"],
                 dilation=dilation), output_size)


# ---------------------------------------------------------------------- passes and plans

def _roofline(flops: int, nbytes: int, peak: Peak, dtype: str) -> Tuple[float, float, float, str]:
    compute = flops / peak.flops(dtype)
    memory = nbytes / peak.bandwidth
    return compute, memory, max(compute, memory), "compute" if compute > memory else "memory"


_TILING = ("OC_BLOCK", "IC_BLOCK", "OC_TILE", "IC_TILE", "RUNS", "KH_BLOCK", "CELLS", "IC_CHUNK", "OC_CHUNK", "BLOCK",
           "BM", "BN", "STAGES", "GROUPS_PER_BLOCK", "SEG", "SEGQ")


def _record(pass_name: str, stage: str, plan: Plan, flops: int, nbytes: int, peak: Peak,
            dtype: str) -> KernelRecord:
    spec = plan.spec
    constants = dict(spec.constants)
    source = spec.source()
    tiles = {k: constants[k] for k in _TILING if k in constants}
    shown = ([_kv(tiles)] if tiles else []) + [f"index_t {plan.index_t}"]
    variant = f"{spec.template}:{spec.function} [{', '.join(shown)}]"
    names = _scalar_names(source, spec.function, len(plan.scalars))
    _, _, floor, bound = _roofline(flops, nbytes, peak, dtype)
    return KernelRecord(pass_name=pass_name, stage=stage, template=spec.template, function=spec.function,
                        variant=variant, constants=constants, grid=tuple(plan.grid), block=tuple(plan.block),
                        scalars=dict(zip(names, plan.scalars)), index_t=plan.index_t,
                        scratch_bytes=plan.scratch_bytes, flops=int(flops), bytes=int(nbytes), floor_s=floor,
                        bound=bound, source=source, tensor_maps=[_tensor_map_text(m) for m in plan.tensor_maps])


def _tensor_map_text(m) -> str:
    """One TMA descriptor: which pointer argument it describes, its tensor and its boxes."""
    return (f"pointer argument {m.pointer}: {m.dtype} tensor of {_tuple(m.dims)} elements (innermost first), "
            f"boxes of {_tuple(m.box)} at element strides {_tuple(m.element_strides)}, {m.swizzle}-byte swizzle")


def _pass(name: str, flops: int, nbytes: int, kernels: List[KernelRecord], peak: Peak, dtype: str,
          note: str = "", variant: str = "") -> PassRecord:
    compute, memory, floor, bound = _roofline(flops, nbytes, peak, dtype)
    return PassRecord(name, int(flops), int(nbytes), compute, memory, floor, bound, kernels, note, variant)


# Made-up, 16-byte aligned addresses for the recorded call: distinct, so that a shared
# channels_last copy of grad_output is shared exactly as in a real call.
_X, _W, _B, _Y, _GX, _GW, _GB = ((i + 1) << 32 for i in range(7))


def _record_call(g: Geometry, dtype: str, has_bias: bool, mask, layout: str, precision: str,
                 dev: _device.Device, grad_weight_channels_last: Optional[bool] = None) -> List[RecordedPass]:
    """The forward and the gradients in ``mask`` as a call runs them, written down instead of launched."""
    recorder = Recorder(dev)
    engine.forward(g, dtype, _X, _W, _B if has_bias else None, _Y, recorder, layout, precision)
    engine.backward(g, dtype, _Y, _X, _W, _GX if mask[0] else None, _GW if mask[1] else None,
                    _GB if mask[2] else None, recorder, layout, precision, grad_weight_channels_last)
    return recorder.passes


def _passes(g: Geometry, dtype: str, has_bias: bool, mask, layout: str, precision: str, dev: _device.Device,
            peak: Peak, grad_weight_channels_last: Optional[bool] = None) -> List[PassRecord]:
    """What each pass launches, with its useful work, minimum traffic and roofline floor."""
    size = dtypes.get(dtype).itemsize
    acc = dtypes.get(dtype).accumulator_bytes
    x = _prod(g.input_shape) * size
    y = _prod(g.output_shape) * size
    w = _prod(g.weight_shape) * size
    b = g.out_channels * size
    mac_flops = g.flops()
    # per pass: (useful FLOPs, minimum bytes, bytes its partial pass reads, bytes its reduce writes)
    work = {
        "forward": (mac_flops, x + w + (b if has_bias else 0) + y, x + w, y + (b if has_bias else 0)),
        "grad_input": (mac_flops, y + w + x, y + w, x),
        "grad_weight": (mac_flops, x + y + w, x + y, w),
        "grad_bias": (_prod(g.output_shape), y + b, y, b),   # one addition per output element
    }
    passes = []
    for recorded in _record_call(g, dtype, has_bias, mask, layout, precision, dev, grad_weight_channels_last):
        name = recorded.name
        flops, nbytes, partial_reads, written = work[name]
        if not recorded.launches:
            zeroed = recorded.zeroed_bytes
            what = f"{name} is zero-filled with a memset" if zeroed else "nothing is launched"
            passes.append(_pass(name, 0, zeroed, [], peak, dtype, note=f"batch is 0: {what}"))
            continue
        kernels, note, partial = [], "", None
        for stage, plan in recorded.launches:
            if stage in ("pack", "to_channels_last", "pack_sources"):
                # a copy: each byte read once and written once
                moved = 2 * (w if stage == "pack" else plan.scratch_bytes)
                kernels.append(_record(name, stage, plan, 0, moved, peak, dtype))
            elif stage == "partial":
                partial = plan
                kernels.append(_record(name, stage, plan, flops, partial_reads + plan.scratch_bytes, peak, dtype))
            elif stage == "reduce":
                elements, chunks = plan.scalars[:2]
                # a reduce always follows the partial pass whose scratch it sums
                kernels.append(_record(name, stage, plan, (chunks - 1) * elements, partial.scratch_bytes + written,
                                       peak, dtype))
                if name in ("forward", "grad_input"):
                    ranges = f"{chunks} even ranges of each stride phase's K tiles"
                else:
                    unit = "K tiles" if recorded.variant.family == "gemm" else "rows"
                    ranges = f"{chunks} chunks of {partial.scalars[-1]} {unit}"
                note = f"split-K over {ranges}; {_bytes(partial.scratch_bytes)} of {acc}-byte partials"
            else:
                kernels.append(_record(name, stage, plan, flops, nbytes, peak, dtype))
        passes.append(_pass(name, flops, nbytes, kernels, peak, dtype, note=note, variant=recorded.variant.name))
    return passes


def _read_resources(explanation: Explanation, device_id: int) -> None:
    from .jit.compiler import get_function

    for k in explanation.kernels:
        spec = _spec_of(k)
        try:
            fn = get_function(spec, device_id)
            k.registers = int(fn.num_regs)
            k.shared_bytes = int(fn.shared_size_bytes)
            k.local_bytes = int(fn.local_size_bytes)
            k.max_threads_per_block = int(fn.max_threads_per_block)
            k.resources = f"from the compiled kernel on device {device_id}"
        except Exception as exc:  # report, do not fail: explain is a diagnostic
            k.resources = f"could not compile: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _spec_of(k: KernelRecord):
    from .jit.compiler import KernelSpec

    return KernelSpec.make(k.template, k.function, k.constants)
