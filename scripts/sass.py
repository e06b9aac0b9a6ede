#!/usr/bin/env python3
"""Check the machine code of the Hopper GEMM kernels: each must issue warpgroup MMAs (HGMMA) and touch no local
memory (no LDL/STL: nothing spilled, no register array indexed at run time).

    python scripts/sass.py                    # every tile of the scatter and gather GEMMs on their check layers
    python scripts/sass.py --keep DIR         # and keep the cubins and their disassembly there

Each kernel is built as the library builds it (NVRTC, its own options, sm_90a) into a cubin, which CUDA's
``nvdisasm`` (or ``cuobjdump -sass``) disassembles; so it needs one of them on the PATH (a GPU is not needed).  NVRTC and
cuobjdump are the ones installed here: the numbers are those of this CUDA's ptxas.  Prints a line a kernel and
exits 1 if any kernel lacks HGMMA or uses local memory.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.jit.compiler import KernelSpec, compile_ptx  # noqa: E402
from cupyconv.plans import scatter_gemm  # noqa: E402


def _layer(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


# The scatter forward's one-tap layers; the gather grad_input's, one tap a pixel or overlapping, with grad_output
# by copy-engine boxes (output channels in 64s) or gathered rows (landing masks where the padding crops)
FORWARD_LAYERS = {"unet_k2s2": _layer((8, 256, 64, 64), (256, 128, 2, 2), stride=2).with_weight_channels_last()}
GRAD_INPUT_LAYERS = {
    "unet_k2s2_boxes": _layer((8, 256, 64, 64), (256, 128, 2, 2), stride=2),
    "k2x3_crop_rows": _layer((2, 32, 6, 5), (32, 40, 2, 3), stride=(2, 3), padding=1, output_padding=(1, 0)),
    "pix2pix_k4s2p1_boxes": _layer((16, 512, 32, 32), (512, 128, 4, 4), stride=2, padding=1),
    "k4s2p1_rows": _layer((2, 64, 5, 7), (64, 48, 4, 4), stride=2, padding=1),
    "k3d2_rows": _layer((1, 32, 6, 9), (32, 40, 3, 3), padding=2, dilation=2),
}


def specs() -> Dict[str, KernelSpec]:
    """Every tile of both kernels on each check layer, in 16 bits both ways, and the gather's in TF32, through
    rounding copies and reading a channels_last grad_output in place (A from registers)."""
    found: Dict[str, KernelSpec] = {}
    for tile_name, tile in scatter_gemm.TILES.items():
        for name, g in FORWARD_LAYERS.items():
            for dtype in ("float16", "bfloat16"):
                packed = scatter_gemm.plan_forward(g, dtype, True, "nhwc", tile)
                found[f"scatter-{name}-{tile_name}-{dtype}"] = packed.gemm.spec
        for i, (name, g) in enumerate(GRAD_INPUT_LAYERS.items()):
            for dtype in (("float16", "bfloat16")[i % 2], "float32"):   # float32 at TF32
                packed = scatter_gemm.plan_grad_input(g, dtype, "nhwc", tile)
                found[f"gather-{name}-{tile_name}-{dtype}"] = packed.gemm.spec
            in_place = scatter_gemm.plan_grad_input(g, "float32", "nhwc", tile, in_place=True)
            found[f"gather-{name}-{tile_name}-float32-inplace"] = in_place.gemm.spec
    return found


def cubin(spec: KernelSpec) -> bytes:
    """The kernel's cubin as NVRTC builds it for the library."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(spec.source(), f"{spec.function}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, list(spec.options))
        except nvrtc.NVRTCError:
            raise RuntimeError(f"{spec.function} failed to build:\n{nvrtc.getProgramLog(program)}") from None
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)


def assembled(spec: KernelSpec) -> bytes:
    """The kernel's NVRTC PTX assembled by the ptxas on the PATH: for an NVRTC whose cubins the disassemblers
    here cannot read (CUDA 13's through CuPy, seen on an H200)."""
    ptx = compile_ptx(spec.source(), spec.function, spec.target.replace("sm_", "compute_"), spec.options[:-1])
    with tempfile.TemporaryDirectory() as folder:
        source, built = Path(folder) / "kernel.ptx", Path(folder) / "kernel.cubin"
        source.write_text(ptx)
        subprocess.run(["ptxas", f"-arch={spec.target}", str(source), "-o", str(built)], check=True,
                       capture_output=True)
        return built.read_bytes()


def disassemble(path: Path) -> str:
    """The SASS of a cubin, from whichever of CUDA's disassemblers is here and reads it."""
    errors = []
    for tool in (["nvdisasm", "-c"], ["cuobjdump", "-sass"]):
        if shutil.which(tool[0]) is None:
            continue
        done = subprocess.run(tool + [str(path)], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout
        errors.append(f"{' '.join(tool)}: exit {done.returncode}: {(done.stderr or done.stdout).strip()[:300]}")
    raise RuntimeError(f"no disassembler read {path.name}: " + "; ".join(errors or ["neither is on the PATH"]))


def inspect(sass: str) -> Tuple[int, int]:
    """(HGMMA instructions, local-memory instructions) in a disassembly."""
    return len(re.findall(r"\bHGMMA\.", sass)), len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\b", sass))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="a folder for the cubins and their disassembly")
    args = parser.parse_args(argv)
    if shutil.which("nvdisasm") is None and shutil.which("cuobjdump") is None:
        print("sass.py: neither nvdisasm nor cuobjdump is on the PATH", file=sys.stderr)
        return 2
    named = specs()
    with ThreadPoolExecutor() as pool:
        binaries = dict(zip(named, pool.map(cubin, named.values())))
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        return check(binaries, named, args.keep, keep=True)
    with tempfile.TemporaryDirectory(prefix="cupyconv-sass-") as folder:
        return check(binaries, named, Path(folder), keep=False)


def check(binaries: Dict[str, bytes], named: Dict[str, KernelSpec], folder: Path, keep: bool) -> int:
    """Disassemble each cubin in ``folder`` and print its line; 1 if any kernel fails."""
    failures: List[str] = []
    for name, binary in binaries.items():
        path = folder / f"{name}.cubin"
        path.write_bytes(binary)
        how = "nvrtc"
        try:
            sass = disassemble(path)
        except RuntimeError as unread:
            if shutil.which("ptxas") is None:
                raise
            print(f"     {name}: {unread}; assembling its PTX with ptxas instead")
            path.write_bytes(assembled(named[name]))
            sass, how = disassemble(path), "ptxas"
        if keep:
            path.with_suffix(".sass").write_text(sass)
        hgmma, local = inspect(sass)
        ok = hgmma > 0 and local == 0
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {hgmma} HGMMA, {local} LDL/STL ({how})")
        if not ok:
            failures.append(name)
    print(f"{len(binaries) - len(failures)} of {len(binaries)} kernels issue HGMMA and use no local memory")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
