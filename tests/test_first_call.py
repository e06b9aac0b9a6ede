"""benchmarks/first_call.py without a GPU: what its parent process hands each child, and what it records."""
from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest

import script_modules


@pytest.fixture(scope="module")
def tool():
    with script_modules.loaded("benchmarks/first_call.py") as module:
        yield module


@pytest.mark.parametrize("flags", [[], ["--nvrtc-warm"], ["--module"], ["--nvrtc-warm", "--module"]])
def test_each_layer_runs_a_cold_and_a_disk_child_with_the_flags(tool, monkeypatch, tmp_path, flags):
    """Two children a layer share fresh CuPy and tuning caches and get the parent's --nvrtc-warm and --module;
    the row records both settings and each child's report."""
    seen = []
    child_row = {"forward_s": 0.5, "backward_s": 0.25, "total_s": 0.75, "builds": 6, "build_s": 1.0,
                 "slowest_build": ["conv_transpose2d_wgmma", 0.4], "settled_s": 0.1, "race_s": 0.01, "all_builds": 9}

    def run(cmd, env, capture_output, text):
        seen.append((cmd, env["CUPY_CACHE_DIR"], env["CUPYCONV_CACHE_DIR"], env["CUPYCONV_AUTOTUNE"]))
        return SimpleNamespace(returncode=0, stdout="noise\n" + json.dumps(child_row), stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    out = tmp_path / "rows.json"
    assert tool.main(["--autotune", "0", "--layers", "small_fp32_nchw", "--json", str(out)] + flags) == 0
    assert len(seen) == 2 and seen[0][1:] == seen[1][1:] and seen[0][3] == "0"
    for cmd, *_ in seen:
        assert cmd[-len(flags) - 2:] == ["--child", "small_fp32_nchw"] + flags
    rows = json.loads(out.read_text())
    assert rows == [{"layer": "small_fp32_nchw", "autotune": "0", "nvrtc_warm": "--nvrtc-warm" in flags,
                     "module": "--module" in flags, "cold": child_row, "disk": child_row}]


def test_a_failing_child_stops_the_run(tool, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=1, stdout="", stderr="boom"))
    assert tool.main(["--layers", "small_fp32_nchw"]) == 1
    assert "boom" in capsys.readouterr().err
