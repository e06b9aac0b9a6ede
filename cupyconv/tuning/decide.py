"""The first-call decision: which of a pass's candidate variants runs, and its timing.

The caller (the engine) hands over the candidates the pass table lists for a
configuration, heuristic first, with a function that runs one and one that lists its
plans.  The first call of a configuration in a process takes a choice stored on disk
for this GPU.  Without one, it runs the heuristic and hands the other candidates' kernels
to a background compiler; the first call after they have built times every candidate
with CUDA events and keeps the fastest.  (A first call that timed at once would wait for
a dozen compiles.)  Once decided, a call costs one dict lookup (:func:`chosen`).

``CUPYCONV_AUTOTUNE=0`` keeps the heuristic: nothing is timed or read from disk.  A first
call never times while its stream is being captured into a CUDA graph, nor under
``torch.use_deterministic_algorithms(True)`` (timing noise would make the choice, and so
the rounding, differ between runs); both use a stored choice or the heuristic.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..core.device import Device
from ..core.geometry import Geometry
from ..core.streams import capturing as _capturing
from . import store
from .variants import Variant

AUTOTUNE_ENV = "CUPYCONV_AUTOTUNE"
# A first call pays this for every candidate: one warm-up run and FIRST_CALL_REPEAT timed
# runs.  Explicit tuning can afford more.
FIRST_CALL_REPEAT = 3
TUNE_REPEAT = 10
# Candidates whose first timed run is this much slower than the best so far (and slow in
# absolute terms) are not timed further: they cannot win, and big layers make each run costly.
_PRUNE_FACTOR, _PRUNE_MS = 3.0, 1.0
_MEMO_LIMIT = 4096

_log = logging.getLogger("cupyconv.tuning")

Run = Callable[[Variant], None]
Plans = Callable[[Variant], list]

# (pass, geometry, dtype, layout, precision, device) -> Variant.  CUPYCONV_AUTOTUNE is read
# when a configuration is first decided, not per call: reading the environment costs
# about a microsecond, most of the hot path's budget for this lookup.
_memo: Dict[tuple, Variant] = {}
_memo_locks: Dict[tuple, threading.Lock] = {}
_memo_locks_lock = threading.Lock()
_local = threading.local()
# pass -> Variant while pinned() runs
_pins: Optional[Dict[str, Variant]] = None
# the same keys -> futures of the candidates' background builds, until they are timed
_building: Dict[tuple, list] = {}
# Changes whenever chosen() may answer differently: a choice remembered or forgotten, pins set or lifted.
_generation = 0


def generation() -> int:
    """A number that changes whenever :func:`chosen` may answer differently for some configuration."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1


def enabled() -> bool:
    """Whether first calls may time candidates (``CUPYCONV_AUTOTUNE``, on unless 0/false/off/no)."""
    return os.environ.get(AUTOTUNE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def clear() -> None:
    """Forget this process's choices (the file is left alone)."""
    with _memo_locks_lock:
        _memo.clear()
        _memo_locks.clear()
        _building.clear()
        _changed()
    store.forget()


def settle(timeout: Optional[float] = None) -> bool:
    """Wait until the candidates that first calls handed to the background compiler have built.

    The next call of each such configuration then times them and keeps the fastest.
    Benchmarks call this after a warm-up, so that the choice is made before they time.
    Returns False if ``timeout`` seconds passed first.
    """
    from concurrent.futures import wait

    with _memo_locks_lock:
        futures = [f for fs in _building.values() for f in fs]
    return not wait(futures, timeout=timeout).not_done


def chosen(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device_id) -> Optional[Variant]:
    """This process's choice for the configuration, or None before its first call (the hot path)."""
    if _pins is not None:
        return _pins.get(pass_)
    return _memo.get((pass_, g, dtype, layout, precision, device_id))


@contextlib.contextmanager
def pinned(variants: Mapping[str, Variant]) -> Iterator[None]:
    """Run the given passes with these variants, and every other pass with its heuristic; nothing is
    timed or remembered meanwhile (sanitizer and test runs of particular candidates)."""
    global _pins
    previous = _pins
    _pins = dict(variants)
    _changed()
    try:
        yield
    finally:
        _pins = previous
        _changed()


@dataclass
class Decision:
    variant: Variant
    source: str                                    # "tuned", "stored" or "heuristic"
    times_ms: Dict[str, float] = field(default_factory=dict)
    remember: bool = True                          # False: decide again at the next call


def choose(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device: Device, stream_ptr: int,
           cands: Sequence[Variant], run: Run, plans: Plans, timing: bool = True) -> Variant:
    """The variant for a configuration's first call in this process (slow path of :func:`chosen`).

    ``cands`` are the pass's candidates, heuristic first.  ``run(v)`` launches ``v`` on
    ``stream_ptr`` with the caller's buffers (every candidate overwrites the same outputs,
    and the caller runs the winner afterwards); ``plans(v)`` lists its plans, to compile
    the candidates side by side.  ``timing=False`` (a launcher that only records) takes a
    remembered or stored choice, else the heuristic, and times nothing.
    """
    if _pins is not None:
        return cands[0]
    if not timing:
        return current(pass_, g, dtype, layout, precision, device, cands)
    key = (pass_, g, dtype, layout, precision, device.index)
    with _memo_locks_lock:
        lock = _memo_locks.setdefault(key, threading.Lock())
    with lock:
        v = _memo.get(key)
        if v is not None:
            return v
        decision = decide(pass_, g, dtype, layout, precision, device, stream_ptr, cands, run, plans,
                          repeat=FIRST_CALL_REPEAT, explicit=False)
        if decision.remember:
            remember(key, decision.variant)
        return decision.variant


def remember(key: tuple, v: Variant) -> None:
    """Keep ``v`` as this process's choice for ``key`` (pass, geometry, dtype, layout, precision, device id)."""
    if len(_memo) >= _MEMO_LIMIT:
        _memo.clear()
    _memo[key] = v
    _changed()


def _deterministic() -> bool:
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.are_deterministic_algorithms_enabled())
    except Exception:
        return False


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """First calls in this thread use the heuristic and remember nothing (shape discovery in ``tune``)."""
    previous = getattr(_local, "suspended", False)
    _local.suspended = True
    try:
        yield
    finally:
        _local.suspended = previous


def _stored(cache: store.TuningCache, key: str, cands: Sequence[Variant]) -> Optional[Tuple[Variant, dict]]:
    entry = cache.get(key)
    if entry is None:
        return None
    try:
        v = Variant.parse(entry["variant"])
    except ValueError:
        return None
    # A choice made for other candidates (another size in the bucket, an edited file) is re-tuned.
    return (v, entry) if v in cands else None


def decide(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device: Device, stream_ptr: int,
           cands: Sequence[Variant], run: Run, plans: Plans, repeat: int, explicit: bool,
           force: bool = False) -> Decision:
    """Stored choice, else timing, else the heuristic; ``explicit`` (``tune``) times even where a
    first call would not, and ``force`` ignores a stored choice."""
    heuristic = cands[0]
    if len(cands) < 2:
        return Decision(heuristic, "heuristic")
    if not explicit:
        if not enabled():
            return Decision(heuristic, "heuristic")
        if getattr(_local, "suspended", False) or _capturing(stream_ptr):
            return Decision(heuristic, "heuristic", remember=False)
    key = store.make_key(pass_, g, dtype, layout, precision, device.name, device.arch)
    cache = store.cache()
    if not force:
        stored = _stored(cache, key, cands)
        if stored is not None:
            v, entry = stored
            times = entry.get("ms") if isinstance(entry.get("ms"), dict) else {}
            return Decision(v, "stored", dict(times))
    if not explicit and _deterministic():
        return Decision(heuristic, "heuristic")
    if not explicit and not _candidates_built((pass_, g, dtype, layout, precision, device.index), cands, plans,
                                              device):
        return Decision(heuristic, "heuristic", remember=False)
    times = _measure(cands, run, plans, device, stream_ptr, repeat)
    if not times:
        return Decision(heuristic, "heuristic")
    winner = min((v for v in cands if v in times), key=lambda v: times[v])  # ties go to the earlier one
    named = {v.name: round(ms, 6) for v, ms in times.items()}
    cache.put(key, {"variant": winner.name, "ms": named, "repeat": repeat, "time": int(time.time())})
    _log.info("cupyconv: %s %s -> %s (%s)", pass_, store.config_key(pass_, g, dtype, layout, precision),
              winner.name, ", ".join(f"{n} {ms:.4f} ms" for n, ms in named.items()))
    return Decision(winner, "tuned", named)


def _candidates_built(key: tuple, cands: Sequence[Variant], plans: Plans, device: Device) -> bool:
    """Whether every candidate's kernels have built (or failed to), so that timing them waits for no
    compile.  The first time a configuration asks, the candidates other than the heuristic (which
    its caller builds now) start building in the background, at low priority."""
    from ..jit.compiler import compile_in_background

    with _memo_locks_lock:
        futures = _building.get(key)
    if futures is None:
        specs = []
        for v in cands[1:]:
            try:
                specs += [p.spec for p in plans(v)]
            except Exception as exc:  # a variant this layer cannot plan is not a candidate
                _log.debug("cupyconv: cannot plan %s: %s", v.name, exc)
        futures = compile_in_background(specs, device.index, low_priority=True)
        with _memo_locks_lock:
            _building[key] = futures
    if not all(f.done() for f in futures):
        return False
    with _memo_locks_lock:
        _building.pop(key, None)
    return True


def _build(cands: Sequence[Variant], plans: Plans, device: Device) -> List[Variant]:
    """Compile every candidate's kernels side by side; returns the candidates that built."""
    from concurrent.futures import ThreadPoolExecutor

    from ..jit.compiler import get_function

    specs: Dict[Variant, list] = {}
    for v in cands:
        try:
            specs[v] = [p.spec for p in plans(v)]
        except Exception as exc:  # a variant this layer cannot plan is not a candidate
            _log.debug("cupyconv: cannot plan %s: %s", v.name, exc)
    unique = list(dict.fromkeys(s for ss in specs.values() for s in ss))
    failed = set()
    if unique:
        with ThreadPoolExecutor(max_workers=min(8, len(unique))) as pool:
            futures = [(s, pool.submit(get_function, s, device.index, device.arch)) for s in unique]
            for s, future in futures:
                try:
                    future.result()
                except Exception as exc:
                    failed.add(s)
                    _log.debug("cupyconv: cannot compile %s: %s", s.function, exc)
    return [v for v in cands if v in specs and not failed.intersection(specs[v])]


def _measure(cands: Sequence[Variant], run: Run, plans: Plans, device: Device, stream_ptr: int,
             repeat: int) -> Dict[Variant, float]:
    """Median milliseconds of each candidate that compiles and launches, timed with CUDA events.

    Each candidate runs once untimed (first launches set function attributes, and anything
    not compiled ahead compiles there), then ``repeat`` times between event pairs.
    """
    from cupy.cuda import runtime

    times: Dict[Variant, float] = {}
    best = math.inf
    for v in _build(cands, plans, device):
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


def current(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device: Optional[Device],
            cands: Sequence[Variant]) -> Variant:
    """The variant that runs (or would run) for ``pass_`` now, without timing anything.

    This process's choice, else a stored one, else the heuristic.  A device without an
    index (the assumed one of a machine without a GPU) gets the heuristic.
    """
    if len(cands) < 2 or device is None or device.index is None:
        return cands[0]
    v = chosen(pass_, g, dtype, layout, precision, device.index)
    if v is not None:
        return v
    if _pins is not None:
        return cands[0]
    if enabled():
        try:
            found = _stored(store.cache(), store.make_key(pass_, g, dtype, layout, precision, device.name,
                                                          device.arch), cands)
        except Exception:
            found = None
        if found is not None:
            return found[0]
    return cands[0]
