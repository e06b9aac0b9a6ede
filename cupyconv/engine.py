"""Running the passes of a layer from raw device pointers.

Both faces (the NumPy/CuPy array API and the torch integration) allocate their outputs
with their own allocator and call in here with pointers and a
:class:`~cupyconv.plans.launch.Launcher` (device, stream, scratch allocator).  For each
pass the pass table lists the candidate variants; the tuner picks one on the
configuration's first call (a dict lookup afterwards), and its planned launches run.
Nothing here synchronises the host, except a first call that times candidates.

Once every choice a call ran is final, its launches are taped (:class:`~cupyconv.plans.launch.Tape`):
a repeated forward or backward of the configuration, with pointers of the same alignment,
replays them with its own pointers and one scratch allocation, planning nothing.

Activations are contiguous in ``layout`` ("nchw", or "nhwc" for channels_last) and the
weight is contiguous (C_in, C_out/groups, kH, kW).  ``precision`` is "strict" (fp32
accuracy for float32) or "tf32"; it only matters for float32.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, Optional, Sequence, Tuple

from .core import dtypes
from .core.geometry import Geometry
from .jit import compiler
from .plans import table
from .plans.gemm import enabled as gemm_enabled
from .plans.launch import Arena, Launcher, Replay, SourceCopies, Tape, pointer_signature
from .plans.sequences import PassPlan
from .tuning import decide
from .tuning.variants import Variant


_log = logging.getLogger("cupyconv.engine")


def _aligned(a: int, b: int, weight: int = 0) -> bool:
    """Whether the pointers a pass may read or write in 16-byte vectors are 16-byte aligned: its activations, and
    a channels_last weight (``weight``; 0 for another), which fp16 and bf16 kernels may read in place."""
    return a % 16 == 0 and b % 16 == 0 and weight % 16 == 0


# (pass, geometry, dtype, layout, precision, bias, aligned, device, tensor cores on) -> (variant, plan) of a pass
# with one candidate, or the candidates of one the tuner chooses for.  A repeated call costs one lookup here.
_prepared: Dict[tuple, tuple] = {}
_PREPARED_LIMIT = 4096


# (call, geometry, dtype, layout, precision, tensor cores on, device, pointer signature) -> Replay of a call whose
# passes' choices are final: a repeated call costs this lookup, one scratch allocation and its launches.
_replays: Dict[tuple, Replay] = {}


def clear() -> None:
    """Forget the prepared passes (after the plans or the tuner's choices were forgotten)."""
    _prepared.clear()
    _prefetched.clear()
    _replays.clear()


def _replayed(key: tuple, launcher: Launcher, pointers: Sequence[int]) -> bool:
    """Run the call's taped launches if it has a current tape."""
    if not launcher.replays:
        return False
    replay = _replays.get(key)
    if replay is None or replay.generation != decide.generation():
        return False
    replay.run(launcher, pointers)
    return True


def _tape(key: tuple, launcher: Launcher, pointers: Sequence[int], passes) -> None:
    """After a call ran its passes, tape them (``passes(tape, stand_in_pointers)``) for the next call, if every
    choice they ran is final."""
    if not launcher.replays:
        return
    generation = decide.generation()
    tape = Tape(launcher.device, pointers)
    try:
        passes(tape, tape.stand_ins)
    except Exception as exc:  # the call itself has run: a tape that cannot be made only costs the next call a plan
        _log.debug("cupyconv: not taped: %s", exc)
        return
    if tape.final:
        if len(_replays) >= _PREPARED_LIMIT:
            _replays.clear()
        _replays[key] = tape.replay(generation)


def _pass_plan(pass_: str, g: Geometry, dtype: str, layout: str, precision: str, has_bias: bool, aligned: bool,
               launcher: Launcher, pointers: Sequence[int],
               tensor_cores: Optional[bool] = None) -> Tuple[Variant, PassPlan]:
    """The variant that runs this pass of the configuration and its launches (a first call may time the
    candidates on ``launcher`` to choose it)."""
    device = launcher.device
    # The switch is read once per call of the engine (the backward hands it to its passes).
    key = (pass_, g, dtype, layout, precision, has_bias, aligned, device,
           gemm_enabled() if tensor_cores is None else tensor_cores)
    prepared = _prepared.get(key)
    if prepared is None:
        cands = table.candidates(pass_, g, dtype, layout, precision, device)
        if len(cands) == 1:
            prepared = (cands[0], table.plan(pass_, cands[0], g, dtype, layout, precision, has_bias, aligned,
                                             device.sm_count))
            specs = [p.spec for p in prepared[1].plans()]
            if launcher.timing and len(specs) > 1:
                # A pass of several kernels (split-K, packed GEMMs) builds them side by side.
                compiler.compile_many(specs, device.index)
        else:
            prepared = (None, cands)
        if len(_prepared) >= _PREPARED_LIMIT:
            _prepared.clear()
        _prepared[key] = prepared
    variant, found = prepared
    if variant is not None:
        return variant, found
    variant = decide.chosen(pass_, g, dtype, layout, precision, device.index)
    if variant is None:
        if isinstance(launcher, Tape):
            launcher.final = False  # the tuner has not chosen yet: what runs now may change
        def plan(v):
            return table.plan(pass_, v, g, dtype, layout, precision, has_bias, aligned, device.sm_count)

        def run(v):
            # Each candidate is timed with every launch it makes on its own, channels_last copies included.
            shared, launcher.copies = launcher.copies, None
            try:
                plan(v).run(launcher, pointers)
            finally:
                launcher.copies = shared

        variant = decide.choose(pass_, g, dtype, layout, precision, device, launcher.stream_ptr, found, run,
                                lambda v: plan(v).plans(), timing=launcher.timing)
    return variant, table.plan(pass_, variant, g, dtype, layout, precision, has_bias, aligned, device.sm_count)


def _run(pass_: str, chosen: Tuple[Variant, PassPlan], pointers: Sequence[int], launcher: Launcher) -> None:
    launcher.enter(pass_, chosen[0])
    chosen[1].run(launcher, pointers)


def forward(g: Geometry, dtype: str, x: int, weight: int, bias: Optional[int], out: int, launcher: Launcher,
            layout: str = "nchw", precision: str = "strict", backward_mask: Optional[Sequence[bool]] = None,
            grad_weight_channels_last: Optional[bool] = None) -> None:
    """out = conv_transpose2d(x, weight, bias).

    The first call of a configuration may time the candidates on the launcher's stream,
    writing each into ``out`` before the winner.  ``backward_mask`` (grad_input,
    grad_weight, grad_bias) says which gradients a backward will likely ask for: their
    kernels start compiling in the background on a configuration's first forward
    (grad_weight's in the layout :func:`backward` is to write it in).
    """
    if g.batch == 0:
        launcher.enter(table.FORWARD, None)
        return
    pointers = (x, weight, bias or 0, out)
    if backward_mask is not None and launcher.timing:
        _prefetch_backward(g, dtype, layout, precision, launcher.device, tuple(backward_mask),
                           grad_weight_channels_last)
    tensor_cores = gemm_enabled()
    key = (table.FORWARD, g, dtype, layout, precision, tensor_cores, launcher.device_id, pointer_signature(pointers))
    if _replayed(key, launcher, pointers):
        return

    def passes(launcher, pointers):
        x, weight, _, out = pointers
        _run(table.FORWARD, _pass_plan(table.FORWARD, g, dtype, layout, precision, bias is not None,
                                       _aligned(x, out, weight if g.weight_channels_last else 0),
                                       launcher, pointers, tensor_cores), pointers, launcher)
    passes(launcher, pointers)
    _tape(key, launcher, pointers, passes)


# (geometry, dtype, layout, precision, device, mask) whose backward kernels were handed to the compiler
_prefetched: set = set()


def _prefetch_backward(g: Geometry, dtype: str, layout: str, precision: str, device, mask: tuple,
                       grad_weight_channels_last: Optional[bool] = None) -> None:
    key = (g, dtype, layout, precision, device.index, mask, grad_weight_channels_last)
    if key in _prefetched:
        return
    if len(_prefetched) >= _PREPARED_LIMIT:
        _prefetched.clear()
    _prefetched.add(key)
    specs = []
    for pass_, wanted in zip((table.GRAD_INPUT, table.GRAD_WEIGHT, table.GRAD_BIAS), mask):
        if not wanted:
            continue
        pass_precision = "strict" if pass_ == table.GRAD_BIAS else precision
        pass_g = g
        if pass_ == table.GRAD_WEIGHT and grad_weight_channels_last is not None:
            pass_g = g.with_weight_channels_last(grad_weight_channels_last)
        cands = table.candidates(pass_, pass_g, dtype, layout, pass_precision, device)
        # What the backward's first call will run: a stored choice, else the heuristic (the tuner
        # builds the other candidates itself, in the background).
        v = decide.current(pass_, pass_g, dtype, layout, pass_precision, device, cands)
        plan = table.plan(pass_, v, pass_g, dtype, layout, pass_precision, False, True, device.sm_count)
        specs += [p.spec for p in plan.plans()]
    compiler.compile_in_background(specs, device.index)


def _grad_input_pass(g, dtype, grad_out, weight, out, launcher, layout, precision, tensor_cores):
    pointers = (grad_out, weight, out)
    return table.GRAD_INPUT, _pass_plan(table.GRAD_INPUT, g, dtype, layout, precision, False,
                                        _aligned(grad_out, out, weight if g.weight_channels_last else 0),
                                        launcher, pointers, tensor_cores), pointers


def _grad_weight_pass(g, dtype, x, grad_out, out, launcher, layout, precision, tensor_cores):
    pointers = (x, grad_out, out)
    return table.GRAD_WEIGHT, _pass_plan(table.GRAD_WEIGHT, g, dtype, layout, precision, False, _aligned(x, grad_out),
                                         launcher, pointers, tensor_cores), pointers


def _grad_bias_pass(g, dtype, grad_out, out, launcher, layout, tensor_cores):
    pointers = (grad_out, out)
    # grad_bias reads grad_output in 16-byte runs where it is aligned; it writes one value a channel.
    return table.GRAD_BIAS, _pass_plan(table.GRAD_BIAS, g, dtype, layout, "strict", False, grad_out % 16 == 0,
                                       launcher, pointers, tensor_cores), pointers


def grad_input(g: Geometry, dtype: str, grad_out: int, weight: int, out: int, launcher: Launcher,
               layout: str = "nchw", precision: str = "strict", tensor_cores: Optional[bool] = None) -> None:
    """out = grad_input (a strided conv2d of grad_output)."""
    if g.batch == 0:
        launcher.enter(table.GRAD_INPUT, None)
        return
    _run(*_grad_input_pass(g, dtype, grad_out, weight, out, launcher, layout, precision, tensor_cores), launcher)


def grad_weight(g: Geometry, dtype: str, x: int, grad_out: int, out: int, launcher: Launcher,
                layout: str = "nchw", precision: str = "strict", tensor_cores: Optional[bool] = None) -> None:
    """out = grad_weight, in the weight's dtype, reduced in a fixed order."""
    if g.batch == 0:
        launcher.enter(table.GRAD_WEIGHT, None)
        launcher.zero(out, math.prod(g.weight_shape) * dtypes.get(dtype).itemsize)
        return
    _run(*_grad_weight_pass(g, dtype, x, grad_out, out, launcher, layout, precision, tensor_cores), launcher)


def grad_bias(g: Geometry, dtype: str, grad_out: int, out: int, launcher: Launcher, layout: str = "nchw",
              tensor_cores: Optional[bool] = None) -> None:
    """out = grad_output.sum((0, 2, 3)), reduced in a fixed order."""
    if g.batch == 0:
        launcher.enter(table.GRAD_BIAS, None)
        launcher.zero(out, g.out_channels * dtypes.get(dtype).itemsize)
        return
    _run(*_grad_bias_pass(g, dtype, grad_out, out, launcher, layout, tensor_cores), launcher)


def backward(g: Geometry, dtype: str, grad_out: int, x: int, weight: int, grad_input_out: Optional[int],
             grad_weight_out: Optional[int], grad_bias_out: Optional[int], launcher: Launcher,
             layout: str = "nchw", precision: str = "strict",
             grad_weight_channels_last: Optional[bool] = None) -> None:
    """Each gradient whose output pointer is given, in the order grad_input, grad_weight, grad_bias.

    When grad_input and grad_weight both read an NCHW grad_output through a channels_last
    copy, they share one.  The passes' scratch comes from one allocation.  grad_weight is
    written in the weight's memory layout, or channels_last or not as ``grad_weight_channels_last``
    says (torch's format for it follows the input's, not the weight's).
    """
    tensor_cores = gemm_enabled()
    g_weight = g if grad_weight_channels_last is None else g.with_weight_channels_last(grad_weight_channels_last)
    if g.batch == 0:
        if grad_input_out is not None:
            grad_input(g, dtype, grad_out, weight, grad_input_out, launcher, layout, precision, tensor_cores)
        if grad_weight_out is not None:
            grad_weight(g_weight, dtype, x, grad_out, grad_weight_out, launcher, layout, precision, tensor_cores)
        if grad_bias_out is not None:
            grad_bias(g, dtype, grad_out, grad_bias_out, launcher, layout, tensor_cores)
        return
    pointers = (grad_out, x, weight, grad_input_out or 0, grad_weight_out or 0, grad_bias_out or 0)
    key = ("backward", g, dtype, layout, precision, tensor_cores, launcher.device_id,
           pointer_signature(pointers), grad_input_out is not None, grad_weight_out is not None,
           grad_bias_out is not None, g_weight.weight_channels_last)
    if _replayed(key, launcher, pointers):
        return
    both = grad_input_out is not None and grad_weight_out is not None

    def passes(launcher, pointers):
        grad_out, x, weight, gi, gw, gb = pointers
        launcher.copies = SourceCopies() if both and layout == "nchw" else None
        alloc = launcher.alloc
        try:
            # Chosen first (a first call may time candidates, with scratch of their own), then run.
            runs = []
            if grad_input_out is not None:
                runs.append(_grad_input_pass(g, dtype, grad_out, weight, gi, launcher, layout, precision,
                                             tensor_cores))
            if grad_weight_out is not None:
                runs.append(_grad_weight_pass(g_weight, dtype, x, grad_out, gw, launcher, layout, precision,
                                              tensor_cores))
            if grad_bias_out is not None:
                runs.append(_grad_bias_pass(g, dtype, grad_out, gb, launcher, layout, tensor_cores))
            scratch = sum(chosen[1].scratch_bound for _, chosen, _ in runs)
            if scratch:
                launcher.alloc = Arena(alloc, scratch).alloc
            for run in runs:
                _run(*run, launcher)
        finally:
            launcher.copies = None
            launcher.alloc = alloc
    passes(launcher, pointers)
    _tape(key, launcher, pointers, passes)
