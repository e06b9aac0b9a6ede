"""What one pass launches, in order: the launch sequences that every family's plans are made of.

A sequence lists its plans (to compile ahead and to show) and runs them on a
:class:`~cupyconv.plans.launch.Launcher` with the pass's pointers:

- forward: ``(x, weight, bias or 0, out)``
- grad_input: ``(grad_output, weight, out)``
- grad_weight: ``(x, grad_output, out)``
- grad_bias: ``(grad_output, out)``
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .launch import Launcher, Plan, aligned_size


class PassPlan:
    """Every launch of one pass."""

    def plans(self) -> List[Plan]:
        """Every plan this pass may launch (a shared channels_last copy too)."""
        raise NotImplementedError

    @functools.cached_property
    def scratch_bound(self) -> int:
        """At most how many bytes of scratch a run asks for, each piece rounded up as
        :func:`~cupyconv.plans.launch.carve` rounds it (a shared copy counted as its own).
        Worked out once per plan: a backward asks on every call."""
        return sum(aligned_size(p.scratch_bytes) for p in self.plans() if p.scratch_bytes)

    def run(self, launcher: Launcher, pointers: Sequence[int]) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class OneKernel(PassPlan):
    """A single kernel that reads the pass's sources and writes its output.  With a ``source_copy`` it reads a
    channels_last copy of its first source (x, or grad_output, whose copy is shared through ``launcher.copies``)."""

    main: Plan
    source_copy: Optional[Plan] = None

    def plans(self) -> List[Plan]:
        return [self.main] + ([self.source_copy] if self.source_copy is not None else [])

    def run(self, launcher: Launcher, pointers: Sequence[int]) -> None:
        copy = self.source_copy
        if copy is None:
            launcher.launch("main", self.main, pointers)
            return
        src, *rest = pointers
        if launcher.copies is None:
            keep, (src_cl,) = launcher.scratch([copy.scratch_bytes])
            launcher.launch("to_channels_last", copy, (src, src_cl))
        else:
            keep, src_cl = None, launcher.copies.get(copy, src, launcher)
        launcher.launch("main", self.main, (src_cl, *rest))
        del keep


@dataclass(frozen=True)
class SplitK(PassPlan):
    """Partial sums over fixed chunks into scratch, then their fixed-order reduction into the output.

    The order never depends on timing, so the result is bitwise reproducible.  Without a
    ``reduce`` the partial pass has a single chunk and writes the output itself (launched
    as the pass's "main" kernel).  ``sources`` are channels_last copies (of x, then of
    grad_output) that the partial pass reads instead of NCHW sources; grad_output's copy
    is shared through ``launcher.copies``.
    """

    partial: Plan
    reduce: Optional[Plan]
    sources: Optional[Tuple[Plan, Plan]] = None

    def plans(self) -> List[Plan]:
        return [p for p in (self.partial, self.reduce) if p is not None] + list(self.sources or ())

    def run(self, launcher: Launcher, pointers: Sequence[int]) -> None:
        *inputs, out = pointers
        partial_bytes = [] if self.reduce is None else [self.partial.scratch_bytes]
        copies = []
        if self.sources is not None:
            (x, grad_out), (x_plan, go_plan) = inputs, self.sources
            own_go = launcher.copies is None
            copies = [x_plan.scratch_bytes] + ([go_plan.scratch_bytes] if own_go else [])
        keep, buffers = launcher.scratch(partial_bytes + copies) if partial_bytes or copies else (None, [])
        scratch = buffers[0] if partial_bytes else out
        if self.sources is not None:
            x_cl = buffers[len(partial_bytes)]
            if own_go:
                go_cl = buffers[len(partial_bytes) + 1]
                launcher.launch("to_channels_last", go_plan, (grad_out, go_cl))
            else:
                go_cl = launcher.copies.get(go_plan, grad_out, launcher)
            launcher.launch("to_channels_last", x_plan, (x, x_cl))
            inputs = [x_cl, go_cl]
        if self.reduce is None:
            launcher.launch("main", self.partial, tuple(inputs) + (out,))
        else:
            launcher.launch("partial", self.partial, tuple(inputs) + (scratch,))
            launcher.launch("reduce", self.reduce, (scratch, out))
        del keep


@dataclass(frozen=True)
class PackedSourcesSplitK(PassPlan):
    """x and grad_output packed into scratch by one ``pack`` launch (into the operand layout the partial pass
    reads), then ``split`` on the packed copies.  ``copy_bytes``: the bytes of x's copy and of grad_output's."""

    pack: Plan
    split: SplitK
    copy_bytes: Tuple[int, int]

    @property
    def partial(self) -> Plan:
        return self.split.partial

    @property
    def reduce(self) -> Optional[Plan]:
        return self.split.reduce

    def plans(self) -> List[Plan]:
        return [self.pack] + self.split.plans()

    def run(self, launcher: Launcher, pointers: Sequence[int]) -> None:
        x, grad_out, out = pointers
        keep, (x_packed, grad_out_packed) = launcher.scratch(self.copy_bytes)
        launcher.launch("pack_sources", self.pack, (x, grad_out, x_packed, grad_out_packed))
        self.split.run(launcher, (x_packed, grad_out_packed, out))
        del keep


@dataclass(frozen=True)
class PackedGemm(PassPlan):
    """The weight repacked into the GEMM's operand layout (or, with no ``pack``, read in place), optionally the
    source copied to channels_last (shared through ``launcher.copies``), then the GEMM.  With a ``reduce`` the
    GEMM is split over K: it writes its partials into scratch (launched as the "partial" stage) and the reduce
    adds them in order, and the bias, into the destination."""

    pack: Optional[Plan]
    gemm: Plan
    to_channels_last: Optional[Plan] = None
    reduce: Optional[Plan] = None

    def plans(self) -> List[Plan]:
        return [p for p in (self.pack, self.to_channels_last, self.gemm, self.reduce) if p is not None]

    def run(self, launcher: Launcher, pointers: Sequence[int]) -> None:
        if len(pointers) == 4:
            src, weight, bias, dst = pointers
        else:
            (src, weight, dst), bias = pointers, 0
        to_cl = self.to_channels_last
        own_copy = to_cl is not None and launcher.copies is None
        keep, rest = launcher.scratch(
            ([self.pack.scratch_bytes] if self.pack is not None else [])
            + ([self.gemm.scratch_bytes] if self.reduce is not None else [])
            + ([to_cl.scratch_bytes] if own_copy else []))
        if self.pack is not None:
            packed = rest.pop(0)
            launcher.launch("pack", self.pack, (weight, packed))
        else:
            packed = weight
        partials = rest.pop(0) if self.reduce is not None else None
        if own_copy:   # the stage is the copy's kernel: to_channels_last, or round_tf32_copy for channels_last
            launcher.launch(to_cl.spec.function, to_cl, (src, rest[0]))
            src = rest[0]
        elif to_cl is not None:
            src = launcher.copies.get(to_cl, src, launcher)
        if partials is None:
            launcher.launch("main", self.gemm, (src, packed, bias, dst))
        else:
            launcher.launch("partial", self.gemm, (src, packed, bias, partials))
            launcher.launch("reduce", self.reduce, (partials, bias, dst))
        del keep
