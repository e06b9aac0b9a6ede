"""benchmarks/model_host.py without a GPU: its arguments, and that its Python-node layers compute what torch's
layers do, forward and backward, in float64 and under autocast."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import script_modules  # noqa: E402


@pytest.fixture(scope="module")
def tool():
    with script_modules.loaded("benchmarks/model_host.py") as module:
        yield module


def test_arguments(tool):
    opts = tool.parse_args([])
    assert opts.models == list(tool.TWO_D_MODELS) and opts.modes == ["fp32_nchw", "bf16_autocast_channels_last"]
    assert (opts.rounds, opts.steps) == (5, 10)
    assert tool.parse_args(["unet", "--modes", "fp32_nchw", "--rounds", "2"]).rounds == 2
    for bad in (["hifigan_generator"], ["resnet"], ["--rounds", "0"], ["--steps", "-1"]):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("bias", [False, True])
def test_python_node_layers_match_torch(tool, bias):
    """Strides, padding, output padding, groups and dilation, with and without bias: same output and gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0), groups=2,
                                 dilation=(1, 2), bias=bias),
        torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.ConvTranspose2d(6, 3, 4, stride=2, padding=1, bias=bias))).double()
    wrapped = tool.with_python_nodes(copy.deepcopy(model))
    assert not any(isinstance(m, torch.nn.ConvTranspose2d) for m in wrapped.modules())
    assert sum(isinstance(m, tool.PythonNodeConvTranspose2d) for m in wrapped.modules()) == 2
    x = torch.randn(2, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for m in (model, wrapped):
        xi = x.detach().clone().requires_grad_()
        out = m(xi)
        out.square().sum().backward()
        outs.append(out)
        grads.append([xi.grad] + _grads(m))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    assert len(grads[0]) == len(grads[1]) == 3 + 2 * bias
    for mine, theirs in zip(grads[1], grads[0]):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def test_python_node_layers_cast_under_autocast(tool):
    """Under CPU autocast the layer runs in bfloat16 as torch's own does; its weight's gradient stays float32."""
    torch.manual_seed(1)
    layer = torch.nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)
    wrapped = tool.PythonNodeConvTranspose2d(layer)
    x = torch.randn(1, 8, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs, mine = layer(x), wrapped(x)
    assert mine.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(mine, theirs)
    mine.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.shape == (4,)
