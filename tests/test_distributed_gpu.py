"""cupyconv on two GPUs: DDP training with NCCL, per-device kernels and streams, mixed-device errors.

Needs two CUDA devices; every test is marked ``gpu``.  Run from the repository root with
``PYTHONPATH=.``.  The DDP tests launch ``examples/ddp_train.py`` with torchrun (helpers
shared with tests/test_distributed.py); the others run in this process, with cuda:0
current and the work on cuda:1.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402
from cupyconv.jit.compiler import compiled_devices  # noqa: E402
from test_distributed import check_training, param_difference, run_training  # noqa: E402

GPU_RUN = ("--backend", "nccl", "--device", "cuda", "--steps", "50")
FP32_TOL = 2e-5   # strict float32 against float64, through up to two layers


@pytest.fixture(autouse=True)
def strict_fp32():
    """Strict float32 on both sides: cupyconv follows torch's TF32 flag, as cuDNN does."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def cuda0_current():
    """cuda:0 current during the test, and again afterwards whatever the test did."""
    before = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(before)


def assert_close(actual, expected, tol, what):
    """max|actual - expected| <= tol * max|expected|, on the same device."""
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.device == expected.device, f"{what}: device {actual.device} != {expected.device}"
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values (read before it was written?)"
    err = (a - e).abs().max().item()
    scale = e.abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} * max|ref| {scale:.3e}"


# --------------------------------------------------------------------- DDP with torchrun

def test_ddp_nccl_matches_single_process_and_nn(tmp_path):
    """2 ranks x 1 GPU, 50 SGD steps: the same parameters as 1 process and as nn.ConvTranspose2d.

    Also each rank's device invariants: kernels compiled for its own device only, nothing
    allocated on the other, the current device untouched, and no CUDA context on the
    other device beyond what the same DDP run with torch's own module opens.
    """
    ddp = run_training(tmp_path, "cupyconv_ddp", 2, *GPU_RUN)
    single = run_training(tmp_path, "cupyconv_single", 1, *GPU_RUN)
    nn_single = run_training(tmp_path, "nn_single", 1, *GPU_RUN, "--impl", "torch")
    nn_ddp = run_training(tmp_path, "nn_ddp", 2, *GPU_RUN, "--impl", "torch")
    # 50 steps carry each step's rounding (cuDNN's float32 against cupyconv's 3xTF32)
    # into the next; the measured torch-vs-torch noise usually sets the bound.
    check_training(ddp, single, nn_single, nn_ddp, floor=1e-4)

    for rank, (r, base) in enumerate(zip(ddp["ranks"], nn_ddp["ranks"])):
        assert r["rank"] == rank and r["device"] == f"cuda:{rank}", r
        assert r["compiled_devices"] == [rank], f"rank {rank} compiled kernels for {r['compiled_devices']}"
        assert r["current_device_before"] == r["current_device_after"] == rank, r
        assert r["memory_allocated_own"] > 0
        assert all(v == 0 for v in r["memory_allocated_other"].values()), r["memory_allocated_other"]
        ours = {d for d, active in r["contexts_after"].items() if active}
        torch_own = {d for d, active in base["contexts_after"].items() if active}
        print(f"rank {rank}: CUDA contexts on other devices: cupyconv run {sorted(ours)}, "
              f"nn run {sorted(torch_own)}; unknown: {[d for d, a in r['contexts_after'].items() if a is None]}")
        assert ours <= torch_own, f"rank {rank} opened a CUDA context on devices {sorted(ours - torch_own)}"
    assert single["ranks"][0]["compiled_devices"] == [0]
    for r in nn_single["ranks"] + nn_ddp["ranks"]:
        assert r["compiled_devices"] == [], "the nn.ConvTranspose2d run compiled cupyconv kernels"


def test_ddp_nccl_float64_matches_nn_to_rounding(tmp_path):
    """In float64 rounding is out of the way: DDP cupyconv and single-process nn agree to ~1e-13."""
    run = ("--backend", "nccl", "--device", "cuda", "--steps", "20", "--dtype", "float64")
    ddp = run_training(tmp_path, "cupyconv_ddp64", 2, *run)
    nn_single = run_training(tmp_path, "nn_single64", 1, *run, "--impl", "torch")
    d, at = param_difference(ddp, nn_single)
    print(f"float64: cupyconv DDP vs nn single {d:.3e} ({at})")
    assert d <= 1e-10, f"float64 parameter {at} differs by {d:.3e} relative"
    assert [r["compiled_devices"] for r in ddp["ranks"]] == [[0], [1]]


# ---------------------------------------------------- one process, work on cuda:1

def _model_pair(device):
    """A tensor-core layer (>= 16 channels per group) and a direct one (grouped, thin), both kinds of kernels."""
    torch.manual_seed(5)
    ref = nn.Sequential(nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.SiLU(),
                        nn.ConvTranspose2d(16, 4, 3, 2, 1, output_padding=1, groups=2))
    ours = ct.convert(copy.deepcopy(ref)).to(device)
    assert sum(type(m) is ct.ConvTranspose2d for m in ours.modules()) == 2
    return ours, ref.to(device).double()


def _reference(ref64, x, go):
    xr = x.detach().double().requires_grad_()
    y = ref64(xr)
    y.backward(go.double())
    return y.detach(), xr.grad, [p.grad for p in ref64.parameters()]


def test_module_on_cuda1_while_cuda0_is_current(cuda0_current):
    dev = torch.device("cuda", 1)
    model, ref64 = _model_pair(dev)
    gen = torch.Generator(device=dev).manual_seed(6)
    x0 = torch.randn(3, 32, 6, 6, device=dev, generator=gen)
    go = torch.randn(3, 4, 24, 24, device=dev, generator=gen)
    want_y, want_gx, want_gp = _reference(ref64, x0, go)
    torch.cuda.synchronize(dev)
    mem0 = torch.cuda.memory_allocated(0)

    cupyconv.clear_cache()
    assert compiled_devices() == set()
    x = x0.clone().requires_grad_()
    y = model(x)
    y.backward(go)
    assert torch.cuda.current_device() == 0, "the call left its device current"
    assert compiled_devices() == {1}, f"kernels compiled for devices {compiled_devices()}, expected only cuda:1"
    assert torch.cuda.memory_allocated(0) == mem0, "a call on cuda:1 allocated memory on cuda:0"
    assert y.device == dev and x.grad.device == dev
    assert_close(y, want_y.float(), FP32_TOL, "output on cuda:1")
    assert_close(x.grad, want_gx.float(), FP32_TOL, "grad_input on cuda:1")
    for i, (p, g) in enumerate(zip(model.parameters(), want_gp)):
        assert_close(p.grad, g.float(), FP32_TOL, f"grad of parameter {i} on cuda:1")


def test_cuda1_work_runs_on_cuda1_current_stream(cuda0_current):
    """Launched on torch.cuda.current_stream(1), not cuda:1's default stream, and without a host sync.

    The input is NaN until a copy queued on a side stream behind a quarter-second sleep
    overwrites it.  A kernel on any other stream reads the NaNs; a host sync shows as a
    finished side stream when the call returns.
    """
    dev = torch.device("cuda", 1)
    model, ref64 = _model_pair(dev)
    gen = torch.Generator(device=dev).manual_seed(7)
    x_src = torch.randn(3, 32, 6, 6, device=dev, generator=gen)
    go = torch.randn(3, 4, 24, 24, device=dev, generator=gen)
    want_y, want_gx, want_gp = _reference(ref64, x_src, go)
    warm = model(x_src.clone().requires_grad_())      # compile now, not while the side stream sleeps
    warm.backward(go)
    model.zero_grad(set_to_none=True)
    x = torch.full_like(x_src, float("nan"))
    torch.cuda.synchronize(dev)

    side = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(side):
        with torch.cuda.device(dev):
            torch.cuda._sleep(500_000_000)
        torch.cuda.set_device(0)          # entering a cuda:1 stream may have made cuda:1 current
        assert torch.cuda.current_stream(1) == side
        x.copy_(x_src)
        x.requires_grad_()
        assert torch.cuda.current_device() == 0
        y = model(x)
        y.backward(go)
        pending = not side.query()
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(dev)
    assert pending, "the side stream had finished when the call returned: something synchronised the host"
    assert_close(y, want_y.float(), FP32_TOL, "output on cuda:1's current stream")
    assert_close(x.grad, want_gx.float(), FP32_TOL, "grad_input on cuda:1's current stream")
    for i, (p, g) in enumerate(zip(model.parameters(), want_gp)):
        assert_close(p.grad, g.float(), FP32_TOL, f"grad of parameter {i} on cuda:1's current stream")


def test_cupy_arrays_on_cuda1_while_cuda0_is_current():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 6, 5, 7)).astype(np.float32)
    w = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    go = rng.standard_normal((2, 8, 10, 14)).astype(np.float32)
    kw = dict(stride=2, padding=1, output_padding=1, groups=2)
    xr, wr, br = (torch.from_numpy(a).double().requires_grad_() for a in (x, w, b))
    yr = F.conv_transpose2d(xr, wr, br, **kw)
    yr.backward(torch.from_numpy(go).double())
    want_y, want = yr.detach().numpy(), (xr.grad.numpy(), wr.grad.numpy(), br.grad.numpy())
    with cupy.cuda.Device(1):
        xd, wd, bd, god = (cupy.asarray(a) for a in (x, w, b, go))
    prev = cupy.cuda.runtime.getDevice()
    cupy.cuda.runtime.setDevice(0)
    try:
        cupyconv.clear_cache()
        y = cupyconv.conv_transpose2d(xd, wd, bd, **kw)
        grads = cupyconv.conv_transpose2d_backward(god, xd, wd, **kw)
        assert cupy.cuda.runtime.getDevice() == 0
        assert compiled_devices() == {1}, f"kernels compiled for devices {compiled_devices()}"
        assert y.device.id == 1 and all(g.device.id == 1 for g in grads)
        with cupy.cuda.Device(1):
            got = [cupy.asnumpy(a) for a in (y,) + tuple(grads)]
    finally:
        cupy.cuda.runtime.setDevice(prev)
    for name, a, e in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, (want_y,) + tuple(want)):
        err, scale = np.abs(a - e).max(), np.abs(e).max()
        assert err <= FP32_TOL * scale, f"CuPy {name} on cuda:1: max error {err:.3e} > {FP32_TOL:g} * {scale:.3e}"


# ------------------------------------------------------------------ mixed devices

def test_mixed_devices_raise_value_error_before_compiling(cuda0_current):
    cupyconv.clear_cache()
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    x0 = torch.randn(2, 4, 5, 5, device=d0)
    x1 = x0.to(d1)
    w1 = torch.randn(4, 3, 3, 3, device=d1)
    b0, b1 = torch.randn(3, device=d0), torch.randn(3, device=d1)
    go0 = torch.randn(2, 3, 7, 7, device=d0)

    with pytest.raises(ValueError, match="same device"):
        ct.conv_transpose2d(x0, w1)                                   # input cuda:0, weight cuda:1
    with pytest.raises(ValueError, match="same device"):
        ct.conv_transpose2d(x0.requires_grad_(), w1.requires_grad_(), b1)   # the autograd path
    with pytest.raises(ValueError, match="same device"):
        ct.conv_transpose2d(x1, w1, b0)                               # only the bias elsewhere
    with pytest.raises(ValueError, match="same device"):
        ct.conv_transpose2d_backward(go0, x1, w1)
    m = ct.ConvTranspose2d(4, 3, 3).to(d1)
    with pytest.raises(ValueError, match="same device"):
        m(x0)
    with torch.no_grad(), pytest.raises(ValueError, match="same device"):
        m(x0)

    cupy = pytest.importorskip("cupy")
    with cupy.cuda.Device(0):
        cx0 = cupy.asarray(x0.detach().cpu().numpy())
        cgo0 = cupy.asarray(go0.cpu().numpy())
    with cupy.cuda.Device(1):
        cx1 = cupy.asarray(x0.detach().cpu().numpy())
        cw1 = cupy.asarray(w1.detach().cpu().numpy())
    with pytest.raises(ValueError, match="same device"):
        cupyconv.conv_transpose2d(cx0, cw1)
    with pytest.raises(ValueError, match="same device"):
        cupyconv.conv_transpose2d_backward(cgo0, cx1, cw1)
    assert compiled_devices() == set(), "kernels were compiled before the device check"
    assert torch.cuda.current_device() == 0
