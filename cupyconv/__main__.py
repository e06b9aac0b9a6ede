"""``python -m cupyconv``: run the seed layer on random data and check it against the reference.

On a GPU the layer runs through CuPy, is checked against the float64 NumPy reference and,
when torch is installed, timed against ``torch.nn.functional.conv_transpose2d``.  Without
a GPU it runs on the NumPy reference backend, says so, and checks against torch's CPU
implementation when torch is installed.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import cupyconv
from cupyconv import reference
from cupyconv.bench import positive_int
from cupyconv.core.geometry import ConvParams

SEED_LAYER = dict(in_channels=32, out_channels=64, kernel=(3, 5), stride=(2, 3), padding=(1, 2), dilation=(2, 1),
                  groups=4)
SEED_INPUT = (16, 32, 128, 256)


def _rel_err(actual, expected) -> float:
    scale = float(np.abs(expected).max()) or 1.0
    return float(np.abs(np.asarray(actual, dtype=np.float64) - expected).max()) / scale


def _torch_cpu_reference(x, w, go, kwargs):
    try:
        import torch
    except ImportError:
        return None
    xt = torch.from_numpy(x).double().requires_grad_()
    wt = torch.from_numpy(w).double().requires_grad_()
    y = torch.nn.functional.conv_transpose2d(xt, wt, None, **kwargs)
    y.backward(torch.from_numpy(go).double())
    return y.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(), go.astype(np.float64).sum((0, 2, 3))


def _gpu_timings(x, w, go, kwargs, repeat):
    import cupy
    from cupyx.profiler import benchmark

    cx, cw, cgo = (cupy.asarray(a) for a in (x, w, go))
    ours_f = benchmark(lambda: cupyconv.conv_transpose2d(cx, cw, None, **kwargs), n_repeat=repeat, n_warmup=3)
    ours_b = benchmark(lambda: cupyconv.conv_transpose2d_backward(cgo, cx, cw, **kwargs), n_repeat=repeat,
                       n_warmup=3)
    rows = [("cupyconv forward", float(np.median(ours_f.gpu_times)) * 1e3),
            ("cupyconv backward", float(np.median(ours_b.gpu_times)) * 1e3)]
    try:
        import torch
    except ImportError:
        print("torch is not installed: no comparison timing")
        return rows
    from cupyconv.cuda_timing import cuda_time_ms

    tx, tw, tgo = (torch.from_numpy(a).cuda() for a in (x, w, go))
    tx.requires_grad_()
    tw.requires_grad_()
    with torch.no_grad():
        rows.append(("torch forward", cuda_time_ms(
            lambda: torch.nn.functional.conv_transpose2d(tx, tw, None, **kwargs), repeat=repeat)))

    def torch_backward():
        y = torch.nn.functional.conv_transpose2d(tx, tw, None, **kwargs)
        y.backward(tgo)

    fb = cuda_time_ms(torch_backward, repeat=repeat)
    rows.append(("torch forward+backward", fb))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cupyconv",
                                     description="cupyconv demo: the seed layer, checked and timed")
    parser.add_argument("--version", action="version", version=f"cupyconv {cupyconv.__version__}")
    parser.add_argument("--batch", type=positive_int, default=SEED_INPUT[0], help="batch size (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=20,
                        help="timed runs per measurement on a GPU (default: %(default)s)")
    args = parser.parse_args(argv)

    backend = cupyconv.backend()
    if backend == "cupy":
        import cupy

        from cupyconv.core import device

        name = device.get(0).name
        print(f"cupyconv {cupyconv.__version__}: GPU backend (CuPy {cupy.__version__}) on {name}")
    else:
        print(f"cupyconv {cupyconv.__version__}: no usable CUDA GPU found, using the NumPy float64 reference "
              f"backend (results are rounded to the input dtype)")

    layer = SEED_LAYER
    kwargs = dict(stride=layer["stride"], padding=layer["padding"], groups=layer["groups"],
                  dilation=layer["dilation"])
    shape = (args.batch,) + SEED_INPUT[1:]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    w = rng.standard_normal((layer["in_channels"], layer["out_channels"] // layer["groups"]) + layer["kernel"],
                            dtype=np.float32)
    print(f"layer: ConvTranspose2d({layer['in_channels']}, {layer['out_channels']}, kernel_size={layer['kernel']}, "
          f"stride={layer['stride']}, padding={layer['padding']}, dilation={layer['dilation']}, "
          f"groups={layer['groups']}, bias=False) on float32 input {shape}")

    start = time.perf_counter()
    y = cupyconv.conv_transpose2d(x, w, None, **kwargs)
    go = rng.standard_normal(y.shape, dtype=np.float32)
    grads = cupyconv.conv_transpose2d_backward(go, x, w, **kwargs)
    print(f"forward + backward through cupyconv ({backend}): output {y.shape}, "
          f"{time.perf_counter() - start:.2f} s wall" + (" (includes compiling the kernels)" if backend == "cupy" else ""))

    if backend == "cupy":
        label = "float64 NumPy reference"
        p = ConvParams.from_args(**kwargs)
        want = (reference.conv_transpose2d(x, w, None, p.stride, p.padding, p.output_padding, p.groups,
                                           p.dilation),) + reference.conv_transpose2d_backward(
            go, x, w, p.stride, p.padding, p.output_padding, p.groups, p.dilation)
    else:
        label = "torch CPU float64"
        want = _torch_cpu_reference(x, w, go, kwargs)
    if want is None:
        print("torch is not installed: the reference backend has nothing independent to be checked against")
    else:
        errors = [_rel_err(a, e) for a, e in zip((y,) + tuple(grads), want)]
        print(f"max error relative to {label}: output {errors[0]:.1e}, grad_input {errors[1]:.1e}, "
              f"grad_weight {errors[2]:.1e}, grad_bias {errors[3]:.1e}")
        if max(errors) > 1e-4:
            raise SystemExit("cupyconv disagrees with the reference")

    if backend == "cupy":
        for label, ms in _gpu_timings(x, w, go, kwargs, args.repeat):
            print(f"  {label:<24} {ms:8.3f} ms (median of {args.repeat})")
    else:
        print("timings skipped: they need a GPU")


if __name__ == "__main__":
    main()
