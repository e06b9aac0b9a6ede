"""The kernel caches under stress: one build per configuration, odd cache directories, concurrency.

CPU tests drive the in-process cache (``compiler.get_function``) with a stand-in build,
and NVRTC itself (``compile_ptx``) from many threads.  GPU tests run real layers in fresh
subprocesses, so each starts with cold caches and its own ``CUPY_CACHE_DIR`` (CuPy reads
it once, when it is imported): a read-only, a full and an uncreatable cache directory,
corrupt cache files, two processes compiling the same kernels at once, 16 threads
calling into a cold cache at once, and a corrupt tuning-choices file.  Every subprocess
checks its results against float64 torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cupyconv
from cupyconv.jit import compiler
from cupyconv.plans import direct
from cupyconv.jit.compiler import KernelSpec, compile_count, compile_ptx
from cupyconv.core.geometry import ConvParams, geometry

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------- in-process cache, on CPU

@pytest.fixture
def fake_build(monkeypatch):
    """``compiler._build`` replaced by a slow stand-in that records every build."""
    built = []
    lock = threading.Lock()

    def build(spec, device_id):
        time.sleep(0.05)  # long enough for every thread to arrive while the first builds
        with lock:
            built.append((spec, device_id))
        return object()

    monkeypatch.setattr(compiler, "_build", build)
    monkeypatch.setattr(compiler, "device_arch", lambda device_id: "90")
    # the package-level clear also drops cached launch plans, which hold handles into
    # the kernels compiler.clear_cache() alone would let go of
    cupyconv.clear_cache()
    yield built
    cupyconv.clear_cache()


def _spec(i: int) -> KernelSpec:
    # a block size no real plan uses, so a stand-in kernel can never be launched
    return KernelSpec.make("reduce_partials.cu", "reduce_partials",
                           dict(SCALAR_T="float", INDEX_T="int", BLOCK=4096 + 32 * i, VEC=1))


def test_sixteen_threads_build_each_configuration_once(fake_build):
    specs = [_spec(i) for i in range(4)]
    barrier = threading.Barrier(16)
    results = [None] * 16
    before = compile_count()

    def worker(i):
        barrier.wait()
        results[i] = compiler.get_function(specs[i % 4], 0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.constants for s, _ in fake_build) == sorted(s.constants for s in specs)
    assert compile_count() - before == 4
    for i in range(16):
        assert results[i] is results[i % 4]
    # and later calls are hits
    assert compiler.get_function(specs[0], 0) is results[0]
    assert compile_count() - before == 4 and len(fake_build) == 4


def test_a_configuration_is_built_per_device(fake_build):
    compiler.get_function(_spec(0), 0)
    compiler.get_function(_spec(0), 1)
    compiler.get_function(_spec(0), 1)
    assert [d for _, d in fake_build] == [0, 1]


def test_a_failed_build_is_not_cached_and_not_counted(monkeypatch, fake_build):
    calls = []

    def flaky(spec, device_id):
        calls.append(spec)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return "kernel"

    monkeypatch.setattr(compiler, "_build", flaky)
    before = compile_count()
    with pytest.raises(RuntimeError, match="transient"):
        compiler.get_function(_spec(1), 0)
    assert compile_count() == before
    assert compiler.get_function(_spec(1), 0) == "kernel"
    assert compile_count() == before + 1 and len(calls) == 2


def test_compile_many_builds_duplicates_once(fake_build):
    specs = [_spec(i % 3) for i in range(12)]
    assert compiler.compile_many(specs, 0, workers=16) == 3
    assert len(fake_build) == 3


nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")


def test_nvrtc_from_sixteen_threads_at_once():
    """What compile_many relies on: NVRTC compiling side by side gives what it gives alone."""
    g = geometry((2, 6, 5, 7), (6, 2, 3, 2), None, ConvParams.from_args(stride=(2, 1), groups=3, dilation=(1, 2)))
    specs = [direct.plan_forward(g, dt, bias).spec for dt in ("float32", "float16") for bias in (False, True)]
    serial = {s: compile_ptx(s.source(), s.function, "compute_80") for s in specs}
    barrier = threading.Barrier(16)
    results = [None] * 16

    def worker(i):
        spec = specs[i % len(specs)]
        barrier.wait()
        results[i] = (spec, compile_ptx(spec.source(), spec.function, "compute_80"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    for spec, ptx in results:
        assert ptx == serial[spec]


# -------------------------------------------------------------- GPU, in fresh processes

WORKER = r'''
import json, os, sys, threading, traceback
result = {"ok": False}
try:
    if os.environ.get("WORKER_BLOCK_NVRTC") == "1":
        import cupy.cuda.compiler as cc
        if not hasattr(cc, "_compile_using_nvrtc_no_warning"):
            result["block_unavailable"] = True
        def refuse(*args, **kwargs):
            raise RuntimeError("NVRTC was called: the kernel was not in the disk cache")
        cc._compile_using_nvrtc_no_warning = refuse
    import cupy
    import torch
    import torch.nn.functional as F
    import cupyconv, cupyconv.torch as ct
    from cupyconv.jit import compiler
    go_flag = os.environ.get("WORKER_GO_FILE")
    if go_flag:  # everything imported: say so, then start together with the other processes
        import time
        open(os.path.join(os.environ["WORKER_READY_DIR"], str(os.getpid())), "w").close()
        while not os.path.exists(go_flag):
            time.sleep(0.001)
    LAYERS = [  # input shape, weight shape, kwargs, dtype, channels_last
        ((2, 4, 7, 6), (4, 3, 3, 2), dict(stride=(2, 1), padding=(1, 0), output_padding=(1, 0)), "float32", False),
        ((2, 16, 5, 6), (16, 16, 3, 3), dict(stride=2, padding=1), "float16", True),
        ((1, 6, 5, 5), (6, 2, 2, 3), dict(groups=3, dilation=(2, 1)), "float64", False),
        ((2, 32, 4, 3), (32, 16, 2, 2), dict(stride=2), "bfloat16", False),
    ]
    TOL = {"float32": 1e-5, "float64": 1e-10, "float16": 1e-2, "bfloat16": 5e-2}

    def run(index, seed):
        xs, ws, kw, dt, cl = LAYERS[index]
        dtype = getattr(torch, dt)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x64 = torch.randn(xs, generator=gen, device="cuda", dtype=torch.float64)
        w64 = torch.randn(ws, generator=gen, device="cuda", dtype=torch.float64)
        b64 = torch.randn(ws[1] * kw.get("groups", 1), generator=gen, device="cuda", dtype=torch.float64)
        fmt = torch.channels_last if cl else torch.contiguous_format
        x = x64.to(dtype).contiguous(memory_format=fmt).requires_grad_()
        w, b = w64.to(dtype).requires_grad_(), b64.to(dtype).requires_grad_()
        y = ct.conv_transpose2d(x, w, b, **kw)
        go64 = torch.randn(y.shape, generator=gen, device="cuda", dtype=torch.float64)
        y.backward(go64.to(dtype))
        xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
        yr = F.conv_transpose2d(xr, wr, br, **kw)
        yr.backward(go64.to(dtype).double())
        worst = 0.0
        for got, want in ((y, yr), (x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
            err = float((got.double() - want).abs().max() / want.abs().max())
            worst = max(worst, err / TOL[dt])
        if dt == "float32":  # the CuPy array API too
            cx, cw = cupy.asarray(x.detach()), cupy.asarray(w.detach())
            cy = cupyconv.conv_transpose2d(cx, cw, None, **kw)
            want = F.conv_transpose2d(x.detach().double(), w.detach().double(), None, **kw)
            err = float((torch.as_tensor(cy, device="cuda").double() - want).abs().max() / want.abs().max())
            worst = max(worst, err / TOL[dt])
        return worst

    threads = int(os.environ.get("WORKER_THREADS", "0"))
    if threads:
        barrier = threading.Barrier(threads)
        ratios, errors = [None] * threads, []
        def work(i):
            try:
                torch.cuda.set_device(0)
                barrier.wait()
                ratios[i] = run(i % len(LAYERS), seed=i)
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise RuntimeError(errors[0])
    else:
        ratios = [run(i, seed=i) for i in range(len(LAYERS))]
    torch.cuda.synchronize()
    # the candidates the tuner handed to the background compiler: built before the warm round, which times them
    cupyconv.tuning.settle()
    result["compiles_first"] = compiler.compile_count()
    ratios += [run(i, seed=100 + i) for i in range(len(LAYERS))]  # warm now: nothing new to build
    torch.cuda.synchronize()
    result.update(ok=max(ratios) <= 1.0, worst=max(ratios), compile_count=compiler.compile_count(),
                  entries=sum(1 for e in compiler._entries.values() if e.function is not None),
                  in_memory=os.environ.get("CUPY_CACHE_IN_MEMORY"))
    if os.environ.get("WORKER_TUNING"):
        from cupyconv import tuning
        path = tuning.cache_path()
        result["tuning_file"] = str(path)
        result["tuning_entries"] = len(tuning.read_entries(path))
except BaseException as exc:
    traceback.print_exc()
    result["exception"] = f"{type(exc).__name__}: {exc}"
print("WORKER-RESULT " + json.dumps(result))
sys.exit(0 if result.get("ok") else 1)
'''


def _env(tmp_path: Path, cache_dir, **extra) -> dict:
    """A worker's environment: its kernel cache directory, and its own tuning directory."""
    env = dict(os.environ)
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    env["CUPY_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUPYCONV_AUTOTUNE"] = "0"
    env["CUPYCONV_CACHE_DIR"] = str(tmp_path / "tuning")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start(env, preexec_fn=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-B", "-c", WORKER], cwd=str(ROOT), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("WORKER-RESULT ")]
    assert lines, f"worker printed no result (exit {proc.returncode})\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    result = json.loads(lines[-1][len("WORKER-RESULT "):])
    result["stderr"] = err[-3000:]
    return result


def _worker(env, preexec_fn=None) -> dict:
    return _finish(_start(env, preexec_fn))


def _assert_ok(result: dict, what: str) -> None:
    assert "exception" not in result, f"{what}: {result['exception']}\n{result['stderr']}"
    assert result["ok"], f"{what}: results off by {result['worst']:.2f} x the tolerance"


def _cache_files(directory: Path):
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.name.endswith(".cu"))


def _valid_cupy_cache_file(path: Path) -> bool:
    """CuPy's format: the SHA-1 of the payload in hex, then the payload."""
    data = path.read_bytes()
    return len(data) > 40 and data[:40] == hashlib.sha1(data[40:]).hexdigest().encode()


gpu = pytest.mark.gpu


@gpu
def test_each_configuration_compiles_once_per_process(tmp_path):
    result = _worker(_env(tmp_path, tmp_path / "cache"))
    _assert_ok(result, "cold cache")
    # as many builds as distinct kernels, and none when the same layers run again
    assert result["compile_count"] == result["entries"] == result["compiles_first"] > 0


@gpu
def test_read_only_cache_directory(tmp_path):
    if os.geteuid() == 0:
        # root writes through permission bits; /proc takes no new files from anyone
        cache, made = Path("/proc"), None
    else:
        cache = made = tmp_path / "read_only"
        made.mkdir()
        made.chmod(0o555)
    try:
        result = _worker(_env(tmp_path, cache))
    finally:
        if made is not None:
            made.chmod(0o755)
    _assert_ok(result, "read-only CUPY_CACHE_DIR")
    if made is not None:
        assert list(made.iterdir()) == []


@gpu
def test_full_cache_directory(tmp_path):
    def no_room():
        # every write to a file fails (EFBIG) as on a full disk; the signal would kill the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    cache = tmp_path / "cache"
    result = _worker(_env(tmp_path, cache), preexec_fn=no_room)
    _assert_ok(result, "CUPY_CACHE_DIR that takes no bytes")
    assert not any(_valid_cupy_cache_file(p) for p in cache.iterdir() if p.is_file()), "the limit did not apply"


@gpu
def test_cache_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = _worker(_env(tmp_path, blocker / "cache"))
    if result.get("exception", "").startswith("NotADirectoryError") and "_compiler_cache" in result["stderr"]:
        pytest.xfail("CuPy creates CUPY_CACHE_DIR when it is imported and fails the import if it cannot; "
                     "cupyconv imports CuPy without a fallback for that")
    _assert_ok(result, "CUPY_CACHE_DIR under a regular file")


@gpu
def test_corrupt_cache_files_are_ignored_and_rewritten(tmp_path):
    cache = tmp_path / "cache"
    _assert_ok(_worker(_env(tmp_path, cache)), "populating the cache")
    files = _cache_files(cache)
    assert len(files) >= 4 and all(_valid_cupy_cache_file(p) for p in files)
    damaged = {}
    for i, path in enumerate(files):
        data = path.read_bytes()
        kind = i % 4
        if kind == 0:
            path.write_bytes(os.urandom(len(data)))             # garbage
        elif kind == 1:
            path.write_bytes(data[: len(data) // 2])            # truncated
        elif kind == 2:
            path.write_bytes(b"")                               # empty
        else:
            path.write_bytes(data[:40] + b"\0" + data[41:])     # a flipped byte under the checksum
        damaged[path] = path.read_bytes()
    _assert_ok(_worker(_env(tmp_path, cache)), "corrupt cache files")
    for path, bad in damaged.items():
        assert path.read_bytes() != bad and _valid_cupy_cache_file(path), f"{path.name} was not rewritten"


@gpu
def test_cache_file_with_valid_checksum_but_broken_binary(tmp_path):
    cache = tmp_path / "cache"
    _assert_ok(_worker(_env(tmp_path, cache)), "populating the cache")
    for path in _cache_files(cache):
        payload = b"\x7fELF" + bytes(60)  # looks like a binary to the driver, which then rejects it
        path.write_bytes(hashlib.sha1(payload).hexdigest().encode() + payload)
    _assert_ok(_worker(_env(tmp_path, cache)), "cache files of a valid checksum but no binary")


@gpu
def test_two_processes_compile_the_same_configurations_at_once(tmp_path):
    go, ready, cache = tmp_path / "go", tmp_path / "ready", tmp_path / "cache"
    ready.mkdir()
    procs = [_start(_env(tmp_path, cache, WORKER_GO_FILE=go, WORKER_READY_DIR=ready)) for _ in range(2)]
    deadline = time.time() + 180
    while len(list(ready.iterdir())) < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    go.write_text("")
    results = [_finish(p) for p in procs]
    for r in results:
        _assert_ok(r, "concurrent compilation")
    assert len(list(ready.iterdir())) == 2
    assert results[0]["compile_count"] == results[1]["compile_count"]
    files = _cache_files(cache)
    assert files and all(_valid_cupy_cache_file(p) for p in files)
    assert not [p for p in cache.iterdir() if p.name.startswith("tmp")], "temporary files left behind"
    # a third process must find every kernel on disk: NVRTC is switched off for it
    third = _worker(_env(tmp_path, cache, WORKER_BLOCK_NVRTC=1))
    if third.get("block_unavailable"):
        pytest.skip("this CuPy compiles through another function; cannot tell disk hits apart")
    _assert_ok(third, "loading what the two processes wrote")


@gpu
@pytest.mark.parametrize("autotune", ["0", "1"], ids=["heuristic", "autotune"])
def test_sixteen_threads_into_a_cold_cache(tmp_path, autotune):
    threaded = _worker(_env(tmp_path, tmp_path / "threads", WORKER_THREADS=16, CUPYCONV_AUTOTUNE=autotune,
                            CUPYCONV_CACHE_DIR=tmp_path / "tuning"))
    _assert_ok(threaded, "16 threads")
    # each configuration built once: as many builds as distinct kernels, and no more after warm calls
    assert threaded["compile_count"] == threaded["entries"] == threaded["compiles_first"]
    serial = _worker(_env(tmp_path, tmp_path / "serial", CUPYCONV_AUTOTUNE=autotune,
                          CUPYCONV_CACHE_DIR=tmp_path / "tuning2"))
    _assert_ok(serial, "one thread")
    assert threaded["compile_count"] == serial["compile_count"]


# The tuning cache (cupyconv/tuning.py) was written alongside this file; this test uses
# only its public names and skips if they change.
@gpu
def test_corrupt_tuning_file_is_ignored_and_rewritten(tmp_path):
    tuning = pytest.importorskip("cupyconv.tuning")
    for name in ("CACHE_DIR_ENV", "CACHE_FILE", "read_entries", "cache_path", "AUTOTUNE_ENV"):
        if not hasattr(tuning, name):
            pytest.skip(f"cupyconv.tuning has no {name} any more")
    choices = tmp_path / "choices"
    choices.mkdir()
    path = choices / tuning.CACHE_FILE
    path.write_bytes(b'{"format": 1, "entries": {"x": ' + os.urandom(64))
    result = _worker(_env(tmp_path, tmp_path / "kernels", WORKER_TUNING=1,
                          **{tuning.CACHE_DIR_ENV: choices, tuning.AUTOTUNE_ENV: "1"}))
    _assert_ok(result, "corrupt tuning file")
    assert Path(result["tuning_file"]) == path
    assert result["tuning_entries"] > 0, "the tuning file was not rewritten with the new choices"
    assert tuning.read_entries(path), "the rewritten tuning file does not parse"
