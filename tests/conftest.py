"""Shared test set-up: the ``gpu`` marker skips where no CUDA GPU is usable, and the summary says so once."""
import functools
import os

import pytest

# The suite checks the kernels the heuristic picks (tests assert which path runs) and must
# not time candidates on every new layer nor write the user's tuning cache; the tuning
# tests turn autotuning on themselves.  CUPYCONV_AUTOTUNE=1 runs the suite with it on.
os.environ.setdefault("CUPYCONV_AUTOTUNE", "0")


GPU_COMMAND = ".venv/bin/python -m pytest -q -m gpu"


@functools.lru_cache(maxsize=None)
def why_no_gpu() -> str:
    """Why the ``gpu`` tests cannot run here, in a few words; empty when CuPy sees a CUDA GPU."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, a driver too old for this CuPy, or no device
        return f"CuPy finds no usable CUDA driver ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    return "" if count > 0 else "CuPy sees no CUDA device"


def gpu_usable() -> bool:
    return not why_no_gpu()


SKIP_REASON = "needs a CUDA GPU through CuPy"


def pytest_collection_modifyitems(config, items):
    if gpu_usable():
        return
    skip = pytest.mark.skip(reason=f"{SKIP_REASON}: {why_no_gpu()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _skipped_for_no_gpu(report) -> bool:
    # Some GPU files also skip on their own when torch sees no CUDA device, and pytest
    # applies their skipif before the marker above; the cause is the same missing GPU.
    # A whole module skipped at collection (say, an importorskip) comes as a CollectReport,
    # which has no keywords; it is reported as pytest always reports it.
    return report.skipped and "gpu" in getattr(report, "keywords", {}) and not gpu_usable()


def pytest_report_teststatus(report, config):
    # Without a GPU well over a thousand tests skip for one reason; a letter each only buries
    # the progress of the tests that ran. They still count as skipped, and the summary says why.
    if _skipped_for_no_gpu(report):
        return "skipped", "", "SKIPPED (no GPU)"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = sum(_skipped_for_no_gpu(r) for r in terminalreporter.stats.get("skipped", []))
    if skipped:
        terminalreporter.write_line(
            f"{skipped} GPU tests (marker gpu) were skipped, not passed: {why_no_gpu()}. "
            f"On a machine with a CUDA GPU and CuPy, run them with: {GPU_COMMAND}", yellow=True, bold=True)
