"""The built wheel carries the kernel templates and finds them once installed."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (path,) = out.glob("cupyconv-*.whl")
    return path


def test_wheel_contains_every_template(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = ROOT / "kernels"
    shipped = {p.relative_to(kernels).as_posix() for p in kernels.rglob("*") if p.suffix in (".cu", ".cuh")}
    assert any(n.startswith("include/") for n in shipped)
    assert shipped and {f"cupyconv/kernels/{n}" for n in shipped} <= names


def test_installed_wheel_loads_templates_and_runs_the_demo(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    # --system-site-packages only lends numpy from the test interpreter's base; the
    # wheel itself must come from the file, not from the source tree.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, env=env)
    site = subprocess.run([str(py), "-c", "import numpy, sys; print(numpy.__file__)"], capture_output=True,
                          text=True, env=env)
    if site.returncode:
        subprocess.run([str(py), "-m", "pip", "install", "--quiet", "numpy"], check=True, env=env)
    script = (
        "import cupyconv, pathlib\n"
        "from cupyconv.jit import templates\n"
        f"assert not pathlib.Path(cupyconv.__file__).is_relative_to({str(ROOT)!r}), cupyconv.__file__\n"
        "kdir = templates.kernels_dir()\n"
        "assert kdir.parent == pathlib.Path(cupyconv.__file__).parent, kdir\n"
        "names = templates.template_names()\n"
        "assert len(names) >= 5, names\n"
        "for n in names:\n"
        "    consts = {k: 1 for k in templates.placeholders(n)}\n"
        "    consts.update({k: 'float' for k in ('SCALAR_T',) if k in consts}, INDEX_T='int')\n"
        "    for flag in ('HAS_BIAS', 'CHANNELS_LAST'):\n"
        "        if flag in consts: consts[flag] = True\n"
        "    assert '{{' not in templates.render(n, consts)\n"
        "print('templates ok', len(names))\n"
    )
    result = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "templates ok" in result.stdout
    demo = subprocess.run([str(py), "-m", "cupyconv", "--batch", "1", "--repeat", "3"], cwd=tmp_path,
                          capture_output=True, text=True, env={**env, "CUPYCONV_BACKEND": "numpy"})
    assert demo.returncode == 0, demo.stderr
    assert "NumPy float64 reference backend" in demo.stdout
