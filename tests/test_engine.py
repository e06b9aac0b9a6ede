"""The engine without a GPU: what a configuration's first forward hands the compiler ahead of its backward.

The engine runs on a recording launcher of a fake device, and the compiler's background
entry point is replaced by one that writes down what it was given.
"""
import pytest

from cupyconv import engine, tuning
from cupyconv.core import device
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.jit import compiler
from cupyconv.plans import gemm, table
from cupyconv.plans.launch import Recorder

DEV = device.fake(0, name="Fake GPU 80GB", arch="90")
# Eight channels: the direct kernels only, so every pass has a single candidate.
SMALL = geometry((1, 8, 8, 8), (8, 8, 3, 3), None, ConvParams.from_args(stride=2))
THIN = geometry((2, 32, 9, 11), (32, 48, 3, 3), None, ConvParams.from_args(stride=2, padding=1))
_X, _W, _B, _Y = ((i + 1) << 32 for i in range(4))


class TimingRecorder(Recorder):
    """A recorder that counts as a real launcher: the engine may compile and time for it."""

    timing = True


@pytest.fixture
def handed(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(gemm.TENSOR_CORES_ENV, raising=False)
    calls = []
    monkeypatch.setattr(compiler, "compile_in_background", lambda specs, device_id: calls.append((list(specs),
                                                                                                   device_id)))
    engine.clear()
    tuning.clear()
    yield calls
    engine.clear()
    tuning.clear()


def _heuristic_specs(pass_, g, dtype="float32", layout="nchw"):
    precision = "strict"
    v = table.candidates(pass_, g, dtype, layout, precision, DEV)[0]
    return [p.spec for p in table.plan(pass_, v, g, dtype, layout, precision, False, True, DEV.sm_count).plans()]


def test_a_first_forward_under_autograd_hands_over_the_backward_kernels_once(handed):
    mask = (True, True, True)
    engine.forward(SMALL, "float32", _X, _W, _B, _Y, TimingRecorder(DEV), backward_mask=mask)
    assert len(handed) == 1
    specs, device_id = handed[0]
    assert device_id == 0
    assert specs == (_heuristic_specs("grad_input", SMALL) + _heuristic_specs("grad_weight", SMALL)
                     + _heuristic_specs("grad_bias", SMALL))
    assert all(s.function != "conv_transpose2d_forward" for s in specs)
    engine.forward(SMALL, "float32", _X, _W, _B, _Y, TimingRecorder(DEV), backward_mask=mask)
    assert len(handed) == 1, "a configuration's backward is handed over on its first forward only"


def test_only_the_gradients_asked_for_are_handed_over(handed):
    engine.forward(SMALL, "float32", _X, _W, None, _Y, TimingRecorder(DEV), backward_mask=(False, True, False))
    (specs, _), = handed
    assert specs == _heuristic_specs("grad_weight", SMALL)


def test_no_backward_expected_or_no_gpu_hands_over_nothing(handed):
    engine.forward(SMALL, "float32", _X, _W, _B, _Y, TimingRecorder(DEV))
    engine.forward(SMALL, "float32", _X, _W, _B, _Y, Recorder(DEV), backward_mask=(True, True, True))
    assert handed == []


def test_with_autotuning_the_stored_choice_or_the_heuristic_is_handed_over(handed, monkeypatch):
    """The backward's first call runs what is stored, else the heuristic: only those kernels are prefetched
    (the tuner builds the other candidates itself, at a lower priority)."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    cands = table.candidates("grad_weight", THIN, "float16", "nchw", "strict", DEV)
    assert len(cands) > 1

    def specs_of(v):
        plan = table.plan("grad_weight", v, THIN, "float16", "nchw", "strict", False, True, DEV.sm_count)
        return [p.spec for p in plan.plans()]

    engine._prefetch_backward(THIN, "float16", "nchw", "strict", DEV, (False, True, False))
    (specs, _), = handed
    assert specs == specs_of(cands[0])
    stored = cands[-1]
    assert specs_of(stored) != specs_of(cands[0])
    tuning.TuningCache(tuning.cache_path()).put(
        tuning.make_key("grad_weight", THIN, "float16", "nchw", "strict", DEV.name, DEV.arch),
        {"variant": stored.name})
    tuning.clear()
    engine.clear()
    engine._prefetch_backward(THIN, "float16", "nchw", "strict", DEV, (False, True, False))
    assert handed[-1][0] == specs_of(stored)


class CountingRecorder(Recorder):
    """A recorder that counts the allocations the engine asks its caller for."""

    def __init__(self, dev):
        super().__init__(dev)
        self.requests = []
        record = self.alloc

        def alloc(nbytes):
            self.requests.append(nbytes)
            return record(nbytes)
        self.alloc = alloc


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_backward_takes_its_scratch_in_one_allocation(handed, layout):
    big = geometry((16, 8, 32, 32), (8, 8, 3, 3), None, ConvParams.from_args(stride=2))
    rec = CountingRecorder(DEV)
    callers_alloc = rec.alloc
    engine.backward(big, "float32", _Y, _X, _W, 1 << 44, 2 << 44, 3 << 44, rec, layout)
    split = [p for p in rec.passes if any(stage == "reduce" for stage, _ in p.launches)]
    assert [p.name for p in split] == ["grad_weight", "grad_bias"], "both reductions need scratch here"
    needed = sum(plan.scratch_bytes for p in split for _, plan in p.launches)
    assert len(rec.requests) == 1 and rec.requests[0] >= needed
    assert rec.alloc is callers_alloc and rec.copies is None, "the caller's allocator is given back"


def test_a_small_backward_allocates_no_scratch(handed):
    rec = CountingRecorder(DEV)
    engine.backward(SMALL, "float32", _Y, _X, _W, 1 << 44, 2 << 44, 3 << 44, rec)
    assert rec.requests == []
    assert [(p.name, [stage for stage, _ in p.launches]) for p in rec.passes] == [
        ("grad_input", ["main"]), ("grad_weight", ["main"]), ("grad_bias", ["main"])]


# ------------------------------------------------------------------ taped launches of repeated calls

class PointerRecorder(Recorder):
    """A recorder that also writes down each launch's pointers, and lets the engine replay tapes on it."""

    replays = True

    def __init__(self, dev):
        super().__init__(dev)
        self.calls = []     # (stage, plan, pointers) of every launch
        self.requests = []  # scratch sizes asked for

    def _alloc(self, nbytes):
        keep, ptr = super()._alloc(nbytes)
        self.requests.append((nbytes, ptr))
        return keep, ptr

    def launch(self, stage, plan, pointers):
        if self.passes:
            super().launch(stage, plan, pointers)
        self.calls.append((stage, plan, tuple(pointers)))


class PlanningRecorder(PointerRecorder):
    """The same, planning every call: what the engine launches without a tape."""

    replays = False


@pytest.fixture
def planned(monkeypatch):
    """Counts the engine's planning lookups: a replayed call makes none."""
    calls = []
    real = engine._pass_plan

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, "_pass_plan", counting)
    return calls


BIG = geometry((16, 8, 32, 32), (8, 8, 3, 3), None, ConvParams.from_args(stride=2))
_GI, _GW, _GB = (1 << 36, 2 << 36, 3 << 36)


def _backward(g, rec, pointers=(_Y, _X, _W, _GI, _GW, _GB), layout="nchw", dtype="float32"):
    engine.backward(g, dtype, *pointers, rec, layout)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_repeated_backward_replays_the_launches_it_planned_with_its_own_pointers(handed, planned, layout):
    first = PointerRecorder(DEV)
    _backward(BIG, first, layout=layout)
    assert planned and engine._replays, "a call whose choices are final is taped"
    planned.clear()
    moved = tuple(p + (5 << 20) for p in (_Y, _X, _W, _GI, _GW, _GB))  # other buffers, the same alignment
    again = PointerRecorder(DEV)
    _backward(BIG, again, moved, layout=layout)
    assert planned == [], "a replayed call plans nothing"
    fresh = PlanningRecorder(DEV)
    _backward(BIG, fresh, moved, layout=layout)
    assert [(s, p) for s, p, _ in again.calls] == [(s, p) for s, p, _ in fresh.calls]
    assert len(again.requests) == 1, "one scratch allocation"
    assert [n for n, _ in again.requests] == [n for n, _ in fresh.requests]
    # Pointers agree wherever they name the caller's buffers; scratch sits at the same offsets from its base.
    (_, base_again), (_, base_fresh) = again.requests[0], fresh.requests[0]
    for (_, _, got), (_, _, want) in zip(again.calls, fresh.calls):
        assert [p - base_again if p >= base_again else p for p in got] == \
               [p - base_fresh if p >= base_fresh else p for p in want]
    assert any(stage == "reduce" for stage, _, _ in again.calls), "the replay includes split-K's scratch"


def test_a_repeated_forward_replays_with_or_without_bias(handed, planned):
    # channels_last: a layout with one forward candidate (NCHW's races the tiled kernels), so that the first
    # call's choice is final on a launcher that does not time
    assert len(table.candidates("forward", SMALL, "float32", "nhwc", "strict", DEV)) == 1
    for bias in (_B, None):
        rec = PointerRecorder(DEV)
        engine.forward(SMALL, "float32", _X, _W, bias, _Y, rec, "nhwc")
        planned.clear()
        again = PointerRecorder(DEV)
        engine.forward(SMALL, "float32", _X + 1024, _W, bias, _Y + 2048, again, "nhwc")
        assert planned == []
        assert [ptrs for _, _, ptrs in again.calls] == [(_X + 1024, _W, bias or 0, _Y + 2048)]


@pytest.mark.parametrize("weight_channels_last", [False, True])
def test_grad_weight_is_written_in_the_layout_it_is_asked_for(handed, planned, weight_channels_last):
    """``grad_weight_channels_last`` (torch's format for grad_weight, where it is not the weight's): grad_weight's
    launches are those of the layer with its weight in that layout, grad_input's still read the weight in its own,
    and the two kinds of call are taped apart; the first forward hands over the same grad_weight kernels."""
    g = BIG.with_weight_channels_last(weight_channels_last)
    flipped = not weight_channels_last

    def stages(rec):
        return [(stage, plan) for stage, plan, _ in rec.calls]

    def passes(g_in, g_w):
        in_rec, w_rec = PlanningRecorder(DEV), PlanningRecorder(DEV)
        engine.grad_input(g_in, "float32", _Y, _W, _GI, in_rec, "nhwc")
        engine.grad_weight(g_w, "float32", _X, _Y, _GW, w_rec, "nhwc")
        return stages(in_rec) + stages(w_rec)

    asked = PlanningRecorder(DEV)
    engine.backward(g, "float32", _Y, _X, _W, _GI, _GW, None, asked, "nhwc", "strict", flipped)
    assert stages(asked) == passes(g, g.with_weight_channels_last(flipped))
    assert stages(asked) != passes(g, g), "the layer's grad_weight kernels differ with the weight's layout"
    taped = PointerRecorder(DEV)
    engine.backward(g, "float32", _Y, _X, _W, _GI, _GW, None, taped, "nhwc", "strict", flipped)
    planned.clear()
    own = PointerRecorder(DEV)
    engine.backward(g, "float32", _Y, _X, _W, _GI, _GW, None, own, "nhwc")
    assert planned, "a call that writes grad_weight in the weight's own layout is not the other's tape"
    assert stages(own) == passes(g, g)
    engine.forward(g, "float32", _X, _W, None, _Y, TimingRecorder(DEV), "nhwc", backward_mask=(False, True, False),
                   grad_weight_channels_last=flipped)
    assert handed[-1][0] == _heuristic_specs("grad_weight", g.with_weight_channels_last(flipped), layout="nhwc")


def test_another_alignment_or_mask_is_planned_again(handed, planned):
    _backward(SMALL, PointerRecorder(DEV))
    planned.clear()
    _backward(SMALL, PointerRecorder(DEV), (_Y + 2, _X, _W, _GI, _GW, _GB), dtype="float32")
    assert planned, "a pointer of another alignment may change the plans"
    planned.clear()
    _backward(SMALL, PointerRecorder(DEV), (_Y, _X, _W, _GI, None, _GB))
    assert planned, "another set of gradients is another call"


def test_a_tape_is_dropped_when_the_tuner_changes_its_mind_or_pins_variants(handed, planned):
    _backward(SMALL, PointerRecorder(DEV))
    tuning.clear()
    planned.clear()
    _backward(SMALL, PointerRecorder(DEV))
    assert planned, "forgotten choices are made again"
    planned.clear()
    from cupyconv.tuning import decide
    v = table.candidates("grad_input", SMALL, "float32", "nchw", "strict", DEV)[0]
    with decide.pinned({"grad_input": v}):
        _backward(SMALL, PointerRecorder(DEV))
    assert planned, "pinned variants are planned, not replayed"
    planned.clear()
    engine.clear()
    _backward(SMALL, PointerRecorder(DEV))
    assert planned


def test_a_choice_the_tuner_has_not_made_is_not_taped(handed, monkeypatch, planned):
    """With autotuning on, the first calls of a layer with several candidates run the heuristic while the
    others build; only once a choice is remembered is the call taped."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    cands = table.candidates("grad_weight", THIN, "float16", "nchw", "strict", DEV)
    assert len(cands) > 1
    engine.backward(THIN, "float16", _Y, _X, _W, None, _GW, None, PointerRecorder(DEV))
    assert not engine._replays
    from cupyconv.tuning import decide
    decide.remember(("grad_weight", THIN, "float16", "nchw", "strict", DEV.index), cands[-1])
    engine.backward(THIN, "float16", _Y, _X, _W, None, _GW, None, PointerRecorder(DEV))
    planned.clear()
    rec = PointerRecorder(DEV)
    engine.backward(THIN, "float16", _Y, _X, _W, None, _GW, None, rec)
    assert planned == []
    fresh = PlanningRecorder(DEV)
    engine.backward(THIN, "float16", _Y, _X, _W, None, _GW, None, fresh)
    assert [(s, p) for s, p, _ in rec.calls] == [(s, p) for s, p, _ in fresh.calls]
    want = table.plan("grad_weight", cands[-1], THIN, "float16", "nchw", "strict", False, True, DEV.sm_count)
    assert {p for _, p, _ in rec.calls} <= set(want.plans()), "the remembered choice runs"


def test_a_tape_that_cannot_be_made_leaves_the_call_alone(handed, planned, monkeypatch):
    from cupyconv.plans import launch

    def broken(self, stage, plan, pointers):
        raise RuntimeError("tape broke")
    monkeypatch.setattr(launch.Tape, "launch", broken)
    rec = PointerRecorder(DEV)
    _backward(SMALL, rec)
    assert [s for s, _, _ in rec.calls] == ["main", "main", "main"], "the call's own launches all ran"
    assert not engine._replays
