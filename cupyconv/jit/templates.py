"""Finding and filling the ``.cu`` kernel templates.

A template is CUDA C++ with ``{{NAME}}`` placeholders for the layer's constants.
Rendering substitutes every placeholder and inlines the local ``#include``s, so the
result is one self-contained translation unit: what NVRTC compiles, what CuPy's disk
cache hashes, and what :func:`cupyconv.explain`-style tools can show a user.
"""
from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path
from typing import Mapping, Tuple

_PLACEHOLDER = re.compile(r"\{\{([A-Z][A-Z0-9_]*)\}\}")
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#pragma[ \t]+once[ \t]*$", re.MULTILINE)


def kernels_dir() -> Path:
    """The folder holding the templates: inside the installed package, or the source tree's top level.

    Templates (``*.cu``, one kernel concept each) sit at its top; the headers they share
    sit in ``include/``, where every ``#include "name.cuh"`` is looked up.
    """
    here = Path(__file__).resolve().parent.parent   # the cupyconv package
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "include" / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"cupyconv's kernel templates were not found next to {here}; the installation is incomplete")


def template_names() -> Tuple[str, ...]:
    """Every kernel template (``*.cu``) shipped with the library."""
    return tuple(sorted(p.name for p in kernels_dir().glob("*.cu")))


@functools.lru_cache(maxsize=None)
def _read(path: str, mtime_ns: int) -> str:
    return Path(path).read_text(encoding="utf-8")


def _text(name: str) -> str:
    folder = kernels_dir()
    path = folder / ("include" if name.endswith(".cuh") else "") / name
    if not path.is_file():
        raise ValueError(f"no kernel template or header named {name!r} in {folder}")
    return _read(str(path), path.stat().st_mtime_ns)


def _inline_includes(text: str, seen: Tuple[str, ...]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        body = _PRAGMA_ONCE.sub("", _text(name))
        return f"// ---- begin {name} ----\n{_inline_includes(body, seen + (name,))}\n// ---- end {name} ----"
    return _LOCAL_INCLUDE.sub(replace, text)


def expanded(name: str) -> str:
    """The template with its includes inlined, placeholders still in place."""
    return _inline_includes(_text(name), (name,))


def placeholders(name: str) -> frozenset:
    """The constants a template needs."""
    return frozenset(_PLACEHOLDER.findall(expanded(name)))


def content_hash(name: str) -> str:
    """Hash of the template and everything it includes: part of every compile-cache key."""
    return hashlib.sha256(expanded(name).encode()).hexdigest()[:16]


def format_constant(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_ ]*", value):
        return value
    raise TypeError(f"template constant {value!r} is not an int, bool or C type name")


def render(name: str, constants: Mapping[str, object]) -> str:
    """Fill template ``name`` with ``constants``; every placeholder must be given, and nothing else."""
    text = expanded(name)
    needed = frozenset(_PLACEHOLDER.findall(text))
    missing = needed - constants.keys()
    if missing:
        raise KeyError(f"template {name} needs constants {sorted(missing)}")
    unused = constants.keys() - needed
    if unused:
        raise KeyError(f"template {name} has no placeholders for {sorted(unused)}")
    values = {k: format_constant(v) for k, v in constants.items()}
    header = f"// cupyconv kernel {name}: " + ", ".join(f"{k}={values[k]}" for k in sorted(values)) + "\n"
    return header + _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)
