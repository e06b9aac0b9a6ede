"""explain() lists exactly the kernels a call launches: each family, both layouts, the tuner's choice.

The real call runs under ``launch.watch()``, which notes every launch; explain() replays the
same call on a recorder.  Marked ``gpu``: skipped where CuPy sees no GPU.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402
from cupyconv.core import device  # noqa: E402
from cupyconv.plans import launch, table  # noqa: E402
from cupyconv.tuning import decide  # noqa: E402

# name -> (module arguments, input shape, dtype, TF32 allowed); each reaches other families
LAYERS = {
    # tensor-core GEMMs, NCHW sources copied to channels_last (grad_output's copy shared)
    "gemm_fp16": (dict(in_channels=32, out_channels=48, kernel_size=(3, 5), stride=2, padding=1), (2, 32, 9, 11),
                  torch.float16, False),
    "gemm_tf32": (dict(in_channels=32, out_channels=32, kernel_size=4, stride=2, padding=1), (2, 32, 8, 8),
                  torch.float32, True),
    "gemm_strict_bf16_odd": (dict(in_channels=20, out_channels=18, kernel_size=3, stride=2, padding=1),
                             (2, 20, 7, 9), torch.bfloat16, False),
    # direct kernels (too few channels per group for tensor cores), grouped and dilated
    "direct_grouped": (dict(in_channels=8, out_channels=12, kernel_size=(3, 2), stride=(2, 3), padding=1, groups=4,
                            dilation=(2, 1), output_padding=(1, 0)), (3, 8, 7, 6), torch.float32, False),
    "direct_fp64": (dict(in_channels=4, out_channels=6, kernel_size=3, stride=1), (2, 4, 5, 5), torch.float64,
                    False),
}


def _key(stage, plan):
    return (stage, plan.spec.template, plan.spec.function, plan.spec.constants, tuple(plan.grid), tuple(plan.block),
            tuple(plan.scalars), plan.index_t, plan.scratch_bytes)


def _explained(e):
    return [(k.stage, k.template, k.function, tuple(sorted(k.constants.items())), k.grid, k.block,
             tuple(k.scalars.values()), k.index_t, k.scratch_bytes) for k in e.kernels]


@pytest.fixture
def tf32_flag():
    saved = torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_explain_lists_the_launches_of_a_training_step(name, layout, tf32_flag, monkeypatch):
    monkeypatch.setenv(decide.AUTOTUNE_ENV, "0")
    kwargs, shape, dtype, tf32 = LAYERS[name]
    torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(0)
    m = ct.ConvTranspose2d(**kwargs).to("cuda", dtype)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt).requires_grad_()
    m(x).sum().backward()  # compiles everything first
    go = torch.randn(m(x).shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    with launch.watch() as seen:
        m(x).backward(go)
        torch.cuda.synchronize()
    e = cupyconv.explain(m, x)
    # torch keeps float64 contiguous on CUDA, channels_last or not, and cupyconv follows it
    assert e.layout == ("nhwc" if layout == "channels_last" and dtype != torch.float64 else "nchw")
    assert e.precision == ("tf32" if tf32 else "strict")
    assert _explained(e) == [_key(stage, plan) for stage, plan in seen]
    families = {p.name: p.variant.split(":")[0] for p in e.passes}
    assert families["grad_bias"] == "reduction"
    # an sm_90 GPU runs the fp16 forward and grad_input of whole 16-byte channel groups on Hopper's wgmma kernels
    hopper = name == "gemm_fp16" and device.get(0).arch == "90"
    # and an NCHW forward of a thin layer on the tiled kernels
    tiled_forward = e.layout == "nchw" and not name.startswith("gemm")
    for pass_ in ("forward", "grad_input"):
        want = "wgmma" if hopper else "gemm" if name.startswith("gemm") else \
            "tiled" if tiled_forward and pass_ == "forward" else "direct"
        assert families[pass_] == want, pass_


def test_explain_follows_the_tuners_remembered_choice():
    """A choice the tuner holds for a configuration (not the heuristic) is what explain lists and what runs."""
    m = ct.ConvTranspose2d(32, 48, 3, stride=2, padding=1).to("cuda", torch.float16)
    x = torch.randn(4, 32, 12, 12, device="cuda", dtype=torch.float16)
    g = ct._forward_entry(x, m.weight, m.bias, m.stride, m.padding, m.output_padding, m.groups, m.dilation).g
    dev = device.get(0)
    cands = table.candidates("forward", g, "float16", "nchw", "strict", dev)
    assert len(cands) > 1
    try:
        decide.remember(("forward", g, "float16", "nchw", "strict", 0), cands[-1])
        with torch.no_grad(), launch.watch() as seen:
            m(x)
            torch.cuda.synchronize()
        e = cupyconv.explain(m, x, output_mask=(False, False, False))
        assert e.pass_("forward").variant == cands[-1].name != cands[0].name
        assert _explained(e) == [_key(stage, plan) for stage, plan in seen]
    finally:
        decide.clear()
