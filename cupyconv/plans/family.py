"""What a kernel family tells the pass table: the passes it runs, when, its variants, and how to plan one."""
from __future__ import annotations

from typing import List, Tuple

from ..core.device import Device
from ..core.geometry import Geometry
from ..tuning.variants import Variant
from .sequences import PassPlan


class Family:
    """One kind of kernel (direct gathers, tensor-core GEMMs, ...) as the pass table sees it."""

    name: str = ""
    passes: Tuple[str, ...] = ()
    max_variants = 7   # candidates worth timing at most, the heuristic included

    def eligible(self, pass_: str, g: Geometry, dtype: str, layout: str, device: Device,
                 precision: str = "strict") -> bool:
        """Whether the family can run ``pass_`` of this layer on ``device`` at ``precision`` (float32's
        ``"tf32"`` or ``"strict"``)."""
        return True

    def leads(self, pass_: str, g: Geometry, dtype: str, layout: str = "nchw", precision: str = "strict") -> bool:
        """Whether its heuristic runs ahead of the families after it in the table; one that steps back for a
        layer where it is known to lose still races them."""
        return True

    def races(self, pass_: str, g: Geometry, dtype: str) -> bool:
        """Whether it is worth timing against a family ahead of it in the table that can run the layer too."""
        return True

    def variants(self, pass_: str, g: Geometry, dtype: str, layout: str, precision: str) -> List[Variant]:
        """Its ways to run the pass, the heuristic one first."""
        return [Variant(self.name)]

    def plan(self, pass_: str, variant: Variant, g: Geometry, dtype: str, layout: str, precision: str,
             has_bias: bool, aligned: bool, sm_count: int) -> PassPlan:
        """The launches of ``variant``; ``aligned``: the activation pointers are 16-byte aligned."""
        raise NotImplementedError

    def clear(self) -> None:
        """Forget planned launches (after the compiler cache was cleared)."""
