"""Float64 NumPy reference for 2-D transposed convolution (PyTorch's ConvTranspose2d).

This module is the test oracle for the CUDA kernels and the CPU backend. It is
written in the *scatter* form (each input pixel spreads through the kernel
taps into the output), deliberately unlike the gather form a GPU kernel would
use, so that a shared misunderstanding of the index arithmetic is unlikely to
hide in both. Everything is computed in float64, whatever the input dtype.

Layouts follow PyTorch: x is (N, C_in, H, W), weight is (C_in, C_out // groups,
kH, kW), bias is (C_out,) or None. The kernel is not flipped.
"""

import contextlib

import numpy as np

from .core.geometry import output_size

__all__ = ["conv_transpose2d", "conv_transpose2d_backward", "output_size"]


def _output_length(in_size, kernel, stride, padding, output_padding, dilation):
    # Written out here rather than taken from the core, so that the oracle does not share the
    # implementation's rule; unchecked, because an empty batch may have zero-size images.
    return ((in_size - 1) * stride - 2 * padding + dilation * (kernel - 1)
            + output_padding + 1)


def _geometry(in_hw, k_hw, stride, padding, output_padding, dilation):
    out_hw = tuple(_output_length(in_hw[i], k_hw[i], stride[i], padding[i],
                                   output_padding[i], dilation[i]) for i in range(2))
    # The buffer must hold every tap's landing row, and also the cropped window,
    # which extends past the last landing row when output_padding > padding.
    full_hw = tuple(max((in_hw[i] - 1) * stride[i] + dilation[i] * (k_hw[i] - 1) + 1,
                        padding[i] + out_hw[i]) for i in range(2))
    return out_hw, full_hw


def _tap_slices(kh, kw, in_hw, stride, dilation):
    """Buffer positions that input pixels (all ih, iw) reach through tap (kh, kw)."""
    r0, c0 = kh * dilation[0], kw * dilation[1]
    return (slice(r0, r0 + (in_hw[0] - 1) * stride[0] + 1, stride[0]),
            slice(c0, c0 + (in_hw[1] - 1) * stride[1] + 1, stride[1]))


def _nonfinite_inputs_allowed(*arrays):
    """Silence "invalid value" where an input holds Inf or NaN, and only there.

    An Inf weight meeting inputs of both signs sums to inf - inf = NaN; that NaN is the
    right answer (torch and the kernels give it without a word), not a fault of ours.
    With finite inputs no such value can arise, so there the warning stays live: it would
    point at a real bug, such as a buffer read before it was written.
    """
    if all(a is None or np.isfinite(a).all() for a in arrays):
        return contextlib.nullcontext()
    return np.errstate(invalid="ignore")


def _grouped(x, weight, groups):
    """x -> (N, G, Cg_in, H*W) and weight -> (G, Cg_in, Cg_out, kH, kW), in float64."""
    x = np.asarray(x, dtype=np.float64)
    weight = np.asarray(weight, dtype=np.float64)
    n, c_in, h, w = x.shape
    # Batch-major throughout, so the final crop is a plain slice rather than a
    # transposing copy of the (large) output.
    xg = x.reshape(n, groups, c_in // groups, h * w)
    wg = weight.reshape(groups, c_in // groups, *weight.shape[1:])
    return x, weight, xg, wg


def conv_transpose2d(x, weight, bias, stride, padding, output_padding, groups, dilation):
    """The transposed convolution in float64, scatter form; every parameter but ``groups`` a pair.

    ``x`` is (N, C_in, H, W), ``weight`` (C_in, C_out // groups, kH, kW), ``bias`` (C_out,)
    or None.  Returns a float64 (N, C_out, H_out, W_out) array, whatever the input dtype.
    """
    x, weight, xg, wg = _grouped(x, weight, groups)
    bias = None if bias is None else np.asarray(bias, dtype=np.float64)
    with _nonfinite_inputs_allowed(x, weight, bias):
        return _forward(x, weight, bias, xg, wg, stride, padding, output_padding, groups, dilation)


def _forward(x, weight, bias, xg, wg, stride, padding, output_padding, groups, dilation):
    n, _, h, w = x.shape
    cg_out, kh_, kw_ = weight.shape[1:]
    (h_out, w_out), full_hw = _geometry((h, w), (kh_, kw_), stride, padding,
                                        output_padding, dilation)

    full = np.zeros((n, groups, cg_out) + full_hw, dtype=np.float64)
    # Reused across taps: fresh large allocations (page faults) dominate otherwise.
    contrib = np.empty((n, groups, cg_out, h * w), dtype=np.float64)
    for kh in range(kh_):
        for kw in range(kw_):
            # (G, Cg_out, Cg_in) @ (N, G, Cg_in, HW): the per-group channel contraction.
            np.matmul(wg[:, :, :, kh, kw].transpose(0, 2, 1), xg, out=contrib)
            rows, cols = _tap_slices(kh, kw, (h, w), stride, dilation)
            full[..., rows, cols] += contrib.reshape(n, groups, cg_out, h, w)

    y = full.reshape((n, groups * cg_out) + full_hw)
    y = np.ascontiguousarray(y[:, :, padding[0]:padding[0] + h_out,
                               padding[1]:padding[1] + w_out])
    if bias is not None:
        y += bias.reshape(1, -1, 1, 1)
    return y


def conv_transpose2d_backward(grad_output, x, weight, stride, padding, output_padding,
                              groups, dilation, output_mask=(True, True, True)):
    """float64 ``(grad_input, grad_weight, grad_bias)`` of :func:`conv_transpose2d`; None where ``output_mask`` is False."""
    x, weight, xg, wg = _grouped(x, weight, groups)
    grad_output = np.asarray(grad_output, dtype=np.float64)
    with _nonfinite_inputs_allowed(grad_output, x, weight):
        return _backward(grad_output, x, weight, xg, wg, stride, padding, output_padding, groups, dilation,
                         output_mask)


def _backward(grad_output, x, weight, xg, wg, stride, padding, output_padding, groups, dilation, output_mask):
    n, c_in, h, w = x.shape
    cg_out, kh_, kw_ = weight.shape[1:]
    (h_out, w_out), full_hw = _geometry((h, w), (kh_, kw_), stride, padding,
                                        output_padding, dilation)
    want_in, want_w, want_b = output_mask

    grad_in = grad_w = grad_b = None
    if want_in or want_w:
        # Undo the crop: taps that landed in the cropped-away border get zero gradient.
        full = np.zeros((n, groups, cg_out) + full_hw, dtype=np.float64)
        full[..., padding[0]:padding[0] + h_out, padding[1]:padding[1] + w_out] = (
            grad_output.reshape(n, groups, cg_out, h_out, w_out))
        gi = np.zeros_like(xg) if want_in else None
        gw = np.zeros(wg.shape, dtype=np.float64) if want_w else None
        # Scratch reused across taps: fresh large allocations (page faults) dominate otherwise.
        g_tap = np.empty((n, groups, cg_out, h * w), dtype=np.float64)
        gi_tap = np.empty_like(xg) if want_in else None
        for kh in range(kh_):
            for kw in range(kw_):
                rows, cols = _tap_slices(kh, kw, (h, w), stride, dilation)
                np.copyto(g_tap.reshape(n, groups, cg_out, h, w), full[..., rows, cols])
                if want_in:
                    # (G, Cg_in, Cg_out) @ (N, G, Cg_out, HW)
                    np.matmul(wg[:, :, :, kh, kw], g_tap, out=gi_tap)
                    gi += gi_tap
                if want_w:
                    # (N, G, Cg_in, HW) @ (N, G, HW, Cg_out), then the sum over the batch.
                    gw[:, :, :, kh, kw] = np.matmul(xg, g_tap.swapaxes(-1, -2)).sum(axis=0)
        if want_in:
            grad_in = gi.reshape(x.shape)
        if want_w:
            grad_w = gw.reshape(weight.shape)
    if want_b:
        grad_b = grad_output.sum(axis=(0, 2, 3))
    return grad_in, grad_w, grad_b
