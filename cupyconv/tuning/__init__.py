"""Choosing among the variants the pass table lists for a pass, and remembering the choice.

- :mod:`.variants`: what a variant is and how it is named;
- :mod:`.store`: the on-disk choices and their keys;
- :mod:`.decide`: the first-call decision and its timing;
- :mod:`.explicit`: the public :func:`cupyconv.tune`.

The tuner never plans or launches on its own: it chooses among the candidates it is handed.
"""
from .decide import AUTOTUNE_ENV, chosen, clear, current, enabled, pinned, settle
from .store import CACHE_DIR_ENV, CACHE_FILE, FILE_FORMAT, TuningCache, cache_dir, cache_path, code_hash, config_key, \
    make_key, read_entries
from .variants import DIRECT, GEMM, Variant

__all__ = ["AUTOTUNE_ENV", "CACHE_DIR_ENV", "CACHE_FILE", "DIRECT", "FILE_FORMAT", "GEMM", "TuningCache", "Variant",
           "cache_dir", "cache_path", "chosen", "clear", "code_hash", "config_key", "current", "enabled", "make_key",
           "pinned", "read_entries", "settle"]
