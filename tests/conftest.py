"""Shared test set-up: the ``gpu`` marker skips cleanly where no CUDA GPU is usable."""
import functools
import os

import pytest

# The suite checks the kernels the heuristic picks (tests assert which path runs) and must
# not time candidates on every new layer nor write the user's tuning cache; the tuning
# tests turn autotuning on themselves.  CUPYCONV_AUTOTUNE=1 runs the suite with it on.
os.environ.setdefault("CUPYCONV_AUTOTUNE", "0")


@functools.lru_cache(maxsize=None)
def gpu_usable() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_usable():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (through CuPy)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
