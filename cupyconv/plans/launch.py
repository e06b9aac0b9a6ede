"""Launch mechanics: one kernel's :class:`Plan`, its parameter block, scratch, and where launches go.

A plan names the kernel specialisation to compile (its template constants), the grid and
the runtime arguments.  Plans are pure Python, so CI can enumerate and compile every one
of them without a GPU.  Launches take raw device pointers and a raw stream handle, so
CuPy arrays and torch tensors (bfloat16 included, which CuPy cannot represent) share one
path that costs no DLPack round trip.

A :class:`Launcher` is where one call's launches go: a device, a stream and the caller's
allocator for scratch.  A :class:`Recorder` takes the same launches and only writes them
down, which is how ``explain`` and host-only tools see exactly what a call runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..core import device as _device
from ..core import dtypes
from ..core.geometry import Geometry
from ..jit import compiler
from ..jit.compiler import KernelSpec, get_function
from . import graphs as _graphs
from .tensor_map import Encoded, TensorMap

INT32_LIMIT = 2 ** 31
GRID_YZ_LIMIT = 65535
STATIC_SMEM_LIMIT = 48 * 1024
LAYOUTS = ("nchw", "nhwc")


def index_type(*element_counts: int) -> str:
    """32-bit offsets unless some tensor a kernel touches has 2**31 elements or more."""
    return "long long" if max(element_counts) >= INT32_LIMIT else "int"


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_rows(rows: int, other_blocks: int, min_items: int, sm_count: int, blocks_per_sm: int = 4,
               row_items: int = 1) -> Tuple[int, int]:
    """Split ``rows`` into enough fixed chunks to fill the GPU; returns (chunks, rows_per_chunk).

    ``blocks_per_sm`` blocks per SM are wanted in all, counting the ``other_blocks`` each
    chunk is launched with, but no chunk gets fewer than ``min_items`` of the
    ``row_items`` items that each row holds.
    """
    wanted = max(1, cdiv(blocks_per_sm * sm_count, max(other_blocks, 1)))
    wanted = min(wanted, max(1, cdiv(rows * row_items, min_items)))
    rows_per_chunk = cdiv(rows, wanted)
    return cdiv(rows, rows_per_chunk), rows_per_chunk


def even_block(size: int, cap: int) -> int:
    """The block of at most ``cap`` that cuts ``size`` into the fewest, most even pieces."""
    return cdiv(size, cdiv(size, max(1, cap)))


def layer_constants(g: Geometry, dtype: str, index_t: str) -> dict:
    """The constants of ``kernels/include/layer.cuh``: storage and index types, the layer's geometry and its
    weight's layout."""
    p = g.params
    return dict(
        SCALAR_T=dtypes.get(dtype).c_type, INDEX_T=index_t,
        KH=g.kernel[0], KW=g.kernel[1], SH=p.stride[0], SW=p.stride[1], PH=p.padding[0], PW=p.padding[1],
        DH=p.dilation[0], DW=p.dilation[1], GROUPS=p.groups, CIN_G=g.in_per_group, COUT_G=g.out_per_group,
        WEIGHT_CL=g.weight_channels_last)


@dataclass(frozen=True)
class Plan:
    """One kernel launch: what to compile, how to launch it, and its non-pointer arguments."""

    spec: KernelSpec
    grid: Tuple[int, int, int]
    block: Tuple[int, int, int]
    scalars: Tuple[int, ...]   # runtime sizes, passed as index_t
    index_t: str
    scratch_bytes: int = 0     # split-K partials the caller must provide
    smem_bytes: int = 0        # dynamic shared memory per block
    tensor_maps: Tuple[TensorMap, ...] = ()   # TMA descriptors of some pointers, passed after the scalars
    # device -> (compiler generation, CUfunction handle, the kernel object that keeps its module loaded)
    _functions: Dict[int, tuple] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # (device, pointer count) -> (compiler generation, parameter block, the driver's launch arguments):
    # everything but the pointers and the stream, so a launch only fills those in
    _ready: Dict[Tuple[int, int], tuple] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def function(self, device_id: int) -> int:
        """The CUfunction handle of this plan's kernel on ``device_id``."""
        held = self._functions.get(device_id)
        if held is None or held[0] != compiler._generation:
            kernel = get_function(self.spec, device_id)
            if self.smem_bytes:
                # A block's static and dynamic shared memory together may pass 48 KB only once the function has
                # opted in, so any dynamic amount opts in: under 48 KB of it can still cross the line with the
                # kernel's static tables.
                kernel.max_dynamic_shared_size_bytes = self.smem_bytes
            held = self._functions[device_id] = (compiler._generation, kernel.kernel.ptr, kernel)
        return held[1]

    def run(self, device_id: int, stream_ptr: int, pointers: Sequence[int]) -> None:
        ready = self._ready.get((device_id, len(pointers)))
        if ready is None or ready[0] != compiler._generation:
            block = _ParamBlock(len(pointers), self.scalars, self.index_t, self.tensor_maps)
            function = self.function(device_id)
            ready = self._ready[device_id, len(pointers)] = (
                compiler._generation, block, (function,) + tuple(self.grid) + tuple(self.block) + (self.smem_bytes,))
        ready[1].launch(ready[2], pointers, stream_ptr)


class _ParamBlock:
    """A kernel's parameter block, built once per plan; each launch only rewrites the pointers.

    The pointers sit side by side in one array, so a launch writes them with one slice
    assignment (a third of the time of setting them one by one).  cuLaunchKernel copies the
    parameters, so the block can be reused at once; the lock keeps two threads launching the
    same plan from interleaving their pointer writes.  Tensor maps follow the scalars, each
    encoded again only when its pointer changes.
    """

    def __init__(self, n_pointers: int, scalars: Sequence[int], index_t: str, tensor_maps: Sequence[TensorMap] = ()):
        scalar_type = ctypes.c_int64 if index_t == "long long" else ctypes.c_int32
        self.n_pointers = n_pointers
        self.pointers = (ctypes.c_uint64 * max(n_pointers, 1))()
        self.scalars = [scalar_type(s) for s in scalars]
        base = ctypes.addressof(self.pointers)
        addresses = [base + i * ctypes.sizeof(ctypes.c_uint64) for i in range(n_pointers)]
        addresses += [ctypes.addressof(v) for v in self.scalars]
        self.maps = [Encoded(m) for m in tensor_maps]
        addresses += [m.address for m in self.maps]
        self.array = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)
        self.address = ctypes.addressof(self.array)
        self.lock = threading.Lock()

    def launch(self, args: tuple, pointers: Sequence[int], stream_ptr: int) -> None:
        """Launch with ``args`` = (function, grid x, y, z, block x, y, z, dynamic shared memory)."""
        launch_kernel = _launch_kernel or _bind_driver()
        with self.lock:
            try:
                self.pointers[:self.n_pointers] = pointers
            except TypeError:  # a None for a null pointer
                self.pointers[:self.n_pointers] = [p or 0 for p in pointers]
            for m in self.maps:
                m.encode(pointers[m.spec.pointer])
            launch_kernel(*args, stream_ptr, self.address, 0)


_launch_kernel = None


def _bind_driver():
    """CuPy's cuLaunchKernel, imported on the first launch (planning needs no CuPy)."""
    global _launch_kernel
    from cupy.cuda import driver

    _launch_kernel = driver.launchKernel
    return _launch_kernel


Allocator = Callable[[int], Tuple[object, int]]
_SCRATCH_ALIGN = 256


def carve(alloc: Allocator, sizes: Sequence[int]) -> Tuple[object, List[int]]:
    """One scratch allocation split into 256-byte aligned pieces of ``sizes`` bytes.

    A pass needs up to four scratch buffers; one allocation costs the host one
    allocator call instead of four.  The buffer lives as long as the returned owner;
    both allocators we use (CuPy's pool and torch's caching allocator) are
    stream-ordered, so its reuse waits behind the launches that read it.
    """
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += aligned_size(size)
    if total == 0:   # nothing to carve (a weight read in place, a whole GEMM): no allocator call
        return None, [0] * len(offsets)
    keep, base = alloc(total)
    return keep, [base + o for o in offsets]


def aligned_size(nbytes: int) -> int:
    """``nbytes`` rounded up to the 256-byte alignment every scratch piece starts at."""
    return cdiv(nbytes, _SCRATCH_ALIGN) * _SCRATCH_ALIGN


class Arena:
    """One scratch allocation that a call's passes take their pieces from in turn.

    A backward whose passes each need scratch (split-K partials, channels_last copies,
    packed weights) pays the allocator once.  Pieces are never reused within the call, so
    nothing waits on anything; a request past the end (the bound was short) goes to the
    caller's allocator instead.
    """

    def __init__(self, alloc: Allocator, nbytes: int):
        self.fallback = alloc
        self.keep, self.next = alloc(nbytes)
        self.end = self.next + nbytes

    def alloc(self, nbytes: int):
        size = aligned_size(max(nbytes, 1))
        if self.next + size > self.end:
            return self.fallback(nbytes)
        ptr, self.next = self.next, self.next + size
        return self.keep, ptr


def cupy_allocator() -> Allocator:
    """Scratch from CuPy's memory pool on the current device."""
    import cupy

    def alloc(nbytes: int):
        buf = cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
        return buf, buf.data.ptr
    return alloc


class SourceCopies:
    """channels_last copies of NCHW sources, made once and shared by the passes of one call.

    grad_input and grad_weight both read grad_output through the same copy; a backward
    call that runs both gives its launcher one of these.  The copies live as long as this
    object (stream-ordered, like all scratch).
    """

    def __init__(self) -> None:
        self._copies: Dict[Tuple[int, int], Tuple[object, int]] = {}  # (id(plan), src) -> (buffer, pointer)

    def get(self, plan: Plan, src: int, launcher: "Launcher") -> int:
        """The pointer of ``src`` copied by ``plan`` (a channels_last copy), made on first use."""
        hit = self._copies.get((id(plan), src))
        if hit is None:
            keep, ptr = launcher.alloc(plan.scratch_bytes)
            launcher.launch("to_channels_last", plan, (src, ptr))
            hit = self._copies[(id(plan), src)] = (keep, ptr)
        return hit[1]


# Lists that every launch is appended to while watch() runs (a GPU test compares them with explain).
_watchers: List[list] = []


@contextlib.contextmanager
def watch() -> Iterator[List[Tuple[str, Plan]]]:
    """Note every (stage, plan) launched through a :class:`Launcher` while the block runs."""
    seen: List[Tuple[str, Plan]] = []
    _watchers.append(seen)
    try:
        yield seen
    finally:
        _watchers.remove(seen)


class Launcher:
    """Where one call's launches go: a device, a stream, the caller's scratch allocator.

    ``copies`` holds channels_last copies that several passes of the call share.
    """

    timing = True   # the tuner may time candidate kernels on this launcher's stream
    replays = True  # a repeated configuration may replay its taped launches here (see Tape)
    graphs = True   # and launch them as one CUDA graph when its pointers repeat (see graphs)

    def __init__(self, device_id: int, stream_ptr: int, alloc: Allocator):
        self.device = _device.get(device_id)
        self.device_id = device_id
        self.stream_ptr = stream_ptr
        self.alloc = alloc
        self.copies: Optional[SourceCopies] = None

    def enter(self, pass_: str, variant) -> None:
        """A pass begins with ``variant``'s kernels (a :class:`Recorder` notes it; launches need nothing)."""

    def launch(self, stage: str, plan: Plan, pointers: Sequence[int]) -> None:
        plan.run(self.device_id, self.stream_ptr, pointers)
        if _watchers:
            for seen in _watchers:
                seen.append((stage, plan))

    def scratch(self, sizes: Sequence[int]) -> Tuple[object, List[int]]:
        return carve(self.alloc, sizes)

    def zero(self, ptr: int, nbytes: int) -> None:
        from cupy.cuda import runtime

        if nbytes:
            runtime.memsetAsync(ptr, 0, nbytes, self.stream_ptr)


@dataclass
class RecordedPass:
    name: str
    variant: object                                    # the tuning Variant that ran
    launches: List[Tuple[str, Plan]] = field(default_factory=list)
    zeroed_bytes: int = 0                              # filled with a memset instead (empty batch)


class Recorder(Launcher):
    """A launcher that launches nothing: it writes down each pass, its variant and its launches.

    Pointers are whatever the caller makes up; scratch gets made-up, aligned addresses.
    Nothing is timed on it, so the tuner answers with a remembered, stored or heuristic choice.
    """

    timing = False
    replays = False  # it is asked what a call would launch: it plans every call
    graphs = False   # and a replay on one (tests) launches one by one, through launch()

    def __init__(self, device: _device.Device):
        self.device = device
        self.device_id = device.index
        self.stream_ptr = 0
        self.alloc = self._alloc
        self.copies = None
        self.passes: List[RecordedPass] = []
        self._next = 1 << 40

    def _alloc(self, nbytes: int):
        ptr = self._next
        self._next += cdiv(max(nbytes, 1), _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        return None, ptr

    def enter(self, pass_: str, variant) -> None:
        self.passes.append(RecordedPass(pass_, variant))

    def launch(self, stage: str, plan: Plan, pointers: Sequence[int]) -> None:
        self.passes[-1].launches.append((stage, plan))

    def zero(self, ptr: int, nbytes: int) -> None:
        self.passes[-1].zeroed_bytes += nbytes

    @property
    def launches(self) -> List[Tuple[str, Plan]]:
        return [launch for p in self.passes for launch in p.launches]


# A tape's stand-in for pointer i of a call is ((i + 1) << _SOURCE_SHIFT) plus the pointer's low byte, and its
# scratch lies at (_SCRATCH_SOURCE << _SOURCE_SHIFT): a launch pointer's high bits say where it came from.
# Stand-ins are never launched, so they need not be addresses; a launch pointer further than _MAX_OFFSET past
# its source (or before it) is not taped.
_SOURCE_SHIFT = 44
_MAX_OFFSET = 1 << (_SOURCE_SHIFT - 1)
_SCRATCH_SOURCE = 15
_LOW_BYTE = 255


def pointer_signature(pointers: Sequence[int]) -> Tuple[int, ...]:
    """What of a call's pointers its planning may look at: whether each is given, and its alignment.

    Plans test alignment up to 16 bytes and scratch is aligned to 256; the low byte covers both.
    """
    return tuple([p & _LOW_BYTE if p else -1 for p in pointers])   # a list is built faster than a generator runs


class Tape(Recorder):
    """A recorder that writes down each launch with where its pointers came from.

    The engine runs a configuration's passes on one, with stand-ins for the call's pointers
    and scratch, once the tuner's choices for them are final.  The :class:`Replay` it
    makes launches the same kernels for a later call of the configuration with that call's
    pointers and one scratch allocation: no planning, lookups or carving on the way.
    """

    def __init__(self, device: _device.Device, pointers: Sequence[int]):
        super().__init__(device)
        self.final = True  # False once a pass ran a choice the tuner may still change, or a launch did not fit
        self._stand_ins = [((i + 1) << _SOURCE_SHIFT) + (p & _LOW_BYTE) if p else 0 for i, p in enumerate(pointers)]
        self._scratch_base = self._next = _SCRATCH_SOURCE << _SOURCE_SHIFT   # the recorder's scratch starts here
        self._steps: List[Tuple[str, Plan, Tuple[Tuple[int, int], ...]]] = []

    @property
    def stand_ins(self) -> Tuple[int, ...]:
        """The pointers the passes are to be run with."""
        return tuple(self._stand_ins)

    def _source(self, ptr: int) -> Tuple[int, int]:
        """(index of the call's pointer, or len(pointers) for scratch, or -1 for null; offset from it)."""
        if not ptr:
            return -1, 0
        source = ptr >> _SOURCE_SHIFT
        if source == _SCRATCH_SOURCE and ptr < self._next:
            return len(self._stand_ins), ptr - self._scratch_base
        if 1 <= source <= len(self._stand_ins) and self._stand_ins[source - 1]:
            offset = ptr - self._stand_ins[source - 1]
            if 0 <= offset < _MAX_OFFSET:
                return source - 1, offset
        self.final = False
        return -1, 0

    def launch(self, stage: str, plan: Plan, pointers: Sequence[int]) -> None:
        self._steps.append((stage, plan, tuple(self._source(p) for p in pointers)))

    def zero(self, ptr: int, nbytes: int) -> None:
        self.final = False  # only empty batches zero, and they are not taped

    def replay(self, generation: object) -> "Replay":
        steps = tuple(self._steps)
        # a call of one kernel launches it as cheaply as it would launch a graph of it
        return Replay(steps, self._next - self._scratch_base, generation,
                      _graphs.GraphReplays() if len(steps) > 1 else None)


@dataclass(frozen=True)
class Replay:
    """A taped call's launches; ``generation`` is the tuner's state it was taped under. ``graphs`` holds the CUDA
    graphs of the call's repeated pointer sets (None for a call of one launch)."""

    steps: Tuple[Tuple[str, Plan, Tuple[Tuple[int, int], ...]], ...]
    scratch_bytes: int
    generation: object
    graphs: Optional[_graphs.GraphReplays] = field(default=None, compare=False)

    def run(self, launcher: Launcher, pointers: Sequence[int]) -> None:
        sources = list(pointers)
        keep = None
        if self.scratch_bytes:
            keep, base = launcher.alloc(self.scratch_bytes)
            sources.append(base)
        graphs = self.graphs
        if (graphs is not None and _graphs.enabled and launcher.graphs and not graphs.failed
                and graphs.launch(launcher.device_id, launcher.stream_ptr, sources, self)):
            if _watchers:
                for seen in _watchers:
                    seen.extend((stage, plan) for stage, plan, _ in self.steps)
        else:
            for stage, plan, recipe in self.steps:
                launcher.launch(stage, plan, [sources[i] + offset if i >= 0 else 0 for i, offset in recipe])
        del keep

    def launch_on(self, device_id: int, stream_ptr: int, sources: Sequence[int]) -> None:
        """Launch the steps on ``stream_ptr`` with the call's pointers and scratch (``sources``), unwatched: a
        graph's capture, whose launches run when the graph does."""
        for _, plan, recipe in self.steps:
            plan.run(device_id, stream_ptr, [sources[i] + offset if i >= 0 else 0 for i, offset in recipe])
