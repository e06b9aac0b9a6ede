"""scripts/sanitize.py without a GPU: its plan, its arguments and how it reads compute-sanitizer."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

import script_modules

SCRIPT = script_modules.ROOT / "scripts" / "sanitize.py"


@pytest.fixture(scope="module")
def san():
    with script_modules.loaded("scripts/sanitize.py") as module:
        yield module


@pytest.fixture(scope="module")
def plan(san):
    cases = san.all_cases()
    specs = {c.name: san.planned_specs(c) for c in cases}
    return cases, specs


def _constants(specs, function):
    return [dict(s.constants) for ss in specs.values() for s in ss if s.function == function]


def test_every_kernel_template_is_planned(san, plan):
    cases, specs = plan
    planned = {s.function for ss in specs.values() for s in ss}
    expected = set(san.template_functions())
    assert {"conv_transpose2d_forward", "conv_transpose2d_igemm", "pack_weight", "reduce_partials"} <= expected
    assert planned == expected


def test_direct_kernels_in_every_dtype(plan):
    _, specs = plan
    for function in ("conv_transpose2d_forward", "conv_transpose2d_grad_input", "conv_transpose2d_grad_weight_partial",
                     "conv_transpose2d_grad_bias_partial", "reduce_partials"):
        assert {c["SCALAR_T"] for c in _constants(specs, function)} == {"float", "double", "half_t", "bf16_t"}, function
    # grad_weight with one and with several kernel-row blocks, and one and several pixels per step
    grad_weight = _constants(specs, "conv_transpose2d_grad_weight_partial")
    assert len({c["KH_BLOCK"] for c in grad_weight}) >= 2
    assert len({c["CELLS"] for c in grad_weight}) >= 2


def test_nchw_forwards_of_thin_layers_run_both_cuda_core_kernels(san, plan):
    """The tiled forward leads on thin NCHW layers: the direct forward is forced where it would not run, and every
    candidate tile of the grouped and depthwise layers runs, with whole-vector and element stores."""
    from cupyconv.plans import tiled

    cases, specs = plan
    by_name = {c.name: c for c in cases}
    for name in ("grouped", "depthwise"):
        forced = by_name[f"direct-{name}-float16-direct-forward"]
        assert "conv_transpose2d_forward" in {s.function for s in specs[forced.name]}
        g = san._geometry(forced)
        planned = {(c["TILE_R"], c["TILE_V"], c["OCB"], c["MIN_BLOCKS"])
                   for case in cases if case.name.endswith(f"-{name}-float16") for c in
                   [dict(s.constants) for s in specs[case.name] if s.function == "conv_transpose2d_forward_tiled"]}
        assert planned == set(tiled.tiles(g, "float16")), name
    stores = {c["VEC"] for c in _constants(specs, "conv_transpose2d_forward_tiled")}
    assert 1 in stores and max(stores) > 1


def test_tensor_core_kernels_in_every_dtype_precision_and_layout(san, plan):
    cases, specs = plan
    igemm = _constants(specs, "conv_transpose2d_igemm")
    for mode in (0, 1):  # forward, grad_input
        assert {c["MMA_KIND"] for c in igemm if c["MODE"] == mode} == {0, 1, 2, 3}
    assert {c["MMA_KIND"] for c in _constants(specs, "conv_transpose2d_grad_weight_igemm")} == {0, 1, 2, 3}
    assert {c["A_VEC"] for c in igemm} == {True, False}
    assert len({(c["BM"], c["BN"]) for c in igemm}) >= 5
    assert len({c["STAGES"] for c in igemm if "STAGES" in c}) >= 2 or not any("STAGES" in c for c in igemm)
    assert {c["ELEMENT_BYTES"] for c in _constants(specs, "pack_weight")} == {2, 4}
    gemm_cases = [c for c in cases if c.name.startswith("gemm-") and c.api == "torch" and not c.variants]
    for dtype, precision in san.GEMM_CASES:
        kinds = {(c.layout, c.unaligned) for c in gemm_cases if (c.dtype, c.precision) == (dtype, precision)}
        assert kinds >= {("nchw", False), ("nhwc", False), ("nhwc", True)}, (dtype, precision)
    assert any(c.nonfinite for c in cases) and any(c.api == "cupy" for c in cases)
    assert any(c.variants for c in cases)


def test_tf32_wgmma_producers_run_both_ways(plan):
    """The halo-tile kernel's TF32 producer hands over a rounded NCHW copy as it lands and rounds a channels_last
    source itself: both run under the tools."""
    _, specs = plan
    tf32 = [c for c in _constants(specs, "conv_transpose2d_wgmma") if c["MMA_KIND"] == 2]
    assert {c["SRC_ROUNDED"] for c in tf32} == {True, False}
    assert True in {c["ROUND_TF32"] for c in _constants(specs, "to_channels_last")}


def test_layers_are_tiny(plan):
    """racecheck is slow: every layer must stay small (the persistent wgmma and scatter GEMM cases need more tiles
    than an H100 has SMs, and two pixels an image so that channels_last is told apart: 8192 input values)."""
    cases, _ = plan
    for c in cases:
        assert math.prod(c.x_shape) <= 8192 and math.prod(c.w_shape) <= 2 ** 16, c.name
        assert math.prod(c.x_shape) <= 4096 or c.name.startswith(("wgmma-persistent", "scatter-gemm-persistent")), \
            c.name


def test_channels_last_cases_have_memory_that_says_so(plan):
    """An input of one pixel or one channel is both NCHW and channels_last, and the op then runs the NCHW
    kernels: a case named nhwc would not test them."""
    cases, _ = plan
    for c in cases:
        if c.layout == "nhwc":
            assert c.x_shape[1] > 1 and c.x_shape[-2] * c.x_shape[-1] > 1, c.name


def test_channels_last_weights_reach_every_template_that_reads_or_writes_weights(plan):
    """Cases with a channels_last weight (one whose memory differs from the contiguous one) plan every kernel that
    takes the weight layout with it, and wgmma's grad_weight both split over K and in one K range of many taps.
    The torch path runs such a layer in channels_last (as cuDNN does), so the takers are the nhwc cases' kernels of
    layers whose weight layout matters: more than one output channel a group (one lies the same either way, and the
    depthwise kernels take it as contiguous)."""
    cases, specs = plan
    cl_cases = [c for c in cases if c.weight_cl]
    assert all(c.w_shape[1] > 1 and c.w_shape[2] * c.w_shape[3] > 1 and c.layout == "nhwc" for c in cl_cases)
    takers = {s.function for c in cases if c.layout == "nhwc" and c.api == "torch" and c.w_shape[1] > 1
              for s in specs[c.name] if "WEIGHT_CL" in dict(s.constants)}
    with_cl = {s.function for c in cl_cases for s in specs[c.name] if dict(s.constants).get("WEIGHT_CL")}
    assert with_cl == takers
    # the one-tap GEMMs read channels_last order whatever the weight's layout (a contiguous one's copy)
    assert not any(dict(s.constants).get("WEIGHT_CL") for c in cases if not c.weight_cl for s in specs[c.name]
                   if s.function not in ("conv_transpose2d_scatter_gemm", "conv_transpose2d_gather_gemm"))
    for function in ("conv_transpose2d_grad_weight_wgmma", "conv_transpose2d_grad_weight_wgmma_tf32"):
        ranges = {(c["SINGLE_CHUNK"], c["KH"] * c["KW"] > 1) for c in _constants(specs, function) if c["WEIGHT_CL"]}
        assert ranges == {(False, True), (True, True)}, function


def test_a_channels_last_weight_case_must_run_channels_last(san):
    with pytest.raises(ValueError, match="nhwc"):
        san.Case("w", (1, 2, 3, 3), (2, 2, 3, 3), (), False, "float32", weight_cl=True)


def test_arguments(san):
    args = san.parse_args(["--tools", "racecheck,memcheck", "--cases", "gemm", "--jobs", "1"])
    assert args.tools == ["racecheck", "memcheck"] and args.cases == "gemm" and args.jobs == 1
    assert san.parse_args([]).tools == list(san.TOOLS)
    for bad in (["--tools", "memcheck,initcheck"], ["--tools", ""], ["--jobs", "0"], ["--timeout", "0"],
                ["--worker"]):
        with pytest.raises(SystemExit) as info:
            san.parse_args(bad)
        assert info.value.code == 2, bad


def test_case_selection(san, capsys):
    cases = san.all_cases()
    assert san.select(cases, "all") == cases
    chosen = san.select(cases, "direct-grouped,tf32-nhwc-unaligned")
    assert chosen and all("direct-grouped" in c.name or "tf32-nhwc-unaligned" in c.name for c in chosen)
    with pytest.raises(ValueError, match="no case"):
        san.select(cases, "no-such-case")
    assert san.main(["--cases", "no-such-case", "--dry-run"]) == san.EXIT_USAGE
    assert san.main(["--list", "--cases", "depthwise"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed and all("depthwise" in name for name in listed)


def test_dry_run_prints_one_command_per_tool(san, capsys):
    assert san.main(["--dry-run", "--tools", "racecheck,synccheck", "--cases", "gemm-dense-float16"]) == 0
    out = capsys.readouterr().out
    assert "--tool racecheck" in out and "--tool synccheck" in out and "--tool memcheck" not in out
    assert "--worker --cases gemm-dense-float16" in out and "conv_transpose2d_igemm[" in out


def test_dry_run_from_the_command_line_needs_no_gpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, cwd="/",
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kernel templates no case reaches" not in proc.stdout
    assert proc.stdout.count("--tool ") == 3


def test_no_sanitizer_is_exit_2(san, monkeypatch, capsys):
    monkeypatch.setattr(san, "find_sanitizer", lambda explicit=None: None)
    assert san.main(["--cases", "direct-grouped-float32"]) == san.EXIT_USAGE
    assert "compute-sanitizer not found" in capsys.readouterr().err


def test_sanitizer_options_follow_its_help(san):
    old = san.sanitizer_options("usage: compute-sanitizer [options]")
    assert old == ["--error-exitcode", str(san.ERROR_EXIT)]
    new = san.sanitizer_options("--show-backtrace <mode>\n--report-api-errors <mode>\n--print-limit <n>")
    assert "--report-api-errors" in new and "--show-backtrace" in new


CLEAN = """\
========= COMPUTE-SANITIZER
plain run output
========= ERROR SUMMARY: 0 errors
"""
MEMCHECK_ERRORS = """\
========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at conv_transpose2d_forward+0x1a0
=========     by thread (5,0,0) in block (0,0,0)
=========     Address 0x7f0c8e000400 is out of bounds
=========
========= Invalid __global__ write of size 2 bytes
=========     at 0x70 in /tmp/kernel.cu:12:pack_weight
=========
========= ERROR SUMMARY: 2 errors
"""
RACECHECK_HAZARDS = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at conv_transpose2d_igemm+0x1230
=========     and Read access at conv_transpose2d_igemm+0x1100 [64 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
RACECHECK_CLEAN = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
UNSUPPORTED = "========= Error: Device not supported\nTraceback (most recent call last):\nRuntimeError: boom\n"


def test_parse_output(san):
    r = san.parse_output("memcheck", CLEAN, 0)
    assert r.clean and r.errors == 0 and not r.by_kernel
    r = san.parse_output("memcheck", MEMCHECK_ERRORS, san.ERROR_EXIT)
    assert not r.clean and r.errors == 2
    assert r.by_kernel == {"conv_transpose2d_forward": 1, "pack_weight": 1}
    r = san.parse_output("racecheck", RACECHECK_HAZARDS, san.ERROR_EXIT)
    assert not r.clean and r.errors == 1 and r.by_kernel == {"conv_transpose2d_igemm": 2}
    r = san.parse_output("racecheck", RACECHECK_CLEAN, 0)
    assert r.clean and r.errors == 0
    r = san.parse_output("racecheck", "========= RACECHECK SUMMARY: 3 hazards displayed (0 errors, 3 warnings)\n", 0)
    assert not r.clean and r.warnings == 3
    r = san.parse_output("synccheck", UNSUPPORTED, 1)
    assert not r.clean and r.errors is None and "Device not supported" in r.note
    r = san.parse_output("memcheck", CLEAN, 3)  # the workload itself failed under the tool
    assert not r.clean


def test_report_lines(san):
    ok = san.parse_output("memcheck", CLEAN, 0)
    bad = san.parse_output("memcheck", MEMCHECK_ERRORS, san.ERROR_EXIT)
    bad.tool = "racecheck"
    lines = san.report_lines([ok, bad], ["to_channels_last"])
    text = "\n".join(lines)
    assert "memcheck   clean" in text and "racecheck  UNCLEAN" in text
    assert "conv_transpose2d_forward: 1" in text and "to_channels_last" in text


class FakeRuns:
    """Stands in for the subprocesses: the plain run, ``--help`` and each tool's run."""

    def __init__(self, san, labels, outputs=None, plain_ok=True, drop=()):
        self.san, self.labels, self.outputs, self.plain_ok, self.drop = san, labels, outputs or {}, plain_ok, drop
        self.commands = []

    def __call__(self, cmd, env, timeout):
        import json

        self.commands.append(list(cmd))
        if "--help" in cmd:
            return 0, "--show-backtrace --report-api-errors --print-limit", 0.1
        report = cmd[cmd.index("--report") + 1]
        cases = [{"case": "x", "ok": self.plain_ok}]
        tool = cmd[cmd.index("--tool") + 1] if "--tool" in cmd else None
        kernels = [k for k in self.labels if not any(k.startswith(d) for d in self.drop)] if tool else self.labels
        with open(report, "w") as f:
            json.dump({"cases": cases, "kernels": kernels}, f)
        if tool is None:
            return (0 if self.plain_ok else 3), "plain", 1.0
        text = self.outputs.get(tool, CLEAN if tool != "racecheck" else RACECHECK_CLEAN)
        return (self.san.ERROR_EXIT if "1 error" in text else 0), text, 2.0


def _fake(san, monkeypatch, **kwargs):
    labels = san.plan_labels(san.all_cases())
    fake = FakeRuns(san, labels, **kwargs)
    monkeypatch.setattr(san, "_run", fake)
    monkeypatch.setattr(san, "find_sanitizer", lambda explicit=None: "/opt/cuda/bin/compute-sanitizer")
    return fake


def test_main_all_clean(san, monkeypatch, capsys, tmp_path):
    fake = _fake(san, monkeypatch)
    assert san.main(["--json", str(tmp_path / "r.json")]) == san.EXIT_OK
    out = capsys.readouterr().out
    assert out.count(" clean ") == 3 and "UNCLEAN" not in out
    tools = [c[c.index("--tool") + 1] for c in fake.commands if "--tool" in c]
    assert sorted(tools) == sorted(san.TOOLS)
    tool_cmd = next(c for c in fake.commands if "--tool" in c)
    assert "--error-exitcode" in tool_cmd and "--report-api-errors" in tool_cmd and "--worker" in tool_cmd
    import json

    saved = json.loads((tmp_path / "r.json").read_text())
    assert [r["clean"] for r in saved["results"]] == [True, True, True] and not saved["missing"]


def test_main_reports_a_dirty_tool(san, monkeypatch, capsys):
    _fake(san, monkeypatch, outputs={"racecheck": RACECHECK_HAZARDS})
    assert san.main([]) == san.EXIT_UNCLEAN
    out = capsys.readouterr().out
    assert "racecheck  UNCLEAN" in out and "conv_transpose2d_igemm: 2" in out and "memcheck   clean" in out


def test_main_reports_kernels_that_did_not_run(san, monkeypatch, capsys):
    _fake(san, monkeypatch, drop=("pack_weight",))
    assert san.main([]) == san.EXIT_UNCLEAN
    assert "kernel templates that did not run: pack_weight" in capsys.readouterr().out


def test_main_stops_when_the_plain_run_fails(san, monkeypatch, capsys):
    fake = _fake(san, monkeypatch, plain_ok=False)
    assert san.main([]) == san.EXIT_WORKLOAD
    assert not any("--tool" in c for c in fake.commands)
