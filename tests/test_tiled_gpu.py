"""The tiled forward on the GPU: every candidate tile of a random sweep and of the bench's bandwidth layers, in
every dtype, against float64 torch."""
from __future__ import annotations

import random

import pytest

from cupyconv import tuning
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import tiled
from cupyconv.tuning.variants import Variant

from layers import Layer, random_layer
from test_kernels_gpu import TOLERANCE, assert_close, make_inputs

torch = pytest.importorskip("torch")
F = torch.nn.functional
ct = pytest.importorskip("cupyconv.torch")
pytestmark = pytest.mark.gpu

DTYPES = ("float32", "float64", "float16", "bfloat16")


def _sweep():
    rng = random.Random(20261127)
    found = []
    while len(found) < 40:
        layer = random_layer(rng, DTYPES[len(found) % 4], max_size=19)
        if tiled.eligible(_geometry(layer), layer.dtype):
            found.append(layer)
    return found


def _geometry(layer: Layer):
    return geometry(layer.input_shape, layer.weight_shape, (layer.out_channels,) if layer.bias else None,
                    ConvParams.from_args(**layer.kwargs()))


SWEEP = _sweep()
# the bench's grouped_dilated and depthwise_up layers at batch 2
BENCH = [Layer(2, 32, 64, (3, 5), (2, 3), (1, 2), (0, 0), (2, 1), 4, False, (32, 64), dtype) for dtype in DTYPES] + \
        [Layer(2, 128, 128, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 128, True, (24, 32), dtype) for dtype in DTYPES]


def _check_every_tile(layer: Layer, seed: int, offset: int = 0):
    x, w, b, _ = make_inputs(layer, seed)
    if offset:  # the input one element past its allocation's start: element stores
        x = torch.empty(x.numel() + offset, dtype=x.dtype, device=x.device)[offset:].view(x.shape).copy_(x)
        assert x.data_ptr() % 16
    kwargs = layer.kwargs()
    want = F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(), **kwargs)
    tiles = tiled.tiles(_geometry(layer), layer.dtype)
    assert tiles
    for tile in tiles:
        with tuning.pinned({"forward": Variant.make("tiled", tile=tiled.tile_name(tile))}):
            got = ct.conv_transpose2d(x, w, b, **kwargs)
        assert_close(got, want, TOLERANCE[layer.dtype], f"{layer} tile {tile}")


@pytest.mark.parametrize("index", range(len(SWEEP)))
def test_every_tile_of_a_random_layer(index):
    _check_every_tile(SWEEP[index], seed=index)


@pytest.mark.parametrize("index", range(len(BENCH)))
def test_every_tile_of_the_bench_layers(index):
    _check_every_tile(BENCH[index], seed=100 + index)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_misaligned_input_runs_element_stores(dtype):
    layer = BENCH[DTYPES.index(dtype) + 4]
    _check_every_tile(layer, seed=7, offset=1)


# The bench's layers at full size: more patches than the grid's blocks, so each block walks a run of them with the
# next one's loads in flight, and the grouped layer stages its input channels in more than one chunk.
FULL = [Layer(16, 32, 64, (3, 5), (2, 3), (1, 2), (0, 0), (2, 1), 4, False, (128, 256), dtype)
        for dtype in ("float16", "float32")] + \
       [Layer(16, 128, 128, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 128, True, (64, 64), dtype)
        for dtype in ("bfloat16", "float32")]


@pytest.mark.parametrize("index", range(len(FULL)))
def test_blocks_walk_runs_of_patches_at_full_size(index):
    layer = FULL[index]
    g = _geometry(layer)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    plans = [tiled.plan_forward(g, layer.dtype, layer.bias, t, sm_count=sm_count) for t in tiled.tiles(g, layer.dtype)]
    assert all(plan.scalars[-1] > 4 * plan.grid[0] for plan in plans)
    if layer.groups == 4:
        assert any(dict(plan.spec.constants)["IC_CHUNK"] < g.in_per_group for plan in plans)
    _check_every_tile(layer, seed=200 + index)
