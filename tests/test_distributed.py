"""DistributedDataParallel with cupyconv.torch.ConvTranspose2d, on CPU processes (gloo).

``examples/ddp_train.py`` is launched with torchrun.  Two processes, each training on half
of a fixed global batch, must reach the parameters of one process trained on the whole
batch, and those of the same model built from ``nn.ConvTranspose2d``, up to float32
rounding.  CPU tensors run on cupyconv's float64 NumPy reference, so this needs no GPU;
tests/test_distributed_gpu.py runs the same script on two GPUs with NCCL.

The helpers here are shared with the GPU test.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "ddp_train.py"

# Launcher variables a surrounding job might have set; each run starts its own group.
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def launch_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               PYTHONUNBUFFERED="1")
    # One thread per process: two ranks on a small machine would otherwise oversubscribe it.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_training(tmp_path: Path, name: str, nproc: int, *args: str, timeout: float = 300) -> dict:
    """Run the script under torchrun on ``nproc`` processes; returns what rank 0 saved."""
    out = tmp_path / f"{name}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPT), "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    result = torch.load(out, weights_only=True) if out.exists() else None
    problems = [] if result is None else [f"rank {r['rank']}: {p}" for r in result["ranks"] for p in r["problems"]]
    log = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0 and result is not None, (
        f"{name}: {' '.join(cmd)} exited with {proc.returncode}\n" + "\n".join(problems) + f"\n--- output ---\n{log}")
    print(proc.stdout.strip())
    assert result["world_size"] == nproc and len(result["ranks"]) == nproc
    return result


def param_difference(a: dict, b: dict):
    """max over parameters of max|a - b| / max|b|, and which parameter attains it."""
    assert a["params"].keys() == b["params"].keys()
    worst, where = 0.0, None
    for name, pb in b["params"].items():
        pa, pb = a["params"][name].double(), pb.double()
        assert pa.shape == pb.shape, name
        d = ((pa - pb).abs().max() / pb.abs().max().clamp_min(1e-30)).item()
        if not d <= worst:      # also catches NaN
            worst, where = d, name
    return worst, where


def check_training(ddp: dict, single: dict, nn_single: dict, nn_ddp: dict, floor: float) -> None:
    """cupyconv under DDP = cupyconv in one process = nn.ConvTranspose2d, to float32 noise.

    The noise is measured, not guessed: ``nn_ddp`` against ``nn_single`` is torch against
    itself when only the batch split (so the order of the sums) changes.  The bound is ten
    times that, or ``floor`` where torch happens to land closer.
    """
    for r in ddp["ranks"] + single["ranks"]:
        assert r["conv_classes"] == ["cupyconv.torch.ConvTranspose2d"], r["conv_classes"]
    for r in nn_ddp["ranks"] + nn_single["ranks"]:
        assert r["conv_classes"] == ["torch.nn.modules.conv.ConvTranspose2d"], r["conv_classes"]
    for run in (single, nn_single, nn_ddp):
        for name, p in ddp["init"].items():
            assert torch.equal(run["init"][name], p), f"initial {name} differs between runs"
    losses = nn_single["losses"]
    assert losses[-1] < 0.95 * losses[0], f"the model did not train (loss {losses[0]:.5f} -> {losses[-1]:.5f})"

    noise, noise_at = param_difference(nn_ddp, nn_single)
    bound = max(floor, 10 * noise)
    pairs = {"cupyconv DDP vs cupyconv single": (ddp, single),
             "cupyconv DDP vs nn single": (ddp, nn_single),
             "cupyconv single vs nn single": (single, nn_single)}
    found = {what: param_difference(a, b) for what, (a, b) in pairs.items()}
    print(f"loss {losses[0]:.5f} -> {losses[-1]:.5f}; torch DDP vs single {noise:.3e} ({noise_at}); "
          + "; ".join(f"{what} {d:.3e} ({at})" for what, (d, at) in found.items()) + f"; bound {bound:.3e}")
    for what, (d, at) in found.items():
        assert d <= bound, (f"{what}: parameter {at} differs by {d:.3e} relative > {bound:.3e} "
                            f"(torch against itself: {noise:.3e})")


CPU_RUN = ("--backend", "gloo", "--device", "cpu", "--width", "8", "--batch", "8", "--steps", "30", "--lr", "0.3")


def test_ddp_gloo_cpu_matches_single_process_and_nn(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ddp = run_training(tmp_path, "cupyconv_ddp", 2, *CPU_RUN)
    single = run_training(tmp_path, "cupyconv_single", 1, *CPU_RUN)
    nn_single = run_training(tmp_path, "nn_single", 1, *CPU_RUN, "--impl", "torch")
    nn_ddp = run_training(tmp_path, "nn_ddp", 2, *CPU_RUN, "--impl", "torch")
    check_training(ddp, single, nn_single, nn_ddp, floor=1e-5)
    for r in ddp["ranks"]:
        assert r["device"] == "cpu" and r["compiled_devices"] == [], r
    # The global loss of the DDP run is the single process's loss, step by step.
    for i, (a, b) in enumerate(zip(ddp["losses"], single["losses"])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: loss {a} (2 ranks) vs {b} (1 process)"
