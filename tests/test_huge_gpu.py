"""Forward and backward on tensors of more than 2**31 elements (64-bit offsets), on the GPU.

Each case has an input, output or gradient past 2**31 elements, on the tensor-core and on
the direct kernels.  Outputs are allocated from memory just filled with NaN and scanned
whole, so an element left unwritten (or a write that wrapped around to the wrong place)
shows.  Values are checked against float64 torch on cropped sub-problems: bands of output
rows at the start, the end and around element 2**31 of the output's memory, bands of
grad_input rows likewise, and grad_weight and grad_bias whole, summed band by band over
the entire input in float64.  The reference is computed from the rounded tensors the
kernels read, so the bounds only allow for accumulation and output rounding.

Peak device memory stays under 40 GB (asserted).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")]

import cupyconv.torch as ct  # noqa: E402
from cupyconv import tuning  # noqa: E402
from layers import uses_gemm  # noqa: E402
from cupyconv.core.geometry import ConvParams, geometry  # noqa: E402

INT32_LIMIT = 2 ** 31
MEMORY_LIMIT = 40e9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Huge:
    name: str
    input_shape: Tuple[int, int, int, int]
    out_per_group: int
    kernel: int
    stride: int
    padding: int
    output_padding: int
    groups: int
    dtype: torch.dtype
    channels_last: bool
    gemm: bool                      # whether the tensor-core kernels run it

    def kwargs(self):
        return dict(stride=self.stride, padding=self.padding, output_padding=self.output_padding, groups=self.groups)

    @property
    def weight_shape(self):
        return (self.input_shape[1], self.out_per_group, self.kernel, self.kernel)


CASES = [
    # fp16 output and grad_output of 2.15e9 elements over two images: the batch offset passes 2**31
    Huge("gemm_fp16_output", (2, 16, 4100, 4100), 16, 3, 2, 1, 1, 1, torch.float16, False, True),
    # bf16 channels_last input and grad_input of 2.15e9 elements, read and written in place
    Huge("gemm_bf16_channels_last_input", (1, 64, 5800, 5800), 16, 3, 1, 1, 0, 1, torch.bfloat16, True, True),
    # fp32 output and grad_output of 2.15e9 elements (8.6 GB) on the direct kernels
    Huge("direct_fp32_output", (1, 2, 16400, 16400), 2, 4, 2, 1, 0, 1, torch.float32, False, False),
    # depthwise fp16: input, output and both activation gradients of 2.15e9 elements
    Huge("direct_fp16_depthwise", (1, 64, 5800, 5800), 1, 3, 1, 1, 0, 64, torch.float16, False, False),
]

# ||ours - ref|| / ||ref|| over what is compared; the reference starts from the same rounded inputs.
TOLERANCE = {  # (output and grad_input, grad_weight and grad_bias: long fp32 sums)
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
BAND = 8


@pytest.fixture
def heuristic_variants(monkeypatch):
    # Timing the tuner's candidates on multi-GB tensors would dominate the test.
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert bool(torch.isfinite(got).all()), "non-finite values"
    denom = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(got - ref))
    return num / denom if denom else (0.0 if num == 0.0 else math.inf)


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the 4-D tensor ``t`` in float64, zeros where they fall outside it."""
    n, c, h, w = t.shape
    out = torch.zeros((n, c, stop - start, w), dtype=torch.float64, device=t.device)
    lo, hi = max(start, 0), min(stop, h)
    if lo < hi:
        out[:, :, lo - start:hi - start] = t[:, :, lo:hi].double()
    return out


def _cols(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Columns [start, start + length) of ``t``, zeros where they fall outside it."""
    out = torch.zeros(t.shape[:-1] + (length,), dtype=t.dtype, device=t.device)
    lo, hi = max(start, 0), min(start + length, t.shape[-1])
    if lo < hi:
        out[..., lo - start:hi - start] = t[..., lo:hi]
    return out


def _forward_rows(case: Huge, x, w64, b64, n: int, oh0: int, oh1: int) -> torch.Tensor:
    """Float64 output rows [oh0, oh1) of image n, from only the input rows that reach them."""
    s, p, d, k = case.stride, case.padding, 1, case.kernel
    h = x.shape[2]
    lo = max(0, -(-(oh0 + p - d * (k - 1)) // s))
    hi = min(h - 1, (oh1 - 1 + p) // s)
    w_out = _out_size(case)[1]
    ref = torch.zeros((1, w64.shape[1] * case.groups, oh1 - oh0, w_out), dtype=torch.float64, device=x.device)
    if lo <= hi:
        # the uncropped transposed conv of the slab: its row f is output row f + lo*s - p
        full = F.conv_transpose2d(x[n:n + 1, :, lo:hi + 1].double(), w64, None, stride=s, groups=case.groups)
        ref = _cols(_rows(full, oh0 - lo * s + p, oh1 - lo * s + p), p, w_out)
    if b64 is not None:
        ref += b64.view(1, -1, 1, 1)
    return ref


def _grad_input_rows(case: Huge, go, w64, n: int, ih0: int, ih1: int, width: int) -> torch.Tensor:
    """Float64 grad_input rows [ih0, ih1) of image n: conv2d of the grad_output rows they read."""
    s, p, k = case.stride, case.padding, case.kernel
    band = _rows(go[n:n + 1], ih0 * s - p, (ih1 - 1) * s - p + k)
    return F.conv2d(band, w64, stride=s, padding=(0, p), groups=case.groups)[..., :width]


def _out_size(case: Huge):
    h, w = case.input_shape[2:]
    return tuple((size - 1) * case.stride - 2 * case.padding + case.kernel - 1 + case.output_padding + 1
                 for size in (h, w))


def _bands(t: torch.Tensor, rows: int):
    """(image, first row) of bands to check: both ends, and around elements 2**31 - 1, 2**31 and the last.

    The elements are counted in ``t``'s memory order (NCHW or channels_last).
    """
    n, c, h, w = t.shape
    picks = {(0, 0), (n - 1, max(0, h - rows)), (n // 2, max(0, h // 2 - rows // 2))}
    order = sorted(range(4), key=lambda dim: -t.stride(dim))
    for offset in (INT32_LIMIT - 1, INT32_LIMIT, t.numel() - 1):
        if offset >= t.numel():
            continue
        index, rest = [0] * 4, offset
        for dim in order:
            index[dim], rest = divmod(rest, t.stride(dim))
        picks.add((index[0], max(0, min(h - rows, index[2] - rows // 2))))
    return sorted(picks)


def _memory_format(case: Huge):
    return torch.channels_last if case.channels_last else torch.contiguous_format


def _random(shape, dtype, memory_format, seed, rows: int = 1024):
    """Standard normals in ``dtype``, drawn a band of rows at a time: no full-size float32 copy."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    t = torch.empty(shape, dtype=dtype, device=DEVICE, memory_format=memory_format)
    n, c, h, w = shape
    planes = t.permute(0, 2, 3, 1) if memory_format == torch.channels_last else t.reshape(n * c, h, w)
    for plane in planes:
        for r in range(0, h, rows):
            chunk = plane[r:r + rows]
            chunk.copy_(torch.randn(chunk.shape, generator=gen, device=DEVICE, dtype=torch.float32))
    return t


def _poison(shape, dtype, memory_format):
    """Leave a NaN-filled free block of this size in the caching allocator for the next output."""
    t = torch.empty(shape, dtype=dtype, device=DEVICE, memory_format=memory_format)
    t.fill_(float("nan"))
    del t


@gpu[0]
@gpu[1]
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_huge_tensor_forward_and_backward(case: Huge, heuristic_variants):
    free, _ = torch.cuda.mem_get_info()
    if free < MEMORY_LIMIT:
        pytest.skip(f"needs {MEMORY_LIMIT / 1e9:.0f} GB of free device memory, {free / 1e9:.0f} GB free")
    torch.cuda.reset_peak_memory_stats()
    fmt = _memory_format(case)
    params = ConvParams.from_args(**case.kwargs())
    g = geometry(case.input_shape, case.weight_shape, None, params)
    dt = ct._DTYPE_NAMES[case.dtype]
    assert uses_gemm(g, dt, 0) == case.gemm
    assert max(math.prod(g.input_shape), math.prod(g.output_shape)) >= INT32_LIMIT

    x = _random(case.input_shape, case.dtype, fmt, seed=1)
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    w = torch.randn(case.weight_shape, generator=gen, device=DEVICE, dtype=torch.float32).to(case.dtype)
    b = torch.randn(g.out_channels, generator=gen, device=DEVICE, dtype=torch.float32).to(case.dtype)
    w64, b64 = w.double(), b.double()
    tol_act, tol_sum = TOLERANCE[case.dtype]

    # forward
    _poison(g.output_shape, case.dtype, fmt)
    y = ct.conv_transpose2d(x, w, b, **case.kwargs())
    assert y.shape == g.output_shape and y.dtype == case.dtype
    assert y.is_contiguous(memory_format=fmt)
    assert not bool(torch.isnan(y).any()), "forward left output elements unwritten"
    for n, oh0 in _bands(y, BAND):
        got = y[n:n + 1, :, oh0:oh0 + BAND]
        err = _rel(got, _forward_rows(case, x, w64, b64, n, oh0, oh0 + BAND))
        assert err <= tol_act, f"{case.name}: output rows {oh0}..{oh0 + BAND} of image {n}: error {err:.2e}"
    del y, got

    # grad_input
    go = _random(g.output_shape, case.dtype, fmt, seed=3)
    _poison(g.input_shape, case.dtype, fmt)
    gi, none_w, none_b = ct.conv_transpose2d_backward(go, x, w, **case.kwargs(), output_mask=(True, False, False))
    assert none_w is None and none_b is None
    assert gi.shape == x.shape and gi.dtype == case.dtype
    assert not bool(torch.isnan(gi).any()), "grad_input left elements unwritten"
    for n, ih0 in _bands(gi, BAND):
        got = gi[n:n + 1, :, ih0:ih0 + BAND]
        err = _rel(got, _grad_input_rows(case, go, w64, n, ih0, ih0 + BAND, x.shape[3]))
        assert err <= tol_act, f"{case.name}: grad_input rows {ih0}..{ih0 + BAND} of image {n}: error {err:.2e}"
    del gi, got

    # grad_weight and grad_bias, each a reduction over the whole tensor: checked whole
    none_i, gw, gb = ct.conv_transpose2d_backward(go, x, w, **case.kwargs(), output_mask=(False, True, True))
    assert none_i is None
    gw_ref, gb_ref = _sums_in_float64(case, x, go, w64)
    err = _rel(gw, gw_ref)
    assert err <= tol_sum, f"{case.name}: grad_weight error {err:.2e}"
    err = _rel(gb, gb_ref)
    assert err <= tol_sum, f"{case.name}: grad_bias error {err:.2e}"

    peak = torch.cuda.max_memory_allocated()
    assert peak <= MEMORY_LIMIT, f"peak device memory {peak / 1e9:.1f} GB"


def _sums_in_float64(case: Huge, x, go, w64, rows: int = 512):
    """grad_weight and grad_bias in float64, one band of input rows at a time over the whole input.

    grad_weight is the weight gradient of <conv2d(grad_output, w), x>, and a band of input
    rows only meets the grad_output rows its taps land on.
    """
    s, p, k = case.stride, case.padding, case.kernel
    n_images, _, h, width = x.shape
    gw = torch.zeros_like(w64)
    for n in range(n_images):
        for ih0 in range(0, h, rows):
            ih1 = min(h, ih0 + rows)
            band = _rows(go[n:n + 1], ih0 * s - p, (ih1 - 1) * s - p + k)
            wv = w64.clone().requires_grad_()
            out = F.conv2d(band, wv, stride=s, padding=(0, p), groups=case.groups)[..., :width]
            (gw_band,) = torch.autograd.grad((out * x[n:n + 1, :, ih0:ih1].double()).sum(), wv)
            gw += gw_band
            del band, out
    gb = torch.zeros(go.shape[1], dtype=torch.float64, device=go.device)
    for n in range(go.shape[0]):
        for r in range(0, go.shape[2], 2 * rows):
            gb += go[n, :, r:r + 2 * rows].double().sum((1, 2))
    return gw, gb


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_reference_helpers_against_whole_tensors(channels_last):
    """Runs with or without a GPU, on the big cases' device: the cropped float64 sub-problems reproduce torch's
    result on a small layer."""
    case = Huge("small", (2, 3, 9, 7), 2, 3, 2, 1, 1, 1, torch.float64, channels_last, False)
    fmt = _memory_format(case)
    x = _random(case.input_shape, torch.float64, fmt, seed=0, rows=4).requires_grad_()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w = torch.randn(case.weight_shape, generator=gen, device=DEVICE, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, generator=gen, device=DEVICE, dtype=torch.float64, requires_grad=True)
    assert x.is_contiguous(memory_format=fmt) and float(x.detach().std()) > 0.5
    y = F.conv_transpose2d(x, w, b, **case.kwargs())
    go = _random(tuple(y.shape), torch.float64, fmt, seed=1, rows=4)
    y.backward(go)
    assert y.shape[2:] == _out_size(case)
    bands = _bands(y, 4)
    assert (0, 0) in bands and (1, y.shape[2] - 4) in bands
    for n, oh0 in bands:
        assert torch.allclose(_forward_rows(case, x.detach(), w.detach(), b.detach(), n, oh0, oh0 + 4),
                              y[n:n + 1, :, oh0:oh0 + 4].detach(), atol=1e-12)
    for oh0 in range(0, y.shape[2] - 2):  # every band, bias left out
        assert torch.allclose(_forward_rows(case, x.detach(), w.detach(), None, 1, oh0, oh0 + 3),
                              y[1:2, :, oh0:oh0 + 3].detach() - b.detach().view(1, -1, 1, 1), atol=1e-12)
    for n, ih0 in _bands(x, 4):
        assert torch.allclose(_grad_input_rows(case, go, w.detach(), n, ih0, ih0 + 4, x.shape[3]),
                              x.grad[n:n + 1, :, ih0:ih0 + 4], atol=1e-12)
    gw, gb = _sums_in_float64(case, x.detach(), go, w.detach(), rows=2)
    assert torch.allclose(gw, w.grad, atol=1e-12) and torch.allclose(gb, b.grad, atol=1e-12)


def test_bands_follow_memory_order():
    """Element 2**31 of an NCHW tensor and of a channels_last one sit in different rows."""
    nchw = torch.empty((1, 16, 11600, 11600), device="meta")
    cl = nchw.to(memory_format=torch.channels_last)
    # NCHW: 2**31 = channel 15, row (2**31 - 15 * 11600**2) // 11600
    assert (0, (INT32_LIMIT - 15 * 11600 ** 2) // 11600 - BAND // 2) in _bands(nchw, BAND)
    # channels_last: 2**31 = row 2**31 // (11600 * 16)
    assert (0, INT32_LIMIT // (11600 * 16) - BAND // 2) in _bands(cl, BAND)
