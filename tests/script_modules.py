"""The repository's command-line scripts (``scripts/``, ``benchmarks/``) loaded as modules, for tests that run
without a GPU."""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def loaded(relative_path: str) -> Iterator[ModuleType]:
    """The script at ``relative_path`` (from the repository root) as a module, registered in ``sys.modules`` while
    it is in use: dataclasses look their module up there."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(f"cupyconv_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
