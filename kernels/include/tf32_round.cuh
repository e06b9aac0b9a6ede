// fp32 words rounded to TF32 as cvt.rna.tf32.f32 rounds them (to nearest, ties away from zero), by bits, so
// that a kernel using it builds for any architecture: half a TF32 unit added to the magnitude, the 13 dropped
// bits cleared (a carry into the exponent rounds the largest values up to Inf); Inf and NaN keep their bits.
// The wgmma kernels read TF32 operands straight from shared memory, where the tensor cores would truncate them.
#pragma once

__device__ __forceinline__ bool tf32_non_finite(unsigned v) { return (v & 0x7f800000u) == 0x7f800000u; }

__device__ __forceinline__ unsigned round_tf32_bits(unsigned v) {
    return tf32_non_finite(v) ? v : (v + 0x1000u) & 0xffffe000u;
}

// An fp32 word as two TF32 words whose sum it is to about 2^-22 of its magnitude, for 3xTF32 products that read
// both parts from shared memory (big x big + big x small + small x big).  The big part is rounded to nearest, or
// truncated where rounding would overflow to Inf.  A non-finite value is carried by the small part alone, with a
// zero big part: each cross term then multiplies it by the other operand's big part, which is zero only for an
// operand of zero (Inf x 0 is NaN, as torch gives), where a non-finite big part would meet the other operand's
// small part, zero for every operand TF32 holds exactly, and give NaN for a finite product.  (Two non-finite
// operands meet as 0 x Inf in both cross terms: NaN, where fp32 would give Inf.)
struct Tf32Parts {
    unsigned big, small;
};

__device__ __forceinline__ Tf32Parts split_tf32_bits(unsigned v) {
    if (tf32_non_finite(v)) return {0u, v};
    unsigned big = round_tf32_bits(v);
    if (tf32_non_finite(big)) big = v & 0xffffe000u;
    return {big, round_tf32_bits(__float_as_uint(__uint_as_float(v) - __uint_as_float(big)))};
}
