"""Hopper's wgmma forward and grad_input on an sm_90 GPU, against float64.

Each case pins its pass (the forward, or grad_input through ``cupyconv::_conv_transpose2d_grad``)
to a wgmma variant (``tuning.pinned``) and checks, through ``launch.watch()``, that
``conv_transpose2d_wgmma`` is what ran.  The output must be finite, no worse than twice torch's
own error on the same fp16/bf16 inputs (the relative norm of the difference from a float64
computation on those very inputs), and every element must lie within a bound of its float64
value.  Before each call the caching allocator's free blocks of the output's size are filled
with NaN, so an element the kernel never writes cannot pass.  Skipped (with the reason) on
GPUs other than sm_90: the kernels are sm_90a code.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

import cupyconv  # noqa: E402
import cupyconv.torch as ct  # noqa: E402
from cupyconv import bench, tuning  # noqa: E402
from cupyconv.core import device as core_device  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402
from cupyconv.jit import compiler  # noqa: E402
from cupyconv.plans import launch, table, wgmma  # noqa: E402
from cupyconv.plans.launch import cdiv  # noqa: E402
from cupyconv.tuning import Variant  # noqa: E402

from layers import Layer, tensor_core_layers  # noqa: E402
from tf32 import round_tf32  # noqa: E402

FUNCTION = "conv_transpose2d_wgmma"
WGMMA = Variant("wgmma")
NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "tf32"}
# float32 cases run at TF32 precision (torch's default for convolutions), whose inputs keep 10 mantissa bits
EPS = {torch.float16: torch.finfo(torch.float16).eps, torch.bfloat16: torch.finfo(torch.bfloat16).eps,
       torch.float32: 2.0 ** -10}
# strict float32 runs as 3xTF32: each product misses its residuals' product and their roundings, about 3 x 2^-22 of
# it at worst, and fp32 adds the steps' sums
STRICT_EPS = 2.0 ** -20
# grad_weight sums every image's pixels (thousands of terms, each K tile's sum added in fp32), whose rounding errors
# alone reach 2^-20 of the terms' magnitudes; the norm check (twice torch's error) is the accuracy test there
STRICT_WEIGHT_EPS = 2.0 ** -16


@pytest.fixture(scope="module", autouse=True)
def hopper():
    """The device's facts; the whole module skips, with the reason, on anything but sm_90."""
    dev = core_device.get(torch.cuda.current_device())
    if dev.arch != "90":
        pytest.skip(f"the wgmma kernels are sm_90a code, for sm_90 GPUs only; this GPU ({dev.name}) is "
                    f"sm_{dev.arch}")
    return dev


@dataclass(frozen=True)
class Case:
    layer: Layer
    dtype: torch.dtype
    channels_last: bool                  # x channels_last (a batched x; an unbatched one follows the weight)
    variant: Variant = WGMMA
    weight_channels_last: bool = False
    pass_: str = "forward"               # or "grad_input"
    strict: bool = False                 # float32 at full precision (3xTF32), TF32 otherwise

    @property
    def layout(self) -> str:
        """The layout cupyconv runs, as torch picks the output's memory format (an input of one pixel or
        one channel is contiguous in both; an unbatched one follows the weight)."""
        x, w = (torch.empty(s, dtype=self.dtype, device="meta") for s in (self.layer.input_shape,
                                                                           self.layer.weight_shape))
        return ct._layout_for(*self.arrange(x, w))

    def arrange(self, x, w):
        """x and the weight in the memory formats of this case."""
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.weight_channels_last:
            w = w.contiguous(memory_format=torch.channels_last)
        return x, w

    @property
    def geometry(self):
        """The layer as the call runs its pass: a weight left channels_last is read in place, and grad_weight is
        written in torch's memory format for it (channels_last beside a channels_last x)."""
        x, w = self.arrange(*(torch.empty(s, dtype=self.dtype, device="meta") for s in (self.layer.input_shape,
                                                                                       self.layer.weight_shape)))
        weight_channels_last = ct._is_channels_last(w)
        if self.pass_ == "grad_weight":
            told = ct._grad_weight_layout(self.layout, x, w, weight_channels_last)
            weight_channels_last = weight_channels_last if told is None else told
        return geometry(self.layer.input_shape, self.layer.weight_shape, None,
                        ConvParams.from_args(**self.layer.kwargs())).with_weight_channels_last(weight_channels_last)

    @property
    def precision(self) -> str:
        return "tf32" if self.dtype == torch.float32 and not self.strict else "strict"

    @property
    def eps(self) -> float:
        if self.strict:
            return STRICT_WEIGHT_EPS if self.pass_ == "grad_weight" else STRICT_EPS
        return EPS[self.dtype]

    def plan(self, dev, aligned=True):
        return table.plan(self.pass_, self.variant, self.geometry, NAMES[self.dtype], self.layout, self.precision,
                          self.layer.bias and self.pass_ == "forward", aligned, dev.sm_count)

    def id(self, prefix) -> str:
        kind = "fp32" if self.strict else SHORT[self.dtype]
        return "-".join([prefix, kind, self.layout] + [self.variant.name] * (self.variant != WGMMA))


def _params(prefix, cases):
    return [pytest.param(c, id=c.id(f"{prefix}{i}" if len(cases) > 1 else prefix)) for i, c in enumerate(cases)]


# ------------------------------------------------------------------------------ the cases

IN_PER_GROUP = (16, 24, 40, 64, 72, 136, 200)
OUT_PER_GROUP = (16, 24, 40, 64, 72, 136, 264)


def wgmma_layers(count: int, seed: int):
    """Random layers the wgmma kernels run: whole 16-byte channel groups, at least 16 channels a group."""
    return tensor_core_layers(count, seed, IN_PER_GROUP, OUT_PER_GROUP, groups=(1, 1, 2, 3))


# every dtype and layout on every layer would compile four times the kernels: each layer takes one
# combination in turn, so each of the four covers a quarter of the layers
ROTATION = [(torch.float16, False), (torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)]
SWEEP = [Case(layer, *ROTATION[i % 4]) for i, layer in enumerate(wgmma_layers(32, seed=11))]


def _suite_layer(name, batch, size) -> Layer:
    s = next(layer for layer in bench.SUITE if layer.name == name)
    return Layer(batch, s.in_channels, s.out_channels, s.kernel, s.stride, s.padding, s.output_padding, s.dilation,
                 s.groups, s.bias, size, "")


# The five dense layers of the benchmark suite at a smaller batch and size (dcgan_up keeps its
# 8 x 8 phase grid, and a batch of 6 that four images a tile do not divide).
SUITE = {"asym_kernel": (2, (24, 40)), "dcgan_up": (6, (8, 8)), "unet_up2x2": (2, (20, 24)),
         "big_square": (2, (40, 48)), "outpad_up3x": (2, (20, 24))}


def _suite_cases():
    cases = []
    for name, (batch, size) in SUITE.items():
        layer = _suite_layer(name, batch, size)
        g = Case(layer, torch.float16, False).geometry
        for i, opts in enumerate(wgmma.options(g)):
            dtype, channels_last = ROTATION[i % 4]
            variant = Variant.make("wgmma", **opts)
            cases.append(pytest.param(Case(layer, dtype, channels_last, variant),
                                      id=f"{name}-{variant.name}-{SHORT[dtype]}-{'nhwc' if channels_last else 'nchw'}"))
    return cases


SUITE_CASES = _suite_cases()

# Every tile of the family, wanted or not, on a layer whose phase grid spans several patches (so
# the multi-image tiles cover several images and several patches of each) with 136 output
# channels (N tiles past the channels at every width).
EVERY_TILE_LAYER = Layer(5, 64, 136, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), 1, True, (11, 19), "")
TILE_CASES = [pytest.param(Case(EVERY_TILE_LAYER, dtype, dtype == torch.float16, Variant.make("wgmma", tile=name)),
                           id=f"{name}-{SHORT[dtype]}")
              for name in sorted(wgmma.TILES) for dtype in (torch.float16, torch.bfloat16)]

# Every depth of the weight ring, on layers of one patch, of a few, and of many patches a
# persistent block walks one after another (9 phases x 3 N tiles leave 4 blocks for 12 patches on
# an H100), through phases whose grids are smaller than the first one's.
RING_LAYERS = {"one_patch": Layer(1, 64, 64, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), 1, True, (6, 6), ""),
               "three_patches": Layer(3, 128, 72, (2, 2), (2, 2), (0, 0), (0, 0), (1, 1), 1, False, (4, 4), ""),
               "persistent": Layer(3, 64, 264, (3, 3), (3, 3), (1, 1), (0, 1), (1, 1), 1, True, (20, 19), "")}
RING_CASES = [pytest.param(Case(layer, dtype, dtype == torch.bfloat16, Variant.make("wgmma", stages=s)),
                           id=f"{name}-stages{s}-{SHORT[dtype]}")
              for name, layer in RING_LAYERS.items() for s in wgmma.STAGE_CHOICES
              for dtype in (torch.float16, torch.bfloat16)]


# Outputs that no tap reaches: the bias alone (or exactly zero without one).
NO_TAP_LAYERS = {
    # a 4 x 4 kernel at stride 4: one tap a phase, and output_padding rows and columns past the input
    "k4_s4_op3": Layer(2, 64, 48, (4, 4), (4, 4), (0, 0), (3, 1), (1, 1), 1, True, (3, 5), ""),
    # a 2 x 3 kernel at stride 3 x 4: phases with no tap at all
    "empty_phases": Layer(2, 16, 40, (2, 3), (3, 4), (0, 0), (2, 3), (1, 1), 1, True, (5, 6), ""),
    # 1 x 1 at stride 3 x 2: every phase but the first is empty
    "k1_gaps": Layer(1, 32, 32, (1, 1), (3, 2), (0, 0), (2, 1), (1, 1), 1, True, (7, 6), ""),
}
NO_TAP_CASES = [pytest.param(Case(replace(layer, bias=bias), dtype, channels_last),
                             id=f"{name}-{'bias' if bias else 'nobias'}-{SHORT[dtype]}-"
                                f"{'nhwc' if channels_last else 'nchw'}")
                for name, layer in NO_TAP_LAYERS.items() for bias in (True, False)
                for dtype, channels_last in ROTATION[:2] + ROTATION[2:] * (not bias)]

UNBATCHED = Layer(None, 64, 72, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1, True, (9, 13), "")
UNBATCHED_CASES = [pytest.param(Case(UNBATCHED, dtype, False, weight_channels_last=wcl),
                                id=f"{SHORT[dtype]}-{'weight_channels_last' if wcl else 'contiguous'}")
                   for dtype in (torch.float16, torch.bfloat16) for wcl in (False, True)]

# batch 5 on an 8 x 8 phase grid, four images a tile: the second tile holds one image
MULTI_IMAGE = Layer(5, 32, 48, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (8, 8), "")
MULTI_IMAGE_CASES = [pytest.param(Case(MULTI_IMAGE, dtype, cl, Variant.make("wgmma", tile="4i8x8x64")),
                                  id=f"{SHORT[dtype]}-{'nhwc' if cl else 'nchw'}")
                     for dtype in (torch.float16, torch.bfloat16) for cl in (False, True)]

# asym_kernel of the suite at a smaller batch and size
ASYM_LIKE = Layer(2, 64, 128, (3, 5), (1, 1), (0, 0), (0, 0), (1, 1), 1, True, (24, 40), "")


# One-row patches (TILE_H 1) on grids under eight rows high: a 1-D-like layer (one input row; a vocoder's kernel of
# 16 at stride 8, so two taps a phase and a phase grid of 300 columns: two 256-column tiles, the second mostly past
# the row), a 2-D grid of three rows (its 3 x 3 taps read three halo rows for each one-row patch), and a grouped,
# dilated 1-D layer with output padding.
ONE_ROW_LAYERS = {
    "one_d_k16_s8": Layer(3, 64, 48, (1, 16), (1, 8), (0, 4), (0, 0), (1, 1), 1, True, (1, 300), ""),
    "three_rows_3x3_s2": Layer(2, 32, 40, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1, True, (3, 150), ""),
    "one_d_grouped_dilated": Layer(2, 96, 96, (1, 5), (1, 2), (0, 3), (0, 1), (1, 2), 2, True, (1, 200), ""),
}


# ------------------------------------------------------------------------ grad_input cases
#
# grad_input is a strided conv2d of grad_output: the kernel's source is grad_output (whole 16-byte
# groups of its channels per group, 16 or more), its destination grad_in (16 or more channels a group,
# any count: odd ones take single-element stores).

GRAD = "grad_input"
GRAD_IN_PER_GROUP = (16, 17, 20, 24, 40, 64, 72, 136)
GRAD_OUT_PER_GROUP = (16, 24, 40, 64, 72, 136, 200)


def grad_input_layers(count: int, seed: int, in_per_group=GRAD_IN_PER_GROUP, out_per_group=GRAD_OUT_PER_GROUP):
    """Random layers of the given channel counts a group (by default those whose grad_input the wgmma kernel
    runs), groups 1 to 3, no bias."""
    return tensor_core_layers(count, seed, in_per_group, out_per_group, groups=(1, 1, 2, 3), bias=False)


# 18 random layers, then stride 3 with a 3 x 3 kernel, and a dilation of 2 at stride 3 x 2 (the three
# kernel rows read three different row phases) with 17 grad_in channels in each of three groups
GRAD_LAYERS = grad_input_layers(18, seed=23) + [
    Layer(2, 32, 40, (3, 3), (3, 3), (1, 1), (2, 2), (1, 1), 1, False, (10, 13), ""),
    Layer(3, 51, 48, (3, 2), (3, 2), (2, 1), (1, 1), (2, 2), 3, False, (7, 9), ""),
]
GRAD_SWEEP = [Case(layer, *ROTATION[i % 4], pass_=GRAD) for i, layer in enumerate(GRAD_LAYERS)]


def _grad_suite_cases():
    """Every grad_input option of the five suite layers at their smaller sizes; the few whose halo planes
    cannot fit shared memory (outpad_up3x's 32 x 16 patches at stride 3) plan nothing and are no candidates."""
    cases = []
    for name, (batch, size) in SUITE.items():
        layer = _suite_layer(name, batch, size)
        g = Case(layer, torch.float16, False).geometry
        for i, opts in enumerate(wgmma.options(g, GRAD)):
            dtype, channels_last = ROTATION[i % 4]
            variant = Variant.make("wgmma", **opts)
            tile = wgmma.TILES.get(opts.get("tile"))
            try:
                wgmma.plan_grad_input(g, NAMES[dtype], "nhwc", tile, opts.get("stages"))
            except ValueError:
                continue
            cases.append(pytest.param(Case(layer, dtype, channels_last, variant, pass_=GRAD),
                                      id=f"{name}-{variant.name}-{SHORT[dtype]}-{'nhwc' if channels_last else 'nchw'}"))
    return cases


GRAD_SUITE_CASES = _grad_suite_cases()

GRAD_UNBATCHED_CASES = [pytest.param(Case(replace(UNBATCHED, bias=False), dtype, False, weight_channels_last=wcl,
                                          pass_=GRAD),
                                     id=f"{SHORT[dtype]}-{'weight_channels_last' if wcl else 'contiguous'}")
                        for dtype in (torch.float16, torch.bfloat16) for wcl in (False, True)]



# ----------------------------------------------------------- a channels_last weight read in place
#
# fp16 and bf16 kernels read a channels_last weight in place: the forward's B an MN-major operand in one, two or
# four 64-channel column blocks, grad_input's K-major swizzled rows (a 64-channel chunk) or the pack's planes (a
# narrower one).  Every option that reads it so, on a layer with 136 output channels (N tiles past them, a K chunk
# past them for grad_input) and on a grouped one with 72 a group; dtypes and layouts in turn.
IN_PLACE_LAYERS = {"wide": Layer(2, 64, 136, (3, 3), (2, 2), (1, 1), (1, 0), (1, 1), 1, True, (9, 13), ""),
                   "grouped": Layer(2, 128, 144, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 2, True, (7, 9), "")}


def _in_place_cases():
    cases = []
    for name, layer in IN_PLACE_LAYERS.items():
        for pass_ in ("forward", GRAD):
            layer_p = layer if pass_ == "forward" else replace(layer, bias=False)
            g = Case(layer_p, torch.float16, False, weight_channels_last=True).geometry
            for i, opts in enumerate(wgmma.options(g, pass_)):
                dtype, channels_last = ROTATION[i % 4]
                case = Case(layer_p, dtype, channels_last, Variant.make("wgmma", **opts), weight_channels_last=True,
                            pass_=pass_)
                try:
                    plan = table.plan(pass_, case.variant, case.geometry, NAMES[dtype], case.layout, "strict",
                                      layer_p.bias, True)
                except ValueError:   # a tile whose halo does not fit
                    continue
                if plan.pack is None:
                    cases.append(pytest.param(case, id=f"{name}-{pass_}-{case.variant.name}-{SHORT[dtype]}-"
                                                       f"{case.layout}"))
    return cases


IN_PLACE_CASES = _in_place_cases()
assert len(IN_PLACE_CASES) >= 12

@pytest.fixture(scope="module", autouse=True)
def precompiled(hopper, request):
    """Build the kernels of every selected case side by side (NVRTC runs without the GIL) rather than one
    by one at each first call.  A kernel that fails to build here builds again, and raises, in its test."""
    cases = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None \
                and isinstance(callspec.params.get("case"), Case):
            cases.append(callspec.params["case"])
    cases += [Case(ASYM_LIKE, torch.float16, cl, tuning.Variant("wgmma")) for cl in (False, True)]
    cases += [Case(ASYM_LIKE, torch.float16, cl, tuning.Variant("wgmma"), pass_=GRAD) for cl in (False, True)]
    specs = []
    for case in cases:
        try:
            specs += [p.spec for p in case.plan(hopper).plans()]
        except Exception:  # noqa: BLE001 - the case's own test reports it
            pass
    try:
        compiler.compile_many(specs, hopper.index, workers=16)
    except Exception:  # noqa: BLE001 - as above
        pass


# ---------------------------------------------------------------------------- the check

def _data(layer: Layer, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(layer.input_shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
    w = torch.randn(layer.weight_shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
    b = torch.randn(layer.out_channels, generator=gen, device="cuda", dtype=torch.float64).to(dtype) \
        if layer.bias else None
    return x, w, b


def _poison(shape, dtype):
    """Fill the caching allocator's free blocks of the output's size with NaN, so unwritten outputs show."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for _ in range(3)]
    del blocks


def _rel(got, ref) -> float:
    return float(torch.linalg.vector_norm(got.double() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-300))


def _run_ours(case: Case, x, w, b, expect_function: Optional[str] = FUNCTION, pin=True):
    """cupyconv's output, with the (stage, plan) launches it made."""
    _poison(case.geometry.user_shape(case.geometry.output_shape), case.dtype)
    pins = tuning.pinned({"forward": case.variant}) if pin else contextlib.nullcontext()
    with torch.no_grad(), pins, launch.watch() as seen:
        y = ct.conv_transpose2d(x, w, b, **case.layer.kwargs())
        torch.cuda.synchronize()
    functions = [plan.spec.function for _, plan in seen]
    if expect_function is not None:
        assert expect_function in functions, f"{expect_function} did not run: {functions}"
    return y, seen


def _inputs(case: Case, x, w, b):
    x, w = case.arrange(x, w)
    assert ct._layout_for(x, w) == case.layout
    return x, w, b


def _compare(case: Case, y, x, w, b):
    """Finite, every element near float64, and no worse than twice torch's error on the same inputs."""
    kwargs = case.layer.kwargs()
    dbl = (lambda t: None if t is None else t.double())
    ref = F.conv_transpose2d(dbl(x), dbl(w), dbl(b), **kwargs)
    magnitude = F.conv_transpose2d(x.double().abs(), w.double().abs(), None if b is None else b.double().abs(),
                                   **kwargs)
    theirs = F.conv_transpose2d(x, w, b, **kwargs)
    floor = None
    if case.precision == "tf32":
        floor = F.conv_transpose2d(round_tf32(x), round_tf32(w), dbl(b), **kwargs)
    _near_float64(case, y, ref, magnitude, theirs, floor)


def _near_float64(case: Case, y, ref, magnitude, theirs, tf32_exact=None):
    """``tf32_exact``: for TF32, the exact result on TF32-rounded operands.  cuDNN may run a float32 layer without
    TF32 even where it is allowed, so torch's error is then taken as at least that result's."""
    assert y.dtype == case.dtype and y.shape == ref.shape
    if case.layout == "nhwc" and y.dim() == 4:
        assert y.is_contiguous(memory_format=torch.channels_last)
    finite = torch.isfinite(y)
    assert bool(finite.all()), f"{int((~finite).sum())} of {y.numel()} outputs not finite (unwritten?)"
    # Per element: fp32 accumulation of exact products and one rounding to the storage type stay
    # within twice the type's epsilon of the sum of the terms' magnitudes (exactly 0 where no
    # tap and no bias reaches an output).
    eps = case.eps
    bad = (y.double() - ref).abs() > 2 * eps * magnitude
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} of {y.numel()} outputs off, first at {where}: "
                             f"{float(y[where])} vs {float(ref[where])} (magnitude {float(magnitude[where])})")
    ours, torchs = _rel(y, ref), _rel(theirs, ref)
    if tf32_exact is not None:
        torchs = max(torchs, _rel(tf32_exact, ref))
    assert ours <= 2 * torchs + 1e-6, f"error {ours:.3e} vs torch's {torchs:.3e}"


def _check(case: Case, seed=0, hopper=None):
    x, w, b = _inputs(case, *_data(case.layer, case.dtype, seed))
    y, seen = _run_ours(case, x, w, b)
    if hopper is not None:
        planned = case.plan(hopper).plans()
        assert {p for _, p in seen} == set(planned), "the pinned variant launched other kernels"
    _compare(case, y, x, w, b)
    return y


# ------------------------------------------------------------------------------ the tests

@pytest.mark.parametrize("case", _params("sweep", SWEEP))
def test_random_layers_match_float64(case, hopper):
    assert wgmma.eligible(case.geometry, NAMES[case.dtype])
    _check(case, seed=SWEEP.index(case), hopper=hopper)


@pytest.mark.parametrize("case", SUITE_CASES)
def test_every_option_of_the_suite_layers(case, hopper):
    _check(case, hopper=hopper)


@pytest.mark.parametrize("case", TILE_CASES)
def test_every_tile(case, hopper):
    _check(case, hopper=hopper)


@pytest.mark.parametrize("case", RING_CASES)
def test_every_weight_ring_depth(case, hopper):
    main = case.plan(hopper).gemm
    if case.layer is RING_LAYERS["persistent"]:
        g = case.geometry
        tile = wgmma.forward_tile(g)
        patches = g.batch * cdiv(cdiv(g.out_size[0], 3), tile.tile_h) * cdiv(cdiv(g.out_size[1], 3), tile.tile_w)
        assert main.grid[0] < patches, "each block walks several patches"
    _check(case, hopper=hopper)


@pytest.mark.parametrize("case", NO_TAP_CASES)
def test_outputs_no_tap_reaches(case, hopper):
    g = case.geometry
    if case.layer.kernel[0] < case.layer.stride[0]:
        assert any(not (r and c) for r, c in wgmma.phase_offsets(g)), "phases without taps"
    y = _check(case, hopper=hopper)
    if not case.layer.bias:
        # output_padding rows past the input (or empty phases) hold exact zeros
        sh = case.layer.stride[0]
        kernel_rows = (case.layer.size[0] - 1) * sh + case.layer.kernel[0]
        assert bool((y[:, :, kernel_rows:] == 0).all())


@pytest.mark.parametrize("case", UNBATCHED_CASES)
def test_unbatched_input(case, hopper):
    y = _check(case, hopper=hopper)
    assert y.dim() == 3


@pytest.mark.parametrize("case", MULTI_IMAGE_CASES)
def test_several_images_a_tile_with_a_batch_they_do_not_divide(case, hopper):
    g = case.geometry
    assert g.batch % 4 and (cdiv(g.out_size[0], 2), cdiv(g.out_size[1], 2)) == (8, 8)
    assert wgmma.forward_tile(g).name == "4i8x8x64"
    _check(case, hopper=hopper)
    # the heuristic takes the same tile here
    _check(replace(case, variant=WGMMA), seed=1, hopper=hopper)


def _one_element_off(t):
    """A channels_last copy of ``t`` that starts one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
    off = torch.as_strided(flat, t.shape, t.stride(), 1)
    off.copy_(t)
    assert off.data_ptr() % 16 and off.is_contiguous(memory_format=torch.channels_last)
    return off


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_channels_last_runs_the_gemm(dtype, hopper):
    """A channels_last view that starts off a 16-byte boundary cannot feed the halo copies: the mma.sync GEMM
    runs instead, pinned wgmma or not."""
    case = Case(ASYM_LIKE, dtype, True)
    x, w, b = _inputs(case, *_data(case.layer, dtype, 5))
    xu = _one_element_off(x)
    y, seen = _run_ours(case, xu, w, b, expect_function="conv_transpose2d_igemm")
    assert FUNCTION not in {plan.spec.function for _, plan in seen}
    assert {p for _, p in seen} == set(case.plan(hopper, aligned=False).plans())
    _compare(case, y, x, w, b)


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
def test_the_heuristic_runs_wgmma_on_sm_90(channels_last, hopper, monkeypatch):
    """Untuned, an fp16 layer like the suite's asym_kernel runs the wgmma kernel."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    try:
        case = Case(ASYM_LIKE, torch.float16, channels_last)
        g = case.geometry
        assert table.candidates("forward", g, "float16", case.layout, "strict", hopper)[0] == WGMMA
        x, w, b = _inputs(case, *_data(case.layer, torch.float16, 7))
        y, seen = _run_ours(case, x, w, b, pin=False)
        stages = [stage for stage, _ in seen]
        assert stages == (["pack", "main"] if channels_last else ["pack", "to_channels_last", "main"])
        assert tuning.chosen("forward", g, "float16", case.layout, "strict", hopper.index) == WGMMA
        _compare(case, y, x, w, b)
    finally:
        tuning.clear()


# ------------------------------------------------------------------------ grad_input

def _grad_data(layer: Layer, dtype, seed):
    """x (whose values grad_input does not read: only its shape and layout count), the weight and grad_output."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(layer.input_shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
    w = torch.randn(layer.weight_shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
    go_shape = layer.input_shape[:-3] + (layer.out_channels,) + layer.out_size()
    go = torch.randn(go_shape, generator=gen, device="cuda", dtype=torch.float64).to(dtype)
    return x, w, go


def _grad_inputs(case: Case, x, w, go):
    x, w = case.arrange(x, w)
    assert ct._layout_for(x, w) == case.layout
    if case.channels_last and go.dim() == 4:
        go = go.contiguous(memory_format=torch.channels_last)
    return x, w, go


def _run_grad(case: Case, go, x, w, expect_function: Optional[str] = None):
    """cupyconv's grad_input or grad_weight alone (``cupyconv::_conv_transpose2d_grad``, as the case's pass), with
    the launches it made; ``expect_function`` (default: the pass's wgmma kernel) must be among them."""
    grad_input = case.pass_ == GRAD
    if expect_function is None:
        expect_function = FUNCTION if grad_input else WEIGHT_TF32_FUNCTION if case.dtype == TF32 else WEIGHT_FUNCTION
    _poison(tuple((x if grad_input else w).shape), case.dtype)
    kw = case.layer.kwargs()
    with torch.no_grad(), tuning.pinned({case.pass_: case.variant}), launch.watch() as seen:
        grad = torch.ops.cupyconv._conv_transpose2d_grad(go, x, w, list(kw["stride"]), list(kw["padding"]),
                                                          list(kw["output_padding"]), kw["groups"],
                                                          list(kw["dilation"]), 0 if grad_input else 1)
        torch.cuda.synchronize()
    functions = [plan.spec.function for _, plan in seen]
    assert expect_function in functions, f"{expect_function} did not run: {functions}"
    if expect_function == FUNCTION:
        modes = {dict(plan.spec.constants)["MODE"] for _, plan in seen if plan.spec.function == FUNCTION}
        assert modes == {1}, "the wgmma kernel ran as grad_input"
    return grad, seen


def _torch_grad(pass_, go, x, w, kwargs):
    """torch's grad_input (GRAD) or grad_weight (WEIGHT) of conv_transpose2d(x, w) for grad_output ``go``: linear
    in go and in the operand it is not taken against."""
    x, w = x.detach(), w.detach()
    if pass_ == GRAD:
        x = x.clone().requires_grad_()
    else:
        w = w.clone().requires_grad_()
    with torch.enable_grad():
        y = F.conv_transpose2d(x, w, None, **kwargs)
        (grad,) = torch.autograd.grad(y, x if pass_ == GRAD else w, go)
    return grad


def _compare_grad_input(case: Case, gi, go, x, w):
    kwargs = case.layer.kwargs()
    ref = _torch_grad(GRAD, go.double(), x.double(), w.double(), kwargs)
    magnitude = _torch_grad(GRAD, go.double().abs(), x.double(), w.double().abs(), kwargs)
    theirs = _torch_grad(GRAD, go, x, w, kwargs)
    floor = _torch_grad(GRAD, round_tf32(go), x.double(), round_tf32(w), kwargs) \
        if case.precision == "tf32" else None
    _near_float64(case, gi, ref, magnitude, theirs, floor)


def _pinned_grad(case: Case, seed, hopper):
    """The case's gradient pass on its data, pinned: (the gradient, grad_output, x, the weight); with ``hopper``,
    the launches must be exactly the pinned variant's plan."""
    x, w, go = _grad_inputs(case, *_grad_data(case.layer, case.dtype, seed))
    grad, seen = _run_grad(case, go, x, w)
    if hopper is not None:
        assert {p for _, p in seen} == set(case.plan(hopper).plans()), "the pinned variant launched other kernels"
    return grad, go, x, w


def _check_grad_input(case: Case, seed=0, hopper=None):
    assert case.pass_ == GRAD
    gi, go, x, w = _pinned_grad(case, seed, hopper)
    _compare_grad_input(case, gi, go, x, w)
    return gi


@pytest.mark.parametrize("case", _params("gi_sweep", GRAD_SWEEP))
def test_grad_input_random_layers_match_float64(case, hopper):
    assert wgmma.eligible(case.geometry, NAMES[case.dtype], GRAD)
    _check_grad_input(case, seed=100 + GRAD_SWEEP.index(case), hopper=hopper)


@pytest.mark.parametrize("case", GRAD_SUITE_CASES)
def test_every_grad_input_option_of_the_suite_layers(case, hopper):
    _check_grad_input(case, hopper=hopper)


@pytest.mark.parametrize("case", GRAD_UNBATCHED_CASES)
def test_grad_input_of_an_unbatched_input(case, hopper):
    gi = _check_grad_input(case, hopper=hopper)
    assert gi.dim() == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_channels_last_grad_output_runs_the_gemm(dtype, hopper):
    """A channels_last grad_output that starts off a 16-byte boundary cannot feed the halo copies: the mma.sync
    GEMM runs grad_input instead, pinned wgmma or not."""
    case = Case(replace(ASYM_LIKE, bias=False), dtype, True, pass_=GRAD)
    x, w, go = _grad_inputs(case, *_grad_data(case.layer, dtype, 5))
    gou = _one_element_off(go)
    gi, seen = _run_grad(case, gou, x, w, expect_function="conv_transpose2d_igemm")
    assert FUNCTION not in {plan.spec.function for _, plan in seen}
    assert {p for _, p in seen} == set(case.plan(hopper, aligned=False).plans())
    _compare_grad_input(case, gi, go, x, w)


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
def test_autograd_runs_grad_input_on_wgmma_on_sm_90(channels_last, hopper, monkeypatch):
    """Untuned, the backward of an fp16 layer like the suite's asym_kernel runs grad_input on the wgmma kernel
    (grad_output's channels_last copy shared with the GEMM's grad_weight), and x.grad is right."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    try:
        case = Case(ASYM_LIKE, torch.float16, channels_last, pass_=GRAD)
        g = case.geometry
        assert table.candidates(GRAD, g, "float16", case.layout, "strict", hopper)[0] == WGMMA
        x, w, b = _inputs(case, *_data(case.layer, torch.float16, 9))
        go = _grad_inputs(case, x, w, _grad_data(case.layer, torch.float16, 10)[2])[2]
        x.requires_grad_()
        w.requires_grad_()
        y = ct.conv_transpose2d(x, w, b, **case.layer.kwargs())
        _poison(tuple(x.shape), case.dtype)
        with launch.watch() as seen:
            y.backward(go)
            torch.cuda.synchronize()
        mains = [(plan.spec.function, dict(plan.spec.constants).get("MODE")) for stage, plan in seen
                 if stage == "main"]
        assert (FUNCTION, 1) in mains, mains
        copies = [plan for stage, plan in seen if stage == "to_channels_last"]
        # NCHW: grad_output once (shared by both gradients) and x once for grad_weight
        assert len(copies) == (0 if channels_last else 2)
        assert tuning.chosen(GRAD, g, "float16", case.layout, "strict", hopper.index) == WGMMA
        _compare_grad_input(case, x.grad, go, x.detach(), w.detach())
    finally:
        tuning.clear()


# ------------------------------------------------------------------------ TF32
#
# float32 at TF32 precision (torch's default for convolutions) runs the same kernel on wgmma's TF32 MMAs, the
# halo rounded to TF32 in shared memory and the weight when it is packed; strict float32 never does.

TF32 = torch.float32


def _tf32_cases():
    cases = [Case(layer, TF32, i % 2 == 1) for i, layer in enumerate(wgmma_layers(8, seed=31))]
    cases += [Case(layer, TF32, i % 2 == 0, pass_=GRAD) for i, layer in enumerate(grad_input_layers(8, seed=37))]
    for name, (batch, size) in SUITE.items():
        layer = _suite_layer(name, batch, size)
        for pass_, channels_last in ((p, cl) for p in ("forward", GRAD) for cl in (False, True)):
            case = Case(replace(layer, bias=layer.bias and pass_ == "forward"), TF32, channels_last, pass_=pass_)
            if wgmma.eligible(case.geometry, "float32", pass_, "tf32"):
                cases.append(case)
    cases += [Case(EVERY_TILE_LAYER, TF32, i % 2 == 0, Variant.make("wgmma", tile=name))
              for i, name in enumerate(sorted(wgmma.TILES))]
    cases += [Case(NO_TAP_LAYERS["empty_phases"], TF32, True), Case(UNBATCHED, TF32, False),
              Case(replace(UNBATCHED, bias=False), TF32, False, weight_channels_last=True, pass_=GRAD)]
    # a channels_last source copied rounded first (the ``copy`` option), both passes
    copied = Variant.make("wgmma", copy=True)
    cases += [case for case in [Case(layer, TF32, True, copied) for layer in wgmma_layers(4, seed=41)]
              + [Case(layer, TF32, True, copied, pass_=GRAD) for layer in grad_input_layers(4, seed=43)]
              if case.layout == "nhwc"]
    return cases


TF32_CASES = _tf32_cases()


@pytest.mark.parametrize("case", _params("tf32", TF32_CASES))
def test_tf32_matches_float64(case, hopper):
    """Every element within twice TF32's unit of float64 on the terms' magnitudes, and no worse than twice torch's
    error (at least that of an exact sum of TF32-rounded products)."""
    assert torch.backends.cudnn.allow_tf32, "torch's default: convolutions may use TF32"
    assert wgmma.eligible(case.geometry, "float32", case.pass_, "tf32")
    check = _check if case.pass_ == "forward" else _check_grad_input
    check(case, seed=200 + TF32_CASES.index(case), hopper=hopper)


ONE_ROW_CASES = {f"{name}-{pass_}-{SHORT[dtype]}-{'nhwc' if channels_last else 'nchw'}":
                 Case(replace(layer, bias=layer.bias and pass_ == "forward"), dtype, channels_last, pass_=pass_)
                 for name, layer in ONE_ROW_LAYERS.items() for pass_ in ("forward", GRAD)
                 for dtype, channels_last in ((torch.float16, False), (torch.bfloat16, True), (TF32, pass_ == GRAD))}


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in ONE_ROW_CASES.items()])
def test_one_row_patches_on_grids_of_few_rows(case, hopper):
    """Untuned, a destination grid under eight rows high takes one-row patches (64-pixel MMA blocks along the row);
    the forward and grad_input match float64 in fp16, bf16 and TF32, both layouts."""
    g, dtype = case.geometry, NAMES[case.dtype]
    assert wgmma.rows_few(g, case.pass_) and wgmma.eligible(g, dtype, case.pass_, case.precision)
    assert dict(case.plan(hopper).gemm.spec.constants)["TILE_H"] == 1
    check = _check if case.pass_ == "forward" else _check_grad_input
    check(case, seed=300 + list(ONE_ROW_CASES.values()).index(case), hopper=hopper)


@pytest.mark.parametrize("allow_tf32", [True, False], ids=["tf32", "strict"])
def test_float32_runs_wgmma_as_torch_allows(allow_tf32, hopper, monkeypatch):
    """Untuned, a float32 layer like the suite's asym_kernel runs its forward and grad_input on the wgmma kernel:
    as TF32 when torch allows TF32 for convolutions, as 3xTF32 when it does not (float32's accuracy); either way
    the result is right."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow_tf32)
    tuning.clear()
    try:
        # a batch of 8 at 48 x 64: tiles for most SMs, where float32 leads (wgmma.tf32_leads)
        case = Case(replace(ASYM_LIKE, batch=8, size=(48, 64)), TF32, True, strict=not allow_tf32)
        assert all(wgmma.tf32_leads(case.geometry, p) for p in ("forward", GRAD))
        x, w, b = _inputs(case, *_data(case.layer, TF32, 13))
        go = _grad_data(case.layer, TF32, 14)[2].contiguous(memory_format=torch.channels_last)
        x.requires_grad_()
        with launch.watch() as seen:
            y = ct.conv_transpose2d(x, w, b, **case.layer.kwargs())
            y.backward(go)
            torch.cuda.synchronize()
        mains = [(plan.spec.function, dict(plan.spec.constants).get("MMA_KIND")) for stage, plan in seen
                 if stage == "main"]
        assert [kind for function, kind in mains if function == FUNCTION] == [2 if allow_tf32 else 3] * 2, mains
        _compare(case, y.detach(), x.detach(), w, b)
        _compare_grad_input(replace(case, pass_=GRAD), x.grad, go, x.detach(), w)
    finally:
        tuning.clear()


# ------------------------------------------------------------------------ strict float32 (3xTF32)
#
# float32 where torch does not allow TF32 runs the same kernel as 3xTF32: the halo split into TF32 big parts and
# residuals in shared memory, the weight when it is packed, three MMAs a product and each step's sum added in fp32.

def _strict_cases():
    cases = [Case(layer, TF32, i % 2 == 0, strict=True) for i, layer in enumerate(wgmma_layers(6, seed=41))]
    cases += [Case(layer, TF32, i % 2 == 1, pass_=GRAD, strict=True)
              for i, layer in enumerate(grad_input_layers(6, seed=43))]
    for name, (batch, size) in SUITE.items():
        layer = _suite_layer(name, batch, size)
        for pass_, channels_last in ((p, cl) for p in ("forward", GRAD) for cl in (False, True)):
            case = Case(replace(layer, bias=layer.bias and pass_ == "forward"), TF32, channels_last, pass_=pass_,
                        strict=True)
            if wgmma.eligible(case.geometry, "float32", pass_, "strict"):
                cases.append(case)
    g = Case(EVERY_TILE_LAYER, TF32, False, strict=True).geometry
    cases += [Case(EVERY_TILE_LAYER, TF32, i % 2 == 0, Variant.make("wgmma", tile=t.name), strict=True)
              for i, t in enumerate(sorted(wgmma.split_tiles(g), key=lambda t: t.name))]
    cases += [Case(NO_TAP_LAYERS["empty_phases"], TF32, True, strict=True), Case(UNBATCHED, TF32, False, strict=True),
              Case(replace(UNBATCHED, bias=False), TF32, False, weight_channels_last=True, pass_=GRAD, strict=True)]
    return cases


STRICT_CASES = _strict_cases()
assert len(STRICT_CASES) >= 30


@pytest.fixture
def strict_float32(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("case", _params("strict", STRICT_CASES))
def test_strict_float32_matches_float64(case, hopper, strict_float32):
    """3xTF32: every element within 2^-19 of float64 on the terms' magnitudes, and no worse than twice torch's
    strict float32 error (plus 1e-6 of the result's norm)."""
    assert wgmma.eligible(case.geometry, "float32", case.pass_, "strict")
    plan = case.plan(hopper)
    assert dict(plan.gemm.spec.constants)["MMA_KIND"] == 3
    assert plan.pack is None or dict(plan.pack.spec.constants)["SPLIT_TF32"]
    check = _check if case.pass_ == "forward" else _check_grad_input
    check(case, seed=400 + STRICT_CASES.index(case), hopper=hopper)


@pytest.mark.parametrize("where", ["input", "grad_output"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "minus_inf"])
def test_strict_float32_non_finite_values_as_torch(where, value, hopper, strict_float32):
    """A NaN or Inf in the source reaches exactly the outputs it reaches in torch, with torch's sign: the split
    carries it in the residual part alone, so no cross term multiplies it by a zero residual."""
    layer = replace(ASYM_LIKE, bias=False)
    pass_ = "forward" if where == "input" else GRAD
    case = Case(layer, TF32, True, pass_=pass_, strict=True)
    x, w, go = _grad_inputs(case, *_grad_data(layer, TF32, 17))
    source = x if where == "input" else go
    source[(0, 3) + tuple(s // 2 for s in source.shape[2:])] = value
    kwargs = layer.kwargs()
    if where == "input":
        got, _ = _run_ours(case, x, w, None)
        want = F.conv_transpose2d(x.double(), w.double(), None, **kwargs)
    else:
        got, _ = _run_grad(case, go, x, w)
        want = _torch_grad(GRAD, go.double(), x.double(), w.double(), kwargs)
    got = got.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN where torch has NaN"
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and bool((got[torch.isinf(want)]
                                                                     == want[torch.isinf(want)]).all())
    assert int(torch.isnan(want).sum() + torch.isinf(want).sum()) > 0
    finite = torch.isfinite(want)
    assert _rel(got[finite], want[finite]) <= 1e-6


# ------------------------------------------------------------------------ split K
#
# A weight-bound grid (few tiles, long K) splits its input-channel chunks into ranges: each block writes fp32
# partials without the bias, and the reduce adds them in order, then the bias.

SPLIT_LAYERS = {
    # five chunks of 64 channels in 16 bits (ten of 32 in TF32): ranges of 3 + 2, and at four ranges 2 + 2 + 1 and
    # an empty one, whose partials are zeros
    "five_chunks": Layer(2, 320, 72, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (8, 8), ""),
    # grouped, with stride phases no tap reaches: three chunks a group
    "grouped_empty_phases": Layer(2, 272, 80, (2, 3), (3, 4), (0, 0), (0, 0), (1, 1), 2, True, (6, 5), ""),
}
GRAD_SPLIT_LAYERS = {
    "five_chunks": Layer(2, 72, 320, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1, False, (7, 9), ""),
    "grouped_empty_phases": Layer(2, 80, 272, (2, 3), (3, 4), (0, 0), (0, 0), (1, 1), 2, False, (6, 5), ""),
}
SPLIT_KINDS = [(torch.float16, False), (torch.bfloat16, False), (TF32, False), (TF32, True)]


def _split_cases():
    cases = []
    for pass_, layers in (("forward", SPLIT_LAYERS), (GRAD, GRAD_SPLIT_LAYERS)):
        for name, layer in layers.items():
            splits = (2, 4) if name == "five_chunks" else (2, 3)
            for i, ((dtype, strict), split) in enumerate((k, s) for k in SPLIT_KINDS for s in splits):
                case = Case(layer, dtype, i % 2 == 0, Variant.make("wgmma", split=split), pass_=pass_, strict=strict)
                cases.append(pytest.param(case, id=f"{pass_}-{name}-{case.id('')[1:]}"))
        # a 16-bit channels_last weight read in place
        case = Case(layers["five_chunks"], torch.float16, True, Variant.make("wgmma", split=2),
                    weight_channels_last=True, pass_=pass_)
        cases.append(pytest.param(case, id=f"{pass_}-in_place-{case.id('')[1:]}"))
    return cases


SPLIT_CASES = _split_cases()


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_k_matches_float64(case, hopper, request):
    """Forced K ranges, even, uneven and empty: the partial kernel and the reduce are exactly the planned launches,
    and the result matches float64 as the unsplit kernel's does (bias added once, after the ranges)."""
    if case.strict:
        request.getfixturevalue("strict_float32")
    plan = case.plan(hopper)
    split = case.variant.kwargs["split"]
    assert dict(plan.gemm.spec.constants)["SPLIT_K"] == split and plan.gemm.grid[2] % split == 0
    assert plan.reduce is not None and plan.reduce.spec.function == "reduce_partials_bias"
    if case.weight_channels_last:
        assert plan.pack is None, "the weight is read in place"
    check = _check if case.pass_ == "forward" else _check_grad_input
    check(case, seed=500 + [p.values[0] for p in SPLIT_CASES].index(case), hopper=hopper)


PIX2PIX_8 = Layer(16, 1024, 512, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (8, 8), "")
MODEL_SPLIT_CASES = [
    Case(PIX2PIX_8, TF32, False),                                        # the heuristic: 2 ranges
    Case(replace(PIX2PIX_8, bias=False), TF32, False, pass_=GRAD),       # the heuristic: 4 ranges
    Case(PIX2PIX_8, torch.bfloat16, True, Variant.make("wgmma", tile="2i8x8x256", split=2), weight_channels_last=True),
]


@pytest.mark.parametrize("case", _params("pix2pix_8", MODEL_SPLIT_CASES))
def test_split_k_at_a_models_size(case, hopper):
    """pix2pix's 16 x 1024 x 8² layer, whose TF32 passes split K untuned: partials of a million elements or more,
    which the reduce adds in runs of four, bias included."""
    plan = case.plan(hopper)
    assert dict(plan.gemm.spec.constants)["SPLIT_K"] > 1 and dict(plan.reduce.spec.constants)["VEC"] == 4
    check = _check if case.pass_ == "forward" else _check_grad_input
    check(case, seed=600 + MODEL_SPLIT_CASES.index(case), hopper=hopper)


# ------------------------------------------------------------------------ thin destinations
#
# Fewer than 16 output channels a group take N tiles of 8 and 16 in the fp16/bf16 forward: an RGB output layer.

RGB = Layer(3, 64, 3, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (20, 18), "")


def _thin_cases():
    kinds = [(torch.float16, False), (torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)]
    cases = [Case(RGB, dtype, cl) for dtype, cl in kinds]
    cases += [Case(RGB, dtype, cl, Variant.make("wgmma", tile=name))
              for (dtype, cl), name in zip(kinds * 2, sorted(t for t in wgmma.TILES if wgmma.TILES[t].bn < 32))]
    # grouped (three channels a group), one channel, twelve channels (N tiles of 16)
    cases += [Case(Layer(2, 48, 6, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 2, True, (11, 9), ""), torch.bfloat16,
                   False),
              Case(Layer(None, 32, 1, (3, 5), (1, 2), (1, 2), (0, 1), (2, 1), 1, False, (13, 17), ""), torch.float16,
                   False),
              Case(Layer(2, 32, 12, (3, 3), (2, 2), (1, 1), (0, 0), (1, 1), 1, True, (9, 11), ""), torch.float16,
                   True),
              # a wide dilated kernel whose halo takes 48 960 bytes of dynamic shared memory, under 48 KB, which the
              # kernel's static tables carry past it (a random fuzz case launched without opting in)
              Case(Layer(1, 16, 7, (7, 10), (3, 3), (6, 0), (0, 2), (1, 2), 1, False, (19, 31), ""), torch.bfloat16,
                   False)]
    return cases


THIN_CASES = _thin_cases()


@pytest.mark.parametrize("case", _params("thin", THIN_CASES))
def test_thin_destinations_match_float64(case, hopper):
    """N tiles of 8 and 16: each output channel past the layer's is never stored, the rest match float64."""
    assert wgmma.eligible(case.geometry, NAMES[case.dtype], "forward")
    y = _check(case, seed=300 + THIN_CASES.index(case), hopper=hopper)
    assert y.shape[-3] == case.layer.out_channels < 16
    assert not wgmma.eligible(case.geometry, "float32", "forward", "tf32"), "thin float32 stays on direct kernels"


def _engine_against_cp_async(monkeypatch, run, function: str, planner: str, no_maps) -> None:
    """``run()`` (the pass, and its launches) with fresh plans, then again with the planner's ``planner`` giving
    ``no_maps``: ``function`` ran on the copy engine's tiles first and on cp.async's then, with the same bits."""
    def tiles_from_the_engine():
        cupyconv.clear_cache()
        out, seen = run()
        return out, {dict(plan.spec.constants)["TMA"] for _, plan in seen if plan.spec.function == function}

    try:
        engine, engine_tma = tiles_from_the_engine()
        monkeypatch.setattr(wgmma, planner, lambda *args: no_maps)
        copied, copied_tma = tiles_from_the_engine()
    finally:
        monkeypatch.undo()
        cupyconv.clear_cache()
    assert engine_tma == {True} and copied_tma == {False}
    assert torch.equal(engine, copied)


def _halo_copied_by_the_engine(case: Case) -> bool:
    plan = table.plan(case.pass_, case.variant, case.geometry, NAMES[case.dtype], case.layout, case.precision,
                      case.layer.bias and case.pass_ == "forward", True, 132)
    return dict(plan.gemm.spec.constants)["TMA"]


# forwards and grad_inputs whose halos the copy engine lands, of both kinds and layouts: random layers, and
# grad_inputs whose halos it walks in 2 x 2 and 3 x 3 phase planes
HALO_COPY_CASES = ([c for c in SWEEP if _halo_copied_by_the_engine(c)][:6]
                   + [c for c in GRAD_SWEEP if _halo_copied_by_the_engine(c)][:1]
                   + [Case(Layer(3, 128, 96, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (8, 8), ""),
                           torch.bfloat16, True, pass_=GRAD),
                      Case(Layer(2, 64, 64, (3, 3), (3, 3), (1, 1), (0, 0), (1, 1), 1, False, (5, 7), ""),
                           torch.float16, False, pass_=GRAD)])


@pytest.mark.parametrize("case", _params("halo_copies", HALO_COPY_CASES))
def test_halos_from_the_copy_engine_match_cp_async_bit_for_bit(case, hopper, monkeypatch):
    """The copy engine's halo boxes (zeros outside the source) and the producer's cp.async copies (zero-filled
    where masked off) are the same bytes, so the forward or grad_input agrees bit for bit, and matches
    float64."""
    forward = case.pass_ == "forward"

    def run():
        if forward:
            x, w, b = _inputs(case, *_data(case.layer, case.dtype, 23))
            return _run_ours(case, x, w, b)
        x, w, go = _grad_inputs(case, *_grad_data(case.layer, case.dtype, 23))
        return _run_grad(case, go, x, w)

    _engine_against_cp_async(monkeypatch, run, FUNCTION, "halo_tensor_map", None)
    (_check if forward else _check_grad_input)(case, seed=23, hopper=hopper)


COPY_CASES = [c for c in TF32_CASES if c.variant.kwargs.get("copy")]


@pytest.mark.parametrize("case", _params("tf32_copy", COPY_CASES))
def test_a_rounded_copy_matches_the_producers_rounding_bit_for_bit(case, hopper):
    """A channels_last TF32 source copied rounded first (``copy``) and the same source rounded by the producer in
    shared memory are the same TF32 words multiplied in the same order: the outputs agree bit for bit."""
    forward = case.pass_ == "forward"

    def run(variant):
        pinned = replace(case, variant=variant)
        if forward:
            x, w, b = _inputs(pinned, *_data(case.layer, case.dtype, 29))
            out, seen = _run_ours(pinned, x, w, b)
        else:
            x, w, go = _grad_inputs(pinned, *_grad_data(case.layer, case.dtype, 29))
            out, seen = _run_grad(pinned, go, x, w)
        return out, [plan.spec.function for _, plan in seen]

    copied, copied_functions = run(case.variant)
    in_place, in_place_functions = run(WGMMA)
    assert "round_tf32_copy" in copied_functions and "round_tf32_copy" not in in_place_functions
    assert torch.equal(copied, in_place)


# ------------------------------------------------------------------------ grad_weight

WEIGHT = "grad_weight"
WEIGHT_FUNCTION = "conv_transpose2d_grad_weight_wgmma"
WEIGHT_TF32_FUNCTION = "conv_transpose2d_grad_weight_wgmma_tf32"
WEIGHT_PER_GROUP = (16, 24, 40, 64, 72, 136, 200)


# random layers with whole 16-byte channel runs on both sides, as grad_weight's wgmma kernel needs
WEIGHT_SWEEP = [Case(layer, *ROTATION[i % 4], pass_=WEIGHT)
                for i, layer in enumerate(grad_input_layers(20, 37, WEIGHT_PER_GROUP, WEIGHT_PER_GROUP))]


def _weight_suite_cases():
    """Every grad_weight option of the five suite layers at their smaller sizes."""
    cases = []
    for name, (batch, size) in SUITE.items():
        layer = replace(_suite_layer(name, batch, size), bias=False)
        g = Case(layer, torch.float16, False).geometry
        for i, opts in enumerate(wgmma.grad_weight_options(g)):
            dtype, channels_last = ROTATION[i % 4]
            variant = Variant.make("wgmma", **opts)
            cases.append(pytest.param(Case(layer, dtype, channels_last, variant, pass_=WEIGHT),
                                      id=f"{name}-{variant.name}-{SHORT[dtype]}-{'nhwc' if channels_last else 'nchw'}"))
    return cases


WEIGHT_SUITE_CASES = _weight_suite_cases()


def _check_grad_weight(case: Case, seed=0, hopper=None):
    assert case.pass_ == WEIGHT
    gw, go, x, w = _pinned_grad(case, seed, hopper)
    kwargs = case.layer.kwargs()
    ref = _torch_grad(WEIGHT, go.double(), x.double(), w.double(), kwargs)
    magnitude = _torch_grad(WEIGHT, go.double().abs(), x.double().abs(), w.double(), kwargs)
    theirs = _torch_grad(WEIGHT, go, x, w, kwargs)
    floor = _torch_grad(WEIGHT, round_tf32(go), round_tf32(x), w.double(), kwargs) \
        if case.precision == "tf32" else None
    # grad_weight's layout is the weight's own (cupyconv returns it contiguous or as the weight is)
    check = replace(case, channels_last=False) if not w.is_contiguous(memory_format=torch.channels_last) else case
    _near_float64(check, gw, ref, magnitude, theirs, floor)
    return gw


@pytest.mark.parametrize("case", _params("gw_sweep", WEIGHT_SWEEP))
def test_grad_weight_random_layers_match_float64(case, hopper):
    assert wgmma.grad_weight_eligible(case.geometry, NAMES[case.dtype])
    _check_grad_weight(case, seed=200 + WEIGHT_SWEEP.index(case), hopper=hopper)


@pytest.mark.parametrize("case", WEIGHT_SUITE_CASES)
def test_every_grad_weight_option_of_the_suite_layers(case, hopper):
    _check_grad_weight(case, hopper=hopper)


def _one_row_weight_cases():
    """Every grad_weight option of the one-row layers (K steps of one input row first), the kinds and layouts in
    turn."""
    cases = {}
    for name, layer in ONE_ROW_LAYERS.items():
        layer = replace(layer, bias=False)
        for i, opts in enumerate(wgmma.grad_weight_options(Case(layer, torch.float16, False).geometry)):
            dtype, channels_last = ROTATION[i % 4]
            variant = Variant.make("wgmma", **opts)
            cases[f"{name}-{variant.name}-{SHORT[dtype]}-{'nhwc' if channels_last else 'nchw'}"] = \
                Case(layer, dtype, channels_last, variant, pass_=WEIGHT)
    return cases


ONE_ROW_WEIGHT_CASES = _one_row_weight_cases()


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in ONE_ROW_WEIGHT_CASES.items()])
def test_grad_weight_of_inputs_of_few_rows(case, hopper):
    """An input under eight rows high takes K steps of 1 x 64 pixels by default; every option matches float64."""
    g = case.geometry
    assert wgmma.weight_rows_few(g) and wgmma.weight_tile(g).one_row
    if case.variant == WGMMA:
        assert dict(case.plan(hopper).partial.spec.constants)["TILE_W"] == 64
    _check_grad_weight(case, seed=400 + list(ONE_ROW_WEIGHT_CASES.values()).index(case), hopper=hopper)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_grad_weight_of_a_long_reduction_splits_it_in_fixed_order(dtype, hopper):
    """A layer with many pixels per channel pair splits K across blocks; the reduction's order is fixed, so two
    runs agree bit for bit."""
    layer = Layer(8, 64, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (32, 32), "")
    case = Case(layer, dtype, True, pass_=WEIGHT)
    assert case.plan(hopper).reduce is not None, "this layer's K is split"
    first = _check_grad_weight(case, seed=3, hopper=hopper)
    x, w, go = _grad_inputs(case, *_grad_data(case.layer, case.dtype, 3))
    again, _ = _run_grad(case, go, x, w)
    assert torch.equal(first, again)


# the copy engine's tiles against cp.async's: the first random layers, a one-row layer whose halo the copy engine
# takes (a stride of 8 over 64 pixels spans more than its 256) and a 16-row tile
COPY_PATH_CASES = WEIGHT_SWEEP[:6] + [ONE_ROW_WEIGHT_CASES["three_rows_3x3_s2-wgmma-fp16-nchw"]] + [
    Case(replace(ASYM_LIKE, bias=False), torch.bfloat16, True, Variant.make("wgmma", tile="64x64x4r16"),
         pass_=WEIGHT)]


@pytest.mark.parametrize("case", _params("gw_copies", COPY_PATH_CASES))
def test_grad_weight_from_the_copy_engine_matches_cp_async_bit_for_bit(case, hopper, monkeypatch):
    """The tiles that the copy engine lands (zeros outside the tensors) and those the producer's cp.async copies
    land (zero-filled where masked off) are the same bytes, so the MMAs sum the same products in the same
    order: grad_weight agrees bit for bit, and matches float64."""
    def run():
        x, w, go = _grad_inputs(case, *_grad_data(case.layer, case.dtype, 17))
        return _run_grad(case, go, x, w)

    _engine_against_cp_async(monkeypatch, run, WEIGHT_FUNCTION, "weight_tensor_maps", ())
    _check_grad_weight(case, seed=17, hopper=hopper)


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
def test_autograd_runs_the_pinned_wgmma_grad_weight(channels_last, hopper, monkeypatch):
    """Untuned, grad_weight of a layer with many taps a stride phase runs the wgmma kernel, the mma.sync GEMM
    racing it when tuning; pinned too, autograd's backward runs the wgmma kernel, with grad_output's
    channels_last copy shared with grad_input, and w.grad is right."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    tuning.clear()
    try:
        case = Case(replace(ASYM_LIKE, bias=False), torch.float16, channels_last, pass_=WEIGHT)
        g = case.geometry
        cands = table.candidates(WEIGHT, g, "float16", case.layout, "strict", hopper)
        assert cands[0] == WGMMA and tuning.GEMM in cands
        x, w, go = _grad_inputs(case, *_grad_data(case.layer, torch.float16, 11))
        x.requires_grad_()
        w.requires_grad_()
        y = ct.conv_transpose2d(x, w, None, **case.layer.kwargs())
        with tuning.pinned({WEIGHT: WGMMA}), launch.watch() as seen:
            y.backward(go)
            torch.cuda.synchronize()
        assert WEIGHT_FUNCTION in {plan.spec.function for _, plan in seen}
        copies = [plan for stage, plan in seen if stage == "to_channels_last"]
        assert len(copies) == (0 if channels_last else 2), "NCHW: grad_output once (shared) and x once"
        kwargs = case.layer.kwargs()
        ref = _torch_grad(WEIGHT, go.double(), x.double(), w.double(), kwargs)
        assert _rel(w.grad, ref) <= 2 * _rel(_torch_grad(WEIGHT, go, x, w, kwargs), ref) + 1e-6
    finally:
        tuning.clear()


# ------------------------------------------------------------------------ TF32 grad_weight
#
# float32 grad_weight at TF32 precision has its own kernel: K runs over (pixel, four images), each word copied
# alone, so any channel count and either layout is read in place; strict float32 stays on mma.sync.

TF32_WEIGHT_PER_GROUP = (16, 17, 24, 40, 64, 72, 100, 136)


def _tf32_weight_cases():
    layers = grad_input_layers(16, 43, TF32_WEIGHT_PER_GROUP, TF32_WEIGHT_PER_GROUP)
    # batches that four images a K step do not divide, inputs of one and two pixels a side (image groups fill
    # the K step), a 4 x 4 input (4 x 4 pixel patches), and pix2pix's shape at a small batch
    layers += [Layer(6, 64, 40, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (16, 16), ""),
               Layer(5, 48, 64, (4, 4), (2, 2), (1, 1), (1, 0), (1, 1), 1, False, (2, 2), ""),
               Layer(9, 34, 34, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), 2, False, (1, 1), ""),
               Layer(7, 136, 72, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (4, 4), ""),
               Layer(4, 256, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (13, 11), ""),
               replace(UNBATCHED, bias=False)]
    cases = [Case(layer, TF32, i % 2 == 0, pass_=WEIGHT) for i, layer in enumerate(layers)]
    for name, (batch, size) in SUITE.items():
        layer = replace(_suite_layer(name, batch, size), bias=False)
        g = Case(layer, TF32, False).geometry
        for i, opts in enumerate(wgmma.tf32_weight_options(g)):
            cases.append(Case(layer, TF32, i % 2 == 1, Variant.make("wgmma", **opts), pass_=WEIGHT))
    return cases


TF32_WEIGHT_CASES = _tf32_weight_cases()


@pytest.mark.parametrize("case", _params("tf32_gw", TF32_WEIGHT_CASES))
def test_tf32_grad_weight_matches_float64(case, hopper):
    """As the forward's TF32 cases: within twice TF32's unit of float64 on the terms' magnitudes, and no worse
    than twice torch's error (at least that of an exact sum of TF32-rounded products); only at TF32 precision."""
    assert torch.backends.cudnn.allow_tf32
    assert wgmma.grad_weight_eligible(case.geometry, "float32", "tf32")
    _check_grad_weight(case, seed=300 + TF32_WEIGHT_CASES.index(case), hopper=hopper)


def _strict_weight_cases():
    """3xTF32 grad_weight: random layers, the odd batches and small inputs of the TF32 cases, every option of the
    suite layers."""
    layers = grad_input_layers(10, 47, TF32_WEIGHT_PER_GROUP, TF32_WEIGHT_PER_GROUP)
    layers += [Layer(6, 64, 40, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (16, 16), ""),
               Layer(5, 48, 64, (4, 4), (2, 2), (1, 1), (1, 0), (1, 1), 1, False, (2, 2), ""),
               Layer(9, 34, 34, (3, 3), (1, 1), (1, 1), (0, 0), (1, 1), 2, False, (1, 1), ""),
               Layer(7, 136, 72, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (4, 4), ""),
               replace(UNBATCHED, bias=False)]
    cases = [Case(layer, TF32, i % 2 == 1, pass_=WEIGHT, strict=True) for i, layer in enumerate(layers)
             if wgmma.grad_weight_eligible(Case(layer, TF32, False).geometry, "float32", "strict")]
    for name, (batch, size) in SUITE.items():
        layer = replace(_suite_layer(name, batch, size), bias=False)
        g = Case(layer, TF32, False).geometry
        if wgmma.grad_weight_eligible(g, "float32", "strict"):
            for i, opts in enumerate(wgmma.tf32_weight_options(g, "strict")):
                cases.append(Case(layer, TF32, i % 2 == 0, Variant.make("wgmma", **opts), pass_=WEIGHT, strict=True))
    return cases


STRICT_WEIGHT_CASES = _strict_weight_cases()
assert len(STRICT_WEIGHT_CASES) >= 15


@pytest.mark.parametrize("case", _params("strict_gw", STRICT_WEIGHT_CASES))
def test_strict_float32_grad_weight_matches_float64(case, hopper, strict_float32):
    """3xTF32 grad_weight: every element within 2^-19 of float64 on the terms' magnitudes, and no worse than twice
    torch's strict float32 error."""
    plan = case.plan(hopper)
    assert dict(plan.partial.spec.constants)["SPLIT_TF32"] and dict(plan.pack.spec.constants)["SPLIT_TF32"]
    _check_grad_weight(case, seed=500 + STRICT_WEIGHT_CASES.index(case), hopper=hopper)


def test_tf32_grad_weight_splits_in_fixed_order(hopper):
    """K split across blocks and reduced in a fixed order: two runs agree bit for bit."""
    layer = Layer(16, 64, 64, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (32, 32), "")
    case = Case(layer, TF32, False, pass_=WEIGHT)
    assert case.plan(hopper).reduce is not None, "this layer's K is split"
    first = _check_grad_weight(case, seed=5, hopper=hopper)
    x, w, go = _grad_inputs(case, *_grad_data(case.layer, case.dtype, 5))
    again, _ = _run_grad(case, go, x, w)
    assert torch.equal(first, again)


@pytest.mark.parametrize("allow_tf32", [True, False], ids=["tf32", "strict"])
def test_float32_grad_weight_runs_wgmma_as_torch_allows(allow_tf32, hopper, monkeypatch):
    """autograd's backward of a float32 layer runs the image-quad grad_weight kernel, as TF32 where torch allows
    TF32 and as 3xTF32 where it does not; w.grad is right either way."""
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow_tf32)
    tuning.clear()
    try:
        case = Case(Layer(8, 64, 48, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1, False, (12, 16), ""), TF32, False,
                    pass_=WEIGHT)
        x, w, go = _grad_inputs(case, *_grad_data(case.layer, TF32, 13))
        w.requires_grad_()
        y = ct.conv_transpose2d(x, w, None, **case.layer.kwargs())
        with launch.watch() as seen:
            y.backward(go)
            torch.cuda.synchronize()
        kernels = [dict(plan.spec.constants)["SPLIT_TF32"] for _, plan in seen
                   if plan.spec.function == WEIGHT_TF32_FUNCTION]
        assert kernels == [not allow_tf32], kernels
        ref = _torch_grad(WEIGHT, go.double(), x.double(), w.double(), case.layer.kwargs())
        theirs = _torch_grad(WEIGHT, go, x, w, case.layer.kwargs())
        floor = _torch_grad(WEIGHT, round_tf32(go), round_tf32(x), w.double(), case.layer.kwargs())
        bound = 2 * (max(_rel(theirs, ref), _rel(floor, ref)) if allow_tf32 else _rel(theirs, ref))
        assert _rel(w.grad, ref) <= bound + 1e-6
    finally:
        tuning.clear()


# ------------------------------------------------------------------ a channels_last weight read in place

@pytest.mark.parametrize("case", IN_PLACE_CASES)
def test_a_channels_last_weight_read_in_place_matches_float64(case, hopper):
    plan = case.plan(hopper)
    assert plan.pack is None and dict(plan.gemm.spec.constants)["WEIGHT_DIRECT"]
    if case.pass_ == GRAD:
        _check_grad_input(case, hopper=hopper)
    else:
        _check(case, hopper=hopper)


@pytest.mark.parametrize("pass_", ["forward", GRAD])
def test_an_unaligned_channels_last_weight_is_packed(pass_, hopper):
    """A channels_last weight that starts off a 16-byte boundary cannot be read in 16-byte copies: it is packed
    (the engine plans the pass as unaligned), and the result is the same."""
    layer = IN_PLACE_LAYERS["wide"] if pass_ == "forward" else replace(IN_PLACE_LAYERS["wide"], bias=False)
    case = Case(layer, torch.bfloat16, True, weight_channels_last=True, pass_=pass_)
    if pass_ == "forward":
        x, w, b = _inputs(case, *_data(layer, torch.bfloat16, 3))
        y, seen = _run_ours(case, x, _one_element_off(w), b, expect_function=None)
        assert "pack_weight" in [plan.spec.function for _, plan in seen]
        _compare(case, y, x, w, b)
    else:
        x, w, go = _grad_inputs(case, *_grad_data(layer, torch.bfloat16, 3))
        gi, seen = _run_grad(case, go, x, _one_element_off(w), expect_function="pack_weight")
        _compare_grad_input(case, gi, go, x, w)
    assert {p for _, p in seen} == set(case.plan(hopper, aligned=False).plans())
