"""benchmarks/pass_candidates.py without a GPU: its layers and arguments, and a clear stop where there is no GPU."""
from __future__ import annotations

import argparse

import pytest

import script_modules


@pytest.fixture(scope="module")
def tool():
    with script_modules.loaded("benchmarks/pass_candidates.py") as module:
        yield module


def test_layers_by_name_or_spec(tool):
    assert tool.parse_layer("pix2pix_4") == ((16, 1024, 4, 4), 512, 4, 2, 1)
    assert tool.parse_layer("2x64x9x7:48:k3s2p1") == ((2, 64, 9, 7), 48, 3, 2, 1)
    for bad in ("pix2pix_5", "2x64x9:48:k3s2p1", "2x64x9x7:48", "2x64x9x7:48:k3s2"):
        with pytest.raises(argparse.ArgumentTypeError, match="NxCxHxW"):
            tool.parse_layer(bad)


def test_arguments(tool):
    args = tool.parse_args(["pix2pix_1", "1x16x3x3:16:k4s2p1", "--dtype", "bfloat16", "float32", "--layout", "nhwc",
                            "--weight-channels-last", "--passes", "grad_input"])
    assert [layer[0] for layer in args.layers] == [(16, 512, 1, 1), (1, 16, 3, 3)]
    assert args.dtype == ["bfloat16", "float32"] and args.layout == ["nhwc"] and args.weight_channels_last
    assert args.passes == ["grad_input"]
    defaults = tool.parse_args(["dcgan_4"])
    assert defaults.dtype == ["float32"] and defaults.layout == ["nchw"] and defaults.passes == list(tool.PASSES)
    for bad in (["dcgan_4", "--dtype", "float64"], ["dcgan_4", "--layout", "nhcw"], ["nothing"], []):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)


def test_without_a_gpu_it_stops_with_a_message(tool, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tool.main(["pix2pix_4"])
