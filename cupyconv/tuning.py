"""Choosing a kernel variant for each pass of a layer, and remembering the choice.

A pass (forward, grad_input, grad_weight) of a layer that the tensor-core kernels can run
has a few candidate variants: GEMM block tiles sized to the GEMM, pipeline depths, and for
thin NCHW layers the direct kernels.  The first call of a configuration (or
:func:`tune`) times them with CUDA events and keeps the fastest.

Choices are remembered at two levels:

- in process, per exact configuration and device, so the hot path costs one dict lookup;
- on disk, in a JSON file under ``CUPYCONV_CACHE_DIR`` (default: the user cache directory),
  keyed by library version, kernel-code hash, GPU name, arch, pass, layer, dtype, layout
  and precision.  Batch and spatial sizes enter the key rounded up to powers of two: the
  best tile depends on them only through the GEMM's rough size, and variable-size
  workloads would otherwise pay a host synchronisation for every new image size.

``CUPYCONV_AUTOTUNE=0`` uses the heuristic of :mod:`cupyconv.launch` and nothing is
timed or read from disk.  A first call never times while its stream is being captured
into a CUDA graph, nor under ``torch.use_deterministic_algorithms(True)`` (timing noise
would make the choice, and so the rounding, differ between runs); both use a stored
choice or the heuristic.  A corrupt cache file is ignored and rewritten; an unwritable
directory leaves the choices in memory.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields, is_dataclass, replace as _replace
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from . import launch
from .geometry import ConvParams, Geometry, geometry

__all__ = ["tune", "TuneResult", "Variant", "candidates", "current", "cache_dir", "cache_path", "clear",
           "AUTOTUNE_ENV", "CACHE_DIR_ENV", "PASSES"]

AUTOTUNE_ENV = "CUPYCONV_AUTOTUNE"
CACHE_DIR_ENV = "CUPYCONV_CACHE_DIR"
CACHE_FILE = "tuning.json"
FILE_FORMAT = 1

FORWARD, GRAD_INPUT, GRAD_WEIGHT = "forward", "grad_input", "grad_weight"
PASSES = (FORWARD, GRAD_INPUT, GRAD_WEIGHT)

# A first call pays this for every candidate: one warm-up run and FIRST_CALL_REPEAT timed
# runs.  Explicit tuning can afford more.
FIRST_CALL_REPEAT = 3
TUNE_REPEAT = 10
# Candidates whose first timed run is this much slower than the best so far (and slow in
# absolute terms) are not timed further: they cannot win, and big layers make each run costly.
_PRUNE_FACTOR, _PRUNE_MS = 3.0, 1.0
# Below this many channels per group the direct kernels can beat the tensor cores, whose
# tiles are then mostly padding.
DIRECT_MAX_CHANNELS = 64
MAX_GEMM_CANDIDATES = 7
_MEMO_LIMIT = 4096

_log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ variants

@dataclass(frozen=True)
class Variant:
    """One way to run a pass: the direct kernels, or the tensor-core GEMM with planner options.

    ``options`` are keyword arguments of the ``launch.plan_*_gemm`` planners (``tile``,
    ``stages``); none means the planner's own heuristic.
    """

    gemm: bool
    options: Tuple[Tuple[str, object], ...] = ()

    @functools.cached_property
    def kwargs(self) -> Dict[str, object]:
        return dict(self.options)

    @property
    def name(self) -> str:
        if not self.gemm:
            return "direct"
        parts = ["gemm"]
        opts = self.kwargs
        if "tile" in opts:
            parts.append(opts["tile"].name)
        if "stages" in opts:
            parts.append(f"s{opts['stages']}")
        return ":".join(parts)

    @classmethod
    def parse(cls, name: str) -> "Variant":
        """The variant a :attr:`name` stands for; ValueError for anything else."""
        if name == "direct":
            return DIRECT
        head, *rest = str(name).split(":")
        if head != "gemm" or len(rest) > 2:
            raise ValueError(f"not a cupyconv variant name: {name!r}")
        opts: Dict[str, object] = {}
        for part in rest:
            if part in launch.TILES and "tile" not in opts:
                opts["tile"] = launch.TILES[part]
            elif part[:1] == "s" and part[1:].isdigit() and "stages" not in opts:
                opts["stages"] = int(part[1:])
            else:
                raise ValueError(f"not a cupyconv variant name: {name!r}")
        return cls(True, tuple(sorted(opts.items())))

    def __repr__(self) -> str:
        return f"Variant({self.name!r})"


DIRECT = Variant(False)
GEMM = Variant(True)


def _sides(n: int) -> Tuple[int, ...]:
    """Tile sides worth trying along a GEMM dimension of ``n``: the covering side and half of it."""
    side = 32 if n <= 32 else 64 if n <= 64 else 128
    return (side, side // 2) if side > 32 else (side,)


def _gemm_rows(pass_: str, g: Geometry) -> int:
    if pass_ == FORWARD:
        sh, sw = g.params.stride
        return g.batch * -(-g.out_size[0] // sh) * -(-g.out_size[1] // sw)
    return g.batch * g.in_size[0] * g.in_size[1]


_GEMM_PLANNERS = {FORWARD: "plan_forward_gemm", GRAD_INPUT: "plan_grad_input_gemm",
                  GRAD_WEIGHT: "plan_grad_weight_gemm"}


@functools.lru_cache(maxsize=None)
def _accepts(planner: str, name: str) -> bool:
    """Whether ``launch.<planner>`` takes the keyword ``name`` (the planners grow options over time)."""
    import inspect

    try:
        return name in inspect.signature(getattr(launch, planner)).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def _stage_choices(pass_: str = FORWARD) -> Tuple[int, ...]:
    """Pipeline depths the pass's GEMM planner takes besides its default (none if it takes no ``stages``)."""
    if not _accepts(_GEMM_PLANNERS[pass_], "stages"):
        return ()
    default = getattr(launch, "DEFAULT_STAGES", None)
    return tuple(s for s in getattr(launch, "STAGE_CHOICES", ()) if s != default)


# GEMM rows from which 256-row tiles are tried: four such tiles per SM of an H100.
_TALL_TILE_ROWS = 256 * 132 * 4


def gemm_options(pass_: str, g: Geometry, dtype: str, precision: str) -> List[Dict[str, object]]:
    """Planner options worth timing for a GEMM pass, the planner's own defaults first.

    Block tiles whose N side fits the GEMM's N (no 128-wide tiles for 16 channels) and
    whose M side fits its M; tiles the 3xTF32 rule of ``launch._default_tile`` would shrink
    are left out.  The other pipeline depths are tried with the default tile.
    """
    _check_pass(pass_)
    if pass_ == GRAD_WEIGHT:
        bms, bns = _sides(g.in_per_group), _sides(g.out_per_group)
    else:
        rows = _gemm_rows(pass_, g)
        # 256-row tiles halve the weight traffic per output row; worth it only where the
        # M grid still fills the GPU many times over.
        bms = (64, 128, 256) if rows >= _TALL_TILE_ROWS else (64, 128) if rows > 64 else (32, 64)
        bns = _sides(g.out_per_group if pass_ == FORWARD else g.in_per_group)
    options: List[Dict[str, object]] = [{}]
    for bm in bms:
        for bn in bns:
            tile = launch.TILES.get(f"{bm}x{bn}")
            if tile is not None and launch._default_tile(tile, dtype, precision) == tile:
                options.append({"tile": tile})
    options += [{"stages": s} for s in _stage_choices(pass_)]
    return options


def _plan(pass_: str, v: Variant, g: Geometry, dtype: str, layout: str, precision: str, has_bias: bool = False,
          aligned: bool = True, sm_count: int = 132):
    """The plans ``v`` launches for ``pass_`` (a Plan, a pair of Plans or a GemmPlans)."""
    if pass_ == FORWARD:
        if v.gemm:
            return launch.plan_forward_gemm(g, dtype, has_bias, layout, precision, aligned=aligned, **v.kwargs)
        return launch.plan_forward(g, dtype, has_bias, layout)
    if pass_ == GRAD_INPUT:
        if v.gemm:
            return launch.plan_grad_input_gemm(g, dtype, layout, precision, aligned=aligned, **v.kwargs)
        return launch.plan_grad_input(g, dtype, layout)
    if not v.gemm:
        return launch.plan_grad_weight(g, dtype, sm_count, layout)
    if not _accepts("plan_grad_weight_gemm", "aligned"):
        return launch.plan_grad_weight_gemm(g, dtype, sm_count, layout, precision, **v.kwargs)
    plans = launch.plan_grad_weight_gemm(g, dtype, sm_count, layout, precision, aligned=aligned, **v.kwargs)
    vectors = getattr(launch, "grad_weight_vectors", None)
    if vectors is not None and vectors(g, dtype, layout, aligned)[1]:
        plans += launch.plan_grad_weight_sources(g, dtype)  # the channels_last copies it runs first
    return plans


def _plans_of(obj) -> List[launch.Plan]:
    """Every Plan inside what a planner returned."""
    if isinstance(obj, launch.Plan):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [p for item in obj for p in _plans_of(item)]
    if is_dataclass(obj):
        return [p for f in fields(obj) for p in _plans_of(getattr(obj, f.name))]
    return []


def candidates(pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict",
               gemm: Optional[bool] = None) -> List[Variant]:
    """The variants worth timing for ``pass_``, the heuristic choice first.

    ``gemm``: whether the tensor-core kernels can run the layer (by default
    ``engine.gemm_eligible``; the engine passes ``uses_gemm`` for its device).  Variants
    that plan to the same kernel are listed once.  The direct kernels are a candidate only
    for layers thin enough that they can win.
    """
    _check_pass(pass_)
    if gemm is None:
        from . import engine

        gemm = engine.gemm_eligible(g, dtype)
    if not gemm:
        return [DIRECT]
    found: List[Variant] = []
    seen = set()
    for opts in gemm_options(pass_, g, dtype, precision):
        v = Variant(True, tuple(sorted(opts.items())))
        try:
            # variants that plan to the very same launches are one candidate
            identity = tuple(_plans_of(_plan(pass_, v, g, dtype, layout, precision)))
        except (ValueError, TypeError, KeyError):
            if opts:
                continue
            identity = None  # the heuristic is kept whatever happens: it is what runs without tuning
        if identity is not None and identity in seen:
            continue
        seen.add(identity)
        found.append(v)
        if len(found) >= MAX_GEMM_CANDIDATES:
            break
    if min(g.in_per_group, g.out_per_group) < DIRECT_MAX_CHANNELS:
        found.append(DIRECT)
    return found


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")


# ---------------------------------------------------------------------------- the key

def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _key_precision(dtype: str, precision: str) -> str:
    # Only float32 has two precisions; other dtypes share one entry.
    return precision if dtype == "float32" else "-"


def config_key(pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> str:
    """The device-independent part of a stored choice's key."""
    p = g.params
    h, w = g.in_size

    def pair(v):
        return f"{v[0]}x{v[1]}"

    return (f"{pass_}|cin={g.in_channels},cout={g.out_channels},k={pair(g.kernel)},s={pair(p.stride)},"
            f"p={pair(p.padding)},op={pair(p.output_padding)},d={pair(p.dilation)},groups={p.groups},"
            f"n<={_pow2(g.batch)},hw<={_pow2(h)}x{_pow2(w)}|{dtype}|{layout}|{_key_precision(dtype, precision)}")


def make_key(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, gpu_name: str, arch: str,
             version: Optional[str] = None, code: Optional[str] = None) -> str:
    """The full key of a stored choice: library version, kernel code, GPU, arch and configuration."""
    return "|".join((version if version is not None else _version(), code if code is not None else code_hash(),
                     gpu_name, f"sm_{arch}", config_key(pass_, g, dtype, layout, precision)))


def _version() -> str:
    from . import __version__

    return __version__


@functools.lru_cache(maxsize=None)
def code_hash() -> str:
    """A hash of the kernel templates and the planner: choices made for other code are not reused."""
    from . import templates

    h = hashlib.sha256()
    for name in templates.template_names():
        h.update(f"{name}={templates.content_hash(name)};".encode())
    try:
        h.update(Path(launch.__file__).read_bytes())
    except OSError:
        pass
    return h.hexdigest()[:12]


_device_names: Dict[int, Tuple[str, str]] = {}


def _device_info(device_id: int) -> Tuple[str, str]:
    """(GPU name, compute capability) of ``device_id``."""
    info = _device_names.get(device_id)
    if info is None:
        import cupy

        from .compiler import device_arch

        name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        info = _device_names[device_id] = (name, device_arch(device_id))
    return info


# ------------------------------------------------------------------------- the file

def cache_dir() -> Path:
    """Where choices persist: ``CUPYCONV_CACHE_DIR``, else the user cache directory."""
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("cupyconv", appauthor=False))
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "cupyconv"


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _valid_entry(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("variant"), str)


def read_entries(path: Path) -> Dict[str, dict]:
    """The well-formed entries of a choices file; nothing for a missing, unreadable or corrupt one."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(k, str) and _valid_entry(v)}


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between processes (POSIX); elsewhere the atomic replace has to do."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class TuningCache:
    """The choices of one file, mirrored in memory.

    Reads happen only on a miss of the in-process choice, and re-read the file only when it
    changed.  A write merges into what is on disk under a file lock and replaces the file
    atomically, so concurrent processes neither lose each other's entries nor see a torn
    file.  If the file cannot be written the entries stay in memory.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._entries: Dict[str, dict] = {}
        self._stamp = None
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[dict]:
        with self._lock:
            self._refresh()
            return self._entries.get(key)

    def put(self, key: str, entry: dict) -> bool:
        """Remember ``entry``; True when it reached the disk."""
        with self._lock:
            self._entries[key] = entry
            try:
                self._write({key: entry})
                return True
            except OSError as exc:
                _log.info("cupyconv: tuning choices stay in memory, %s is not writable: %s", self.path, exc)
                return False

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._entries.update(read_entries(self.path))
            self._stamp = stamp

    def _write(self, new: Dict[str, dict]) -> None:
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.path.with_name(self.path.name + ".lock")):
            entries = read_entries(self.path)
            entries.update(new)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"format": FILE_FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._entries.update(entries)
            with contextlib.suppress(OSError):
                st = os.stat(self.path)
                self._stamp = (st.st_mtime_ns, st.st_size)


_caches: Dict[Path, TuningCache] = {}
_caches_lock = threading.Lock()


def _cache() -> TuningCache:
    path = cache_path()
    with _caches_lock:
        cache = _caches.get(path)
        if cache is None:
            cache = _caches[path] = TuningCache(path)
        return cache


# ------------------------------------------------------------------------ deciding

# (pass, geometry, dtype, layout, precision, device) -> Variant.  CUPYCONV_AUTOTUNE is read
# when a configuration is first decided, not per call: reading the environment costs
# about a microsecond, most of the hot path's budget for this lookup.
_memo: Dict[tuple, Variant] = {}
_memo_locks: Dict[tuple, threading.Lock] = {}
_memo_locks_lock = threading.Lock()
_local = threading.local()


def enabled() -> bool:
    """Whether first calls may time candidates (``CUPYCONV_AUTOTUNE``, on unless 0/false/off/no)."""
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def clear() -> None:
    """Forget this process's choices (the file is left alone)."""
    with _memo_locks_lock:
        _memo.clear()
        _memo_locks.clear()
    with _caches_lock:
        _caches.clear()


def chosen(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device_id: int) -> Optional[Variant]:
    """This process's choice for the configuration, or None before its first call (the hot path)."""
    return _memo.get((pass_, g, dtype, layout, precision, device_id))


@dataclass
class Decision:
    variant: Variant
    source: str                                    # "tuned", "stored" or "heuristic"
    times_ms: Dict[str, float] = field(default_factory=dict)
    remember: bool = True                          # False: decide again at the next call


def choose(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device_id: int, stream_ptr: int,
           run: Callable[[Variant], None], plans: Callable[[Variant], object]) -> Variant:
    """The variant for a configuration's first call in this process (slow path of :func:`chosen`).

    ``run(v)`` launches variant ``v`` on ``stream_ptr`` with the caller's buffers (every
    candidate overwrites the same outputs, and the caller runs the winner afterwards);
    ``plans(v)`` returns its plans, to compile the candidates side by side.
    """
    key = (pass_, g, dtype, layout, precision, device_id)
    with _memo_locks_lock:
        lock = _memo_locks.setdefault(key, threading.Lock())
    with lock:
        v = _memo.get(key)
        if v is not None:
            return v
        decision = _decide(pass_, g, dtype, layout, precision, device_id, stream_ptr, run, plans,
                           repeat=FIRST_CALL_REPEAT, explicit=False)
        if decision.remember:
            _remember(key, decision.variant)
        return decision.variant


def _remember(key: tuple, v: Variant) -> None:
    if len(_memo) >= _MEMO_LIMIT:
        _memo.clear()
    _memo[key] = v


def _capturing(stream_ptr: int) -> bool:
    """Whether the stream is being captured into a CUDA graph (True when that cannot be told)."""
    try:
        from cupy.cuda import runtime

        return bool(runtime.streamIsCapturing(stream_ptr))
    except Exception:  # e.g. the legacy stream while another stream captures: do not synchronise
        return True


def _deterministic() -> bool:
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.are_deterministic_algorithms_enabled())
    except Exception:
        return False


@contextlib.contextmanager
def _suspended():
    """First calls in this thread use the heuristic and remember nothing (shape discovery in :func:`tune`)."""
    previous = getattr(_local, "suspended", False)
    _local.suspended = True
    try:
        yield
    finally:
        _local.suspended = previous


def _stored(cache: TuningCache, key: str, cands: Sequence[Variant]) -> Optional[Tuple[Variant, dict]]:
    entry = cache.get(key)
    if entry is None:
        return None
    try:
        v = Variant.parse(entry["variant"])
    except ValueError:
        return None
    # A choice made for other candidates (another size in the bucket, an edited file) is re-tuned.
    return (v, entry) if v in cands else None


def _decide(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device_id: int, stream_ptr: int,
            run: Callable[[Variant], None], plans: Callable[[Variant], object], repeat: int, explicit: bool,
            force: bool = False) -> Decision:
    cands = candidates(pass_, g, dtype, layout, precision, gemm=True)
    heuristic = cands[0]
    if len(cands) < 2:
        return Decision(heuristic, "heuristic")
    if not explicit:
        if not enabled():
            return Decision(heuristic, "heuristic")
        if getattr(_local, "suspended", False) or _capturing(stream_ptr):
            return Decision(heuristic, "heuristic", remember=False)
    try:
        gpu_name, arch = _device_info(device_id)
    except Exception as exc:  # without a name there is no key: run as untuned
        _log.debug("cupyconv: no device information for tuning: %s", exc)
        return Decision(heuristic, "heuristic")
    key = make_key(pass_, g, dtype, layout, precision, gpu_name, arch)
    cache = _cache()
    if not force:
        stored = _stored(cache, key, cands)
        if stored is not None:
            v, entry = stored
            times = entry.get("ms") if isinstance(entry.get("ms"), dict) else {}
            return Decision(v, "stored", dict(times))
    if not explicit and _deterministic():
        return Decision(heuristic, "heuristic")
    times = _measure(cands, run, plans, device_id, stream_ptr, repeat)
    if not times:
        return Decision(heuristic, "heuristic")
    winner = min((v for v in cands if v in times), key=lambda v: times[v])  # ties go to the earlier one
    named = {v.name: round(ms, 6) for v, ms in times.items()}
    cache.put(key, {"variant": winner.name, "ms": named, "repeat": repeat, "time": int(time.time())})
    _log.info("cupyconv: %s %s -> %s (%s)", pass_, config_key(pass_, g, dtype, layout, precision), winner.name,
              ", ".join(f"{n} {ms:.4f} ms" for n, ms in named.items()))
    return Decision(winner, "tuned", named)


def _build(cands: Sequence[Variant], plans: Callable[[Variant], object], device_id: int) -> List[Variant]:
    """Compile every candidate's kernels side by side; returns the candidates that built."""
    from concurrent.futures import ThreadPoolExecutor

    from .compiler import device_arch, get_function

    specs: Dict[Variant, list] = {}
    for v in cands:
        try:
            specs[v] = [p.spec for p in _plans_of(plans(v))]
        except Exception as exc:  # a variant this layer cannot plan is not a candidate
            _log.debug("cupyconv: cannot plan %s: %s", v.name, exc)
    unique = list(dict.fromkeys(s for ss in specs.values() for s in ss))
    failed = set()
    if unique:
        arch = device_arch(device_id)
        with ThreadPoolExecutor(max_workers=min(8, len(unique))) as pool:
            futures = [(s, pool.submit(get_function, s, device_id, arch)) for s in unique]
            for s, future in futures:
                try:
                    future.result()
                except Exception as exc:
                    failed.add(s)
                    _log.debug("cupyconv: cannot compile %s: %s", s.function, exc)
    return [v for v in cands if v in specs and not failed.intersection(specs[v])]


def _measure(cands: Sequence[Variant], run: Callable[[Variant], None], plans: Callable[[Variant], object],
             device_id: int, stream_ptr: int, repeat: int) -> Dict[Variant, float]:
    """Median milliseconds of each candidate that compiles and launches, timed with CUDA events.

    Each candidate runs once untimed (first launches set function attributes, and anything
    not compiled ahead compiles there), then ``repeat`` times between event pairs.
    """
    from cupy.cuda import runtime

    times: Dict[Variant, float] = {}
    best = math.inf
    for v in _build(cands, plans, device_id):
        events = []
        try:
            for _ in range(2 * repeat):
                events.append(runtime.eventCreate())
            run(v)
            runtime.eventRecord(events[0], stream_ptr)
            run(v)
            runtime.eventRecord(events[1], stream_ptr)
            runtime.eventSynchronize(events[1])
            samples = [runtime.eventElapsedTime(events[0], events[1])]
            if not (samples[0] > _PRUNE_FACTOR * best and samples[0] > _PRUNE_MS) and repeat > 1:
                for i in range(1, repeat):
                    runtime.eventRecord(events[2 * i], stream_ptr)
                    run(v)
                    runtime.eventRecord(events[2 * i + 1], stream_ptr)
                runtime.eventSynchronize(events[-1])
                samples += [runtime.eventElapsedTime(events[2 * i], events[2 * i + 1]) for i in range(1, repeat)]
            times[v] = statistics.median(samples)
            best = min(best, times[v])
        except Exception as exc:  # a launch failure (resources, shared memory) rules the variant out
            _log.debug("cupyconv: cannot run %s: %s", v.name, exc)
        finally:
            for e in events:
                with contextlib.suppress(Exception):
                    runtime.eventDestroy(e)
    return times


def current(pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict",
            device_id: Optional[int] = None) -> Variant:
    """The variant that runs (or would run) for ``pass_`` now, without timing anything.

    This process's choice, else a stored one, else the heuristic.  ``device_id=None``
    (no GPU) gives the heuristic for an sm_80+ device.
    """
    from . import engine

    _check_pass(pass_)
    if device_id is None:
        return GEMM if engine.gemm_eligible(g, dtype) else DIRECT
    if not engine.uses_gemm(g, dtype, device_id):
        return DIRECT
    v = chosen(pass_, g, dtype, layout, precision, device_id)
    if v is not None:
        return v
    cands = candidates(pass_, g, dtype, layout, precision, gemm=True)
    if enabled() and len(cands) > 1:
        try:
            gpu_name, arch = _device_info(device_id)
            stored = _stored(_cache(), make_key(pass_, g, dtype, layout, precision, gpu_name, arch), cands)
        except Exception:
            stored = None
        if stored is not None:
            return stored[0]
    return cands[0]


# ------------------------------------------------------------------- explicit tuning

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
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64"}


def _torch_module(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def _torch_tensor(obj) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in launch.DTYPES:
        raise TypeError(f"dtype must be one of {sorted(launch.DTYPES)}, got {dtype}")
    return name


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
    if precision not in launch.PRECISIONS:
        raise ValueError(f"precision must be one of {launch.PRECISIONS}, got {precision!r}")
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
        return shape, _dtype_name(dtype if dtype is not None else example.dtype), _layout_name(layout, example), device
    return shape, None if dtype is None else _dtype_name(dtype), _layout_name(layout, None), None


def _module_job(name: str, m, example, dtype, layout, precision) -> _Job:
    if getattr(m, "padding_mode", "zeros") != "zeros":
        raise ValueError(f"{name}: only padding_mode='zeros' is supported, got {m.padding_mode!r}")
    shape, dt, layout, device = _example(example, dtype, layout)
    weight = m.weight
    dt = dt or _dtype_name(weight.dtype)
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
    from .geometry import as_int, as_pair

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
        with torch.no_grad(), _suspended():
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
        dtype = _dtype_name(dtype)
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


def _tune_job(job: _Job, passes: Sequence[str], device: int, repeat: int, force: bool) -> TuneResult:
    import cupy

    from . import engine
    from .functional import _alloc

    g, dtype, precision = job.g, job.dtype, job.precision
    gemm = engine.uses_gemm(g, dtype, device)
    layout = job.layout if gemm else "nchw"    # as cupyconv.torch lays out channels_last input
    result = TuneResult(job.name, g.user_shape(g.input_shape), dtype, layout, precision, {}, {}, {})
    if g.batch == 0 or not gemm:
        for pass_ in passes:
            result.choices[pass_], result.sources[pass_], result.times_ms[pass_] = DIRECT.name, "heuristic", {}
        return result
    storage = "uint16" if dtype == "bfloat16" else dtype
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            # Inputs hold random data; each output is written by every candidate in turn.
            x = _random(cupy, g.input_shape, dtype) if {FORWARD, GRAD_WEIGHT} & set(passes) else None
            w = _random(cupy, g.weight_shape, dtype) if {FORWARD, GRAD_INPUT} & set(passes) else None
            b = _random(cupy, (g.out_channels,), dtype) if job.has_bias and FORWARD in passes else None
            y = _random(cupy, g.output_shape, dtype)
            dx = cupy.empty(math.prod(g.input_shape), dtype=storage) if GRAD_INPUT in passes else None
            dw = cupy.empty(math.prod(g.weight_shape), dtype=storage) if GRAD_WEIGHT in passes else None
            common = dict(device_id=device, stream_ptr=stream.ptr, alloc=_alloc(cupy), layout=layout,
                          precision=precision)
            runs = {
                FORWARD: lambda v: engine._run_forward(v, g, dtype, x.data.ptr, w.data.ptr,
                                                       None if b is None else b.data.ptr, y.data.ptr, **common),
                GRAD_INPUT: lambda v: engine._run_grad_input(v, g, dtype, y.data.ptr, w.data.ptr, dx.data.ptr,
                                                             **common),
                GRAD_WEIGHT: lambda v: engine._run_grad_weight(v, g, dtype, x.data.ptr, y.data.ptr, dw.data.ptr,
                                                               **common),
            }
            for pass_ in passes:
                decision = _decide(
                    pass_, g, dtype, layout, precision, device, stream.ptr, runs[pass_],
                    lambda v, p=pass_: _plan(p, v, g, dtype, layout, precision, job.has_bias, True,
                                             engine.sm_count(device)),
                    repeat=repeat, explicit=True, force=force)
                if enabled():
                    _remember((pass_, g, dtype, layout, precision, device), decision.variant)
                result.choices[pass_], result.sources[pass_] = decision.variant.name, decision.source
                result.times_ms[pass_] = dict(decision.times_ms)
        stream.synchronize()
        del x, w, b, y, dx, dw
    return result


def tune(layers, input_shape=None, *, dtype=None, layout: Optional[str] = None, precision: Optional[str] = None,
         device: Optional[int] = None, passes: Iterable[str] = PASSES, repeat: int = TUNE_REPEAT,
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
        _check_pass(p)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    jobs = _jobs(layers, input_shape, dtype, layout, precision)
    if not jobs:
        return []
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        gpus = 0
    if not gpus:
        raise RuntimeError("cupyconv.tune needs a CUDA GPU usable through CuPy")
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
