"""Host time of a model's training step: torch, converted, and torch's own kernels behind a Python autograd node.

    python benchmarks/model_host.py dcgan_generator unet --modes bf16_autocast_channels_last

A step whose GPU work is shorter than the time the host takes to issue it runs at the host's pace, and so did
the bf16 steps of the benchmark's models on both sides (v37 notes).  This prints, for each model and mode, the
process CPU time a step takes (no synchronisation inside the timed steps, so a host-bound step spends it all
issuing work), its host wall time, and its wall time to the GPU's end, for three copies of the model on the same
weights: the original, the converted one (``cupyconv.torch.convert``), and the original with each
ConvTranspose2d computed by torch's own kernels through a Python ``torch.autograd.Function``
(:class:`PythonNodeConvTranspose2d`).  The third is the floor of any operator whose autograd lives in Python:
what remains between it and torch is the cost of being a Python node, not of cupyconv's path.  Needs a GPU.
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_passes import TWO_D_MODELS, parse_model_args  # noqa: E402  (beside this script)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; each side keeps its fastest")
    parser.add_argument("--steps", type=int, default=10, help="steps a round")
    opts = parse_model_args(parser, argv)
    if opts.rounds < 1 or opts.steps < 1:
        parser.error("--rounds and --steps must be positive")
    return opts


class ConvTranspose2dNode(torch.autograd.Function):
    """torch's transposed convolution and its backward operator, with the autograd node in Python."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, output_padding, groups, dilation):
        ctx.save_for_backward(x, weight)
        ctx.conv = (stride, padding, output_padding, groups, dilation, bias is not None)
        return torch.nn.functional.conv_transpose2d(x, weight, bias, stride, padding, output_padding, groups,
                                                    dilation)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        stride, padding, output_padding, groups, dilation, has_bias = ctx.conv
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
        bias_sizes = [weight.shape[1] * groups] if has_bias else None
        grads = torch.ops.aten.convolution_backward(grad_output, x, weight, bias_sizes, list(stride), list(padding),
                                                    list(dilation), True, list(output_padding), groups, mask)
        return (*grads, None, None, None, None, None)


class PythonNodeConvTranspose2d(torch.nn.Module):
    """Stands in for an ``nn.ConvTranspose2d``, sharing its parameters: torch's kernels behind a Python autograd
    node.  Under autocast it casts its operands to the autocast dtype first, as torch's autocast does for
    ``conv_transpose2d``."""

    def __init__(self, layer: torch.nn.ConvTranspose2d):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.conv = (tuple(layer.stride), tuple(layer.padding), tuple(layer.output_padding), layer.groups,
                     tuple(layer.dilation))

    def forward(self, x):
        weight, bias = self.weight, self.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                return ConvTranspose2dNode.apply(x, weight, bias, *self.conv)
        return ConvTranspose2dNode.apply(x, weight, bias, *self.conv)


def with_python_nodes(model):
    """``model`` with every ConvTranspose2d replaced in place by a :class:`PythonNodeConvTranspose2d`."""
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ConvTranspose2d):
            setattr(model, name, PythonNodeConvTranspose2d(child))
        else:
            with_python_nodes(child)
    return model


def time_steps(steps: Dict[str, object], rounds: int, per_round: int) -> Dict[str, Dict[str, float]]:
    """Each side's fastest round, in ms a step: process CPU, host wall (to the last step's return) and wall (to
    the GPU's end); the sides alternate within every round."""
    times: Dict[str, List[tuple]] = {side: [] for side in steps}
    for _ in range(rounds):
        for side, step in steps.items():
            torch.cuda.synchronize()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for _ in range(per_round):
                step()
            cpu1, wall1 = time.process_time(), time.perf_counter()
            torch.cuda.synchronize()
            wall2 = time.perf_counter()
            times[side].append(tuple(1e3 * t / per_round for t in (cpu1 - cpu0, wall1 - wall0, wall2 - wall0)))
    return {side: dict(cpu_ms=min(r[0] for r in rows), host_ms=min(r[1] for r in rows),
                       wall_ms=min(r[2] for r in rows), cpu_median_ms=statistics.median(r[0] for r in rows))
            for side, rows in times.items()}


def main(argv=None) -> int:
    from cupyconv import model_bench
    from cupyconv.torch import convert

    opts = parse_args(argv)
    torch.backends.cudnn.benchmark = True
    for name in opts.models:
        builder, kwargs, shape = model_bench.MODELS[name]
        for mode in opts.modes:
            channels_last = mode == "bf16_autocast_channels_last"
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            torch.manual_seed(0)
            original = builder(**kwargs).cuda()
            models = dict(torch=original, cupyconv=convert(copy.deepcopy(original)),
                          python_node=with_python_nodes(copy.deepcopy(original)))
            models = {side: m.to(memory_format=fmt) for side, m in models.items()}
            x = model_bench._arranged(torch.randn(shape, device="cuda"), fmt)
            steps = {}
            for side, model in models.items():
                optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
                steps[side] = functools.partial(model_bench._step, model, x, optimizer, channels_last)
                steps[side]()
                model_bench.settle_tuning()
                steps[side]()
            result = time_steps(steps, opts.rounds, opts.steps)
            print(f"{name} {mode}, ms a step (fastest of {opts.rounds} rounds of {opts.steps}):", flush=True)
            for side, r in result.items():
                print(f"  {side:12s} process CPU {r['cpu_ms']:7.2f} (median round {r['cpu_median_ms']:7.2f})  "
                      f"host {r['host_ms']:7.2f}  wall {r['wall_ms']:7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
