"""Compiling rendered templates with NVRTC, and the per-configuration kernel cache.

On a GPU, kernels are built with :class:`cupy.RawModule`, which keeps CuPy's on-disk
cache (``CUPY_CACHE_DIR``) in play, and kept in process per (template content hash,
constants, device, arch).  Without a GPU, :func:`compile_ptx` drives NVRTC directly for
an explicit architecture, so CI can compile every template variant.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

from ..core import device as _device
from . import templates

COMPILE_OPTIONS: Tuple[str, ...] = ("--std=c++17",)
_ERROR_LINE = re.compile(r"\((\d+)\): (?:error|catastrophic error)")


class KernelCompileError(RuntimeError):
    """NVRTC rejected a rendered template; carries the kernel, the options and the offending lines."""

    def __init__(self, kernel: str, options: Sequence[str], log: str, source: str):
        self.kernel = kernel
        self.options = tuple(options)
        self.log = log
        self.source = source
        super().__init__(
            f"failed to compile cupyconv kernel {kernel!r} with options {' '.join(self.options)}\n"
            f"{log.strip()}\n{source_excerpt(source, log)}")


def source_excerpt(source: str, log: str, context: int = 3) -> str:
    """The numbered source lines around each line the compiler log complains about."""
    lines = source.splitlines()
    wanted = sorted({int(m) for m in _ERROR_LINE.findall(log)})
    if not wanted:
        wanted = list(range(1, min(len(lines), 2 * context + 1) + 1))
    shown, out = set(), []
    for line in wanted:
        for i in range(max(1, line - context), min(len(lines), line + context) + 1):
            if i not in shown:
                shown.add(i)
                out.append(f"{'>>' if i == line else '  '} {i:5d} | {lines[i - 1]}")
        out.append("   ...")
    return "\n".join(out)


def compile_ptx(source: str, kernel: str, arch: str, options: Sequence[str] = COMPILE_OPTIONS) -> str:
    """Compile ``source`` to PTX for ``arch`` (e.g. ``"compute_90"``) with NVRTC; needs no GPU."""
    from cupy_backends.cuda.libs import nvrtc

    all_options = tuple(options) + (f"--gpu-architecture={arch}",)
    program = nvrtc.createProgram(source, f"{kernel}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, list(all_options))
        except nvrtc.NVRTCError:
            raise KernelCompileError(kernel, all_options, nvrtc.getProgramLog(program), source) from None
        ptx = nvrtc.getPTX(program)
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(program)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel function of one template, specialised by its constants."""

    template: str
    function: str
    constants: Tuple[Tuple[str, object], ...]
    # "" builds for the device's own architecture; an architecture-specific target such as
    # "sm_90a" (wgmma, setmaxnreg) builds for exactly that and loads only on such a device.
    target: str = ""

    @classmethod
    def make(cls, template: str, function: str, constants: Mapping[str, object], target: str = "") -> "KernelSpec":
        """A hashable spec; the constants are sorted by name, so their order does not matter."""
        return cls(template, function, tuple(sorted(constants.items())), target)

    @property
    def options(self) -> Tuple[str, ...]:
        """NVRTC options: CuPy adds the device's ``-arch=sm_XY``, and NVRTC keeps the
        architecture-specific target when both are given."""
        return COMPILE_OPTIONS + ((f"-arch={self.target}",) if self.target else ())

    def source(self) -> str:
        """The template rendered with these constants: the CUDA source NVRTC compiles."""
        return templates.render(self.template, dict(self.constants))


@dataclass
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    function: object = None


_entries: Dict[tuple, _Entry] = {}
_entries_lock = threading.Lock()
_compile_count = 0
# Bumped by clear_cache(); launch plans compare it on every launch, so a plain module
# attribute rather than a function.
_generation = 0


def compile_count() -> int:
    """How many kernels this process has built (each configuration should count once)."""
    return _compile_count


def compiled_devices() -> set:
    """The CUDA device ids this process holds compiled kernels for.

    Kernels are compiled and loaded per device, so this tells which devices cupyconv has
    launched on (or is ready to launch on) since the last :func:`clear_cache`.
    """
    with _entries_lock:
        return {key[4] for key, entry in _entries.items() if entry.function is not None}


def compiled_specs() -> set:
    """(KernelSpec, device id) of every kernel this process holds compiled."""
    with _entries_lock:
        return {(KernelSpec(key[0], key[2], key[3], key[6]), key[4]) for key, entry in _entries.items()
                if entry.function is not None}


def clear_cache() -> None:
    """Forget every compiled kernel of this process (CuPy's disk cache is left alone).

    Launch plans notice (the generation counter changes) and fetch their kernels again;
    the ones they held stay loaded until then, so a launch never uses an unloaded module.
    """
    global _generation
    with _entries_lock:
        _entries.clear()
        _generation += 1


def _build(spec: KernelSpec, device_id: int):
    """Compile and load ``spec`` on ``device_id``; returns a CuPy ``RawKernel`` (``.kernel.ptr`` launches)."""
    import cupy

    source = spec.source()
    options = spec.options
    with cupy.cuda.Device(device_id):
        try:
            kernel = cupy.RawModule(code=source, options=options).get_function(spec.function)
            kernel.kernel  # compile and load now, under this device, not at the first launch
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(spec.function, options, str(exc), source) from None
        except (OSError, cupy.cuda.driver.CUDADriverError):
            # A read-only or full CUPY_CACHE_DIR, or a cached binary the driver rejects:
            # keep working, compiling in memory without the disk cache.
            os.environ["CUPY_CACHE_IN_MEMORY"] = "1"
            kernel = cupy.RawModule(code=source, options=options).get_function(spec.function)
            kernel.kernel
    return kernel


# Builds a call waits for (its own kernels, the backward's handed over by the first forward)
# in flight.  The tuner's candidates wait until there are none, so they never slow a first call.
_foreground = 0
_foreground_idle = threading.Condition()
_FOREGROUND_WAIT_S = 10.0


def get_function(spec: KernelSpec, device_id: int, arch: Optional[str] = None):
    """The compiled kernel for ``spec`` on ``device_id``, building it at most once per process."""
    global _compile_count, _foreground
    if arch is None:
        arch = device_arch(device_id)
    key = _key(spec, device_id, arch)
    entry = _entries.get(key)
    if entry is not None and entry.function is not None:
        return entry.function
    with _entries_lock:
        entry = _entries.setdefault(key, _Entry())
    background = threading.current_thread().name.startswith(_CANDIDATE_THREADS)
    with entry.lock:
        if entry.function is None:
            if not background:
                with _foreground_idle:
                    _foreground += 1
            try:
                entry.function = _build(spec, device_id)
            finally:
                if not background:
                    with _foreground_idle:
                        _foreground -= 1
                        _foreground_idle.notify_all()
            with _entries_lock:
                _compile_count += 1
    return entry.function


def device_arch(device_id: int) -> str:
    """The compute capability of CUDA device ``device_id`` as CuPy spells it (e.g. ``"90"``)."""
    return _device.get(device_id).arch


# Two pools: kernels a call is about to need (the backward's, handed over by the first forward),
# and the tuner's other candidates, which build at a lower CPU priority so that they do not
# slow the first calls down.
_pools: Dict[bool, object] = {}
_pools_lock = threading.Lock()
_CANDIDATE_THREADS = "cupyconv-candidates"
WARM_UP_THREAD = "cupyconv-nvrtc-warm-up"
_warm_up: Optional[threading.Thread] = None


def warm_up() -> threading.Thread:
    """Start NVRTC in a background thread, once a process, and return that thread.

    A process's first NVRTC program costs 0.2-0.9 s beyond its own build (loading the compiler and setting it
    up: a one-line kernel took 0.7-0.95 s first and 20 ms after on a slow CPU, NOTES v46), which a layer's
    first call would otherwise pay before its first kernel.  The modules start it when they are built or
    converted, so it runs while the rest of a model is set up.  It compiles to PTX only: no CUDA driver, device
    or context is touched.  Without NVRTC it does nothing."""
    global _warm_up
    with _pools_lock:
        if _warm_up is None:
            _warm_up = threading.Thread(target=_start_nvrtc, name=WARM_UP_THREAD, daemon=True)
            _warm_up.start()
        return _warm_up


def _start_nvrtc() -> None:
    try:
        compile_ptx('extern "C" __global__ void warm_up(float* x) { x[0] = 0.f; }', "warm_up", "compute_80")
    except Exception:  # no CuPy or no NVRTC here: the first build reports that where it matters
        pass


def _lower_priority() -> None:
    try:  # Linux gives each thread its own nice value
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _pool(low_priority: bool):
    with _pools_lock:
        pool = _pools.get(low_priority)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            if low_priority:
                workers = max(1, min(4, (os.cpu_count() or 2) // 4))
                pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=_CANDIDATE_THREADS,
                                          initializer=_lower_priority)
            else:
                pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="cupyconv-compile")
            _pools[low_priority] = pool
        return pool


def compile_in_background(specs, device_id: int, low_priority: bool = False) -> list:
    """Start building the kernels of ``specs`` that are not built yet, without waiting for them.

    A layer's first forward under autograd hands over its backward's kernels here, so they
    compile while the forward's own kernel does; the tuner hands over the candidates it will
    time (``low_priority``).  A launch that needs one of them waits for its build (the
    per-kernel lock in :func:`get_function`); a build that fails here is simply tried again
    there, where the error reaches the caller.  Returns the builds' futures.
    """
    arch = device_arch(device_id)
    todo = [s for s in dict.fromkeys(specs) if not _is_built(s, device_id, arch)]
    if not todo:
        return []
    pool = _pool(low_priority)
    build = _build_when_idle if low_priority else _build_quietly
    return [pool.submit(build, spec, device_id, arch) for spec in todo]


def _build_when_idle(spec: KernelSpec, device_id: int, arch: str) -> None:
    """A candidate's build: after the builds calls wait for (up to a bound, so none starves)."""
    with _foreground_idle:
        _foreground_idle.wait_for(lambda: _foreground == 0, timeout=_FOREGROUND_WAIT_S)
    _build_quietly(spec, device_id, arch)


def _build_quietly(spec: KernelSpec, device_id: int, arch: str) -> None:
    try:
        get_function(spec, device_id, arch)
    except Exception:  # noqa: BLE001 - the launch that needs the kernel builds it again and raises
        pass


def _is_built(spec: KernelSpec, device_id: int, arch: str) -> bool:
    entry = _entries.get(_key(spec, device_id, arch))
    return entry is not None and entry.function is not None


def _key(spec: KernelSpec, device_id: int, arch: str) -> tuple:
    return (spec.template, templates.content_hash(spec.template), spec.function, spec.constants, device_id, arch,
            spec.target)


def compile_many(specs, device_id: int, workers: int = 8) -> int:
    """Build many kernels for ``device_id`` on a thread pool (NVRTC runs without the GIL).

    Returns how many distinct specs were requested.  Useful to warm the caches before a
    sweep or a training run instead of paying each compile on first use.
    """
    from concurrent.futures import ThreadPoolExecutor

    unique = list(dict.fromkeys(specs))
    arch = device_arch(device_id)
    todo = [s for s in unique if not _is_built(s, device_id, arch)]
    if len(todo) == 1:
        get_function(todo[0], device_id, arch)
    elif todo:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for _ in pool.map(lambda s: get_function(s, device_id, arch), todo):
                pass
    return len(unique)
