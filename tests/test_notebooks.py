"""Execute every notebook in examples/ top to bottom, in a kernel running this interpreter.

The kernel is described by a kernelspec written to a temporary folder (argv: this
``sys.executable``), so the test uses no global Jupyter state and runs the same in a
fresh CI virtualenv.  Skipped when nbformat, nbclient or ipykernel is missing; a
notebook is skipped when a module its ``metadata.cupyconv.requires`` names is missing.
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
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (jupyter_client comes with nbclient)
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

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
def test_notebook_is_valid_and_clean(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "commit notebooks without outputs"


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
    km = AsyncKernelManager(kernel_name=KERNEL_NAME,
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))
    client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S, startup_timeout=120,
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()   # raises CellExecutionError, with the cell and traceback, on any error
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
    "01_numpy_cupy_arrays": ["NumPy arrays run on backend", "grad_weight", "max error", "floor"],
    "02_torch_convert": ["layers converted", "Same losses up to float32 rounding", "grad_weight"],
    "03_benchmark_your_layer": ["-bound, floor"],
}
EXPECTED_WITHOUT_GPU = {
    "01_numpy_cupy_arrays": ["REFERENCE backend", "skipping the CuPy-array part"],
    "02_torch_convert": ["REFERENCE"],
    "03_benchmark_your_layer": ["skipping the timings"],
}


def _gpu() -> bool:
    import cupyconv

    return cupyconv.backend() == "cupy"
