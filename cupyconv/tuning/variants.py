"""A variant: one way to run a pass, as a kernel family and its planner options.

Its name is what the tuning file stores: ``direct``, ``direct:8x2x1``, ``direct:4x16``, ``gemm``, ``gemm:128x64``,
``gemm:s3``, ``gemm:64x64:s2``, ``gemm:k1``, ``gemm:128x128:k8``, ``wgmma:4i8x8x128``, ``wgmma:16x16x64:s6``,
``wgmma:64x64x4r16``, ``wgmma:copy``, ``scatter_gemm:64x256:inplace``, ``tiled:8x8x1b6`` or ``grouped_mma:4x32``
(family, then a block tile, then a pipeline depth, then K ranges, then ``copy`` for a source copied first or
``inplace`` for one read in place where the heuristic copies it).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Dict, Tuple

# rows x columns (the direct grad_input's: input channels x pixels), or [images i] height x width x channels, or
# grad_weight's channels x channels x taps [r rows [w columns]] (the direct kernels': input channels x output
# channels x kernel rows), or the tiled forward's rows x columns x channels [b blocks per SM], or the grouped mma
# kernels' groups x pixels a segment
_TILE = re.compile(r"(\d+i)?\d+x\d+(x\d+)?(r\d+(w\d+)?|b\d+)?")
_STAGES = re.compile(r"s(\d+)")
_SPLIT = re.compile(r"k(\d+)")
_FAMILY = re.compile(r"[a-z][a-z0-9_]*")
# the order of options in a name
_ORDER = ("tile", "stages", "split", "copy")   # ("copy" or "inplace", not both)


@dataclass(frozen=True)
class Variant:
    """A kernel family and the planner options it runs with; no options means the planner's heuristic."""

    family: str
    options: Tuple[Tuple[str, object], ...] = ()

    def __hash__(self) -> int:
        # Looked up on every launch of a tuned pass; hash the fields once.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.family, self.options))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # a string's hash differs between processes: a pickled variant hashes afresh
        return {f: getattr(self, f) for f in ("family", "options")}

    @classmethod
    def make(cls, family: str, **options) -> "Variant":
        return cls(family, tuple(sorted(options.items())))

    @functools.cached_property
    def kwargs(self) -> Dict[str, object]:
        return dict(self.options)

    @property
    def name(self) -> str:
        opts = self.kwargs
        parts = [self.family]
        if "tile" in opts:
            parts.append(str(opts["tile"]))
        if "stages" in opts:
            parts.append(f"s{opts['stages']}")
        if "split" in opts:
            parts.append(f"k{opts['split']}")
        if opts.get("copy"):
            parts.append("copy")
        if opts.get("inplace"):
            parts.append("inplace")
        return ":".join(parts)

    @classmethod
    def parse(cls, name: str) -> "Variant":
        """The variant a :attr:`name` stands for; ValueError for anything else."""
        family, *rest = str(name).split(":")
        if not _FAMILY.fullmatch(family) or len(rest) > len(_ORDER):
            raise ValueError(f"not a cupyconv variant name: {name!r}")
        opts: Dict[str, object] = {}
        for part in rest:
            stages, split = _STAGES.fullmatch(part), _SPLIT.fullmatch(part)
            source = "copy" in opts or "inplace" in opts   # the source's option comes last
            if _TILE.fullmatch(part) and not opts:
                opts["tile"] = part
            elif stages and "stages" not in opts and "split" not in opts and not source:
                opts["stages"] = int(stages.group(1))
            elif split and "split" not in opts and not source:
                opts["split"] = int(split.group(1))
            elif part in ("copy", "inplace") and not source:
                opts[part] = True
            else:
                raise ValueError(f"not a cupyconv variant name: {name!r}")
        return cls.make(family, **opts)

    def __repr__(self) -> str:
        return f"Variant({self.name!r})"


def block_tile(block: Tuple[int, ...]) -> str:
    """The tile option naming a thread or block shape, ``(8, 2, 1)`` as ``"8x2x1"``."""
    return "x".join(map(str, block))


def tile_block(tile: str) -> Tuple[int, ...]:
    """The shape a tile option names (the inverse of :func:`block_tile`)."""
    return tuple(int(v) for v in tile.split("x"))


DIRECT = Variant("direct")
GEMM = Variant("gemm")
