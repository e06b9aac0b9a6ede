"""benchmarks/model_passes.py without a GPU: its arguments, and the layers it finds in each model (on the meta
device)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.plans import scatter_gemm  # noqa: E402

import script_modules  # noqa: E402


@pytest.fixture(scope="module")
def tool():
    with script_modules.loaded("benchmarks/model_passes.py") as module:
        yield module


def test_arguments(tool):
    opts = tool.parse_args([])
    assert opts.models == list(tool.TWO_D_MODELS) and opts.modes == ["fp32_nchw", "bf16_autocast_channels_last"]
    assert tool.parse_args(["unet", "--modes", "fp32_nchw"]).models == ["unet"]
    for bad in (["hifigan_generator"], ["resnet"]):
        with pytest.raises(SystemExit):
            tool.parse_args(bad)


def _geometry(x_shape, layer):
    return geometry(x_shape, tuple(layer.weight.shape), None,
                    ConvParams.from_args(stride=layer.stride, padding=layer.padding,
                                         output_padding=layer.output_padding, groups=layer.groups,
                                         dilation=layer.dilation))


@pytest.mark.parametrize("mode", ["fp32_nchw", "bf16_autocast_channels_last"])
def test_the_layers_each_model_runs(tool, mode):
    found = {name: tool.model_layers(name, mode, device="meta") for name in tool.TWO_D_MODELS}
    assert [len(found[name]) for name in tool.TWO_D_MODELS] == [5, 4, 8]
    dcgan_first, _ = found["dcgan_generator"][0]
    assert dcgan_first == (128, 100, 1, 1)
    # U-Net's upsampling layers are 2 x 2 at stride 2: the scatter GEMM's; pix2pix's 4 x 4 ones overlap but the
    # innermost, whose input is one pixel
    assert all(scatter_gemm.one_tap(_geometry(x, layer)) for x, layer in found["unet"])
    assert [scatter_gemm.one_tap(_geometry(x, layer)) for x, layer in found["pix2pix_unet"]] == [True] + [False] * 7
    for x_shape, layer in found["pix2pix_unet"]:
        assert layer.weight.is_contiguous(memory_format=torch.channels_last) == (mode != "fp32_nchw")
