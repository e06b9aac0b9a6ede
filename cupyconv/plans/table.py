"""The pass table: which kernel families run each pass, in order of preference.

Every consumer reads this one table: the engine (what to run), the tuner (the candidates
it is handed), ``explain`` (what a call launches) and the compile-ahead lists.  A new
kernel family is one module with a :class:`~.family.Family` and one entry here.

For a pass, the first family that is eligible for the layer supplies the heuristic
variant; later eligible families join the candidates the tuner times when they may
race it (the direct kernels against the GEMMs on thin layers).
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.device import ASSUMED, Device
from ..core.geometry import Geometry
from ..tuning.variants import Variant
from . import (depthwise, direct, expanded_taps, gemm, grouped_mma, large_kernel, reduction, scatter_gemm, thin_mma,
               tiled, wgmma)
from .family import Family
from .launch import Plan
from .sequences import PassPlan

FORWARD, GRAD_INPUT, GRAD_WEIGHT, GRAD_BIAS = "forward", "grad_input", "grad_weight", "grad_bias"
PASSES = (FORWARD, GRAD_INPUT, GRAD_WEIGHT, GRAD_BIAS)

# Families in order of preference; each runs the passes it lists.
FAMILIES: Tuple[Family, ...] = (scatter_gemm.FAMILY, expanded_taps.FAMILY, wgmma.FAMILY, gemm.FAMILY,
                                grouped_mma.FAMILY, thin_mma.FAMILY, tiled.FAMILY, depthwise.FAMILY, direct.FAMILY,
                                large_kernel.FAMILY, reduction.FAMILY)

_BY_PASS: Dict[str, Tuple[Family, ...]] = {p: tuple(f for f in FAMILIES if p in f.passes) for p in PASSES}
_BY_NAME: Dict[str, Family] = {f.name: f for f in FAMILIES}


def check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")


def families(pass_: str) -> Tuple[Family, ...]:
    """The families that run ``pass_``, in order of preference."""
    check_pass(pass_)
    return _BY_PASS[pass_]


def family(name: str) -> Family:
    """The family called ``name``; KeyError for none."""
    return _BY_NAME[name]


def eligible(pass_: str, g: Geometry, dtype: str, layout: str, device: Device = ASSUMED,
             precision: str = "strict") -> Tuple[Family, ...]:
    """The families that can run ``pass_`` of this layer on ``device`` at ``precision``, in order of preference:
    the table's, with a family that steps back for this layer (:meth:`Family.leads`) moved just behind the next
    one."""
    ordered: List[Family] = []
    stepped_back: List[Family] = []
    for f in families(pass_):
        if not f.eligible(pass_, g, dtype, layout, device, precision):
            continue
        if f.leads(pass_, g, dtype, layout, precision):
            ordered += [f] + stepped_back
            stepped_back = []
        else:
            stepped_back.append(f)
    return tuple(ordered + stepped_back)


def candidates(pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict",
               device: Device = ASSUMED) -> Tuple[Variant, ...]:
    """The variants worth running for ``pass_``, the heuristic choice first.

    One entry means there is nothing to choose.  Variants that plan to the very same
    launches are listed once.
    """
    return _candidates(pass_, g, dtype, layout, precision, device, gemm.enabled())


@functools.lru_cache(maxsize=4096)
def _candidates(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, device: Device,
                _tensor_cores_enabled: bool) -> Tuple[Variant, ...]:
    # The TENSOR_CORES switch is part of the key: eligibility reads it.
    fams = eligible(pass_, g, dtype, layout, device, precision)
    if not fams:
        raise ValueError(f"no kernel family runs {pass_} of this layer")
    found: List[Variant] = []
    seen = set()
    for i, fam in enumerate(fams):
        if i and not fam.races(pass_, g, dtype):
            continue
        taken = 0
        for v in fam.variants(pass_, g, dtype, layout, precision):
            heuristic = not found
            try:
                identity = tuple(plan(pass_, v, g, dtype, layout, precision).plans())
            except (ValueError, TypeError, KeyError):
                if not heuristic:
                    continue
                identity = None  # the heuristic is kept whatever happens: it is what runs untuned
            if identity is not None and identity in seen:
                continue
            seen.add(identity)
            found.append(v)
            taken += 1
            if taken >= fam.max_variants:
                break
    return tuple(found)


@functools.lru_cache(maxsize=4096)
def plan(pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict",
         has_bias: bool = False, aligned: bool = True, sm_count: int = ASSUMED.sm_count) -> PassPlan:
    """What ``variant`` launches for ``pass_`` of this layer."""
    return family(variant.family).plan(pass_, variant, g, dtype, layout, precision, has_bias, aligned, sm_count)


def all_plans(g: Geometry, dtype: str, has_bias: bool, layout: str = "nchw", precision: str = "strict",
              device: Device = ASSUMED, every_variant: bool = False,
              families_named: Optional[Sequence[str]] = None) -> List[Plan]:
    """Every kernel launch this layer may need, for compiling ahead: each pass, each eligible family's
    heuristic variant (every candidate with ``every_variant``), both pointer alignments of channels_last
    activations.  ``families_named`` limits it to those families."""
    found: Dict[Plan, None] = {}
    for pass_ in PASSES:
        fams = eligible(pass_, g, dtype, layout, device, precision)
        for fam in fams:
            if families_named is not None and fam.name not in families_named:
                continue
            if every_variant:
                variants = [v for v in candidates(pass_, g, dtype, layout, precision, device) if v.family == fam.name]
            else:
                variants = fam.variants(pass_, g, dtype, layout, precision)[:1]
            for v in variants:
                for aligned in ((True, False) if layout == "nhwc" else (True,)):
                    for p in plan(pass_, v, g, dtype, layout, precision, has_bias, aligned, device.sm_count).plans():
                        found.setdefault(p)
    return list(found)


def clear_plan_cache() -> None:
    """Forget every planned launch (the compiled kernels are the compiler's to forget)."""
    _candidates.cache_clear()
    plan.cache_clear()
    for fam in FAMILIES:
        fam.clear()
