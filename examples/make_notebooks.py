"""Regenerate the example notebooks from the cell text below (needs ``nbformat``).

    python examples/make_notebooks.py

Edit the cells here rather than in the .ipynb files, so the cell ids stay stable and
the diffs small.  This writes the notebooks without outputs; the committed ones carry
the outputs of one run on a GPU, stored by ``python scripts/run_notebooks.py`` (rerun it
on a GPU after regenerating).  ``tests/test_notebooks.py`` executes every notebook in
this folder; a notebook's ``metadata.cupyconv.requires`` lists the modules it needs
beyond cupyconv (the test skips it where one is missing).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

NOTEBOOKS = {}

# --------------------------------------------------------------------------------------------
NOTEBOOKS["01_numpy_cupy_arrays"] = ([], [
    ("md", """# cupyconv with NumPy and CuPy arrays

A transposed convolution (PyTorch's `ConvTranspose2d` semantics) and its three gradients on
plain arrays, checked against cupyconv's float64 reference. NumPy arrays run on the GPU when
there is one and on the float64 NumPy reference otherwise; CuPy arrays always run on the GPU."""),
    ("code", """import numpy as np

import cupyconv
from cupyconv import reference
from cupyconv.bench import where_this_runs
from cupyconv.explain import explain

print(where_this_runs())   # the GPU and the commit these outputs come from
backend = cupyconv.backend()
print(f"cupyconv {cupyconv.__version__}; NumPy arrays run on backend {backend!r}")
if backend == "numpy":
    print("No usable CUDA GPU (or CUPYCONV_BACKEND=numpy): NumPy arrays run on the float64 NumPy "
          "REFERENCE backend, so the checks below compare the reference with itself and only show the API.")"""),
    ("md", """A small strided, grouped, dilated layer with output padding and a bias. The weight is
`(C_in, C_out // groups, kH, kW)`, as in PyTorch."""),
    ("code", """rng = np.random.default_rng(0)
layer = dict(stride=(2, 3), padding=(1, 2), output_padding=(1, 0), groups=2, dilation=(1, 2))
x = rng.standard_normal((2, 4, 6, 7)).astype(np.float32)     # (N, C_in, H, W)
w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)     # C_out = 3 * groups = 6
b = rng.standard_normal(6).astype(np.float32)

y = cupyconv.conv_transpose2d(x, w, b, **layer)
go = rng.standard_normal(y.shape).astype(np.float32)          # an upstream gradient
gi, gw, gb = cupyconv.conv_transpose2d_backward(go, x, w, **layer)
print("output", y.shape, y.dtype, "| grads", gi.shape, gw.shape, gb.shape)"""),
    ("code", """def rel_err(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


args = (layer["stride"], layer["padding"], layer["output_padding"], layer["groups"], layer["dilation"])
y_ref = reference.conv_transpose2d(x, w, b, *args)                  # float64, scatter form
grads_ref = reference.conv_transpose2d_backward(go, x, w, *args)
expected = dict(zip(("output", "grad_input", "grad_weight", "grad_bias"), (y_ref,) + grads_ref))


def check(results, where):
    for (name, ref), got in zip(expected.items(), results):
        err = rel_err(got, ref)
        print(f"{where:>6} {name:<12} max error / max |ref| = {err:.1e}")
        assert err < 1e-5, name


check((y, gi, gw, gb), "numpy")"""),
    ("code", """if backend == "cupy":
    import cupy as cp

    cx, cw, cb, cgo = (cp.asarray(a) for a in (x, w, b, go))
    cy = cupyconv.conv_transpose2d(cx, cw, cb, **layer)          # CuPy in, CuPy out, current stream
    cgrads = cupyconv.conv_transpose2d_backward(cgo, cx, cw, **layer)
    check([cp.asnumpy(a) for a in (cy,) + tuple(cgrads)], "cupy")
else:
    print("No GPU: skipping the CuPy-array part (CuPy arrays need a CUDA device).")"""),
    ("md", """## What runs on the GPU

`explain` shows, for the forward pass and each gradient, the kernel variant, its template
constants, grid and block, runtime arguments, split-K scratch, the generated CUDA source and
a roofline floor. It works without a GPU (register counts then read "n/a")."""),
    ("code", """e = explain(x.shape, w.shape, bias=True, dtype="float32", **layer)
for p in e.passes:
    print(f"{p.name:<12} floor {p.floor_s * 1e9:8.2f} ns ({p.bound}-bound) via "
          + ", ".join(f"{k.function} grid {k.grid}" for k in p.kernels))
e     # the notebook renders it as a table with collapsible sources; print(e) gives plain text"""),
])

# --------------------------------------------------------------------------------------------
NOTEBOOKS["02_torch_convert"] = (["torch"], [
    ("md", """# Swapping cupyconv into a PyTorch model

`cupyconv.torch.convert(model)` replaces every `nn.ConvTranspose2d` in a model by
`cupyconv.torch.ConvTranspose2d`, in place, keeping the same parameters. Here a small
DCGAN-style generator and a converted copy of it are trained side by side on the same data."""),
    ("code", """import copy

import numpy as np
import torch
import torch.nn as nn

import cupyconv
import cupyconv.torch as cct
from cupyconv.bench import where_this_runs

print(where_this_runs())   # the GPU and the commit these outputs come from
device = "cuda" if cupyconv.backend() == "cupy" and torch.cuda.is_available() else "cpu"
torch.backends.cudnn.allow_tf32 = False   # strict float32 on both sides: cupyconv follows this flag too
print("device:", device)
if device == "cpu":
    print("No GPU: the converted model's transposed convolutions run on cupyconv's float64 NumPy "
          "REFERENCE (rounded back to float32), not on the CUDA kernels.")"""),
    ("code", """def generator(nz=16, ngf=16, channels=3):
    \"\"\"1x1 noise -> 32x32 image, DCGAN-style.\"\"\"
    return nn.Sequential(
        nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),   # 4x4
        nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),  # 8x8
        nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),  # 16x16
        nn.ConvTranspose2d(ngf, channels, 4, 2, 1), nn.Tanh())  # 32x32


torch.manual_seed(0)
reference_model = generator().to(device)
ours = cct.convert(copy.deepcopy(reference_model))
print(sum(isinstance(m, cct.ConvTranspose2d) for m in ours.modules()), "layers converted")"""),
    ("code", """gen = torch.Generator().manual_seed(1)
noise = torch.randn(32, 16, 1, 1, generator=gen).to(device)
targets = torch.rand(32, 3, 32, 32, generator=gen).mul(2).sub(1).to(device)   # stand-in images in [-1, 1]


def train(model, steps=5):
    opt = torch.optim.Adam(model.parameters(), lr=2e-3, betas=(0.5, 0.999))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(noise), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


torch_losses, cupyconv_losses = train(reference_model), train(ours)
for step, (a, b) in enumerate(zip(torch_losses, cupyconv_losses)):
    print(f"step {step}: torch {a:.6f}  cupyconv {b:.6f}  rel. diff {abs(a - b) / a:.1e}")
assert np.allclose(torch_losses, cupyconv_losses, rtol=1e-3), "the two models diverged"
print("Same losses up to float32 rounding.")"""),
    ("md", """`explain` takes a module and an input shape too: here the last (largest) layer."""),
    ("code", """from cupyconv.explain import explain

last = ours[-2]
e = explain(last, (32, last.in_channels, 16, 16))
print(e.text().split("\\n== ")[0])   # the summary lines; print(e) shows every kernel
for p in e.passes:
    print(f"{p.name:<12} {p.flops / 1e6:8.2f} MFLOP, {p.bytes / 1e6:6.2f} MB -> floor {p.floor_s * 1e6:.2f} us")"""),
])

# --------------------------------------------------------------------------------------------
NOTEBOOKS["03_benchmark_your_layer"] = (["matplotlib"], [
    ("md", """# Benchmark your own layer

Describe your layer as a `cupyconv.bench.BenchLayer`, then time cupyconv against PyTorch
(cuDNN) over a few batch sizes and plot the speedup. The timings need a CUDA GPU, CuPy and a
CUDA build of torch; without them this notebook plots the roofline floor from `explain`
instead (an H100 estimate) and says so."""),
    ("code", """import dataclasses
import importlib.util

import matplotlib.pyplot as plt

import cupyconv
from cupyconv.bench import BenchLayer, format_table, run, where_this_runs
from cupyconv.explain import explain

print(where_this_runs())   # the GPU and the commit these outputs come from

# Your layer: ConvTranspose2d(64, 32, kernel_size=4, stride=2, padding=1) on 32x32 inputs.
my_layer = BenchLayer("my_layer", batch=8, in_channels=64, out_channels=32, kernel=(4, 4), stride=(2, 2),
                      padding=(1, 1), size=(32, 32))
batches = [1, 4, 16, 64]
layers = [dataclasses.replace(my_layer, name=f"batch {n}", batch=n) for n in batches]"""),
    ("code", """def torch_cuda():
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return torch.cuda.is_available()


can_time = cupyconv.backend() == "cupy" and torch_cuda()
if can_time:
    # Strict float32 (TF32 off on both sides); dtype="tf32" is torch's default, or try "float16", "bfloat16".
    rows = run(layers, dtype="float32", repeat=20, progress=False)
    print(format_table(rows))
else:
    rows = []
    print("No CUDA GPU (with CuPy and CUDA torch): skipping the timings. "
          "Below is the roofline floor from explain() instead, an estimate for an H100.")"""),
    ("code", """def floors(layer):
    e = explain((layer.batch, layer.in_channels) + layer.size,
                (layer.in_channels, layer.out_channels // layer.groups) + layer.kernel,
                bias=layer.bias, **layer.kwargs())
    return {"forward": e.pass_("forward").floor_s * 1e3, "forward+backward": e.floor_s * 1e3}, e


floor_ms = [floors(layer)[0] for layer in layers]
fig, ax = plt.subplots(figsize=(6, 3.5))
if rows:
    for pass_name in ("forward", "forward+backward"):
        speedup = [r["speedup"] for r in rows if r["pass"] == pass_name]
        ax.plot(batches, speedup, "o-", label=pass_name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speedup over torch (x)")
    ax.set_title(f"{my_layer.name}: cupyconv vs torch")
else:
    for pass_name in ("forward", "forward+backward"):
        ax.plot(batches, [f[pass_name] for f in floor_ms], "o-", label=f"{pass_name} floor")
    ax.set_yscale("log")
    ax.set_ylabel("roofline floor (ms, H100 estimate)")
    ax.set_title(f"{my_layer.name}: no GPU, so the floor instead of timings")
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size")
ax.legend()
plt.show()"""),
    ("md", """How close does each pass get to its floor? On a GPU, compare the measured times above
with these; `print(e)` shows the kernels, grids and generated sources behind each number."""),
    ("code", """_, e = floors(my_layer)
for p in e.passes:
    print(f"{p.name:<12} {p.bound}-bound, floor {p.floor_s * 1e6:7.2f} us "
          f"(compute {p.compute_s * 1e6:.2f} us, memory {p.memory_s * 1e6:.2f} us)")
print(e.peak.source)"""),
])


def build(name: str, requires, cells) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["cupyconv"] = {"requires": list(requires)}
    for i, (kind, text) in enumerate(cells):
        cell = new_markdown_cell(text) if kind == "md" else new_code_cell(text)
        cell["id"] = f"{name[:2]}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def main() -> None:
    for name, (requires, cells) in NOTEBOOKS.items():
        path = HERE / f"{name}.ipynb"
        nbformat.write(build(name, requires, cells), str(path))
        print("wrote", path.relative_to(HERE.parent))


if __name__ == "__main__":
    main()
