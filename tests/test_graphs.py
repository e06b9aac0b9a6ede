"""Replays launched as one CUDA graph when a call's pointers repeat, without a GPU.

The engine runs a split-K backward (several launches and scratch) on a launcher of a fake
device; the CUDA runtime's graph entry points are replaced by a fake that writes down
captures and graph launches, and ``Plan.run`` by one that writes down each launch.
"""
import pytest

from cupyconv import engine, tuning
from cupyconv.core import device, streams
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.jit import compiler
from cupyconv.plans import gemm, graphs, launch

DEV = device.fake(0, name="Fake GPU 80GB", arch="90")
BIG = geometry((16, 8, 32, 32), (8, 8, 3, 3), None, ConvParams.from_args(stride=2))
ONE = geometry((1, 8, 8, 8), (8, 8, 3, 3), None, ConvParams.from_args(stride=2))
POINTERS = tuple((i + 1) << 36 for i in range(6))   # grad_output, input, weight, grad_input, grad_weight, grad_bias
USER_STREAM, CAPTURE_STREAM = 77, 99


class FakeRuntime:
    """The graph entry points of ``cupy.cuda.runtime``: captures and launches are written down."""

    streamCaptureModeThreadLocal = 1

    def __init__(self):
        self.capturing = set()    # streams under capture
        self.captures = []        # the launches of each capture
        self.graph_launches = []  # (exec handle, stream)
        self.destroyed = []       # exec handles
        self.fail = None          # the step that raises: "begin", "end" or "instantiate"
        self._next = 1000

    def streamIsCapturing(self, stream):
        return stream in self.capturing

    def streamBeginCapture(self, stream, mode):
        assert mode == self.streamCaptureModeThreadLocal, "no other thread's CUDA calls may be constrained"
        if self.fail == "begin":
            raise RuntimeError("begin")
        self.capturing.add(stream)
        self.captures.append([])

    def streamEndCapture(self, stream):
        self.capturing.discard(stream)
        if self.fail == "end":
            raise RuntimeError("capture invalidated")
        self._next += 1
        return self._next

    def graphInstantiate(self, graph):
        if self.fail == "instantiate":
            raise RuntimeError("instantiate")
        return graph + 10 ** 6

    def graphDestroy(self, graph):
        pass

    def graphExecDestroy(self, handle):
        self.destroyed.append(handle)

    def graphLaunch(self, handle, stream):
        assert stream not in self.capturing
        self.graph_launches.append((handle, stream))


class GraphLauncher(launch.Recorder):
    """A launcher that replays tapes and may launch them as graphs; its own launches are written down."""

    replays = True
    graphs = True

    def __init__(self):
        super().__init__(DEV)
        self.stream_ptr = USER_STREAM
        self.calls = []

    def launch(self, stage, plan, pointers):
        if self.passes:   # the engine's first call, planned on this launcher
            super().launch(stage, plan, pointers)
        self.calls.append((plan, tuple(pointers)))


class Scratch:
    """Scratch addresses handed out in turn from a fixed cycle (a caching allocator's steady state)."""

    def __init__(self, *bases):
        self.bases, self.i = bases, 0

    def __call__(self, nbytes):
        base = self.bases[self.i % len(self.bases)]
        self.i += 1
        return None, base


@pytest.fixture
def runtime(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV, raising=False)
    monkeypatch.setattr(compiler, "compile_in_background", lambda specs, device_id: None)
    fake = FakeRuntime()
    monkeypatch.setattr(graphs, "_runtime", fake)
    monkeypatch.setattr(streams, "capturing", fake.streamIsCapturing)
    monkeypatch.setattr(graphs, "_capture_streams", {DEV.index: type("Stream", (), {"ptr": CAPTURE_STREAM})()})
    monkeypatch.setattr(graphs, "enabled", True)
    captured = []

    def run(plan, device_id, stream_ptr, pointers):   # only a capture launches through Plan.run
        assert stream_ptr == CAPTURE_STREAM and stream_ptr in fake.capturing
        fake.captures[-1].append((plan, tuple(pointers)))
    monkeypatch.setattr(launch.Plan, "run", run)
    engine.clear()
    tuning.clear()
    yield fake
    engine.clear()
    tuning.clear()


def _call(g=BIG, pointers=POINTERS, scratch=Scratch(1 << 44)):
    rec = GraphLauncher()
    rec.alloc = scratch
    engine.backward(g, "float32", *pointers, rec, "nchw")
    return rec


def test_the_second_sighting_of_a_calls_pointers_captures_and_later_calls_launch_the_graph(runtime):
    first = _call()                       # planned and taped
    assert len(first.calls) > 1 and any(p.scratch_bytes for p, _ in first.calls), "split-K: several launches"
    one_by_one = _call()                  # replayed; its pointers seen once
    assert one_by_one.calls == first.calls and not runtime.captures
    captured = _call()                    # seen twice: captured, then launched as a graph
    assert captured.calls == [], "a graph replaces the launches"
    assert runtime.captures == [first.calls], "the graph holds the same kernels with the same pointers"
    assert len(runtime.graph_launches) == 1 and runtime.graph_launches[0][1] == USER_STREAM
    for _ in range(3):
        assert _call().calls == []
    assert len(runtime.captures) == 1 and len(runtime.graph_launches) == 4
    assert len({h for h, _ in runtime.graph_launches}) == 1


def test_other_pointers_or_other_scratch_are_other_graphs(runtime):
    for _ in range(3):
        _call()
    moved = tuple(p + (5 << 20) for p in POINTERS)
    assert _call(pointers=moved).calls, "new pointers launch one by one"
    assert _call(scratch=Scratch(2 << 44)).calls, "so does new scratch"
    assert len(runtime.captures) == 1
    assert _call(pointers=moved).calls == [] and len(runtime.captures) == 2
    assert runtime.captures[1][0][1] != runtime.captures[0][0][1]


def test_alternating_buffers_keep_their_graphs(runtime):
    scratch = Scratch(1 << 44, 2 << 44)   # the allocator alternates between two blocks
    for _ in range(4):
        _call(scratch=scratch)
    for _ in range(6):
        assert _call(scratch=scratch).calls == []
    assert len(runtime.captures) == 2


def test_a_graph_per_pointer_set_up_to_a_bound(runtime, monkeypatch):
    monkeypatch.setattr(graphs, "GRAPHS_PER_REPLAY", 2)
    sets = [tuple(p + (k << 20) for p in POINTERS) for k in range(1, 4)]
    _call()   # planned and taped
    for pointers in sets + sets:
        _call(pointers=pointers)
    assert len(runtime.captures) == 3
    replay = next(iter(engine._replays.values()))
    assert len(replay.graphs._graphs) == 2, "the oldest graph is dropped"
    import gc
    gc.collect()
    assert len(runtime.destroyed) == 1, "and destroyed"


def test_a_stream_under_capture_gets_the_launches_one_by_one(runtime):
    for _ in range(3):
        _call()
    runtime.capturing.add(USER_STREAM)   # torch.cuda.graph or reduce-overhead is capturing the caller's stream
    assert _call().calls, "a graph launch would be captured as a launch of a graph that may be freed"
    runtime.capturing.clear()
    assert _call().calls == []


def test_no_graphs_when_turned_off(runtime):
    previous = graphs.set_enabled(False)
    try:
        for _ in range(4):
            assert _call().calls
        assert not runtime.captures and not runtime.graph_launches
    finally:
        graphs.set_enabled(previous)


@pytest.mark.parametrize("step", ["begin", "end", "instantiate"])
def test_a_capture_cuda_refuses_leaves_the_replay_launching_one_by_one(runtime, step):
    _call()
    _call()
    runtime.fail = step
    rec = _call()
    assert rec.calls and len(rec.calls) == len(_call().calls), "the call's kernels ran, once each"
    runtime.fail = None
    for _ in range(2):
        assert _call().calls, "no further capture is tried"
    assert not runtime.graph_launches and not runtime.capturing, "no stream is left capturing"


def test_graphs_of_unloaded_kernels_are_made_again(runtime, monkeypatch):
    for _ in range(3):
        _call()
    monkeypatch.setattr(compiler, "_generation", compiler._generation + 1)   # the compiler's caches were cleared
    assert _call().calls, "the old graph is not launched"
    assert _call().calls == [] and len(runtime.captures) == 2


def test_a_call_of_one_launch_has_no_graph(runtime):
    for _ in range(4):
        rec = GraphLauncher()
        engine.forward(ONE, "float32", *POINTERS[:2], None, POINTERS[3], rec, "nhwc")
        assert len(rec.calls) == 1
    (replay,) = engine._replays.values()
    assert len(replay.steps) == 1 and replay.graphs is None
    assert not runtime.captures and not runtime.graph_launches


def test_watchers_see_a_graphs_launches(runtime):
    first = _call()
    _call()
    with launch.watch() as seen:
        assert _call().calls == []
    assert [plan for _, plan in seen] == [plan for plan, _ in first.calls]
