"""The split-K reduces on a GPU at the sizes that take their 16-byte runs, their larger tiles and their grid-stride
loop: bit for bit against the chunks added in order in fp32 by torch and rounded once, and with no local memory.

The emulated tests (test_kernels_emulated.py) check the same arithmetic on layers small enough for the CPU; these
check the planning that only large weights reach.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

from cupyconv.jit.compiler import get_function  # noqa: E402
from cupyconv.plans import reduction  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _in_order(partials):
    """The chunks added one after another in fp32, as each thread of the reduces adds them."""
    total = partials[0].clone()
    for chunk in partials[1:]:
        total += chunk
    return total


def _run(plan, partials, out):
    device = torch.cuda.current_device()
    plan.run(device, torch.cuda.current_stream().cuda_stream, (partials.data_ptr(), out.data_ptr()))
    torch.cuda.synchronize()
    assert get_function(plan.spec, device).local_size_bytes == 0, "no local memory"


# 4 * (8192 * 256 + 1000) elements: 1000 runs of four past what the 8192-block grid covers in one stride.
GRID_STRIDE = 4 * (8192 * 256 + 1000)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("elements, chunks", [(GRID_STRIDE, 2), (256 * 256 * 4, 7), (256 * 256 * 4 - 4, 3)])
def test_split_k_reduce_matches_the_in_order_sum(elements, chunks, dtype):
    plan = reduction.plan_reduce(dtype, elements, chunks, "int")
    assert dict(plan.spec.constants)["VEC"] == (4 if elements >= 256 * 256 * 4 else 1)
    gen = torch.Generator(device="cuda").manual_seed(elements + chunks)
    partials = torch.randn(chunks, elements, device="cuda", generator=gen)
    out = torch.empty(elements, device="cuda", dtype=DTYPES[dtype])
    _run(plan, partials, out)
    assert torch.equal(out, _in_order(partials).to(DTYPES[dtype]))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("rows, taps, chunks, runs", [
    (1024 * 512, 16, 1, 1024),   # pix2pix's 1024 x 512 x 4 x 4 weight, one chunk
    (512 * 256, 16, 5, 1024),    # dcgan_up's, a set of four chunks and one more
    (256 * 1024, 9, 3, 1024),    # a 3 x 3 kernel: runs rounded up to the taps
    (64 * 4096, 49, 2, 1024),    # 7 x 7 taps over two tiles of 25 and 24
    (64 * 64, 16, 64, 256),      # few rows over many chunks keep the smaller tile and its blocks
    (1026, 15, 3, 256),          # a row count that is no multiple of four: one row a load
])
def test_tap_major_reduce_matches_the_in_order_sum_with_the_taps_last(rows, taps, chunks, runs, dtype):
    plan = reduction.plan_tap_major_reduce(dtype, rows, taps, chunks, "int")
    constants = dict(plan.spec.constants)
    assert constants["RUNS"] == runs and constants["VEC"] == (4 if rows % 4 == 0 else 1)
    gen = torch.Generator(device="cuda").manual_seed(rows + taps + chunks)
    partials = torch.randn(chunks, taps, rows, device="cuda", generator=gen)
    out = torch.empty(rows, taps, device="cuda", dtype=DTYPES[dtype])
    _run(plan, partials, out)
    assert torch.equal(out, _in_order(partials).t().to(DTYPES[dtype]))
