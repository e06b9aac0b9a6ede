"""The scatter and gather GEMMs' planner (no GPU): which layers the scatter forward (one tap an output pixel) and
the gather grad_input (any taps) take, what they launch, and where the table puts them."""
from __future__ import annotations

import dataclasses

import pytest

from cupyconv.core.device import ASSUMED, MMA_SYNC
from cupyconv.core.geometry import ConvParams, geometry
from cupyconv.plans import gemm, scatter_gemm, table
from cupyconv.tuning import Variant


def _layer(x_shape, w_shape, **kwargs):
    return geometry(x_shape, w_shape, None, ConvParams.from_args(**kwargs))


UNET_UP = _layer((8, 256, 64, 64), (256, 128, 2, 2), stride=2)
ONE_PIXEL = _layer((16, 512, 1, 1), (512, 512, 4, 4), stride=2, padding=1)
DCGAN_UP = _layer((64, 512, 8, 8), (512, 256, 4, 4), stride=2, padding=1)       # taps overlap: two a phase


@pytest.mark.parametrize("x_shape,w_shape,kwargs,one", [
    ((2, 8, 5, 7), (8, 8, 2, 2), dict(stride=2), True),
    ((2, 8, 5, 7), (8, 8, 2, 3), dict(stride=(2, 3), padding=1, output_padding=(1, 0)), True),
    ((2, 8, 5, 7), (8, 8, 1, 1), dict(), True),                                    # pointwise
    ((2, 8, 1, 1), (8, 8, 4, 4), dict(stride=2, padding=1), True),                 # one input pixel, cropped taps
    ((2, 8, 1, 1), (8, 8, 4, 4), dict(), True),                                    # a generator's first layer
    ((2, 8, 5, 7), (8, 8, 4, 4), dict(stride=2, padding=1), False),                # taps overlap
    ((2, 8, 5, 7), (8, 8, 2, 2), dict(stride=3), False),                           # gaps between taps
    ((2, 8, 5, 7), (8, 8, 2, 2), dict(stride=2, output_padding=1), False),         # padding rows with no tap
    ((2, 8, 5, 7), (8, 8, 2, 2), dict(stride=4, dilation=2), False),               # dilated apart
    ((2, 8, 1, 1), (8, 8, 3, 3), dict(dilation=2), False),                         # one pixel, dilated: gaps
])
def test_one_tap_means_every_output_pixel_receives_exactly_one_tap(x_shape, w_shape, kwargs, one):
    g = _layer(x_shape, w_shape, **kwargs)
    assert scatter_gemm.one_tap(g) is one
    # the definition itself, counted: each output position along each axis receives this many taps
    p = g.params
    counts = []
    for axis in range(2):
        hits = [0] * g.out_size[axis]
        for i in range(g.in_size[axis]):
            for k in range(g.kernel[axis]):
                o = i * p.stride[axis] + k * p.dilation[axis] - p.padding[axis]
                if 0 <= o < g.out_size[axis]:
                    hits[o] += 1
        counts.append(set(hits))
    assert (counts == [{1}, {1}]) is one


def test_box_coordinates_reach_every_pixel():
    """The copy engine's coordinates are signed 32-bit: 2**31 input pixels or more take the other families."""
    g = _layer((2 ** 15, 8, 256, 256), (8, 8, 2, 2), stride=2)
    assert scatter_gemm.pixel_count(g) == 2 ** 31 and scatter_gemm.one_tap(g)
    assert not scatter_gemm.eligible(g, "float16")
    assert scatter_gemm.eligible(_layer((2 ** 15 - 1, 8, 256, 256), (8, 8, 2, 2), stride=2), "float16")


def test_eligibility():
    assert scatter_gemm.eligible(UNET_UP, "float16") and scatter_gemm.eligible(UNET_UP, "bfloat16")
    assert not scatter_gemm.eligible(UNET_UP, "float32"), "B is MN-major: no TF32"
    assert not scatter_gemm.eligible(UNET_UP, "float64")
    grouped = _layer((2, 64, 5, 7), (64, 16, 2, 2), stride=2, groups=2)
    assert not scatter_gemm.eligible(grouped, "float16")
    odd_in = _layer((2, 100, 1, 1), (100, 512, 4, 4))   # DCGAN's 100 noise channels: no 16-byte runs
    assert not scatter_gemm.eligible(odd_in, "float16")
    odd_out = _layer((2, 64, 5, 7), (64, 12, 2, 2), stride=2)
    assert not scatter_gemm.eligible(odd_out, "float16")
    for g in (grouped, odd_in, odd_out):
        assert not scatter_gemm.eligible(g, "float16", "grad_input")
    # taps that overlap: the gather takes grad_input, the scatter no forward
    assert scatter_gemm.eligible(DCGAN_UP, "bfloat16", "grad_input") and not scatter_gemm.eligible(DCGAN_UP, "bfloat16")
    assert not scatter_gemm.eligible(DCGAN_UP, "float32", "grad_input")


@pytest.mark.parametrize("x_shape,w_shape,kwargs,gathers", [
    ((2, 8, 5, 7), (8, 8, 4, 4), dict(stride=2, padding=1), True),                 # overlapping, cropped
    ((2, 8, 5, 7), (8, 8, 3, 5), dict(stride=(2, 1), output_padding=(1, 0)), True),
    ((2, 8, 5, 7), (8, 8, 2, 2), dict(stride=3), True),                            # gaps between taps
    ((2, 8, 5, 7), (8, 8, 3, 3), dict(padding=2, dilation=2), True),               # dilated apart
    ((2, 8, 5, 7), (8, 8, 17, 3), dict(), True),                                   # long kernel, nothing cropped
    ((2, 8, 5, 7), (8, 64, 17, 3), dict(padding=1), True),                         # cropped, by boxes
    ((2, 8, 5, 7), (8, 8, 17, 3), dict(padding=1), False),                         # cropped rows: 16-bit masks
    ((2, 8, 5, 7), (8, 64, 17, 3), dict(stride=9, padding=1), False),              # no box at stride 9
])
def test_the_gather_takes_any_taps_within_its_masks(x_shape, w_shape, kwargs, gathers):
    g = _layer(x_shape, w_shape, **kwargs)
    assert scatter_gemm.gathers(g) is gathers
    assert scatter_gemm.eligible(g, "float16", "grad_input") is gathers


@pytest.mark.parametrize("weight_cl", [False, True], ids=["w", "w_cl"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_plan_copies_only_what_is_not_channels_last(layout, weight_cl):
    g = UNET_UP.with_weight_channels_last(weight_cl)
    packed = scatter_gemm.plan_forward(g, "bfloat16", True, layout)
    functions = [p.spec.function for p in packed.plans()]
    assert functions[-1] == "conv_transpose2d_scatter_gemm"
    assert (packed.pack is None) is weight_cl
    assert (packed.to_channels_last is None) is (layout == "nhwc")
    if not weight_cl:
        # the weight (C_in, C_out, kH, kW) is copied as a batch of C_in images of C_out channels over kH x kW pixels
        assert packed.pack.scalars == (256, 128, 4) and packed.pack.scratch_bytes == 256 * 128 * 4 * 2
    constants = dict(packed.gemm.spec.constants)
    assert constants["WEIGHT_CL"] is True and constants["DST_CL"] is (layout == "nhwc") and constants["HAS_BIAS"]
    assert packed.gemm.spec.target == "sm_90a" and packed.gemm.block == (384, 1, 1)
    assert packed.gemm.grid == (132, 1, 1), "persistent: a block an SM"
    assert packed.gemm.scalars == (8, 64, 64, 128, 128)
    # the copy engine's boxes: A, 128 pixels by 64 channels of the (copied) input; B, 64 columns by 64 channels
    pixels, weight = packed.gemm.tensor_maps
    assert (pixels.pointer, weight.pointer) == (0, 1)
    assert pixels.dims == (256, 8 * 64 * 64, 1, 1) and pixels.strides[0] == 256 * 2 and pixels.box == (64, 128, 1, 1)
    assert weight.dims == (512, 256, 1, 1) and weight.strides[0] == 512 * 2 and weight.box == (64, 64, 1, 1)
    assert pixels.box_bytes + 128 // 64 * weight.box_bytes == scatter_gemm.HEURISTIC.stage_bytes()


@pytest.mark.parametrize("name", sorted(scatter_gemm.TILES))
def test_every_tile_fits_shared_memory_and_registers(name):
    tile = scatter_gemm.TILES[name]
    stages = scatter_gemm.stages_for(tile)
    assert stages >= 4 and stages * tile.stage_bytes() <= scatter_gemm.wgmma.SMEM_LIMIT
    assert tile.mb * tile.bn // 2 <= 128, "a consumer thread's accumulators"
    plan = scatter_gemm.plan_forward(UNET_UP, "float16", False, "nhwc", tile).gemm
    assert plan.smem_bytes == stages * tile.stage_bytes()
    assert dict(plan.spec.constants)["STAGES"] == stages


def test_small_layers_launch_a_block_a_tile():
    g = _layer((1, 64, 3, 3), (64, 64, 2, 2), stride=2)   # 9 pixels, 256 columns: two 128 x 128 tiles
    assert scatter_gemm.tile_count(g, scatter_gemm.HEURISTIC) == 2
    assert scatter_gemm.plan_forward(g, "float16", False, "nhwc").gemm.grid == (2, 1, 1)


def test_options_skip_tiles_that_would_be_mostly_padding():
    narrow = _layer((2, 64, 5, 7), (64, 8, 1, 1))   # 8 columns
    assert scatter_gemm.options(narrow) == [{}, {"tile": "128x64"}]
    assert len(scatter_gemm.options(UNET_UP)) == len(scatter_gemm.TILES)


def test_the_forward_leads_with_it_in_nchw_where_tiles_are_many_and_races_the_others():
    for g in (UNET_UP, UNET_UP.with_weight_channels_last()):
        for dtype in ("float16", "bfloat16"):
            # NCHW: it leads; channels_last: the halo-tile kernel leads (NOTES v44) and it races
            nchw = table.candidates("forward", g, dtype, "nchw")
            assert nchw[0] == Variant("scatter_gemm") and any(v.family == "wgmma" for v in nchw)
            nhwc = table.candidates("forward", g, dtype, "nhwc")
            assert nhwc[0].family == "wgmma" and any(v.family == "scatter_gemm" for v in nhwc)
    # a 1 x 1 input of 16 images makes 64 tiles: the split GEMM leads, the scatter GEMM races it
    assert scatter_gemm.tile_count(ONE_PIXEL, scatter_gemm.HEURISTIC) < 2 * ASSUMED.sm_count
    cands = table.candidates("forward", ONE_PIXEL, "bfloat16", "nhwc")
    assert cands[0].family == "gemm" and any(v.family == "scatter_gemm" for v in cands)
    # float32 keeps the other families; so do other GPUs (sm_90a code only) and layers with overlapping taps
    assert all(v.family != "scatter_gemm" for v in table.candidates("forward", UNET_UP, "float32", "nhwc", "tf32"))
    ampere = dataclasses.replace(ASSUMED, arch="80", tensor_cores=MMA_SYNC)
    assert all(f.name != "scatter_gemm" for f in table.eligible("forward", UNET_UP, "float16", "nhwc", ampere))
    overlapping = _layer((8, 256, 16, 16), (256, 128, 4, 4), stride=2, padding=1)
    assert all(v.family != "scatter_gemm" for v in table.candidates("forward", overlapping, "float16", "nhwc"))
    # grad_weight is other families'
    assert all(f.name != "scatter_gemm" for f in table.eligible("grad_weight", UNET_UP, "float16", "nhwc"))


def test_unaligned_pointers_take_the_gemm(monkeypatch):
    planned = table.plan("forward", Variant("scatter_gemm"), UNET_UP.with_weight_channels_last(), "bfloat16",
                         "nhwc", "strict", True, False)
    assert [p.spec.function for p in planned.plans()] == \
        [p.spec.function for p in gemm.plan_forward_gemm(UNET_UP.with_weight_channels_last(), "bfloat16", True,
                                                         "nhwc", "strict", aligned=False).plans()]
    monkeypatch.setenv(gemm.TENSOR_CORES_ENV, "0")
    assert not scatter_gemm.FAMILY.eligible("forward", UNET_UP, "float16", "nhwc", ASSUMED)


@pytest.mark.parametrize("weight_cl", [False, True], ids=["w", "w_cl"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_grad_input_plan_copies_only_what_is_not_channels_last(layout, weight_cl):
    g = UNET_UP.with_weight_channels_last(weight_cl)
    packed = scatter_gemm.plan_grad_input(g, "float16", layout)
    assert packed.gemm.spec.function == "conv_transpose2d_gather_gemm" and packed.reduce is None
    assert (packed.pack is None) is weight_cl
    if not weight_cl:
        assert packed.pack == scatter_gemm.plan_forward(g, "float16", False, layout).pack, "the forward's weight copy"
    if layout == "nhwc":
        assert packed.to_channels_last is None
    else:
        # grad_output's copy: 8 images of 128 channels over 128 x 128 pixels, the copy grad_weight shares
        assert packed.to_channels_last == gemm.plan_to_channels_last(8, 128, 128 * 128, "float16")
    constants = dict(packed.gemm.spec.constants)
    assert constants["WEIGHT_CL"] is True and constants["DST_CL"] is (layout == "nhwc")
    assert "HAS_BIAS" not in constants
    assert packed.gemm.spec.target == "sm_90a" and packed.gemm.block == (384, 1, 1)
    assert packed.gemm.grid == (132, 1, 1)
    assert packed.gemm.scalars == (8, 64, 64, 128, 128)
    # B, the weight as 256 rows of 4 x 128 (tap, channel) columns, lands a box of 128 rows by 64 columns a step;
    # A, 128 output channels (whole 64-channel steps in one tap), a box of grad_output's 2 x 64 pixels walked at
    # stride 2: the tile's two rows of input pixels
    weight_map, grad_output_map = packed.gemm.tensor_maps
    assert weight_map.pointer == 1, "the weight (or its copy): the launch's second pointer"
    assert weight_map.dims == (512, 256, 1, 1) and weight_map.strides[0] == 512 * 2
    assert weight_map.box == (64, 128, 1, 1) and weight_map.swizzle == 128
    assert weight_map.box_bytes == scatter_gemm.HEURISTIC.bn * scatter_gemm.ROW_BYTES
    assert grad_output_map.pointer == 0 and grad_output_map.dims == (128, 128, 128, 8)
    assert grad_output_map.box == (64, 128, 4, 1) and grad_output_map.element_strides == (1, 2, 2, 1)
    assert grad_output_map.box_bytes == 128 * scatter_gemm.ROW_BYTES
    assert (constants["A_BOXES"], constants["BOX_H"], constants["BOX_W"]) == (True, 2, 64)


def test_grad_input_tiles_its_input_channels():
    """grad_input's GEMM is input pixels x input channels (256 here), K its (tap, output channel) pairs."""
    assert scatter_gemm.columns(UNET_UP, "grad_input") == 256 and scatter_gemm.columns(UNET_UP) == 512
    tile = scatter_gemm.TILES["64x256"]
    assert scatter_gemm.tile_count(UNET_UP, tile, "grad_input") == 8 * 64 * 64 // 64
    narrow = _layer((2, 16, 5, 7), (16, 64, 2, 2), stride=2)   # 16 input channels, 256 (tap, channel) columns
    assert scatter_gemm.options(narrow, "grad_input") == [{}, {"tile": "128x64"}]
    assert len(scatter_gemm.options(narrow)) == len(scatter_gemm.TILES)
    for name, tile in scatter_gemm.TILES.items():
        plan = scatter_gemm.plan_grad_input(UNET_UP, "bfloat16", "nhwc", tile).gemm
        assert plan.smem_bytes == scatter_gemm.stages_for(tile) * tile.stage_bytes()
        assert (dict(plan.spec.constants)["MB"], dict(plan.spec.constants)["BN"]) == (tile.mb, tile.bn)


def test_grad_input_on_the_table():
    for dtype in ("float16", "bfloat16"):
        assert table.candidates("grad_input", UNET_UP, dtype, "nhwc")[0] == Variant("scatter_gemm")
        assert any(v.family == "wgmma" for v in table.candidates("grad_input", UNET_UP, dtype, "nhwc"))
    # overlapping taps: the gather leads on layers like DCGAN's (two taps a phase, 512 input channels, 128 tiles),
    # and races the halo tiles where its tiles make under half a wave or a phase has three taps or more
    for layout in ("nchw", "nhwc"):
        assert table.candidates("grad_input", DCGAN_UP, "bfloat16", layout)[0] == Variant("scatter_gemm")
    few_tiles = _layer((8, 256, 16, 16), (256, 128, 4, 4), stride=2, padding=1)    # 32 tiles (64 of 64 x 128)
    dense_3x5 = _layer((16, 128, 64, 64), (128, 128, 3, 5))                        # 15 taps a phase
    narrow = _layer((64, 64, 32, 32), (64, 64, 4, 4), stride=2, padding=1)         # 64 input channels
    for g in (few_tiles, dense_3x5, narrow):
        assert not scatter_gemm.FAMILY.leads("grad_input", g, "float16", "nhwc")
        cands = table.candidates("grad_input", g, "float16", "nhwc")
        assert cands[0].family == "wgmma" and any(v.family == "scatter_gemm" for v in cands)
    assert scatter_gemm.tile_count(few_tiles, scatter_gemm.HEURISTIC, "grad_input") == 32
    assert scatter_gemm.tile_count(dense_3x5, scatter_gemm.HEURISTIC, "grad_input") >= ASSUMED.sm_count
    assert scatter_gemm.tile_count(narrow, scatter_gemm.HEURISTIC, "grad_input") >= ASSUMED.sm_count
    # unaligned grad_output: the mma.sync GEMM, as the pinned variant's plan
    planned = table.plan("grad_input", Variant("scatter_gemm"), UNET_UP, "float16", "nhwc", "strict", False, False)
    assert planned == gemm.plan_grad_input_gemm(UNET_UP, "float16", "nhwc", "strict", aligned=False)


@pytest.mark.parametrize("x_shape,w_shape,kwargs,box,boxes", [
    ((8, 256, 64, 64), (256, 128, 2, 2), dict(stride=2), (1, 2, 64), True),     # two image rows a tile
    ((8, 1024, 16, 16), (1024, 512, 2, 2), dict(stride=2), (1, 8, 16), True),    # eight
    ((16, 512, 1, 1), (512, 512, 4, 4), dict(stride=2, padding=1), (128, 1, 1), True),   # 128 one-pixel images
    # 48 channels: steps cross taps; three tiles either way, and columns within the image's nine
    ((3, 64, 7, 9), (64, 48, 2, 2), dict(stride=2), (4, 8, 4), False),
    ((2, 64, 5, 300), (64, 64, 9, 9), dict(stride=9), (2, 1, 64), False),        # stride 9: past the copy engine;
    # 300 columns: 64 a tile leave 20 past the edge, where 128 would leave 84
    ((1, 64, 64, 64), (64, 64, 8, 8), dict(stride=8), (1, 4, 32), True),        # 8 x 32 = 256: the widest box
    ((1, 64, 64, 64), (64, 48, 8, 8), dict(stride=8), (1, 2, 64), False),        # no box: rows of 64
])
def test_grad_input_tiles_are_boxes_of_pixels_with_the_fewest_past_the_edges(x_shape, w_shape, kwargs, box, boxes):
    g = _layer(x_shape, w_shape, **kwargs)
    assert scatter_gemm.pixel_box(g, scatter_gemm.HEURISTIC) == box
    assert scatter_gemm.grad_output_boxes(g) is boxes
    images, rows, cols = box
    assert images * rows * cols == 128
    pixel_tiles = -(-g.batch // images) * -(-g.in_size[0] // rows) * -(-g.in_size[1] // cols)
    assert scatter_gemm.tile_count(g, scatter_gemm.HEURISTIC, "grad_input") == \
        pixel_tiles * -(-g.in_channels // scatter_gemm.HEURISTIC.bn)
    plan = scatter_gemm.plan_grad_input(g, "bfloat16", "nhwc", scatter_gemm.HEURISTIC).gemm
    assert len(plan.tensor_maps) == (2 if boxes else 1)
    if boxes:
        sh, sw = g.params.stride
        assert plan.tensor_maps[1].box == (64, sw * cols, sh * rows, images)


@pytest.mark.parametrize("weight_cl", [False, True], ids=["w", "w_cl"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_tf32_grad_input_plans_rounded_copies_of_both_operands(layout, weight_cl):
    """float32 grad_input at TF32 multiplies operands rounded to nearest: grad_output's channels_last copy rounds
    (NCHW), or a rounding copy replaces reading it in place (channels_last); the same for the weight.  A step is
    32 float32 columns, so grad_output's boxes and the weight's are 32 values (128 bytes) wide."""
    g = DCGAN_UP.with_weight_channels_last(weight_cl)
    assert scatter_gemm.eligible(g, "float32", "grad_input", "tf32")
    assert not scatter_gemm.eligible(g, "float32", "grad_input", "strict"), "3xTF32 needs every bit"
    assert not scatter_gemm.eligible(UNET_UP, "float32", "forward", "tf32"), "the forward's B is MN-major"
    packed = scatter_gemm.plan_grad_input(g, "float32", layout)
    words = 64 * 256 * 16 * 16
    if layout == "nchw":
        assert packed.to_channels_last == gemm.plan_to_channels_last(64, 256, 16 * 16, "float32", round_tf32=True)
    else:
        assert packed.to_channels_last == gemm.plan_round_tf32(words)
    if weight_cl:
        assert packed.pack == gemm.plan_round_tf32(512 * 256 * 16)
    else:
        assert packed.pack == gemm.plan_to_channels_last(512, 256, 16, "float32", round_tf32=True)
    constants = dict(packed.gemm.spec.constants)
    assert constants["MMA_KIND"] == 2 and constants["SCALAR_T"] == "float" and constants["A_BOXES"]
    weight_map, grad_output_map = packed.gemm.tensor_maps
    assert weight_map.dtype == grad_output_map.dtype == "float32"
    assert weight_map.box == (32, 128, 1, 1) and weight_map.box_bytes == scatter_gemm.HEURISTIC.bn * 128
    assert grad_output_map.box[0] == 32 and grad_output_map.box_bytes == 128 * scatter_gemm.ROW_BYTES
    assert scatter_gemm.row_elements("float32") == 32 and scatter_gemm.row_elements("bfloat16") == 64


def test_tf32_grad_input_leads_where_16_bit_leads_and_strict_float32_never_takes_it():
    """TF32 follows the 16-bit rules (NOTES v46): it leads on the one-tap U-Net layer and on DCGAN's two taps a
    phase (reading a channels_last grad_output in place), and races where the halo tile shares pixels among many
    taps or input channels are few.  Strict float32 never takes it, pinned or not."""
    dense_3x5 = _layer((16, 128, 64, 64), (128, 128, 3, 5))
    narrow = _layer((64, 64, 32, 32), (64, 64, 4, 4), stride=2, padding=1)
    for layout in ("nchw", "nhwc"):
        for g, leads in ((UNET_UP, True), (DCGAN_UP, True), (dense_3x5, False), (narrow, False)):
            cands = table.candidates("grad_input", g, "float32", layout, "tf32")
            assert (cands[0].family == "scatter_gemm") is leads, (g.input_shape, layout)
            assert cands[0].kwargs.get("inplace", False) is (leads and layout == "nhwc"), cands[0]
            assert Variant("scatter_gemm") in cands
            assert scatter_gemm.FAMILY.leads("grad_input", g, "float32", layout, "tf32") is leads
            strict = table.candidates("grad_input", g, "float32", layout, "strict")
            assert all(v.family != "scatter_gemm" for v in strict)
    pinned = table.plan("grad_input", Variant("scatter_gemm"), DCGAN_UP, "float32", "nhwc", "tf32")
    assert pinned.gemm.spec.function == "conv_transpose2d_gather_gemm"
    with pytest.raises(ValueError, match="TF32"):
        table.plan("grad_input", Variant("scatter_gemm"), DCGAN_UP, "float32", "nhwc", "strict")


def test_grad_input_of_under_half_a_wave_runs_twice_the_tiles_of_64_pixels():
    """grad_input's heuristic tile is 128 x 128 down to half a wave of tiles, and 64 x 128 below it (pix2pix's 8²
    layer: 64 tiles of 128 pixels, 128 of 64); the forward's is always 128 x 128."""
    pix2pix_8 = _layer((16, 1024, 8, 8), (1024, 512, 4, 4), stride=2, padding=1)
    assert scatter_gemm.tile_count(pix2pix_8, scatter_gemm.HEURISTIC, "grad_input") == 64
    assert scatter_gemm.heuristic_tile(pix2pix_8, "grad_input") == scatter_gemm.TILES["64x128"]
    assert scatter_gemm.tile_count(pix2pix_8, scatter_gemm.TILES["64x128"], "grad_input") == 128
    assert scatter_gemm.tile_count(DCGAN_UP, scatter_gemm.HEURISTIC, "grad_input") == 128
    for g in (DCGAN_UP, UNET_UP):
        assert scatter_gemm.heuristic_tile(g, "grad_input") == scatter_gemm.HEURISTIC
    assert scatter_gemm.heuristic_tile(ONE_PIXEL, "forward") == scatter_gemm.HEURISTIC
    for dtype in ("bfloat16", "float32"):
        untuned = scatter_gemm.plan_grad_input(pix2pix_8, dtype, "nhwc").gemm
        pinned = scatter_gemm.plan_grad_input(pix2pix_8, dtype, "nhwc", scatter_gemm.TILES["64x128"]).gemm
        assert untuned == pinned and (dict(untuned.spec.constants)["MB"], untuned.grid) == (1, (128, 1, 1))
        # the heuristic now leads there; the 128 x 128 tile stays a candidate, the 64 x 128 is not listed twice
        precision = "tf32" if dtype == "float32" else "strict"
        cands = table.candidates("grad_input", pix2pix_8, dtype, "nhwc", precision)
        if dtype == "float32":   # read in place first, on the same tile
            assert cands[0] == Variant.make("scatter_gemm", tile="64x128", inplace=True)
            cands = tuple(v for v in cands if not v.kwargs.get("inplace"))
        assert cands[0] == Variant("scatter_gemm") and Variant.make("scatter_gemm", tile="128x128") in cands
        assert Variant.make("scatter_gemm", tile="64x128") not in cands


def test_tf32_grad_input_can_read_a_channels_last_grad_output_in_place():
    """The ``inplace`` option drops the rounding copy of a channels_last grad_output (the consumers round A in
    registers) and keeps the weight's; it plans for TF32 grad_input in channels_last only."""
    in_place = Variant.make("scatter_gemm", inplace=True)
    for weight_cl in (False, True):
        g = DCGAN_UP.with_weight_channels_last(weight_cl)
        packed = table.plan("grad_input", in_place, g, "float32", "nhwc", "tf32")
        copied = table.plan("grad_input", Variant("scatter_gemm"), g, "float32", "nhwc", "tf32")
        assert packed.to_channels_last is None and copied.to_channels_last == gemm.plan_round_tf32(64 * 256 * 16 * 16)
        assert packed.pack == copied.pack is not None, "the weight still arrives rounded"
        constants = dict(packed.gemm.spec.constants)
        assert constants["A_IN_PLACE"] and not dict(copied.gemm.spec.constants)["A_IN_PLACE"]
        assert {k: v for k, v in constants.items() if k != "A_IN_PLACE"} == \
            {k: v for k, v in dict(copied.gemm.spec.constants).items() if k != "A_IN_PLACE"}
        assert packed.gemm.tensor_maps == copied.gemm.tensor_maps and packed.gemm.grid == copied.gemm.grid
    pinned_tile = table.plan("grad_input", Variant.make("scatter_gemm", tile="64x256", inplace=True), DCGAN_UP,
                             "float32", "nhwc", "tf32")
    assert (dict(pinned_tile.gemm.spec.constants)["BN"], pinned_tile.to_channels_last) == (256, None)
    for dtype, layout, precision in (("float32", "nchw", "tf32"), ("bfloat16", "nhwc", "strict")):
        with pytest.raises(ValueError, match="in place"):
            table.plan("grad_input", in_place, DCGAN_UP, dtype, layout, precision)
    with pytest.raises(ValueError, match="inplace"):
        table.plan("forward", in_place, UNET_UP, "bfloat16", "nhwc")


def test_tf32_channels_last_grad_input_reads_in_place_first():
    """Where the gather reads a channels_last TF32 grad_output in place, two in-place tiles come first (the first
    the heuristic), then the rounding copy's heuristic and another of its tiles; NCHW and 16-bit layers have no
    in-place option.  The first in-place tile holds two steps of A in registers: the 64 x 256 tile in place of
    128 x 128, 64 x 128 where 256 columns would be mostly padding or under half a wave of tiles."""
    narrow = _layer((8, 128, 64, 64), (128, 64, 2, 2), stride=2)
    few_tiles = _layer((1, 256, 16, 16), (256, 128, 2, 2), stride=2)
    assert scatter_gemm.heuristic_tile(few_tiles, "grad_input") == scatter_gemm.FEW_TILES
    for g, first in ((DCGAN_UP, "64x256"), (UNET_UP, "64x256"), (narrow, "64x128"), (few_tiles, "64x128")):
        cands = table.candidates("grad_input", g, "float32", "nhwc", "tf32")
        names = [v.name for v in cands if v.family == "scatter_gemm"]
        assert names[0] == f"scatter_gemm:{first}:inplace", names
        assert [n.endswith(":inplace") for n in names] == [True, True, False, False], names
        assert "scatter_gemm" in names, "the rounding copy's heuristic still races"
        assert all(scatter_gemm.TILES[v.kwargs["tile"]].registers_a_twice for v in cands if v.kwargs.get("inplace"))
        if table.candidates("grad_input", g, "float32", "nhwc", "tf32")[0].family == "scatter_gemm":
            assert cands[0].kwargs.get("inplace")
    assert not scatter_gemm.TILES["128x128"].registers_a_twice
    assert all(t.registers_a_twice for n, t in scatter_gemm.TILES.items() if n != "128x128")
    for dtype, layout, precision in (("float32", "nchw", "tf32"), ("bfloat16", "nhwc", "strict")):
        assert not any(v.kwargs.get("inplace") for v in table.candidates("grad_input", DCGAN_UP, dtype, layout,
                                                                           precision))
