"""Train a small generator built from cupyconv's ConvTranspose2d under DistributedDataParallel.

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 50 --out result.pt
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --backend gloo --device cpu --out cpu.pt
    python examples/ddp_train.py --out single.pt          # one process, no process group

The global batch is fixed and drawn from a seeded generator, independently of the rank;
each of the N ranks trains on its own 1/N slice.  The model has no BatchNorm (GroupNorm
normalises each sample on its own) and the loss is a mean, so DDP's gradient averaging
gives the gradient of the whole batch: N processes and one process with the same global
batch reach the same parameters, up to float32 rounding.  ``--impl torch`` builds the
same model from ``nn.ConvTranspose2d`` (same initial values) for comparison.

Every rank checks its own device placement: cupyconv compiled kernels only for the rank's
device, torch allocated nothing on any other device, the current device is unchanged.
Rank 0 gathers those diagnostics and writes them with the final parameters to ``--out``
(a ``torch.save`` file).  A rank whose checks failed exits non-zero after the file is written.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

# NVLink SHARP buffers are not needed for the small all-reduces here, and some hosts cannot map them.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cupyconv.jit.compiler  # noqa: E402
import cupyconv.torch as ct  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="result.pt", help="where rank 0 writes the parameters and diagnostics")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="process-group backend (default: nccl on CUDA, gloo on CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--impl", choices=("cupyconv", "torch"), default="cupyconv",
                   help="ConvTranspose2d class the generator is built from")
    p.add_argument("--batch", type=int, default=16, help="global batch size, split evenly across the ranks")
    p.add_argument("--width", type=int, default=32, help="channels of the last hidden layer (even)")
    p.add_argument("--zdim", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.width < 2 or args.width % 2:
        p.error("--width must be an even number >= 2")
    return args


def generator(conv, zdim: int, width: int) -> nn.Sequential:
    """z (N, zdim, 1, 1) -> (N, 3, 16, 16): a dense, a strided, a grouped and a dilated upsample.

    The activations are smooth: at a ReLU's kink a rounding-sized difference can flip a
    unit's gradient on or off, and over a few dozen steps such flips grow the gap between
    two runs far beyond rounding.
    """
    w = width
    return nn.Sequential(
        conv(zdim, 4 * w, 4, 1, 0), nn.SiLU(),                           # 4x4
        conv(4 * w, 2 * w, 4, 2, 1), nn.GroupNorm(4, 2 * w), nn.SiLU(),  # 8x8
        conv(2 * w, w, 3, 2, 1, output_padding=1, groups=2), nn.SiLU(),  # 16x16
        conv(w, 3, 3, 1, 2, dilation=2), nn.Tanh(),                      # 16x16
    )


def global_batch(args, dtype):
    """The whole batch, identical on every rank whatever the world size."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    z = torch.randn(args.batch, args.zdim, 1, 1, generator=gen, dtype=torch.float64)
    target = torch.rand(args.batch, 3, 16, 16, generator=gen, dtype=torch.float64) * 2 - 1
    return z.to(dtype), target.to(dtype)


def primary_context_active(ordinal: int):
    """Whether this process holds a CUDA primary context on device ``ordinal`` (None if unknown)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if lib.cuInit(0) != 0:
            return None
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
            return None
        if lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return None
        return bool(active.value)
    except Exception:   # no driver library, or not Linux: the other checks still stand
        return None


def other_devices(device: torch.device):
    if device.type != "cuda":
        return []
    return [d for d in range(torch.cuda.device_count()) if d != device.index]


def launched_distributed() -> bool:
    """Whether a launcher such as torchrun started this process as one rank of several."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = launched_distributed()
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split evenly across {world} ranks")

    if args.device == "cuda":
        # Bind the device before anything touches CUDA, so no rank opens a context on cuda:0.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # Both implementations in true float32, so the comparison is of rounding only.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        device = torch.device("cpu")

    if distributed:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(args.backend, **kwargs)

    dtype = getattr(torch, args.dtype)
    conv = ct.ConvTranspose2d if args.impl == "cupyconv" else nn.ConvTranspose2d
    torch.manual_seed(args.seed)
    model = generator(conv, args.zdim, args.width).to(device=device, dtype=dtype)
    init = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ddp = world > 1
    if ddp:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    else:
        net = model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    z, target = global_batch(args, dtype)
    per_rank = args.batch // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    z, target = z[rows].to(device), target[rows].to(device)

    others = other_devices(device)
    current_before = torch.cuda.current_device() if device.type == "cuda" else None
    contexts_before = {d: primary_context_active(d) for d in others}

    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(net(z), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    losses = torch.stack(losses).cpu().tolist() if losses else []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start

    compiled = sorted(cupyconv.jit.compiler.compiled_devices())
    diag = {
        "rank": rank,
        "world_size": world,
        "device": str(device),
        "impl": args.impl,
        "conv_classes": sorted({f"{type(m).__module__}.{type(m).__qualname__}"
                                for m in model.modules() if isinstance(m, nn.ConvTranspose2d)}),
        "compiled_devices": compiled,
        "memory_allocated_own": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
        "memory_allocated_other": {d: torch.cuda.memory_allocated(d) for d in others},
        "current_device_before": current_before,
        "current_device_after": torch.cuda.current_device() if device.type == "cuda" else None,
        "contexts_before": contexts_before,
        "contexts_after": {d: primary_context_active(d) for d in others},
        "losses": losses,
        "seconds": elapsed,
    }
    problems = []
    want_compiled = [device.index] if args.impl == "cupyconv" and device.type == "cuda" else []
    if compiled != want_compiled:
        problems.append(f"cupyconv compiled kernels for devices {compiled}, expected {want_compiled}")
    for d, nbytes in diag["memory_allocated_other"].items():
        if nbytes:
            problems.append(f"{nbytes} bytes allocated on cuda:{d} by a rank that runs on {device}")
    if current_before != diag["current_device_after"]:
        problems.append(f"current device changed from {current_before} to {diag['current_device_after']}")
    if any(p.device != device for p in model.parameters()):
        problems.append("a parameter left the rank's device")
    diag["problems"] = problems

    gathered = [None] * world if rank == 0 else None
    if distributed:
        dist.gather_object(diag, gathered, dst=0)
    else:
        gathered = [diag]
    if rank == 0:
        per_step = [sum(r["losses"][i] for r in gathered) / world for i in range(args.steps)]
        result = {
            "args": vars(args),
            "world_size": world,
            "params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "init": init,
            "losses": per_step,      # the global-batch loss: each rank's mean over an equal slice, averaged
            "ranks": gathered,
        }
        torch.save(result, args.out)
        all_problems = [f"rank {r['rank']}: {p}" for r in gathered for p in r["problems"]]
        loss_text = f"loss {per_step[0]:.6f} -> {per_step[-1]:.6f}" if per_step else "no steps"
        group = args.backend if distributed else "no process group"
        print(f"{args.impl} on {world} x {device.type} ({group}): {args.steps} steps, {loss_text}, "
              f"{elapsed:.2f} s; wrote {args.out}" + ("" if not all_problems else "\n" + "\n".join(all_problems)),
              flush=True)
    if distributed:
        # Tearing gloo down while a peer still completes the gather can abort the process.
        dist.barrier()
        del net
        dist.destroy_process_group()
    return 1 if problems else 0


if __name__ == "__main__":
    code = main()
    if launched_distributed():
        # Leave without interpreter finalization: gloo's worker threads can still hold
        # work objects at that point, and tearing them down then aborts the process
        # ("terminate called without an active exception") after a clean run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
