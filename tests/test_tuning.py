"""Autotuning without a GPU: keys, candidates, the choices file and the decision rules.

Timing itself needs a GPU (tests/test_tuning_gpu.py); here ``tuning._measure`` is replaced
by a fake that returns chosen times, so everything around it is checked on the CPU.
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from cupyconv import engine, launch, tuning
from cupyconv.geometry import ConvParams, geometry

ROOT = Path(__file__).resolve().parents[1]


def _g(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


THIN = _g((2, 32, 9, 11), (32, 48, 3, 3), stride=2, padding=1)          # GEMM-eligible, under 64 channels
WIDE = _g((4, 128, 8, 8), (128, 96, 4, 4), stride=2, padding=1)        # GEMM-eligible, wide
N16 = _g((3, 64, 16, 16), (64, 16, 3, 3))                               # GEMM N = 16 in the forward
DEPTHWISE = _g((2, 16, 8, 8), (16, 1, 4, 4), stride=2, padding=1, groups=16)
GPU_NAME, ARCH = "Fake GPU 80GB", "90"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Autotuning on, an empty cache directory, a fake device, and no choice remembered."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(engine.TENSOR_CORES_ENV, raising=False)
    monkeypatch.setattr(tuning, "_device_info", lambda device_id: (GPU_NAME, ARCH))
    monkeypatch.setattr(tuning, "_capturing", lambda stream_ptr: False)
    tuning.clear()
    yield tmp_path / "cache"
    tuning.clear()


class FakeTimer:
    """Stands in for ``tuning._measure``: times by variant name, and counts calls."""

    def __init__(self, times=None, default=1.0):
        self.times = times or {}
        self.default = default
        self.calls = []

    def __call__(self, cands, run, plans, device_id, stream_ptr, repeat):
        self.calls.append([v.name for v in cands])
        return {v: self.times.get(v.name, self.default) for v in cands if self.times.get(v.name, 0) is not None}


def _choose(pass_="forward", g=THIN, dtype="float16", layout="nchw", precision="strict", device_id=0):
    runs = []
    v = tuning.choose(pass_, g, dtype, layout, precision, device_id, 0, runs.append, lambda v: None)
    return v, runs


def _entries(cache_dir):
    data = json.loads((cache_dir / tuning.CACHE_FILE).read_text())
    assert data["format"] == tuning.FILE_FORMAT
    return data["entries"]


# ------------------------------------------------------------------------------ variants

def test_variant_names_round_trip():
    for g in (THIN, WIDE, N16):
        for dtype, precision in (("float16", "strict"), ("float32", "tf32"), ("float32", "strict")):
            for pass_ in tuning.PASSES:
                for layout in launch.LAYOUTS:
                    for v in tuning.candidates(pass_, g, dtype, layout, precision):
                        assert tuning.Variant.parse(v.name) == v
    assert tuning.Variant.parse("direct") is tuning.DIRECT
    assert tuning.Variant.parse("gemm") == tuning.GEMM
    for bad in ("", "gemm:7x7", "gemm:64x64:64x64", "gemm:sx", "cudnn", "gemm:s2:s3", "direct:64x64"):
        with pytest.raises(ValueError):
            tuning.Variant.parse(bad)


# ------------------------------------------------------------------------------ the key

def test_key_names_version_code_gpu_arch_pass_layer_dtype_layout_and_precision():
    key = tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH)
    import cupyconv

    parts = key.split("|")
    assert parts[:4] == [cupyconv.__version__, tuning.code_hash(), GPU_NAME, "sm_90"]
    assert parts[4] == "grad_input"
    assert parts[-3:] == ["float32", "nhwc", "tf32"]
    assert "cin=32,cout=48,k=3x3,s=2x2,p=1x1,op=0x0,d=1x1,groups=1" in key
    variations = [
        tuning.make_key("forward", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float16", "nhwc", "strict", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nchw", "tf32", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "strict", GPU_NAME, ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", "Other GPU", ARCH),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, "80"),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH, version="0.0.1"),
        tuning.make_key("grad_input", THIN, "float32", "nhwc", "tf32", GPU_NAME, ARCH, code="0123"),
        tuning.make_key("grad_input", _g((2, 32, 9, 11), (32, 48, 3, 3), stride=2), "float32", "nhwc", "tf32",
                        GPU_NAME, ARCH),
    ]
    assert len(set(variations + [key])) == len(variations) + 1


def test_key_buckets_batch_and_spatial_size_to_powers_of_two():
    def key(batch, h, w):
        return tuning.config_key("forward", _g((batch, 32, h, w), (32, 48, 3, 3)), "float16", "nchw", "strict")

    assert key(5, 100, 60) == key(8, 128, 64) == key(7, 65, 33)
    assert key(8, 128, 64) != key(9, 128, 64)
    assert key(8, 128, 64) != key(8, 129, 64)
    assert key(1, 1, 1) != key(2, 1, 1)
    # precision is one entry for the dtypes it does not apply to
    g = _g((2, 32, 9, 11), (32, 48, 3, 3))
    assert tuning.config_key("forward", g, "float16", "nchw", "strict") == \
        tuning.config_key("forward", g, "float16", "nchw", "tf32")
    assert tuning.config_key("forward", g, "float32", "nchw", "strict") != \
        tuning.config_key("forward", g, "float32", "nchw", "tf32")


def test_code_hash_is_stable_and_short():
    assert tuning.code_hash() == tuning.code_hash()
    assert len(tuning.code_hash()) == 12 and "|" not in tuning.code_hash()


# ----------------------------------------------------------------------- candidates

def _tile(v):
    return v.kwargs.get("tile")


@pytest.mark.parametrize("pass_", tuning.PASSES)
@pytest.mark.parametrize("case", [("float16", "strict"), ("bfloat16", "strict"), ("float32", "tf32"),
                                  ("float32", "strict")], ids=["fp16", "bf16", "tf32", "fp32_strict"])
def test_candidates_plan_distinct_launches_heuristic_first(pass_, case):
    dtype, precision = case
    for g in (THIN, WIDE, N16):
        for layout in launch.LAYOUTS:
            cands = tuning.candidates(pass_, g, dtype, layout, precision)
            assert cands[0] == tuning.GEMM, "the heuristic must come first: it is the fallback and tie-breaker"
            assert len(cands) == len(set(cands)) <= tuning.MAX_GEMM_CANDIDATES + 1
            identities = set()
            for v in cands:
                plans = tuning._plans_of(tuning._plan(pass_, v, g, dtype, layout, precision))
                assert plans and all(isinstance(p, launch.Plan) for p in plans)
                identities.add(tuple(plans))
            assert len(identities) == len(cands), "two candidates launch the same kernels"


def test_tile_sides_fit_the_gemm():
    # forward GEMM N is C_out per group = 16: no tile wider than 32 along N
    for v in tuning.candidates("forward", N16, "float16", "nhwc", "strict"):
        if not v.gemm:
            continue
        plan = tuning._plan("forward", v, N16, "float16", "nhwc", "strict")
        assert dict(plan.gemm.spec.constants)["BN"] == 32
    # ...but grad_input's N is C_in per group = 64, where 128-wide tiles are pointless too
    for v in tuning.candidates("grad_input", N16, "float16", "nhwc", "strict"):
        assert _tile(v) is None or _tile(v).bn in (32, 64)
    # grad_weight's tile covers C_in x C_out per group: 64 x 16
    for v in tuning.candidates("grad_weight", N16, "float16", "nhwc", "strict"):
        assert _tile(v) is None or (_tile(v).bm in (32, 64) and _tile(v).bn == 32)
    # a wide layer tries the 128-wide tiles
    names = {v.name for v in tuning.candidates("forward", WIDE, "float16", "nhwc", "strict")}
    assert {"gemm:64x64", "gemm:64x128"} & names or "gemm:128x64" in names
    assert len(tuning.candidates("forward", WIDE, "float16", "nhwc", "strict")) >= 3


def test_strict_float32_never_tries_tiles_over_64x64():
    for g in (THIN, WIDE, N16):
        for pass_ in tuning.PASSES:
            for v in tuning.candidates(pass_, g, "float32", "nhwc", "strict"):
                if not v.gemm:
                    continue
                plans = tuning._plans_of(tuning._plan(pass_, v, g, "float32", "nhwc", "strict"))
                gemm_plan = [p for p in plans if "igemm" in p.spec.template][0]
                constants = dict(gemm_plan.spec.constants)
                assert constants["BM"] * constants["BN"] <= 64 * 64, v.name
    # TF32 has no such cap
    wide_tf32 = tuning.candidates("forward", WIDE, "float32", "nhwc", "tf32")
    assert any(_tile(v) is not None and _tile(v).bm * _tile(v).bn > 64 * 64 for v in wide_tf32)


def test_direct_kernels_are_a_candidate_for_thin_layers_only():
    for pass_ in tuning.PASSES:
        for layout in ("nchw", "nhwc"):
            assert tuning.candidates(pass_, THIN, "float16", layout, "strict")[-1] == tuning.DIRECT
        assert tuning.DIRECT not in tuning.candidates(pass_, WIDE, "float16", "nchw", "strict")
        # layers the tensor cores cannot run have the direct kernels only
        assert tuning.candidates(pass_, DEPTHWISE, "float16", "nchw", "strict") == [tuning.DIRECT]
        assert tuning.candidates(pass_, THIN, "float64", "nchw", "strict") == [tuning.DIRECT]
        assert tuning.candidates(pass_, THIN, "float16", "nchw", "strict", gemm=False) == [tuning.DIRECT]


@pytest.mark.parametrize("pass_", tuning.PASSES)
def test_pipeline_depths_are_tried_when_the_planner_takes_them(pass_):
    cands = tuning.candidates(pass_, WIDE, "float16", "nhwc", "strict")
    staged = [v for v in cands if "stages" in v.kwargs]
    assert [v.kwargs["stages"] for v in staged] == list(tuning._stage_choices(pass_))
    for v in staged:
        plans = tuning._plans_of(tuning._plan(pass_, v, WIDE, "float16", "nhwc", "strict"))
        assert any(dict(p.spec.constants).get("STAGES") == v.kwargs["stages"] for p in plans)
    if not tuning._accepts(tuning._GEMM_PLANNERS[pass_], "stages"):
        assert not staged


def test_tensor_cores_off_forces_direct(monkeypatch):
    monkeypatch.setenv(engine.TENSOR_CORES_ENV, "0")
    for pass_ in tuning.PASSES:
        assert tuning.candidates(pass_, THIN, "float16", "nchw", "strict") == [tuning.DIRECT]
        assert tuning.current(pass_, THIN, "float16") == tuning.DIRECT
    calls = []
    v = engine._variant("forward", lambda *a: calls.append(a), (THIN, "float16", 0, 0, None, 0, 0, 0, None, "nchw",
                                                                 "strict"))
    assert v == tuning.DIRECT and not calls


# --------------------------------------------------------------------- the choices file

def test_cache_file_round_trip(tmp_path):
    path = tmp_path / "d" / tuning.CACHE_FILE
    entry = {"variant": "gemm:64x64", "ms": {"gemm": 1.5, "gemm:64x64": 1.25}, "repeat": 3, "time": 1}
    assert tuning.TuningCache(path).put("k1", entry)
    assert tuning.TuningCache(path).get("k1") == entry
    assert tuning.TuningCache(path).put("k2", {"variant": "direct"})
    data = json.loads(path.read_text())
    assert data == {"format": tuning.FILE_FORMAT, "entries": {"k1": entry, "k2": {"variant": "direct"}}}
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")], "temporary file left behind"


def test_cache_sees_another_writers_entries(tmp_path):
    path = tmp_path / tuning.CACHE_FILE
    reader, writer = tuning.TuningCache(path), tuning.TuningCache(path)
    assert reader.get("k") is None
    writer.put("k", {"variant": "gemm"})
    assert reader.get("k") == {"variant": "gemm"}


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'{"format": 999}',
                                     b'{"format": 1, "entries": []}', b""])
def test_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, content):
    path = tmp_path / tuning.CACHE_FILE
    path.write_bytes(content)
    cache = tuning.TuningCache(path)
    assert cache.get("k") is None
    assert cache.put("k", {"variant": "direct"})
    assert json.loads(path.read_text()) == {"format": tuning.FILE_FORMAT, "entries": {"k": {"variant": "direct"}}}


def test_malformed_entries_are_dropped(tmp_path):
    path = tmp_path / tuning.CACHE_FILE
    path.write_text(json.dumps({"format": tuning.FILE_FORMAT, "entries": {
        "good": {"variant": "gemm"}, "no_variant": {"ms": {}}, "not_a_dict": "gemm", "number": {"variant": 3}}}))
    assert tuning.read_entries(path) == {"good": {"variant": "gemm"}}
    tuning.TuningCache(path).put("new", {"variant": "direct"})
    assert set(json.loads(path.read_text())["entries"]) == {"good", "new"}


def test_unwritable_cache_dir_keeps_choices_in_memory(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = tuning.TuningCache(blocker / "sub" / tuning.CACHE_FILE)
    assert cache.put("k", {"variant": "gemm"}) is False
    assert cache.get("k") == {"variant": "gemm"}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores permissions")
def test_read_only_cache_dir_keeps_choices_in_memory(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        cache = tuning.TuningCache(directory / tuning.CACHE_FILE)
        assert cache.put("k", {"variant": "gemm"}) is False
        assert cache.get("k") == {"variant": "gemm"}
    finally:
        directory.chmod(0o700)


def test_concurrent_processes_and_threads_lose_no_entry(tmp_path):
    path = tmp_path / tuning.CACHE_FILE
    script = textwrap.dedent(f"""
        import sys
        from cupyconv.tuning import TuningCache
        cache = TuningCache({str(path)!r})
        for i in range(25):
            assert cache.put(f"p{{sys.argv[1]}}-{{i}}", {{"variant": "gemm", "i": i}})
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)], env=env) for n in range(6)]
    errors = []

    def writer(n):
        try:
            cache = tuning.TuningCache(path)
            for i in range(25):
                assert cache.put(f"t{n}-{i}", {"variant": "direct"})
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(timeout=120) for p in procs] == [0] * 6
    assert not errors
    entries = tuning.read_entries(path)
    assert set(entries) == {f"p{n}-{i}" for n in range(6) for i in range(25)} | \
        {f"t{n}-{i}" for n in range(4) for i in range(25)}


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.CACHE_DIR_ENV, str(tmp_path / "x"))
    assert tuning.cache_path() == tmp_path / "x" / tuning.CACHE_FILE
    monkeypatch.delenv(tuning.CACHE_DIR_ENV)
    platformdirs = pytest.importorskip("platformdirs")
    assert tuning.cache_dir() == Path(platformdirs.user_cache_dir("cupyconv", appauthor=False))


# ------------------------------------------------------------------------- decisions

def test_first_call_times_candidates_keeps_the_fastest_and_persists_it(fresh, monkeypatch):
    cands = tuning.candidates("forward", THIN, "float16", "nchw", "strict")
    fastest = cands[2]
    timer = FakeTimer({fastest.name: 0.25}, default=1.0)
    monkeypatch.setattr(tuning, "_measure", timer)
    v, _ = _choose()
    assert v == fastest
    assert timer.calls == [[c.name for c in cands]]
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) == fastest
    # the next call is a lookup
    assert _choose()[0] == fastest and len(timer.calls) == 1
    key = tuning.make_key("forward", THIN, "float16", "nchw", "strict", GPU_NAME, ARCH)
    entry = _entries(fresh)[key]
    assert entry["variant"] == fastest.name
    assert entry["ms"][fastest.name] == 0.25 and set(entry["ms"]) == {c.name for c in cands}
    # another device of the process decides on its own
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 1) is None


def test_ties_go_to_the_heuristic(fresh, monkeypatch):
    monkeypatch.setattr(tuning, "_measure", FakeTimer(default=1.0))
    assert _choose()[0] == tuning.GEMM


def test_stored_choice_is_reused_without_timing_after_a_restart(fresh, monkeypatch):
    cands = tuning.candidates("grad_weight", THIN, "float16", "nchw", "strict")
    monkeypatch.setattr(tuning, "_measure", FakeTimer({cands[-1].name: 0.1}))
    assert _choose("grad_weight")[0] == cands[-1]
    tuning.clear()  # as a new process: nothing in memory, only the file

    def no_timing(*args):
        raise AssertionError("a stored choice must not be timed again")

    monkeypatch.setattr(tuning, "_measure", no_timing)
    assert _choose("grad_weight")[0] == cands[-1]
    # another size in the same bucket reuses it too
    other = _g((2, 32, 10, 12), (32, 48, 3, 3), stride=2, padding=1)
    assert _choose("grad_weight", g=other)[0] == cands[-1]


def test_stored_choice_that_is_no_candidate_is_tuned_again(fresh, monkeypatch):
    key = tuning.make_key("forward", WIDE, "float16", "nhwc", "strict", GPU_NAME, ARCH)
    # the direct kernels are no candidate for a layer this wide
    assert tuning.DIRECT not in tuning.candidates("forward", WIDE, "float16", "nhwc", "strict")
    tuning.TuningCache(fresh / tuning.CACHE_FILE).put(key, {"variant": "direct"})
    timer = FakeTimer()
    monkeypatch.setattr(tuning, "_measure", timer)
    v, _ = _choose(g=WIDE, layout="nhwc")
    assert v != tuning.DIRECT and len(timer.calls) == 1
    assert _entries(fresh)[key]["variant"] == v.name


def test_autotune_off_uses_the_heuristic_and_writes_nothing(fresh, monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(tuning, "_measure", timer)
    key = tuning.make_key("forward", THIN, "float16", "nchw", "strict", GPU_NAME, ARCH)
    fresh.mkdir(parents=True)
    tuning.TuningCache(fresh / tuning.CACHE_FILE).put(key, {"variant": "direct"})
    before = (fresh / tuning.CACHE_FILE).read_bytes()
    v, runs = _choose()
    assert v == tuning.GEMM and not runs and not timer.calls
    assert (fresh / tuning.CACHE_FILE).read_bytes() == before
    assert tuning.current("forward", THIN, "float16", device_id=None) == tuning.GEMM
    for off in ("false", "OFF", " no "):
        monkeypatch.setenv(tuning.AUTOTUNE_ENV, off)
        assert not tuning.enabled()
    monkeypatch.delenv(tuning.AUTOTUNE_ENV)
    assert tuning.enabled()


def test_no_tuning_while_the_stream_is_captured(fresh, monkeypatch):
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(tuning, "_measure", timer)
    monkeypatch.setattr(tuning, "_capturing", lambda stream_ptr: True)
    assert _choose()[0] == tuning.GEMM
    assert not timer.calls and not (fresh / tuning.CACHE_FILE).exists()
    assert tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None, \
        "a choice made under capture must not stick: the next eager call tunes"
    monkeypatch.setattr(tuning, "_capturing", lambda stream_ptr: False)
    assert _choose()[0] == tuning.DIRECT and len(timer.calls) == 1


def test_capture_check_errs_on_the_safe_side(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda s: (_ for _ in ()).throw(RuntimeError()))
    assert tuning._capturing(0) is True


def test_deterministic_mode_does_not_time_but_uses_a_stored_choice(fresh, monkeypatch):
    torch = pytest.importorskip("torch")
    timer = FakeTimer({"direct": 0.001})
    monkeypatch.setattr(tuning, "_measure", timer)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert _choose()[0] == tuning.GEMM and not timer.calls
        tuning.clear()
        key = tuning.make_key("forward", THIN, "float16", "nchw", "strict", GPU_NAME, ARCH)
        tuning.TuningCache(fresh / tuning.CACHE_FILE).put(key, {"variant": "direct"})
        assert _choose()[0] == tuning.DIRECT and not timer.calls
    finally:
        torch.use_deterministic_algorithms(saved)


def test_all_candidates_failing_falls_back_to_the_heuristic(fresh, monkeypatch):
    monkeypatch.setattr(tuning, "_measure", lambda *a: {})
    assert _choose()[0] == tuning.GEMM
    assert not (fresh / tuning.CACHE_FILE).exists()


def test_candidates_that_cannot_plan_or_compile_are_skipped(monkeypatch):
    from cupyconv import compiler

    cands = tuning.candidates("forward", THIN, "float16", "nchw", "strict")
    bad_plan, bad_compile = cands[1], cands[2]
    bad_spec = tuning._plan("forward", bad_compile, THIN, "float16", "nchw", "strict").gemm.spec
    built = []

    def get_function(spec, device_id, arch=None):
        if spec == bad_spec:
            raise compiler.KernelCompileError("k", (), "error", "src")
        built.append(spec)

    def plans(v):
        if v == bad_plan:
            raise ValueError("cannot plan")
        return tuning._plan("forward", v, THIN, "float16", "nchw", "strict")

    monkeypatch.setattr(compiler, "get_function", get_function)
    monkeypatch.setattr(compiler, "device_arch", lambda device_id: ARCH)
    ok = tuning._build(cands, plans, 0)
    assert ok == [c for c in cands if c not in (bad_plan, bad_compile)]
    assert len(built) == len(set(built)), "each kernel compiles once"


def test_shape_discovery_runs_remember_nothing(fresh, monkeypatch):
    timer = FakeTimer()
    monkeypatch.setattr(tuning, "_measure", timer)
    with tuning._suspended():
        assert _choose()[0] == tuning.GEMM
    assert not timer.calls and tuning.chosen("forward", THIN, "float16", "nchw", "strict", 0) is None


def test_engine_asks_the_tuner_once_per_configuration(fresh, monkeypatch):
    monkeypatch.setitem(engine._tensor_core_devices, 0, True)
    cands = tuning.candidates("grad_input", THIN, "float16", "nchw", "strict")
    timer = FakeTimer({cands[1].name: 0.5})
    monkeypatch.setattr(tuning, "_measure", timer)
    runs = []
    args = (THIN, "float16", 16, 32, 48, 0, 7, None, "nchw", "strict")
    for _ in range(3):
        assert engine._variant("grad_input", lambda v, *a: runs.append((v, a)), args, False, (16, 48)) == cands[1]
    assert len(timer.calls) == 1
    assert tuning.current("grad_input", THIN, "float16", "nchw", "strict", device_id=0) == cands[1]


def test_one_configuration_is_tuned_once_under_concurrent_first_calls(fresh, monkeypatch):
    timer = FakeTimer()
    monkeypatch.setattr(tuning, "_measure", timer)
    results = []
    threads = [threading.Thread(target=lambda: results.append(_choose()[0])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(timer.calls) == 1 and len(set(results)) == 1 and len(results) == 8


# ------------------------------------------------------------------------- tune()

def test_tune_parses_dicts_and_pairs():
    jobs = tuning._jobs([dict(in_channels=32, out_channels=48, kernel_size=3, stride=2, padding=1),
                         (dict(in_channels=32, out_channels=48, kernel_size=(3, 3), stride=2, padding=1,
                               bias=False), (2, 32, 9, 11))], (2, 32, 9, 11), dtype="half", layout="channels_last")
    assert [j.g for j in jobs] == [THIN, THIN]
    assert [j.has_bias for j in jobs] == [True, False]
    assert {j.dtype for j in jobs} == {"float16"} and {j.layout for j in jobs} == {"nhwc"}
    # repeats are tuned once
    assert len(tuning._jobs([dict(in_channels=32, out_channels=48, kernel_size=3)] * 3, (2, 32, 9, 11))) == 1
    assert tuning._jobs(dict(in_channels=32, out_channels=48, kernel_size=3), (32, 9, 11))[0].precision == "strict"
    with pytest.raises(TypeError, match="input shape"):
        tuning._jobs(dict(in_channels=32, out_channels=48, kernel_size=3), None)
    with pytest.raises(TypeError, match="unknown"):
        tuning._jobs(dict(in_channels=32, out_channels=48, kernel_size=3, padding_mode="zeros"), (2, 32, 9, 11))
    with pytest.raises(ValueError):
        tuning._jobs(dict(in_channels=32, out_channels=48, kernel_size=3, groups=5), (2, 32, 9, 11))
    with pytest.raises(ValueError):
        tuning._jobs(dict(in_channels=32, out_channels=48, kernel_size=3), (2, 31, 9, 11))
    with pytest.raises(TypeError):
        tuning._jobs("layer", (2, 32, 9, 11))
    with pytest.raises(ValueError):
        tuning.tune(dict(in_channels=32, out_channels=48, kernel_size=3), (2, 32, 9, 11), passes=("grad_bias",))


def test_tune_finds_each_layer_of_a_model():
    torch = pytest.importorskip("torch")
    import cupyconv.torch as ct

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        ct.ConvTranspose2d(32, 24, 3, stride=2, padding=1, output_padding=1, bias=False), torch.nn.ReLU(),
        torch.nn.ConvTranspose2d(24, 3, 3, padding=1))
    model.train()
    stats = model[1].running_mean.clone()
    jobs = tuning._jobs(model, (2, 64, 5, 7))
    assert [j.name for j in jobs] == ["0", "3", "5"]
    assert [j.g.input_shape for j in jobs] == [(2, 64, 5, 7), (2, 32, 10, 14), (2, 24, 20, 28)]
    assert [j.has_bias for j in jobs] == [True, False, True]
    assert {j.dtype for j in jobs} == {"float32"}
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(model[1].running_mean, stats), "tuning must not touch batch-norm statistics"
    x = torch.randn(2, 64, 5, 7).contiguous(memory_format=torch.channels_last)
    assert {j.layout for j in tuning._jobs(model, x)} == {"nhwc"}
    assert {j.layout for j in tuning._jobs(model, x, layout="nchw")} == {"nchw"}
    assert tuning._jobs(model[0], x.shape)[0].g == jobs[0].g
    assert tuning._jobs([(model[0], (2, 64, 5, 7)), (model[3], (1, 32, 3, 3))], None)[1].g.input_shape == \
        (1, 32, 3, 3)
    saved = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert tuning._jobs(model[0], x)[0].precision == "tf32"
        assert tuning._jobs(model[0], x, precision="strict")[0].precision == "strict"
        torch.backends.cudnn.allow_tf32 = False
        assert tuning._jobs(model[0], x)[0].precision == "strict"
    finally:
        torch.backends.cudnn.allow_tf32 = saved


def test_tune_without_a_gpu_says_so():
    from conftest import gpu_usable

    if gpu_usable():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="GPU"):
        tuning.tune(dict(in_channels=32, out_channels=48, kernel_size=3), (2, 32, 9, 11))


def test_import_stays_light():
    script = ("import sys, cupyconv\n"
              "heavy = [m for m in ('cupy', 'torch', 'tqdm', 'platformdirs') if m in sys.modules]\n"
              "assert not heavy, heavy\n"
              "assert callable(cupyconv.tune)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
