"""Long runs leak nothing: device memory, compiled modules, streams, events or host objects.

10 000 forward+backward calls of a small layer on the direct kernels, and a few thousand
on the tensor-core kernels (channels_last, fp16) and through the CuPy API.  After a
warm-up (first calls compile, tune and plan), every later call must leave
``torch.cuda.memory_allocated()`` (or CuPy's pool) exactly where it was, compile nothing,
create no CUDA stream or event that it does not destroy, and leave no new Python objects
(streams, events, cache entries) behind.
"""
from __future__ import annotations

import gc
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402
from layers import uses_gemm  # noqa: E402
from cupyconv.jit.compiler import compile_count  # noqa: E402

ITERATIONS = int(os.environ.get("CUPYCONV_STABILITY_ITERATIONS", "10000"))
CHECKPOINTS = 10


class HandleCounter:
    """Counts CUDA streams and events made and destroyed through CuPy's runtime bindings."""

    NAMES = ("streamCreate", "streamCreateWithFlags", "streamDestroy", "eventCreate", "eventCreateWithFlags",
             "eventDestroy")

    def __init__(self):
        from cupy.cuda import runtime

        self.runtime = runtime
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(self.runtime, name, None)
            if original is None:
                continue
            self.saved[name] = original

            def counted(*args, _name=name, _original=original):
                self.counts[_name] += 1
                return _original(*args)
            setattr(self.runtime, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(self.runtime, name, original)

    @property
    def created(self) -> int:
        return sum(v for k, v in self.counts.items() if "Create" in k)

    @property
    def destroyed(self) -> int:
        return sum(v for k, v in self.counts.items() if "Destroy" in k)


def _stream_and_event_objects() -> int:
    kinds = (torch.cuda.Stream, torch.cuda.Event, cupy.cuda.Stream, cupy.cuda.Event)
    with warnings.catch_warnings():  # isinstance on deprecated module attributes warns
        warnings.simplefilter("ignore")
        return sum(1 for obj in gc.get_objects() if isinstance(obj, kinds))


def _host_state():
    """Python-side state that a per-call leak would grow."""
    gc.collect()
    return dict(objects=len(gc.get_objects()), streams_events=_stream_and_event_objects(),
                forward_cache=len(ct._forward_cache), backward_cache=len(ct._backward_cache))


def _torch_step(forward, inputs, go):
    """One forward+backward call, its gradients dropped again."""
    def step():
        y = forward()
        y.backward(go)
        for t in inputs:
            t.grad = None
    return step


def _check_flat(name, step, iterations):
    for _ in range(20):  # first calls compile, tune and plan; later ones must add nothing
        step()
    torch.cuda.synchronize()
    before_host = _host_state()
    compiles = compile_count()
    allocated = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    readings = []
    every = max(1, iterations // CHECKPOINTS)
    with HandleCounter() as handles:
        for i in range(iterations):
            step()
            if (i + 1) % every == 0:
                torch.cuda.synchronize()
                readings.append(torch.cuda.memory_allocated())
            if i + 1 == iterations // 2:
                middle_host = _host_state()
    torch.cuda.synchronize()
    after_host = _host_state()
    assert len(readings) == CHECKPOINTS or iterations < CHECKPOINTS
    assert readings == [allocated] * len(readings), f"{name}: memory_allocated drifted: {readings} from {allocated}"
    assert torch.cuda.memory_reserved() == reserved, f"{name}: the caching allocator reserved more memory"
    assert compile_count() == compiles, f"{name}: {compile_count() - compiles} kernels compiled in steady state"
    assert handles.created == handles.destroyed == 0, f"{name}: streams/events created {handles.counts}"
    assert after_host["streams_events"] == before_host["streams_events"], f"{name}: stream or event objects leaked"
    assert after_host["forward_cache"] == before_host["forward_cache"]
    assert after_host["backward_cache"] == before_host["backward_cache"]
    # A per-call leak grows the second half as much as the first; lazily built state
    # (library caches filled once) shows up only in the first, and a handful of objects
    # can come and go with pytest and the gc itself.
    assert after_host["objects"] - middle_host["objects"] < 100, \
        f"{name}: {after_host['objects'] - middle_host['objects']} more live Python objects over the second " \
        f"{iterations - iterations // 2} calls (first half: {middle_host['objects'] - before_host['objects']})"


def _tensors(shape_x, shape_w, c_out, dtype, channels_last=False, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def rnd(shape):
        t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        return t.contiguous(memory_format=fmt) if t.dim() == 4 else t

    return rnd(shape_x).requires_grad_(), rnd(shape_w).requires_grad_(), rnd((c_out,)).requires_grad_()


def _geometry(x, w, kwargs):
    from cupyconv.core.geometry import ConvParams, geometry

    return geometry(x.shape, w.shape, None, ConvParams.from_args(**kwargs))


def test_direct_kernels_10000_calls_leak_nothing():
    kwargs = dict(stride=2, padding=1, output_padding=1, groups=2, dilation=1)
    x, w, b = _tensors((2, 4, 5, 6), (4, 3, 3, 3), 6, torch.float32)
    go = torch.randn(ct.conv_transpose2d(x, w, b, **kwargs).shape, device="cuda")
    assert not uses_gemm(_geometry(x, w, kwargs), "float32", 0)
    step = _torch_step(lambda: ct.conv_transpose2d(x, w, b, **kwargs), (x, w, b), go)
    _check_flat("direct fp32", step, ITERATIONS)


def test_tensor_core_kernels_channels_last_calls_leak_nothing():
    kwargs = dict(stride=2, padding=1, output_padding=0, groups=1, dilation=1)
    x, w, b = _tensors((2, 16, 6, 5), (16, 32, 4, 4), 32, torch.float16, channels_last=True)
    go = torch.randn(ct.conv_transpose2d(x, w, b, **kwargs).shape, device="cuda", dtype=torch.float16)
    go = go.contiguous(memory_format=torch.channels_last)
    assert uses_gemm(_geometry(x, w, kwargs), "float16", 0)
    step = _torch_step(lambda: ct.conv_transpose2d(x, w, b, **kwargs), (x, w, b), go)
    _check_flat("tensor cores fp16 channels_last", step, max(1, ITERATIONS // 5))


def test_module_without_bias_calls_leak_nothing():
    m = ct.ConvTranspose2d(6, 4, (2, 3), stride=(1, 2), padding=(0, 1), dilation=(2, 1), bias=False).cuda()
    x = torch.randn(3, 6, 7, 5, device="cuda", requires_grad=True)
    go = torch.randn(m(x).shape, device="cuda")
    _check_flat("module, no bias", _torch_step(lambda: m(x), (x, m.weight), go), max(1, ITERATIONS // 5))


def test_cupy_api_calls_leak_nothing():
    pool = cupy.get_default_memory_pool()
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((2, 4, 5, 6), dtype=cupy.float32)
    w = rng.standard_normal((4, 3, 3, 3), dtype=cupy.float32)
    b = rng.standard_normal((6,), dtype=cupy.float32)
    kwargs = dict(stride=2, padding=1, output_padding=1, groups=2)
    go = rng.standard_normal(cupyconv.conv_transpose2d(x, w, b, **kwargs).shape, dtype=cupy.float32)

    def call():
        y = cupyconv.conv_transpose2d(x, w, b, **kwargs)
        grads = cupyconv.conv_transpose2d_backward(go, x, w, **kwargs)
        del y, grads

    for _ in range(20):
        call()
    cupy.cuda.Device().synchronize()
    before_host = _host_state()
    compiles, used = compile_count(), pool.used_bytes()
    iterations = max(1, ITERATIONS // 5)
    readings = []
    with HandleCounter() as handles:
        for i in range(iterations):
            call()
            if (i + 1) % max(1, iterations // CHECKPOINTS) == 0:
                cupy.cuda.Device().synchronize()
                readings.append(pool.used_bytes())
    after_host = _host_state()
    assert readings == [used] * len(readings), f"CuPy pool usage drifted: {readings} from {used}"
    assert compile_count() == compiles
    assert handles.created == handles.destroyed == 0, f"streams/events created {handles.counts}"
    assert after_host["streams_events"] == before_host["streams_events"]
    assert after_host["objects"] - before_host["objects"] < 100


def test_handle_counter_sees_cupy_streams_and_events():
    """The counter used above does count what CuPy creates and destroys."""
    with HandleCounter() as handles:
        from cupy.cuda import runtime

        e = runtime.eventCreate()
        runtime.eventDestroy(e)
    assert handles.counts["eventCreate"] == 1 and handles.counts["eventDestroy"] == 1
