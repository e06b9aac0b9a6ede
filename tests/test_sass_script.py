"""scripts/sass.py without a GPU or a disassembler: which kernels it checks and how it reads their SASS."""
from __future__ import annotations

import pytest

import script_modules
from cupyconv.plans import scatter_gemm


@pytest.fixture(scope="module")
def sass():
    with script_modules.loaded("scripts/sass.py") as module:
        yield module


def test_it_checks_every_tile_of_both_kernels_on_each_grad_output_path(sass):
    specs = sass.specs()
    constants = {name: dict(spec.constants) for name, spec in specs.items()}
    for function in ("conv_transpose2d_scatter_gemm", "conv_transpose2d_gather_gemm"):
        tiles = {(c["MB"], c["BN"]) for name, c in constants.items() if specs[name].function == function}
        assert tiles == {(t.mb, t.bn) for t in scatter_gemm.TILES.values()}, function
    gather = [c for name, c in constants.items() if specs[name].function == "conv_transpose2d_gather_gemm"]
    # one tap a pixel and overlapping taps, by copy-engine boxes and by gathered rows, cropped, dilated
    assert {(c["KH"] > c["SH"], c["A_BOXES"]) for c in gather} == {(a, b) for a in (True, False) for b in (True, False)}
    assert any(c["PH"] > 0 and not c["A_BOXES"] for c in gather) and any(c["DH"] > 1 for c in gather)
    assert {spec.target for spec in specs.values()} == {"sm_90a"}
    assert {c["MMA_KIND"] for c in gather} == {0, 1, 2}, "fp16, bf16 and TF32"
    # TF32 through rounding copies and reading grad_output in place, A from registers, on every tile
    in_place = [c for c in gather if c["A_IN_PLACE"]]
    assert {c["MMA_KIND"] for c in in_place} == {2}
    assert {(c["MB"], c["BN"]) for c in in_place} == {(t.mb, t.bn) for t in scatter_gemm.TILES.values()}
    assert any(c["MMA_KIND"] == 2 and not c["A_IN_PLACE"] for c in gather)


def test_it_counts_warpgroup_mmas_and_local_memory(sass):
    listing = """
        /*0a10*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0a20*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0a30*/                   STL.64 [R1], R2 ;
        /*0a40*/                   LDL R3, [R1+0x4] ;
        /*0a50*/                   LDS.128 R8, [R2] ;
    """
    assert sass.inspect(listing) == (1, 2)
    assert sass.inspect("        /*0000*/ LDG.E.128 R4, desc[UR4][R2.64] ;") == (0, 0)
