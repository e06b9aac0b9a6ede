"""vmap batching rules for the transposed convolution and its backward.

A vmapped call becomes one call on a bigger layer, never a loop over samples:

* when only activations carry the vmap dimension and no per-sample weight gradient is
  wanted, the vmap dimension folds into the batch (N) dimension;
* otherwise (per-sample weights, bias, weight or bias gradients) each sample becomes its
  own set of groups: channels ``(B, C)`` fold into ``B * C`` channels and ``groups`` into
  ``B * groups``, so sample ``b``'s channels only ever meet sample ``b``'s weights.

The rules take the call they fold into (``forward(x, w, b, params)`` and
``backward(go, x, w, params, mask)``, ``params`` being ``(stride, padding,
output_padding, groups, dilation)``), so one rule serves the registered operators and the
differentiable functions, and this module needs nothing from the rest of cupyconv.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


def _leading(t: Optional[Tensor], dim: Optional[int], batch_size: int) -> Optional[Tensor]:
    """``t`` with its vmap dimension first, or broadcast along a new first dimension."""
    if t is None:
        return None
    if dim is None:
        return t.unsqueeze(0).expand(batch_size, *t.shape)
    return t.movedim(dim, 0)


def _sample_dims(t: Tensor, dim: Optional[int]) -> int:
    """How many dimensions one sample of ``t`` has inside the vmapped function."""
    return t.dim() - (dim is not None)


def _with_groups(params: Sequence, batch_size: int) -> tuple:
    stride, padding, output_padding, groups, dilation = params
    return stride, padding, output_padding, groups * batch_size, dilation


def _fold_channels(t: Tensor) -> Tensor:
    """``(B, N, C, H, W)`` to ``(N, B * C, H, W)``."""
    b, n, c = t.shape[:3]
    return t.transpose(0, 1).reshape(n, b * c, *t.shape[3:])


def _unfold_channels(t: Tensor, batch_size: int) -> Tensor:
    """``(N, B * C, H, W)`` back to ``(B, N, C, H, W)``."""
    return t.reshape(t.shape[0], batch_size, -1, *t.shape[2:]).transpose(0, 1)


def _as_batches(ts: Sequence[Tensor]) -> Tuple[Tuple[Tensor, ...], Optional[int]]:
    """Leading-vmap-dimension activations as one batch: (B, N, ...) to (B*N, ...).

    Samples that are themselves unbatched (C, H, W) already form a (B, C, H, W) batch;
    returns the folded tensors and N (None for unbatched samples).
    """
    if ts[0].dim() == 4:
        return tuple(ts), None
    n = ts[0].shape[1]
    return tuple(t.reshape(t.shape[0] * n, *t.shape[2:]) for t in ts), n


def _split_batch(t: Tensor, n: Optional[int]) -> Tensor:
    return t if n is None else t.reshape(-1, n, *t.shape[1:])


def forward_rule(forward: Callable, batch_size: int, in_dims: Sequence[Optional[int]], x: Tensor, w: Tensor,
                 b: Optional[Tensor], params: Sequence) -> Tuple[Tensor, int]:
    """The vmap rule of ``forward(x, w, b, params)``: returns (output, output's vmap dim)."""
    x_dim, w_dim, b_dim = in_dims[:3]
    unbatched = _sample_dims(x, x_dim) == 3
    x = _leading(x, x_dim, batch_size)
    if w_dim is None and b_dim is None:
        (folded,), n = _as_batches((x,))
        return _split_batch(forward(folded, w, b, params), n), 0
    if unbatched:
        x = x.unsqueeze(1)
    w = _leading(w, w_dim, batch_size)
    b = _leading(b, b_dim, batch_size)
    y = forward(_fold_channels(x), w.reshape(-1, *w.shape[2:]), None if b is None else b.reshape(-1),
                _with_groups(params, batch_size))
    y = _unfold_channels(y, batch_size)
    return (y.squeeze(1) if unbatched else y), 0


def backward_rule(backward: Callable, batch_size: int, in_dims: Sequence[Optional[int]], go: Tensor, x: Tensor,
                  w: Tensor, params: Sequence, mask: Sequence[bool]):
    """The vmap rule of ``backward(go, x, w, params, mask)``: returns (grads, their vmap dims)."""
    go_dim, x_dim, w_dim = in_dims[:3]
    unbatched = _sample_dims(x, x_dim) == 3
    go = _leading(go, go_dim, batch_size)
    x = _leading(x, x_dim, batch_size)
    if w_dim is None and not mask[1] and not mask[2]:
        # grad_input alone, one weight for all: the samples are just more images
        (go, x), n = _as_batches((go, x))
        gi = backward(go, x, w, params, (True, False, False))[0]
        return (_split_batch(gi, n), None, None), (0, None, None)
    if unbatched:
        go, x = go.unsqueeze(1), x.unsqueeze(1)
    w = _leading(w, w_dim, batch_size)
    gi, gw, gb = backward(_fold_channels(go), _fold_channels(x), w.reshape(-1, *w.shape[2:]),
                          _with_groups(params, batch_size), tuple(mask))
    if gi is not None:
        gi = _unfold_channels(gi, batch_size)
        if unbatched:
            gi = gi.squeeze(1)
    if gw is not None:
        gw = gw.reshape(batch_size, -1, *gw.shape[1:])
    if gb is not None:
        gb = gb.reshape(batch_size, -1)
    grads = (gi, gw, gb)
    return grads, tuple(None if g is None else 0 for g in grads)
