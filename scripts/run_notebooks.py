"""Execute the example notebooks top to bottom and store their outputs.

    python scripts/run_notebooks.py                 # every examples/*.ipynb, in place
    python scripts/run_notebooks.py --out DIR       # ... and a copy of each in DIR
    python scripts/run_notebooks.py --no-inplace --out DIR examples/02_torch_convert.ipynb

Each notebook runs in a fresh ``python3`` kernel on this interpreter, with examples/ as
its working directory and this checkout first on ``PYTHONPATH`` (relative entries of
the caller's ``PYTHONPATH`` are made absolute, so the kernel sees the same modules).
The kernelspec is written to a temporary folder, so no Jupyter installation or global
kernel registration is needed: nbformat, nbclient and ipykernel importable is enough.

Each executed notebook records in ``metadata.cupyconv.executed`` where it ran: the GPU
(or "no GPU"), cupyconv's backend, the torch, CuPy, NumPy and Python versions and the
git commit (``CUPYCONV_COMMIT`` if set, else ``git rev-parse``).  The committed
notebooks carry the outputs of one such run on a GPU; ``tests/test_notebooks.py``
re-executes them in memory on every CI run.

A notebook whose cell fails is not written back; its partial outputs go to
``--out`` as ``NAME.failed.ipynb`` and the script exits with status 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KERNEL_NAME = "python3"

# Run in a subprocess so this process never initialises CUDA next to the kernels'.
_PROBE = r"""
import json, platform, sys
info = {"python": platform.python_version()}
try:
    import numpy
    info["numpy"] = numpy.__version__
except Exception as exc:
    info["numpy"] = f"unavailable ({type(exc).__name__})"
import cupyconv
info["cupyconv"] = cupyconv.__version__
info["backend"] = cupyconv.backend()
try:
    import cupy
    info["cupy"] = cupy.__version__
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        info["device"] = name.decode() if isinstance(name, bytes) else str(name)
        info["compute_capability"] = f"{props['major']}.{props['minor']}"
        info["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:
        info["device"] = f"no GPU ({type(exc).__name__})"
except ImportError:
    info["cupy"] = "not installed"
try:
    import torch
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info.setdefault("device", torch.cuda.get_device_name(0))
        info["cudnn"] = torch.backends.cudnn.version()
except ImportError:
    info["torch"] = "not installed"
info.setdefault("device", "no GPU")
print(json.dumps(info))
"""


def git_commit() -> str:
    """``CUPYCONV_COMMIT`` if set, else this checkout's HEAD (with ``-dirty`` for local changes), else "unknown"."""
    commit = os.environ.get("CUPYCONV_COMMIT", "").strip()
    if commit:
        return commit
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        if head.returncode != 0 or not head.stdout.strip():
            return "unknown"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)examples/*.ipynb"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def kernel_environment(runtime_dir: Path) -> dict:
    """The environment every kernel inherits: this checkout and the caller's path, absolute."""
    entries = [str(ROOT)]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry:
            absolute = str(Path(entry).resolve())
            if absolute not in entries:
                entries.append(absolute)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(entries)
    env["JUPYTER_RUNTIME_DIR"] = str(runtime_dir / "runtime")
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["IPYTHONDIR"] = str(runtime_dir / "ipython")
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"   # figures become image/png outputs
    return env


def probe(env: dict) -> dict:
    """Where the notebooks will run: device, backend and versions, read by a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=EXAMPLES, capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"could not import cupyconv in {sys.executable}:\n{out.stderr}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    info["commit"] = git_commit()
    return info


def write_kernelspec(folder: Path) -> None:
    """Write a ``python3`` kernelspec for this interpreter under ``folder`` and put it first on JUPYTER_PATH."""
    from ipykernel.kernelspec import write_kernel_spec

    kernels = folder / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    write_kernel_spec(kernels / KERNEL_NAME, overrides={"display_name": "Python 3"})
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("JUPYTER_PATH")]))


def execute(path: Path, timeout: int, info: dict):
    """Run one notebook in a kernel of its own; returns (notebook, seconds, error or None)."""
    import nbclient
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=timeout, startup_timeout=180,
                                     record_timing=False, resources={"metadata": {"path": str(EXAMPLES)}})
    start = time.perf_counter()
    error = None
    try:
        client.execute()   # starts the kernel, runs every cell, shuts the kernel down
    except Exception as exc:   # CellExecutionError, DeadKernelError, timeouts: report and go on
        error = exc
    seconds = time.perf_counter() - start
    meta = nb.metadata.setdefault("cupyconv", {})
    meta["executed"] = dict(info, seconds=round(seconds, 1),
                            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    nbformat.validate(nb)
    return nb, seconds, error


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every examples/*.ipynb")
    parser.add_argument("--out", type=Path, help="also write each executed notebook here")
    parser.add_argument("--no-inplace", action="store_true", help="leave the notebooks in examples/ unchanged")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
    args = parser.parse_args(argv)
    if args.no_inplace and args.out is None:
        parser.error("--no-inplace needs --out")
    paths = [p.resolve() for p in args.notebooks] or sorted(EXAMPLES.glob("*.ipynb"))
    if not paths:
        parser.error(f"no notebooks in {EXAMPLES}")
    import nbformat

    failures = 0
    with tempfile.TemporaryDirectory(prefix="cupyconv-nb-") as tmp:
        tmp = Path(tmp)
        env = kernel_environment(tmp)
        os.environ.update(env)     # the kernels are started with this process's environment
        info = probe(env)
        print("running on:", ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
        write_kernelspec(tmp)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
        for path in paths:
            nb, seconds, error = execute(path, args.timeout, info)
            if error is not None:
                failures += 1
                print(f"FAILED {path.name} after {seconds:.1f} s:\n{error}", file=sys.stderr, flush=True)
                if args.out is not None:
                    nbformat.write(nb, str(args.out / f"{path.stem}.failed.ipynb"))
                continue
            if not args.no_inplace:
                nbformat.write(nb, str(path))
            if args.out is not None:
                target = args.out / path.name
                if args.no_inplace:
                    nbformat.write(nb, str(target))
                else:
                    shutil.copyfile(path, target)
            print(f"ok {path.name}: {seconds:.1f} s", flush=True)
    print(f"executed {len(paths) - failures} of {len(paths)} notebooks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
