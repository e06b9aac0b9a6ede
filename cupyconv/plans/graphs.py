"""A taped call's launches, replayed as one CUDA graph when its pointers repeat.

A :class:`~cupyconv.plans.launch.Replay` launches its kernels one by one, and each launch
costs the host a few microseconds (about twice that inside a training step, whose caches
the rest of the step has cooled). A training loop calls each layer with the same buffers
step after step: torch's caching allocator hands out the same blocks in the same order.
So the second time a replay meets the same pointers (its scratch's included), it captures
its launches into a CUDA graph, and every later call with those pointers launches the
graph: one launch for all of the call's kernels, with the same kernels and arguments.

Capture happens on a private stream in thread-local mode, so no other thread's CUDA calls
are constrained and nothing runs; the graph is then launched on the caller's stream. A
caller's stream that is itself being captured (``torch.cuda.graph``, ``reduce-overhead``)
gets the launches one by one, as before. ``CUPYCONV_GRAPH_REPLAY=0`` turns this off.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Dict, Optional, Sequence

from ..core import streams
from ..jit import compiler

_log = logging.getLogger("cupyconv.graphs")

# Pointer sets a replay keeps graphs for, and pointer sets it remembers having seen once: a loop
# that cycles through a few buffers (double buffering, alternating batches) keeps all of its graphs.
GRAPHS_PER_REPLAY = 8
SEEN_PER_REPLAY = 32

_ENV = "CUPYCONV_GRAPH_REPLAY"


def _enabled_from_env() -> bool:
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


enabled = _enabled_from_env()


def set_enabled(value: bool) -> bool:
    """Turn graph replay on or off for this process; returns the previous setting."""
    global enabled
    previous, enabled = enabled, bool(value)
    return previous


_runtime = None
_capture_streams: Dict[int, object] = {}   # device -> the CuPy stream captures run on
_capture_lock = threading.Lock()


def _bind_runtime():
    global _runtime
    from cupy.cuda import runtime

    _runtime = runtime
    return runtime


def _capture_stream(device_id: int) -> int:
    """A non-blocking stream of ``device_id`` (the current device) that only ever captures."""
    stream = _capture_streams.get(device_id)
    if stream is None:
        import cupy

        stream = _capture_streams[device_id] = cupy.cuda.Stream(non_blocking=True)
    return stream.ptr


class _Executable:
    """An instantiated graph; destroyed with this object (the driver frees one still running when it ends)."""

    __slots__ = ("handle", "generation")

    def __init__(self, handle: int, generation: int):
        self.handle = handle
        self.generation = generation

    def __del__(self):
        runtime = _runtime
        if runtime is not None and self.handle:
            try:
                runtime.graphExecDestroy(self.handle)
            except Exception:  # interpreter shutdown: the context may be gone already
                pass


class GraphReplays:
    """The graphs of one replay, keyed by the call's device and pointers (scratch last)."""

    def __init__(self) -> None:
        self._graphs: "OrderedDict[tuple, _Executable]" = OrderedDict()
        self._seen: "OrderedDict[tuple, None]" = OrderedDict()
        self.failed = False   # a capture failed: this replay launches one by one from now on

    def launch(self, device_id: int, stream_ptr: int, pointers: Sequence[int], replay) -> bool:
        """Launch the graph of ``replay`` (a :class:`~cupyconv.plans.launch.Replay`) for these pointers on
        ``stream_ptr`` if there is one, making it on their second sighting; False when the caller is to launch
        the kernels itself."""
        key = (device_id, *pointers)
        graph = self._graphs.get(key)
        if graph is None or graph.generation != compiler._generation:
            if graph is not None:
                self._graphs.pop(key, None)   # its kernels' modules were unloaded
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > SEEN_PER_REPLAY:
                    self._seen.popitem(last=False)
                return False
            if streams.capturing(stream_ptr):
                return False
            graph = self._capture(device_id, replay, pointers)
            if graph is None:
                return False
            self._seen.pop(key, None)
            self._graphs[key] = graph
            if len(self._graphs) > GRAPHS_PER_REPLAY:
                self._graphs.popitem(last=False)
        elif streams.capturing(stream_ptr):
            return False
        (_runtime or _bind_runtime()).graphLaunch(graph.handle, stream_ptr)
        return True

    def _capture(self, device_id: int, replay, pointers: Sequence[int]) -> Optional[_Executable]:
        """The replay's launches with these pointers as an instantiated graph; None (and this replay launches one
        by one from now on) where CUDA refuses any step of that."""
        runtime = _runtime or _bind_runtime()
        generation = compiler._generation
        graph = 0
        try:
            with _capture_lock:
                stream = _capture_stream(device_id)
                runtime.streamBeginCapture(stream, runtime.streamCaptureModeThreadLocal)
                try:
                    replay.launch_on(device_id, stream, pointers)
                finally:
                    graph = runtime.streamEndCapture(stream)
            return _Executable(runtime.graphInstantiate(graph), generation)
        except Exception as exc:
            self.failed = True
            _log.debug("cupyconv: a replay could not be made a CUDA graph: %s", exc)
            return None
        finally:
            if graph:
                runtime.graphDestroy(graph)
