// fp32 words rounded to TF32 as cvt.rna.tf32.f32 rounds them (to nearest, ties away from zero), by bits, so
// that a kernel using it builds for any architecture: half a TF32 unit added to the magnitude, the 13 dropped
// bits cleared (a carry into the exponent rounds the largest values up to Inf); Inf and NaN keep their bits.
// The wgmma kernels read TF32 operands straight from shared memory, where the tensor cores would truncate them.
#pragma once

__device__ __forceinline__ unsigned round_tf32_bits(unsigned v) {
    return (v & 0x7f800000u) == 0x7f800000u ? v : (v + 0x1000u) & 0xffffe000u;
}
