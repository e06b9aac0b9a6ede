"""The grouped mma kernels (thin grouped layers, every tap of a staged row segment on mma.sync): the forward,
grad_input and grad_weight on a GPU, against float64.

Each case pins a pass to one of the family's blocks and checks, through ``launch.watch()``, that its kernel ran with
that block; outputs and gradients must be finite (free blocks of their size are NaN-filled first), every element
within twice the dtype's epsilon of the sum of its terms' magnitudes, and no worse than twice torch's own error.
Needs an sm_80 or newer GPU.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv.torch as ct  # noqa: E402
from cupyconv import tuning  # noqa: E402
from cupyconv.plans import gemm, grouped_mma, launch, table  # noqa: E402
from cupyconv.tuning import Variant  # noqa: E402

from layers import Layer, grad_weight_geometry  # noqa: E402
from test_expanded_taps_gpu import _arranged, _check_near_float64, _geometry, _grads, ampere_or_newer  # noqa: E402,F401
from test_gemm_gpu import _data  # noqa: E402
from test_wgmma_gpu import _one_element_off  # noqa: E402

F = torch.nn.functional
FUNCTION = "conv_transpose2d_grad_weight_grouped_mma"
FORWARD = "conv_transpose2d_forward_grouped_mma"
GRAD_INPUT = "conv_transpose2d_grad_input_grouped_mma"
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@pytest.fixture
def untuned(monkeypatch):
    """The tuner's heuristic choices, with nothing timed or remembered before or after."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    yield
    tuning.clear()


# (batch, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups, bias, size)
LAYERS = {
    # the suite's grouped_dilated at a small size: asymmetric kernel, stride, padding and dilation, output padding;
    # 40 columns end a 32-pixel segment part way
    "dilated_3x5": Layer(2, 32, 64, (3, 5), (2, 3), (1, 2), (1, 0), (2, 1), 4, False, (9, 40), ""),
    # six groups in blocks of four: the second block's last two warps idle
    "six_groups": Layer(3, 48, 96, (2, 3), (1, 1), (0, 1), (0, 0), (1, 1), 6, True, (7, 19), ""),
    # 16 channels a side: two warps a group
    "two_warps_4x4": Layer(2, 64, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 4, False, (10, 12), ""),
    # 25 taps, 32 output channels a group (two 16-channel warps), batch 1
    "k5_batch1": Layer(1, 64, 256, (5, 5), (1, 1), (2, 2), (0, 0), (1, 1), 8, False, (12, 70), ""),
    # enough rows for many chunks and their reduce
    "many_rows": Layer(8, 16, 32, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 2, True, (40, 24), ""),
    # twelve groups: forward blocks of eight, the second holding four
    "twelve_groups": Layer(2, 96, 192, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 12, True, (6, 21), ""),
}
CASES = [pytest.param(name, dtype, block, weight_cl,
                      id=f"{name}-{SHORT[dtype]}-{block[0]}x{block[1]}-{'wcl' if weight_cl else 'w'}")
         for i, name in enumerate(LAYERS) for dtype in (torch.float16, torch.bfloat16)
         for j, block in enumerate(grouped_mma.blocks(_geometry(LAYERS[name], False)))
         for weight_cl in ((i + j + (dtype == torch.bfloat16)) % 2 == 0,)]


def _run(layer: Layer, dtype, weight_cl: bool, seed: int, variant=None, x_view=None, pass_="grad_weight",
         nchw=False):
    """Our grad_weight with ``pass_`` pinned to ``variant`` (the tuner's choice for None; a dict pins passes), and
    the launches of the call; grad_input and grad_weight are checked against float64.  ``nchw``: x and grad_output
    NCHW, else channels_last."""
    x64, w64, b64, go64 = _data(layer, seed)
    x, go = _arranged(x64, dtype, not nchw), _arranged(go64, dtype, not nchw)
    w = _arranged(w64, dtype, weight_cl)
    b = None if b64 is None else b64.to(dtype)
    for shape in (x.shape, w.shape):
        blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(3)]
        del blocks
    pins = tuning.pinned(variant if isinstance(variant, dict) else {} if variant is None else {pass_: variant})
    with pins, launch.watch() as seen:
        gi, gw = _grads(ct.conv_transpose2d, x if x_view is None else x_view(x), w, b, go, layer)
        torch.cuda.synchronize()
    ref = _grads(F.conv_transpose2d, x64, w64, None, go64, layer)
    magnitude = _grads(F.conv_transpose2d, x64.abs(), w64.abs(), None, go64.abs(), layer)
    theirs = _grads(F.conv_transpose2d, x, w, b, go, layer)
    for what, o, t, r, m in zip(("grad_input", "grad_weight"), (gi, gw), theirs, ref, magnitude):
        _check_near_float64(o, t, r, m, dtype, what)
    assert gw.is_contiguous(memory_format=torch.channels_last) == weight_cl
    assert gi.stride() == theirs[0].stride()   # torch's memory format
    return gw, seen


def _launched(seen):
    return [plan for _, plan in seen if plan.spec.function == FUNCTION]


@pytest.mark.parametrize("name,dtype,block,weight_cl", CASES)
def test_every_block_matches_float64(name, dtype, block, weight_cl, ampere_or_newer):
    layer = LAYERS[name]
    # grad_weight is written in torch's memory format for it, channels_last beside the channels_last x
    g = grad_weight_geometry(layer, _geometry(layer, weight_cl))
    variant = Variant.make("grouped_mma", tile=f"{block[0]}x{block[1]}")
    assert table.plan("grad_weight", variant, g, NAMES[dtype], "nhwc", "strict", False, True,
                      ampere_or_newer.sm_count).plans()[0].spec.function == FUNCTION
    _, seen = _run(layer, dtype, weight_cl, list(LAYERS).index(name), variant)
    plans = _launched(seen)
    assert len(plans) == 1, [plan.spec.function for _, plan in seen]
    constants = dict(plans[0].spec.constants)
    assert (constants["GROUPS_PER_BLOCK"], constants["SEG"]) == block
    assert constants["WEIGHT_CL"] == g.weight_channels_last


def test_many_chunks_reduce_reproducibly(ampere_or_newer):
    """Many row chunks and their fixed-order reduce give the same bits on every run."""
    layer = LAYERS["many_rows"]
    partial, reduce = grouped_mma.plan_grad_weight(_geometry(layer, False), "float16", ampere_or_newer.sm_count)
    assert partial.grid[0] > 1 and reduce is not None
    first, _ = _run(layer, torch.float16, False, 7, Variant("grouped_mma"))
    for _ in range(2):
        again, _ = _run(layer, torch.float16, False, 7, Variant("grouped_mma"))
        assert torch.equal(again, first)


def test_unbatched_input(ampere_or_newer):
    """A (C, H, W) input runs as a batch of one; its layout follows the channels_last weight."""
    layer = Layer(None, 32, 64, (3, 3), (2, 2), (1, 1), (0, 0), (1, 1), 4, True, (9, 11), "")
    gw, seen = _run(layer, torch.bfloat16, True, 8, Variant("grouped_mma"))
    assert _launched(seen)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_input_runs_the_direct_kernel(dtype, ampere_or_newer):
    """A channels_last x one element off a 16-byte boundary cannot feed the 16-byte copies: the pinned family plans
    the direct grad_weight kernel instead, which gives the right answer."""
    _, seen = _run(LAYERS["dilated_3x5"], dtype, False, 9, Variant("grouped_mma"), x_view=_one_element_off)
    functions = {plan.spec.function for _, plan in seen}
    assert "conv_transpose2d_grad_weight_nhwc_partial" in functions and FUNCTION not in functions


def test_the_heuristic_runs_the_family(ampere_or_newer, untuned):
    """Untuned, a channels_last 16-bit layer of 8 input channels a group runs the grouped mma grad_weight."""
    layer = LAYERS["dilated_3x5"]
    g = _geometry(layer, False)
    assert table.candidates("grad_weight", g, "float16", "nhwc", "strict", ampere_or_newer)[0] == Variant("grouped_mma")
    _, seen = _run(layer, torch.float16, False, 10)
    assert _launched(seen)


FORWARD_CASES = [pytest.param(name, dtype, block, weight_cl,
                              id=f"{name}-{SHORT[dtype]}-{block[0]}x{block[1]}-{'wcl' if weight_cl else 'w'}")
                 for i, name in enumerate(LAYERS) for dtype in (torch.float16, torch.bfloat16)
                 for j, block in enumerate(grouped_mma.forward_blocks(_geometry(LAYERS[name], False)))
                 for weight_cl in ((i + j + (dtype == torch.bfloat16)) % 2 == 1,)]


def _forward(layer: Layer, dtype, weight_cl: bool, seed: int, variant=None, x_view=None, nchw=False):
    """Our forward with it pinned to ``variant`` (the tuner's choice for None) and checked against float64, and the
    launches of the call.  ``nchw``: x NCHW, else channels_last."""
    x64, w64, b64, _ = _data(layer, seed)
    x, w = _arranged(x64, dtype, not nchw), _arranged(w64, dtype, weight_cl)
    b = None if b64 is None else b64.to(dtype)
    ref = F.conv_transpose2d(x64, w64, b64, **layer.kwargs())
    blocks = [torch.full(ref.shape, float("nan"), dtype=dtype, device="cuda") for _ in range(3)]
    del blocks
    with tuning.pinned({} if variant is None else {"forward": variant}), launch.watch() as seen, torch.no_grad():
        y = ct.conv_transpose2d(x if x_view is None else x_view(x), w, b, **layer.kwargs())
        torch.cuda.synchronize()
    magnitude = F.conv_transpose2d(x64.abs(), w64.abs(), None if b64 is None else b64.abs(), **layer.kwargs())
    theirs = F.conv_transpose2d(x, w, b, **layer.kwargs())
    _check_near_float64(y, theirs, ref, magnitude, dtype, "forward")
    assert y.stride() == theirs.stride()   # torch's memory format
    return y, seen


@pytest.mark.parametrize("name,dtype,block,weight_cl", FORWARD_CASES)
def test_every_forward_block_matches_float64(name, dtype, block, weight_cl, ampere_or_newer):
    layer = LAYERS[name]
    variant = Variant.make("grouped_mma", tile=f"{block[0]}x{block[1]}")
    _, seen = _forward(layer, dtype, weight_cl, 20 + list(LAYERS).index(name), variant)
    plans = [plan for _, plan in seen if plan.spec.function == FORWARD]
    assert len(plans) == 1, [plan.spec.function for _, plan in seen]
    constants = dict(plans[0].spec.constants)
    assert (constants["GROUPS_PER_BLOCK"], constants["SEGQ"]) == block
    assert constants["WEIGHT_CL"] == weight_cl and constants["HAS_BIAS"] == layer.bias


def test_forward_rows_no_tap_reaches_hold_the_bias(ampere_or_newer):
    """Stride 2 with dilation 2 leaves every other output row without a tap: those rows are the bias alone."""
    layer = dataclasses.replace(LAYERS["dilated_3x5"], bias=True)
    y, _ = _forward(layer, torch.bfloat16, False, 30, Variant("grouped_mma"))
    b = _data(layer, 30)[2].to(torch.bfloat16)
    assert torch.equal(y[:, :, 0::2], b.view(1, -1, 1, 1).expand_as(y[:, :, 0::2]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_forward_runs_the_direct_kernel(dtype, ampere_or_newer):
    _, seen = _forward(LAYERS["six_groups"], dtype, False, 31, Variant("grouped_mma"), x_view=_one_element_off)
    functions = {plan.spec.function for _, plan in seen}
    assert "conv_transpose2d_forward_nhwc" in functions and FORWARD not in functions


def test_the_heuristic_runs_the_forward(ampere_or_newer, untuned):
    """Untuned, a channels_last 16-bit layer of 8 input channels a group runs the grouped mma forward."""
    layer = LAYERS["twelve_groups"]
    g = _geometry(layer, False)
    assert table.candidates("forward", g, "float16", "nhwc", "strict", ampere_or_newer)[0] == Variant("grouped_mma")
    _, seen = _forward(layer, torch.float16, False, 32)
    assert any(plan.spec.function == FORWARD for _, plan in seen)



GRAD_INPUT_CASES = [pytest.param(name, dtype, block, weight_cl,
                                 id=f"{name}-{SHORT[dtype]}-{block[0]}x{block[1]}-{'wcl' if weight_cl else 'w'}")
                    for i, name in enumerate(LAYERS) for dtype in (torch.float16, torch.bfloat16)
                    for j, block in enumerate(grouped_mma.grad_input_blocks(_geometry(LAYERS[name], False)))
                    for weight_cl in ((i + j + (dtype == torch.bfloat16)) % 2 == 0,)]


@pytest.mark.parametrize("name,dtype,block,weight_cl", GRAD_INPUT_CASES)
def test_every_grad_input_block_matches_float64(name, dtype, block, weight_cl, ampere_or_newer):
    layer = LAYERS[name]
    variant = Variant.make("grouped_mma", tile=f"{block[0]}x{block[1]}")
    _, seen = _run(layer, dtype, weight_cl, 40 + list(LAYERS).index(name), variant, pass_="grad_input")
    plans = [plan for _, plan in seen if plan.spec.function == GRAD_INPUT]
    assert len(plans) == 1, [plan.spec.function for _, plan in seen]
    constants = dict(plans[0].spec.constants)
    assert (constants["GROUPS_PER_BLOCK"], constants["SEG"]) == block
    assert constants["WEIGHT_CL"] == weight_cl


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_grad_output_runs_the_direct_grad_input(dtype, ampere_or_newer):
    """grad_output one element off a 16-byte boundary cannot feed the 16-byte copies: the direct kernel runs."""
    layer = LAYERS["twelve_groups"]
    x64, w64, _, go64 = _data(layer, 50)
    x, w = _arranged(x64, dtype).requires_grad_(), w64.to(dtype)
    with tuning.pinned({"grad_input": Variant("grouped_mma")}), launch.watch() as seen:
        ct.conv_transpose2d(x, w, None, **layer.kwargs()).backward(_one_element_off(_arranged(go64, dtype)))
        torch.cuda.synchronize()
    functions = {plan.spec.function for _, plan in seen}
    assert "conv_transpose2d_grad_input_nhwc" in functions and GRAD_INPUT not in functions
    ref = _grads(F.conv_transpose2d, x64, w64, None, go64, layer)[0]
    magnitude = _grads(F.conv_transpose2d, x64.abs(), w64.abs(), None, go64.abs(), layer)[0]
    theirs = _grads(F.conv_transpose2d, x.detach(), w, None, _arranged(go64, dtype), layer)[0]
    _check_near_float64(x.grad, theirs, ref, magnitude, dtype, "grad_input")


def test_the_heuristic_runs_grad_input(ampere_or_newer, untuned):
    """Untuned, a channels_last 16-bit layer of 8 input channels a group runs the grouped mma grad_input."""
    layer = LAYERS["six_groups"]
    g = _geometry(layer, False)
    assert table.candidates("grad_input", g, "float16", "nhwc", "strict", ampere_or_newer)[0] == Variant("grouped_mma")
    _, seen = _run(layer, torch.float16, False, 51)
    assert any(plan.spec.function == GRAD_INPUT for _, plan in seen)


NCHW_CASES = [pytest.param(name, dtype, id=f"{name}-{SHORT[dtype]}")
              for name in LAYERS for dtype in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("name,dtype", NCHW_CASES)
def test_nchw_layers_run_on_channels_last_copies(name, dtype, ampere_or_newer):
    """NCHW x, grad_output and weight: the forward reads a channels_last copy of x and writes NCHW output, grad_input
    and grad_weight read one shared copy of grad_output (grad_weight a copy of x too), grad_input is written NCHW;
    every block of every pass against float64.  (A channels_last weight makes torch's output channels_last.)"""
    layer = LAYERS[name]
    seed = 60 + list(LAYERS).index(name)
    g = _geometry(layer, False)
    for i, block in enumerate(grouped_mma.forward_blocks(g)):
        _, seen = _forward(layer, dtype, False, seed, Variant.make("grouped_mma", tile=f"{block[0]}x{block[1]}"),
                           nchw=True)
        plans = [plan for _, plan in seen if plan.spec.function == FORWARD]
        assert len(plans) == 1 and dict(plans[0].spec.constants)["OUT_NCHW"] is True
        assert [stage for stage, _ in seen] == ["to_channels_last", "main"]
    blocks = zip(grouped_mma.grad_input_blocks(g), grouped_mma.blocks(g))
    for i, (gi_block, gw_block) in enumerate(blocks):
        pins = {"grad_input": Variant.make("grouped_mma", tile=f"{gi_block[0]}x{gi_block[1]}"),
                "grad_weight": Variant.make("grouped_mma", tile=f"{gw_block[0]}x{gw_block[1]}")}
        _, seen = _run(layer, dtype, False, seed + i, pins, nchw=True)
        functions = [plan.spec.function for _, plan in seen]
        gi_plans = [plan for _, plan in seen if plan.spec.function == GRAD_INPUT]
        assert len(gi_plans) == 1 and dict(gi_plans[0].spec.constants)["OUT_NCHW"] is True, functions
        assert functions.count(FUNCTION) == 1, functions
        # one copy of grad_output for both passes (a forward on the GEMMs copies x too)
        go_copy = gemm.plan_grad_weight_sources(g, NAMES[dtype])[1]
        assert sum(plan is go_copy for _, plan in seen) == 1, functions
