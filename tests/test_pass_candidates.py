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
    assert tool.parse_layer("pix2pix_4") == ((16, 1024, 4, 4), 512, (4, 4), (2, 2), (1, 1), (0, 0))
    assert tool.parse_layer("2x64x9x7:48:k3s2p1") == ((2, 64, 9, 7), 48, (3, 3), (2, 2), (1, 1), (0, 0))
    # a side a number: HiFi-GAN's 1-D layers on one row, by spec and by name
    hifigan = ((16, 512, 1, 32), 256, (1, 16), (1, 8), (0, 4), (0, 0))
    assert tool.parse_layer("16x512x1x32:256:k1x16s1x8p0x4") == hifigan == tool.parse_layer("hifigan_32")
    assert tool.parse_layer("2x64x9x7:48:k3x5s2p1x2") == ((2, 64, 9, 7), 48, (3, 5), (2, 2), (1, 2), (0, 0))
    # output padding, as the suite's outpad_up3x
    assert tool.parse_layer("8x64x96x96:32:k3s3p1o2") == ((8, 64, 96, 96), 32, (3, 3), (3, 3), (1, 1), (2, 2))
    assert tool.parse_layer("2x8x5x7:6:k3s2p1o1x0") == ((2, 8, 5, 7), 6, (3, 3), (2, 2), (1, 1), (1, 0))
    for text in ("16x512x1x32:256:k1x16s1x8p0x4", "2x64x9x7:48:k3s2p1", "2x64x9x7:48:k3x5s2p1x2",
                 "8x64x96x96:32:k3s3p1o2", "2x8x5x7:6:k3s2p1o1x0"):
        assert tool.layer_name(*tool.parse_layer(text)) == text
    for bad in ("pix2pix_5", "2x64x9:48:k3s2p1", "2x64x9x7:48", "2x64x9x7:48:k3s2", "2x64x9x7:48:k3x5x7s2p1",
                "2x64x9x7:48:k3xs2p1", "2x64x9x7:48:k3s2p1o", "2x64x9x7:48:k3s2o1"):
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


@pytest.mark.parametrize("text", ["hifigan_32", "2x8x5x7:6:k3x5s2x1p1x2", "2x8x5x7:6:k3s3p1o2x1"])
@pytest.mark.parametrize("pass_", ["forward", "grad_input", "grad_weight"])
def test_torchs_call_is_the_layers_own_pass(tool, text, pass_):
    """cuDNN's side of a row, run on the CPU: the layer's pass with its per-side kernel, stride and padding, as
    autograd computes it."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x_shape, out_channels, k, s, p, o = tool.parse_layer(text)
    x_shape = (2, min(x_shape[1], 8)) + x_shape[2:]
    kw = dict(stride=s, padding=p, output_padding=o)
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    w = torch.randn((x_shape[1], 4) + k, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64)
    y = F.conv_transpose2d(x, w, b, **kw)
    go = torch.randn_like(y)
    y.backward(go)
    theirs, _ = tool._calls(pass_, x.detach(), w.detach(), b, go, kw)
    want = {"forward": y.detach(), "grad_input": x.grad, "grad_weight": w.grad}[pass_]
    torch.testing.assert_close(theirs(), want)


def test_also_times_variants_the_table_does_not_list_where_they_plan(tool):
    """--also adds pinned variants after the candidates where they plan for the pass: a halo tile the wgmma family
    does not list, and the gather only for grad_input (the scatter forward plans no float32); one already listed
    is not timed twice."""
    from cupyconv.core.geometry import ConvParams, geometry
    from cupyconv.plans import table
    from cupyconv.tuning import Variant

    g = geometry((128, 512, 4, 4), (512, 256, 4, 4), None, ConvParams.from_args(stride=2, padding=1))
    listed = list(table.candidates("grad_input", g, "float32", "nhwc", "tf32"))
    args = tool.parse_args(["dcgan_4", "--also", "scatter_gemm:64x256:inplace", "wgmma:8x8x64:copy", listed[-1].name])
    gather, halo, last = args.also
    assert (gather, halo, last) == (Variant.make("scatter_gemm", tile="64x256", inplace=True),
                                    Variant.make("wgmma", tile="8x8x64", copy=True), listed[-1])
    with pytest.raises(SystemExit):
        tool.parse_args(["dcgan_4", "--also", "no such:thing"])
    assert gather in listed and halo not in listed
    assert tool.timed_variants("grad_input", g, "float32", "nhwc", "tf32", args.also) == listed + [halo]
    forward = list(table.candidates("forward", g, "float32", "nhwc", "tf32"))
    assert halo not in forward
    assert tool.timed_variants("forward", g, "float32", "nhwc", "tf32", [gather, halo]) == forward + [halo]
