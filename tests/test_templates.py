"""Template discovery and rendering (pure Python, no GPU, no NVRTC)."""
import re

import pytest

from cupyconv.jit import templates

EXPECTED = {
    "conv_transpose2d_forward.cu",
    "conv_transpose2d_grad_input.cu",
    "conv_transpose2d_grad_weight.cu",
    "conv_transpose2d_grad_bias.cu",
    "reduce_partials.cu",
    "conv_transpose2d_forward_nhwc.cu",
    "conv_transpose2d_grad_input_nhwc.cu",
    "conv_transpose2d_grad_weight_nhwc.cu",
}
GEMM = {"conv_transpose2d_igemm.cu", "conv_transpose2d_grad_weight_igemm.cu"}
DATA_MOVEMENT = {"pack_weight.cu", "to_channels_last.cu", "to_image_quads.cu", "round_tf32.cu"}
LARGE_KERNEL = {"conv_transpose2d_large_kernel_forward.cu", "conv_transpose2d_large_kernel_grad_input.cu",
                "conv_transpose2d_large_kernel_grad_weight.cu"}
WGMMA = {"conv_transpose2d_wgmma.cu"}
SCATTER_GEMM = {"conv_transpose2d_scatter_gemm.cu"}
GATHER_GEMM = {"conv_transpose2d_gather_gemm.cu"}
WGMMA_GRAD_WEIGHT = {"conv_transpose2d_grad_weight_wgmma.cu"}
WGMMA_TF32_GRAD_WEIGHT = {"conv_transpose2d_grad_weight_wgmma_tf32.cu"}
TAP_MAJOR_REDUCE = {"reduce_tap_major_partials.cu"}   # its tile follows its tap count, not a setting
TILED = {"conv_transpose2d_forward_tiled.cu"}
EXPANDED_TAPS = {"conv_transpose2d_grad_input_expanded_taps.cu", "conv_transpose2d_grad_weight_expanded_taps.cu"}
GROUPED_MMA = {"conv_transpose2d_forward_grouped_mma.cu", "conv_transpose2d_grad_input_grouped_mma.cu",
               "conv_transpose2d_grad_weight_grouped_mma.cu"}
THIN_MMA = {"conv_transpose2d_forward_thin_mma.cu"}
DEPTHWISE = {"conv_transpose2d_depthwise_nhwc.cu"}
# the constants of kernels/include/layer.cuh: every layer template takes them
LAYER = frozenset({"KH", "KW", "SH", "SW", "PH", "PW", "DH", "DW", "GROUPS", "CIN_G", "COUT_G",
                   "WEIGHT_CL"})


def test_every_template_is_found():
    assert set(templates.template_names()) == (EXPECTED | GEMM | DATA_MOVEMENT | LARGE_KERNEL | WGMMA | WGMMA_GRAD_WEIGHT
                                               | WGMMA_TF32_GRAD_WEIGHT | TAP_MAJOR_REDUCE | TILED | SCATTER_GEMM | GATHER_GEMM
                                               | EXPANDED_TAPS | GROUPED_MMA | THIN_MMA | DEPTHWISE)
    assert (templates.kernels_dir() / "include" / "common.cuh").is_file()
    assert (templates.kernels_dir() / "include" / "mma.cuh").is_file()
    assert (templates.kernels_dir() / "include" / "wgmma.cuh").is_file()


def test_the_wgmma_grad_weight_template_inlines_the_mma_headers():
    name, = WGMMA_GRAD_WEIGHT
    text = templates.expanded(name)
    assert "#include" not in text
    # both producers: the copy engine's tensor copies, and cp.async where the plan gives no tensor maps
    assert "wgmma_async" in text and "smem_descriptor" in text and "cp_async_16" in text and "tensor_copy_4d" in text
    tile = {"MMA_KIND", "WARPGROUPS", "BN", "TAP_GROUP", "TAP_CHUNKS", "SKIP_ABSENT_TAPS", "TILE_H", "TILE_W", "SPAN_H",
            "SPAN_W", "STAGES", "SINGLE_CHUNK", "TMA", "MIN_BLOCKS", "PRODUCER_REGISTERS"}
    assert {"SCALAR_T", "INDEX_T"} | LAYER | tile == templates.placeholders(name)


def test_the_tf32_grad_weight_template_inlines_its_headers_and_takes_no_layout():
    name, = WGMMA_TF32_GRAD_WEIGHT
    text = templates.expanded(name)
    assert "#include" not in text
    # wgmma.cuh, cp.async, and the phase-tap helpers shared with the 16-bit kernel
    assert "wgmma_async" in text and "cp_async_16" in text and "find_phase_taps" in text
    tile = {"WARPGROUPS", "BN", "TAP_GROUP", "TAP_CHUNKS", "TILE_H", "TILE_W", "QUADS", "SPAN_H", "SPAN_W",
            "STAGES", "SINGLE_CHUNK", "SPLIT_TF32"}
    assert {"SCALAR_T", "INDEX_T"} | LAYER | tile == templates.placeholders(name), "its sources come packed"


def test_the_image_quad_pack_rounds_by_bits_and_takes_the_layout():
    text = templates.expanded("to_image_quads.cu")
    assert "#include" not in text and "round_tf32_bits" in text and "asm" not in text, "builds for any architecture"
    assert templates.placeholders("to_image_quads.cu") == {"INDEX_T", "NHWC", "VEC4", "SPLIT_TF32"}


def test_the_tiled_forward_takes_the_layer_and_its_tile():
    name, = TILED
    assert "#include" not in templates.expanded(name)
    tile = {"HAS_BIAS", "OCB", "TILE_R", "TILE_V", "VEC", "TX", "TY", "IC_CHUNK", "MIN_BLOCKS", "PAIRS"}
    assert {"SCALAR_T", "INDEX_T"} | LAYER | tile == templates.placeholders(name)


def test_the_tap_major_reduce_takes_its_types_tap_count_and_loads():
    name, = TAP_MAJOR_REDUCE
    assert "#include" not in templates.expanded(name) and "store(" in templates.expanded(name)
    assert templates.placeholders(name) == {"SCALAR_T", "INDEX_T", "TAPS", "VEC", "CHUNKS_AT_ONCE", "RUNS"}


@pytest.mark.parametrize("name", sorted(WGMMA))
def test_wgmma_templates_inline_the_mma_headers(name):
    text = templates.expanded(name)
    assert "#include" not in text
    assert "wgmma_async" in text and "smem_descriptor" in text and "MMA_F16" in text   # wgmma.cuh, mma.cuh
    tile = {"MMA_KIND", "TILE_IMAGES", "TILE_H", "TILE_W", "WARPGROUPS", "BN", "CK", "HALO_H", "HALO_W"}
    assert {"SCALAR_T", "INDEX_T", "DST_CL", "HAS_BIAS"} | LAYER | tile <= templates.placeholders(name)


def test_the_scatter_gemm_template_inlines_the_mma_headers():
    name, = SCATTER_GEMM
    text = templates.expanded(name)
    assert "#include" not in text
    assert "wgmma_async" in text and "smem_descriptor_swizzle_128b" in text and "cp_async_arrive" in text
    tile = {"MMA_KIND", "MB", "BN", "STAGES"}
    assert {"SCALAR_T", "INDEX_T", "DST_CL", "HAS_BIAS"} | LAYER | tile == templates.placeholders(name)


def test_the_gather_gemm_template_shares_the_scatter_gemms_block():
    name, = GATHER_GEMM
    text = templates.expanded(name)
    assert "#include" not in text
    assert "struct PingPongGemm" in text and "struct PingPongGemm" in templates.expanded(next(iter(SCATTER_GEMM)))
    assert "wgmma_async" in text and "cp_async_arrive" in text and "wgmma_async_a_registers" in text
    assert {"SCALAR_T", "INDEX_T", "DST_CL", "MMA_KIND", "MB", "BN", "STAGES", "A_BOXES", "BOX_W", "BOX_H",
            "A_IN_PLACE"} | LAYER == templates.placeholders(name)


@pytest.mark.parametrize("name", sorted(EXPANDED_TAPS))
def test_the_expanded_taps_templates_inline_the_mma_and_expansion_headers(name):
    text = templates.expanded(name)
    assert "#include" not in text
    assert "ldmatrix_x4_trans" in text and "struct ExpandedTapsRuns" in text and "weight_index" in text
    tile = {"MMA_KIND", "NCHW", "TP"} | ({"BM", "STAGES", "SINGLE_CHUNK"} if "grad_weight" in name else {"BN"})
    assert {"SCALAR_T", "INDEX_T"} | LAYER | tile == templates.placeholders(name)


def test_the_thin_mma_template_inlines_the_mma_header():
    name, = THIN_MMA
    text = templates.expanded(name)
    assert "#include" not in text and "ldmatrix_x4" in text and "weight_index" in text and "cp_async_4" in text
    assert {"SCALAR_T", "INDEX_T", "HAS_BIAS", "MMA_KIND", "PR", "MI", "NI", "VEC", "STAGES"} | LAYER == templates.placeholders(name)


def test_the_depthwise_template_takes_its_patch_and_channel_runs():
    name, = DEPTHWISE
    text = templates.expanded(name)
    assert "#include" not in text and "store_run" in text and "weight_index" in text
    tile = {"MODE", "ROWS", "COLS", "VEC", "CV_BLOCK", "TILES_BLOCK", "HAS_BIAS", "MIN_BLOCKS"}
    assert {"SCALAR_T", "INDEX_T"} | LAYER | tile == templates.placeholders(name)


@pytest.mark.parametrize("name", sorted(GEMM))
def test_gemm_templates_inline_the_mma_header(name):
    text = templates.expanded(name)
    assert '#include "mma.cuh"' not in text and "ldmatrix_x4" in text and "warp_sum" in text
    assert {"SCALAR_T", "INDEX_T", "MMA_KIND", "BM", "BN"} <= templates.placeholders(name)
    layouts = {"CHANNELS_LAST"} if "grad_weight" in name else {"SRC_CL", "DST_CL", "STAGES"}
    assert layouts <= templates.placeholders(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_includes_are_inlined_and_placeholders_listed(name):
    text = templates.expanded(name)
    assert '#include "common.cuh"' not in text
    assert "warp_sum" in text  # from common.cuh
    needed = templates.placeholders(name)
    assert {"SCALAR_T", "INDEX_T"} <= needed
    assert "ACC_T" not in needed  # the accumulator follows from the storage type (common.cuh)
    # the block size: given, or (channels_last kernels) a channel tile times its pixel runs
    assert "BLOCK" in needed or {"RUNS"} <= needed


def test_layer_templates_take_every_layer_constant():
    for name in ("conv_transpose2d_forward.cu", "conv_transpose2d_grad_input.cu", "conv_transpose2d_grad_weight.cu"):
        assert LAYER <= templates.placeholders(name), name
        # output_padding only sizes the output, which the host passes at run time
        assert not {"OPH", "OPW"} & templates.placeholders(name), name


def _constants(name, **overrides):
    values = {k: 1 for k in templates.placeholders(name)}
    values.update(SCALAR_T="float", INDEX_T="int", HAS_BIAS=True, BLOCK=128)
    values = {k: v for k, v in values.items() if k in templates.placeholders(name)}
    values.update(overrides)
    return values


def test_render_substitutes_everything():
    src = templates.render("conv_transpose2d_forward.cu", _constants("conv_transpose2d_forward.cu", KH=3, KW=5))
    assert "{{" not in src
    assert "constexpr int KH = 3, KW = 5;" in src
    assert "constexpr bool HAS_BIAS = true;" in src
    assert src.startswith("// cupyconv kernel conv_transpose2d_forward.cu:")


def test_render_rejects_missing_and_unknown_constants():
    constants = _constants("reduce_partials.cu")
    missing = dict(constants)
    missing.pop("BLOCK")
    with pytest.raises(KeyError, match="BLOCK"):
        templates.render("reduce_partials.cu", missing)
    with pytest.raises(KeyError, match="NOT_A_CONSTANT"):
        templates.render("reduce_partials.cu", {**constants, "NOT_A_CONSTANT": 1})


def test_render_rejects_values_that_are_not_constants():
    with pytest.raises(TypeError):
        templates.render("reduce_partials.cu", _constants("reduce_partials.cu", SCALAR_T="float; evil()"))
    with pytest.raises(TypeError):
        templates.render("reduce_partials.cu", _constants("reduce_partials.cu", BLOCK=1.5))


def test_unknown_template():
    with pytest.raises(ValueError, match="no kernel template"):
        templates.expanded("nope.cu")


def test_content_hash_tracks_template_text():
    hashes = {n: templates.content_hash(n) for n in EXPECTED}
    assert len(set(hashes.values())) == len(EXPECTED)
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in hashes.values())
