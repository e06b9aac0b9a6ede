"""The on-disk store of tuning choices, and the keys they are filed under.

Choices live in a JSON file under ``CUPYCONV_CACHE_DIR`` (default: the user cache
directory), keyed by library version, kernel-code hash, GPU name, arch, pass, layer,
dtype, layout and precision.  Batch and spatial sizes enter the key rounded up to powers
of two: the best tile depends on them only through the GEMM's rough size, and
variable-size workloads would otherwise pay a host synchronisation for every new image
size.  A corrupt file is ignored and rewritten; an unwritable directory leaves the
choices in memory.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional

from ..core.geometry import Geometry
from ..core.version import VERSION
from ..jit import templates

CACHE_DIR_ENV = "CUPYCONV_CACHE_DIR"
CACHE_FILE = "tuning.json"
FILE_FORMAT = 1

_log = logging.getLogger("cupyconv.tuning")


# ---------------------------------------------------------------------------- the key

def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _key_precision(dtype: str, precision: str) -> str:
    # Only float32 has two precisions; other dtypes share one entry.
    return precision if dtype == "float32" else "-"


def config_key(pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> str:
    """The device-independent part of a stored choice's key."""
    p = g.params
    h, w = g.in_size

    def pair(v):
        return f"{v[0]}x{v[1]}"

    return (f"{pass_}|cin={g.in_channels},cout={g.out_channels},k={pair(g.kernel)},s={pair(p.stride)},"
            f"p={pair(p.padding)},op={pair(p.output_padding)},d={pair(p.dilation)},groups={p.groups},"
            f"n<={_pow2(g.batch)},hw<={_pow2(h)}x{_pow2(w)}|{dtype}|{layout}|{_key_precision(dtype, precision)}")


def make_key(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, gpu_name: str, arch: str,
             version: Optional[str] = None, code: Optional[str] = None) -> str:
    """The full key of a stored choice: library version, kernel code, GPU, arch and configuration."""
    return "|".join((version if version is not None else VERSION, code if code is not None else code_hash(),
                     gpu_name, f"sm_{arch}", config_key(pass_, g, dtype, layout, precision)))


@functools.lru_cache(maxsize=None)
def code_hash() -> str:
    """A hash of the kernel templates and the planners: choices made for other code are not reused."""
    h = hashlib.sha256()
    for name in templates.template_names():
        h.update(f"{name}={templates.content_hash(name)};".encode())
    planners = Path(__file__).resolve().parent.parent / "plans"
    for path in sorted(planners.glob("*.py")):
        try:
            h.update(path.name.encode() + path.read_bytes())
        except OSError:
            pass
    return h.hexdigest()[:12]


# ------------------------------------------------------------------------- the file

def cache_dir() -> Path:
    """Where choices persist: ``CUPYCONV_CACHE_DIR``, else the user cache directory."""
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("cupyconv", appauthor=False))
    except ImportError:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "cupyconv"


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _valid_entry(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("variant"), str)


def read_entries(path: Path) -> Dict[str, dict]:
    """The well-formed entries of a choices file; nothing for a missing, unreadable or corrupt one."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(k, str) and _valid_entry(v)}


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock between processes (POSIX); elsewhere the atomic replace has to do."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class TuningCache:
    """The choices of one file, mirrored in memory.

    Reads happen only on a miss of the in-process choice, and re-read the file only when it
    changed.  A write merges into what is on disk under a file lock and replaces the file
    atomically, so concurrent processes neither lose each other's entries nor see a torn
    file.  If the file cannot be written the entries stay in memory.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._entries: Dict[str, dict] = {}
        self._stamp = None
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[dict]:
        with self._lock:
            self._refresh()
            return self._entries.get(key)

    def put(self, key: str, entry: dict) -> bool:
        """Remember ``entry``; True when it reached the disk."""
        with self._lock:
            self._entries[key] = entry
            try:
                self._write({key: entry})
                return True
            except OSError as exc:
                _log.info("cupyconv: tuning choices stay in memory, %s is not writable: %s", self.path, exc)
                return False

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._entries.update(read_entries(self.path))
            self._stamp = stamp

    def _write(self, new: Dict[str, dict]) -> None:
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        with _file_lock(self.path.with_name(self.path.name + ".lock")):
            entries = read_entries(self.path)
            entries.update(new)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"format": FILE_FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._entries.update(entries)
            with contextlib.suppress(OSError):
                st = os.stat(self.path)
                self._stamp = (st.st_mtime_ns, st.st_size)


_caches: Dict[Path, TuningCache] = {}
_caches_lock = threading.Lock()


def cache() -> TuningCache:
    """The store of the current cache directory."""
    path = cache_path()
    with _caches_lock:
        found = _caches.get(path)
        if found is None:
            found = _caches[path] = TuningCache(path)
        return found


def forget() -> None:
    """Drop the in-memory mirrors of every store (the files are left alone)."""
    with _caches_lock:
        _caches.clear()

