"""The benchmark's arithmetic, reporting and command line, without a GPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cupyconv import bench
from cupyconv.bench import BenchLayer

# 2 x 4 x 5 x 7 input, 4 -> 6 channels in 2 groups, 3x3 kernel, stride 2, padding 1, with bias.
# Output: (5 - 1)*2 - 2 + 2 + 1 = 9 rows, (7 - 1)*2 - 2 + 2 + 1 = 13 columns.
# Elements: x 2*4*5*7 = 280, w 4*3*3*3 = 108, y 2*6*9*13 = 1404, bias 6.
SMALL = BenchLayer("small", 2, 4, 6, (3, 3), stride=(2, 2), padding=(1, 1), groups=2, size=(5, 7))


def test_flops_of_a_hand_checked_layer():
    assert SMALL.out_size() == (9, 13)
    assert bench.layer_flops(SMALL, "forward") == 2 * 2 * 4 * 3 * 5 * 7 * 9 == 15120
    assert bench.layer_flops(SMALL, "forward+backward") == 3 * 15120


def test_bytes_of_a_hand_checked_layer():
    forward = 280 + 108 + 1404 + 6
    grad_input = 1404 + 108 + 280
    grad_weight_and_bias = 280 + 1404 + 108 + 6
    assert bench.layer_bytes(SMALL, "float16", "forward") == 2 * forward == 3596
    assert bench.layer_bytes(SMALL, "float32", "forward+backward") == \
        4 * (forward + grad_input + grad_weight_and_bias) == 21552
    assert bench.layer_bytes(SMALL, "tf32", "forward") == bench.layer_bytes(SMALL, "float32", "forward")
    assert bench.layer_bytes(SMALL, "bfloat16", "forward") == bench.layer_bytes(SMALL, "float16", "forward")
    assert bench.layer_bytes(SMALL, "float64", "forward") == 2 * bench.layer_bytes(SMALL, "float32", "forward")


def test_bytes_without_bias_leave_out_bias_and_grad_bias():
    no_bias = BenchLayer("small", 2, 4, 6, (3, 3), stride=(2, 2), padding=(1, 1), groups=2, size=(5, 7),
                         bias=False)
    assert bench.layer_bytes(no_bias, "float32", "forward") == 4 * (280 + 108 + 1404)
    assert bench.layer_bytes(SMALL, "float32", "forward+backward") - \
        bench.layer_bytes(no_bias, "float32", "forward+backward") == 4 * 6 * 2


def test_seed_layer_matches_the_performance_notes():
    # benchmarks/NOTES.md: grouped_dilated writes 257 x 766 outputs, 2*16*32*16*128*256*15 FLOP forward.
    layer = bench.SEED_LAYERS[0]
    assert layer.name == "grouped_dilated"
    assert layer.out_size() == (257, 766)
    assert bench.layer_flops(layer, "forward") == 2 * 16 * 32 * 16 * 128 * 256 * 15
    assert bench.layer_bytes(layer, "float32", "forward") == 4 * (16 * 32 * 128 * 256 + 32 * 16 * 3 * 5
                                                                  + 16 * 64 * 257 * 766)


def test_unknown_pass_is_refused():
    with pytest.raises(ValueError, match="unknown pass"):
        bench.layer_flops(SMALL, "backward")
    with pytest.raises(ValueError, match="unknown pass"):
        bench.layer_bytes(SMALL, "float32", "backward")


def test_row_metrics():
    row = bench.make_row(SMALL, "float32", "nchw", "forward", ms=0.5, torch_ms=1.5, copy_gbps=1000.0)
    assert row["speedup"] == pytest.approx(3.0)
    assert row["tflops"] == pytest.approx(15120 / 0.5e-3 / 1e12)
    assert row["bandwidth_pct"] == pytest.approx(100 * 7192 / 0.5e-3 / 1e12)
    assert "error" not in row
    failed = bench.make_row(SMALL, "float16", "channels_last", "forward+backward", None, 2.0, 1000.0,
                            error="cupyconv: OutOfMemoryError: oom")
    assert (failed["ms"], failed["speedup"], failed["tflops"], failed["bandwidth_pct"]) == (None,) * 4
    assert failed["torch_ms"] == 2.0 and failed["error"] == "cupyconv: OutOfMemoryError: oom"
    assert bench.make_row(SMALL, "float32", "nchw", "forward", 0.5, 1.5, copy_gbps=None)["bandwidth_pct"] is None


def test_a_failing_case_becomes_error_rows_and_the_rest_is_kept():
    def setup():
        def time_pass(impl, pass_name):
            if impl == "cupyconv" and pass_name == "forward+backward":
                raise MemoryError("out of memory\nwith a second line")
            return {"cupyconv": 1.0, "torch": 2.0}[impl]
        return time_pass

    forward, backward = bench.case_rows(SMALL, "bfloat16", "nchw", setup, copy_gbps=1000.0)
    assert (forward["pass"], forward["ms"], forward["speedup"]) == ("forward", 1.0, 2.0)
    assert "error" not in forward
    assert (backward["pass"], backward["ms"], backward["torch_ms"], backward["speedup"]) == \
        ("forward+backward", None, 2.0, None)
    assert backward["error"].startswith("cupyconv: MemoryError: out of memory")

    def failing_setup():
        raise RuntimeError("unsupported")

    rows = bench.case_rows(SMALL, "float64", "channels_last", failing_setup, copy_gbps=None)
    assert [r["pass"] for r in rows] == list(bench.PASSES)
    assert all(r["ms"] is None and r["error"] == "setup: RuntimeError: unsupported" for r in rows)


def _rows():
    return [
        bench.make_row(SMALL, "tf32", "nchw", "forward", 1.0, 2.0, 1000.0),
        bench.make_row(SMALL, "tf32", "nchw", "forward+backward", 4.0, 16.0, 1000.0),
        bench.make_row(SMALL, "float16", "channels_last", "forward", 2.0, 1.0, 1000.0),
        bench.make_row(SMALL, "float16", "channels_last", "forward+backward", None, 3.0, 1000.0,
                       error="cupyconv: OutOfMemoryError: CUDA out of memory.\nTried to allocate 2 GiB"),
    ]


def test_geomean_skips_rows_without_a_speedup():
    means = bench.geomean_speedups(_rows())
    assert means["overall"] == pytest.approx((2.0 * 4.0 * 0.5) ** (1 / 3))
    assert means["forward"] == pytest.approx(1.0)
    assert means["forward+backward"] == pytest.approx(4.0)
    assert bench.geomean_speedups([]) == {"overall": None, "forward": None, "forward+backward": None}


def test_table_has_every_row_the_error_and_the_geomean():
    lines = bench.format_table(_rows()).splitlines()
    assert lines[0].split() == ["layer", "dtype", "layout", "pass", "cupyconv", "ms", "torch", "ms", "speedup",
                                "TFLOP/s", "%copy-BW"]
    assert len(lines) == 1 + 4 + 1
    first = lines[1].split()
    assert first == ["small", "tf32", "nchw", "forward", "1.000", "2.000", "2.00x", "0.00", "0.0"]
    error = lines[4]
    assert error.split()[:7] == ["small", "float16", "channels_last", "forward+backward", "-", "3.000", "-"]
    assert error.endswith("error: cupyconv: OutOfMemoryError: CUDA out of memory.")
    assert lines[-1] == (f"geomean speedup: {(2.0 * 4.0 * 0.5) ** (1 / 3):.2f}x overall "
                         "(forward 1.00x, forward+backward 4.00x); 1 of 4 rows failed")


def test_table_throughput_columns_of_a_seed_layer():
    # 8.05 GFLOP and 873 MB in 1.6 ms against a 3000 GB/s copy: 5.03 TFLOP/s and 18.2 % of it.
    row = bench.make_row(bench.SEED_LAYERS[0], "float32", "nchw", "forward", 1.6, 6.4, 3000.0)
    assert bench.format_table([row]).splitlines()[1].split()[4:] == ["1.600", "6.400", "4.00x", "5.03", "18.2"]


def test_table_of_only_failures_says_so():
    rows = [bench.make_row(SMALL, "float32", "nchw", "forward", None, None, None, error="setup: boom")]
    assert bench.format_table(rows).splitlines()[-1] == \
        "geomean speedup: n/a (no row has both times); 1 of 1 rows failed"


ENV = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "cupy": "14.0.0", "commit": "abc1234", "cudnn": 91900,
       "copy_gbps": 3000.0}


def test_json_round_trip(tmp_path):
    path = tmp_path / "results.json"
    bench.write_results(path, ENV, _rows())
    data = json.loads(path.read_text())
    assert set(data) == {"device", "torch", "cupy", "commit", "cudnn", "copy_gbps", "rows"}
    required = {"name", "dtype", "layout", "pass", "ms", "torch_ms", "speedup", "tflops", "bandwidth_pct"}
    assert all(set(r) in (required, required | {"error"}) for r in data["rows"])
    assert data["rows"][3]["ms"] is None and "\n" in data["rows"][3]["error"]
    env, rows = bench.load_results(path)
    assert env == ENV
    assert rows == _rows()


def test_runs_of_one_commit_merge_into_one_report(tmp_path):
    rows = _rows()
    first, second = rows[:2], rows[2:]
    paths = []
    for i, part in enumerate((first, second)):
        paths.append(tmp_path / f"part{i}.json")
        bench.write_results(paths[-1], {**ENV, "copy_gbps": 3000.0 - i}, part)
    env, merged = bench.merge_results([bench.load_results(p) for p in paths])
    assert env["copy_gbps"] == 3000.0 and merged == rows
    # the same case measured twice is kept once, from the later run
    again = dict(rows[0], ms=123.0)
    _, merged = bench.merge_results([(ENV, rows), (ENV, [again])])
    assert len(merged) == len(rows) and merged[0]["ms"] == 123.0
    for field, value in (("commit", "def5678"), ("device", "NVIDIA H200"), ("dirty", True)):
        with pytest.raises(ValueError, match=f"different runs: {field}"):
            bench.merge_results([(ENV, first), ({**ENV, field: value}, second)])
    out = tmp_path / "merged.json"
    result = _cli("--from-json", str(paths[0]), "--from-json", str(paths[1]), "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert bench.load_results(out)[1] == rows
    bench.write_results(paths[1], {**ENV, "commit": "def5678"}, second)
    result = _cli("--from-json", str(paths[0]), "--from-json", str(paths[1]))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "python -m cupyconv.bench: error: the results come from different runs: commit 'abc1234' against 'def5678'"]


def test_a_baseline_run_lists_the_cases_whose_speedup_fell_worst_first():
    then = _rows()
    now = [dict(then[0], ms=1.2, speedup=2.0 / 1.2),            # 2.00x -> 1.67x: listed
           dict(then[1], ms=4.1, speedup=16.0 / 4.1),           # 4.00x -> 3.90x: within 5%, not listed
           dict(then[2], ms=4.0, torch_ms=1.0, speedup=0.25),   # 0.50x -> 0.25x: listed first
           dict(then[3], ms=1.0, error=None, speedup=3.0),      # failed before: nothing to compare it with
           bench.make_row(SMALL, "float32", "nchw", "forward", 1.0, 1.0, 1000.0)]   # new case
    changes = bench.baseline_changes(now, then)
    assert changes["matched"] == 3 and changes["unmatched"] == 2
    assert [(row["dtype"], row["pass"]) for row, _ in changes["slower"]] == [("float16", "forward"),
                                                                             ("tf32", "forward")]
    assert changes["geomean_then"] == pytest.approx((2.0 * 4.0 * 0.5) ** (1 / 3))
    assert changes["geomean_now"] == pytest.approx((2.0 / 1.2 * 16.0 / 4.1 * 0.25) ** (1 / 3))
    text = bench.format_baseline(changes, ENV)
    lines = text.splitlines()
    assert lines[0] == ("against the baseline at commit abc1234: 3 cases in both, 2 in one run only; geomean "
                        "speedup 1.59x -> 1.18x; 2 below 0.95 of their baseline speedup")
    assert lines[2].split() == ["small", "float16", "channels_last", "forward", "0.50", "->", "0.25", "2.000",
                                "->", "4.000", "1.000", "->", "1.000"]
    assert len(lines) == 4 and not any(line != line.rstrip() for line in lines)
    assert bench.format_baseline(bench.baseline_changes(now[4:], then), ENV).endswith("nothing to compare")


def test_a_baseline_compares_saved_runs_of_one_device_on_the_command_line(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    bench.write_results(old, ENV, _rows())
    bench.write_results(new, {**ENV, "commit": "def5678"}, [dict(_rows()[0], ms=1.5, speedup=2.0 / 1.5)])
    result = _cli("--from-json", str(new), "--baseline", str(old))
    assert result.returncode == 0, result.stderr
    assert ("against the baseline at commit abc1234: 1 cases in both, 2 in one run only; geomean speedup "
            "2.00x -> 1.33x; 1 below 0.95 of their baseline speedup") in result.stdout
    # a selection compares the baseline's selected cases only
    result = _cli("--from-json", str(new), "--baseline", str(old), "--dtype", "tf32")
    assert result.returncode == 0, result.stderr
    assert "against the baseline at commit abc1234: 1 cases in both, 1 in one run only;" in result.stdout
    bench.write_results(old, {**ENV, "device": "NVIDIA H200"}, _rows())
    result = _cli("--from-json", str(new), "--baseline", str(old))
    assert result.returncode == 2 and result.stdout == "" and result.stderr.strip().splitlines() == [
        f"python -m cupyconv.bench: error: the baseline ran on NVIDIA H200, these results on {ENV['device']}: "
        "compare runs of one device"]
    result = _cli("--from-json", str(new), "--baseline", str(tmp_path / "missing.json"))
    assert result.returncode == 2 and "cannot read" in result.stderr and "Traceback" not in result.stderr
    result = _cli("--models", "--baseline", str(old))
    assert result.returncode == 2 and "--baseline compares suite runs" in result.stderr


def test_select_rows():
    rows = _rows()
    assert bench.select_rows(rows) == rows
    assert bench.select_rows(rows, dtypes=["float16"]) == rows[2:]
    assert bench.select_rows(rows, layouts=["nchw"], names=["small"]) == rows[:2]
    assert bench.select_rows(rows, names=["other"]) == []


def test_default_arguments_cover_every_case():
    args = bench.parse_args([])
    assert args.dtypes == ["tf32", "float32", "float16", "bfloat16"]
    assert args.layouts == ["nchw", "channels_last"]
    assert args.layers == bench.SUITE
    assert not args.no_progress and args.json is None and args.plot is None and args.from_json is None


def test_dtype_layout_and_layer_selection():
    args = bench.parse_args(["--dtype", "float16", "--dtype", "float64", "--dtype", "float16", "--layout",
                             "channels_last", "--layer", "dcgan_up", "--layer", "big_square", "--no-progress"])
    assert args.dtypes == ["float16", "float64"]
    assert args.layouts == ["channels_last"]
    assert [layer.name for layer in args.layers] == ["big_square", "dcgan_up"]   # suite order
    assert args.no_progress
    assert [layer.name for layer in bench.parse_args(["--suite", "seeds"]).layers] == \
        [layer.name for layer in bench.SEED_LAYERS]


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--layout", "nhwc"], ["--layer", "nope"],
                                  ["--suite", "seeds", "--layer", "dcgan_up"],
                                  ["--host-cost", "--from-json", "r.json"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_saved_results_may_name_any_layer():
    args = bench.parse_args(["--from-json", "r.json", "--layer", "batch 4"])
    assert args.layer == ["batch 4"] and args.from_json == [Path("r.json")]


def test_run_refuses_unknown_dtypes_and_layouts_before_touching_the_gpu():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="unknown dtype"):
        bench.run([SMALL], "int8", copy_gbps=1.0)
    with pytest.raises(ValueError, match="unknown layout"):
        bench.run([SMALL], ["float16"], layouts=["nhwc"], copy_gbps=1.0)


def test_resolve_dtype_keeps_the_allow_tf32_argument():
    assert bench._resolve_dtype("float32", None) == "float32"
    assert bench._resolve_dtype("float32", True) == "tf32"
    assert bench._resolve_dtype("tf32", False) == "float32"
    assert bench._resolve_dtype("float16", True) == "float16"


def test_plot_from_json_needs_neither_torch_nor_cupy(tmp_path):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "results.json"
    bench.write_results(saved, ENV, _rows())
    png = tmp_path / "speedup.png"
    script = ("import sys\n"
              "from cupyconv.bench import main\n"
              f"main(['--from-json', {str(saved)!r}, '--plot', {str(png)!r}])\n"
              "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, 'a GPU library was imported'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000
    assert "geomean speedup" in done.stdout and "copy bandwidth 3000 GB/s" in done.stdout


def test_plot_and_json_of_a_selection(tmp_path):
    pytest.importorskip("matplotlib")
    saved, png, out = tmp_path / "in.json", tmp_path / "fwd.png", tmp_path / "out.json"
    bench.write_results(saved, ENV, _rows())
    bench.main(["--from-json", str(saved), "--dtype", "tf32", "--plot", str(png), "--json", str(out)])
    env, rows = bench.load_results(out)
    assert env == ENV and rows == _rows()[:2]
    assert png.stat().st_size > 0



# ------------------------------------------------------------------ the command line as a user meets it

def _cli(*args, module="cupyconv.bench", env=None):
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root), **(env or {})}, timeout=300)


def _gpu() -> bool:
    try:
        bench.require_gpu()
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(_gpu(), reason="checks the message without a GPU")
def test_measuring_without_a_gpu_is_one_line_and_status_2():
    for args in ((), ("--host-cost",), ("--models",)):
        result = _cli(*args)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("python -m cupyconv.bench: error: the benchmark needs")
        assert "Traceback" not in result.stderr


@pytest.mark.skipif(_gpu(), reason="checks the message without a GPU")
def test_run_without_a_gpu_says_what_is_missing():
    pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="needs"):
        bench.run([SMALL], ["float16"], copy_gbps=1.0)
    with pytest.raises(RuntimeError, match="needs"):
        bench.host_cost()


@pytest.mark.parametrize("content,message", [(None, "cannot read"), ("not json", "not a results file"),
                                             ('{"rows": 3}', "not a results file"), ("[1, 2]", "not a results file")])
def test_from_json_with_a_bad_file_is_one_line_and_status_2(tmp_path, content, message):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    result = _cli("--from-json", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    want = f"cannot read {path}: No such file or directory" if content is None else \
        f"{path} is not a results file written by --json"
    assert message in want and result.stderr.strip().splitlines() == [f"python -m cupyconv.bench: error: {want}"]


def test_usage_names_the_commands_and_every_option_has_help():
    for module in ("cupyconv", "cupyconv.bench"):
        result = _cli("--help", module=module)
        assert result.returncode == 0
        assert result.stdout.startswith(f"usage: python -m {module} ")
        version = _cli("--version", module=module)
        assert version.returncode == 0 and version.stdout.strip() == f"cupyconv {bench.VERSION}"
    parser_help = _cli("--help").stdout
    for layer in bench.SUITE:
        assert layer.name in parser_help
    assert parser_help.count("default") >= 7   # every option that has one names it


@pytest.mark.parametrize("batch", ["0", "-3", "two"])
def test_the_demo_refuses_a_batch_that_is_not_positive(batch):
    result = _cli("--batch", batch, module="cupyconv", env={"CUPYCONV_BACKEND": "numpy"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--batch: expected a positive int" in result.stderr


def test_the_commit_is_the_projects_own_or_none(tmp_path):
    root = Path(__file__).resolve().parent.parent
    commit, dirty = bench.project_commit()
    if (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        assert commit == head and isinstance(dirty, bool)
    # a copy of the package inside another repository records no commit, not that repository's
    outer = tmp_path / "other_project"
    import shutil

    shutil.copytree(root / "cupyconv", outer / "vendored" / "cupyconv",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "other"], check=True)
    code = "from cupyconv import bench; print(bench.project_commit())"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=outer / "vendored",
                           env={**__import__("os").environ, "PYTHONPATH": str(outer / "vendored")})
    assert found.stdout.strip() == "(None, None)", found.stderr


def test_one_d_layers_are_1d_calls_with_torch_shapes():
    torch = pytest.importorskip("torch")
    import cupyconv.torch as ct

    layer = next(layer for layer in bench.SUITE if layer.name == "vocoder_up8_1d")
    assert layer.kwargs() == dict(stride=8, padding=4, output_padding=0, groups=1, dilation=1)
    assert layer.spatial(layer.size) == (8192,) and layer.spatial(layer.out_size()) == (8 * 8192,)
    assert layer.functionals() == (torch.nn.functional.conv_transpose1d, ct.conv_transpose1d)
    # FLOP and bytes count the one row once
    assert bench.layer_flops(layer, "forward") == 2 * 16 * 512 * 256 * 8192 * 16
    with pytest.raises(ValueError, match="1-D"):
        BenchLayer("bad", 1, 2, 2, (3, 3), size=(4, 4), one_d=True)


def test_chart_labels_give_layer_shapes():
    assert bench.layer_label("dcgan_up") == "dcgan_up\n64×512×8×8 → 256, k4×4 s2×2"
    assert bench.layer_label("depthwise_up").endswith("g128")
    assert bench.layer_label("vocoder_up8_1d") == "vocoder_up8_1d\n16×512×8192 → 256, k16 s8"
    assert bench.layer_label("not_in_the_suite") == "not_in_the_suite"


def test_host_cost_json_holds_the_device_the_commit_and_the_rows(tmp_path, monkeypatch, capsys):
    rows = [dict(call="forward, no_grad", torch_us=20.0, cupyconv_us=21.0, ratio=1.05),
            dict(call="forward+backward", torch_us=200.0, cupyconv_us=260.0, ratio=1.3)]
    monkeypatch.setattr(bench, "require_gpu", lambda: None)
    monkeypatch.setattr(bench, "host_cost", lambda: rows)
    monkeypatch.setattr(bench, "environment", lambda: dict(device="Some GPU", torch="2.x", cupy="14.x", cudnn=1,
                                                           commit="abc1234", dirty=False))
    out = tmp_path / "host.json"
    bench.main(["--host-cost", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["device"] == "Some GPU" and saved["commit"] == "abc1234"
    assert saved["rows"] == rows
    assert set(saved["rows"][0]) == {"call", "torch_us", "cupyconv_us", "ratio"}
    assert "forward+backward" in capsys.readouterr().out
