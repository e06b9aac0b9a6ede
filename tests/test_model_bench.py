"""The model benchmark: published architectures built to spec, and original-against-converted rows.

On the CPU the converted models run cupyconv's float64 NumPy path, so the rows are checked
for their fields and for errors at each precision's level; timings there mean nothing.
"""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from cupyconv import bench, model_bench  # noqa: E402

SMALL = {  # name -> (builder arguments, input shape): the published layouts at a fraction of the width
    "dcgan_generator": (dict(ngf=8), (2, 100, 1, 1)),
    "unet": (dict(width=4), (2, 3, 32, 32)),
    "pix2pix_unet": (dict(width=2), (1, 3, 256, 256)),
    "hifigan_generator": (dict(width=16), (2, 80, 6)),
}


def _transposed(model):
    return [m for m in model.modules() if isinstance(m, (nn.ConvTranspose2d, nn.ConvTranspose1d))]


def test_dcgan_generator_follows_the_paper():
    g = model_bench.dcgan_generator()
    convs = _transposed(g)
    assert [(c.in_channels, c.out_channels) for c in convs] == [(100, 512), (512, 256), (256, 128), (128, 64),
                                                                 (64, 3)]
    assert all(c.kernel_size == (4, 4) and c.bias is None for c in convs)
    assert [c.stride for c in convs] == [(1, 1)] + [(2, 2)] * 4
    assert [c.padding for c in convs] == [(0, 0)] + [(1, 1)] * 4
    small = model_bench.dcgan_generator(ngf=8)
    assert small(torch.randn(2, 100, 1, 1)).shape == (2, 3, 64, 64)


def test_unet_decoder_has_four_2x2_stride_2_up_convolutions():
    u = model_bench.unet()
    convs = _transposed(u)
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1024, 512), (512, 256), (256, 128), (128, 64)]
    assert all(c.kernel_size == (2, 2) and c.stride == (2, 2) and c.padding == (0, 0) for c in convs)
    assert model_bench.unet(width=4)(torch.randn(1, 3, 32, 32)).shape == (1, 2, 32, 32)


def test_pix2pix_generator_mirrors_its_eight_downsamplings():
    p = model_bench.pix2pix_unet()
    convs = _transposed(p)
    assert [(c.in_channels, c.out_channels) for c in convs] == [(512, 512), (1024, 512), (1024, 512), (1024, 512),
                                                                 (1024, 256), (512, 128), (256, 64), (128, 3)]
    assert all(c.kernel_size == (4, 4) and c.stride == (2, 2) and c.padding == (1, 1) for c in convs)
    assert model_bench.pix2pix_unet(width=2)(torch.randn(1, 3, 256, 256)).shape == (1, 3, 256, 256)


def test_hifigan_generator_follows_the_paper():
    """V1: 512 channels after the 7-tap input convolution, halved by each of four upsamplings (x8, x8, x2, x2 with
    kernels 16, 16, 4, 4), each followed by three residual blocks of kernels 3, 7 and 11 and dilations 1, 3, 5."""
    g = model_bench.hifigan_generator()
    ups = _transposed(g)
    assert [(c.in_channels, c.out_channels) for c in ups] == [(512, 256), (256, 128), (128, 64), (64, 32)]
    assert [(c.kernel_size, c.stride, c.padding) for c in ups] == [((16,), (8,), (4,)), ((16,), (8,), (4,)),
                                                                   ((4,), (2,), (1,)), ((4,), (2,), (1,))]
    convs = [m for m in g.modules() if isinstance(m, nn.Conv1d)]
    assert (convs[0].in_channels, convs[0].out_channels, convs[0].kernel_size) == (80, 512, (7,))
    assert (convs[-1].in_channels, convs[-1].out_channels, convs[-1].kernel_size) == (32, 1, (7,))
    blocks = convs[1:-1]
    assert len(blocks) == 4 * 3 * 6 and {c.kernel_size for c in blocks} == {(3,), (7,), (11,)}
    assert {c.dilation for c in blocks} == {(1,), (3,), (5,)}
    assert all(c.padding[0] == c.dilation[0] * (c.kernel_size[0] - 1) // 2 for c in blocks), "length kept"
    # 256 samples a mel frame; a smaller width keeps the shapes
    with torch.no_grad():
        assert model_bench.hifigan_generator(width=16)(torch.randn(2, 80, 6)).shape == (2, 1, 6 * 256)


def test_the_command_line_names_every_model():
    assert bench.MODEL_NAMES == tuple(model_bench.MODELS)
    assert all(shape[0] >= 8 for _, _, shape in model_bench.MODELS.values()), "batches that fill a GPU"


@pytest.mark.parametrize("mode", model_bench.MODES)
@pytest.mark.parametrize("name", sorted(SMALL))
def test_rows_compare_both_sides_with_float64(name, mode):
    args, shape = SMALL[name]
    row = model_bench.compare(name, mode, "cpu", repeat=1, warmup=0, shape=shape, builder_args=args)
    assert row["model"] == name and row["mode"] == mode and row["batch"] == shape[0]
    assert row["transposed_convs"] == len(_transposed(model_bench.MODELS[name][0](**args)))
    assert row["torch_ms"] > 0 and row["ms"] > 0 and math.isclose(row["speedup"], row["torch_ms"] / row["ms"])
    assert row["rounds"] == model_bench.ROUNDS
    for side in ("torch_error", "error"):
        assert set(row[side]) == {"output", "grads"}
        assert all(math.isfinite(v) and v >= 0 for v in row[side].values())
    if mode == "fp32_nchw":
        assert row["error"]["output"] < 1e-5 and row["error"]["grads"] < 1e-5
    else:
        # bfloat16 autocast: the converted model's error is torch's own, give or take the rounding of its sums
        assert 1e-4 < row["torch_error"]["output"] < 0.05
        for key in ("output", "grads"):
            assert row["error"][key] <= 2 * row["torch_error"][key] + 1e-3, key


def test_sides_alternate_rounds_and_keep_their_fastest(monkeypatch):
    """Each round times both sides, the order flipping from round to round; a side's time is its fastest round."""
    args, shape = SMALL["dcgan_generator"]
    calls, clock = [], iter([5.0, 4.0, 3.0, 6.0, 7.0, 2.0, 9.0, 9.0])

    def timed(fn, device, warmup, repeat):
        calls.append(fn.args[0])
        return next(clock)

    monkeypatch.setattr(model_bench, "_wall_ms", timed)
    row = model_bench.compare("dcgan_generator", "fp32_nchw", "cpu", repeat=1, warmup=0, shape=shape,
                              builder_args=args, rounds=4)
    original, converted = calls[0], calls[1]
    assert original is not converted
    assert calls == [original, converted, converted, original, original, converted, converted, original]
    assert (row["torch_ms"], row["ms"], row["rounds"]) == (5.0, 2.0, 4)


def test_bad_names_and_modes_are_refused():
    with pytest.raises(ValueError, match="model must be one of"):
        model_bench.compare("resnet", "fp32_nchw", "cpu")
    with pytest.raises(ValueError, match="mode must be one of"):
        model_bench.compare("unet", "fp16", "cpu")


def test_table_lists_every_row_and_the_geomean():
    rows = [dict(model="unet", mode="fp32_nchw", batch=8, torch_ms=2.0, ms=1.0, speedup=2.0,
                 torch_error=dict(output=1e-6, grads=2e-6), error=dict(output=3e-6, grads=4e-6)),
            dict(model="dcgan_generator", mode="bf16_autocast_channels_last", batch=128, torch_ms=1.0, ms=2.0,
                 speedup=0.5, torch_error=dict(output=1e-3, grads=2e-3), error=dict(output=1e-3, grads=2e-3))]
    table = model_bench.format_table(rows)
    assert "unet" in table and "dcgan_generator" in table and "2.00x" in table and "0.50x" in table
    assert table.splitlines()[-1] == "geomean speedup: 1.00x over 2 rows"


def test_layer_table_lists_shapes_runs_and_times():
    row = dict(model="unet", mode="fp32_nchw", input=[8, 1024, 16, 16], weight=[1024, 512, 2, 2], stride=[2, 2],
               padding=[0, 0], count=1, torch_ms=0.5, ms=0.25, speedup=2.0)
    lines = model_bench.format_layer_table([row]).splitlines()
    assert len(lines) == 2 and "8x1024x16x16" in lines[1] and "1024x512x2x2" in lines[1] and "2.00x" in lines[1]


def test_model_selection_needs_models():
    assert bench.parse_args(["--models", "--model", "unet", "--per-layer"]).per_layer
    with pytest.raises(SystemExit):
        bench.parse_args(["--per-layer"])
    assert bench.parse_args(["--models", "--model", "unet"]).model == ["unet"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "unet"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "--model", "resnet"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("mode", model_bench.MODES)
def test_converted_models_train_like_the_originals_on_the_gpu(mode):
    """Small versions of every model on the GPU: the converted side's error against float64 is within twice
    torch's own (plus a TF32/bf16 floor), for the output and for every gradient."""
    for name, (args, shape) in SMALL.items():
        row = model_bench.compare(name, mode, "cuda", repeat=2, warmup=1, shape=shape, builder_args=args)
        for key in ("output", "grads"):
            floor = 1e-3 if mode == "fp32_nchw" else 1e-2
            assert row["error"][key] <= 2 * row["torch_error"][key] + floor, (name, key, row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("mode", model_bench.MODES)
def test_the_per_layer_breakdown_times_each_distinct_layer(mode):
    for name, (args, shape) in SMALL.items():
        rows = model_bench.layer_rows(name, mode, repeat=2, shape=shape, builder_args=args)
        layers = _transposed(model_bench.MODELS[name][0](**args))
        assert 1 <= len(rows) <= len(layers) and sum(r["count"] for r in rows) == len(layers), name
        assert len({(tuple(r["input"]), tuple(r["weight"])) for r in rows}) == len(rows)
        for r in rows:
            assert r["torch_ms"] > 0 and r["ms"] > 0 and math.isclose(r["speedup"], r["torch_ms"] / r["ms"])
