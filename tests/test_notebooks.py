"""Execute every notebook in examples/ top to bottom, in a kernel running this interpreter.

The kernel is described by a kernelspec written to a temporary folder (argv: this
``sys.executable``), so the test uses no global Jupyter state and runs the same in a
fresh CI virtualenv.  Skipped when nbformat, nbclient or ipykernel is missing; a
notebook is skipped when a module its ``metadata.cupyconv.requires`` names is missing.

The committed notebooks either carry no outputs or the outputs of one complete GPU run
by ``scripts/run_notebooks.py``.  Here they are re-executed in memory (their stored
outputs are replaced, never compared, and the files are not written), with or without
a GPU.
"""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
KERNEL_NAME = "cupyconv-test-python"
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory):
    kernels = tmp_path_factory.mktemp("jupyter") / "kernels"
    spec_dir = kernels / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }))
    return kernels


def test_examples_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_numpy_cupy_arrays.ipynb", "02_torch_convert.ipynb", "03_benchmark_your_layer.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_valid_and_clean_or_from_a_gpu_run(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    assert nb.metadata.kernelspec.name == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    if all(cell.outputs == [] and cell.execution_count is None for cell in code):
        return   # as examples/make_notebooks.py writes them
    # Stored outputs: one top-to-bottom run on a GPU by scripts/run_notebooks.py, no errors.
    executed = nb.metadata.get("cupyconv", {}).get("executed")
    assert executed, "outputs without metadata.cupyconv.executed: store them with scripts/run_notebooks.py"
    assert executed["backend"] == "cupy" and "no GPU" not in executed["device"], \
        f"stored outputs come from a run without a GPU: {executed}"
    for key in ("device", "torch", "cupy", "commit", "date"):
        assert executed.get(key), f"metadata.cupyconv.executed lacks {key!r}"
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), \
        "stored outputs must come from one run, top to bottom"
    assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
    # and a reader sees where they come from: the first output names the GPU and the commit
    first = "".join(o.get("text", "") for o in code[0].outputs if o.output_type == "stream")
    assert f"ran on {executed['device']}" in first and f"at commit {executed['commit']}" in first, first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel_dir, tmp_path, monkeypatch):
    nb = nbformat.read(str(path), as_version=4)
    for module in nb.metadata.get("cupyconv", {}).get("requires", []):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{path.name} needs {module}")
    # The kernel inherits this environment: cupyconv from this checkout, a private
    # runtime folder for connection files, and a non-interactive matplotlib.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # The kernelspec is found first on JUPYTER_PATH; nbclient then owns the kernel and shuts it down.
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(kernel_dir.parent),
                                                                     os.environ.get("JUPYTER_PATH")])))
    stored = path.read_bytes()
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT_S, startup_timeout=120,
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()   # raises CellExecutionError, with the cell and traceback, on any error
    assert path.read_bytes() == stored, "executing a notebook must not rewrite the committed file"
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    rich = [o for o in outputs if o.output_type in ("execute_result", "display_data")]
    for expected in EXPECTED[path.stem]:
        assert expected in text, f"{path.name}: {expected!r} not printed"
    if not _gpu():
        for expected in EXPECTED_WITHOUT_GPU[path.stem]:
            assert expected in text, f"{path.name}: {expected!r} not printed without a GPU"
    if path.stem.startswith("01"):   # explain() renders as HTML and Markdown
        assert any("text/html" in o.data and "<details>" in o.data["text/html"] for o in rich)
    if path.stem.startswith("03"):   # the plot
        assert any("image/png" in o.data for o in rich)


# What each notebook must print, so that a notebook that silently does nothing fails.
EXPECTED = {
    "01_numpy_cupy_arrays": ["ran on", "NumPy arrays run on backend", "grad_weight", "max error", "floor"],
    "02_torch_convert": ["ran on", "layers converted", "Same losses up to float32 rounding", "grad_weight"],
    "03_benchmark_your_layer": ["ran on", "-bound, floor"],
}
EXPECTED_WITHOUT_GPU = {
    "01_numpy_cupy_arrays": ["REFERENCE backend", "skipping the CuPy-array part"],
    "02_torch_convert": ["REFERENCE"],
    "03_benchmark_your_layer": ["skipping the timings"],
}


def _gpu() -> bool:
    import cupyconv

    return cupyconv.backend() == "cupy"
