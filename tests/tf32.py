"""TF32 rounding of float32 tensors, as the kernels' TF32 paths round their operands (for the GPU tests' floors)."""
from __future__ import annotations


def round_tf32(t):
    """``t`` rounded to TF32 (10 mantissa bits, to nearest, ties away) as cvt.rna.tf32.f32 does, in float64."""
    import torch

    bits = t.float().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).double()
