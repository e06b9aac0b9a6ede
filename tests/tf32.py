"""TF32 rounding of float32 tensors, as the kernels' TF32 paths round their operands (for the GPU tests' floors),
and torch's TF32 switches for a block."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def tf32_allowed(allowed: bool):
    """torch's TF32 switches (cuDNN's, which picks cupyconv's float32 precision, and matmul's) set for the block."""
    import torch

    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def round_tf32(t):
    """``t`` rounded to TF32 (10 mantissa bits, to nearest, ties away) as cvt.rna.tf32.f32 does, in float64."""
    import torch

    bits = t.float().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).double()
